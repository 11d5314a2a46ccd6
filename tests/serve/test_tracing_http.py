"""Tracing over HTTP (issue 19 item 3): one ``/v1/embeddings`` call with three texts is one
HTTP server span (a child of the client's W3C ``traceparent``), three ``lumen.request`` spans
under it, each linked from the ``lumen.batch`` span it ran in.  In-memory exporter only."""
from __future__ import annotations

import httpx
import pytest
import serve_support as S

from lumen_core import tracing
from lumen_core.runtime import Runtime
from lumen_core.tasks import default_task_tables

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # the server starts (and its tasks resolve their models) inside LUMEN_HOME's block
    with S.lumen_home_env(S.prepared_home(tmp_path_factory)):
        rt = Runtime.from_dict({"tasks": default_task_tables()})
        rt.tracing = tracing.Tracing(provider)
        srv = S.ServerThread(rt, grpc=False)
    yield srv, exporter
    srv.stop()


def test_embeddings_three_texts_trace(traced):
    srv, exporter = traced
    exporter.clear()
    r = httpx.post(f"{srv.url}/v1/embeddings", timeout=60,
                   json={"model": "text_embed", "input": ["one", "two texts", "and a third one"]},
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200 and len(r.json()["data"]) == 3
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert format(server.parent.span_id, "016x") == PARENT_ID  # the client's span
    assert server.attributes["http.response.status_code"] == 200
    reqs = [s for s in spans if s.name == "lumen.request"]
    assert len(reqs) == 3
    for q in reqs:
        assert q.parent.span_id == server.context.span_id
        assert q.attributes["lumen.task"] == "text_embed"
        assert q.attributes["lumen.model_version"]
    batches = [s for s in spans if s.name == "lumen.batch"]
    linked = [link.context.span_id for b in batches for link in b.links]
    assert sorted(linked) == sorted(q.context.span_id for q in reqs)  # each in one batch
    for b in batches:
        assert b.parent is None and b.attributes["lumen.batch_size"] == len(b.links)
    by_id = {link.context.span_id: b for b in batches for link in b.links}
    for q in reqs:
        assert q.attributes["lumen.batch_size"] == by_id[q.context.span_id].attributes[
            "lumen.batch_size"]
    assert sum(b.attributes["lumen.batch_size"] for b in batches) == 3


def test_no_traceparent_makes_a_new_trace(traced):
    srv, exporter = traced
    exporter.clear()
    r = httpx.post(f"{srv.url}/v1/embeddings", timeout=60, json={"model": "text_embed", "input": "solo"})
    assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert server.parent is None
    (req,) = [s for s in spans if s.name == "lumen.request"]
    assert req.parent.span_id == server.context.span_id

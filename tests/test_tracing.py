"""OpenTelemetry tracing (issue 19 item 3, ``lumen_core/tracing.py``): request spans with queue
and compute events, batch spans linked to their requests' spans, W3C ``traceparent`` from
gRPC metadata, nothing at all when tracing is off.  Spans go to the SDK's in-memory exporter
through a provider of the test's own (the global provider is never touched, nothing exported).
"""
from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import pytest
import serve_support as S

import lumen_core as lc
from lumen_core import tracing
from lumen_core.config import parse_config
from lumen_core.runtime import Runtime
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def in_memory() -> tuple:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracing.Tracing(provider), exporter


def mlp_request(seed: int, cid: str = "") -> lc.InferRequest:
    x = S.mlp_input(seed)
    return lc.InferRequest("mlp", x.tobytes(), "application/octet-stream",
                           S.tensor_meta(x.shape), correlation_id=cid)


def by_name(spans, name: str) -> list:
    return [s for s in spans if s.name == name]


def check_linked(spans, n: int) -> tuple:
    """``n`` request spans, each linked from exactly one batch span; the batch sizes add up."""
    reqs = by_name(spans, "lumen.request")
    batches = by_name(spans, "lumen.batch")
    assert len(reqs) == n and batches
    linked: dict = {}
    for b in batches:
        assert b.attributes["lumen.batch_size"] == len(b.links) >= 1
        for link in b.links:
            linked.setdefault(link.context.span_id, []).append(b)
    for r in reqs:
        ran_in = linked.get(r.context.span_id, [])
        assert len(ran_in) == 1, "each request ran in exactly one batch"
        b = ran_in[0]
        assert r.attributes["lumen.batch_size"] == b.attributes["lumen.batch_size"]
        assert b.start_time >= r.start_time and b.end_time <= r.end_time
        ev = {e.name: e.timestamp for e in r.events}
        assert list(ev) == ["lumen.dispatched", "lumen.computed"]
        assert r.start_time <= ev["lumen.dispatched"] <= ev["lumen.computed"] <= r.end_time
        # the batch formed: queue wait over (two clock readings apart)
        assert abs(ev["lumen.dispatched"] - b.start_time) < 1_000_000
        assert r.attributes["lumen.queue_us"] >= 0
    assert sum(b.attributes["lumen.batch_size"] for b in batches) == n
    return reqs, batches


def test_off_by_default_and_switches(monkeypatch):
    monkeypatch.delenv(tracing.ENV, raising=False)
    cfg = parse_config({"server": {}})
    assert cfg.server.tracing is False and not tracing.requested(cfg)
    assert tracing.from_config(cfg) is None
    assert tracing.requested(parse_config({"server": {"tracing": True}}))
    monkeypatch.setenv(tracing.ENV, "1")
    assert tracing.requested(cfg)
    # enabled: a Tracing on the global provider, configured from OTEL_* only when unset
    monkeypatch.setattr(tracing, "_configure_sdk", lambda: None)
    assert isinstance(tracing.from_config(cfg), tracing.Tracing)


def test_disabled_runtime_makes_no_spans(tmp_path, monkeypatch):
    monkeypatch.delenv(tracing.ENV, raising=False)
    rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))
    assert rt.tracing is None

    async def main():
        async with rt:
            assert all(t.batcher.queue.trace is None for t in rt.tasks.values())
            resp = await rt.infer(mlp_request(0))
            assert resp.stats.batch_size == 1
            await rt.infer_many([mlp_request(i) for i in range(3)])

    asyncio.run(main())


def test_runtime_request_and_batch_spans(tmp_path):
    rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))
    rt.tracing, exporter = in_memory()

    async def main():
        async with rt:
            exporter.clear()  # the warm-up's
            one = await rt.infer(mlp_request(0, "one"))
            assert one.stats.batch_size == 1
            spans = exporter.get_finished_spans()
            (req,), _ = check_linked(spans, 1)
            assert req.parent is None  # no transport here: a root span
            assert req.attributes["lumen.task"] == "mlp"
            assert req.attributes["lumen.route"] == "tensor"
            assert req.attributes["lumen.model_version"] == "1"
            exporter.clear()
            many = await rt.infer_many([mlp_request(i) for i in range(5)])
            assert all(isinstance(r, lc.InferResponse) for r in many)
            check_linked(exporter.get_finished_spans(), 5)
            exporter.clear()
            # an error after admission is recorded on its request span
            bad = lc.InferRequest("mlp", np.zeros((1, S.D_IN + 1), np.float32).tobytes(),
                                  "application/octet-stream", S.tensor_meta((1, S.D_IN + 1)))
            with pytest.raises(lc.LumenError):
                await rt.infer(bad)

    asyncio.run(main())


def test_cancelled_request_span(tmp_path):
    """A caller that gives up while queued: its request span ends, marked cancelled."""
    rt = Runtime.from_dict(S.onnx_config(tmp_path))
    rt.tracing, exporter = in_memory()

    async def main():
        async with rt:
            exporter.clear()
            x = S.mlp_input(0)
            req = lc.InferRequest("slow", x.tobytes(), "application/octet-stream",
                                  S.tensor_meta(x.shape))
            t = asyncio.ensure_future(rt.infer(req))
            await asyncio.sleep(0.05)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            await asyncio.sleep(0)
            (span,) = by_name(exporter.get_finished_spans(), "lumen.request")
            assert span.attributes["lumen.error.code"] == "cancelled"
            assert not span.status.is_ok

    asyncio.run(main())


def test_request_spans_are_the_tracers_own_and_leave_its_map_when_answered(tmp_path):
    """The request spans live in the tracer's map (``Tracing.spans``), not on the entry: open
    from admission to the answer, so the map is empty once every caller was answered,
    cancelled or refused."""
    rt = Runtime.from_dict(S.onnx_config(tmp_path))
    rt.tracing, exporter = in_memory()

    async def main():
        async with rt:
            await rt.infer(mlp_request(0))
            await rt.infer_many([mlp_request(i) for i in range(3)])
            x = S.mlp_input(0)
            t = asyncio.ensure_future(rt.infer(lc.InferRequest(
                "slow", x.tobytes(), "application/octet-stream", S.tensor_meta(x.shape))))
            await asyncio.sleep(0.05)
            assert len(rt.tracing.spans) == 1  # the slow one, still open
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            await asyncio.sleep(0)
            assert rt.tracing.spans == {}
            assert len(by_name(exporter.get_finished_spans(), "lumen.request")) >= 5

    asyncio.run(main())


def test_grpc_traceparent_metadata(tmp_path):
    rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))
    rt.tracing, exporter = in_memory()
    srv = S.ServerThread(rt)
    try:
        exporter.clear()
        x = S.mlp_input(1)
        msg = pb.InferRequest(task="mlp", payload=x.tobytes(),
                              payload_mime="application/octet-stream", correlation_id="g1",
                              meta=S.tensor_meta(x.shape))
        with grpc.insecure_channel(srv.grpc_target) as channel:
            resp = pb_grpc.InferenceStub(channel).Infer(
                msg, metadata=(("traceparent", TRACEPARENT),))
        assert resp.correlation_id == "g1"
        spans = exporter.get_finished_spans()
        (server,) = by_name(spans, "lumen.v1.Inference/Infer")
        assert format(server.context.trace_id, "032x") == TRACE_ID
        assert format(server.parent.span_id, "016x") == PARENT_ID
        (req,), _ = check_linked(spans, 1)
        assert req.parent.span_id == server.context.span_id
        assert req.context.trace_id == server.context.trace_id
    finally:
        srv.stop()


def test_oip_grpc_traceparent_metadata(tmp_path):
    """OIP's ModelInfer and ModelStreamInfer open the same transport span as lumen.v1's."""
    from lumen_core.serve.proto import open_inference_grpc_pb2 as oip_pb

    rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))
    rt.tracing, exporter = in_memory()
    srv = S.ServerThread(rt)
    try:
        exporter.clear()
        x = S.mlp_input(2)
        req = oip_pb.ModelInferRequest(model_name="mlp", id="o1")
        inp = req.inputs.add()
        inp.name, inp.datatype = "x", "FP32"
        inp.shape.extend(x.shape)
        req.raw_input_contents.append(x.tobytes())
        md = (("traceparent", TRACEPARENT),)
        with grpc.insecure_channel(srv.grpc_target) as channel:
            unary = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=oip_pb.ModelInferRequest.SerializeToString,
                response_deserializer=oip_pb.ModelInferResponse.FromString)
            assert unary(req, metadata=md).id == "o1"
            stream = channel.stream_stream(
                "/inference.GRPCInferenceService/ModelStreamInfer",
                request_serializer=oip_pb.ModelInferRequest.SerializeToString,
                response_deserializer=oip_pb.ModelStreamInferResponse.FromString)
            replies = list(stream(iter([req, req]), metadata=md))
        assert [r.infer_response.id for r in replies] == ["o1", "o1"]
        assert not any(r.error_message for r in replies)
        spans = exporter.get_finished_spans()
        servers = (by_name(spans, "inference.GRPCInferenceService/ModelInfer")
                   + by_name(spans, "inference.GRPCInferenceService/ModelStreamInfer"))
        assert len(servers) == 3
        for s in servers:
            assert format(s.context.trace_id, "032x") == TRACE_ID
            assert format(s.parent.span_id, "016x") == PARENT_ID
            assert s.attributes["rpc.system"] == "grpc"
        reqs, _ = check_linked(spans, 3)
        assert {r.parent.span_id for r in reqs} == {s.context.span_id for s in servers}
    finally:
        srv.stop()


def test_oversized_trace_context_is_logged_rate_limited(caplog):
    """Issue 38 row 9: a traceparent over 512 characters used to write OpenTelemetry's WARNING
    for every request (a client could fill the log).  Now it is ignored (a new trace), counted,
    and logged at most once per OVERSIZE_LOG_EVERY_S with the count not logged since."""
    from opentelemetry import trace

    tr, _ = in_memory()
    clock = [1000.0]
    tr._clock = lambda: clock[0]
    long_parent = TRACEPARENT + "-" + "a" * 600
    caplog.set_level(logging.DEBUG)
    for _ in range(100):
        ctx = tr.extract({"traceparent": long_parent})
        assert not trace.get_current_span(ctx).get_span_context().is_valid
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].name == "lumen.tracing" and "traceparent" in warnings[0].getMessage()
    assert tr.dropped_context == 100
    clock[0] += tracing.OVERSIZE_LOG_EVERY_S
    caplog.clear()
    tr.extract({"traceparent": long_parent})
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "99 more" in line
    # an oversized tracestate is dropped, the (valid) parent kept, once more without a line
    caplog.clear()
    ctx = tr.extract({"traceparent": TRACEPARENT, "tracestate": "k=" + "v" * 600})
    sc = trace.get_current_span(ctx).get_span_context()
    assert sc.is_valid and format(sc.trace_id, "032x") == TRACE_ID and not sc.trace_state
    assert tr.dropped_context == 102
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # a well-formed context is untouched
    ctx = tr.extract({"traceparent": TRACEPARENT, "tracestate": "k=v"})
    assert trace.get_current_span(ctx).get_span_context().trace_state.get("k") == "v"

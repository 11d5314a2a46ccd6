"""Prometheus metrics: the observer's series (exact values on a fake runtime) and a live server's
/metrics, parsed with ``prometheus_client.parser`` so the exposition must be valid."""
from __future__ import annotations

import types

import grpc
import httpx
import numpy as np
import pytest
import serve_support as S
from prometheus_client.parser import text_string_to_metric_families

from lumen_core.serve.metrics import PrometheusObserver
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc


def _fake_runtime(active: bool) -> types.SimpleNamespace:
    """What the collector reads: ``ready`` and the ``load()`` query of the Runtime."""
    load = {"pending": 3, "in_flight": 1, "padding_ratio": 0.25}
    if active:
        load.update(active_sequences=5, backlog=0)
    return types.SimpleNamespace(ready=True, load=lambda: {"t": load})


def _samples(observer: PrometheusObserver) -> dict:
    out = {}
    for fam in text_string_to_metric_families(observer.exposition().decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


@pytest.mark.parametrize("active", [True, False])
def test_observer_series(active):
    obs = PrometheusObserver(_fake_runtime(active))
    obs.request("t", "raw", "ok", 2500, queue_us=1000, compute_us=1200)
    obs.request("t", "raw", "ok", 40_000, queue_us=30_000, compute_us=9000)
    obs.request("t", "tensor", "invalid_argument", 100)
    obs.batch("t", 7, 1200)
    obs.batch("t", 32, 9000)
    obs.transport_request("http", "/v1/embeddings", "200")
    s = _samples(obs)
    m = S.metric
    assert m(s, "lumen_requests_total", task="t", route="raw", code="ok") == 2
    assert m(s, "lumen_requests_total", task="t", route="tensor", code="invalid_argument") == 1
    # queue / compute only for successes; end-to-end for every outcome
    assert m(s, "lumen_queue_seconds_count", task="t") == 2
    assert m(s, "lumen_queue_seconds_sum", task="t") == pytest.approx(0.031)
    assert m(s, "lumen_queue_seconds_bucket", task="t", le="0.001") == 1
    assert m(s, "lumen_compute_seconds_count", task="t") == 2
    assert m(s, "lumen_request_seconds_count", task="t") == 3
    assert m(s, "lumen_batch_size_count", task="t") == 2
    assert m(s, "lumen_batch_size_sum", task="t") == 39
    assert m(s, "lumen_batch_size_bucket", task="t", le="8.0") == 1
    assert m(s, "lumen_transport_requests_total", transport="http", endpoint="/v1/embeddings",
             status="200") == 1
    assert m(s, "lumen_pending_requests", task="t") == 3
    assert m(s, "lumen_inflight_batches", task="t") == 1
    assert m(s, "lumen_padding_ratio", task="t") == 0.25
    assert m(s, "lumen_ready") == 1
    assert (("lumen_active_sequences", frozenset({("task", "t")})) in s) is active


def test_ensemble_step_queue_series():
    """Per-step queue time of an ensemble (``load()["steps"]``, batching/pipeline.py) as
    counters: summed seconds and the requests they cover, per task and step."""
    steps = {"det": {"batches": 4, "items": 9, "requests": 9, "queue_us": 1_500_000,
                     "compute_us": 800_000, "max_batch_size": 3, "mean_batch_size": 2.25},
             "rec": {"batches": 2, "items": 40, "requests": 8, "queue_us": 250_000,
                     "compute_us": 90_000, "max_batch_size": 24, "mean_batch_size": 20.0}}
    load = {"pending": 0, "in_flight": 0, "padding_ratio": 0.0, "steps": steps}
    rt = types.SimpleNamespace(ready=True, load=lambda: {"ocr": load, "t": dict(load, steps={})})
    s = _samples(PrometheusObserver(rt))
    m = S.metric
    assert m(s, "lumen_step_queue_seconds_total", task="ocr", step="det") == pytest.approx(1.5)
    assert m(s, "lumen_step_queue_seconds_total", task="ocr", step="rec") == pytest.approx(0.25)
    assert m(s, "lumen_step_requests_total", task="ocr", step="det") == 9
    assert m(s, "lumen_step_requests_total", task="ocr", step="rec") == 8
    assert not any(name.startswith("lumen_step_") and dict(labels).get("task") == "t"
                   for name, labels in s)  # a plain task has no step series


def test_learnt_cost_and_latency_target_gauges():
    """The cost model of ``load()["cost"]`` (batching/cost.py) as gauges, in seconds."""
    cost = {"batch_fixed_us": 2000.0, "batch_item_us": 300.0, "per_token_us": 5.0,
            "latency_target_ms": 500, "loop_execution": True}
    load = {"pending": 0, "in_flight": 0, "padding_ratio": 0.0, "cost": cost}
    rt = types.SimpleNamespace(ready=True, load=lambda: {"t": load})
    s = _samples(PrometheusObserver(rt))
    m = S.metric
    assert m(s, "lumen_batch_cost_seconds", task="t", term="fixed") == pytest.approx(0.002)
    assert m(s, "lumen_batch_cost_seconds", task="t", term="item") == pytest.approx(0.0003)
    assert m(s, "lumen_batch_cost_seconds", task="t", term="token") == pytest.approx(5e-6)
    assert m(s, "lumen_latency_target_seconds", task="t") == pytest.approx(0.5)
    assert m(s, "lumen_loop_execution", task="t") == 1.0  # its batches run on the loop


def test_each_observer_has_its_own_registry():
    a, b = PrometheusObserver(_fake_runtime(False)), PrometheusObserver(_fake_runtime(False))
    a.request("t", "raw", "ok", 10)
    assert S.metric(_samples(a), "lumen_requests_total", task="t", route="raw", code="ok") == 1
    assert S.metric(_samples(b), "lumen_requests_total", task="t", route="raw", code="ok") == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    srv = S.default_server(home, S.onnx_config(tmp_path_factory.mktemp("m"), slow=False)["tasks"])
    yield srv
    srv.stop()


def test_live_server_metrics(server):
    """Requests over HTTP and gRPC show up per task, route and code; warm-up requests do not;
    an open VAD stream is an active sequence."""
    s0 = S.scrape(server.url)
    assert S.metric(s0, "lumen_requests_total", task="mlp", route="tensor", code="ok") == 0
    x = S.mlp_input()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for _ in range(3):
            assert c.post("/v1/infer/mlp", content=x.tobytes(),
                          params=S.tensor_meta(x.shape)).status_code == 200
        assert c.post("/v1/infer/mlp", content=x.tobytes()[:-4],
                      params=S.tensor_meta(x.shape)).status_code == 400
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        chunk = np.zeros(512, "<f4").tobytes()
        stub.Infer(pb.InferRequest(task="vad", payload=chunk,
                                   payload_mime="audio/pcm;format=f32le;rate=16000",
                                   meta={"lumen.sequence.id": "open-stream",
                                         "lumen.sequence.start": "true"}))
    s = S.scrape(server.url)
    m = S.metric
    assert m(s, "lumen_requests_total", task="mlp", route="tensor", code="ok") == 3
    # a request refused while its meta is parsed has no route yet; count it under any route
    assert sum(m(s, "lumen_requests_total", task="mlp", route=r, code="invalid_argument")
               for r in ("raw", "tensor")) == 1
    assert m(s, "lumen_requests_total", task="vad", route="raw", code="ok") == 1
    assert m(s, "lumen_request_seconds_count", task="mlp") == 4
    assert m(s, "lumen_batch_size_count", task="mlp") == 3
    assert m(s, "lumen_transport_requests_total", transport="http", endpoint="/v1/infer/{task}",
             status="400") == 1
    assert m(s, "lumen_transport_requests_total", transport="grpc", endpoint="Infer",
             status="OK") == 1
    assert m(s, "lumen_active_sequences", task="vad") == 1
    for task in server.runtime.tasks:
        assert ("lumen_padding_ratio", frozenset({("task", task)})) in s
        assert m(s, "lumen_pending_requests", task=task) == 0

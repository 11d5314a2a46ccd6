"""HTTP API: the infer route (JSON and raw tensor replies), introspection routes, every error
status of the SPEC table, disconnect cancellation and graceful shutdown, on small generated
ONNX models; /v1/embeddings (also through the ``openai`` client) on the prepared MiniLM."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import numpy as np
import onnx_models as M
import openai
import pytest
import serve_support as S

from lumen_core import native
from lumen_core.contract import DTYPES
from lumen_core.request import InferResponse
from lumen_core.runtime import Runtime
from lumen_core.serve import codec
from lumen_core.serve.http import HttpApp


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    srv = S.ServerThread(Runtime.from_dict(S.onnx_config(tmp)), grpc=False)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def post_tensor(client: httpx.Client, task: str, x: np.ndarray, **kw) -> httpx.Response:
    params = S.tensor_meta(x.shape)
    params.update(kw.pop("params", {}))
    return client.post(f"/v1/infer/{task}", content=x.tobytes(), params=params,
                       headers={"Content-Type": "application/octet-stream", **kw.pop("headers", {})},
                       **kw)


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field"}
    return body["error"]


# -- the infer route ------------------------------------------------------------------------
def test_infer_json_reply(client):
    x = S.mlp_input(1)
    r = post_tensor(client, "mlp", x, headers={"X-Correlation-Id": "req-42"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["correlation_id"] == "req-42" and r.headers["x-correlation-id"] == "req-42"
    assert body["task"] == "mlp"
    out = body["outputs"]["y"]
    assert out["dtype"] == "fp32" and out["shape"] == [S.D_OUT]
    np.testing.assert_allclose(out["data"], M.mlp_reference(x, d_out=S.D_OUT)[0], rtol=1e-5, atol=1e-5)
    assert int(body["meta"]["lumen.batch.size"]) >= 1
    assert "lumen.queue_us" in body["meta"] and "lumen.compute_us" in body["meta"]


def test_infer_raw_tensor_reply(client):
    x = S.mlp_input(2)
    r = post_tensor(client, "mlp", x, headers={"Accept": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["lumen-tensor-dtype"] == "fp32"
    assert json.loads(r.headers["lumen-tensor-shape"]) == [S.D_OUT]
    got = np.frombuffer(r.content, dtype="<f4")
    np.testing.assert_allclose(got, M.mlp_reference(x, d_out=S.D_OUT)[0], rtol=1e-5, atol=1e-5)


def test_concurrent_requests_batch_and_each_get_their_own_result(server):
    xs = [S.mlp_input(100 + i) for i in range(24)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            return await asyncio.gather(*(c.post("/v1/infer/mlp", content=x.tobytes(),
                                                 params=S.tensor_meta(x.shape)) for x in xs))

    for x, r in zip(xs, asyncio.run(run()), strict=True):
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"]["y"]["data"],
                                   M.mlp_reference(x, d_out=S.D_OUT)[0], rtol=1e-5, atol=1e-5)


def test_introspection_routes(server, client):
    import lumen_core

    health = client.get("/healthz").json()
    ext = server.runtime.extensions()
    assert health == {"status": "ok", "version": lumen_core.__version__,
                      "compiled_extensions": all(ext.values()), "extensions": ext}
    assert health["extensions"] and all(isinstance(v, bool) for v in health["extensions"].values())
    if native.NO_EXTENSIONS:
        assert not any(health["extensions"].values()) and not health["compiled_extensions"]
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["tasks"] == ["mlp", "nan", "slow"]
    tasks = client.get("/v1/tasks").json()["tasks"]
    sig = tasks["mlp"]["tensor_signatures"][0]
    assert sig == {"dtype": "fp32", "layout": "NC", "shape": [1, S.D_IN], "preprocess_ids": ["none"]}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["mlp", "nan", "slow"]
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")


def test_asgi_app_in_process(tmp_path):
    """The app is plain ASGI: it runs under httpx's ASGI transport with no socket at all."""
    rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))

    async def run():
        async with rt:
            app = HttpApp(rt)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://lumen") as c:
                x = S.mlp_input(3)
                ok = await c.post("/v1/infer/mlp", content=x.tobytes(), params=S.tensor_meta(x.shape))
                app.draining = True
                draining = await c.post("/v1/infer/mlp", content=x.tobytes(),
                                        params=S.tensor_meta(x.shape))
                ready = await c.get("/readyz")
        return ok, draining, ready

    ok, draining, ready = asyncio.run(run())
    assert ok.status_code == 200
    assert draining.status_code == 503 and error_of(draining)["code"] == "unavailable"
    assert ready.status_code == 503


# -- error statuses -----------------------------------------------------------------------
def test_400_names_the_meta_key_at_fault(client):
    x = S.mlp_input()
    r = post_tensor(client, "mlp", x, params={"lumen.tensor.shpe": "[1,16]"})
    assert r.status_code == 400
    err = error_of(r)
    assert err["code"] == "invalid_argument" and err["field"] == "lumen.tensor.shpe"
    r = post_tensor(client, "mlp", x, params={"lumen.tensor.shape": "[1,17]"})
    assert r.status_code == 400 and error_of(r)["field"] == "payload"


def test_404_unknown_task(client):
    r = client.post("/v1/infer/nope", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 404
    err = error_of(r)
    assert err["code"] == "not_found" and "mlp" in err["message"]


def test_413_from_content_length_before_reading(server):
    """The server answers 413 and closes while the client is still sending: it never reads
    the announced body (only the headers were sent here)."""
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as s:
        s.sendall(b"POST /v1/infer/mlp HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                  b"Content-Length: 100000000\r\n\r\n" + b"\0" * 1024)
        data = _read_reply(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "payload_too_large"


def test_413_while_streaming_a_chunked_body(client):
    def chunks():
        for _ in range(10):
            yield b"\0" * 1024  # 10 KiB, no Content-Length: counted as it arrives

    r = client.post("/v1/infer/mlp", content=chunks(), params=S.tensor_meta((1, S.D_IN)))
    assert r.status_code == 413 and error_of(r)["code"] == "payload_too_large"


def test_415_embeddings_needs_json(client):
    r = client.post("/v1/embeddings", content=b'{"model":"mlp","input":"hi"}',
                    headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"


def test_embeddings_input_errors(client):
    r = client.post("/v1/embeddings", json={"model": "mlp", "input": []})
    assert r.status_code == 400 and error_of(r)["field"] == "input"
    r = client.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and error_of(r)["field"] == "model"
    r = client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and error_of(r)["field"] == "model"
    r = client.post("/v1/embeddings", json={"model": "mlp", "input": "hi", "encoding_format": "int8"})
    assert r.status_code == 400 and error_of(r)["field"] == "encoding_format"
    r = client.post("/v1/embeddings", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error_of(r)["field"] == "body"
    # a task that takes no text says so (tensor-only generic model), naming the task
    r = client.post("/v1/embeddings", json={"model": "mlp", "input": "hi"})
    assert r.status_code == 400
    err = error_of(r)
    assert err["code"] == "invalid_argument" and "'mlp'" in err["message"]


def test_hostile_bodies_and_headers_answer_400_not_500(client):
    """Deeply nested JSON (the decoder raises RecursionError) is the caller's fault: 400,
    never a 500."""
    deep = b"[" * 3000  # under MAX_PAYLOAD, deeper than the JSON decoder's recursion limit
    r = client.post("/v1/embeddings", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error_of(r)["field"] == "body"


def test_bad_content_length_digits_in_process():
    """A Content-Length of non-ASCII digits (``str.isdigit`` accepts '\u00b2') is a 400 on the
    raw ASGI app (no HTTP parser in front of it to reject the header first)."""
    class _NoRuntime:
        class config:
            class server:
                max_payload_bytes = S.MAX_PAYLOAD
                read_timeout_ms = 1000

    app = HttpApp(_NoRuntime())

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://lumen") as c:
            return await c.post("/v1/infer/mlp", content=b"xx",
                                headers={"Content-Length": "\u00b2".encode("latin-1")})

    r = asyncio.run(run())
    assert r.status_code == 400 and error_of(r)["field"] == "Content-Length"


def test_unknown_route_and_wrong_method_answer_the_json_error_shape(client):
    """SPEC 6: all HTTP errors are ``{"error": {...}}``, also the router's own 404 / 405."""
    r = client.get("/v2/nothing-here")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    # issue 26: the route list names the WebSocket and the Open Inference Protocol too
    for route in ("/v1/stream/{task}", "/v2", "/v2/models/{task}/infer", "/v1/infer/{task}"):
        assert route in error_of(r)["message"], error_of(r)["message"]
    r = client.get("/v1/embeddings")
    # issue 26: a 405 is no bad argument; its own code, the methods in Allow
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


def test_raw_tensor_reply_of_an_empty_output():
    """A zero-size output (e.g. no detections) is sent as an empty body, not a 500."""
    from lumen_core.serve.door import tensor_head

    resp = InferResponse("cid", "t", {"boxes": np.zeros((0, 4), np.float32)}, {})
    _name, arr, head = tensor_head(resp, None)
    assert codec.tensor_view(arr).nbytes == 0
    assert dict(head)[b"lumen-tensor-shape"] == b"[0,4]"
    assert dict(head)[b"content-length"] == b"0"
    _name, arr, _head = tensor_head(InferResponse("c", "t", {"y": np.arange(3, dtype=">f4")},
                                                  {}), None)
    assert np.frombuffer(codec.tensor_view(arr), "<f4").tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_codec_speaks_the_contract_dtype_table(name):
    """One dtype table: every contract dtype round-trips through the shared encoding (names,
    little-endian bytes from either byte order, JSON, base64)."""
    want = np.arange(6).astype(DTYPES[name]).reshape(2, 3)
    for arr in (want, want.astype(want.dtype.newbyteorder(">"))):
        assert codec.dtype_name(arr) == name
        assert bytes(codec.tensor_view(arr)) == codec.tensor_bytes(arr) == want.tobytes()
        assert codec.tensor_json(arr) == {"dtype": name, "shape": [2, 3],
                                          "data": want.reshape(-1).tolist()}
        assert base64.b64decode(codec.b64_tensor(arr)) == want.tobytes()
    assert codec.shape_text(want.shape) == "[2,3]"


def test_429_with_retry_after_then_504_for_the_queued(server, client):
    """Fill the slow task's queue (2) with requests that have a 400 ms deadline: a third is
    refused with 429 + Retry-After, the two queued ones expire with 504."""
    x = S.mlp_input()
    results: list = []

    def queued():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            results.append(post_tensor(c, "slow", x, params={"lumen.timeout_ms": "400"}))

    threads = [threading.Thread(target=queued) for _ in range(S.SLOW_QUEUE_SIZE)]
    for t in threads:
        t.start()
    S.wait_for(lambda: server.runtime.tasks["slow"].batcher.pending == S.SLOW_QUEUE_SIZE,
               "the slow queue to fill")
    r = post_tensor(client, "slow", x)
    assert r.status_code == 429
    assert error_of(r)["code"] == "resource_exhausted" and int(r.headers["retry-after"]) >= 1
    for t in threads:
        t.join(10)
    assert [q.status_code for q in results] == [504, 504]
    assert {error_of(q)["field"] for q in results} == {"lumen.timeout_ms"}


def test_500_for_a_non_finite_result(client):
    x = np.array([[1.0, -1.0, 4.0, 9.0]], np.float32)
    r = post_tensor(client, "nan", x)
    assert r.status_code == 500 and error_of(r)["code"] == "internal"
    assert "non-finite" in error_of(r)["message"]


def test_503_before_the_runtime_is_ready(tmp_path):
    rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))  # never started

    async def run():
        transport = httpx.ASGITransport(app=HttpApp(rt))
        async with httpx.AsyncClient(transport=transport, base_url="http://lumen") as c:
            return (await c.post("/v1/infer/mlp", content=b"\0" * 64, params=S.tensor_meta((1, 16))),
                    await c.get("/readyz"))

    infer, ready = asyncio.run(run())
    assert infer.status_code == 503 and error_of(infer)["code"] == "unavailable"
    assert ready.status_code == 503


# -- cancellation and shutdown ------------------------------------------------------------
def _read_reply(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _raw_request(task: str, x: np.ndarray) -> bytes:
    query = "&".join(f"{k}={v}" for k, v in S.tensor_meta(x.shape).items())
    body = x.tobytes()
    return (f"POST /v1/infer/{task}?{query} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def test_client_disconnect_cancels_the_queued_request(server):
    batcher = server.runtime.tasks["slow"].batcher
    before = S.metric(S.scrape(server.url), "lumen_requests_total", task="slow", route="tensor",
                      code="cancelled")
    s = socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10)
    s.sendall(_raw_request("slow", S.mlp_input()))
    S.wait_for(lambda: batcher.pending == 1, "the request to be queued")
    s.close()
    # a lone request waits SLOW_DELAY_US; the cancellation must free the slot well before that
    S.wait_for(lambda: batcher.pending == 0, "the queued request to be cancelled",
               timeout=S.SLOW_DELAY_US / 1e6 / 2)
    samples = S.scrape(server.url)
    assert S.metric(samples, "lumen_requests_total", task="slow", route="tensor",
                    code="cancelled") == before + 1
    assert S.metric(samples, "lumen_transport_requests_total", transport="http",
                    endpoint="/v1/infer/{task}", status="499") >= 1


def test_sigterm_drains_in_flight_then_refuses_and_exits(tmp_path):
    """`lumen serve` in a subprocess: a request queued in the slow task is in flight when
    SIGTERM arrives; it still completes with 200, new connections are refused, exit 0."""
    cfg = S.onnx_config(tmp_path)
    cfg["tasks"][1]["batching"]["max_queue_delay_us"] = 1_500_000
    toml = tmp_path / "lumen.toml"
    toml.write_text(S.to_toml(cfg))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "lumen_core.cli", "serve", "--config", str(toml),
                             "--http-port", "0", "--grpc-port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = _ready_port(proc)
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(_raw_request("slow", S.mlp_input()))
        S.wait_for(lambda: S.metric(S.scrape(f"http://127.0.0.1:{port}"),
                                    "lumen_pending_requests", task="slow") == 1,
                   "the request to be queued")
        proc.send_signal(signal.SIGTERM)
        reply = _read_reply(s)
        s.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ready_port(proc: subprocess.Popen) -> int:
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "lumen ready" in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return int(line.split("http://127.0.0.1:")[1].split(",")[0].split()[0])
    raise AssertionError("server exited before it was ready:\n" + "".join(lines))


# -- /v1/embeddings on the prepared MiniLM ------------------------------------------------
EMBED_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    texts = json.loads((fixtures_dir / "minilm_reference.json").read_text())["texts"]
    return texts, np.load(fixtures_dir / "minilm_reference_embeddings.npy")


def test_embeddings_list_keeps_order_and_matches_the_reference(embed_server, reference):
    texts, ref = reference
    empty = texts.index("")  # an empty text is a 400 (TEI); its embedding is [CLS] [SEP]'s
    keep = [i for i in range(len(texts)) if i != empty]
    with httpx.Client(base_url=embed_server.url, timeout=60) as c:
        r = c.post("/v1/embeddings", json={"model": "text_embed",
                                           "input": [texts[i] for i in keep]})
        one = c.post("/v1/embeddings", json={"model": "text_embed", "input": texts[3]})
        bad_list = c.post("/v1/embeddings", json={"model": "text_embed", "input": texts})
        bad_one = c.post("/v1/embeddings", json={"model": "text_embed", "input": ""})
        no_text = c.post("/v1/embeddings", json={"model": "text_embed", "input": [101, 102]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "text_embed"
    assert [d["index"] for d in body["data"]] == list(range(len(keep)))
    got = np.array([d["embedding"] for d in body["data"]], np.float32)
    np.testing.assert_allclose(got, ref[keep], atol=EMBED_TOLERANCE)
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] >= 2 * len(keep)  # [CLS]/[SEP] each
    np.testing.assert_allclose(one.json()["data"][0]["embedding"], ref[3], atol=EMBED_TOLERANCE)
    # issue 12 item 7: the empty item is named; a lone empty input is the body's 'input'
    assert bad_list.status_code == 400
    err = bad_list.json()["error"]
    assert err["code"] == "invalid_argument" and err["field"] == f"input[{empty}]"
    assert "empty" in err["message"]
    assert bad_one.status_code == 400 and bad_one.json()["error"]["field"] == "input"
    np.testing.assert_allclose(no_text.json()["data"][0]["embedding"], ref[empty],
                               atol=EMBED_TOLERANCE)


def test_embeddings_base64_and_token_ids(embed_server, reference):
    texts, ref = reference
    with httpx.Client(base_url=embed_server.url, timeout=60) as c:
        b64 = c.post("/v1/embeddings", json={"model": "text_embed", "input": [texts[2]],
                                             "encoding_format": "base64"}).json()
        vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
        np.testing.assert_allclose(vec, ref[2], atol=EMBED_TOLERANCE)
        # "hello world" as WordPiece ids ([CLS] hello world [SEP]): the tensor route
        ids = c.post("/v1/embeddings", json={"model": "text_embed", "input": [101, 7592, 2088, 102]})
    assert ids.status_code == 200, ids.text
    np.testing.assert_allclose(ids.json()["data"][0]["embedding"], ref[2], atol=EMBED_TOLERANCE)
    assert ids.json()["usage"]["prompt_tokens"] == 4


def test_openai_client(embed_server, reference):
    texts, ref = reference
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="dummy", max_retries=0)
    res = client.embeddings.create(model="text_embed", input=texts[:5])  # base64 on the wire
    got = np.array([d.embedding for d in sorted(res.data, key=lambda d: d.index)], np.float32)
    np.testing.assert_allclose(got, ref[:5], atol=EMBED_TOLERANCE)
    single = client.embeddings.create(model="text_embed", input=texts[0], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, ref[0], atol=EMBED_TOLERANCE)
    assert [m.id for m in client.models.list().data] == ["face_detection", "ocr", "text_embed",
                                                         "text_embed_int8", "vad"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no_such_task", input="x")


def test_raw_text_infer_route(embed_server, reference):
    texts, ref = reference
    r = httpx.post(f"{embed_server.url}/v1/infer/text_embed", content=texts[4].encode(),
                   headers={"Content-Type": "text/plain; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["outputs"]["embedding"]["data"], ref[4], atol=EMBED_TOLERANCE)
    bad = httpx.post(f"{embed_server.url}/v1/infer/text_embed", content=b"\x89PNG",
                     headers={"Content-Type": "image/png"}, timeout=60)
    assert bad.status_code == 415 and error_of(bad)["code"] == "unsupported_media_type"


def test_embeddings_list_with_a_bad_item_fails_with_its_error(embed_server):
    """One bad item (a token id outside the vocabulary) fails the call with its error; the others
    run and are discarded (OpenAI semantics: a call succeeds or fails as a whole)."""
    with httpx.Client(base_url=embed_server.url, timeout=60) as c:
        r = c.post("/v1/embeddings", json={"model": "text_embed", "input": ["ok", [101, 10 ** 9, 102]]})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_argument"


def test_a_busy_http_port_stops_the_runtime_it_started(tmp_path):
    from lumen_core.serve.server import LumenServer

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))

    async def main():
        srv = LumenServer(rt, host="127.0.0.1", http_port=port, grpc_port=0)
        with pytest.raises(OSError):
            await srv.start()
        assert not rt.ready and rt.tasks == {}  # never loaded (issue 38 row 14: ports first)
        assert srv.grpc is None
        # gRPC losing its port after the check (another process took it): the runtime it
        # started stops, and the HTTP socket it held is closed
        srv = LumenServer(rt, host="127.0.0.1", http_port=0, grpc_port=0)

        async def taken(self):
            raise OSError("gRPC cannot listen")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("lumen_core.serve.server.GrpcServer.start", taken)
            with pytest.raises(OSError, match="gRPC cannot listen"):
                await srv.start()
        assert not rt.ready and rt.tasks == {}  # sessions and worker threads released

    try:
        asyncio.run(main())
    finally:
        busy.close()

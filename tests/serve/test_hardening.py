"""Hostile and clumsy clients (issue 12): oversized header sections, idle / half-sent
connections and the connection cap (raw sockets), client input that must not be a server fault,
oversized gRPC messages, busy ports, and the metrics exposition."""
from __future__ import annotations

import json
import socket
import time

import grpc
import httpx
import numpy as np
import pytest
import serve_support as S

from lumen_core.runtime import Runtime
from lumen_core.serve.grpc import ERROR_CODE_KEY, MESSAGE_OVERHEAD_BYTES
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc
from lumen_core.serve.server import LumenServer

READ_TIMEOUT_MS = 400
MAX_CONNECTIONS = 12
#: a lone request of ``wait`` sits in its queue longer than the read timeout
WAIT_DELAY_US = 700_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = S.guard_server(tmp_path_factory.mktemp("hardening"), WAIT_DELAY_US,
                         read_timeout_ms=READ_TIMEOUT_MS, max_connections=MAX_CONNECTIONS)
    yield srv
    srv.stop()


connect = S.raw_connect
read_all = S.read_until_closed


def json_error(reply: bytes) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"code", "message", "field"}
    return err


# -- 1. header size ---------------------------------------------------------------------------
def test_an_oversized_header_section_is_refused_early_with_431(server):
    s = connect(server)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    try:
        for _ in range(64):  # up to 4 MiB; the server must stop reading long before
            s.sendall(b"a" * 65536)
            sent += 65536
    except (BrokenPipeError, ConnectionResetError):
        pass
    reply = read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    err = json_error(reply)
    assert err["field"] == "headers" and "max_header_bytes" in err["message"]
    # a header section under the limit is still served
    r = httpx.get(f"{server.url}/healthz", headers={"X-Fine": "b" * 16_000}, timeout=10)
    assert r.status_code == 200


# -- 2. read timeouts and the connection cap -----------------------------------------------------
def test_an_idle_connection_is_answered_408_and_closed(server):
    s = connect(server)
    reply = read_all(s)  # nothing sent
    s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert "read_timeout_ms" in json_error(reply)["message"]


def test_a_trickled_header_is_cut_off_however_slowly_it_arrives(server):
    s = connect(server)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    s.settimeout(0.05)
    reply = b""
    deadline = time.monotonic() + S.WAIT_S
    while time.monotonic() < deadline:  # slowloris: one header byte every 50 ms
        try:
            s.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            break
        reply += chunk
    s.settimeout(S.WAIT_S)
    reply += read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_a_stalled_body_closes_the_connection(server):
    s = connect(server)
    s.sendall(b"POST /v1/infer/mlp HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream"
              b"\r\nContent-Length: 64\r\n\r\n" + b"\0" * 10)
    reply = read_all(s)  # the rest never comes
    s.close()
    assert not reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_inference_longer_than_the_read_timeout_is_not_cut(server):
    x = S.mlp_input(3)
    r = httpx.post(f"{server.url}/v1/infer/wait", content=x.tobytes(), params=S.tensor_meta(x.shape),
                   headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert r.status_code == 200, r.text


def test_connections_past_the_cap_get_503_and_the_slots_come_back(server):
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        S.wait_for(lambda: len(server.server._uvicorn.server_state.connections) >= MAX_CONNECTIONS,
                   "the idle connections to be accepted")
        extra = connect(server)
        reply = read_all(extra)
        extra.close()
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
        assert b"retry-after:" in reply.lower()
        assert "max_connections" in json_error(reply)["message"]
    finally:
        for s in idle:
            s.close()
    # the idle ones are gone (closed here, or timed out): a new client gets in
    S.wait_for(lambda: httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200,
               "a free connection slot")


# -- 4. client input is the client's error ------------------------------------------------------
def test_a_lone_surrogate_is_a_400_on_the_input_field(embed_server):
    for inp, field in (("\ud800", "input"), (["ok", "bad \udfff"], "input[1]")):
        r = httpx.post(f"{embed_server.url}/v1/embeddings",
                       content=json.dumps({"model": "text_embed", "input": inp}),
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_argument" and err["field"] == field
        assert "surrogate" in err["message"] and "internal" not in err["message"]


@pytest.mark.parametrize("mime,body", [("text/plain; charset=undefined", b"hello"),
                                       ("text/plain; charset=idna", b"xn--")])
def test_a_charset_that_cannot_decode_is_not_a_500(embed_server, mime, body):
    r = httpx.post(f"{embed_server.url}/v1/infer/text_embed", content=body,
                   headers={"Content-Type": mime}, timeout=30)
    assert r.status_code in (400, 415), r.text
    assert r.json()["error"]["field"] == "payload_mime" or r.status_code == 400


# -- 8. oversized gRPC messages ------------------------------------------------------------------
def test_grpc_message_over_the_limit_is_invalid_argument_payload_too_large(server):
    limit = S.MAX_PAYLOAD + MESSAGE_OVERHEAD_BYTES
    big = pb.InferRequest(task="mlp", payload=b"\0" * (limit + 1000), payload_mime="x")
    with grpc.insecure_channel(server.grpc_target,
                               options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Infer(big, timeout=30)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
        md = dict(ei.value.trailing_metadata())
        assert md[ERROR_CODE_KEY] == "payload_too_large"
        # on a stream the oversized message gets an error reply and the stream goes on
        x = S.mlp_input(4)
        ok = pb.InferRequest(task="mlp", payload=x.tobytes(), payload_mime="application/octet-stream",
                             meta=S.tensor_meta(x.shape), correlation_id="ok")
        big.correlation_id = "big"
        replies = list(stub.InferStream(iter([big, ok]), timeout=30))
        by = {r.correlation_id or "big": r for r in replies}
        assert by["big"].error.code == "payload_too_large"
        assert by["ok"].HasField("response")


# -- 11. busy ports -----------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["http", "grpc"])
def test_a_busy_port_is_one_line_naming_it_and_the_flag(tmp_path, which):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))
        kwargs = {"http_port": port, "grpc_port": None} if which == "http" else \
            {"http_port": 0, "grpc_port": port}
        srv = LumenServer(rt, host="127.0.0.1", **kwargs)
        import asyncio

        with pytest.raises(OSError) as ei:
            asyncio.run(srv.start())
        msg = str(ei.value)
        assert f"127.0.0.1:{port}" in msg and f"--{which}-port" in msg and "\n" not in msg
        assert not rt.ready
    finally:
        busy.close()


# -- 14. metrics exposition -----------------------------------------------------------------------
def test_metrics_have_no_created_series(server):
    x = S.mlp_input(5)
    httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(), params=S.tensor_meta(x.shape),
               headers={"Content-Type": "application/octet-stream"}, timeout=30)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "lumen_requests_total" in text
    assert "_created" not in text


def test_rejected_tensor_requests_are_counted_as_tensor(server):
    x = np.zeros((1, S.D_IN + 1), np.float32)  # wrong shape: refused by validation
    r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(), params=S.tensor_meta(x.shape),
                   headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert r.status_code == 400
    samples = S.scrape(server.url)
    tensor = sum(v for (name, labels), v in samples.items()
                 if name == "lumen_requests_total" and ("route", "tensor") in labels
                 and ("code", "invalid_argument") in labels)
    assert tensor >= 1


def test_accepted_connections_send_without_nagle_delay():
    """Found while fuzzing issue 25's surfaces: the listening socket was made without naming
    TCP, so asyncio (not uvloop) left Nagle's algorithm on for accepted connections and each
    keep-alive reply waited ~40 ms for the client's delayed ACK.  Accepted sockets now have
    TCP_NODELAY."""
    import asyncio

    from lumen_core.serve.server import bind_socket

    async def accepted_nodelay() -> int:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                got.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = bind_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
            value = await asyncio.wait_for(got, S.WAIT_S)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0

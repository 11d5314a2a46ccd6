"""The hot door's guards (issue 37) and what issue 38 rows 5, 6, 7 and 9 found open at the door:
slow request bodies holding every connection slot, correlation ids echoed uncut, a redirect
built from the Host header, and a transfer coding accepted but never decoded.  Raw sockets
where the wire matters."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import grpc
import httpx
import pytest
import serve_support as S

from lumen_core.serve import logs
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc

MAX_CONNECTIONS = 20
READ_TIMEOUT_MS = 2000
BODY_TIMEOUT_MS = 3000
#: one byte this often: every gap is well inside the read timeout
TRICKLE_S = 1.5
#: a lone request of ``wait`` sits in its queue this long (the disconnect test)
WAIT_DELAY_US = 3_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = S.guard_server(tmp_path_factory.mktemp("door"), WAIT_DELAY_US,
                         read_timeout_ms=READ_TIMEOUT_MS, max_connections=MAX_CONNECTIONS,
                         body_timeout_ms=BODY_TIMEOUT_MS, body_min_rate=500)
    yield srv
    srv.stop()


connect = S.raw_connect
read_all = S.read_until_closed


def tensor_post(path: str = "/v1/infer/mlp", extra: bytes = b"", body_len: int = 64) -> bytes:
    x = S.mlp_input()
    query = "&".join(f"{k}={v}" for k, v in S.tensor_meta(x.shape).items())
    return (f"POST {path}?{query} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {body_len}\r\n"
            ).encode() + extra + b"\r\n"


# -- row 5: slow bodies -----------------------------------------------------------------------
def test_trickling_bodies_are_closed_at_the_body_deadline_and_others_are_served(server):
    """20 connections (the cap) sending a byte every 1.5 s: each gap is inside the read
    timeout, so only the body deadline (3 s + 1 s per 500 bytes) frees the slots."""
    socks = [connect(server) for _ in range(MAX_CONNECTIONS)]
    t0 = time.monotonic()
    for s in socks:
        s.sendall(tensor_post(body_len=64))
    closed_at: dict = {}

    def trickle(i: int, s: socket.socket) -> None:
        s.settimeout(TRICKLE_S)
        try:
            for _ in range(40):
                try:
                    s.sendall(b"\0")
                except OSError:
                    break
                try:
                    data = s.recv(65536)
                except socket.timeout:
                    continue
                if not data or data.startswith(b"HTTP/1.1 408"):
                    break
        finally:
            closed_at[i] = time.monotonic() - t0

    threads = [threading.Thread(target=trickle, args=(i, s)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in socks:
        s.close()
    assert len(closed_at) == MAX_CONNECTIONS
    limit = BODY_TIMEOUT_MS / 1000 + 2 * TRICKLE_S + 1.0  # deadline + a trickle step + linger
    assert max(closed_at.values()) < limit, sorted(closed_at.values())
    x = S.mlp_input()
    r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(),
                   params=S.tensor_meta(x.shape), timeout=30)
    assert r.status_code == 200, r.text


def test_a_slow_body_past_its_deadline_is_answered_408(server):
    s = connect(server)
    s.sendall(tensor_post(body_len=64))
    s.settimeout(S.WAIT_S)
    deadline = time.monotonic() + BODY_TIMEOUT_MS / 1000 + 3
    reply = b""
    while time.monotonic() < deadline:
        try:
            s.sendall(b"\0")
        except OSError:
            break
        s.settimeout(0.5)
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            break
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    err = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
    assert err["field"] == "body" and "body_timeout_ms" in err["message"]


# -- row 6: one cut of a client's correlation id ---------------------------------------------
def test_a_long_correlation_id_is_cut_on_the_native_route_both_replies(server):
    cid = "c" * 20_000
    x = S.mlp_input()
    r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(),
                   params=S.tensor_meta(x.shape), headers={"X-Correlation-Id": cid}, timeout=30)
    assert r.status_code == 200
    want = cid[:logs.MAX_CORRELATION_ID]
    assert r.headers["x-correlation-id"] == want and r.json()["correlation_id"] == want
    r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(),
                   params=S.tensor_meta(x.shape),
                   headers={"X-Correlation-Id": cid, "Accept": "application/octet-stream"},
                   timeout=30)
    assert r.status_code == 200 and r.headers["x-correlation-id"] == want


def test_a_long_correlation_id_is_cut_on_grpc(server):
    x = S.mlp_input()

    async def call() -> str:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as ch:
            resp = await pb_grpc.InferenceStub(ch).Infer(pb.InferRequest(
                task="mlp", payload=x.tobytes(), payload_mime="application/octet-stream",
                meta=S.tensor_meta(x.shape), correlation_id="g" * 20_000), timeout=30)
            return resp.correlation_id

    assert asyncio.run(call()) == "g" * logs.MAX_CORRELATION_ID


def test_the_cut_keeps_only_visible_ascii():
    assert logs.client_correlation_id(b"a b\"c\x01" + b"d" * 300) == "a?b?c?" + "d" * 122
    assert logs.client_correlation_id("plain-id") == "plain-id"


# -- row 7: no redirect built from the Host header -------------------------------------------
def test_a_trailing_slash_is_the_json_404_not_a_redirect(server):
    r = httpx.post(f"{server.url}/v1/infer/mlp/", content=b"x",
                   headers={"Host": "evil.example"}, timeout=10)
    assert r.status_code == 404, (r.status_code, r.headers)
    assert "location" not in r.headers
    assert r.json()["error"]["code"] == "not_found"


# -- row 9: a transfer coding that is not decoded ---------------------------------------------
@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"br, chunked"])
def test_a_transfer_coding_other_than_chunked_is_refused_and_closed(server, coding):
    s = connect(server)
    body = b"40\r\n" + b"\0" * 64 + b"\r\n0\r\n\r\n"
    s.sendall(tensor_post(extra=b"Transfer-Encoding: " + coding + b"\r\n").replace(
        b"Content-Length: 64\r\n", b"") + body + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert reply.count(b"HTTP/1.1") == 1  # nothing pipelined behind it is answered
    err = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
    assert err["field"] == "Transfer-Encoding" and "chunked" in err["message"]


def test_plain_chunked_still_works(server):
    s = connect(server)
    body = b"40\r\n" + S.mlp_input().tobytes() + b"\r\n0\r\n\r\n"
    s.sendall(tensor_post(extra=b"Transfer-Encoding: chunked\r\nConnection: close\r\n").replace(
        b"Content-Length: 64\r\n", b"") + body)
    reply = read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


# -- the hot door ---------------------------------------------------------------------------
def test_pipelined_requests_are_answered_in_order_on_one_connection(server):
    """Replies written whole by the connection (limits.reply) keep HTTP/1.1 pipelining."""
    x = S.mlp_input()
    one = tensor_post(extra=b"Accept: application/octet-stream\r\n") + x.tobytes()
    s = connect(server)
    s.sendall(one * 3 + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply = read_all(s)
    s.close()
    assert reply.count(b"HTTP/1.1 200") == 4, reply[:500]
    assert reply.rstrip().endswith(b"}")  # the healthz JSON came last


def test_a_client_that_hangs_up_cancels_its_queued_request(server):
    """The connection (not a watcher task) notices the loss and cancels the request."""
    x = S.mlp_input()
    s = connect(server)
    path = "/v1/infer/wait"
    s.sendall(tensor_post(path=path) + x.tobytes())
    rt = server.runtime
    S.wait_for(lambda: rt.load()["wait"]["pending"] == 1, "the request to be queued")
    s.close()
    S.wait_for(lambda: rt.load()["wait"]["pending"] == 0, "the queued request to be cancelled",
               timeout=2.0)
    samples = S.scrape(server.url)
    assert S.metric(samples, "lumen_requests_total", task="wait", code="cancelled") == 1
    assert S.metric(samples, "lumen_transport_requests_total", endpoint="/v1/infer/{task}",
                    status="499") >= 1


def test_a_route_added_to_the_hot_path_keeps_its_guard_and_counting(server):
    """``HotDoor.add_route`` (how TEI's /embed joins the hot path): the endpoint's handler,
    error shape and transport counter, under the template it was guarded as."""
    door = server.server.http.door
    door.add_route("/embed-door-test", "/v1/embeddings")
    with pytest.raises(KeyError):
        door.add_route("/nowhere", "/v1/not-a-route")
    r = httpx.post(f"{server.url}/embed-door-test", json={"model": "mlp", "input": "hi"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "model"
    samples = S.scrape(server.url)
    assert S.metric(samples, "lumen_transport_requests_total", endpoint="/v1/embeddings",
                    status="400") >= 1


def test_the_query_memo_is_checked_against_the_tasks_head_version():
    """The native route remembers a query string's meta and option check per task head; a new
    head (a reload, a version load) clears it, an unknown task is never remembered, and a
    refused query is refused every time."""
    import functools
    import types

    from lumen_core import errors
    from lumen_core.serve.door import HotDoor
    from lumen_core.serve.http import HttpApp

    class Runtime:
        def __init__(self) -> None:
            self.tasks = {"t": object()}
            self.asked = 0

        def has_task(self, task: str) -> bool:
            return task in self.tasks

        def request_options(self, task: str) -> dict:
            self.asked += 1
            return {"opt": "an option"}

    rt = Runtime()
    app = types.SimpleNamespace(runtime=rt, keys=types.SimpleNamespace(enabled=False),
                                guarded=lambda route: None)
    app.check_options = functools.partial(HttpApp.check_options, app)
    door = HotDoor(app, None)
    assert door.meta("t", b"opt=1", "") == {"opt": "1"}
    got = door.meta("t", b"opt=1", "")
    assert got == {"opt": "1"} and rt.asked == 1  # remembered
    got["lumen.x"] = "y"  # a caller's change stays its own
    assert door.meta("t", b"opt=1", "") == {"opt": "1"}
    rt.tasks["t"] = object()  # a new head version
    assert door.meta("t", b"opt=1", "") == {"opt": "1"} and rt.asked == 2
    for _ in range(2):
        with pytest.raises(errors.InvalidArgument):
            door.meta("t", b"opts=1", "")
    assert door.meta("gone", b"anything=1", "") == {"anything": "1"}  # refused later: 404
    assert ("gone", b"anything=1", "") not in door.queries

"""The hot routes served from the parser's callbacks (serve/door_protocol.py, issue 37): no task
per request, pipelining order with uvicorn's own path, errors answered before the body (and
the connection still serving), the body limit while a body arrives, flow control, and a
client that leaves.  Raw sockets where the wire matters."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import serve_support as S

from lumen_core.runtime import Runtime
from lumen_core.serve import door_protocol
from lumen_core.serve.http import HttpApp
from lumen_core.serve.limits import HttpLimits

WAIT_DELAY_US = 2_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = S.guard_server(tmp_path_factory.mktemp("door_protocol"), WAIT_DELAY_US)
    yield srv
    srv.stop()


def post(task: str = "mlp", query: str = "", body: bytes = b"", extra: bytes = b"",
         length: int = -1) -> bytes:
    x = S.mlp_input()
    q = query or "&".join(f"{k}={v}" for k, v in S.tensor_meta(x.shape).items())
    body = body or x.tobytes()
    n = len(body) if length < 0 else length
    return (f"POST /v1/infer/{task}?{q} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {n}\r\n").encode() \
        + extra + b"\r\n" + body


def replies(raw: bytes) -> list:
    """(status, headers, body) of each response in ``raw``, in order."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        n = int(headers.get(b"content-length", b"0"))
        out.append((status, headers, rest[:n]))
        raw = rest[n:]
    return out


def test_the_server_speaks_through_the_callback_protocol(server):
    cls = server.server._uvicorn.config.http_protocol_class
    assert cls.__name__ == "DoorProtocol"


def test_a_queued_hot_request_holds_no_task(server):
    """The request waits in its batch queue with no task of its own: the loop's task count
    is what it was before it arrived."""
    async def tasks() -> int:
        return len(asyncio.all_tasks()) - 1  # less this coroutine's own

    before = server.call(tasks())
    s = S.raw_connect(server)
    s.sendall(post("wait", extra=b"Accept: application/octet-stream\r\n"))
    rt = server.runtime
    S.wait_for(lambda: rt.load()["wait"]["pending"] == 1, "the request to be queued")
    assert server.call(tasks()) == before
    s.settimeout(10)
    status, headers, body = replies(s.recv(65536))[0]
    s.close()
    assert status == 200 and headers[b"lumen-tensor-dtype"] == b"fp32"
    assert np.frombuffer(body, "<f4").shape == (S.D_OUT,)


def test_pipelined_hot_and_cold_requests_keep_their_order(server):
    """A hot request, a cold one and a hot one again in one write: answered in order (the
    cold one waits in uvicorn's queue behind the reply still being made)."""
    s = S.raw_connect(server)
    s.sendall(post("wait") + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
              + post(extra=b"Connection: close\r\n"))
    got = replies(S.read_until_closed(s))
    s.close()
    assert [g[0] for g in got] == [200, 200, 200]
    assert "outputs" in json.loads(got[0][2])
    assert json.loads(got[1][2])["status"] == "ok"
    assert got[2][1][b"connection"] == b"close"


def test_an_error_before_the_body_keeps_the_connection_serving(server):
    """An unknown query option is refused when the headers are in (400, before the body is
    read); the body that follows is dropped and the next request on the connection served."""
    whole = post(query="no_such_option=1")
    s = S.raw_connect(server)
    s.settimeout(10)
    s.sendall(whole[:-16])  # the body is not all sent: the 400 comes first
    early = s.recv(65536)
    assert early.startswith(b"HTTP/1.1 400"), early[:100]
    s.sendall(whole[-16:] + post(extra=b"Connection: close\r\n"))
    got = replies(early + S.read_until_closed(s))
    s.close()
    assert [g[0] for g in got] == [400, 200], got
    err = json.loads(got[0][2])["error"]
    assert err["code"] == "invalid_argument" and "no_such_option" in err["message"]


def test_a_declared_body_over_the_limit_is_refused_unread_and_closed(server):
    head = post(length=S.MAX_PAYLOAD + 1)
    s = S.raw_connect(server)
    s.sendall(head[:head.index(b"\r\n\r\n") + 4])  # the headers alone: nothing else is sent
    got = replies(S.read_until_closed(s))
    s.close()
    assert got[0][0] == 413 and got[0][1][b"connection"] == b"close"
    assert json.loads(got[0][2])["error"]["field"] == "payload"


def test_a_chunked_body_growing_past_the_limit_is_refused_and_closed(server):
    x = S.mlp_input()
    q = "&".join(f"{k}={v}" for k, v in S.tensor_meta(x.shape).items())
    chunk = b"x" * 1024
    s = S.raw_connect(server)
    s.sendall(f"POST /v1/infer/mlp?{q} HTTP/1.1\r\nHost: x\r\n"
              f"Transfer-Encoding: chunked\r\n\r\n".encode())
    try:
        for _ in range(S.MAX_PAYLOAD // len(chunk) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while sending: the reply is already on its way
    got = replies(S.read_until_closed(s))
    s.close()
    assert got and got[0][0] == 413, got
    assert "exceeds the limit" in json.loads(got[0][2])["error"]["message"]


def test_oip_json_on_the_callback_path(server):
    x = S.mlp_input()
    body = json.dumps({"id": "r1", "inputs": [{"name": "x", "shape": list(x.shape),
                                               "datatype": "FP32",
                                               "data": x.reshape(-1).tolist()}]}).encode()
    s = S.raw_connect(server)
    s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nX-Correlation-Id: oip-1\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    (status, headers, out), = replies(S.read_until_closed(s))
    s.close()
    reply = json.loads(out)
    assert status == 200 and reply["id"] == "r1" and reply["model_name"] == "mlp"
    assert headers[b"x-correlation-id"] == b"oip-1"
    assert reply["outputs"][0]["shape"] == [S.D_OUT]  # the request's row of the batch


def test_an_unknown_task_is_the_json_404_counted_on_its_route(server):
    s = S.raw_connect(server)
    s.sendall(post("nope", extra=b"Connection: close\r\n"))
    (status, _h, out), = replies(S.read_until_closed(s))
    s.close()
    assert status == 404 and json.loads(out)["error"]["code"] == "not_found"
    samples = S.scrape(server.url)
    assert S.metric(samples, "lumen_transport_requests_total", endpoint="/v1/infer/{task}",
                    status="404") >= 1


# -- the protocol on a transport of the test's own ------------------------------------------
class _Transport(asyncio.Transport):
    """A transport that keeps what is written; past ``high_water`` buffered bytes it tells
    the protocol to pause writing (as a socket whose client stopped reading does)."""

    def __init__(self, high_water: int = 1 << 30) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.eof = False
        self.reading = True
        self.high_water = high_water
        self.protocol: object = None
        self.late_writes = 0  # writes after write_eof (a real transport raises)

    def write(self, data: bytes) -> None:
        if self.eof or self.closed:
            self.late_writes += 1
            return
        self.out += data
        if len(self.out) > self.high_water and self.protocol is not None:
            self.high_water = 1 << 30
            self.protocol.pause_writing()  # type: ignore[attr-defined]

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 5), "sockname": ("127.0.0.1", 80)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True


async def _until(cond, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _on_protocol(tmp_path, body, keep_alive_s: float = 5.0, high_water: int = 1 << 30,
                 **server) -> None:
    """Run ``body(proto, transport, runtime)`` against a started runtime of the guard
    suites' tasks, on a protocol fed by a transport of the test's own."""
    import uvicorn
    from uvicorn.server import ServerState

    async def main() -> None:
        cfg = S.onnx_config(tmp_path, slow=False, **server)
        cfg["tasks"].append(dict(cfg["tasks"][0], name="wait",
                                 batching={"max_queue_delay_us": WAIT_DELAY_US}))
        rt = Runtime.from_dict(cfg)
        await rt.start()
        try:
            app = HttpApp(rt)
            cls = door_protocol.protocol_class(HttpLimits(), app)
            config = uvicorn.Config(app, lifespan="off", log_config=None,
                                    timeout_keep_alive=keep_alive_s)  # type: ignore[arg-type]
            config.load()
            proto = cls(config=config, server_state=ServerState(), app_state={})
            t = _Transport(high_water)
            t.protocol = proto
            proto.connection_made(t)
            try:
                await body(proto, t, rt)
            finally:
                proto.connection_lost(None)
        finally:
            await rt.stop()

    asyncio.run(main())


def test_after_a_reply_that_fills_the_write_buffer_the_next_request_waits(tmp_path):
    """Flow control: a hot reply that fills the transport's buffer (pause_writing) pauses
    reading, and the request pipelined behind it is not started until the buffer drains."""
    async def body(proto, t, rt) -> None:
        proto.data_received(post() + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await _until(lambda: t.out, "the hot reply")
        await asyncio.sleep(0.1)
        assert len(replies(bytes(t.out))) == 1 and not t.reading
        proto.resume_writing()
        await _until(lambda: len(replies(bytes(t.out))) == 2, "the next reply")
        assert [g[0] for g in replies(bytes(t.out))] == [200, 200] and t.reading

    _on_protocol(tmp_path, body, high_water=1)


def test_while_writes_are_paused_a_request_takes_uvicorns_waiting_send(tmp_path):
    """No hot reply is written into a full buffer: a request arriving while writes are
    paused waits in uvicorn's send for the drain."""
    async def body(proto, t, rt) -> None:
        proto.pause_writing()
        proto.data_received(post())
        await asyncio.sleep(0.3)
        assert not t.out
        proto.resume_writing()
        await _until(lambda: t.out, "the reply after the drain")
        assert replies(bytes(t.out))[0][0] == 200

    _on_protocol(tmp_path, body)


def test_an_early_error_leaves_keep_alive_to_after_the_body(tmp_path):
    """An error answered at the headers completes the request only when its body is read:
    then keep-alive applies (an idle connection is closed), and a request pipelined after
    the error is not cut by a keep-alive timer armed by the error."""
    async def body(proto, t, rt) -> None:
        whole = post(query="no_such_option=1")
        head, rest = whole[:-32], whole[-32:]
        proto.data_received(head)
        await _until(lambda: t.out, "the early 400")
        assert replies(bytes(t.out))[0][0] == 400
        proto.data_received(rest)  # the body's end, then nothing: keep-alive closes it
        await _until(lambda: t.closed, "the keep-alive close", timeout=3.0)

    _on_protocol(tmp_path, body, keep_alive_s=0.3)

    async def pipelined(proto, t, rt) -> None:
        proto.data_received(post(query="no_such_option=1") + post("wait"))
        await asyncio.sleep(0.6)  # past the keep-alive: the wait request is still queued
        assert not t.closed
        await _until(lambda: len(replies(bytes(t.out))) == 2, "the queued reply",
                     timeout=WAIT_DELAY_US / 1e6 + 3)
        assert [g[0] for g in replies(bytes(t.out))] == [400, 200]

    _on_protocol(tmp_path, pipelined, keep_alive_s=0.3)


def test_a_refused_body_closes_and_nothing_after_it_runs(tmp_path):
    """A chunked body past the limit is a 413 and the connection ends (lingering): a request
    the client sends in the linger is neither parsed into work nor answered."""
    async def body(proto, t, rt) -> None:
        x = S.mlp_input()
        q = "&".join(f"{k}={v}" for k, v in S.tensor_meta(x.shape).items())
        chunk = b"x" * 1024
        data = f"POST /v1/infer/mlp?{q} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        data += b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk)
                         for _ in range(S.MAX_PAYLOAD // len(chunk) + 1)) + b"0\r\n\r\n"
        proto.data_received(data + post())
        await asyncio.sleep(0.3)
        got = replies(bytes(t.out))
        assert [g[0] for g in got] == [413] and t.eof
        proto.data_received(post())  # in the linger: dropped
        await asyncio.sleep(0.3)
        assert len(replies(bytes(t.out))) == 1
        assert t.late_writes == 0  # nothing was run whose reply could not be sent

    _on_protocol(tmp_path, body)


def test_the_body_dropped_after_an_early_error_is_bounded(tmp_path):
    """After an error answered at the headers, the rest of the body is read and dropped only
    up to the payload limit; past it the connection ends."""
    async def body(proto, t, rt) -> None:
        x = S.mlp_input()
        q = "&".join(f"{k}={v}" for k, v in S.tensor_meta(x.shape).items())
        proto.data_received(f"POST /v1/infer/mlp?{q}&no_such_option=1 HTTP/1.1\r\nHost: x\r\n"
                            f"Transfer-Encoding: chunked\r\n\r\n".encode())
        await _until(lambda: t.out, "the early 400")
        assert replies(bytes(t.out))[0][0] == 400
        chunk = b"x" * 1024
        for _ in range(S.MAX_PAYLOAD // len(chunk) + 2):
            proto.data_received(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert t.eof  # closing (lingering): what still comes is dropped unparsed

    _on_protocol(tmp_path, body)


def test_a_client_that_leaves_mid_body_is_counted_gone(server):
    def gone() -> float:
        return S.metric(S.scrape(server.url), "lumen_transport_requests_total",
                        endpoint="/v1/infer/{task}", status="499")

    before = gone()
    s = S.raw_connect(server)
    s.sendall(post()[:-32])  # half the body
    s.close()
    S.wait_for(lambda: gone() == before + 1, "the lost request to be counted")


def test_keep_alive_serves_many_requests_on_one_connection(server):
    s = S.raw_connect(server)
    s.settimeout(10)
    for i in range(20):
        s.sendall(post(extra=b"Accept: application/octet-stream\r\n"))
        buf = b""
        while b"\r\n\r\n" not in buf or len(replies(buf)[0][2]) < S.D_OUT * 4:
            buf += s.recv(65536)
        assert replies(buf)[0][0] == 200, i
    s.close()


def test_a_websocket_upgrade_after_a_hot_request_on_the_same_connection(server):
    s = S.raw_connect(server)
    s.settimeout(10)
    s.sendall(post())
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /v1/stream/mlp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
              b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 101")
    s.close()


def test_an_http_1_0_request_is_answered_and_its_connection_closed(server):
    s = S.raw_connect(server)
    s.sendall(post().replace(b"HTTP/1.1", b"HTTP/1.0"))
    got = replies(S.read_until_closed(s))  # returns once the server closed
    s.close()
    assert got[0][0] == 200 and got[0][1][b"connection"] == b"close"

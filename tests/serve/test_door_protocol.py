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
    s = S.raw_connect(server)
    s.sendall(post(query="no_such_option=1") + post(extra=b"Connection: close\r\n"))
    got = replies(S.read_until_closed(s))
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


# -- the protocol on a transport whose writes can be paused --------------------------------
class _Transport(asyncio.Transport):
    """A transport that keeps what is written, and can say its buffer is full."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.out += data

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
        return False


def test_after_a_reply_that_fills_the_write_buffer_the_next_request_waits(tmp_path):
    """Flow control: while the transport's buffer is full (pause_writing), the pipelined
    request after a hot reply is not started; it runs once the buffer drains."""
    import uvicorn
    from uvicorn.server import ServerState

    async def main() -> None:
        rt = Runtime.from_dict(S.onnx_config(tmp_path, slow=False))
        await rt.start()
        try:
            app = HttpApp(rt)
            cls = door_protocol.protocol_class(HttpLimits(), app)
            config = uvicorn.Config(app, lifespan="off", log_config=None)
            config.load()
            proto = cls(config=config, server_state=ServerState(), app_state={})
            t = _Transport()
            proto.connection_made(t)
            proto.pause_writing()  # the client stopped reading
            proto.data_received(post() + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(200):
                if t.out:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert len(replies(bytes(t.out))) == 1  # the hot reply, the next one waits
            proto.resume_writing()
            for _ in range(200):
                if len(replies(bytes(t.out))) == 2:
                    break
                await asyncio.sleep(0.01)
            got = replies(bytes(t.out))
            assert [g[0] for g in got] == [200, 200]
            proto.connection_lost(None)
        finally:
            await rt.stop()

    asyncio.run(main())


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


def test_an_http_1_0_request_is_answered_and_its_connection_closed(server):
    s = S.raw_connect(server)
    s.sendall(post().replace(b"HTTP/1.1", b"HTTP/1.0"))
    got = replies(S.read_until_closed(s))  # returns once the server closed
    s.close()
    assert got[0][0] == 200 and got[0][1][b"connection"] == b"close"

"""``GET /v1/stream/{task}`` (serve/ws.py): live speech segments over a WebSocket, with the
``websockets`` client.  The stream's events must equal the whole file's segments (silero-vad's
reference, tests/fixtures/vad_speech_reference.json) whatever the frame sizes; 32 clients at
once; a dropped socket frees its slot at once; errors are an event and a 4xxx close."""
from __future__ import annotations

import asyncio
import json
import pathlib
import time
import wave

import httpx
import numpy as np
import pytest
import websockets
from serve_support import ServerThread

import lumen_core as lc
from lumen_core import models

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE = json.loads((FIXTURES / "vad_speech_reference.json").read_text())
NAME = "vad_speech_1.wav"
TOLERANCE_MS = 32.0
KEY = "ws-secret-key"
CLIENTS = 32
#: the keyed server's read timeout: an unauthenticated socket is closed after it
AUTH_TIMEOUT_MS = 300
#: the keyed server's max_payload_bytes (frames up to 1 s of PCM16 fit)
MAX_PAYLOAD = 64 * 1024
#: seconds a test waits for a refusal (well past AUTH_TIMEOUT_MS)
REFUSAL_WAIT_S = 5.0
SILENT_SOCKETS = 4


def vad_task(home) -> dict:
    path = str(models.model_dir(models.SILERO_VAD, home) / models.MODEL_FILE)
    return {"name": "vad", "backend": "vad", "model": path, "intra_op_threads": 1,
            "batching": {"max_batch_size": 64, "max_queue_size": 4096},
            "sequence": {"strategy": "direct"}}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("lumen_home")
    models.prepare(names=[models.SILERO_VAD], home=h)
    return h


@pytest.fixture(scope="module")
def server(home):
    srv = ServerThread(lc.Runtime.from_dict({"tasks": [vad_task(home)]}), grpc=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pcm() -> bytes:
    with wave.open(str(FIXTURES / NAME)) as w:
        return w.readframes(w.getnframes())


def ws_url(server, path="/v1/stream/vad") -> str:
    return server.url.replace("http://", "ws://") + path


def frames(data: bytes, rng) -> list:
    """Random frame sizes from 1 byte to 1 s (32000 bytes), log-uniform; samples split."""
    out, i = [], 0
    while i < len(data):
        n = int(np.exp(rng.uniform(0, np.log(32000))))
        out.append(data[i:i + n])
        i += n
    return out


async def stream(url: str, data: bytes, seed: int, first: dict = None, **kw) -> tuple:
    rng = np.random.default_rng(seed)
    events = []
    async with websockets.connect(url, **kw) as ws:
        if first is not None:
            await ws.send(json.dumps(first))

        async def reader():
            async for msg in ws:
                events.append(json.loads(msg))

        task = asyncio.ensure_future(reader())
        for f in frames(data, rng):
            await ws.send(f)
        await ws.send(json.dumps({"event": "end"}))
        await asyncio.wait_for(task, 60)
        return events, ws.close_code


def check(events: list) -> None:
    want = [(s / 16, e / 16) for s, e in REFERENCE[NAME]["segments"]]
    done = events[-1]
    assert done["event"] == "done"
    assert done["duration_ms"] == REFERENCE[NAME]["samples"] / 16
    live = [e for e in events if e["event"] in ("start", "end")]
    assert [e["event"] for e in live] == ["start", "end"] * len(want)
    pairs = list(zip(live[::2], live[1::2], strict=True))
    assert [{"start_ms": s["ms"], "end_ms": e["ms"]} for s, e in pairs] == done["segments"]
    for (s, e), seg in zip(want, done["segments"], strict=True):
        assert abs(seg["start_ms"] - s) <= TOLERANCE_MS and abs(seg["end_ms"] - e) <= TOLERANCE_MS


def test_32_clients_random_frames_get_silero_segments(server, pcm):
    async def go():
        return await asyncio.gather(*[stream(ws_url(server), pcm, seed)
                                      for seed in range(CLIENTS)])

    for events, code in asyncio.run(go()):
        assert code == 1000
        check(events)
    assert server.runtime.load()["vad"]["active_sequences"] == 0


def test_f32_by_first_message_with_probabilities(server, pcm):
    f32 = (np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0).astype("<f4").tobytes()
    first = {"mime": "audio/pcm;format=f32le;rate=16000", "probabilities": True}
    events, code = asyncio.run(stream(ws_url(server), f32, 1, first))
    probs = [e for e in events if e["event"] == "prob"]
    assert len(probs) == -(-REFERENCE[NAME]["samples"] // 512)
    assert all(0.0 <= e["p"] <= 1.0 for e in probs)
    check([e for e in events if e["event"] != "prob"])


def test_a_dropped_client_frees_its_slot_at_once(server, pcm):
    rt = server.runtime

    async def go():
        ws = await websockets.connect(ws_url(server) + "?probabilities=true")
        await ws.send(pcm[:32000])
        await ws.recv()  # a probability: the sequence holds a slot
        assert rt.load()["vad"]["active_sequences"] == 1
        ws.transport.abort()  # no close frame: the connection is lost
        t0 = time.monotonic()
        while rt.load()["vad"]["active_sequences"] and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    # the idle timeout is 10 s: freed well before it means the socket ended the sequence
    assert asyncio.run(go()) < 2.0
    assert rt.load()["vad"]["active_sequences"] == 0


def test_errors_are_an_event_and_a_close_code(server):
    cases = [
        (ws_url(server, "/v1/stream/nope"), None, 4404, "not_found"),
        (ws_url(server) + "?lumen.vad.threshold=7", None, 4400, "invalid_argument"),
        (ws_url(server) + "?lumen.sequence.id=x", None, 4400, "invalid_argument"),
        (ws_url(server), {"mime": "audio/L16;rate=8000"}, 4415, "unsupported_media_type"),
        (ws_url(server), "not json", 4400, "invalid_argument"),
    ]
    for url, first, code, name in cases:
        err, got = asyncio.run(refused(url, bytes(1024) if first is None else first))
        assert err["code"] == name, (url, err)
        assert got == code


@pytest.fixture(scope="module")
def keyed(home):
    """A server with an API key, a short read timeout and a small payload limit."""
    cfg = {"server": {"api_keys": [KEY], "read_timeout_ms": AUTH_TIMEOUT_MS,
                      "max_payload_bytes": MAX_PAYLOAD}, "tasks": [vad_task(home)]}
    srv = ServerThread(lc.Runtime.from_dict(cfg))
    yield srv
    srv.stop()


async def refused(url: str, first=None, **kw) -> tuple:
    """(the error event, the close code) of a stream the server ends with an error."""
    async with websockets.connect(url, **kw) as ws:
        if first is not None:
            try:
                await ws.send(first if isinstance(first, (str, bytes)) else json.dumps(first))
            except websockets.ConnectionClosed:
                pass  # refused before the first message
        msg = json.loads(await asyncio.wait_for(ws.recv(), REFUSAL_WAIT_S))
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), REFUSAL_WAIT_S)
        assert msg["event"] == "error", msg
        return msg["error"], ws.close_code


def test_api_keys_by_header_or_first_message(keyed, pcm):
    async def go():
        url = ws_url(keyed)
        err, code = await refused(url, bytes(1024))
        assert err["code"] == "unauthenticated" and code == 4401
        ev, code = await stream(url, pcm[:64000], 0,
                                additional_headers={"Authorization": f"Bearer {KEY}"})
        assert code == 1000 and ev[-1]["event"] == "done"
        ev, code = await stream(url, pcm[:64000], 0, first={"api_key": KEY})
        assert code == 1000 and ev[-1]["event"] == "done"

    asyncio.run(go())


def test_without_a_key_an_unknown_task_is_4401_not_4404(keyed):
    """Issue 26 row 7: task names cannot be probed without a key (authenticate, then look up)."""
    async def go():
        url = ws_url(keyed, "/v1/stream/nope")
        for first in (bytes(1024), {"api_key": "wrong"}, {"event": "end"}):
            err, code = await refused(url, first)
            assert (err["code"], code) == ("unauthenticated", 4401), first
        err, code = await refused(url, bytes(8),
                                  additional_headers={"Authorization": f"Bearer {KEY}"})
        assert (err["code"], code) == ("not_found", 4404)
        err, code = await refused(url, {"api_key": KEY})
        assert (err["code"], code) == ("not_found", 4404)

    asyncio.run(go())


def test_a_silent_unauthenticated_socket_is_closed_within_the_read_timeout(keyed):
    """Issue 25 row 9: with keys on, a socket that never authenticates is closed 4401 within
    read_timeout_ms (20 such sockets held every connection of max_connections=20)."""
    async def go():
        socks = [await websockets.connect(ws_url(keyed)) for _ in range(SILENT_SOCKETS)]
        t0 = time.monotonic()
        out = []
        for ws in socks:
            msg = json.loads(await asyncio.wait_for(ws.recv(), REFUSAL_WAIT_S))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), REFUSAL_WAIT_S)
            out.append((msg["error"]["code"], ws.close_code, "read_timeout_ms" in
                        msg["error"]["message"]))
        return out, time.monotonic() - t0

    out, took = asyncio.run(go())
    assert out == [("unauthenticated", 4401, True)] * SILENT_SOCKETS
    assert took < REFUSAL_WAIT_S


def test_a_key_in_the_url_is_refused(keyed):
    """Issue 25 row 8: ``?api_key=`` (URLs are logged, by us and by every proxy on the way)."""
    async def go():
        err, code = await refused(ws_url(keyed) + f"?api_key={KEY}", {"event": "end"})
        assert (err["code"], code, err["field"]) == ("unauthenticated", 4401, "api_key")
        assert KEY not in err["message"]

    asyncio.run(go())


def test_a_frame_over_max_payload_bytes_is_refused(keyed, pcm):
    """Issue 25, also seen: frames up to 16 MiB were accepted whatever max_payload_bytes said;
    now a frame over it closes the socket 1009 (message too big)."""
    async def go():
        auth = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(ws_url(keyed), additional_headers=auth) as ws:
            await ws.send(pcm[:MAX_PAYLOAD])  # at the limit: served
            await ws.send(pcm[:MAX_PAYLOAD + 2])
            with pytest.raises(websockets.ConnectionClosed) as e:
                while True:
                    await asyncio.wait_for(ws.recv(), REFUSAL_WAIT_S)
            return e.value.rcvd.code if e.value.rcvd else None

    assert asyncio.run(go()) == 1009


def test_a_deeply_nested_control_message_is_4400(server):
    """Issue 25 row 10: 8,000 nested brackets were a 4500 ``internal`` and a traceback."""
    for text in ("[" * 8000 + "]" * 8000, '{"a":' * 8000 + "1" + "}" * 8000):
        err, code = asyncio.run(refused(ws_url(server), text))
        assert (err["code"], code) == ("invalid_argument", 4400)


def test_a_fast_client_is_paced_by_the_model_not_buffered(server, pcm):
    """Frames are run before the next is read: a client that sends ~97 s of audio as fast as
    it can is held by flow control, and its events equal the whole file's segments."""
    data = pcm * 8

    async def go():
        async with websockets.connect(ws_url(server), max_queue=4) as ws:
            t0 = time.monotonic()
            for i in range(0, len(data), 32000):
                await ws.send(data[i:i + 32000])
            sent = time.monotonic() - t0
            await ws.send(json.dumps({"event": "end"}))
            events = [json.loads(m) async for m in ws]
            return sent, events

    sent, events = asyncio.run(go())
    assert events[-1]["event"] == "done"
    whole = httpx.post(f"{server.url}/v1/infer/vad", content=data, timeout=60,
                       headers={"content-type": "audio/L16;rate=16000"}).json()
    assert len(events[-1]["segments"]) == len(whole["segments"]) >= 20
    for a, b in zip(events[-1]["segments"], whole["segments"], strict=True):
        assert abs(a["start_ms"] - b["start_ms"]) <= TOLERANCE_MS
        assert abs(a["end_ms"] - b["end_ms"]) <= TOLERANCE_MS


def test_an_infinitely_fast_client_is_read_one_frame_at_a_time(home, pcm):
    """The endpoint on a fake ASGI connection whose frames are always ready: whenever it asks
    for the next frame, every chunk of the previous ones has been answered (nothing of this
    stream is queued), so the server holds at most one frame of a fast client."""
    from lumen_core.serve.auth import ApiKeys
    from lumen_core.serve.ws import StreamEndpoint

    data = pcm * 3
    parts = [data[i:i + 20000] for i in range(0, len(data), 20000)]

    async def go():
        async with lc.Runtime.from_dict({"tasks": [vad_task(home)]}) as rt:
            sent, queued_at_read = [], []
            inbox = [{"type": "websocket.connect"}]
            inbox += [{"type": "websocket.receive", "bytes": p} for p in parts]
            inbox += [{"type": "websocket.receive", "text": '{"event": "end"}'}]

            async def receive():
                load = rt.load()["vad"]
                queued_at_read.append(load["pending"] + load["in_flight"])
                return inbox.pop(0)

            async def send(msg):
                sent.append(msg)

            scope = {"type": "websocket", "path": "/v1/stream/vad", "query_string": b"",
                     "headers": [], "path_params": {"task": "vad"}}
            await StreamEndpoint(rt, ApiKeys(), lambda: False)(scope, receive, send)
            return sent, queued_at_read

    sent, queued = asyncio.run(go())
    assert set(queued) == {0} and len(queued) == len(parts) + 2
    texts = [json.loads(m["text"]) for m in sent if m["type"] == "websocket.send"]
    assert texts[-1]["event"] == "done" and len(texts[-1]["segments"]) >= 9
    assert sent[-1]["type"] == "websocket.close" and sent[-1]["code"] == 1000


def test_a_stream_paused_past_the_idle_timeout_goes_on(home, pcm):
    task = vad_task(home)
    task["sequence"] = {"strategy": "direct", "max_sequence_idle_us": 100_000}
    srv = ServerThread(lc.Runtime.from_dict({"tasks": [task]}), grpc=False)
    try:
        async def go():
            async with websockets.connect(ws_url(srv)) as ws:
                await ws.send(pcm[:64000])
                await asyncio.sleep(0.5)  # the slot idles out
                await ws.send(pcm[64000:])
                await ws.send(json.dumps({"event": "end"}))
                return [json.loads(m) async for m in ws], ws.close_code

        events, code = asyncio.run(go())
        assert code == 1000 and events[-1]["event"] == "done", events[-1]
        assert len(events[-1]["segments"]) >= 2
    finally:
        srv.stop()


def test_keys_never_reach_the_log_even_at_debug(keyed, pcm):
    """Issue 25 rows 7 and 8: at ``--log-level debug`` the WebSocket library traced each
    upgrade header (``< authorization: Bearer <key>``) and frame (``< TEXT '{"api_key": ...``)
    into uvicorn's logger, and uvicorn's INFO line of a socket carried its URL's query string
    (``?api_key=<key>``).  The key is in no line; the lines themselves still are."""
    import io
    import logging

    import grpc

    from lumen_core.serve import logs
    from lumen_core.serve.proto import lumen_pb2, lumen_pb2_grpc

    auth = {"Authorization": f"Bearer {KEY}"}
    buf = io.StringIO()
    undo = logs.configure("debug", "text", access=True, stream=buf)
    uvicorn_log = logging.getLogger("uvicorn.error")
    client_log = logging.getLogger("websockets.client")  # the test's own client: not the server
    levels = uvicorn_log.level, client_log.level
    uvicorn_log.setLevel(logging.DEBUG)  # what `lumen serve --log-level debug` sets
    client_log.setLevel(logging.INFO)
    try:
        async def go():
            url = ws_url(keyed)
            ev, _ = await stream(url, pcm[:3200], 0, additional_headers=auth)
            assert ev[-1]["event"] == "done"
            ev, _ = await stream(url, pcm[:3200], 0, first={"api_key": KEY})
            assert ev[-1]["event"] == "done"
            await refused(url + f"?api_key={KEY}&probabilities=true", {"event": "end"})

        asyncio.run(go())
        assert httpx.get(f"{keyed.url}/v1/tasks", headers=auth, timeout=10).status_code == 200
        with grpc.insecure_channel(keyed.grpc_target) as ch:
            with pytest.raises(grpc.RpcError):  # an empty request: refused after the key
                lumen_pb2_grpc.InferenceStub(ch).Infer(
                    lumen_pb2.InferRequest(task="vad"), metadata=[("authorization", auth[
                        "Authorization"])], timeout=10)
    finally:
        uvicorn_log.setLevel(levels[0])
        client_log.setLevel(levels[1])
        undo()
    text = buf.getvalue()
    assert '"WebSocket /v1/stream/vad" [accepted]' in text  # uvicorn's lines, without the query
    assert KEY not in text

"""``GET /v1/stream/{task}``: live speech segments over a WebSocket.

Protocol (one stream per socket, run as one sequence of the task, :class:`.audio.SegmentStream`):

- options in the query string (``mime``, ``probabilities``, ``lumen.vad.*``) and/or in a
  first *text* message ``{"mime": ..., "probabilities": true, "lumen.vad.threshold": "0.6",
  "api_key": ...}``; ``mime`` is ``audio/L16;rate=16000`` (the default) or
  ``audio/pcm;format=f32le;rate=16000``;
- then binary frames of any size (split samples are fine): the server re-chunks them to 512
  samples and answers ``{"event": "start", "ms": ...}`` / ``{"event": "end", "ms": ...}`` as
  soon as each boundary is settled (silero-vad's ``get_speech_timestamps`` semantics, so the
  events equal the whole file's segments), and ``{"event": "prob", "ms", "p"}`` per chunk when
  asked;
- a text message ``{"event": "end"}`` ends the stream: the last events, then
  ``{"event": "done", "segments": [...], "duration_ms": ...}`` and a normal close (1000);
- closing the socket (or losing it) ends the sequence at once and frees its slot;
- an error is ``{"event": "error", "error": {"code", "message", "field"}}`` and a close with
  code ``4000 + the HTTP status`` of the error (4400, 4401, 4404, 4413, 4415, 4429, 4503, 4500).

Backpressure: frames are read one at a time and each is run before the next is read, so a
client sending faster than the model is slowed by TCP flow control (uvicorn stops reading the
socket while a received frame waits for the app, so a stream holds at most about one frame,
plus its chunk requests); nothing is buffered without bound.  A message (frame) over ``[server]
max_payload_bytes`` closes the socket 1009 (uvicorn's ``ws_max_size``, set by the server).

API keys apply: ``Authorization: Bearer KEY`` on the upgrade, or ``"api_key"`` in the first
text message, within ``read_timeout_ms`` of the upgrade (else 4401); a key in the URL
(``?api_key=``) is refused, 4401.  Authentication comes before anything else (the task too).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ..config import DEFAULT_READ_TIMEOUT_MS
from ..errors import (
    InternalError,
    InvalidArgument,
    LumenError,
    TaskNotFound,
    Unauthenticated,
    Unavailable,
)
from . import audio, codec
from .auth import ApiKeys, unscope_error

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import RuntimeQueries

log = logging.getLogger("lumen.ws")

#: close code of an error: 4000 + its HTTP status
CLOSE_BASE = 4000
NORMAL_CLOSE = 1000
#: the most characters of a control (text) message
MAX_TEXT_CHARS = 16 * 1024
END_EVENTS = ("end", "eof", "close")
#: the first message's key (never in the URL: URLs are logged)
API_KEY = "api_key"
_KEY_HINT = ("send 'Authorization: Bearer <key>' on the upgrade or {\"api_key\": \"<key>\"} "
             "as the first message")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _control(text: str) -> dict:
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidArgument(f"a text message holds at most {MAX_TEXT_CHARS} characters",
                              "message")
    obj = codec.loads(text, "a text message", "message")
    if not isinstance(obj, dict):
        raise InvalidArgument("a text message must be a JSON object", "message")
    return obj


async def _first_message(websocket: WebSocket, timeout_s: Optional[float]) -> tuple:
    """(the first message, its control object when it is text, else None), waiting at most
    ``timeout_s`` (None: no limit) for it; WebSocketDisconnect when the client left."""
    try:
        msg = await asyncio.wait_for(websocket.receive(), timeout_s)
    except asyncio.TimeoutError:
        raise Unauthenticated(f"no API key arrived within {timeout_s:g} s "
                              f"(server.read_timeout_ms); {_KEY_HINT}", API_KEY) from None
    if msg["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(msg.get("code", NORMAL_CLOSE))
    text = msg.get("text")
    return msg, (_control(text) if text is not None else None)


class StreamEndpoint:
    """The WebSocket route of one HTTP app (its runtime, API keys and drain flag).

    ``auth_timeout_s`` (``[server] read_timeout_ms``): with API keys on, a socket that has not
    sent its key (on the upgrade, or in the first message) within it is closed 4401, so silent
    sockets cannot hold the server's connections; a socket is authenticated before anything
    else is looked at (an unknown task is 4401 for a caller without a key, not 4404)."""

    def __init__(self, runtime: RuntimeQueries, keys: ApiKeys, draining: Callable[[], bool],
                 auth_timeout_s: float = DEFAULT_READ_TIMEOUT_MS / 1000.0):
        self.runtime = runtime
        self.keys = keys
        self.draining = draining
        self.auth_timeout_s = auth_timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.handle(WebSocket(scope, receive, send))

    async def handle(self, websocket: WebSocket) -> None:
        await websocket.accept()
        stream: Optional[audio.SegmentStream] = None
        scope = None
        try:
            params = dict(websocket.query_params)
            scope, msg, first = await self._authenticate(websocket, params)
            if self.draining():
                raise Unavailable("the server is shutting down; not accepting new streams")
            task = websocket.path_params["task"]
            desc = audio.segment_task(self.runtime, task)
            if desc is None:
                if self.runtime.has_task(task):
                    raise InvalidArgument(f"task {task!r} does not produce speech segments",
                                          "task")
                raise TaskNotFound(f"unknown task {task!r}", "task")
            if msg is None:
                msg, first = await _first_message(websocket, None)
            if first is not None:
                first.pop(API_KEY, None)
                params.update({k: v for k, v in first.items() if k != "event"})
                msg = None  # consumed
            meta = {k: str(v) for k, v in params.items() if isinstance(k, str)}
            audio.check_keys(meta)
            options = audio.segment_options(meta, audio.task_options(desc))
            width = audio.stream_format(meta.get("mime", audio.L16_MIME), "mime")
            stream = audio.SegmentStream(self.runtime, task, options, width,
                                         audio.flag(meta.get(audio.PROBS_PARAM, "")),
                                         prefix="lumen-ws")
            if first is not None and str(first.get("event", "")).lower() in END_EVENTS:
                await self._finish(websocket, stream)
                return
            while True:
                if msg is None:
                    msg = await websocket.receive()
                kind = msg["type"]
                if kind == "websocket.disconnect":
                    return
                data = msg.get("bytes")
                if data is not None:
                    events = await stream.feed(data)
                    for ev in events:
                        await websocket.send_text(_dumps(ev))
                elif msg.get("text") is not None:
                    ctl = _control(msg["text"])
                    if str(ctl.get("event", "")).lower() in END_EVENTS:
                        await self._finish(websocket, stream)
                        return
                    raise InvalidArgument("after the first message, a text message may only "
                                          "be {\"event\": \"end\"}", "message")
                msg = None
        except WebSocketDisconnect:
            return
        except LumenError as exc:
            await self._error(websocket, unscope_error(exc, scope))
        except Exception as exc:  # noqa: BLE001 - a bug closes this socket, not the server
            log.exception("unhandled error on /v1/stream")
            await self._error(websocket, InternalError(f"internal server error: {exc}"))
        finally:
            if stream is not None and not stream.closed:
                await stream.abort()

    async def _authenticate(self, websocket: WebSocket, params: dict) -> tuple:
        """(the key's scope, the first message and its control object when it was read for
        the key, else None, None); Unauthenticated for a missing, wrong or late key, or one in
        the URL.  ``api_key`` is taken out of ``params``."""
        keys = self.keys
        in_url = params.pop(API_KEY, None) is not None
        if not keys.enabled:
            return None, None, None
        if in_url:
            raise Unauthenticated(f"an API key in the URL is refused (URLs are written to "
                                  f"logs); {_KEY_HINT}", API_KEY)
        header = websocket.headers.get("authorization")
        if header:
            return keys.check(header), None, None
        msg, first = await _first_message(websocket, self.auth_timeout_s)
        key = first.pop(API_KEY, None) if first is not None else None
        if not key:
            raise Unauthenticated(f"this server needs an API key: {_KEY_HINT}", API_KEY)
        return keys.check(f"Bearer {key}"), msg, first

    async def _finish(self, websocket: WebSocket, stream: audio.SegmentStream) -> None:
        for ev in await stream.close():
            await websocket.send_text(_dumps(ev))
        await websocket.send_text(_dumps({"event": "done", **stream.result()}))
        await websocket.close(NORMAL_CLOSE)

    @staticmethod
    async def _error(websocket: WebSocket, exc: LumenError) -> None:
        if websocket.application_state != WebSocketState.CONNECTED:
            return
        try:
            await websocket.send_text(_dumps({"event": "error", "error": exc.to_dict()}))
            await websocket.close(CLOSE_BASE + exc.http_status, exc.code)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass

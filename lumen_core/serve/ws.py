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
socket while a received frame waits for the app, so a stream holds at most about one frame of
at most ``ws_max_size`` bytes, plus its chunk requests); nothing is buffered without bound.  API keys apply: ``Authorization: Bearer KEY`` on the upgrade, or
``"api_key"`` in the first text message.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Optional

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ..errors import InternalError, InvalidArgument, LumenError, TaskNotFound, Unavailable
from . import audio
from .auth import ApiKeys, unscope_error

log = logging.getLogger("lumen.ws")

#: close code of an error: 4000 + its HTTP status
CLOSE_BASE = 4000
NORMAL_CLOSE = 1000
#: the most characters of a control (text) message
MAX_TEXT_CHARS = 16 * 1024
END_EVENTS = ("end", "eof", "close")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _control(text: str) -> dict:
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidArgument(f"a text message holds at most {MAX_TEXT_CHARS} characters",
                              "message")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"a text message must be a JSON object: {exc}", "message") from None
    if not isinstance(obj, dict):
        raise InvalidArgument("a text message must be a JSON object", "message")
    return obj


class StreamEndpoint:
    """The WebSocket route of one HTTP app (its runtime, API keys and drain flag)."""

    def __init__(self, runtime: Any, keys: ApiKeys, draining: Callable[[], bool]):
        self.runtime = runtime
        self.keys = keys
        self.draining = draining

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.handle(WebSocket(scope, receive, send))

    async def handle(self, websocket: WebSocket) -> None:
        await websocket.accept()
        stream: Optional[audio.SegmentStream] = None
        scope = None
        try:
            if self.draining():
                raise Unavailable("the server is shutting down; not accepting new streams")
            task = websocket.path_params["task"]
            desc = audio.segment_task(self.runtime, task)
            if desc is None:
                if self.runtime.has_task(task):
                    raise InvalidArgument(f"task {task!r} does not produce speech segments",
                                          "task")
                raise TaskNotFound(f"unknown task {task!r}", "task")
            params = dict(websocket.query_params)
            first: Optional[dict] = None
            header = websocket.headers.get("authorization")
            if self.keys.enabled and header:
                scope = self.keys.check(header)
            msg = await websocket.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("text") is not None:
                ctl = _control(msg["text"])
                params.update({k: v for k, v in ctl.items() if k not in ("event",)})
                msg = None  # consumed
                first = ctl
            if self.keys.enabled and not header:
                key = params.pop("api_key", None) if first is not None else None
                scope = self.keys.check(f"Bearer {key}" if key else None)
            params.pop("api_key", None)
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

"""Reading an HTTP request body under a limit: the one body reader of every HTTP route (the
native and OpenAI routes, the Open Inference Protocol, the admin API, whole audio files).

The body is refused with 413 as soon as it is known to exceed the limit: from Content-Length
before anything is read, else while counting the streamed chunks.  It is read from the ASGI
``receive`` channel, so a client that hangs up mid-body raises :class:`ClientGone` (nothing can
be sent to it) instead of a framework error.  One chunk is returned as the ``bytes`` object the
server produced (no copy); several are joined once.
"""
from __future__ import annotations

from typing import Any, Awaitable

from ..errors import InvalidArgument, PayloadTooLarge

#: what a body is called in the 413's message, and the setting that bounds it
REQUEST_BODY = "request body"
PAYLOAD_SETTING = "server.max_payload_bytes"
#: the most characters of a bad Content-Length header quoted back
MAX_HEADER_ECHO = 40


class ClientGone(Exception):
    """The client disconnected before its reply was ready (nothing can be sent)."""


def read_body(request: Any, limit: int, field: str, what: str = REQUEST_BODY,
              setting: str = PAYLOAD_SETTING) -> Awaitable[bytes]:
    """The whole body of ``request`` (a Starlette request), at most ``limit`` bytes; a larger
    one is a 413 on ``field`` naming ``what`` and the ``setting`` that bounds it."""
    return receive_body(request.receive, request.headers.get("content-length"), limit,
                        field, what, setting)


def check_declared(declared: str, limit: int, field: str, what: str = REQUEST_BODY,
                   setting: str = PAYLOAD_SETTING) -> None:
    """A Content-Length value that is not a number is a 400; one past ``limit`` a 413, before
    a byte of the body is read."""
    if not (declared.isascii() and declared.isdigit()):  # isdigit alone takes '\u00b2'
        raise InvalidArgument(f"bad Content-Length header {declared[:MAX_HEADER_ECHO]!r}",
                              "Content-Length")
    if int(declared) > limit:
        raise PayloadTooLarge(f"{what} is {declared} bytes; the limit is {limit} bytes "
                              f"({setting})", field)


async def receive_body(receive: Any, declared: Any, limit: int, field: str,
                       what: str = REQUEST_BODY, setting: str = PAYLOAD_SETTING) -> bytes:
    """:func:`read_body` from an ASGI ``receive`` and the Content-Length value ``declared``
    (None when absent), for a caller that has read the headers itself."""
    if declared is not None:
        check_declared(declared, limit, field, what, setting)
    chunks: list[bytes] = []
    total = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        chunk = msg.get("body", b"")
        if chunk:
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes ({setting})",
                                      field)
            chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)

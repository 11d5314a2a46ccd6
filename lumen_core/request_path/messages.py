# cython: annotation_typing=False
"""The request path's messages: ``InferRequest``, ``InferResponse``, ``ResponseStats``.

One source, two builds (as ``scheduler.py``): compiled with ``lumen_core/request_path/_messages.pxd`` into
``lumen_core.request_path._messages``, or run as its own pure-Python twin.  ``lumen_core.request`` re-exports
the classes ``native`` chose, so ``lumen_core.InferRequest``, ``lumen_core.request.InferRequest``
and what ``Runtime.infer`` returns are one class.

Nothing is made that nobody reads: a request's correlation id is generated (uuid4 hex) when it
is first read, not when the request is made; a response holds its batch's outputs and its row
and makes the ``{name: array}`` mapping when ``outputs`` is first read; its ``stats`` object and
``lumen.*`` meta strings are built from plain integers on demand.
"""
from __future__ import annotations

import uuid
from typing import Any, Dict, Optional

from ..contract import (
    RESP_BATCH_SIZE,
    RESP_COMPUTE_US,
    RESP_MODEL_VERSION,
    RESP_QUEUE_US,
    RESP_TOKENS,
)

#: the twin API (``lumen_core.request_path._messages`` exports the same names)
__all__ = ["InferRequest", "InferResponse", "ResponseStats", "respond"]

_uuid4 = uuid.uuid4


class InferRequest:
    """One logical input for one task (SPEC section 1).

    ``payload`` may be any C-contiguous buffer (bytes, bytearray, memoryview, numpy array) or,
    for tasks that take text, a ``str``; it is kept as given, never copied.  ``meta`` is a
    ``dict[str, str]``.  ``correlation_id`` is the caller's id for tracing; left empty, one is
    generated (uuid4 hex) the first time it is read.
    """

    __slots__ = ("task", "payload", "payload_mime", "meta", "_cid")

    def __init__(self, task: str, payload: Any = b"", payload_mime: str = "",
                 meta: Optional[Dict[str, str]] = None, correlation_id: str = ""):
        self.task = task
        self.payload = payload
        self.payload_mime = payload_mime
        self.meta = {} if meta is None else meta
        self._cid = correlation_id or ""

    @property
    def correlation_id(self) -> str:
        if not self._cid:
            self._cid = _uuid4().hex
        return self._cid

    @correlation_id.setter
    def correlation_id(self, value: str) -> None:
        self._cid = value or ""

    def __repr__(self) -> str:
        n: object
        try:
            n = memoryview(self.payload).nbytes
        except TypeError:
            n = "?"
        return (f"InferRequest(task={self.task!r}, payload=<{n} bytes>, "
                f"payload_mime={self.payload_mime!r}, meta={self.meta!r}, "
                f"correlation_id={self.correlation_id!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (InferRequest, (self.task, self.payload, self.payload_mime, self.meta, self._cid))


class ResponseStats:
    """Typed per-response figures: batch size, queue and compute time, token count, and the
    version of the task that served it.  The ``lumen.*`` response meta strings are derived
    from them only when someone asks for ``InferResponse.meta``."""

    __slots__ = ("batch_size", "queue_us", "compute_us", "tokens", "version")

    def __init__(self, batch_size: int = 0, queue_us: int = 0, compute_us: int = 0,
                 tokens: int = 0, version: str = ""):
        self.batch_size = batch_size
        self.queue_us = queue_us
        self.compute_us = compute_us
        self.tokens = tokens
        self.version = version

    def to_meta(self) -> Dict[str, str]:
        meta = {RESP_BATCH_SIZE: str(self.batch_size), RESP_QUEUE_US: str(self.queue_us),
                RESP_COMPUTE_US: str(self.compute_us)}
        if self.tokens:
            meta[RESP_TOKENS] = str(self.tokens)
        if self.version:
            meta[RESP_MODEL_VERSION] = self.version
        return meta

    def __repr__(self) -> str:
        return (f"ResponseStats(batch_size={self.batch_size}, queue_us={self.queue_us}, "
                f"compute_us={self.compute_us}, tokens={self.tokens}, "
                f"version={self.version!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (ResponseStats, (self.batch_size, self.queue_us, self.compute_us, self.tokens,
                                self.version))


class InferResponse:
    """One request's outputs (``outputs``: ``dict[str, numpy.ndarray]``), its ``stats`` and
    ``meta`` (``dict[str, str]``: the ``lumen.*`` response keys built from ``stats`` on first
    access, plus any explicit entries)."""

    __slots__ = ("task", "_cid", "_req", "_outputs", "_row", "_meta", "_stats", "_batch_size",
                 "_queue_us", "_compute_us", "_tokens", "_version")

    def __init__(self, correlation_id: str, task: str, outputs: Dict[str, Any],
                 meta: Optional[Dict[str, str]] = None, stats: Optional[ResponseStats] = None):
        self._cid = correlation_id
        self._req: Optional[InferRequest] = None
        self.task = task
        # a dict, or a batch's outputs whose row(i) splits out this response's (self._row >= 0)
        self._outputs: Any = outputs
        self._row = -1
        self._meta = meta
        self._stats = stats
        self._batch_size = -1  # -1: the figures are ``_stats`` (or there are none)
        self._queue_us = self._compute_us = self._tokens = 0
        self._version = ""

    @property
    def correlation_id(self) -> str:
        req = self._req
        if req is not None:  # the request's id, generated only now that someone asks
            self._cid = req.correlation_id
            self._req = None
        return self._cid

    @property
    def outputs(self) -> Dict[str, Any]:
        if self._row >= 0:  # a row of the batch's outputs, split out on first read
            self._outputs = self._outputs.row(self._row)
            self._row = -1
        # a dict once the row is split out (typed Any for the Rows before it; no local here:
        # this is read once per response)
        return self._outputs  # type: ignore[no-any-return]

    @property
    def stats(self) -> Optional[ResponseStats]:
        if self._stats is None and self._batch_size >= 0:
            self._stats = ResponseStats(self._batch_size, self._queue_us, self._compute_us,
                                        self._tokens, self._version)
        return self._stats

    @property
    def meta(self) -> Dict[str, str]:
        meta = self._meta
        stats = self.stats
        if meta is None or (stats is not None and RESP_BATCH_SIZE not in meta):
            built = stats.to_meta() if stats is not None else {}
            if meta:
                built.update(meta)
            meta = self._meta = built
        return meta

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InferResponse):
            return NotImplemented
        return (self.correlation_id, self.task, self.outputs, self.meta) == (
            other.correlation_id, other.task, other.outputs, other.meta)

    def __repr__(self) -> str:
        return (f"InferResponse(correlation_id={self.correlation_id!r}, task={self.task!r}, "
                f"outputs={sorted(self.outputs)}, meta={self.meta!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (InferResponse, (self.correlation_id, self.task, self.outputs, self.meta,
                                self.stats))


def respond(req: InferRequest, outcome: Any, row: int, batch_size: int, queue_us: int,
            compute_us: int, tokens: int, version: str) -> InferResponse:
    """The response to ``req`` from the runtime's request path: ``outcome`` is the result
    mapping (its ``meta`` attribute, if any, becomes response meta) or, with ``row >= 0``, the
    batch's outputs (``entries.Rows``) of which it is row ``row``."""
    r = InferResponse.__new__(InferResponse)
    cid = ""
    if type(req) is InferRequest:
        rq = req
        cid = rq._cid
    if cid:
        r._cid = cid
        r._req = None
    else:
        r._cid = ""
        r._req = req
    r.task = req.task
    r._outputs = outcome
    r._row = row
    r._meta = getattr(outcome, "meta", None) if row < 0 else None
    r._stats = None
    r._batch_size = batch_size
    r._queue_us = queue_us
    r._compute_us = compute_us
    r._tokens = tokens
    r._version = version
    return r

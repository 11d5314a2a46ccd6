"""Per-task response cache (``[tasks.cache] max_bytes``, ``ttl_s``).

A byte-bounded LRU of finished responses.  The key is everything that decides a response:

* the task and the model version that serves it (an explicit input: a response computed by
  one version is never returned for another);
* the request's execution signature as it declares it: payload mime plus the descriptor keys
  (input kind, tensor dtype / shape / layout / format / byte order, preprocess id, model id);
* every other request option, verbatim (``lumen.embedding.dimensions``,
  ``lumen.embedding.type``, ``truncate``, ``normalize``, ... and any option a later backend
  reads): only the keys that change *when* or *how urgently* a request runs, never *what* it
  returns (``SCHEDULING_KEYS``), are left out.  Spelling variants (``truncate=1`` vs
  ``truncate=true``) are different keys: a miss, never a wrong answer;
* a 128-bit BLAKE2b digest of the payload bytes (a ``str`` payload hashed as UTF-8 with a
  tag, so it never collides with a bytes payload of another mime);
* the *tenant* asking (:data:`TENANT`: the API key's scope, which the transports set when they
  authenticate a call): a response computed for one key is never served to another, nor
  shared with another's identical request while it runs, so neither a ``hit`` nor the time
  of an answer tells a key what another key sent.  In process, or with no keys, there is
  one tenant.

A hit skips preprocessing and the batcher; its response meta carries ``lumen.cache=hit``
(``miss`` on the request that computed it, ``coalesced`` on requests that waited for an
identical computation already running).  Identical concurrent misses coalesce: the first starts
one computation (an asyncio task) and every caller awaits it; it fails every waiter with the
same error and is then not cached; a caller that goes away stops waiting, and the computation
is cancelled only when no caller is left.  An entry older than ``ttl_s`` (0: no expiry) is
never served: it is dropped when looked up.  Stored outputs are private read-only copies (a
row of a batch output is a view that would keep the whole batch buffer alive and count wrong).

Stateful tasks (sequences) cannot be cached: a response depends on the sequence's state.
The cache is a stage of its task's route (``Route.cache``, answered through
``Dispatcher.cached``): a task without one pays one ``is not None`` test and runs exactly the
uncached code.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Optional

import numpy as np

from .contract import (
    KEY_PRIORITY,
    KEY_SEQUENCE_END,
    KEY_SEQUENCE_ID,
    KEY_SEQUENCE_START,
    KEY_TIMEOUT_MS,
    RESP_CACHE,
)
from .errors import DeadlineExceeded
from .request import InferResponse, ResponseStats

#: the tenant of the request being served in this context (an API key's scope; None: no keys,
#: or a caller in process): part of every cache key
TENANT: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("lumen_tenant",
                                                                      default=None)
#: request meta that never changes a response's content, only its scheduling
SCHEDULING_KEYS = frozenset({KEY_PRIORITY, KEY_TIMEOUT_MS, KEY_SEQUENCE_ID, KEY_SEQUENCE_START,
                             KEY_SEQUENCE_END})
#: ``lumen.cache`` values
HIT, MISS, COALESCED = "hit", "miss", "coalesced"
#: bytes charged per entry beyond its arrays (key tuple, dicts, the LRU link): an estimate
#: that keeps many tiny entries from looking free
ENTRY_OVERHEAD_BYTES = 256
DIGEST_BYTES = 16


def payload_digest(payload: Any) -> bytes:
    """BLAKE2b-128 of a payload: a buffer's bytes, or a ``str`` as tagged UTF-8."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    if type(payload) is str:
        h.update(b"s\x00")
        h.update(payload.encode("utf-8", "surrogatepass"))
    else:
        h.update(b"b\x00")
        h.update(payload)
    return h.digest()


class _Entry:
    __slots__ = ("outputs", "meta", "tokens", "nbytes", "expires")

    def __init__(self, outputs: dict, meta: Optional[dict], tokens: int, nbytes: int,
                 expires: float):
        self.outputs = outputs
        self.meta = meta
        self.tokens = tokens
        self.nbytes = nbytes
        self.expires = expires


class _Flight:
    """One computation that identical misses wait for."""

    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Task):
        self.task = task
        self.waiters = 0


def _frozen(outputs: Any) -> tuple:
    """(read-only private copies of the output arrays, their bytes)."""
    out = {}
    nbytes = 0
    for name, arr in outputs.items():
        a = np.array(arr, copy=True)
        a.setflags(write=False)
        out[name] = a
        nbytes += a.nbytes + len(name)
    return out, nbytes


class ResponseCache:
    """The LRU of one task.  ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(self, task: str, max_bytes: int, ttl_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.task = task
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict = OrderedDict()
        self._flights: dict = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.coalesced = 0
        self.evictions = 0
        self.expired = 0

    # -- keys -------------------------------------------------------------------------------
    def key(self, version: str, payload_mime: str, meta: Any, payload: Any) -> tuple:
        """The cache key of a request served by model version ``version`` for the tenant of
        this context.  Each option value goes in with its type: ``False == 0`` and ``True ==
        1`` in Python, and an in-process caller's ``{"normalize": 0}`` (a 400) must not hit the
        entry of ``{"normalize": False}``."""
        opts = tuple(sorted((k, type(v).__name__, v) for k, v in meta.items()
                            if k not in SCHEDULING_KEYS)) if meta else ()
        return (self.task, version, payload_mime, opts, payload_digest(payload), TENANT.get())

    # -- the LRU ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> Optional[_Entry]:
        """The live entry of ``key`` (now most recently used), or None (an expired one is
        dropped)."""
        e = self._entries.get(key)
        if e is None:
            return None
        if e.expires and self.clock() >= e.expires:
            self._drop(key)
            self.expired += 1
            return None
        self._entries.move_to_end(key)
        return e

    def put(self, key: tuple, outputs: Any, meta: Optional[dict], tokens: int) -> bool:
        """Store a response; False when it alone exceeds ``max_bytes`` (then nothing is
        evicted for it).  Least recently used entries go until it fits."""
        arrays, nbytes = _frozen(outputs)
        nbytes += ENTRY_OVERHEAD_BYTES + sum(len(str(x)) for x in key[3]) + len(key[2])
        if nbytes > self.max_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        while self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        expires = self.clock() + self.ttl_s if self.ttl_s else 0.0
        self._entries[key] = _Entry(arrays, dict(meta) if meta else None, tokens, nbytes, expires)
        self.bytes += nbytes
        return True

    def _drop(self, key: tuple) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "coalesced": self.coalesced,
                "evictions": self.evictions, "expired": self.expired, "bytes": self.bytes,
                "entries": len(self._entries), "max_bytes": self.max_bytes}

    # -- the request path -------------------------------------------------------------------
    async def fetch(self, key: tuple, req: Any, compute: Callable[[], Awaitable[InferResponse]],
                    timeout_ms: int = 0, where: Optional[list] = None) -> InferResponse:
        """``req``'s response: from the cache, from an identical computation already running,
        or from ``compute()`` (then stored unless it failed).  ``where[0]``, when given, is
        set to how it was answered (``HIT`` / ``MISS`` / ``COALESCED``) before any wait, so a
        caller can tell an error of its own computation from one it shared.  A request that
        waits for another's computation still keeps its own deadline (``timeout_ms``)."""
        e = self.get(key)
        if e is not None:
            self.hits += 1
            if where is not None:
                where[0] = HIT
            return self._respond(req, e.outputs, e.meta, e.tokens, HIT, version=key[1])
        flight = self._flights.get(key)
        if flight is None:
            self.misses += 1
            flight = self._flights[key] = _Flight(asyncio.ensure_future(self._compute(key, compute)))
            state = MISS
        else:
            self.coalesced += 1
            state = COALESCED
        if where is not None:
            where[0] = state
        flight.waiters += 1
        try:
            if state == COALESCED and timeout_ms > 0:
                try:
                    resp, outputs = await asyncio.wait_for(asyncio.shield(flight.task),
                                                           timeout_ms / 1000)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(f"deadline of {timeout_ms} ms expired while waiting "
                                           f"for an identical request's result",
                                           KEY_TIMEOUT_MS) from None
            else:
                resp, outputs = await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if not flight.task.done() and flight.waiters == 1:
                flight.task.cancel()  # nobody waits any more: stop the queued work
            raise
        finally:
            flight.waiters -= 1
        tokens = resp.stats.tokens if resp.stats is not None else 0
        return self._respond(req, outputs, getattr(resp.outputs, "meta", None), tokens, state,
                             resp.stats if state == MISS else None, key[1])

    async def _compute(self, key: tuple, compute: Callable[[], Awaitable[InferResponse]]) -> tuple:
        """(the computed response, the outputs to answer with: the stored read-only copies,
        or the response's own when it was too big to store)."""
        try:
            resp = await compute()
            stored = self.put(key, resp.outputs, getattr(resp.outputs, "meta", None),
                              resp.stats.tokens if resp.stats is not None else 0)
            return resp, (self._entries[key].outputs if stored else resp.outputs)
        finally:
            # errors (and cancellation) are never cached: the next request computes again
            self._flights.pop(key, None)

    @staticmethod
    def _respond(req: Any, outputs: dict, meta: Optional[dict], tokens: int, state: str,
                 stats: Optional[ResponseStats] = None, version: str = "") -> InferResponse:
        """A response of ``outputs``; ``stats`` are the computation's own for the request that
        ran it, else zeros (no batch, no queue) with the stored token count."""
        m = dict(meta) if meta else {}
        m[RESP_CACHE] = state
        return InferResponse(req.correlation_id, req.task, dict(outputs), m,
                             stats if stats is not None else ResponseStats(0, 0, 0, tokens, version))

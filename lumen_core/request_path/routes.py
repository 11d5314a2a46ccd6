# cython: annotation_typing=False
"""A task version as the request path sees it, and the preparations it runs without a Python frame.

Compiled like ``dispatch.py`` (one source; ``_routes.pxd`` adds the C types, and the dispatcher
cimports them, so a route's fields and its ``prepare`` are C to it).

- :class:`Route` -- a task version's dispatch record: its batcher, contract, preparation and
  deadline/priority defaults, resolved once at load;
- :class:`DenseTensor` and :class:`TextPrep` -- the dense tensor route and plain text, prepared
  in C;
- :func:`route_of` -- the metrics route a request claims before it is validated.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ..contract import KEY_INPUT_KIND
from ..errors import InternalError, InvalidArgument, LumenError

if TYPE_CHECKING:  # the entries' types (compiled: cimported by _routes.pxd)
    from . import entries

log = logging.getLogger("lumen")

#: the twin API (``lumen_core.request_path._routes`` exports the same names)
__all__ = ["DenseTensor", "Route", "TextPrep", "route_of"]

# the entries of this module's own kind, by a visible import: the compiled module (``_routes``)
# works with the compiled ones, whose C types it cimports (_routes.pxd)
if __name__.endswith("._routes"):
    from . import _entries as _ent  # type: ignore[attr-defined]
else:
    from . import entries as _ent
#: the metrics routes a request may take (defined with the entry that carries one)
RAW: str = _ent.RAW
TENSOR: str = _ent.TENSOR
_Prepared: type[entries.Prepared] = _ent.Prepared


class DenseTensor:
    """The tensor route of a model with one dense input, prepared in C: the payload is the
    item, under the signature of its (dtype, per-item shape, preprocess id).

    ``make_signature(dtype, item_shape, preprocess_id)`` builds a signature the first time a
    combination is seen; at most ``max_cached`` are remembered.
    """

    __slots__ = ("make_signature", "signatures", "max_cached")

    def __init__(self, make_signature: Callable[..., Any], max_cached: int = 256):
        self.make_signature = make_signature
        self.signatures: dict[tuple[Any, ...], Any] = {}
        self.max_cached = max_cached

    def prepare(self, desc: Any, payload: Any) -> entries.Prepared:
        item_shape = desc.shape[1:]
        key = (desc.dtype, item_shape, desc.preprocess_id)
        sig = self.signatures.get(key)
        if sig is None:
            sig = self.make_signature(desc.dtype, item_shape, desc.preprocess_id, desc.layout)
            if len(self.signatures) < self.max_cached:
                self.signatures[key] = sig
        return _Prepared(sig, (payload,), item_shape, 0)


class TextPrep:
    """The raw text route of a tokenizing backend, prepared in C in its common case: a request
    without meta whose payload is a ``str`` or UTF-8 bytes under one of ``mimes``, short enough
    (``max_chars``) to tokenize on the loop, whose ``encode(text).ids`` fit the model
    (``max_tokens``) without truncation.  Anything else -- options, other charsets, long or
    truncated texts, text that is not text -- is the backend's (:meth:`prepare` returns None)."""

    __slots__ = ("encode", "signature", "max_tokens", "max_chars", "mimes")

    def __init__(self, encode: Callable[[str], Any], signature: Any, max_tokens: int,
                 max_chars: int, mimes: frozenset[str]):
        self.encode = encode
        self.signature = signature
        self.max_tokens = max_tokens
        self.max_chars = max_chars
        self.mimes = mimes

    def prepare(self, req: Any, payload: Any) -> Optional[entries.Prepared]:
        mime = req.payload_mime
        if req.meta or type(mime) is not str or mime not in self.mimes:
            return None  # (a mime that is not a str is the backend's to refuse, 415)
        if type(payload) is str:
            text = payload
        else:
            try:
                text = str(payload, "utf-8")
            except UnicodeDecodeError:
                return None
        if not text or len(text) > self.max_chars:
            return None
        try:
            ids = self.encode(text).ids
        except TypeError:  # lone surrogates: the backend says what is wrong
            return None
        n = len(ids)
        if n > self.max_tokens:
            return None
        return _Prepared(self.signature, (np.array(ids, dtype=np.int64),), (), n)


def route_of(meta: Any) -> str:
    """The metrics route a request claims (``tensor`` or ``raw``), before it is validated."""
    kind = meta.get(KEY_INPUT_KIND) if isinstance(meta, dict) else None
    return TENSOR if kind == TENSOR else RAW


class Route:
    """A loaded task version as the request path sees it, resolved once at load: the
    backend's contract and preparation, the batcher, the priority and deadline defaults.

    ``router`` is None unless the task serves several versions (``versions.Router`` picks
    one per request); ``holds`` counts requests routed here that are still being prepared off
    the loop (a version is unloaded only once nothing holds it); ``cache`` is the task's
    ``ResponseCache`` or None.
    """

    __slots__ = ("name", "version", "backend", "contract", "batcher", "router", "holds", "cache",
                 "priority_levels", "default_priority", "default_timeout_ms", "dense", "text",
                 "off_loop", "inline_max", "stateful")

    def __init__(self, name: str, version: str, backend: Any, batcher: Any,
                 priority_levels: int = 1, default_priority: int = 0,
                 default_timeout_ms: int = 0):
        self.name = name
        self.version = version
        self.backend = backend
        self.contract = backend.contract
        self.batcher = batcher
        self.router: Optional[Callable[[Any], Route]] = None
        self.holds = 0
        self.cache: Any = None  # cache.ResponseCache
        self.priority_levels = priority_levels
        self.default_priority = default_priority or priority_levels
        self.default_timeout_ms = default_timeout_ms
        dense = getattr(backend, "dense_tensor", None)
        self.dense = dense() if dense is not None else None
        text = getattr(backend, "text_fast_path", None)
        self.text = text() if text is not None else None
        self.stateful = bool(backend.stateful)
        # stateful tasks are admitted in arrival order, inline: never off the loop
        self.off_loop = bool(backend.prepare_off_loop) and not self.stateful
        self.inline_max = -1 if self.stateful else backend.inline_prepare_max_bytes

    def policy(self, desc: Any) -> tuple[int, int]:
        """(priority, timeout_ms) of a request: its own values within the task's limits."""
        priority = desc.priority or self.default_priority
        if priority > self.priority_levels:
            raise InvalidArgument(f"lumen.priority must be 1..{self.priority_levels} for task "
                                  f"{self.name!r}, got {priority}", "lumen.priority")
        timeout_ms = self.default_timeout_ms
        if desc.timeout_ms:
            # a request may only tighten the task's deadline, never extend it
            timeout_ms = min(timeout_ms, desc.timeout_ms) if timeout_ms else desc.timeout_ms
        return priority, timeout_ms

    def prepares_off_loop(self, nbytes: int) -> bool:
        """True when a payload of ``nbytes`` is prepared on the bounded pool."""
        return self.off_loop or (self.inline_max >= 0 and nbytes > self.inline_max)

    def prepare(self, req: Any, desc: Any, payload: Any) -> Any:
        """The prepared item of ``req`` (its descriptor ``desc``, its payload buffer): a dense
        tensor or plain text in C (``DenseTensor``, ``TextPrep``), anything else by the backend; a backend bug on odd input is
        logged and answered ``InternalError``, never a crash."""
        if desc.kind == TENSOR:
            if self.dense is not None:
                return self.dense.prepare(desc, payload)
        elif self.text is not None:
            prepared = self.text.prepare(req, payload)
            if prepared is not None:
                return prepared
        try:
            return self.backend.prepare(req, desc, payload)
        except LumenError:
            raise
        except Exception as exc:
            log.error("task %s: prepare failed", self.name, exc_info=exc)
            raise InternalError(f"task {self.name!r} failed to prepare the input: {exc}") from exc

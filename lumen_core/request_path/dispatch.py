# cython: annotation_typing=False
"""The request path's admission side: routes, validation, preparation, ``Runtime.infer``.

Compiled like ``scheduler.py`` (one source, ``lumen_core/request_path/_dispatch.pxd`` adds the C types and
cimports the scheduler's ``Batcher``, the latency guard's and the entries', so calls into the
queue side are C calls).

- :class:`Dispatcher` -- the runtime's table of routes (``routes.Route``, a task version's
  record) and ``infer`` / ``infer_many`` / ``admit`` / ``settle``: route, validate
  (``native.descriptor``), prepare, admit, await, respond.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .. import native
from ..cache import MISS
from ..contract import KEY_MODEL_VERSION, KEY_TIMEOUT_MS
from ..errors import (
    DeadlineExceeded,
    InvalidArgument,
    LumenError,
    PayloadTooLarge,
    TaskNotFound,
    Unavailable,
)
from ..request import InferRequest, InferResponse

if TYPE_CHECKING:  # the queue side's and the routes' types (compiled: cimported by _dispatch.pxd)
    from . import entries, routes

log = logging.getLogger("lumen")

#: the twin API (``lumen_core.request_path._dispatch`` exports the same names)
__all__ = ["Dispatcher"]

# the neighbours of this module's own kind, by a visible import: the compiled module
# (``_dispatch``) works with the compiled ones, whose C types it cimports (_dispatch.pxd); the
# pure twin with the pure ones, so each implementation is tested whole
if __name__.endswith("._dispatch"):
    from . import _entries as _ent  # type: ignore[attr-defined]
    from . import _messages as _msg  # type: ignore[attr-defined]
    from . import _routes as _rt  # type: ignore[attr-defined]
    from . import _scheduler as _sch  # type: ignore[attr-defined]
else:
    from . import entries as _ent
    from . import messages as _msg
    from . import routes as _rt
    from . import scheduler as _sch
#: the metrics routes a request may take (defined with the entry that carries one)
RAW: str = _ent.RAW
TENSOR: str = _ent.TENSOR
_Prepared: type[entries.Prepared] = _ent.Prepared
_Rows = _ent.Rows
_CancelledError = asyncio.CancelledError
_monotonic_ns = time.monotonic_ns
_respond: Callable[..., InferResponse] = _msg.respond
route_of = _rt.route_of
group_too_large = _sch.group_too_large


class Dispatcher:
    """The runtime's request path: its routes (task name -> the head :class:`Route`),
    ``infer`` and ``infer_many``.

    ``observe`` is the metrics hook (``Observer.request``) or None; ``trace`` the runtime's
    ``tracing.Tracing`` or None; ``pool`` the bounded preprocessing pool; ``max_payload``
    ``server.max_payload_bytes``.  ``ready`` and ``closing`` follow the runtime's life cycle.

    ``infer`` is a coroutine with three C calls in it: :meth:`admit` (route, validate,
    prepare, queue, trace: everything up to the await), the await of the entry's future, and
    :meth:`finish` (observe, respond).  A request prepared off the loop (a large or heavy
    input) is admitted by :meth:`admit_off_loop` instead.
    """

    __slots__ = ("routes", "ready", "closing", "max_payload", "observe", "trace", "pool")

    def __init__(self, max_payload: int, pool: Any):
        self.routes: dict[str, routes.Route] = {}
        self.ready = False
        self.closing = False
        self.max_payload = max_payload
        self.observe: Optional[Callable[..., None]] = None
        self.trace: Any = None  # tracing.Tracing
        self.pool = pool

    # -- routing and validation --------------------------------------------------------------
    def route(self, name: Any) -> routes.Route:
        """The head route of task ``name``; ``TaskNotFound`` / ``Unavailable`` otherwise."""
        task = self.routes.get(name)
        if task is None:
            if self.closing or not self.ready:
                raise Unavailable("the runtime is not running (starting or shutting down)")
            raise TaskNotFound.unknown(name, self.routes)
        if self.closing:
            raise Unavailable("the runtime is shutting down; not accepting requests")
        return task

    def routed(self, req: Any) -> routes.Route:
        """The route (task version) that serves ``req``: its task's head, or the version a
        pin or the traffic split picks when the task serves several."""
        route = self.routes.get(req.task)
        if route is None or self.closing:
            route = self.route(req.task)
        if route.router is not None:
            route = route.router(req.meta)
        return route

    def payload(self, payload: Any, route: routes.Route) -> tuple[Any, int]:
        """(payload, nbytes): a C-contiguous buffer as a memoryview, or a ``str`` for a task
        that takes text (its size counted in code points: each is at least one byte)."""
        if type(payload) is str:
            if not route.backend.accepts_text:
                raise InvalidArgument(f"task {route.name!r} takes no text input; send its "
                                      f"input as bytes or a tensor (see /v1/tasks)", "payload")
            n = len(payload)
        else:
            try:
                payload = memoryview(payload)
            except TypeError:
                raise InvalidArgument(f"payload must be a bytes-like buffer, got "
                                      f"{type(payload).__name__}", "payload") from None
            if not payload.c_contiguous:
                raise InvalidArgument("payload buffer must be C-contiguous", "payload")
            n = payload.nbytes
        if n > self.max_payload:
            raise PayloadTooLarge(f"payload is {n} bytes; the limit is {self.max_payload} "
                                  f"(server.max_payload_bytes)", "payload")
        return payload, n

    def observed(self, route: Optional[routes.Route], kind: Any, code: str, t0: int,
                 e: Optional[entries.Entry] = None) -> None:
        """Report one finished request to the metrics hook (when there is one)."""
        if self.observe is not None and route is not None:
            self.observe(route.name, kind, code, (_monotonic_ns() - t0) // 1000,
                         e.queue_us if e is not None else 0,
                         e.compute_us if e is not None else 0, route.version)

    # -- admission: the one sequence every door runs ------------------------------------------
    def checked(self, route: routes.Route, desc: Any, late: bool) -> tuple[int, int]:
        """(priority, timeout_ms) of a request on ``route`` whose meta parsed to ``desc``: its
        own values within the task's policy, and -- when ``late`` -- refused now if the task's
        latency budget cannot take it (before paying to prepare it).  The one policy stage of
        every door: :meth:`admit` (which skips the call when nothing asks for it: no priority,
        no deadline, no latency target), :meth:`admit_off_loop`, the items of
        :meth:`infer_many` and the response cache's :meth:`cached`."""
        priority, timeout_ms = route.policy(desc)
        guard = route.batcher.guard
        if late and guard is not None and guard.target_ns and not route.stateful:
            route.batcher.refuse_late(priority, timeout_ms)
        return priority, timeout_ms

    # -- infer --------------------------------------------------------------------------------
    async def infer(self, req: Any, cached: bool = True) -> InferResponse:
        """Route by task, validate, prepare, queue, await the batch, respond (``Runtime.infer``).

        A task with a response cache answers through :meth:`cached` (a stage of its route:
        ``cached=False`` is the computation behind the cache)."""
        entry = self.admit(req, cached)
        if entry is None:
            route = self.routed(req)
            if cached and route.cache is not None:
                return await self.cached(req, route)
            entry = await self.admit_off_loop(req)
        try:
            await entry.waiter
        except _CancelledError:
            self.cancelled(entry)
            raise
        except LumenError as exc:
            self.failed(entry, exc)
            raise
        return self.finish(req, entry)

    def admit(self, req: Any, cached: bool = True) -> Optional[entries.Entry]:
        """Everything before the await: route, validate, prepare inline, queue; None when the
        input is prepared off the loop (:meth:`admit_off_loop`) or the task answers through
        its response cache (``cached``).  A refused request is observed here and raises."""
        route = self.routes.get(req.task)
        if route is None or self.closing:
            route = self.route(req.task)
        if cached and route.cache is not None:
            return None
        t0 = 0
        kind = RAW
        if self.observe is not None:  # a request refused before its meta parses keeps its route
            t0 = _monotonic_ns()
            kind = route_of(req.meta)
        try:
            if route.router is not None:  # several versions: a pin or the split picks
                route = route.router(req.meta)
            payload = req.payload
            try:
                payload = memoryview(payload)
                nbytes = payload.nbytes
                if nbytes > self.max_payload or not payload.c_contiguous:
                    raise TypeError
            except TypeError:
                payload, nbytes = self.payload(req.payload, route)
            if route.prepares_off_loop(nbytes):
                return None
            desc = native.descriptor.parse_meta(req.meta, nbytes, route.contract)
            guard = route.batcher.guard  # a latency target: the check may refuse it now
            if desc.priority or desc.timeout_ms or (guard is not None and guard.target_ns):
                priority, timeout_ms = self.checked(route, desc, True)
            else:  # the common case, without a call: the task's defaults
                priority = route.default_priority
                timeout_ms = route.default_timeout_ms
            kind = desc.kind
            prepared = route.prepare(req, desc, payload)
            entry = route.batcher.submit(prepared, desc, priority, timeout_ms)
        except LumenError as exc:
            self.observed(route, kind, exc.code, t0, None)
            raise
        return self.admitted(entry, route, kind, t0)

    def admitted(self, entry: entries.Entry, route: routes.Route, kind: Any, t0: int) -> entries.Entry:
        """``entry`` is queued on ``route``: remember for whom, open its span if tracing."""
        entry.route = route
        entry.kind = kind
        entry.t0 = t0
        if self.trace is not None:  # the one tracing check a request pays (tracing.py)
            self.trace.admitted(route, kind, entry)
        return entry

    def settle(self, req: Any, entry: entries.Entry) -> InferResponse:
        """The answer of ``entry`` (admitted by :meth:`admit`) once its future is done, for a
        door that waits by a callback on ``entry.waiter`` instead of an await (the HTTP door on
        Lumen's own connections: no task per request): the response, or the error raised,
        observed as :meth:`infer` observes them; a cancelled future is :meth:`cancelled` and
        raises CancelledError."""
        w = entry.waiter
        if w.cancelled():
            self.cancelled(entry)
            raise _CancelledError()
        exc = w.exception()
        if exc is not None:
            if isinstance(exc, LumenError):
                self.failed(entry, exc)
            raise exc
        return self.finish(req, entry)

    def failed(self, entry: entries.Entry, exc: LumenError) -> None:
        """``entry`` was answered with an error: observed under its code."""
        self.observed(entry.route, entry.kind, exc.code, entry.t0, None)

    def cancelled(self, entry: entries.Entry) -> None:
        """The caller of ``entry`` went away (its task was cancelled)."""
        entry.route.batcher.cancel(entry)
        self.observed(entry.route, entry.kind, "cancelled", entry.t0, None)

    def finish(self, req: Any, entry: entries.Entry) -> InferResponse:
        """The answered request: observed, and its response made."""
        if self.observe is not None:
            self.observed(entry.route, entry.kind, "ok", entry.t0, entry)
        return respond(req, entry.route, entry)

    async def admit_off_loop(self, req: Any) -> entries.Entry:
        """:meth:`admit` of an input prepared on the bounded pool (large or heavy)."""
        route = self.route(req.task)
        t0 = _monotonic_ns()
        kind = route_of(req.meta)
        try:
            route = self.routed(req)
            payload, nbytes = self.payload(req.payload, route)
            desc = native.descriptor.parse_meta(req.meta, nbytes, route.contract)
            priority, timeout_ms = self.checked(route, desc, True)
            kind = desc.kind
            prepared, timeout_ms = await self.prepare_off_loop(route, req, desc, payload,
                                                               nbytes, timeout_ms)
            entry = route.batcher.submit(prepared, desc, priority, timeout_ms)
        except LumenError as exc:
            self.observed(route, kind, exc.code, t0, None)
            raise
        except _CancelledError:
            self.observed(route, kind, "cancelled", t0, None)
            raise
        return self.admitted(entry, route, kind, t0)

    async def prepare_off_loop(self, route: routes.Route, req: Any, desc: Any, payload: Any,
                               nbytes: int, timeout_ms: int) -> tuple[Any, int]:
        """(prepared, timeout left for the queue) for a heavy input, prepared on the bounded
        pool (``prepare_pool.py``): its deadline runs from here and covers the wait for a
        thread, the preprocessing and then the batch queue."""
        t0 = _monotonic_ns()
        # the version stays loaded until the request is queued on it (versions.py drains it
        # only once nothing holds it; the caller submits right after this returns)
        route.holds += 1
        try:
            prepared = await self.pool.run(functools.partial(route.prepare, req, desc, payload),
                                           nbytes, timeout_ms)
        finally:
            route.holds -= 1
        if timeout_ms:
            left = timeout_ms - (_monotonic_ns() - t0) // 1_000_000
            if left <= 0:
                raise DeadlineExceeded(f"deadline of {timeout_ms} ms expired during "
                                       f"preprocessing", KEY_TIMEOUT_MS)
            timeout_ms = left
        return prepared, timeout_ms

    # -- the response cache: a stage of a cached task's route (cache.py) ----------------------
    async def cached(self, req: Any, route: routes.Route) -> InferResponse:
        """``req`` on ``route`` (the version a pin or the split picked: it is in the key, and
        the computation runs on exactly that version), validated as any request is, then
        answered from the task's cache, by an identical computation already running, or by
        :meth:`infer` without the cache."""
        cache = route.cache
        t0 = _monotonic_ns()
        kind = route_of(req.meta)
        where: list[Any] = [None]
        try:
            payload, nbytes = self.payload(req.payload, route)
            desc = native.descriptor.parse_meta(req.meta, nbytes, route.contract)
            timeout_ms = self.checked(route, desc, False)[1]
            kind = desc.kind
            key = cache.key(route.version, req.payload_mime, req.meta, payload)
            run = req
            meta = req.meta or {}
            head = self.routes.get(req.task)
            if head is not None and head.router is not None \
                    and meta.get(KEY_MODEL_VERSION) != route.version:
                # computed on the version the key names: pinned like a caller's pin
                run = InferRequest(req.task, req.payload, req.payload_mime,
                                   {**meta, KEY_MODEL_VERSION: route.version},
                                   req.correlation_id)
            resp: InferResponse = await cache.fetch(key, req, functools.partial(self.infer, run, False),
                                     timeout_ms, where)
        except LumenError as exc:
            if where[0] != MISS:  # a miss: the computation observed it
                self.observed(route, kind, exc.code, t0, None)
            raise
        if where[0] != MISS:
            self.observed(route, kind, "ok", t0, None)
        return resp

    # -- infer_many ---------------------------------------------------------------------------
    async def infer_many(self, requests: Sequence[Any]) -> list[Any]:
        """Run many requests as one group; return, in order, each one's ``InferResponse`` or
        its ``LumenError`` (an invalid item fails alone; the others still run).

        Every item is still its own request for validation, deadlines, errors and metrics,
        but the items of one task version are admitted as a unit (they fit the queue or each
        gets the same ``Overloaded``) and cost one future and one wake-up, not one per item.
        Items of a task with a response cache go through :meth:`cached` one by one (each is
        its own request there too).  Cancelling the call cancels every item still queued.
        """
        out = [None] * len(requests)
        t0 = _monotonic_ns()
        groups: dict[int, _Items] = {}  # id(route) -> _Items
        cached: list[int] = []
        try:
            late = self.many_prepare(requests, out, groups, cached, t0)
            for i, state in late:  # inputs prepared off the loop
                await self.many_off_loop(requests[i], i, out, state, t0)
            submitted = self.many_submit(groups, out, t0)
        finally:
            for items in groups.values():
                items.route.holds -= 1
        try:
            if cached:
                await asyncio.gather(*[self.many_cached(requests, i, out) for i in cached])
            for items in submitted:
                await items.group.future
        except _CancelledError:
            for items in submitted:
                items.route.batcher.cancel_group(items.entries)
            raise
        self.many_respond(requests, submitted, out, t0)
        return out

    async def many_cached(self, requests: Sequence[Any], i: int, out: list[Any]) -> None:
        """Item ``i`` of ``infer_many`` through its task's response cache."""
        req = requests[i]
        try:
            out[i] = await self.cached(req, self.routed(req))
        except LumenError as exc:
            out[i] = exc

    def many_prepare(self, requests: Sequence[Any], out: list[Any], groups: dict[Any, Any],
                     cached: list[int], t0: int) -> list[Any]:
        """Route every item, prepare those prepared inline into their version's group (an
        item's error goes to ``out[i]``), set aside those of cached tasks in ``cached``;
        return (index, state) of those prepared off the loop."""
        late = []
        counts: dict[str, int] = {}  # task -> items of a cached task
        for i in range(len(requests)):
            req = requests[i]
            if not isinstance(req, InferRequest):
                out[i] = InvalidArgument(f"item {i} is a {type(req).__name__}, not an "
                                         f"InferRequest", "requests")
                continue
            head = self.routes.get(req.task)
            if head is not None and head.cache is not None and not self.closing:
                cached.append(i)
                counts[req.task] = counts.get(req.task, 0) + 1
            else:
                state = self.many_item(req, i, out, groups, t0)
                if state is not None:
                    late.append((i, state))
        for name, n in counts.items():
            # more items of a task than its queue holds: the uncached path's 400 (each item
            # is its own request here, so the queue alone would answer a 429 no retry passes)
            limit = self.routes[name].batcher.queue_limit()
            if n > limit:
                err = group_too_large(name, n, limit)
                for i in cached:
                    if requests[i].task == name:
                        out[i] = err
        cached[:] = [i for i in cached if out[i] is None]
        return late

    def items_of(self, route: routes.Route, groups: dict[Any, Any]) -> _Items:
        """``route``'s share of an ``infer_many`` call (the route is held until it is queued)."""
        items = groups.get(id(route))
        if items is None:
            route.holds += 1
            items = groups[id(route)] = _Items(route)
        return items

    def many_item(self, req: Any, i: int, out: list[Any], groups: dict[Any, Any],
                  t0: int) -> Any:
        """Item ``i`` of ``infer_many`` into its version's group, prepared inline; its error
        goes to ``out[i]``.  None when done, else (its group, payload, nbytes) for
        :meth:`many_off_loop` (an input prepared on the bounded pool)."""
        route = None
        kind = RAW
        try:
            if self.observe is not None:
                kind = route_of(req.meta)
            route = self.routed(req)
            items = self.items_of(route, groups)
            payload, nbytes = self.payload(req.payload, route)
            if route.prepares_off_loop(nbytes):
                return items, payload, nbytes
            desc = native.descriptor.parse_meta(req.meta, nbytes, route.contract)
            priority, timeout_ms = self.checked(route, desc, False)
            kind = desc.kind
            items.add(i, kind, route.prepare(req, desc, payload), desc, priority, timeout_ms)
        except LumenError as exc:
            out[i] = exc
            self.observed(route, kind, exc.code, t0, None)
        return None

    async def many_off_loop(self, req: Any, i: int, out: list[Any], late: tuple[Any, ...],
                            t0: int) -> None:
        """Item ``i`` of ``infer_many``, prepared on the bounded pool (``late``: what
        :meth:`many_item` returned for it)."""
        items, payload, nbytes = late
        route = items.route
        kind = route_of(req.meta)
        try:
            desc = native.descriptor.parse_meta(req.meta, nbytes, route.contract)
            priority, timeout_ms = self.checked(route, desc, False)
            kind = desc.kind
            prepared, timeout_ms = await self.prepare_off_loop(route, req, desc, payload,
                                                               nbytes, timeout_ms)
        except LumenError as exc:
            out[i] = exc
            self.observed(route, kind, exc.code, t0, None)
            return
        items.add(i, kind, prepared, desc, priority, timeout_ms)

    def many_submit(self, groups: dict[Any, Any], out: list[Any], t0: int) -> list[Any]:
        """Queue each version's items of ``infer_many`` as one group."""
        submitted = []
        for items in groups.values():
            if not items.specs:
                continue
            route = items.route
            try:
                items.group, items.entries = route.batcher.submit_many(items.specs)
            except LumenError as exc:
                for k in range(len(items.index)):
                    out[items.index[k]] = exc
                    self.observed(route, items.kinds[k], exc.code, t0, None)
                continue
            submitted.append(items)
            if self.trace is not None:
                self.trace.admitted_group(route, items.kinds, items.entries, items.group)
        return submitted

    def many_respond(self, requests: Sequence[Any], submitted: list[Any], out: list[Any],
                     t0: int) -> None:
        """The answered items of ``infer_many``: responses (or errors) into ``out``."""
        observe = self.observe
        for items in submitted:
            route = items.route
            entries = items.entries
            for k in range(len(entries)):
                e = entries[k]
                i = items.index[k]
                res = e.outcome
                if isinstance(res, LumenError):
                    out[i] = res
                    if observe is not None:
                        self.observed(route, items.kinds[k], res.code, t0, e)
                else:
                    out[i] = respond(requests[i], route, e)
                    if observe is not None:
                        self.observed(route, items.kinds[k], "ok", t0, e)


class _Items:
    """One task version's share of an ``infer_many`` call."""

    __slots__ = ("route", "index", "kinds", "specs", "group", "entries")

    def __init__(self, route: routes.Route):
        self.route = route
        self.index: list[int] = []
        self.kinds: list[str] = []
        self.specs: list[tuple[Any, ...]] = []
        self.group = None
        self.entries = None

    def add(self, i: int, kind: Any, prepared: Any, desc: Any, priority: int,
            timeout_ms: int) -> None:
        self.index.append(i)
        self.kinds.append(kind)
        self.specs.append((prepared, desc, priority, timeout_ms))


def respond(req: Any, route: routes.Route, e: entries.Entry) -> InferResponse:
    """The response of an answered entry: its outputs (a batch row, split when read), the
    backend's response meta if any (e.g. ``lumen.truncated``), its batch's figures."""
    out = e.outcome
    return _respond(req, out, e.row if type(out) is _Rows else -1, e.batch_size, e.queue_us,
                    e.compute_us, e.item.length, route.version)

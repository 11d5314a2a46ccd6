"""The Runtime: config -> task backends -> engines -> batchers; ``infer`` routes by task.

``async with rt:`` loads every task (model files, contracts, ORT sessions), warms each one up
through the whole public path, and starts its batcher; leaving the block drains in-flight work.
For synchronous callers, ``with rt:`` runs the same thing on a private event-loop thread and
``rt.infer_sync(req)`` blocks on it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
from typing import Any, Coroutine, Mapping, Optional, Sequence

import numpy as np

from . import native, tracing
from .config import LumenConfig, TaskConfig, load_config, parse_config
from .contract import TensorContract
from .errors import (
    InternalError,
    InvalidArgument,
    LumenError,
    TaskNotFound,
    Unavailable,
)
from .loading import Observer, Task, TaskLoader
from .prepare_pool import PreparePool
from .request import InferRequest, InferResponse, new_infer_request
from .tasks import default_task_table, default_task_tables, nothing_to_serve
from .versions import Lifecycle

log = logging.getLogger("lumen")

#: seconds ``infer_sync`` waits before giving up on a wedged runtime (requests have deadlines)
SYNC_WAIT_S = None
#: the tensor form of token ids (``token_ids_request``)
TOKEN_DTYPE, TOKEN_LAYOUT = "int64", "NL"
#: the mime of ``str`` payloads (``text_request``)
TEXT_MIME = "text/plain; charset=utf-8"


class Runtime:
    def __init__(self, config: LumenConfig):
        self.config = config
        self._observer: Observer = Observer()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._pool = PreparePool()  # heavy preprocessing: bounded, smallest first, deadlines
        #: the request path (scheduler.py): the routes, ``infer`` and ``infer_many``
        self._dispatch = native.dispatch.Dispatcher(config.server.max_payload_bytes, self._pool)
        #: ``tracing.Tracing`` when tracing is on ([server] tracing, LUMEN_TRACING), else None
        self._dispatch.trace = tracing.from_config(config)
        #: versions, traffic splits, reloads (versions.py); ``self.tasks`` holds each task's head
        self._lifecycle = Lifecycle(self)
        #: task name -> ResponseCache of the loaded tasks with [tasks.cache]
        self._caches: dict = {}
        #: builds task versions (loading.py); its batchers report to ``self.observer``
        self._loader = TaskLoader(lambda: self._observer, self._dispatch, self._caches)

    @property
    def tasks(self) -> dict:
        """Task name -> the loaded head version (a :class:`~lumen_core.loading.Task`)."""
        return self._dispatch.routes

    @property
    def ready(self) -> bool:
        """True once every task loaded and warmed up, until ``stop``."""
        return self._dispatch.ready

    @property
    def loop(self) -> Optional[asyncio.AbstractEventLoop]:
        """The event loop the runtime was started on (None before ``start``)."""
        return self._loop

    @property
    def closing(self) -> bool:
        """True while the runtime stops (requests are refused ``Unavailable``)."""
        return self._dispatch.closing

    @property
    def tracing(self) -> Optional[tracing.Tracing]:
        """The runtime's tracing (spans per request and batch), None when tracing is off."""
        return self._dispatch.trace

    @tracing.setter
    def tracing(self, value: Optional[tracing.Tracing]) -> None:
        # the batchers take it as their tasks load: set it before ``start``
        if self._dispatch.routes:
            raise RuntimeError("set the runtime's tracing before it starts")
        self._dispatch.trace = value

    @property
    def observer(self) -> Observer:
        return self._observer

    @observer.setter
    def observer(self, obs: Observer) -> None:
        self._observer = obs
        self._dispatch.observe = None if type(obs) is Observer else obs.request

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str) -> "Runtime":
        return cls(load_config(path))

    @classmethod
    def from_dict(cls, cfg: Mapping, source: str = "<dict>") -> "Runtime":
        return cls(parse_config(cfg, source=source))

    @classmethod
    def default(cls, server: Optional[Mapping] = None, only: Optional[str] = None) -> "Runtime":
        """The built-in default tasks on the prepared models (``lumen models prepare``); each
        one that cannot be served here is left out with a warning line saying why.  ``only``:
        that default task alone (why it cannot be served is then raised).  When none at all
        can be served, a ModelMissingError names each task's reason and the command to run
        (the pip line of the model packages, or ``lumen models prepare``), not an empty
        runtime."""
        left_out: dict = {}
        cfg: dict = {"tasks": default_task_tables(left_out) if only is None
                     else [default_task_table(only)]}
        if not cfg["tasks"]:
            raise nothing_to_serve(left_out)
        if server:
            cfg["server"] = dict(server)
        return cls.from_dict(cfg, source="<default tasks>")

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.ready:
            return
        self._dispatch.closing = False  # a stopped runtime may be started again
        self._loop = asyncio.get_running_loop()
        try:
            # each version loads, starts and warms up; then its task routes to it
            await self._lifecycle.start(self.config.tasks)
        except BaseException:
            await self._close_tasks()
            raise
        self._dispatch.ready = True
        log.info("lumen runtime ready: tasks %s, extensions %s", sorted(self.tasks),
                 native.using_extensions())

    def load_task(self, tc: TaskConfig) -> Task:
        """Build one task version from its config: backend, engine instances, batcher (not
        started; the lifecycle starts and warms it up before it takes traffic)."""
        return self._loader.load(tc)

    async def warmup(self, task: Task) -> None:
        """Run the backend's warm-up requests through the whole request path, on ``task``
        itself (a new version warms up before any traffic can reach it), unobserved and
        past its response cache (a warm-up answer is no one's to keep)."""
        pinned = native.dispatch.Dispatcher(self.config.server.max_payload_bytes, self._pool)
        pinned.routes = {task.name: task}
        pinned.ready = True
        for req in task.backend.warmup_requests():
            try:
                await pinned.infer(req, False)
            except LumenError as exc:
                raise InternalError(f"warm-up of task {task.config.name!r} failed: {exc}") from exc

    async def stop(self) -> None:
        """Stop admitting, drain in-flight work, release sessions and threads."""
        self._dispatch.closing = True
        # the pool first: what it still holds is refused, and nothing reaches a batcher
        # after that batcher started draining
        await self._lifecycle.stop()
        await asyncio.to_thread(self._pool.stop)
        self._pool = self._dispatch.pool = PreparePool()  # a stopped runtime may start again
        for task in self._loaded_tasks():
            await task.batcher.drain()
        await self._close_tasks()
        self._dispatch.ready = False

    def _loaded_tasks(self) -> list:
        """Every loaded version of every task (heads, other versions, draining ones), once."""
        out = {id(t): t for t in self._lifecycle.tasks()}
        for t in self.tasks.values():
            out.setdefault(id(t), t)
        return list(out.values())

    async def _close_tasks(self) -> None:
        for task in self._loaded_tasks():
            await self.close_task(task)
        self._dispatch.routes = {}
        self._lifecycle.forget()
        self._caches.clear()

    async def close_task(self, task: Task) -> None:
        """Close one task version: its batcher (refusing what it still holds) and engines."""
        await task.batcher.close()
        for runner in task.runners:
            await asyncio.to_thread(runner.close)

    async def __aenter__(self) -> "Runtime":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- inference ------------------------------------------------------------------------
    def infer(self, req: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """Run one request: route by task, validate, prepare, queue, await its batch, respond
        (``await rt.infer(req)``).

        A plain method that returns the compiled dispatcher's coroutine (``Dispatcher.infer``):
        no Python coroutine frame between the caller and the request path.  A task's response
        cache is a stage of its route there (``Dispatcher.cached``)."""
        return self._dispatch.infer(req)

    def admit(self, req: InferRequest) -> Any:
        """:meth:`infer` without the await, for a door that waits by callback (the HTTP door on
        Lumen's own connections): route, validate, prepare and queue ``req``, returning its
        entry, whose ``waiter`` future is done when the batch answered it; then
        :meth:`settle` gives the response (or raises its error), and :meth:`cancelled` gives
        up on it (the caller left).  None when the request needs more than the loop may do
        inline -- it is prepared on the preprocessing pool or answered through the task's
        response cache --: then call :meth:`infer`.  A refused request raises here."""
        return self._dispatch.admit(req)

    def settle(self, req: InferRequest, entry: Any) -> InferResponse:
        """The response of an :meth:`admit`-ted request whose ``entry.waiter`` is done, or
        its error raised (observed as :meth:`infer` observes it)."""
        return self._dispatch.settle(req, entry)

    def cancelled(self, entry: Any) -> None:
        """Give up on an :meth:`admit`-ted request (cancel its future first): it leaves its
        queue, or its batch's answer is dropped, and is counted ``cancelled``."""
        self._dispatch.cancelled(entry)

    def infer_many(self, requests: Sequence[InferRequest]) -> Coroutine[Any, Any, list]:
        """Run many requests as one group; return, in order, each one's ``InferResponse`` or
        its ``LumenError`` (an invalid item fails alone; the others still run).

        Every item is still its own request for validation, deadlines, errors and metrics,
        but the group is admitted per task as a unit (it fits the queue or every item of that
        task gets the same ``Overloaded``) and costs one future and one wake-up per task, not
        one per item.  Cancelling the call cancels every item still queued.  (A plain method
        returning the compiled dispatcher's coroutine, as :meth:`infer`.)
        """
        return self._dispatch.infer_many(requests)

    # -- model lifecycle: versions, traffic, reload (lumen_core/versions.py) ---------------
    async def reload(self, task: Optional[str] = None) -> dict:
        """Re-read the config file (when the runtime came from one) and every model file, and
        bring the tasks (or ``task``) to what they say, without failing a request: a changed
        or added version loads and warms up beside the serving one, then takes its traffic in
        one step; the replaced one finishes what it holds and is unloaded.  A version that
        fails to load leaves what serves untouched and is reported.  Returns
        :meth:`lifecycle` (of ``task``, or of all tasks)."""
        return await self._lifecycle.reload(task)

    async def apply_config(self, config: Any) -> dict:
        """Bring the runtime to a new config -- a :class:`LumenConfig`, a config dict or a
        TOML path -- the way :meth:`reload` does (tasks it adds load, tasks it drops drain and
        unload).  A bad config raises ``ConfigError`` and changes nothing; ``[server]``
        settings take effect on restart.  Returns :meth:`lifecycle`."""
        return await self._lifecycle.apply_config(config)

    def set_traffic(self, task: str, weights: Mapping) -> dict:
        """Split ``task``'s traffic over its loaded versions (``{version: weight}``; a request
        with a ``lumen.route.key`` keeps its version while the split is unchanged).  Call it on
        the runtime's loop.  Returns the task's :meth:`lifecycle`."""
        return self._lifecycle.set_traffic(task, weights)

    async def load_version(self, task: str, version: str, model: Optional[str] = None) -> dict:
        """(Re)load one version of ``task`` beside what serves: from its config, or from the
        file ``model`` (a new version).  Returns the task's :meth:`lifecycle`; a load that
        fails raises :class:`~lumen_core.errors.LoadFailed` naming the cause (the failed
        instance stays in :meth:`lifecycle`, what was serving keeps serving)."""
        return await self._lifecycle.load_version(task, version, model)

    async def unload_version(self, task: str, version: str) -> dict:
        """Take ``version`` out of ``task``'s traffic, let it finish what it holds, unload it
        (never the last one).  Returns the task's :meth:`lifecycle`."""
        return await self._lifecycle.unload_version(task, version)

    def stop_loading(self) -> None:
        """Give up model-file reads in progress (a reload, an admin load) and start no new
        load: the first step of a server's shutdown, so that it never waits for one.
        ``stop()`` does it too; a later ``start()`` loads again."""
        self._lifecycle.stop_loading()

    def lifecycle(self, task: Optional[str] = None) -> dict:
        """Each task's versions (state ``loading|ready|draining|failed``, model, revision =
        sha256 of the model file, error), its traffic split and load failures."""
        return self._lifecycle.describe(task)

    def watch(self, interval_s: float = 1.0) -> "asyncio.Task":
        """Reload whenever the config file or a model file changes (polled every
        ``interval_s``; a file is loaded once it stopped changing).  Stops with the runtime."""
        return self._lifecycle.watch(interval_s)

    # -- synchronous use ------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        self.start_background()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_background()

    def start_background(self) -> None:
        """Run the runtime on a private event-loop thread (for ``infer_sync`` callers)."""
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve_loop, args=(loop, started),
                                        name="lumen-runtime", daemon=True)
        self._thread.start()
        started.wait()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result()
        except BaseException:
            # no ``__exit__`` follows a failed ``__enter__``: end the loop thread here
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join()
            self._thread = None
            raise

    def _serve_loop(self, loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        loop.run_forever()
        loop.close()

    def stop_background(self) -> None:
        if self._thread is None:
            return
        loop = self._loop
        assert loop is not None  # a background thread runs only once started
        asyncio.run_coroutine_threadsafe(self.stop(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join()
        self._thread = None

    def infer_sync(self, req: InferRequest) -> InferResponse:
        """Blocking ``infer`` for threads other than the runtime's loop."""
        loop = self._sync_loop()
        return asyncio.run_coroutine_threadsafe(self.infer(req), loop).result(SYNC_WAIT_S)

    def infer_many_sync(self, requests: Sequence[InferRequest]) -> list:
        """Blocking ``infer_many`` for threads other than the runtime's loop."""
        loop = self._sync_loop()
        return asyncio.run_coroutine_threadsafe(self.infer_many(requests), loop).result(SYNC_WAIT_S)

    def run_sync(self, coro: Any) -> Any:
        """Blocking: run ``coro`` (one that calls this runtime, e.g. a whole audio file as
        one sequence, ``serve.audio.run_file``) on the runtime's loop and return its result."""
        loop = self._sync_loop()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(SYNC_WAIT_S)

    def _sync_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or not self.ready:
            raise Unavailable("start the runtime first (`with rt:` or `async with rt:`)")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("a *_sync method was called on the runtime's own event loop; "
                               "await the async method instead")
        return loop

    # -- queries: what transports may ask (they never reach into tasks or backends) ----------
    def task_names(self) -> list:
        """The loaded tasks, sorted."""
        return sorted(self.tasks)

    def has_task(self, name: str) -> bool:
        return name in self.tasks

    def room(self, task: str, sequence_id: Optional[str] = None) -> int:
        """Whether a request for ``task`` (of sequence ``sequence_id``, scoped as its meta
        is) would find room now (``batching.policy.ROOM``), or the queue is full
        (``QUEUE_FULL``), or the sequence waits for a slot (``AWAITING_SLOT``): a stream
        reads on only with room (``serve/streams.py``).  An unknown task has room: its
        request answers 404."""
        route = self.tasks.get(task)
        if route is None:
            return 0
        return route.batcher.room(sequence_id)

    def _task(self, name: str) -> Task:
        task = self.tasks.get(name)
        if task is None:
            raise TaskNotFound.unknown(name, self.tasks)
        return task

    def versions(self, task: str) -> list:
        """The versions ``task`` serves now, in version order (``lumen.model.version`` may pin
        any of them)."""
        return self._lifecycle.serving(task) or [self._task(task).version]

    def request_options(self, task: str) -> Mapping:
        """``{meta key: what it does}`` of the options ``task`` reads beyond the ``lumen.*``
        keys of every task (``TaskBackend.request_options``)."""
        return self._task(task).backend.request_options

    def contract(self, task: str) -> TensorContract:
        """The tensor contract of ``task`` (dtypes, layouts, shapes, preprocess ids)."""
        return self._task(task).backend.contract

    def describe(self, task: Optional[str] = None) -> dict:
        """``{task: description}`` of every task, or the description of one."""
        if task is not None:
            return self._task(task).backend.describe()
        return {name: t.backend.describe() for name, t in self.tasks.items()}

    def load(self) -> dict:
        """``{task: {pending, in_flight, padding_ratio[, cost][, steps][, active_sequences,
        backlog]}}`` now, summed over a task's versions: queued requests, running batches,
        padded share of token slots; the head version's learnt cost model and latency target
        (``QueuePolicy.cost_figures``; not for ensembles); for ensembles the per-step counters;
        for stateful tasks the sequences holding a slot and those waiting."""
        out: dict = {}
        for t in self._loaded_tasks():  # summed over a task's versions
            b = t.batcher
            load = out.get(t.name)
            if load is None:
                load = out[t.name] = {"pending": 0, "in_flight": 0, "padding_ratio": 0.0}
            load["pending"] += b.pending
            load["in_flight"] += b.in_flight
            load["padding_ratio"] = max(load["padding_ratio"], t.padding_ratio)
            if t is self.tasks.get(t.name):  # the head version's learnt cost (issue 30)
                cost = b.cost_figures()
                if cost is not None:
                    load["cost"] = cost
            for key, value in b.counters().items():  # the batcher's own (TaskBatcher.counters)
                if isinstance(value, dict):  # an ensemble's per-step table: the head's
                    if t is self.tasks.get(t.name):
                        load[key] = value
                else:
                    load[key] = load.get(key, 0) + value
        return out

    def cache_stats(self) -> dict:
        """``{task: {hits, misses, coalesced, evictions, expired, bytes, entries, max_bytes}}``
        of the tasks with a response cache (cache.py); empty when none has one."""
        return {name: c.stats() for name, c in list(self._caches.items())}

    @staticmethod
    def extensions() -> dict:
        """Compiled module name -> True when the compiled twin is in use."""
        return native.using_extensions()

    def token_ids_request(self, task: str, ids: Any, correlation_id: str = "",
                          field: str = "payload", truncate: bool = True) -> InferRequest:
        """A tensor-route request carrying token ids, under the preprocess id ``task``
        declares for int64 ``[1, L]`` ``NL`` input; ``InvalidArgument`` (``field``) when the
        task takes no token ids or an id does not fit in int64.  A task that fits ids to its
        length (``fit_token_ids``: text_embedding) cuts them when ``truncate``, else refuses
        too many with 413, as it treats a text."""
        fit = getattr(self._task(task).backend, "fit_token_ids", None)
        if fit is not None:
            ids = fit(ids, truncate, field)
        for spec in self.contract(task).specs:
            if spec.dtype == TOKEN_DTYPE and spec.layout == TOKEN_LAYOUT and spec.preprocess_ids:
                try:
                    arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)
                except (OverflowError, TypeError, ValueError):
                    raise InvalidArgument("token ids must be integers that fit in int64",
                                          field) from None
                return (new_infer_request(task)
                        .for_tensor_array(arr, TOKEN_LAYOUT, sorted(spec.preprocess_ids)[0])
                        .with_correlation_id(correlation_id).build())
        raise InvalidArgument(f"task {task!r} does not take token ids; send text", field)

    async def tokenize(self, task: str, texts: Sequence[str], truncate: bool = True) -> list:
        """Per text, the tokens ``task`` would embed (``{"id", "text", "special", "start",
        "stop"}``, TEI's ``/tokenize``), cut like the task cuts unless ``truncate`` is False.
        Runs on the preprocessing pool: tokenizing is CPU work of the size of the texts."""
        backend = self._task(task).backend
        fn = getattr(backend, "tokenize", None)
        if fn is None:
            raise InvalidArgument(f"task {task!r} does not tokenize text", "model")
        texts = list(texts)
        return await self._pool.run(functools.partial(fn, texts, truncate),
                                    sum(len(t) for t in texts))

    def prepare(self, req: InferRequest) -> Any:
        """The prepared model item of ``req``: routed, validated and prepared exactly as
        ``infer`` does it, but not queued.  For callers that form their own batches and run
        them on the task's runners (``lumen embed``: deterministic batches, so a resumed job
        computes the same bytes).  Raises the request's ``LumenError``."""
        dispatch = self._dispatch
        route = dispatch.routed(req)
        payload, nbytes = dispatch.payload(req.payload, route)  # the limits every door checks
        desc = native.descriptor.parse_meta(req.meta, nbytes, route.contract)
        return route.prepare(req, desc, payload)

    @staticmethod
    def text_request(task: str, text: str, correlation_id: str = "") -> InferRequest:
        """A raw ``text/plain`` request whose payload is the ``str`` itself: a task that takes
        text reads it without an encode / decode round trip."""
        return InferRequest(task, text, TEXT_MIME, {}, correlation_id)

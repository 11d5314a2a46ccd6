"""The Runtime: config -> task backends -> engines -> batchers; ``infer`` routes by task.

``async with rt:`` loads every task (model files, contracts, ORT sessions), warms each one up
through the whole public path, and starts its batcher; leaving the block drains in-flight work.
For synchronous callers, ``with rt:`` runs the same thing on a private event-loop thread and
``rt.infer_sync(req)`` blocks on it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Mapping, Optional

import numpy as np

from . import native
from .batching.dynamic import DynamicBatcher
from .config import LumenConfig, TaskConfig, load_config, parse_config
from .contract import TensorContract
from .engine.ort import make_instances
from .errors import (
    InternalError,
    InvalidArgument,
    LumenError,
    PayloadTooLarge,
    TaskNotFound,
    Unavailable,
)
from .request import InferRequest, InferResponse, ResponseStats, new_infer_request
from .tasks import backend_class, default_task_tables
from .tasks.base import TaskBackend

log = logging.getLogger("lumen")

#: seconds ``infer_sync`` waits before giving up on a wedged runtime (requests have deadlines)
SYNC_WAIT_S = None
#: the tensor form of token ids (``token_ids_request``)
TOKEN_DTYPE, TOKEN_LAYOUT = "int64", "NL"
#: the mime of ``str`` payloads (``text_request``)
TEXT_MIME = "text/plain; charset=utf-8"


class Observer:
    """Metrics hooks; the serve layer installs a Prometheus implementation.  No-ops here."""

    def request(self, task: str, route: str, code: str, e2e_us: int,
                queue_us: int = 0, compute_us: int = 0) -> None:
        """One finished request (``code`` is ``ok`` or an error code)."""

    def batch(self, task: str, size: int, compute_us: int) -> None:
        """One finished batch."""


class Task:
    """A loaded task: its backend, engine instances and batcher."""

    def __init__(self, config: TaskConfig, backend: TaskBackend, instances: list, batcher: Any):
        self.config = config
        self.backend = backend
        self.instances = instances
        self.batcher = batcher
        b = config.batching
        # resolved once: the per-request policy check reads plain attributes
        self.priority_levels = b.priority_levels
        self.default_priority = b.default_priority_level or b.priority_levels
        self.default_timeout_ms = b.default_timeout_ms

    @property
    def padding_ratio(self) -> float:
        """Padded / all token slots over the task's life (0 for non-ragged tasks)."""
        real = sum(i.stats.get("real_tokens", 0) for i in self.instances)
        total = sum(i.stats.get("padded_tokens", 0) for i in self.instances)
        return (total - real) / total if total else 0.0


class Runtime:
    def __init__(self, config: LumenConfig):
        self.config = config
        self.tasks: dict = {}
        self.observer: Observer = Observer()
        self.ready = False
        self._closing = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._max_payload = config.server.max_payload_bytes

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str) -> "Runtime":
        return cls(load_config(path))

    @classmethod
    def from_dict(cls, cfg: Mapping, source: str = "<dict>") -> "Runtime":
        return cls(parse_config(cfg, source=source))

    @classmethod
    def default(cls, server: Optional[Mapping] = None) -> "Runtime":
        """The built-in default tasks on the prepared models (``lumen models prepare``)."""
        cfg: dict = {"tasks": default_task_tables()}
        if server:
            cfg["server"] = dict(server)
        return cls.from_dict(cfg, source="<default tasks>")

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.ready:
            return
        self._closing = False  # a stopped runtime may be started again
        self._loop = asyncio.get_running_loop()
        try:
            for tc in self.config.tasks:
                self.tasks[tc.name] = await asyncio.to_thread(self._load_task, tc)
            for task in self.tasks.values():
                await self._warmup(task)
        except BaseException:
            await self._close_tasks()
            raise
        self.ready = True
        log.info("lumen runtime ready: tasks %s, extensions %s", sorted(self.tasks),
                 native.using_extensions())

    def _load_task(self, tc: TaskConfig) -> Task:
        try:
            cls = backend_class(tc.backend)
        except KeyError:
            from .config import ConfigError
            from .tasks import BACKENDS

            raise ConfigError(tc.source, f"{tc.key}.backend",
                              f"unknown backend {tc.backend!r} (known: {', '.join(sorted(BACKENDS))})") from None
        backend = cls(tc)
        spec = backend.load()
        instances = make_instances(spec, tc.name, tc.device, tc.instances, tc.intra_op_threads,
                                   tc.allow_spinning, backend.postprocess)
        if backend.stateful:
            from .batching.sequence import SequenceBatcher

            batcher = SequenceBatcher(tc.name, tc, instances, backend,
                                      on_batch=lambda n, us, _t=tc.name: self.observer.batch(_t, n, us))
        else:
            batcher = DynamicBatcher(tc.name, tc.batching, instances,
                                     on_batch=lambda n, us, _t=tc.name: self.observer.batch(_t, n, us),
                                     **backend.batching_options())
        return Task(tc, backend, instances, batcher)

    async def _warmup(self, task: Task) -> None:
        for req in task.backend.warmup_requests():
            try:
                await self._infer(task, req)
            except LumenError as exc:
                raise InternalError(f"warm-up of task {task.config.name!r} failed: {exc}") from exc

    async def stop(self) -> None:
        """Stop admitting, drain in-flight work, release sessions and threads."""
        self._closing = True
        for task in self.tasks.values():
            await task.batcher.drain()
        await self._close_tasks()
        self.ready = False

    async def _close_tasks(self) -> None:
        for task in self.tasks.values():
            for inst in task.instances:
                await asyncio.to_thread(inst.close)
        self.tasks = {}

    async def __aenter__(self) -> "Runtime":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- inference ------------------------------------------------------------------------
    async def infer(self, req: InferRequest) -> InferResponse:
        task = self.tasks.get(req.task)
        if task is None:
            if self._closing or not self.ready:
                raise Unavailable("the runtime is not running (starting or shutting down)")
            raise TaskNotFound(f"unknown task {req.task!r}; this runtime serves "
                               f"{', '.join(sorted(self.tasks)) or 'no tasks'}", "task")
        if self._closing:
            raise Unavailable("the runtime is shutting down; not accepting requests")
        return await self._infer(task, req)

    async def _infer(self, task: Task, req: InferRequest) -> InferResponse:
        t0 = time.perf_counter_ns()
        route = "raw"
        try:
            backend = task.backend
            payload, nbytes = self._payload(req.payload, backend)
            desc = native.descriptor.parse_meta(req.meta, nbytes, backend.contract)
            route = desc.kind
            priority, timeout_ms = self._policy(task, desc)
            try:
                if backend.prepare_off_loop or nbytes > backend.inline_prepare_max_bytes:
                    prepared = await asyncio.to_thread(backend.prepare, req, desc, payload)
                else:
                    prepared = backend.prepare(req, desc, payload)
            except LumenError:
                raise
            except Exception as exc:  # a backend bug on odd input must not escape as a crash
                log.exception("task %s: prepare failed", task.config.name)
                raise InternalError(f"task {task.config.name!r} failed to prepare the input: {exc}") from exc
            if backend.stateful:
                res = await task.batcher.infer(prepared, desc, priority, timeout_ms)
            else:
                # submit + await inline (one coroutine frame less per request than infer())
                entry = task.batcher.submit(prepared, priority, timeout_ms)
                try:
                    res = await entry.future
                except asyncio.CancelledError:
                    task.batcher.cancel(entry)
                    raise
        except LumenError as exc:
            self.observer.request(task.config.name, route, exc.code,
                                  (time.perf_counter_ns() - t0) // 1000)
            raise
        except asyncio.CancelledError:
            self.observer.request(task.config.name, route, "cancelled",
                                  (time.perf_counter_ns() - t0) // 1000)
            raise
        self.observer.request(task.config.name, route, "ok", (time.perf_counter_ns() - t0) // 1000,
                              res.queue_us, res.compute_us)
        stats = ResponseStats(res.batch_size, res.queue_us, res.compute_us, prepared.length)
        return InferResponse(req.correlation_id, req.task, res.value, None, stats)

    def _payload(self, payload: Any, backend: TaskBackend) -> tuple:
        """(payload, nbytes): a C-contiguous buffer as a memoryview, or a ``str`` for a task
        that takes text (its size counted in code points: each is at least one byte)."""
        if type(payload) is str:
            if not backend.accepts_text:
                raise InvalidArgument(f"task {backend.name!r} does not take a str payload; send "
                                      f"bytes", "payload")
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
        if n > self._max_payload:
            raise PayloadTooLarge(f"payload is {n} bytes; the limit is {self._max_payload} "
                                  f"(server.max_payload_bytes)", "payload")
        return payload, n

    @staticmethod
    def _policy(task: Task, desc) -> tuple:
        """(priority, timeout_ms) of a request: its own values within the task's limits."""
        priority = desc.priority or task.default_priority
        if priority > task.priority_levels:
            raise InvalidArgument(f"lumen.priority must be 1..{task.priority_levels} for task "
                                  f"{task.config.name!r}, got {priority}", "lumen.priority")
        timeout_ms = task.default_timeout_ms
        if desc.timeout_ms:
            # a request may only tighten the task's deadline, never extend it
            timeout_ms = min(timeout_ms, desc.timeout_ms) if timeout_ms else desc.timeout_ms
        return priority, timeout_ms

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
        asyncio.run_coroutine_threadsafe(self.stop(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join()
        self._thread = None

    def infer_sync(self, req: InferRequest) -> InferResponse:
        """Blocking ``infer`` for threads other than the runtime's loop."""
        loop = self._loop
        if loop is None or not self.ready:
            raise Unavailable("start the runtime first (`with rt:` or `async with rt:`)")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("infer_sync called on the runtime's own event loop; use `await rt.infer(req)`")
        return asyncio.run_coroutine_threadsafe(self.infer(req), loop).result(SYNC_WAIT_S)

    # -- queries: what transports may ask (they never reach into tasks or backends) ----------
    def task_names(self) -> list:
        """The loaded tasks, sorted."""
        return sorted(self.tasks)

    def has_task(self, name: str) -> bool:
        return name in self.tasks

    def _task(self, name: str) -> Task:
        task = self.tasks.get(name)
        if task is None:
            raise TaskNotFound(f"unknown task {name!r}; this runtime serves "
                               f"{', '.join(sorted(self.tasks)) or 'no tasks'}", "task")
        return task

    def contract(self, task: str) -> TensorContract:
        """The tensor contract of ``task`` (dtypes, layouts, shapes, preprocess ids)."""
        return self._task(task).backend.contract

    def describe(self, task: Optional[str] = None) -> dict:
        """``{task: description}`` of every task, or the description of one."""
        if task is not None:
            return self._task(task).backend.describe()
        return {name: t.backend.describe() for name, t in self.tasks.items()}

    @staticmethod
    def extensions() -> dict:
        """Compiled module name -> True when the compiled twin is in use."""
        return native.using_extensions()

    def token_ids_request(self, task: str, ids: Any, correlation_id: str = "",
                          field: str = "payload") -> InferRequest:
        """A tensor-route request carrying token ids, under the preprocess id ``task``
        declares for int64 ``[1, L]`` ``NL`` input; ``InvalidArgument`` (``field``) when the
        task takes no token ids or an id does not fit in int64."""
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

    @staticmethod
    def text_request(task: str, text: str, correlation_id: str = "") -> InferRequest:
        """A raw ``text/plain`` request whose payload is the ``str`` itself: a task that takes
        text reads it without an encode / decode round trip."""
        return InferRequest(task, text, TEXT_MIME, {}, correlation_id)

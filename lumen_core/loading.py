"""Building a task version from its config: backend, engine instances, runners, batcher.

The runtime (``runtime.py``) asks :class:`TaskLoader` for a :class:`Task` whenever the
lifecycle (``versions.py``) brings a version up; the task is not started here (the lifecycle
starts and warms it up before any traffic reaches it).
"""
from __future__ import annotations

from typing import Any, Callable

from . import native
from .batching.dynamic import DynamicBatcher
from .batching.pipeline import build_pipeline
from .batching.runner import BatchRunner
from .batching.sequence import SequenceBatcher
from .cache import ResponseCache
from .config import TaskConfig
from .engine.ort import make_instances
from .errors import ConfigError
from .tasks import BACKENDS, backend_class
from .tasks.base import TaskBackend


class Observer:
    """Metrics hooks; the serve layer installs a Prometheus implementation.  No-ops here (and
    with this base class installed the runtime skips the calls and their timing entirely)."""

    def request(self, task: str, route: str, code: str, e2e_us: int,
                queue_us: int = 0, compute_us: int = 0, version: str = "") -> None:
        """One finished request (``code`` is ``ok`` or an error code; ``version`` the task
        version that served it, empty when none was chosen yet)."""

    def batch(self, task: str, size: int, compute_us: int) -> None:
        """One finished batch."""


class Task(native.routes.Route):
    """A loaded version of a task: its dispatch record (``routes.Route``: backend,
    contract, batcher, policy defaults, router, holds, cache) plus what the runtime keeps
    for it -- its config, engine instances and their runners."""

    def __init__(self, config: TaskConfig, backend: TaskBackend, instances: list, runners: list,
                 batcher: Any):
        b = config.batching
        super().__init__(config.name, config.model_version, backend, batcher, b.priority_levels,
                         b.default_priority_level, b.default_timeout_ms)
        self.config = config
        self.instances = instances
        self.runners = runners

    @property
    def padding_ratio(self) -> float:
        """Padded / all token slots over the task's life (0 for non-ragged tasks)."""
        real = sum(r.stats.get("real_tokens", 0) for r in self.runners)
        total = sum(r.stats.get("padded_tokens", 0) for r in self.runners)
        return (total - real) / total if total else 0.0


class TaskLoader:
    """Builds :class:`Task` versions for one runtime: ``observer()`` is the runtime's current
    :class:`Observer` (batches report to it), ``dispatch`` its dispatcher (tracing), ``caches``
    its task name -> ``ResponseCache`` table (one cache per task name, shared by its versions)."""

    def __init__(self, observer: Callable[[], Observer], dispatch: Any, caches: dict):
        self._observer = observer
        self._dispatch = dispatch
        self._caches = caches

    def load(self, tc: TaskConfig) -> Task:
        """Build one task version from its config (not started)."""
        try:
            cls = backend_class(tc.backend)
        except KeyError:
            raise ConfigError(tc.source, f"{tc.key}.backend",
                              f"unknown backend {tc.backend!r} (known: {', '.join(sorted(BACKENDS))})") from None
        backend = cls(tc)
        try:
            spec = backend.load()
        except Exception as exc:
            raise model_file_error(tc, tc.model, exc) from None
        steps = backend.steps()
        if steps is not None:  # an ensemble: one batcher per step (batching/pipeline.py)
            return self._load_pipeline(tc, backend, steps)
        try:
            instances = make_instances(spec, tc.name, tc.device, tc.instances,
                                       tc.intra_op_threads, tc.allow_spinning)
        except Exception as exc:
            raise model_file_error(tc, spec.path, exc) from None
        runners = [BatchRunner(inst, backend.postprocess) for inst in instances]
        on_batch = self._batch_observer(tc.name)
        if backend.stateful:
            batcher: Any = SequenceBatcher(tc.name, tc.batching,
                                           getattr(backend, "sequence", None) or tc.sequence,
                                           runners, on_batch=on_batch)
        else:
            batcher = DynamicBatcher(tc.name, tc.batching, runners, on_batch=on_batch,
                                     **backend.batching_options())
        trace = self._dispatch.trace
        if trace is not None:
            trace.versions[tc.name] = tc.model_version
            batcher.queue.trace = trace
        task = Task(tc, backend, instances, runners, batcher)
        if tc.cache is not None:
            if backend.stateful:
                raise ConfigError(tc.source, f"{tc.key}.cache",
                                  f"task {tc.name!r} is stateful (sequences): its responses "
                                  f"depend on the sequence's state and cannot be cached; "
                                  f"remove [tasks.cache]")
            # one cache per task name, shared by its versions (the version is in every key)
            cache = self._caches.get(tc.name)
            if cache is None:
                cache = self._caches[tc.name] = ResponseCache(tc.name, tc.cache.max_bytes,
                                                              tc.cache.ttl_s)
            task.cache = cache
        return task

    def _load_pipeline(self, tc: TaskConfig, backend: TaskBackend, steps: list) -> Task:
        """An ensemble task: each step its own engine instances and dynamic batcher; step
        batches reach the observer as ``<task>.<step>``."""
        instances: list = []

        def make_runners(step: Any) -> list:
            made = make_instances(step.model, f"{tc.name}.{step.name}", tc.device, step.instances,
                                  step.intra_op_threads or tc.intra_op_threads, tc.allow_spinning)
            instances.extend(made)
            return [BatchRunner(inst, step.postprocess) for inst in made]

        def on_batch(step: str, n: int, compute_us: int) -> None:
            obs = self._observer()
            if type(obs) is not Observer:
                obs.batch(f"{tc.name}.{step}", n, compute_us)

        batcher = build_pipeline(tc.name, tc.batching, steps, backend.flow,
                                 make_runners, on_batch)
        trace = self._dispatch.trace
        if trace is not None:  # request spans per ocr request, batch spans per step
            trace.versions[tc.name] = tc.model_version
            for step in batcher.steps.values():
                step.batcher.queue.trace = trace
        return Task(tc, backend, instances, batcher.runners, batcher)

    def _batch_observer(self, name: str):
        def on_batch(n: int, compute_us: int) -> None:
            obs = self._observer()
            if type(obs) is not Observer:
                obs.batch(name, n, compute_us)
        return on_batch



#: the packages whose exceptions mean "this model file cannot be read" (protobuf's decoder,
#: onnx's checker, ONNX Runtime's session)
_MODEL_FILE_ERRORS = ("google.protobuf", "onnx", "onnxruntime")


def model_file_error(tc: TaskConfig, path: Any, exc: Exception) -> Exception:
    """A model file that the ONNX libraries cannot read (corrupt, truncated, not ONNX) as a
    one-line ConfigError naming the task and the file; any other exception unchanged (the
    backends raise their own ConfigErrors, with their own keys)."""
    top = type(exc).__module__.split(".")[0]
    if top == "google":
        top = "google.protobuf"
    if top not in _MODEL_FILE_ERRORS:
        return exc
    what = str(path) if path else "its model"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return ConfigError(tc.source, f"{tc.key}.model",
                       f"task {tc.name!r}: cannot load the model file {what}: {first} (is it "
                       f"a complete ONNX file? prepare or export it again)")

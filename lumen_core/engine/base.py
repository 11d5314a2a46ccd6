"""The one engine protocol: an instance runs one assembled batch and returns its outputs.

    engine.next_arena()        -> the buffer arena the next batch's inputs are assembled into
    engine.run(feeds, n)       -> {output_name: ndarray}, every declared output
    engine.stats, engine.close()

Assembly (the plans), the task's postprocess and state commits are the caller's: the
batching side's ``BatchRunner`` composes them, so the engine knows no task.  CPU and CUDA
instances share this base: session construction, the output check at load, the plain-run
path for inputs ORT cannot bind (string tensors, e.g. a string CORRID control), counters and
close; a subclass provides its session providers, its arena(s) and, if it binds, the IO-bound
run.
"""
from __future__ import annotations

import abc
import threading
from typing import Any

from ..errors import InternalError
from .plan import ModelSpec, OutputSpec
from .session import session_options


def output_shape(o: OutputSpec, n: int) -> tuple:
    """The batch shape of a bindable output: ``item_shape`` with ``n`` at its batch axis."""
    item = tuple(o.item_shape or ())
    return item[:o.batch_axis] + (n,) + item[o.batch_axis:]


class EngineInstance(abc.ABC):
    """One ONNX Runtime session of a model (see the module docstring)."""

    def __init__(self, spec: ModelSpec, name: str, intra_op_threads: int, allow_spinning: bool):
        self.spec = spec
        self.name = name
        self.session = self._session(session_options(intra_op_threads, allow_spinning))
        self.stats: dict = {"batches": 0, "items": 0}
        self._names = [o.name for o in spec.outputs]
        self._lock = threading.Lock()  # guards against accidental concurrent use only
        known = {o.name for o in self.session.get_outputs()}
        missing = [n for n in self._names if n not in known]
        if missing:
            raise InternalError(f"model {spec.path} has no output(s) {missing}; it has {sorted(known)}")

    @abc.abstractmethod
    def _session(self, options: Any) -> Any:
        """Build the ORT session with this device's providers."""

    @abc.abstractmethod
    def next_arena(self) -> Any:
        """The arena the next batch is assembled into (``get(name, shape, dtype)``)."""

    #: whether the instance runs with IO binding (CUDA: inputs and outputs stay on the device);
    #: one that does not runs every batch with ``session.run`` (the CPU: ``ort.py`` says why)
    binds = False

    def _run_bound(self, feeds: dict, n: int) -> dict:
        """Run with IO binding; return every declared output (instances with ``binds``)."""
        return self._run_plain(feeds)

    def run(self, feeds: dict, n: int) -> dict:
        """Run one assembled batch of ``n`` rows; return ``{output_name: ndarray}``."""
        with self._lock:
            # ORT cannot bind string tensors: those run plain wherever they are
            if self.binds and not any(arr.dtype.hasobject for arr in feeds.values()):
                outs = self._run_bound(feeds, n)
            else:
                outs = self._run_plain(feeds)
        stats = self.stats
        stats["batches"] += 1
        stats["items"] += n
        return outs

    def _run_plain(self, feeds: dict) -> dict:
        """``session.run`` without IO binding: ORT cannot bind string tensors."""
        return dict(zip(self._names, self.session.run(self._names, feeds), strict=True))

    @abc.abstractmethod
    def close(self) -> None:
        """Release the instance's buffers; the session goes with the instance."""

"""ONNX Runtime engine: one session per instance, explicit threads, IO binding.

Each instance owns one ``InferenceSession``, one single-thread executor (so runs of one
instance never overlap and its arena needs no locks) and one :class:`BufferArena`.  Inputs are
assembled by the plan (compiled gather / ragged pad) into 64-byte-aligned arena buffers and
bound with IO binding, so ORT reads them in place; outputs whose shape is known are bound to
freshly allocated arrays that ORT writes into directly, and callers get views of them (a batch's
outputs are never recycled, so the views stay valid).

The engine knows nothing of tasks: it executes a :class:`ModelSpec`.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import InternalError
from .buffers import BufferArena
from .plan import ModelSpec, PreparedModelRequest
from .session import default_intra_op_threads, session_options


class EngineInstance:
    """One ORT session + its worker thread + its input arena (CPU)."""

    def __init__(self, spec: ModelSpec, name: str, index: int, intra_op_threads: int,
                 allow_spinning: bool,
                 postprocess: Callable[[dict, Sequence[PreparedModelRequest]], list]):
        import onnxruntime as ort

        self.spec = spec
        self.name = f"{name}#{index}"
        self.postprocess = postprocess
        so = session_options(intra_op_threads, allow_spinning, spec.session_config)
        self.session = ort.InferenceSession(spec.path, so, providers=["CPUExecutionProvider"])
        self.arena = BufferArena()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"lumen-{self.name}")
        self.stats: dict = {"batches": 0, "items": 0, "real_tokens": 0, "padded_tokens": 0}
        self._binding = self.session.io_binding()
        self._lock = threading.Lock()  # guards against accidental concurrent use only
        known = {o.name for o in self.session.get_outputs()}
        missing = [o.name for o in spec.outputs if o.name not in known]
        if missing:
            raise InternalError(f"model {spec.path} has no output(s) {missing}; it has {sorted(known)}")

    def run(self, items: Sequence[PreparedModelRequest]) -> dict:
        """Assemble, bind and run one batch; return ``{output_name: ndarray [N, ...]}``."""
        n = len(items)
        stats: dict = {}
        feeds = {}
        for plan in self.spec.inputs:
            feeds.update(plan.assemble(items, self.arena, stats))
        if any(arr.dtype.hasobject for arr in feeds.values()):
            outs = self._run_plain(feeds)
        else:
            outs = self._run_bound(feeds, n)
        self.stats["batches"] += 1
        self.stats["items"] += n
        for k, v in stats.items():
            self.stats[k] = self.stats.get(k, 0) + v
        return outs

    def _run_plain(self, feeds: dict) -> dict:
        """``session.run`` without IO binding: ORT cannot bind string tensors (e.g. a string
        CORRID control of a sequence model)."""
        names = [o.name for o in self.spec.outputs]
        with self._lock:
            return dict(zip(names, self.session.run(names, feeds), strict=True))

    def _run_bound(self, feeds: dict, n: int) -> dict:
        with self._lock:
            io = self._binding
            io.clear_binding_inputs()
            io.clear_binding_outputs()
            for name, arr in feeds.items():
                io.bind_cpu_input(name, arr)
            outs = {}
            unbound = []
            for o in self.spec.outputs:
                if o.item_shape is not None:
                    arr = np.empty((n,) + tuple(o.item_shape), dtype=o.dtype)
                    io.bind_output(o.name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
                    outs[o.name] = arr
                else:
                    io.bind_output(o.name, "cpu")
                    unbound.append(o.name)
            self.session.run_with_iobinding(io)
            if unbound:
                produced = io.copy_outputs_to_cpu()
                names = [o.name for o in self.spec.outputs]
                for name in unbound:
                    outs[name] = produced[names.index(name)]
        return outs

    def execute(self, items: Sequence[PreparedModelRequest]) -> list:
        """Worker entry point (in this instance's thread): run + backend postprocess."""
        return self.postprocess(self.run(items), items)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.arena.release()


def make_instances(spec: ModelSpec, name: str, device: str, instances: int, intra_op_threads: int,
                   allow_spinning: Optional[bool], postprocess) -> list:
    """Build ``instances`` engine instances for ``device`` with explicit thread settings."""
    threads = intra_op_threads or default_intra_op_threads(instances)
    # Spinning burns the cores other sessions (and the event loop) need: off unless asked for.
    spin = bool(allow_spinning) if allow_spinning is not None else False
    if device.startswith("cuda"):
        from .cuda import CudaEngineInstance

        dev = int(device.split(":", 1)[1])
        return [CudaEngineInstance(spec, name, i, threads, spin, postprocess, dev)
                for i in range(instances)]
    return [EngineInstance(spec, name, i, threads, spin, postprocess) for i in range(instances)]


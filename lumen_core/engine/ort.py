"""ONNX Runtime CPU engine instance: one session, IO binding, one aligned input arena.

Inputs are assembled by the caller's plans into 64-byte-aligned arena buffers and bound with IO
binding, so ORT reads them in place; outputs whose shape is known (``OutputSpec.item_shape``,
with the batch at ``batch_axis``) are bound to freshly allocated arrays that ORT writes into
directly, and callers get views of them (a batch's outputs are never recycled, so the views
stay valid).  Silero's state output ``[2, N, 128]`` is bound this way too, so the state a
sequence carries is written once, by ORT, and scattered into its slots once.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .base import EngineInstance, output_shape
from .buffers import BufferArena
from .plan import ModelSpec
from .session import default_intra_op_threads


class CpuEngineInstance(EngineInstance):
    """One ORT CPU session + its input arena."""

    def __init__(self, spec: ModelSpec, name: str, intra_op_threads: int, allow_spinning: bool):
        super().__init__(spec, name, intra_op_threads, allow_spinning)
        self.arena = BufferArena()
        self._binding = self.session.io_binding()

    def _session(self, options: Any) -> Any:
        import onnxruntime as ort

        return ort.InferenceSession(self.spec.path, options, providers=["CPUExecutionProvider"])

    def next_arena(self) -> BufferArena:
        return self.arena

    def _run_bound(self, feeds: dict, n: int) -> dict:
        io = self._binding
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        for name, arr in feeds.items():
            io.bind_cpu_input(name, arr)
        outs = {}
        unbound = []
        for o in self.spec.outputs:
            if o.item_shape is not None:
                arr = np.empty(output_shape(o, n), dtype=o.dtype)
                io.bind_output(o.name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
                outs[o.name] = arr
            else:
                io.bind_output(o.name, "cpu")
                unbound.append(o.name)
        self.session.run_with_iobinding(io)
        if unbound:
            produced = io.copy_outputs_to_cpu()
            for name in unbound:
                outs[name] = produced[self._names.index(name)]
        return outs

    def close(self) -> None:
        self.arena.release()


def make_instances(spec: ModelSpec, name: str, device: str, instances: int, intra_op_threads: int,
                   allow_spinning: Optional[bool]) -> list:
    """Build ``instances`` engine instances for ``device`` with explicit thread settings."""
    threads = intra_op_threads or default_intra_op_threads(instances)
    # Spinning burns the cores other sessions (and the event loop) need: off unless asked for.
    spin = bool(allow_spinning) if allow_spinning is not None else False
    if device.startswith("cuda"):
        from .cuda import CudaEngineInstance

        dev = int(device.split(":", 1)[1])
        return [CudaEngineInstance(spec, f"{name}#{i}@cuda:{dev}", threads, spin, dev)
                for i in range(instances)]
    return [CpuEngineInstance(spec, f"{name}#{i}", threads, spin) for i in range(instances)]

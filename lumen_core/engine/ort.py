"""ONNX Runtime CPU engine instance: one session, one aligned input arena.

Inputs are assembled by the caller's plans into 64-byte-aligned arena buffers that ORT reads in
place (a C-contiguous numpy input of the model's dtype is wrapped, not copied); every output
comes back as a fresh array, so callers may keep views of it (a batch's outputs are never
recycled).  The run is ``InferenceSession.run``, not IO binding: on the CPU, binding buys
nothing a run does not already do (ORT allocates an output either way) and costs four Python
wrapper calls a batch, which makes a small model's run slower with binding than without
(``bench/bench_handover.py`` measures both on the null model).  The CUDA instance binds (``cuda.py``):
there the binding is what keeps inputs and outputs on the device.
"""
from __future__ import annotations

from typing import Any, Optional

from .base import EngineInstance
from .buffers import BufferArena
from .plan import ModelSpec
from .session import default_intra_op_threads


class CpuEngineInstance(EngineInstance):
    """One ORT CPU session + its input arena."""

    def __init__(self, spec: ModelSpec, name: str, intra_op_threads: int, allow_spinning: bool):
        super().__init__(spec, name, intra_op_threads, allow_spinning)
        self.arena = BufferArena()

    def _session(self, options: Any) -> Any:
        import onnxruntime as ort

        return ort.InferenceSession(self.spec.path, options, providers=["CPUExecutionProvider"])

    def next_arena(self) -> BufferArena:
        return self.arena

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

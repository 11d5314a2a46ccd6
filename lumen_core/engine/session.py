"""ONNX Runtime session setup and model I/O reading: the one home of both.

Engine instances (CPU and CUDA), the task backends (reading a model's inputs and outputs at
load) and ``models/`` (offline preparation and reference checks) all build sessions and read
ONNX graphs through here, so every figure the project measures uses the same settings.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from ..contract import ONNX_ELEM_TYPES

#: ORT session config key: whether intra-op worker threads spin while waiting for work
SPIN_KEY = "session.intra_op.allow_spinning"
INTER_SPIN_KEY = "session.inter_op.allow_spinning"
#: ORT's quietest log level: model errors reach the caller as InternalError instead
QUIET_LOG_SEVERITY = 4


def default_intra_op_threads(instances: int) -> int:
    """Cores per instance when the config leaves ``intra_op_threads`` at 0."""
    return max(1, (os.cpu_count() or 1) // max(1, instances))


def session_options(intra_op_threads: int, allow_spinning: bool = False,
                    extra: Optional[dict] = None) -> Any:
    """Explicit thread settings, sequential execution, full graph optimisation, no spinning
    unless asked for (spinning burns the cores other sessions and the event loop need)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = intra_op_threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry(SPIN_KEY, "1" if allow_spinning else "0")
    so.add_session_config_entry(INTER_SPIN_KEY, "0")
    for k, v in (extra or {}).items():
        so.add_session_config_entry(k, str(v))
    so.log_severity_level = QUIET_LOG_SEVERITY
    return so


def cpu_session(path: Any, intra_op_threads: int = 2, allow_spinning: bool = False,
                extra: Optional[dict] = None) -> Any:
    """An ORT CPU ``InferenceSession`` with :func:`session_options`; ``path`` may also be a
    serialised model (bytes)."""
    import onnxruntime as ort

    model = path if isinstance(path, (bytes, bytearray)) else str(path)
    return ort.InferenceSession(model, session_options(intra_op_threads, allow_spinning, extra),
                                providers=["CPUExecutionProvider"])


def read_io(path: str) -> tuple:
    """(inputs, outputs) of an ONNX file as ``[(name, dtype_name, dims)]``; dims hold ints for
    fixed sizes and None for symbolic ones.  Initializers are not inputs."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    inits = {i.name for i in model.graph.initializer}

    def conv(values: Sequence[Any]) -> list:
        out = []
        for v in values:
            if v.name in inits:
                continue
            tt = v.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            out.append((v.name, ONNX_ELEM_TYPES.get(tt.elem_type, f"onnx-type-{tt.elem_type}"), dims))
        return out

    return conv(model.graph.input), conv(model.graph.output)

"""CUDA engine instance (``device = "cuda:N"``, extra ``[gpu]``).

The batch is assembled by the same plan as on CPU, but into *pinned* host buffers from CuPy
(``cupyx.empty_pinned``), copied to device buffers asynchronously on a CUDA stream that ONNX
Runtime also computes on (``user_compute_stream``), and bound with IO binding as device
pointers, so ORT neither copies nor synchronises on its own.  Two pinned arenas alternate
(double buffering): batch k+1 is assembled into the other arena while batch k's host-to-device
copies may still be in flight, and an event per arena guards against reusing a buffer before
its copy has finished.  Outputs with a known shape are bound to device buffers and copied back
into host arrays on the same stream; the only synchronisation is that final copy.

CuPy and CUDA are imported lazily: without them this module is never loaded and the CPU path
runs.  This path is exercised by ``tests/test_cuda.py`` on a machine with a GPU.  The base
class gives it what the CPU instance has: the output check at load and the plain-run path for
string inputs (a string CORRID control).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import Unavailable
from .base import EngineInstance, output_shape
from .plan import ModelSpec

PINNED_GROWTH = 2  # capacity multiplier when a pinned or device buffer must grow


def _import_cupy():
    try:
        import cupy
        import cupyx
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise Unavailable("device cuda:N needs CuPy and onnxruntime-gpu: "
                          "pip install 'lumen-core[gpu]'") from exc
    return cupy, cupyx


class PinnedArena:
    """Like :class:`~lumen_core.engine.buffers.BufferArena`, over page-locked host memory."""

    def __init__(self, cupyx):
        self._cupyx = cupyx
        self._bufs: dict = {}

    def get(self, name: str, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._cupyx.empty_pinned((max(nbytes, 64) * PINNED_GROWTH,), dtype=np.uint8)
            self._bufs[name] = buf
        return buf[:nbytes].view(dtype).reshape(shape)

    def release(self) -> None:
        self._bufs.clear()


class CudaEngineInstance(EngineInstance):
    """One ORT CUDA session on its own stream, with double-buffered pinned staging."""

    binds = True

    def __init__(self, spec: ModelSpec, name: str, intra_op_threads: int, allow_spinning: bool,
                 device_id: int):
        import onnxruntime as ort

        cupy, cupyx = _import_cupy()
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Unavailable("onnxruntime has no CUDAExecutionProvider here; install "
                              "onnxruntime-gpu (pip install 'lumen-core[gpu]')")
        self._cp = cupy
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._events = [cupy.cuda.Event(), cupy.cuda.Event()]
        super().__init__(spec, name, intra_op_threads, allow_spinning)
        self._arenas = [PinnedArena(cupyx), PinnedArena(cupyx)]
        self._turn = 0
        self._k = 0
        self._device: dict = {}
        self._binding = self.session.io_binding()

    def _session(self, options: Any) -> Any:
        import onnxruntime as ort

        provider = ("CUDAExecutionProvider", {
            "device_id": str(self.device_id),
            "user_compute_stream": str(self.stream.ptr),
            "do_copy_in_default_stream": "0",
        })
        return ort.InferenceSession(self.spec.path, options,
                                    providers=[provider, "CPUExecutionProvider"])

    def next_arena(self) -> PinnedArena:
        """Alternate the two pinned arenas; the one we are about to overwrite may still feed
        an in-flight host-to-device copy of the batch before last."""
        k = self._k = self._turn
        self._turn ^= 1
        self._events[k].synchronize()
        return self._arenas[k]

    def _device_buffer(self, key: str, shape: tuple, dtype: Any) -> Any:
        cp = self._cp
        dtype = np.dtype(dtype)
        n = int(np.prod(shape))
        buf = self._device.get(key)
        if buf is None or buf.size < n * dtype.itemsize:
            with cp.cuda.Device(self.device_id):
                buf = cp.empty(max(n * dtype.itemsize, 64) * PINNED_GROWTH, dtype=cp.uint8)
            self._device[key] = buf
        return buf[: n * dtype.itemsize].view(dtype).reshape(shape)

    def _run_bound(self, feeds: dict, n: int) -> dict:
        cp = self._cp
        k = self._k
        io = self._binding
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        with cp.cuda.Device(self.device_id):
            for name, host in feeds.items():
                dev = self._device_buffer(f"in:{name}:{k}", host.shape, host.dtype)
                dev.set(host, stream=self.stream)  # async: host memory is pinned
                io.bind_input(name, "cuda", self.device_id, host.dtype, host.shape, dev.data.ptr)
            self._events[k].record(self.stream)
            dev_outs = {}
            for o in self.spec.outputs:
                if o.item_shape is not None:
                    shape = output_shape(o, n)
                    dev = self._device_buffer(f"out:{o.name}", shape, o.dtype)
                    io.bind_output(o.name, "cuda", self.device_id, np.dtype(o.dtype), shape,
                                   dev.data.ptr)
                    dev_outs[o.name] = dev
                else:
                    io.bind_output(o.name, "cpu")
            self.session.run_with_iobinding(io)
            outs = {}
            for name, dev in dev_outs.items():
                host = np.empty(dev.shape, dtype=dev.dtype)
                dev.get(stream=self.stream, out=host)
                outs[name] = host
            self.stream.synchronize()
        unbound = [o.name for o in self.spec.outputs if o.item_shape is None]
        if unbound:
            produced = io.copy_outputs_to_cpu()
            for name in unbound:
                outs[name] = produced[self._names.index(name)]
        return outs

    def close(self) -> None:
        for a in self._arenas:
            a.release()
        self._device.clear()

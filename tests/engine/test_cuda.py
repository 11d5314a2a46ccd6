"""CUDA engine path (pinned staging, user compute stream, IO binding on device buffers).

Runs only where CuPy, onnxruntime-gpu and a CUDA device exist (the GPU machine); elsewhere the
module is skipped as a whole, because there is nothing to run it on.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (extra [gpu])")
ort = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in ort.get_available_providers():
    pytest.skip("onnxruntime has no CUDAExecutionProvider", allow_module_level=True)
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device", allow_module_level=True)
except cupy.cuda.runtime.CUDARuntimeError:
    pytest.skip("no CUDA driver", allow_module_level=True)

import onnx_models as M  # noqa: E402

import lumen_core as lc  # noqa: E402

pytestmark = pytest.mark.cuda


def test_cuda_results_equal_cpu_under_concurrency(tmp_path):
    path = M.mlp(tmp_path / "mlp.onnx")
    xs = np.random.default_rng(0).standard_normal((500, 16)).astype(np.float32)
    cfg = {"tasks": [{"name": "mlp", "backend": "onnx", "model": str(path), "device": "cuda:0",
                      "batching": {"max_batch_size": 32, "max_queue_delay_us": 0}}]}

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            reqs = [lc.new_infer_request("mlp").for_tensor_array(xs[i:i + 1], "NC", "none").build()
                    for i in range(len(xs))]
            return await asyncio.gather(*[rt.infer(r) for r in reqs])

    res = asyncio.run(main())
    got = np.stack([r.outputs["y"] for r in res])
    np.testing.assert_allclose(got, M.mlp_reference(xs), atol=1e-4)
    assert max(int(r.meta["lumen.batch.size"]) for r in res) > 1


def test_cuda_failure_isolation(tmp_path):
    path = M.mlp(tmp_path / "failing.onnx", fail_marker=True)
    xs = np.random.default_rng(1).standard_normal((40, 16)).astype(np.float32)
    xs[7, 0] = M.FAIL_MARKER
    cfg = {"tasks": [{"name": "mlp", "backend": "onnx", "model": str(path), "device": "cuda:0",
                      "batching": {"max_batch_size": 16, "max_queue_delay_us": 0}}]}

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            reqs = [lc.new_infer_request("mlp").for_tensor_array(xs[i:i + 1], "NC", "none").build()
                    for i in range(len(xs))]
            return await asyncio.gather(*[rt.infer(r) for r in reqs], return_exceptions=True)

    res = asyncio.run(main())
    assert isinstance(res[7], lc.InternalError)
    ok = [i for i in range(40) if i != 7]
    np.testing.assert_allclose(np.stack([res[i].outputs["y"] for i in ok]),
                               M.mlp_reference(xs[ok]), atol=1e-4)

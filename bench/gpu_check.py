"""The GPU check (issue 37 item 5): what a CUDA machine can tell us, in one run of minutes.

On a machine with an NVIDIA GPU, CuPy for its CUDA (``cupy-cuda13x`` on CUDA 13) and, most
likely, no onnxruntime-gpu (its wheels trail new CUDA releases), this script:

1. builds the compiled extensions in place (``setup.py build_ext --inplace``);
2. runs the ``cuda``-marked tests (``tests/engine/test_cuda.py``) and prints their outcome,
   skips included with their reasons;
3. measures the engine's staging path per batch -- the batch's request payloads gathered
   (``native.assemble.gather``, the compiled copy) into a pinned host buffer
   (``engine.cuda.PinnedArena``) and copied to a device buffer asynchronously on a stream,
   as ``CudaEngineInstance`` does -- against a plain ``cupy.asarray`` of the same bytes
   (pageable ``np.concatenate`` then a synchronous copy), median of repeats, per batch size;
4. prints what it could not check and why (IO binding on the CUDA execution provider needs
   onnxruntime-gpu; a machine without CuPy or without a device cannot run any of it).

Without a GPU it says so, prints what it would have run, and exits 0: nothing here pretends.

    python bench/gpu_check.py [--no-build] [--repeats 200]     (make gpu-check)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: (batch size, bytes per item): a null-model row, a text row, an image
SHAPES = ((32, 64), (32, 4096), (8, 3 * 224 * 224 * 4))
#: the whole check's budget; each step is bounded within it
BUDGET_S = 300


def gpu_present() -> tuple:
    """(True, description) when CuPy sees a CUDA device, else (False, why not)."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        return False, "no NVIDIA GPU on this machine (no nvidia-smi, no /dev/nvidia0)"
    try:
        import cupy
    except ImportError:
        return False, ("a GPU may be present but CuPy is not installed (pip install "
                       "cupy-cuda13x for CUDA 13)")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - a driver error is the answer
        return False, f"CuPy cannot reach a CUDA device: {exc}"
    if n < 1:
        return False, "CuPy sees no CUDA device"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return True, (f"{n} device(s), device 0: {name}; CUDA runtime "
                  f"{cupy.cuda.runtime.runtimeGetVersion()}, CuPy {cupy.__version__}")


def run(cmd: list, timeout: float) -> tuple:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    return p.returncode, (p.stdout + p.stderr), time.perf_counter() - t0


def measure(repeats: int) -> list:
    """Per batch shape: (batch, item bytes, staged us, asarray us) medians."""
    import cupy
    import cupyx

    from lumen_core import native
    from lumen_core.engine.cuda import PinnedArena

    gather = native.assemble.gather
    stream = cupy.cuda.Stream(non_blocking=True)
    out = []
    for batch, nbytes in SHAPES:
        rng = np.random.default_rng(0)
        items = [rng.integers(0, 255, nbytes, dtype=np.uint8).tobytes() for _ in range(batch)]
        arena = PinnedArena(cupyx)
        dev = cupy.empty(batch * nbytes, dtype=cupy.uint8)
        staged, plain = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            host = arena.get("x", (batch, nbytes), np.uint8)
            gather(items, host)
            dev.set(host.reshape(-1), stream=stream)
            stream.synchronize()
            staged.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            arr = cupy.asarray(np.frombuffer(b"".join(items), dtype=np.uint8))
            cupy.cuda.Device().synchronize()
            plain.append(time.perf_counter() - t0)
            del arr
        host = arena.get("x", (batch, nbytes), np.uint8)
        gather(items, host)
        dev.set(host.reshape(-1), stream=stream)
        stream.synchronize()
        assert bytes(dev.get()) == b"".join(items), "the staged copy differs from its items"
        arena.release()
        out.append((batch, nbytes, statistics.median(staged) * 1e6,
                    statistics.median(plain) * 1e6))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-build", action="store_true", help="use the extensions already built")
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    t_start = time.perf_counter()
    ok, what = gpu_present()
    if not ok:
        print(f"gpu-check: NO GPU -- {what}.")
        print("gpu-check: nothing was checked: not the build for CUDA, not the cuda-marked "
              "tests (tests/engine/test_cuda.py), not the pinned staging + host-to-device copy "
              "against cupy.asarray.  Run `make gpu-check` on a CUDA machine with CuPy.")
        return 0
    print(f"gpu-check: {what}")
    unchecked = []
    failed = False
    if not a.no_build:
        rc, text, dt = run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], 180)
        print(f"gpu-check: build_ext --inplace: {'ok' if rc == 0 else 'FAILED'} ({dt:.0f} s)")
        if rc != 0:
            print(text[-3000:])
            return 1
    left = BUDGET_S - (time.perf_counter() - t_start)
    rc, text, dt = run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda",
                        "tests/engine/test_cuda.py"], max(30.0, left - 60))
    tail = [ln for ln in text.splitlines() if ln.strip()][-12:]
    print(f"gpu-check: cuda-marked tests ({dt:.0f} s), rc {rc}:")
    for ln in tail:
        print("    " + ln)
    if rc == 5 or "skipped" in text and "passed" not in text:
        unchecked.append("the cuda-marked tests were skipped (see the reasons above)")
    elif rc != 0:
        failed = True
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            unchecked.append("IO binding on the CUDA execution provider and CudaEngineInstance "
                             "end to end: onnxruntime has no CUDAExecutionProvider (install "
                             "onnxruntime-gpu built for this CUDA)")
    except ImportError:
        unchecked.append("anything with ONNX Runtime: onnxruntime is not installed")
    print("gpu-check: staging per batch (median of %d): pinned gather + async H2D copy vs "
          "cupy.asarray of the same bytes" % a.repeats)
    for batch, nbytes, staged, plain in measure(a.repeats):
        print(f"    {batch:3d} x {nbytes:7d} B: staged {staged:8.1f} us  asarray {plain:8.1f} us"
              f"  ratio {staged / plain:.2f}x")
    print(f"gpu-check: done in {time.perf_counter() - t_start:.0f} s")
    for u in unchecked:
        print(f"gpu-check: NOT CHECKED -- {u}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

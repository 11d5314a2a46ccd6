"""The CUDA engine's staging path per batch, as a suite entry (``gpu_check.measure``).

A batch's request payloads gathered by the compiled ``native.assemble.gather`` into a pinned
host buffer (``engine.cuda.PinnedArena``) and copied to the device asynchronously on a stream,
as ``CudaEngineInstance`` does, against a plain ``cupy.asarray`` of the same bytes; medians
per batch shape.  ``bench/gpu_check.py`` (``make gpu-check``) runs the same measurement beside
the build and the ``cuda``-marked tests.  Without a GPU or CuPy it is skipped, with the reason
``gpu_check.gpu_present`` gives.

    python bench/bench_gpu_staging.py [--quick] [--repeats 200]
"""
from __future__ import annotations

import argparse

import gpu_check
import harness


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200, help="copies per shape (median)")
    harness.add_quick(ap, repeats=50)
    args = harness.parse(ap)
    ok, what = gpu_check.gpu_present()
    if not ok:
        harness.skip(what)
    print(f"{what}; median of {args.repeats} copies per shape")
    figures = {}
    for batch, nbytes, staged, plain in gpu_check.measure(args.repeats):
        key = f"{batch} x {nbytes} B"
        figures[f"{key}: staged"] = harness.value(staged, "us")
        figures[f"{key}: staged / cupy.asarray"] = harness.value(staged / plain, "x")
    harness.emit(figures, args=args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

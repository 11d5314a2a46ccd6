"""Loop-thread CPU per request on a tiny model, with only the API every tree has had.

``bench_scheduler.py`` needs this round's API (``infer_many``, ``Runtime._payload``); this one
uses only ``Runtime.infer``, ``parse_meta`` and ``backend.prepare``, so the same figure can be
measured on an older tree in the same session (before/after in bench/README.md):

    python bench/bench_loop_cpu.py .                                   # this tree
    git worktree add /tmp/old 4bc668b && (cd /tmp/old && python setup.py build_ext --inplace)
    PYTHONPATH=/tmp/old python bench/bench_loop_cpu.py /tmp/old       # the old one
"""
import asyncio
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "tests"))

import onnx_models as M  # noqa: E402

import lumen_core as lc  # noqa: E402
from lumen_core import native  # noqa: E402

D = 8
REPS = 20000
CALLERS = 256


async def loop_cpu(rt, reqs: list) -> tuple:
    per = len(reqs) // CALLERS

    async def caller(k: int) -> None:
        for r in reqs[k * per:(k + 1) * per]:
            await rt.infer(r)

    c0, t0 = time.thread_time(), time.perf_counter()
    await asyncio.gather(*[caller(k) for k in range(CALLERS)])
    n = per * CALLERS
    return (time.thread_time() - c0) / n * 1e6, n / (time.perf_counter() - t0)


def stage_us(fn) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(REPS):
        fn()
    return (time.perf_counter_ns() - t0) / REPS / 1000


async def main() -> None:
    path = M.mlp(os.path.join(tempfile.mkdtemp(), "t.onnx"), D, 16, D)
    cfg = {"tasks": [{"name": "tiny", "backend": "onnx", "model": path, "intra_op_threads": 1,
                      "batching": {"max_batch_size": 32, "max_queue_delay_us": 0,
                                   "max_queue_size": 1024}}]}
    xs = np.random.default_rng(0).standard_normal((40960, D)).astype(np.float32)
    reqs = [lc.new_infer_request("tiny").for_tensor_array(xs[i:i + 1], "NC", "none").build()
            for i in range(len(xs))]
    async with lc.Runtime.from_dict(cfg) as rt:
        await loop_cpu(rt, reqs[:4096])
        cpu, rate = await loop_cpu(rt, reqs)
        backend = rt.tasks["tiny"].backend
        req = reqs[0]
        pv = memoryview(req.payload)
        desc = native.descriptor.parse_meta(req.meta, pv.nbytes, backend.contract)
        parse = stage_us(lambda: native.descriptor.parse_meta(req.meta, pv.nbytes,
                                                              backend.contract))
        prepare = stage_us(lambda: backend.prepare(req, desc, pv))
    kind = "compiled" if native.using_extensions()["descriptor"] else "pure"
    print(f"{kind}: infer, {CALLERS} callers: {cpu:.2f} us loop CPU per request, {rate:,.0f} "
          f"req/s; parse_meta {parse:.2f} us, prepare {prepare:.2f} us; load "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())

"""Lumen on Ray Serve against a plain Ray Serve ``@serve.batch`` deployment (issue 18), one run.

Both serve the same prepared all-MiniLM-L6-v2 ONNX graph (mean pooling + L2 normalisation in
the graph) from the same ``$LUMEN_HOME``, as two replicas of 1 CPU and 1 ONNX Runtime thread
each (no spinning), behind the same Ray HTTP proxy of one local Ray instance, driven by the
same load generator (``lumen bench``'s: seeded corpus, one text per request, closed loop):

- ``lumen-ray``: :func:`lumen_core.integrations.ray.build_app` (Lumen's HTTP app and batcher
  in each replica; ``max_ongoing_requests`` as Lumen derives it);
- ``ray-batch``: what a Ray Serve user writes: a deployment whose ``__call__`` parses the JSON
  and awaits an ``@serve.batch(max_batch_size=32)`` method (Ray's default 10 ms wait) that
  tokenises the batch with ``tokenizers``, pads it and runs the ORT session;
  ``max_ongoing_requests=64`` (Ray's default of 5 would cap every batch at 5).

Both applications are deployed at once (``ray.init(num_cpus=4)`` logical CPUs on a 2-core box)
but only one is under load at a time; the targets alternate within each round, and the whole
comparison repeats ``--rounds`` times so the spread shows.  The load average is printed before
and after: the box is shared, and the figures move with what else runs.

    python bench/bench_ray.py [--count 512] [--concurrency 16 64] [--rounds 3]
    python bench/bench_ray.py --ingress proxy ...   # Ray's Python proxy instead of HAProxy

The ingress is ``lumen serve --ray``'s (:func:`lumen_core.integrations.ray_ingress.start_serve`):
HAProxy by default, the Python proxy with ``--ingress proxy`` (or where Ray has no HAProxy).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import statistics
import sys
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
import ray
from ray import serve

from lumen_core import loadgen, models
from lumen_core.engine.session import cpu_session
from lumen_core.integrations import ray as LR
from lumen_core.integrations import ray_ingress as RI
from lumen_core.models import minilm
from lumen_core.tasks.text_embedding import default_task_table

REPLICAS = 2
REPLICA_CPUS = 1.0
THREADS = 1
BATCH = 32
BASELINE_ONGOING = 64
LOGICAL_CPUS = 4


@serve.deployment(num_replicas=REPLICAS, max_ongoing_requests=BASELINE_ONGOING,
                  ray_actor_options={"num_cpus": REPLICA_CPUS})
class RayBatchBaseline:
    """The plain Ray Serve deployment: ORT + tokenizers under ``@serve.batch``."""

    def __init__(self, model_dir: str, threads: int):
        d = pathlib.Path(model_dir)
        self.sess = cpu_session(d / minilm.MODEL_FILE, threads)
        self.tok = minilm.load_tokenizer(d / minilm.TOKENIZER_FILE)

    @serve.batch(max_batch_size=BATCH)
    async def embed(self, texts: list) -> list:
        return list(minilm.embed(self.sess, self.tok, texts))

    async def __call__(self, request) -> dict:
        body = await request.json()
        vec = await self.embed(body["input"])
        return {"object": "list", "model": body.get("model", ""),
                "data": [{"object": "embedding", "index": 0, "embedding": vec.tolist()}]}


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=512, help="requests per measurement")
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--corpus-size", type=int, default=loadgen.DEFAULT_SIZE)
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--ingress", choices=RI.INGRESSES, default=RI.DEFAULT_INGRESS,
                    help="Ray Serve's ingress (default: lumen serve --ray's, HAProxy)")
    harness.add_quick(ap, count=128, warmup=16, concurrency=[16])
    args = harness.parse(ap)

    table = default_task_table()
    if table is None:
        harness.skip("the prepared MiniLM is missing: run `lumen models prepare` "
                     "(or set LUMEN_HOME)")
    model_dir = str(models.model_dir(models.MINILM))
    texts = loadgen.make_corpus(args.corpus_size, loadgen.DEFAULT_SEED)
    port = free_port()
    print(f"load average before: {load_avg()}; {REPLICAS} replicas x {REPLICA_CPUS:g} CPU x "
          f"{THREADS} ORT thread each; {args.count} requests per run "
          f"(+{args.warmup} warm-up)", flush=True)
    ray.init(num_cpus=LOGICAL_CPUS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": LR.replica_env()})
    results: list = []
    ingress = args.ingress
    try:
        ingress, notes = RI.start_serve("127.0.0.1", port, args.ingress)
        print(f"ingress: {ingress}", *notes, sep="; ", flush=True)
        lumen_cfg = {"tasks": [dict(table, instances=1, intra_op_threads=THREADS)]}
        serve.run(LR.build_app(lumen_cfg, num_replicas=REPLICAS, num_cpus=REPLICA_CPUS),
                  name="lumen", route_prefix="/lumen")
        serve.run(RayBatchBaseline.bind(model_dir, THREADS), name="baseline",
                  route_prefix="/baseline")
        base = f"http://127.0.0.1:{port}"
        targets = [("lumen-ray", f"{base}/lumen/v1/embeddings"),
                   ("ray-batch", f"{base}/baseline/v1/embeddings")]

        async def run_all() -> None:
            for rnd in range(args.rounds):
                for c in args.concurrency:
                    for name, url in targets if rnd % 2 == 0 else targets[::-1]:
                        r = await loadgen.bench_http(url, texts, c, args.count,
                                                     warmup=args.warmup, target=name)
                        r.round = rnd
                        results.append(r)
                        print(f"round {rnd + 1} {r.row()}   (load {load_avg()})", flush=True)

        asyncio.run(run_all())
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"load average after: {load_avg()}")
    print(f"\nratios lumen-ray / ray-batch per round (req/s; p99 latency; ingress: {ingress}):")
    figures = {}
    for c in args.concurrency:
        ratios, p99s = [], []
        for rnd in range(args.rounds):
            by = {r.target: r for r in results if r.concurrency == c and r.round == rnd}
            lum, bat = by["lumen-ray"], by["ray-batch"]
            ratios.append(lum.rps / bat.rps if bat.rps else float("inf"))
            p99s.append((lum.latency_ms["p99"], bat.latency_ms["p99"]))
        lum_rps = [r.rps for r in results if r.concurrency == c and r.target == "lumen-ray"]
        bat_rps = [r.rps for r in results if r.concurrency == c and r.target == "ray-batch"]
        print(f"c={c}: lumen-ray {statistics.median(lum_rps):.1f} req/s "
              f"[{min(lum_rps):.1f}-{max(lum_rps):.1f}], ray-batch "
              f"{statistics.median(bat_rps):.1f} [{min(bat_rps):.1f}-{max(bat_rps):.1f}]; "
              f"ratio median {statistics.median(ratios):.2f}x [{min(ratios):.2f}-"
              f"{max(ratios):.2f}]; p99 ms (lumen, batch) "
              + ", ".join(f"({a:.0f}, {b:.0f})" for a, b in p99s))
        figures[f"c={c} lumen-ray"] = harness.stat(lum_rps, "req/s")
        figures[f"c={c} ray-batch"] = harness.stat(bat_rps, "req/s")
        figures[f"c={c} lumen-ray / ray-batch"] = harness.stat(ratios, "x")
    errors = sum(r.errors for r in results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r.to_dict(), round=r.round) for r in results], f, indent=1)
    if errors:
        print(f"{errors} failed requests", file=sys.stderr)
    else:
        harness.emit(figures, args=args)
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(code)

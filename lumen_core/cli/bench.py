"""``lumen bench``: closed-loop (concurrency) or open-loop (``--rate``) load on an
embeddings endpoint, ours or a peer's, or on the runtime in process."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from .common import API_KEY_HELP, EXIT_OK, api_key, at_least_one, build_runtime, run

DEFAULT_CONCURRENCY = (16, 64)


def _targets(args: argparse.Namespace) -> list:
    """(name, url) pairs from --url / --target NAME=URL."""
    out = []
    for url in args.url or []:
        out.append(("lumen" if len(args.url) == 1 and not args.target else url, url))
    for spec in args.target or []:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--target takes NAME=URL, got {spec!r}")
        out.append((name, url))
    return out


def cmd_bench(args: argparse.Namespace) -> int:

    from .. import loadgen

    targets = _targets(args)
    if not targets and not args.in_process:
        raise ValueError("nothing to measure: give --url URL, --target NAME=URL or --in-process")
    key = api_key(args)
    texts = loadgen.make_corpus(args.corpus_size, args.seed)
    if args.rate is not None:
        return _bench_open_loop(args, targets, key, texts)
    count = args.count or len(texts)
    results: list = []

    async def run_all() -> None:
        for name, url in targets:
            for c in args.concurrency:
                results.append(await loadgen.bench_http(url, texts, c, count, args.model,
                                                        args.warmup, name, api_key=key))
        if args.in_process:
            rt = build_runtime(args.config, only_task=args.model)
            async with rt:
                for c in args.concurrency:
                    results.append(await loadgen.bench_runtime(rt, texts, c, count, args.model,
                                                               args.warmup))

    print(f"corpus: {len(texts)} texts (seed {args.seed}); {count} requests per run, "
          f"warm-up {args.warmup}", file=sys.stderr)
    run(run_all())
    print(loadgen.format_table(results))
    for r in results:
        if r.errors:
            print(f"{r.target} c={r.concurrency}: {r.errors} errors, first: {r.first_error}",
                  file=sys.stderr)
    _write_results(args, results, loadgen.plot)
    return EXIT_OK if all(r.errors == 0 for r in results) else 1


def _bench_open_loop(args: argparse.Namespace, targets: list, key: Optional[str],
                     texts: list) -> int:
    """``lumen bench --rate R``: open-loop Poisson arrivals, per target (see loadgen.py)."""

    from .. import openloop

    if not args.rate > 0 or not args.duration > 0:
        raise ValueError(f"--rate and --duration must be > 0, got {args.rate} and "
                         f"{args.duration}")
    results: list = []

    async def run_all() -> None:
        for name, url in targets:
            results.append(await openloop.bench_http_open_loop(
                url, texts, args.rate, args.duration, args.model, args.target_ms, args.seed,
                name, api_key=key))
        if args.in_process:
            rt = build_runtime(args.config, only_task=args.model)
            async with rt:
                results.append(await openloop.bench_runtime_open_loop(
                    rt, texts, args.rate, args.duration, args.model, args.target_ms,
                    args.seed))

    run(run_all())
    for r in results:
        print(openloop.format_open_loop(r))
        if r.first_error:
            print(f"{r.target}: first client error: {r.first_error}", file=sys.stderr)
    _write_results(args, results, openloop.plot_open_loop)
    return EXIT_OK


def _write_results(args: argparse.Namespace, results: list,
                   plot: Callable[[list, str], None]) -> None:
    """``lumen bench``'s --json (every result's dict) and --plot files."""
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)


def add_bench(sub: argparse._SubParsersAction) -> None:
    from ..corpus import DEFAULT_SEED, DEFAULT_SIZE
    from ..loadgen import DEFAULT_TASK
    from ..openloop import DEFAULT_TARGET_MS

    p = sub.add_parser("bench", help="load-test an OpenAI-style embeddings endpoint (ours or a peer's)",
                       description="Closed-loop load over the seeded text corpus: one text per "
                                   "request, N concurrent keep-alive clients; prints req/s and "
                                   "p50/p95/p99 latency per target and concurrency.")
    p.add_argument("--url", action="append", metavar="URL",
                   help="embeddings URL (http://HOST:PORT means HOST:PORT/v1/embeddings); repeatable")
    p.add_argument("--target", action="append", metavar="NAME=URL",
                   help="a named target, e.g. infinity=http://127.0.0.1:7997/embeddings; repeatable")
    p.add_argument("--in-process", action="store_true",
                   help="also measure the runtime in this process (no HTTP), for reference")
    p.add_argument("--config", metavar="TOML", help="runtime config for --in-process")
    p.add_argument("--model", default=DEFAULT_TASK, help=f"the 'model' field: the task (default {DEFAULT_TASK})")
    p.add_argument("-c", "--concurrency", type=at_least_one, nargs="+", default=list(DEFAULT_CONCURRENCY),
                   metavar="N", help="concurrent clients, one run each (default: 16 64)")
    p.add_argument("-n", "--count", type=int, default=0,
                   help="requests per run (default: the corpus size)")
    p.add_argument("--warmup", type=int, default=64, help="untimed requests before each run")
    p.add_argument("--corpus-size", type=at_least_one, default=DEFAULT_SIZE)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="open loop instead: Poisson arrivals at R requests/s whatever the "
                        "answers; reports per second and in total sent, ok within --target-ms, "
                        "429, 504, other errors, p50/p95/p99 of the ok ones and goodput")
    p.add_argument("--duration", type=float, default=30.0, metavar="S",
                   help="with --rate: seconds of sending (default 30)")
    p.add_argument("--target-ms", type=float, default=DEFAULT_TARGET_MS, metavar="MS",
                   help=f"with --rate: an ok answer counts as good within this (default "
                        f"{DEFAULT_TARGET_MS})")
    p.add_argument("--plot", metavar="PNG", help="draw throughput/latency vs concurrency "
                                                 "(with --rate: latency and outcomes over time; "
                                                 "matplotlib)")
    p.add_argument("--api-key", default=None, metavar="KEY", help=API_KEY_HELP)
    p.set_defaults(func=cmd_bench)

"""The Open Inference Protocol's cost (issue 15): ``text_embed`` over the native routes and over
OIP, HTTP and gRPC, at each concurrency, in one run against one ``lumen serve``.

Rows (one text per request, the seeded ``lumen bench`` corpus, closed loop):

- ``native http /v1/embeddings`` and ``oip http /v2 (json)``: the same minimal keep-alive client
  (``loadgen.Connection``) posting pre-built JSON bodies, so the difference is the server's;
- ``native grpc lumen.v1 Infer`` and ``oip grpc ModelInfer``: the same ``grpc.aio`` client, one
  channel, pre-built messages;
- ``tritonclient http`` / ``tritonclient grpc``: Triton's own asyncio clients as a user runs
  them (binary tensors; their client-side cost is in the figure).

The routes alternate for ``--rounds`` rounds and each route's best round is reported, so a
neighbour's burst of load does not land on one route only.

The protocol's cost is each OIP row against its native twin on the same client.  On a 2-core
box the client shares the cores with the server: compare ratios within one run only.

    python bench/bench_oip.py [--count 2000] [--concurrency 16 64] [--rounds 2] [--home DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
import numpy as np

from lumen_core import loadgen, models
from lumen_core.serve.proto import lumen_pb2, open_inference_grpc_pb2

START_TIMEOUT_S = 240.0
TASK = "text_embed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(home: pathlib.Path) -> tuple:
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, LUMEN_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "lumen_core.cli", "serve", "--http-port",
                             str(http_port), "--grpc-port", str(grpc_port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lumen serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready",
                                        timeout=5) as r:
                if r.status == 200:
                    return proc, http_port, grpc_port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("lumen serve did not become ready")


async def run(call, n: int, c: int, count: int, warmup: int, label: str) -> loadgen.BenchResult:
    await loadgen._closed_loop(call, n, c, warmup, None)
    lat, errors, first, seconds = await loadgen._closed_loop(call, n, c, count, None)
    res = loadgen.summarize(label, c, lat, errors, seconds, first)
    print(f"{label} c={c}: {res.rps:.1f} req/s, p99 {res.latency_ms['p99']:.1f} ms"
          + (f", {errors} errors ({first})" if errors else ""), flush=True)
    return res


async def http_rows(port: int, texts: list, c: int, args) -> list:
    base = f"http://127.0.0.1:{port}"
    native = loadgen.request_bodies(texts, TASK)
    oip = [json.dumps({"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [1],
                                   "data": [t]}]}).encode() for t in texts]
    out = []
    for label, url, bodies in (("native http /v1/embeddings", base + "/v1/embeddings", native),
                               ("oip http /v2 (json)", base + f"/v2/models/{TASK}/infer", oip)):
        conns = [loadgen.Connection(url) for _ in range(c)]

        async def call(w: int, i: int, conns=conns, bodies=bodies) -> None:
            status, data = await conns[w].post(bodies[i])
            if status != 200:
                raise loadgen.HttpError(f"HTTP {status}: {data[:200]!r}")

        try:
            out.append(await run(call, len(texts), c, args.count, args.warmup, label))
        finally:
            for conn in conns:
                conn.close()
    return out


async def grpc_rows(port: int, texts: list, c: int, args) -> list:
    target = f"127.0.0.1:{port}"
    native = [lumen_pb2.InferRequest(task=TASK, payload=t.encode(), payload_mime="text/plain")
              .SerializeToString() for t in texts]
    oip = []
    for t in texts:
        m = open_inference_grpc_pb2.ModelInferRequest(model_name=TASK)
        m.inputs.add(name="raw", datatype="BYTES", shape=[1])
        b = t.encode()
        m.raw_input_contents.append(len(b).to_bytes(4, "little") + b)
        oip.append(m.SerializeToString())
    out = []
    async with grpc.aio.insecure_channel(target) as ch:
        for label, method, msgs in (
                ("native grpc lumen.v1 Infer", "/lumen.v1.Inference/Infer", native),
                ("oip grpc ModelInfer", "/inference.GRPCInferenceService/ModelInfer", oip)):
            rpc = ch.unary_unary(method, request_serializer=None, response_deserializer=None)

            async def call(w: int, i: int, rpc=rpc, msgs=msgs) -> None:
                await rpc(msgs[i])

            out.append(await run(call, len(texts), c, args.count, args.warmup, label))
    return out


async def triton_rows(http_port: int, grpc_port: int, texts: list, c: int, args) -> list:
    import tritonclient.grpc.aio as tgrpc
    import tritonclient.http.aio as thttp

    out = []
    arrays = [np.array([t.encode()], dtype=object) for t in texts]
    for label, mod, url in (("tritonclient http", thttp, f"127.0.0.1:{http_port}"),
                            ("tritonclient grpc", tgrpc, f"127.0.0.1:{grpc_port}")):
        client = mod.InferenceServerClient(url, **({"conn_limit": c} if mod is thttp else {}))

        async def call(w: int, i: int, mod=mod, client=client) -> None:
            inp = mod.InferInput("raw", [1], "BYTES")
            inp.set_data_from_numpy(arrays[i])
            res = await client.infer(TASK, [inp])
            res.as_numpy("embedding")

        try:
            out.append(await run(call, len(texts), c, args.count, args.warmup, label))
        finally:
            await client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--home", default=None)
    ap.add_argument("--no-tritonclient", action="store_true")
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternate the routes this many times; each route's best round counts")
    harness.add_quick(ap, count=300, concurrency=[16])
    args = harness.parse(ap)
    home = pathlib.Path(args.home) if args.home else models.lumen_home()
    if harness.quick(args):  # the suite does not build models; it says what is missing
        harness.require_model(models.MINILM, home)
    else:
        models.prepare(home=home)
    if not args.no_tritonclient:
        try:
            import tritonclient.http.aio  # noqa: F401 - only whether it is there
        except ImportError:
            print("tritonclient is not installed: its rows are left out (--no-tritonclient)")
            args.no_tritonclient = True
    texts = loadgen.make_corpus()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    proc, http_port, grpc_port = start(home)
    rows: list = []
    try:
        for _ in range(args.rounds):
            for c in args.concurrency:
                rows += asyncio.run(http_rows(http_port, texts, c, args))
                rows += asyncio.run(grpc_rows(grpc_port, texts, c, args))
                if not args.no_tritonclient:
                    rows += asyncio.run(triton_rows(http_port, grpc_port, texts, c, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| route | " + " | ".join(f"c={c} req/s" for c in args.concurrency) + " |")
    print("|" + "---|" * (1 + len(args.concurrency)))
    by: dict = {}
    for r in rows:  # the best round of each route
        if (r.target, r.concurrency) not in by or r.rps > by[(r.target, r.concurrency)].rps:
            by[(r.target, r.concurrency)] = r
    for label in dict.fromkeys(r.target for r in rows):
        cells = [f"{by[(label, c)].rps:.1f}" if (label, c) in by else "-"
                 for c in args.concurrency]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    figures = {f"{label} c={c} (best round)": harness.value(r.rps, "req/s")
               for (label, c), r in by.items()}
    for oip, native in (("oip http /v2 (json)", "native http /v1/embeddings"),
                        ("oip grpc ModelInfer", "native grpc lumen.v1 Infer")):
        for c in args.concurrency:
            a, b = by.get((oip, c)), by.get((native, c))
            if a and b and b.rps:
                print(f"c={c}: {oip} / {native} = {a.rps / b.rps:.3f} "
                      f"(protocol cost {100 * (1 - a.rps / b.rps):+.1f}%)")
                figures[f"c={c}: {oip} / {native}"] = harness.value(a.rps / b.rps, "x")
    harness.emit(figures, args=args)


if __name__ == "__main__":
    main()

"""HTTP load benchmark (issue 6): ``lumen bench`` against our server and two peers, one run.

Every system serves the same prepared all-MiniLM-L6-v2 ONNX encoder on this machine, is started
the same way (a subprocess on a loopback port, alone on the machine while it is measured) and is
driven by the same load generator (``lumen bench``: seeded 2,000-text corpus, one text per
request, closed loop at each concurrency).  The reference point is the offline best: ORT fed
length-sorted batches (of 16 and of 32, tokenisation included) with the same thread settings.

    python bench/bench_http.py [--count 2000] [--concurrency 16 64] [--threads 2]
                               [--peer-venv /work/infvenv] [--only lumen,fastapi-ort,infinity]

Peers run from their own virtualenv (``--peer-venv``, see ``bench/peers/README.md``).  Run it
when the machine is quiet: the load average is printed before and after, and so are the compiled
extensions our server runs (from its ``/healthz``), since a build without them is slower.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)

from lumen_core import loadgen, models
from lumen_core.engine.session import cpu_session  # noqa: E402
from lumen_core.models import minilm

HERE = pathlib.Path(__file__).resolve().parent
#: seconds a server gets to load its model and answer its first request
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
OFFLINE_BATCHES = (16, 32)
SYSTEMS = ("lumen", "fastapi-ort", "infinity")
BASE_PORT = 8110


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def offline_best(home: pathlib.Path, texts: list, threads: int) -> dict:
    """Texts/s of ORT over the corpus in length-sorted batches (tokenising each batch in the
    timed loop, as a server must); best of two passes per batch size."""
    model_dir = models.model_dir(models.MINILM, home)
    sess = cpu_session(model_dir / minilm.MODEL_FILE, threads)
    tok = minilm.load_tokenizer(model_dir / minilm.TOKENIZER_FILE)
    order = sorted(range(len(texts)), key=lambda i: len(tok.encode(texts[i]).ids))
    ordered = [texts[i] for i in order]
    out = {}
    for b in OFFLINE_BATCHES:
        batches = [ordered[i:i + b] for i in range(0, len(ordered), b)]
        minilm.embed(sess, tok, batches[-1])
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            for batch in batches:
                minilm.embed(sess, tok, batch)
            best = max(best, len(texts) / (time.perf_counter() - t0))
        out[f"sorted batches of {b}"] = best
    return out


def wait_ready(url: str, proc: subprocess.Popen, model: str) -> None:
    body = json.dumps({"model": model, "input": "warm up"}).encode()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server for {url} exited with {proc.returncode}")
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"{url} not ready after {START_TIMEOUT_S:.0f} s")


def lumen_extensions(port: int) -> dict:
    """The compiled extensions the server on ``port`` reports in use (its ``/healthz``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        return json.loads(r.read()).get("extensions", {})


def start(system: str, port: int, home: pathlib.Path, args: argparse.Namespace,
          workdir: pathlib.Path) -> tuple:
    """(process, embeddings URL) of one system on ``port``."""
    env = dict(os.environ, LUMEN_HOME=str(home), HF_HUB_OFFLINE="1", DO_NOT_TRACK="1",
               INFINITY_ANONYMOUS_USAGE_STATS="0")
    model_dir = models.model_dir(models.MINILM, home)
    peer_bin = pathlib.Path(args.peer_venv) / "bin"
    quiet = subprocess.DEVNULL
    if system == "lumen":
        cmd = [sys.executable, "-m", "lumen_core.cli", "serve", "--http-port", str(port),
               "--grpc-port", "0"]
        return subprocess.Popen(cmd, env=env, stdout=quiet, stderr=quiet), \
            f"http://127.0.0.1:{port}/v1/embeddings"
    if system == "fastapi-ort":
        cmd = [str(peer_bin / "python"), str(HERE / "peers" / "fastapi_ort.py"), "--model-dir",
               str(model_dir), "--port", str(port), "--threads", str(args.threads)]
        return subprocess.Popen(cmd, env=env, stdout=quiet, stderr=quiet), \
            f"http://127.0.0.1:{port}/v1/embeddings"
    if system == "infinity":
        folder = workdir / "infinity-model"
        subprocess.run([sys.executable, str(HERE / "peers" / "infinity_model.py"), str(folder),
                        "--model-dir", str(model_dir)], check=True, env=env, stdout=quiet)
        # infinity 0.0.78 + optimum 2.x only find the ONNX file by a bare name: start inside it
        cmd = [str(peer_bin / "infinity_emb"), "v2", "--model-id", ".", "--engine", "optimum",
               "--device", "cpu", "--batch-size", "32", "--pooling-method", "mean",
               "--port", str(port), "--no-vector-disk-cache", "--served-model-name", args.model]
        return subprocess.Popen(cmd, env=env, cwd=folder, stdout=quiet, stderr=quiet), \
            f"http://127.0.0.1:{port}/embeddings"
    raise SystemExit(f"unknown system {system!r} (known: {', '.join(SYSTEMS)})")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(system: str, url: str, args: argparse.Namespace, workdir: pathlib.Path) -> list:
    """Runs the ``lumen bench`` command itself (a subprocess, as a user would)."""
    out = workdir / f"{system}.json"
    cmd = [sys.executable, "-m", "lumen_core.cli", "bench", "--target", f"{system}={url}",
           "--model", args.model, "-n", str(args.count), "--warmup", str(args.warmup),
           "-c", *map(str, args.concurrency), "--json", str(out)]
    subprocess.run(cmd, check=False)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=loadgen.DEFAULT_SIZE)
    ap.add_argument("--warmup", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (offline, baseline)")
    ap.add_argument("--model", default="text_embed")
    ap.add_argument("--peer-venv", default="/work/infvenv")
    ap.add_argument("--only", default=",".join(SYSTEMS))
    ap.add_argument("--home", default=None, help="LUMEN_HOME (default: $LUMEN_HOME or ~/.cache/lumen)")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--plot", default=None, help="throughput/latency vs concurrency PNG (matplotlib)")
    harness.add_quick(ap, count=256, warmup=32, concurrency=[16])
    args = harness.parse(ap)
    home = pathlib.Path(args.home) if args.home else models.lumen_home()
    if harness.quick(args):  # the suite does not build models; it says what is missing
        harness.require_model(models.MINILM, home)
    else:
        models.prepare(home=home)
    if not pathlib.Path(args.peer_venv).is_dir():
        peers = [s for s in args.only.split(",") if s and s != "lumen"]
        if peers:
            print(f"the peers' virtualenv {args.peer_venv} is absent (bench/peers/README.md): "
                  f"left out {', '.join(peers)}", flush=True)
        args.only = "lumen" if "lumen" in args.only.split(",") else ""
    texts = loadgen.make_corpus()
    print(f"load average before: {load_avg()}", flush=True)
    # quick mode: the offline best over the texts the quick run sends (the first --count)
    offline = offline_best(home, texts[:args.count] if harness.quick(args) else texts,
                           args.threads)
    for k, v in offline.items():
        print(f"offline ORT, {k}: {v:.1f} texts/s", flush=True)
    best = max(offline.values())
    results: dict = {}
    extensions: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        for n, system in enumerate(s for s in args.only.split(",") if s):
            proc, url = start(system, BASE_PORT + n, home, args, workdir)
            try:
                wait_ready(url, proc, args.model)
                if system == "lumen":
                    extensions = lumen_extensions(BASE_PORT + n)
                    print(f"lumen extensions in use: {extensions}", flush=True)
                results[system] = measure(system, url, args, workdir)
            finally:
                stop(proc)
    print(f"load average after: {load_avg()}")
    print()
    header = "| system | " + " | ".join(f"c={c} req/s | c={c} p99 ms" for c in args.concurrency) + " |"
    print(header)
    print("|" + "---|" * (1 + 2 * len(args.concurrency)))
    for system, rows in results.items():
        by_c = {r["concurrency"]: r for r in rows}
        cells = []
        for c in args.concurrency:
            r = by_c.get(c)
            cells += [f"{r['rps']:.1f}", f"{r['latency_ms']['p99']:.0f}"] if r else ["-", "-"]
        print(f"| {system} | " + " | ".join(cells) + " |")
    top = max(args.concurrency)
    ours = {r["concurrency"]: r for r in results.get("lumen", [])}.get(top)
    if ours:
        print(f"\nat c={top}: lumen / offline best = {ours['rps'] / best:.2f}")
        for system, rows in results.items():
            peer = {r["concurrency"]: r for r in rows}.get(top)
            if system != "lumen" and peer and peer["rps"]:
                print(f"at c={top}: lumen / {system} = {ours['rps'] / peer['rps']:.2f}")
    figures = {f"offline ORT, {k}": harness.value(v, "texts/s") for k, v in offline.items()}
    for system, rows in results.items():
        for r in rows:
            figures[f"{system} c={r['concurrency']}"] = harness.value(r["rps"], "req/s")
            figures[f"{system} c={r['concurrency']} p99"] = harness.value(
                r["latency_ms"]["p99"], "ms")
    if ours:
        figures[f"lumen / offline best at c={top}"] = harness.value(ours["rps"] / best, "x")
    harness.emit(figures, args=args)
    if args.plot:
        loadgen.plot([loadgen.BenchResult(**r) for rows in results.values() for r in rows], args.plot)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"offline": offline, "results": results,
                                                        "extensions": extensions,
                                                        "load": load_avg()}, indent=1))


if __name__ == "__main__":
    main()

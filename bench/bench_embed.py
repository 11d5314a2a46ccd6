"""``lumen embed`` (in process) vs the offline best and vs a client loop against ``lumen serve``.

Same prepared all-MiniLM-L6-v2, the seeded length-mixed corpus (``lumen_core.corpus``),
tokenization included everywhere, spinning off.  Modes, interleaved in every round so a
neighbour's burst of load hits all of them:

* ``offline 32 1x2`` / ``offline 32 2x1``: tokenize every text (``Tokenizer.encode``), sort
  the whole corpus by token count, run batches of 32 on one 2-thread ORT session, or on two
  1-thread sessions driven by two threads (the offline twin of the job's layout); ``offline
  <=512 tokens``: the same sorted order cut at 32 rows and 512 padded tokens (the job's CPU
  budget, ``bulk.local.CPU_BATCH_TOKENS``), 2x1; the offline best is the best of the three in
  the same round;
* ``embed IxT``: the job itself (``bulk.job.run_job``: read the JSONL, tokenize, sort inside
  each window, run, write Parquet row groups, assemble the output), with I engine sessions of
  T threads; the time is the job's (the runtime's start and warm-up are not counted, as the
  offline sessions' creation is not);
* ``serve c=16``: 16 client threads, each posting one text per ``/v1/embeddings`` request
  (keep-alive connections) to a ``lumen serve`` subprocess with the built-in text_embed task;
  the client runs on the same cores, as a client loop on the same machine would.

Prints per round texts/s and the ratios embed / offline best (target >= 0.95) and embed /
serve (target >= 3), in wall time and per CPU-second (process CPU time of every thread; for
serve the server's and the clients' together: on a shared box it moves much less with the
neighbours' load than wall time), then the median over rounds with min and max, and the load
average.

``--rss N,M``: instead, the peak RSS of ``lumen embed`` (a subprocess each, the tiny
``embedding_only`` model from tests/onnx_models.py, short texts) for N and M rows: memory must
not grow with the input (target: M's within 1.5x of N's).

    python bench/bench_embed.py [--texts 400] [--rounds 3] [--layouts 2x1,1x2]
    python bench/bench_embed.py --rss 10000,1000000
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)

ROOT = pathlib.Path(__file__).resolve().parents[1]

from lumen_core import models  # noqa: E402
from lumen_core.bulk import job as J  # noqa: E402
from lumen_core.bulk import local as L  # noqa: E402
from lumen_core.bulk import store as ST  # noqa: E402
from lumen_core.bulk.sources import InputSpec, open_inputs  # noqa: E402
from lumen_core.corpus import make_corpus  # noqa: E402
from lumen_core.engine.session import cpu_session  # noqa: E402
from lumen_core.models import minilm  # noqa: E402

BATCH = 32
CLIENTS = 16
TARGET_OFFLINE = 0.95
TARGET_SERVE = 3.0


def offline(texts: list, sessions: int, threads: int, budget: int = 0) -> tuple:
    """(texts/s, texts per CPU-second) of the offline ideal (see the module docstring)."""
    path = models.require_model(models.MINILM)
    sess = [cpu_session(path / models.MODEL_FILE, threads) for _ in range(sessions)]
    tok = minilm.load_tokenizer(path / minilm.TOKENIZER_FILE)
    for s in sess:  # warm-up
        ids, mask = minilm.pad_batch([tok.encode("warm up").ids])
        s.run([minilm.OUTPUT], {minilm.INPUT_IDS: ids, minilm.ATTENTION_MASK: mask})
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [tok.encode(t).ids for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    if budget:  # runs of the sorted order within BATCH rows and ``budget`` padded tokens
        batches, cur = [], []
        for i in order:
            if cur and (len(cur) >= BATCH or (len(cur) + 1) * len(ids[i]) > budget):
                batches.append(cur)
                cur = []
            cur.append(ids[i])
        batches.append(cur)
    else:
        batches = [[ids[i] for i in order[s:s + BATCH]] for s in range(0, len(order), BATCH)]

    def work(k: int) -> None:
        for rows in batches[k::sessions]:
            a, m = minilm.pad_batch(rows)
            sess[k].run([minilm.OUTPUT], {minilm.INPUT_IDS: a, minilm.ATTENTION_MASK: m})

    ts = [threading.Thread(target=work, args=(k,)) for k in range(sessions)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return len(texts) / (time.perf_counter() - t0), len(texts) / (time.process_time() - c0)


def embed(src: str, n: int, instances: int, threads: int, tmp: str) -> tuple:
    """(texts/s, texts per CPU-second) of the job (run_job's own time and CPU)."""
    rt = L.bulk_runtime("text_embed", None, instances, threads)
    rt.start_background()
    emb = L.LocalEmbedder(rt, "text_embed")
    try:
        out = os.path.join(tmp, f"embed-{instances}x{threads}.parquet")
        inputs = open_inputs([src], InputSpec())
        store = ST.Store(out, {"job": {}, "model": {}, "inputs": []}, overwrite=True)
        done = store.open()
        schema = ST.output_schema(emb.dim, None, None, (), None)
        c0 = time.process_time()
        s = J.run_job(inputs, emb, store, schema, done, J.JobOptions(row_group_size=4096))
        cpu = time.process_time() - c0
        assert s.rows_out == n, s
        return n / s.seconds, n / cpu
    finally:
        emb.close()
        rt.stop_background()


class Server:
    """``lumen serve`` with the built-in text_embed task, in a subprocess."""

    def __init__(self, port: int, tmp: str):
        cfg = os.path.join(tmp, "serve.toml")
        with open(cfg, "w") as f:
            f.write('[server]\n[[tasks]]\nname = "text_embed"\nbackend = "text_embedding"\n'
                    'model_id = "all-minilm-l6-v2"\nmodel_version = "1"\ninstances = 2\n')
        self.url = f"http://127.0.0.1:{port}"
        self.p = subprocess.Popen([sys.executable, "-m", "lumen_core.cli", "serve", "--config",
                                   cfg, "--http-port", str(port), "--grpc-port", "0"],
                                  env={**os.environ, "PYTHONPATH": str(ROOT)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("lumen serve did not start")

    def close(self) -> None:
        self.p.terminate()
        self.p.wait(30)


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_loop(url: str, texts: list, pid: int) -> tuple:
    """(texts/s, texts per CPU-second of server and clients) of CLIENTS threads posting one
    text per request."""
    import http.client

    host, port = url.split("//")[1].split(":")
    nxt = iter(range(len(texts)))
    lock = threading.Lock()

    def work() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            body = json.dumps({"model": "text_embed", "input": texts[i]})
            conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            assert r.status == 200, r.status

    t0, c0, s0 = time.perf_counter(), time.process_time(), _cpu_of(pid)
    ts = [threading.Thread(target=work) for _ in range(CLIENTS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    cpu = time.process_time() - c0 + _cpu_of(pid) - s0
    return len(texts) / (time.perf_counter() - t0), len(texts) / cpu


def spread(values: list) -> str:
    return (f"median {statistics.median(values):.3f} (min {min(values):.3f}, "
            f"max {max(values):.3f}, {len(values)} rounds)")


def rss(sizes: list) -> None:
    from lumen_core.corpus import make_corpus as mc
    from lumen_core.toy_graphs import embedding_only

    short = [t for t in mc(400) if len(t.split()) <= 20][:100]
    probe = ("import json, resource, sys\nfrom lumen_core import cli\nrc = cli.main(sys.argv[1:])"
             "\nprint(json.dumps({'rc': rc, 'kb': resource.getrusage(resource.RUSAGE_SELF)"
             ".ru_maxrss}))")
    with tempfile.TemporaryDirectory() as tmp:
        model = embedding_only(os.path.join(tmp, "tiny.onnx"))
        tok = models.require_model(models.MINILM) / minilm.TOKENIZER_FILE
        cfg = os.path.join(tmp, "tiny.toml")
        with open(cfg, "w") as f:
            f.write(f'[server]\n\n[[tasks]]\nname = "tiny"\nbackend = "text_embedding"\n'
                    f'model = {json.dumps(str(model))}\n[tasks.options]\n'
                    f'tokenizer = {json.dumps(str(tok))}\n')
        got = {}
        for n in sizes:
            src = os.path.join(tmp, f"{n}.txt")
            with open(src, "w") as f:
                for i in range(n):
                    f.write(short[i % len(short)] + "\n")
            t0 = time.monotonic()
            r = subprocess.run([sys.executable, "-c", probe, "embed", src, "-o",
                                os.path.join(tmp, f"{n}.parquet"), "--config", cfg, "--task",
                                "tiny", "-q"], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
            res = json.loads(r.stdout.strip().splitlines()[-1])
            got[n] = res["kb"]
            print(f"{n:>10,} rows: peak RSS {res['kb'] / 1024:,.1f} MiB "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
            os.remove(src)
        a, b = sizes[0], sizes[-1]
        print(f"peak RSS {b:,} / {a:,} rows = {got[b] / got[a]:.3f} (target <= 1.5); load "
              f"average {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="2x1,1x2", help="the job's instances x threads")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--rss", default=None, metavar="N,M")
    harness.add_quick(ap, texts=64, rounds=1, layouts="2x1", no_serve=True)
    a = harness.parse(ap)
    if harness.quick(a):  # the suite does not build models; it says what is missing
        harness.require_model(models.MINILM)
    if a.rss:
        rss([int(v) for v in a.rss.split(",")])
        return
    layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",")]
    texts = make_corpus(a.texts)
    ratios: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus.jsonl")
        with open(src, "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        server = None if a.no_serve else Server(S_port(), tmp)
        try:
            print(f"{a.texts} texts (length-mixed corpus), {os.cpu_count()} cores, load "
                  f"average {os.getloadavg()[0]:.2f} at start", flush=True)
            for rnd in range(1, a.rounds + 1):
                off = {(1, 2): offline(texts, 1, 2), (2, 1): offline(texts, 2, 1),
                       "tokens": offline(texts, 2, 1, L.CPU_BATCH_TOKENS)}
                best = max(v[0] for v in off.values())
                best_cpu = max(v[1] for v in off.values())
                ratios.setdefault("offline 32 (best layout) / offline best", []).append(
                    max(off[(1, 2)][0], off[(2, 1)][0]) / best)
                ours = {lay: embed(src, a.texts, *lay, tmp) for lay in layouts}
                srv = client_loop(server.url, texts, server.p.pid) if server else None
                line = (f"round {rnd}: offline 32 1x2 {off[(1, 2)][0]:.1f}, 32 2x1 "
                        f"{off[(2, 1)][0]:.1f}, <={L.CPU_BATCH_TOKENS} tokens 2x1 "
                        f"{off['tokens'][0]:.1f} texts/s; ")
                for lay, (v, c) in ours.items():
                    name = f"embed {lay[0]}x{lay[1]}"
                    ratios.setdefault(f"{name} / offline best", []).append(v / best)
                    ratios.setdefault(f"{name} / offline best, per CPU-second",
                                      []).append(c / best_cpu)
                    line += (f"{name} {v:.1f} ({v / best:.3f} of offline best, per CPU-second "
                             f"{c / best_cpu:.3f}")
                    if srv:
                        ratios.setdefault(f"{name} / serve c={CLIENTS}", []).append(v / srv[0])
                        ratios.setdefault(f"{name} / serve c={CLIENTS}, per CPU-second",
                                          []).append(c / srv[1])
                        line += f"; {v / srv[0]:.2f}x serve, per CPU-second {c / srv[1]:.2f}x"
                    line += "); "
                if srv:
                    line += f"serve c={CLIENTS} {srv[0]:.1f}; "
                print(line + f"load average {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            if server:
                server.close()
    print(f"targets: embed / offline best >= {TARGET_OFFLINE}, embed / serve >= {TARGET_SERVE}")
    for k, v in ratios.items():
        print(f"  {k}: {spread(v)}")
    harness.emit({k: harness.stat(v, "x") for k, v in ratios.items()}, args=a)


def S_port() -> int:  # noqa: N802 - a free port for the server
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()

"""``lumen embed`` (in process) vs the offline best and vs a client loop against ``lumen serve``.

Same prepared all-MiniLM-L6-v2, the seeded length-mixed corpus (``lumen_core.corpus``; past
its 2,000 texts the corpus repeated, as the issue's 20,000-text file), one JSON line per text
with an ``id``, tokenization included everywhere, spinning off.  Modes:

* ``offline 32 1x2`` / ``offline 32 2x1``: tokenize every text (``Tokenizer.encode``), sort
  the whole corpus by token count, run batches of 32 on one 2-thread ORT session, or on two
  1-thread sessions driven by two threads; ``offline <=512 2x1``: the same sorted order cut at
  32 rows and 512 padded tokens (the job's CPU budget, ``bulk.local.CPU_BATCH_TOKENS``) on
  two 1-thread sessions -- the job's own batch shape and threads.  ``--offline tokens`` runs
  that one alone (the 32-row modes cost ~30% more CPU per text: a long run can skip them);
* ``embed IxT``: the job itself (``bulk.job.run_job``: read the JSONL with its ids, tokenize,
  sort inside each window, run, write Parquet row groups, assemble the output), with I engine
  sessions of T threads; the time is the job's including the output's assembly (the
  runtime's start and warm-up are not counted, as the offline sessions' creation is not);
* ``serve c=16``: 16 client threads, each posting one text per ``/v1/embeddings`` request
  (keep-alive connections) to a ``lumen serve`` subprocess with the built-in text_embed task
  (2 x 1 thread); the client runs on the same cores, as a client loop on the same machine would.

Every round runs every mode once, forwards on odd rounds and backwards on even ones, so a
drift of the box is shared.  **The offline best** is the offline mode with the highest median
texts/s net of run-queue wait (below) over the rounds -- the fastest layout on a quiet box,
not the one a neighbour happened to leave alone -- and each round's ratio divides by that
mode's run of the same round (dividing by the fastest of three noisy runs in each round, as
this script did first, biases the ratio down on a shared box: a neighbour's burst that slows
one mode makes another the round's "best"; that ratio is still printed, "fastest offline run
of the round").  Ratios in wall time and per CPU-second (process CPU time of every thread;
for serve the server's and the clients' together).

Where the wall time goes: for the worker threads of every in-process mode (the job's engine
threads, the offline loop's threads) ``/proc/self/task/*/schedstat`` splits the wall time
into **busy** (on a core), **run queue** (runnable, waiting for a core: the neighbours' load)
and **blocked** (waiting for work, the GIL or the main thread: idle cores of our making); the
ratio "wall net of run-queue wait" divides texts/s by (1 - run queue) on both sides, an
estimate of the wall ratio on a quiet box.

    python bench/bench_embed.py [--texts 400] [--rounds 3] [--layouts 2x1,1x2]
                                [--offline all|tokens] [--no-serve]
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
from dataclasses import dataclass

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)

ROOT = pathlib.Path(__file__).resolve().parents[1]

from lumen_core import models  # noqa: E402
from lumen_core.bulk import job as J  # noqa: E402
from lumen_core.bulk import local as L  # noqa: E402
from lumen_core.bulk import store as ST  # noqa: E402
from lumen_core.bulk.sources import InputSpec, open_inputs  # noqa: E402
from lumen_core.corpus import DEFAULT_SIZE, make_corpus  # noqa: E402
from lumen_core.engine.session import cpu_session  # noqa: E402
from lumen_core.models import minilm  # noqa: E402

BATCH = 32
CLIENTS = 16
TARGET_OFFLINE = 0.95
TARGET_SERVE = 3.0


@dataclass
class Run:
    """One mode's run: texts/s, texts per CPU-second, and its worker threads' wall time split
    into busy / run queue / blocked (fractions; None where not measured)."""

    rate: float
    per_cpu: float
    busy: float | None = None
    queued: float | None = None
    blocked: float | None = None


def corpus(n: int) -> list:
    """The benchmark corpus: ``make_corpus(n)`` up to its default size, repeated past it."""
    base = make_corpus(min(n, DEFAULT_SIZE))
    return [base[i % len(base)] for i in range(n)]


def _task_clocks() -> dict:
    """{thread id: (CPU ns, run-queue wait ns)} of this process's threads (schedstat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu, wait = f.read().split()[:2]
        except OSError:  # a thread that ended meanwhile
            continue
        out[int(tid)] = (int(cpu), int(wait))
    return out


class Workers:
    """Measures the ``n`` busiest threads other than the caller's between ``start`` and
    ``stop`` (the engine threads of a mode): busy, run-queue and blocked shares of n x wall.
    A thread that ends inside the window (the offline loop's) is read just before it ends
    via ``mark``."""

    def __init__(self, n: int):
        self.n = n
        self.before: dict = {}
        self.ended: dict = {}
        self.t0 = 0.0

    def start(self) -> None:
        self.before = _task_clocks()
        self.t0 = time.perf_counter()

    def mark(self) -> None:
        """Called by a worker thread as its last act: its clocks, before it is gone."""
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            cpu, wait = f.read().split()[:2]
        self.ended[threading.get_native_id()] = (int(cpu), int(wait))

    def stop(self, run: Run) -> Run:
        wall = time.perf_counter() - self.t0
        now = {**_task_clocks(), **self.ended}
        me = threading.get_native_id()
        deltas = sorted(((c - self.before.get(t, (0, 0))[0], w - self.before.get(t, (0, 0))[1])
                         for t, (c, w) in now.items() if t != me), reverse=True)[:self.n]
        span = self.n * wall * 1e9
        run.busy = sum(d[0] for d in deltas) / span
        run.queued = sum(d[1] for d in deltas) / span
        run.blocked = max(0.0, 1.0 - run.busy - run.queued)
        return run


def offline(texts: list, sessions: int, threads: int, budget: int = 0) -> Run:
    """The offline ideal (see the module docstring)."""
    path = models.require_model(models.MINILM)
    sess = [cpu_session(path / models.MODEL_FILE, threads) for _ in range(sessions)]
    tok = minilm.load_tokenizer(path / minilm.TOKENIZER_FILE)
    for s in sess:  # warm-up
        w_ids, w_mask = minilm.pad_batch([tok.encode("warm up").ids])
        s.run([minilm.OUTPUT], {minilm.INPUT_IDS: w_ids, minilm.ATTENTION_MASK: w_mask})
    probe = Workers(sessions * threads)  # the loop's threads and ORT's intra-op threads
    probe.start()
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [tok.encode(t).ids for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    if budget:  # runs of the sorted order within BATCH rows and ``budget`` padded tokens
        batches: list = []
        cur: list = []
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
        probe.mark()

    ts = [threading.Thread(target=work, args=(k,)) for k in range(sessions)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return probe.stop(Run(len(texts) / wall, len(texts) / cpu))


def embed(src: str, n: int, instances: int, threads: int, tmp: str) -> Run:
    """The job (run_job, the output's assembly included)."""
    import pyarrow as pa

    rt = L.bulk_runtime("text_embed", None, instances, threads)
    rt.start_background()
    emb = L.LocalEmbedder(rt, "text_embed")
    try:
        out = os.path.join(tmp, f"embed-{instances}x{threads}.parquet")
        spec = InputSpec(id_field="id")
        inputs = open_inputs([src], spec)
        store = ST.Store(out, {"job": {}, "model": {}, "inputs": []}, overwrite=True)
        done = store.open()
        schema = ST.output_schema(emb.dim, "id", pa.string(), (), None)
        probe = Workers(instances * threads)  # engine threads and ORT's intra-op threads
        probe.start()
        t0, c0 = time.perf_counter(), time.process_time()
        s = J.run_job(inputs, emb, store, schema, done, J.JobOptions(row_group_size=4096))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert s.rows_out == n, s
        return probe.stop(Run(n / wall, n / cpu))
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


def client_loop(url: str, texts: list, pid: int) -> Run:
    """CLIENTS threads posting one text per request (per CPU-second: server and clients)."""
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
    return Run(len(texts) / (time.perf_counter() - t0), len(texts) / cpu)


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


def _net(r: Run) -> float:
    """texts/s had the worker threads never waited for a core (an estimate: the wall time less
    their share of run-queue wait, which is mostly the neighbours' load)."""
    return r.rate / (1.0 - (r.queued or 0.0))


def _share(runs: list) -> str:
    """Median busy / run queue / blocked shares of a mode's runs, as one phrase."""
    if not runs or runs[0].busy is None:
        return ""
    med = {k: statistics.median(getattr(r, k) for r in runs) for k in ("busy", "queued",
                                                                      "blocked")}
    return (f"workers busy {med['busy']:.1%}, run queue {med['queued']:.1%}, "
            f"blocked {med['blocked']:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="2x1,1x2", help="the job's instances x threads")
    ap.add_argument("--offline", choices=("all", "tokens"), default="all",
                    help="the offline modes: all three, or the job's shape alone")
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
    texts = corpus(a.texts)
    tok_mode = f"offline <={L.CPU_BATCH_TOKENS} 2x1"
    runs: dict = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus.jsonl")
        with open(src, "w") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"id": f"t{i}", "text": t}) + "\n")
        server = None if a.no_serve else Server(S_port(), tmp)
        modes: dict = {}
        if a.offline == "all":
            modes["offline 32 1x2"] = lambda: offline(texts, 1, 2)
            modes["offline 32 2x1"] = lambda: offline(texts, 2, 1)
        modes[tok_mode] = lambda: offline(texts, 2, 1, L.CPU_BATCH_TOKENS)
        for lay in layouts:
            modes[f"embed {lay[0]}x{lay[1]}"] = (
                lambda lay=lay: embed(src, a.texts, lay[0], lay[1], tmp))
        if server:
            modes[f"serve c={CLIENTS}"] = lambda: client_loop(server.url, texts, server.p.pid)
        try:
            print(f"{a.texts} texts (length-mixed corpus, ids), {os.cpu_count()} cores, load "
                  f"average {os.getloadavg()[0]:.2f} at start", flush=True)
            for rnd in range(1, a.rounds + 1):
                names = list(modes) if rnd % 2 else list(modes)[::-1]
                for name in names:
                    runs.setdefault(name, []).append(modes[name]())
                loads.append(os.getloadavg()[0])
                print(f"round {rnd}: " + ", ".join(
                    f"{k} {v[-1].rate:.1f}" for k, v in runs.items())
                    + f" texts/s; load average {loads[-1]:.2f}", flush=True)
        finally:
            if server:
                server.close()
    ratios = report(runs, layouts, a.rounds)
    print(f"load average over the rounds {min(loads):.2f}-{max(loads):.2f}")
    harness.emit({k: harness.stat(v, "x") for k, v in ratios.items()}, args=a)


def report(runs: dict, layouts: list, rounds: int) -> dict:
    """Print where the time goes and the ratios; return the ratio figures per round."""
    off = [k for k in runs if k.startswith("offline")]
    best = max(off, key=lambda k: statistics.median(_net(r) for r in runs[k]))
    best_cpu = max(off, key=lambda k: statistics.median(r.per_cpu for r in runs[k]))
    print(f"offline best: {best} (highest median texts/s net of run-queue wait; per "
          f"CPU-second: {best_cpu})")
    for k, v in runs.items():
        print(f"  {k}: median {statistics.median(r.rate for r in v):.1f} texts/s, "
              f"{statistics.median(r.per_cpu for r in v):.1f} per CPU-second; {_share(v)}")
    ratios: dict = {}

    def put(name: str, num: list, den: list) -> None:
        ratios[name] = [x / y for x, y in zip(num, den, strict=True)]

    rate = {k: [r.rate for r in v] for k, v in runs.items()}

    def net(v: list) -> list:
        return [_net(r) for r in v]

    cpu = {k: [r.per_cpu for r in v] for k, v in runs.items()}
    round_best = [max(rate[k][i] for k in off) for i in range(rounds)]
    serve = f"serve c={CLIENTS}"
    for lay in layouts:
        name = f"embed {lay[0]}x{lay[1]}"
        put(f"{name} / offline best", rate[name], rate[best])
        put(f"{name} / offline best, per CPU-second", cpu[name], cpu[best_cpu])
        put(f"{name} / fastest offline run of the round", rate[name], round_best)
        put(f"{name} / offline best, wall net of run-queue wait", net(runs[name]), net(runs[best]))
        if serve in runs:
            put(f"{name} / {serve}", rate[name], rate[serve])
            put(f"{name} / {serve}, per CPU-second", cpu[name], cpu[serve])
    if serve in runs:  # the ceiling of embed / serve: embed cannot beat the offline best
        put(f"{serve} / offline best", rate[serve], rate[best])
        put(f"{serve} / offline best, per CPU-second", cpu[serve], cpu[best_cpu])
    print(f"targets: embed / offline best >= {TARGET_OFFLINE}, embed / serve >= {TARGET_SERVE}")
    for k, v in ratios.items():
        print(f"  {k}: {spread(v)}")
    if serve in runs:
        print(f"  ceiling of embed / {serve} (offline best / serve): "
              f"{spread([1 / v for v in ratios[f'{serve} / offline best']])}")
    return ratios


def S_port() -> int:  # noqa: N802 - a free port for the server
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()

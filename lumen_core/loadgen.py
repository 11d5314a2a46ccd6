"""``lumen bench``: a load generator for OpenAI-style embeddings endpoints (ours or a peer's).

It owns the seeded benchmark corpus (moved here from ``bench/corpus.py``, which re-exports it,
so the in-process and HTTP benchmarks and the installed command all send the same texts).

Measurement: ``concurrency`` closed-loop clients, each on its own keep-alive HTTP/1.1
connection, send one text per request (``{"model", "input", "encoding_format": "float"}``)
until ``count`` requests are done; a short warm-up first is not timed.  The client is a minimal
asyncio HTTP/1.1 implementation (request bytes pre-built, only the status line and framing
headers parsed): on a 2-core box the load generator shares the CPU with the server, and a
heavyweight client would take cycles from whichever server it measures -- the same lean client
is used for every target, so the comparison stays fair.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence, TextIO
from urllib.parse import urlsplit

# --------------------------------------------------------------------------- the corpus
DEFAULT_SIZE = 2000
DEFAULT_SEED = 20240601
#: (share of texts, min words, max words) — inclusive bounds
LENGTH_MIX: tuple[tuple[float, int, int], ...] = ((0.5, 5, 20), (0.4, 20, 80), (0.1, 80, 200))
#: Zipf exponent of word frequencies (English is close to 1)
ZIPF_S = 1.05
#: chance that a sentence ends after a word (sentences of ~12 words on average)
SENTENCE_END_P = 0.08
#: chance of a comma after a word inside a sentence
COMMA_P = 0.05
#: chance that a word is replaced by a number
NUMBER_P = 0.02

# Ordered roughly by English frequency; the Zipf weights follow this order.
_COMMON = """
the of and to a in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no will
more can who out up about into than them some could time these two may other then do first
any now such like our over also new after only most made what where much many before must
through back years way well down should because each just those people how too little state
good very make world still own see men work long here get both between life being under never
day same another know while last might great old year off come since against go came right used
take three
""".split()

_DOMAIN = """
model request batch server runtime inference latency throughput queue worker thread memory
buffer tensor token sentence embedding vector network service client response error system
data search index document query result cache storage process signal audio image text file
user library version release update support performance language training learning feature
engineer team project product customer market price value report policy research question
answer energy water health school student market city river music story history science
""".split()

_RARE = """
quantization tokenizer transformer normalisation preprocessing deserialization interoperability
asynchronous concurrency backpressure orchestration observability heterogeneous photosynthesis
mitochondria cryptocurrency biodiversity infrastructure microservices containerization
vectorization parallelism throughput-oriented latency-sensitive kubernetes autoscaling
benchmarking idempotent checkpointing multilingual lexicographic hyperparameter regularization
backpropagation convolutional recurrent attention-based semiconductor thermodynamics
""".split()

VOCABULARY: tuple[str, ...] = tuple(_COMMON + _DOMAIN + _RARE)


def _weights(n: int) -> list[float]:
    return [1.0 / (rank + 1) ** ZIPF_S for rank in range(n)]


def _text(rng: random.Random, n_words: int, cum: Sequence[float]) -> str:
    words = rng.choices(VOCABULARY, cum_weights=cum, k=n_words)
    out: list[str] = []
    start = True
    for w in words:
        if rng.random() < NUMBER_P:
            w = str(rng.randrange(1, 100_000))
        if start:
            w = w[:1].upper() + w[1:]
            start = False
        r = rng.random()
        if r < SENTENCE_END_P:
            w += rng.choice(".!?") if rng.random() < 0.2 else "."
            start = True
        elif r < SENTENCE_END_P + COMMA_P:
            w += ","
        out.append(w)
    text = " ".join(out)
    return text if text.endswith((".", "!", "?")) else text + "."


def make_corpus(size: int = DEFAULT_SIZE, seed: int = DEFAULT_SEED) -> list[str]:
    """``size`` texts in the benchmark length mix (50% 5-20 words, 40% 20-80, 10% 80-200),
    shuffled so the order is length-blind like live traffic; deterministic for a ``seed``."""
    rng = random.Random(seed)
    cum: list[float] = []
    acc = 0.0
    for w in _weights(len(VOCABULARY)):
        acc += w
        cum.append(acc)
    counts = [int(round(share * size)) for share, _, _ in LENGTH_MIX]
    counts[0] += size - sum(counts)  # rounding remainder goes to the short bucket
    texts = [_text(rng, rng.randint(lo, hi), cum)
             for count, (_, lo, hi) in zip(counts, LENGTH_MIX, strict=True)
             for _ in range(count)]
    rng.shuffle(texts)
    return texts


# --------------------------------------------------------------------------- results
PERCENTILES = (50, 95, 99)
DEFAULT_TASK = "text_embed"
EMBEDDINGS_PATH = "/v1/embeddings"
#: seconds one request may take before the run counts it as failed
REQUEST_TIMEOUT_S = 120.0
#: seconds between progress updates
PROGRESS_EVERY_S = 0.25
PROGRESS_BAR_WIDTH = 30


@dataclass
class BenchResult:
    target: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    rps: float
    latency_ms: dict = field(default_factory=dict)  # "p50" -> ms
    first_error: str = ""

    def row(self) -> str:
        p = self.latency_ms
        return (f"{self.target:<16} {self.concurrency:>4} {self.requests:>7} {self.errors:>6} "
                f"{self.rps:>9.1f} {p.get('p50', 0):>8.1f} {p.get('p95', 0):>8.1f} "
                f"{p.get('p99', 0):>8.1f}")

    def to_dict(self) -> dict:
        return asdict(self)


TABLE_HEADER = (f"{'target':<16} {'conc':>4} {'reqs':>7} {'errors':>6} {'req/s':>9} "
                f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(pct / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(target: str, concurrency: int, latencies_s: list, errors: int, seconds: float,
              first_error: str = "") -> BenchResult:
    lat = sorted(latencies_s)
    n = len(lat) + errors
    return BenchResult(target, concurrency, n, errors, seconds,
                       len(lat) / seconds if seconds > 0 else 0.0,
                       {f"p{p}": percentile(lat, p) * 1000.0 for p in PERCENTILES}, first_error)


# --------------------------------------------------------------------------- progress
class Progress:
    """A redrawn bar on a terminal, a plain line every 10% otherwise (logs, CI)."""

    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None):
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._next_decile = 1

    def update(self, done: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = done / elapsed
        if self.tty:
            filled = int(PROGRESS_BAR_WIDTH * done / max(self.total, 1))
            bar = "#" * filled + "." * (PROGRESS_BAR_WIDTH - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {rate:7.1f} req/s")
            self.stream.flush()
        else:
            while self._next_decile <= 10 and done * 10 >= self._next_decile * self.total:
                self.stream.write(f"{self.label}: {done}/{self.total} "
                                  f"({self._next_decile * 10}%) {rate:.1f} req/s\n")
                self.stream.flush()
                self._next_decile += 1

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------- HTTP client
class HttpError(OSError):
    """A target answered with something other than a good embeddings reply."""


def embeddings_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1/embeddings``; a URL with a path is kept."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"bench targets must be http:// URLs, got {url!r}")
    if parts.path in ("", "/"):
        return url.rstrip("/") + EMBEDDINGS_PATH
    return url


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs pre-built JSON bodies."""

    def __init__(self, url: str, api_key: Optional[str] = None):
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        auth = ""
        if api_key is not None:
            if not (api_key.isascii() and api_key.isprintable()):  # no header injection
                raise ValueError("the API key must be printable ASCII")
            auth = f"Authorization: Bearer {api_key}\r\n"
        self._head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth}"
                      f"Content-Type: application/json\r\nAccept: application/json\r\n"
                      f"Content-Length: ").encode()
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port,
                                                                 limit=1 << 22)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = self.reader = None

    async def post(self, body: bytes) -> tuple:
        """(status, body bytes); reconnects once when a kept-alive socket was closed."""
        if self.writer is None:
            await self._open()
        try:
            try:
                return await self._exchange(body)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                await self._open()
                return await self._exchange(body)
        except BaseException:
            # an abandoned exchange (timeout, cancel, bad framing) may leave its reply in flight:
            # reusing the socket would hand that stale reply to the next request
            self.close()
            raise

    async def _exchange(self, body: bytes) -> tuple:
        writer, reader = self.writer, self.reader
        assert writer is not None and reader is not None  # _open ran
        writer.write(self._head + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = -1
        chunked = close = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            data = b"".join(parts)
        elif length >= 0:
            data = await reader.readexactly(length)
        else:
            data = await reader.read()
            close = True
        if close:
            self.close()
        return status, data


def request_bodies(texts: Sequence[str], model: str) -> list:
    """The JSON bodies, encoded once up front so the timed loop does no JSON work."""
    return [json.dumps({"model": model, "input": t, "encoding_format": "float"}).encode()
            for t in texts]


def check_embedding_reply(data: bytes) -> int:
    """Dimension of the embedding in an OpenAI-style reply; raises HttpError if malformed."""
    try:
        emb = json.loads(data)["data"][0]["embedding"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise HttpError(f"not an embeddings reply ({exc}): {data[:200]!r}") from None
    if not isinstance(emb, list) or not emb:
        raise HttpError(f"empty or non-float embedding: {data[:200]!r}")
    return len(emb)


# --------------------------------------------------------------------------- the runs
async def _closed_loop(call: Callable, n_items: int, concurrency: int, count: int,
                       progress: Optional[Progress]) -> tuple:
    """``concurrency`` workers share a counter; each call(i) is timed.  Returns
    (latencies, errors, first_error, seconds)."""
    latencies: list = []
    counts = {"next": 0, "errors": 0}
    first = [""]

    async def worker(w: int) -> None:
        while True:
            i = counts["next"]
            if i >= count:
                return
            counts["next"] = i + 1
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(call(w, i % n_items), REQUEST_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
                counts["errors"] += 1
                if not first[0]:
                    first[0] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            latencies.append(time.perf_counter() - t0)

    async def ticker(bar: Progress) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            bar.update(len(latencies) + counts["errors"])

    tick = asyncio.ensure_future(ticker(progress)) if progress is not None else None
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        seconds = time.perf_counter() - t0
        if tick is not None and progress is not None:
            tick.cancel()
            progress.update(len(latencies) + counts["errors"])
            progress.close()
    return latencies, counts["errors"], first[0], seconds


async def bench_http(url: str, texts: Sequence[str], concurrency: int, count: int,
                     model: str = DEFAULT_TASK, warmup: int = 0, target: str = "",
                     stream: Optional[TextIO] = None,
                     api_key: Optional[str] = None) -> BenchResult:
    """Closed-loop load on an OpenAI-style embeddings URL; one text per request (with
    ``Authorization: Bearer api_key`` when given)."""
    url = embeddings_url(url)
    bodies = request_bodies(texts, model)
    conns = [Connection(url, api_key) for _ in range(concurrency)]
    label = f"{target or url} c={concurrency}"

    async def call(w: int, i: int) -> None:
        status, data = await conns[w].post(bodies[i])
        if status != 200:
            raise HttpError(f"HTTP {status}: {data[:200]!r}")

    try:
        status, data = await conns[0].post(bodies[0])  # fail fast on a wrong URL or model
        if status != 200:
            raise HttpError(f"{url} answered HTTP {status}: {data[:300]!r}")
        check_embedding_reply(data)
        if warmup:
            await _closed_loop(call, len(bodies), concurrency, warmup, None)
        lat, errors, first, seconds = await _closed_loop(
            call, len(bodies), concurrency, count, Progress(label, count, stream))
    finally:
        for c in conns:
            c.close()
    return summarize(target or url, concurrency, lat, errors, seconds, first)


async def bench_runtime(runtime: Any, texts: Sequence[str], concurrency: int, count: int,
                        task: str = DEFAULT_TASK, warmup: int = 0, target: str = "in-process",
                        stream: Optional[TextIO] = None) -> BenchResult:
    """The same closed loop straight against a started ``Runtime`` (no HTTP); each text goes
    as ``Runtime.text_request`` builds it, the request ``/v1/embeddings`` makes of it."""
    text_request = runtime.text_request

    async def call(w: int, i: int) -> None:
        await runtime.infer(text_request(task, texts[i]))

    if warmup:
        await _closed_loop(call, len(texts), concurrency, warmup, None)
    lat, errors, first, seconds = await _closed_loop(
        call, len(texts), concurrency, count, Progress(f"{target} c={concurrency}", count, stream))
    return summarize(target, concurrency, lat, errors, seconds, first)


# --------------------------------------------------------------------------- open loop
#: ``lumen bench --rate``: the most requests one open-loop run keeps in flight (one
#: connection each); an arrival past it is counted as a client error, never delayed
MAX_OPEN_IN_FLIGHT = 2048
#: the latency a request must answer within to count as good (``--target-ms`` default)
DEFAULT_TARGET_MS = 500
#: the HTTP statuses an open-loop run counts apart
STATUS_OK, STATUS_REFUSED, STATUS_DEADLINE = 200, 429, 504


@dataclass
class OpenLoopSlice:
    """One second of an open-loop run: the requests *sent* in it and how they ended."""

    second: int
    sent: int = 0
    ok: int = 0
    ok_in_target: int = 0
    refused: int = 0  # 429
    deadline: int = 0  # 504
    errors: int = 0  # anything else (other statuses, client errors, timeouts)
    latency_ms: dict = field(default_factory=dict)  # of the ok ones: "p50" -> ms


@dataclass
class OpenLoopResult:
    """An open-loop run (``lumen bench --rate``): Poisson arrivals at ``rate`` req/s."""

    target: str
    rate: float
    target_ms: float
    seconds: float
    sent: int = 0
    ok: int = 0
    ok_in_target: int = 0
    refused: int = 0
    deadline: int = 0
    errors: int = 0
    latency_ms: dict = field(default_factory=dict)  # of the ok ones
    refusal_ms: dict = field(default_factory=dict)  # how fast a 429 came back
    goodput: float = 0.0  # ok within the target, per second of the run
    per_second: list = field(default_factory=list)  # OpenLoopSlice dicts
    first_error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


OPEN_HEADER = (f"{'second':>6} {'sent':>6} {'ok':>6} {'in tgt':>6} {'429':>5} {'504':>5} "
               f"{'err':>5} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")


def _pcts(values: list) -> dict:
    lat = sorted(values)
    return {f"p{p}": percentile(lat, p) * 1000.0 for p in PERCENTILES}


def open_loop_summary(target: str, rate: float, target_ms: float, seconds: float,
                      outcomes: list, first_error: str = "") -> OpenLoopResult:
    """Tally ``outcomes`` (``(sent_at_s, status, latency_s)``, status 0 for a client error)
    per second of sending and in total."""
    res = OpenLoopResult(target, rate, target_ms, seconds, first_error=first_error)
    slices: dict = {}
    ok_lat: dict = {}
    refusal = []
    limit = target_ms / 1000.0
    for sent_at, status, latency in outcomes:
        sec = int(sent_at)
        sl = slices.get(sec)
        if sl is None:
            sl = slices[sec] = OpenLoopSlice(sec)
            ok_lat[sec] = []
        sl.sent += 1
        if status == STATUS_OK:
            sl.ok += 1
            ok_lat[sec].append(latency)
            if latency <= limit:
                sl.ok_in_target += 1
        elif status == STATUS_REFUSED:
            sl.refused += 1
            refusal.append(latency)
        elif status == STATUS_DEADLINE:
            sl.deadline += 1
        else:
            sl.errors += 1
    for sec in sorted(slices):
        sl = slices[sec]
        sl.latency_ms = _pcts(ok_lat[sec])
        for name in ("sent", "ok", "ok_in_target", "refused", "deadline", "errors"):
            setattr(res, name, getattr(res, name) + getattr(sl, name))
        res.per_second.append(asdict(sl))
    res.latency_ms = _pcts([x for v in ok_lat.values() for x in v])
    res.refusal_ms = _pcts(refusal)
    res.goodput = res.ok_in_target / seconds if seconds > 0 else 0.0
    return res


def format_open_loop(r: OpenLoopResult) -> str:
    """Per-second rows, then the total and the goodput."""
    def row(label: str, x: Any) -> str:
        p = x["latency_ms"] if isinstance(x, dict) else x.latency_ms
        g = x.get if isinstance(x, dict) else lambda k: getattr(x, k)
        return (f"{label:>6} {g('sent'):>6} {g('ok'):>6} {g('ok_in_target'):>6} "
                f"{g('refused'):>5} {g('deadline'):>5} {g('errors'):>5} {p.get('p50', 0):>8.1f} "
                f"{p.get('p95', 0):>8.1f} {p.get('p99', 0):>8.1f}")

    lines = [f"{r.target}: open loop, Poisson arrivals at {r.rate:g} req/s for {r.seconds:.1f} s "
             f"(target {r.target_ms:g} ms)", OPEN_HEADER]
    lines += [row(str(s["second"]), s) for s in r.per_second]
    lines.append(row("total", r))
    lines.append(f"goodput (ok within {r.target_ms:g} ms): {r.goodput:.1f} req/s; "
                 f"429 answered in p50 {r.refusal_ms.get('p50', 0):.1f} ms")
    return "\n".join(lines)


async def open_loop(call: Callable, n_items: int, rate: float, duration: float, seed: int,
                    progress: Optional[Progress] = None) -> tuple:
    """Send ``call(i)`` (an awaitable giving an HTTP status) at Poisson arrivals of ``rate``
    per second for ``duration`` seconds, whatever the answers; return ``(outcomes,
    first_error, seconds)`` once every request has answered (``open_loop_summary``)."""
    rng = random.Random(seed)
    outcomes: list = []
    tasks: set = set()
    first = [""]
    done = [0]
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(i: int, sent_at: float) -> None:
        status = 0
        try:
            status = await asyncio.wait_for(call(i), REQUEST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
            if not first[0]:
                first[0] = f"{type(exc).__name__}: {exc}"[:300]
        outcomes.append((sent_at, status, loop.time() - t0 - sent_at))
        done[0] += 1

    i = 0
    at = rng.expovariate(rate)
    while at < duration:
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= MAX_OPEN_IN_FLIGHT:
            outcomes.append((at, 0, 0.0))
            if not first[0]:
                first[0] = f"client: more than {MAX_OPEN_IN_FLIGHT} requests in flight"
        else:
            t = asyncio.ensure_future(one(i % n_items, at))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        i += 1
        at += rng.expovariate(rate)
        if progress is not None and i % 64 == 0:
            progress.update(done[0])
    if tasks:
        await asyncio.gather(*list(tasks))
    if progress is not None:
        progress.update(done[0])
        progress.close()
    return outcomes, first[0], duration


async def bench_http_open_loop(url: str, texts: Sequence[str], rate: float, duration: float,
                               model: str = DEFAULT_TASK, target_ms: float = DEFAULT_TARGET_MS,
                               seed: int = DEFAULT_SEED, target: str = "",
                               stream: Optional[TextIO] = None,
                               api_key: Optional[str] = None) -> OpenLoopResult:
    """Open-loop load on an OpenAI-style embeddings URL: one keep-alive connection per request
    in flight (opened as needed, reused once free)."""
    url = embeddings_url(url)
    bodies = request_bodies(texts, model)
    idle: list = []
    opened: list = []

    async def call(i: int) -> int:
        conn = idle.pop() if idle else None
        if conn is None:
            conn = Connection(url, api_key)
            opened.append(conn)
        try:
            status, _data = await conn.post(bodies[i])
        except BaseException:
            conn.close()
            raise
        idle.append(conn)
        return status

    try:
        status = await call(0)  # fail fast on a wrong URL or model
        if status != STATUS_OK:
            raise HttpError(f"{url} answered HTTP {status}")
        label = f"{target or url} rate={rate:g}/s"
        total = max(1, int(rate * duration))
        outcomes, first, seconds = await open_loop(call, len(bodies), rate, duration, seed,
                                                   Progress(label, total, stream))
    finally:
        for c in opened:
            c.close()
    return open_loop_summary(target or url, rate, target_ms, seconds, outcomes, first)


async def bench_runtime_open_loop(runtime: Any, texts: Sequence[str], rate: float,
                                  duration: float, task: str = DEFAULT_TASK,
                                  target_ms: float = DEFAULT_TARGET_MS, seed: int = DEFAULT_SEED,
                                  target: str = "in-process",
                                  stream: Optional[TextIO] = None) -> OpenLoopResult:
    """The same open loop straight against a started ``Runtime`` (no HTTP): an error counts
    under the HTTP status the server would answer it with."""
    text_request = runtime.text_request

    async def call(i: int) -> int:
        try:
            await runtime.infer(text_request(task, texts[i]))
        except Exception as exc:  # noqa: BLE001 - its status is the outcome
            status = getattr(exc, "http_status", 0)
            if not status:
                raise
            return status
        return STATUS_OK

    outcomes, first, seconds = await open_loop(
        call, len(texts), rate, duration, seed,
        Progress(f"{target} rate={rate:g}/s", max(1, int(rate * duration)), stream))
    return open_loop_summary(target, rate, target_ms, seconds, outcomes, first)


def plot_open_loop(results: Sequence[OpenLoopResult], path: str) -> None:
    """Per second of each run: the ok latency percentiles, and the outcomes (stacked)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for (ax_l, ax_o), r in zip(axes, results, strict=True):
        secs = [s["second"] for s in r.per_second]
        for p, style in (("p50", "--"), ("p95", "-."), ("p99", "-")):
            ax_l.plot(secs, [s["latency_ms"].get(p, 0) for s in r.per_second], style, label=p)
        ax_l.axhline(r.target_ms, color="grey", linewidth=0.8, label="target")
        ax_l.set(xlabel="second (sent)", ylabel="latency of ok (ms)",
                 title=f"{r.target} at {r.rate:g} req/s")
        bottom = [0] * len(secs)
        for key, label in (("ok_in_target", "ok in target"), ("late", "ok, late"),
                           ("refused", "429"), ("deadline", "504"), ("errors", "other")):
            vals = [s["ok"] - s["ok_in_target"] if key == "late" else s[key]
                    for s in r.per_second]
            ax_o.bar(secs, vals, bottom=bottom, label=label, width=0.9)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax_o.set(xlabel="second (sent)", ylabel="requests", title="outcomes")
        for ax in (ax_l, ax_o):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- output
def format_table(results: Sequence[BenchResult]) -> str:
    return "\n".join([TABLE_HEADER] + [r.row() for r in results])


def plot(results: Sequence[BenchResult], path: str) -> None:
    """Throughput and p50/p99 latency against concurrency, one line per target."""
    plt = _pyplot()
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    targets = sorted({r.target for r in results}, key=[r.target for r in results].index)
    for t in targets:
        rs = sorted((r for r in results if r.target == t), key=lambda r: r.concurrency)
        cs = [r.concurrency for r in rs]
        ax_t.plot(cs, [r.rps for r in rs], marker="o", label=t)
        line, = ax_l.plot(cs, [r.latency_ms["p99"] for r in rs], marker="o", label=f"{t} p99")
        ax_l.plot(cs, [r.latency_ms["p50"] for r in rs], marker="x", linestyle="--",
                  color=line.get_color(), label=f"{t} p50")
    ax_t.set(xlabel="concurrent clients", ylabel="requests / s", title="throughput")
    ax_l.set(xlabel="concurrent clients", ylabel="latency (ms)", title="latency")
    for ax in (ax_t, ax_l):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot() -> Any:
    """matplotlib's pyplot on the file backend (the [bench] extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    return plt

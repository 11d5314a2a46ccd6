"""``lumen bench``: a load generator for OpenAI-style embeddings endpoints (ours or a peer's).

The seeded benchmark corpus is ``corpus.py``'s (re-exported here); the open-loop runs
(``lumen bench --rate``) are ``openloop.py``'s.

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
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence, TextIO
from urllib.parse import urlsplit

from .corpus import DEFAULT_SEED, DEFAULT_SIZE, make_corpus  # noqa: F401 (re-exported)

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


# --------------------------------------------------------------------------- output
def format_table(results: Sequence[BenchResult]) -> str:
    return "\n".join([TABLE_HEADER] + [r.row() for r in results])


def plot(results: Sequence[BenchResult], path: str) -> None:
    """Throughput and p50/p99 latency against concurrency, one line per target."""
    plt = pyplot()
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
    save_plot(plt, fig, (ax_t, ax_l), path)


def save_plot(plt: Any, fig: Any, axes: Sequence[Any], path: str) -> None:
    """Grid and legend on every axis, then the figure written to ``path`` and closed."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot() -> Any:
    """matplotlib's pyplot on the file backend (the [bench] extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    return plt

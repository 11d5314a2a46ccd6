"""``lumen bench --rate``: an open-loop load generator (Poisson arrivals at a fixed rate,
whatever the answers: a closed loop hides overload) and its per-second and total outcomes."""
from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence, TextIO

from .corpus import DEFAULT_SEED
from .loadgen import (
    DEFAULT_TASK,
    PERCENTILES,
    REQUEST_TIMEOUT_S,
    Connection,
    HttpError,
    Progress,
    embeddings_url,
    percentile,
    pyplot,
    request_bodies,
    save_plot,
)

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
    plt = pyplot()
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
    save_plot(plt, fig, [ax for row in axes for ax in row], path)



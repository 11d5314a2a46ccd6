"""The benchmarks' shared harness: quick mode, rounds, CPU from /proc, spread, one result format.

Every ``bench/bench_*.py`` script measures something different, but they all follow the same
rules (``/work/shared/GUIDE.md``, "how we measure"): a figure is the median of at least three
interleaved rounds with its spread, CPU time is read from the kernel (``/proc``) rather than
guessed from wall time, and the load average is said next to it because this box is shared.
This module holds those rules once, so a script only says what it measures:

* :func:`add_quick` / :func:`parse` give a script its ``--quick`` mode (smaller workloads, the
  same code path) that ``python -m bench`` calls; :func:`quick` says whether it is on;
* :func:`interleave` runs arms round by round in alternating order; :func:`stat` and
  :func:`ratio_stat` turn per-round values into median, min, max and spread;
* :func:`proc_cpu_seconds` / :class:`CpuMeter` read a process's CPU (user + system, every
  thread) from ``/proc/<pid>/stat``, the figure per request that a noisy box disturbs least;
* :func:`emit` writes the one JSON result (``SCHEMA``) a script produces, to stdout and to the
  file the runner names in ``LUMEN_BENCH_RESULT``; :func:`skip` records why a benchmark could
  not run (no ``wrk``, no GPU, a model not prepared) instead of failing or staying silent.

It imports nothing from ``tests/`` and ``lumen_core`` only inside :func:`require_model`, so
it works against any tree.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

#: the version of one benchmark's result document
SCHEMA = "lumen-bench-result/1"
#: the runner sets these: the file a script writes its result to, and quick mode
RESULT_ENV = "LUMEN_BENCH_RESULT"
QUICK_ENV = "LUMEN_BENCH_QUICK"
STATUSES = ("ok", "skipped", "failed")

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def benchmark_name(path: Optional[str] = None) -> str:
    """The benchmark's name: its script's stem (``bench_null`` for ``bench/bench_null.py``)."""
    return pathlib.Path(path or sys.argv[0]).stem


# -- quick mode ------------------------------------------------------------------------------

def add_quick(ap: argparse.ArgumentParser, **quick_values: Any) -> argparse.ArgumentParser:
    """Add ``--quick`` to a script's parser; ``quick_values`` are the options it shrinks.

    Quick mode is the same measurement on a smaller workload (fewer requests, shorter runs),
    long enough to catch a broken benchmark or a large regression, short enough (~20-60 s)
    that ``make bench`` can run every script.  An option given on the command line wins.
    """
    ap.add_argument("--quick", action="store_true",
                    default=os.environ.get(QUICK_ENV) == "1",
                    help="a short run for the suite (python -m bench): "
                    + (", ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick_values.items())
                       or "the same workload"))
    ap.set_defaults(_quick_values=quick_values)
    return ap


def parse(ap: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse, then apply the quick values to every option still at its default."""
    args = ap.parse_args(argv)
    values = getattr(args, "_quick_values", {}) or {}
    if getattr(args, "quick", False):
        for key, value in values.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    return args


def quick(args: Optional[argparse.Namespace] = None) -> bool:
    """Whether this run is a quick one (``--quick`` or the runner's environment)."""
    if args is not None and getattr(args, "quick", False):
        return True
    return "--quick" in sys.argv[1:] or os.environ.get(QUICK_ENV) == "1"


# -- rounds and spread -----------------------------------------------------------------------

def interleave(arms: Mapping[str, Callable[[], float]], rounds: int) -> Dict[str, List[float]]:
    """Run every arm once per round, forwards on even rounds and backwards on odd ones.

    Alternating the order spreads a drift of the box (another job starting, a thermal step)
    over every arm instead of charging it to whichever runs last.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(arms)
    got: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got[name].append(float(arms[name]()))
    return got


def stat(values: Iterable[float], unit: str) -> Dict[str, Any]:
    """Median, min, max and relative spread ((max - min) / median) of per-round values."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("a figure needs at least one value")
    med = statistics.median(vals)
    return {"median": med, "min": min(vals), "max": max(vals),
            "spread": (max(vals) - min(vals)) / med if med else 0.0,
            "rounds": vals, "unit": unit}


def ratio_stat(num: Sequence[float], den: Sequence[float], unit: str = "x") -> Dict[str, Any]:
    """The per-round ratio num/den as a figure: ratios of runs a few seconds apart."""
    return stat([a / b for a, b in zip(num, den, strict=True)], unit)


def value(x: float, unit: str) -> Dict[str, Any]:
    """A single measured value (a figure that has no rounds, e.g. an accuracy)."""
    return {"median": float(x), "min": float(x), "max": float(x), "spread": 0.0,
            "rounds": [float(x)], "unit": unit}


# -- CPU and load ----------------------------------------------------------------------------

def proc_cpu_seconds(pid: Optional[int] = None, children: bool = False) -> float:
    """User + system CPU seconds of a process (every thread), from ``/proc/<pid>/stat``.

    ``children`` adds the CPU of its waited-for children.  Falls back to ``os.times`` for
    this process where ``/proc`` is absent.
    """
    path = f"/proc/{pid if pid is not None else 'self'}/stat"
    try:
        text = pathlib.Path(path).read_text()
    except OSError:
        if pid is not None and pid != os.getpid():
            raise
        t = os.times()
        return t.user + t.system + ((t.children_user + t.children_system) if children else 0.0)
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / _CLK_TCK


class CpuMeter:
    """CPU seconds a process spends between ``start`` and ``stop`` (``with`` works too)."""

    def __init__(self, pid: Optional[int] = None) -> None:
        self.pid = pid
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self._t0 = (0.0, 0.0)

    def start(self) -> "CpuMeter":
        self._t0 = (proc_cpu_seconds(self.pid), time.perf_counter())
        return self

    def stop(self) -> "CpuMeter":
        self.cpu_s = proc_cpu_seconds(self.pid) - self._t0[0]
        self.wall_s = time.perf_counter() - self._t0[1]
        return self

    def per_request_us(self, requests: int) -> float:
        """CPU microseconds per request over the measured span."""
        return self.cpu_s * 1e6 / max(requests, 1)

    def __enter__(self) -> "CpuMeter":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def load_average() -> List[float]:
    """The 1, 5 and 15 minute load averages (zeros where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [0.0, 0.0, 0.0]


# -- the result document ---------------------------------------------------------------------

def result(name: str, figures: Mapping[str, Mapping[str, Any]], *, status: str = "ok",
           reason: str = "", params: Optional[Mapping[str, Any]] = None,
           quick_mode: Optional[bool] = None) -> Dict[str, Any]:
    """One benchmark's result document (``SCHEMA``); :func:`validate` checks it."""
    doc: Dict[str, Any] = {
        "schema": SCHEMA, "benchmark": name, "status": status,
        "quick": quick() if quick_mode is None else quick_mode,
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": load_average(), "cpu_count": os.cpu_count(),
        "params": dict(params or {}), "figures": {k: dict(v) for k, v in figures.items()},
    }
    if reason:
        doc["reason"] = reason
    problems = validate(doc)
    if problems:
        raise ValueError(f"{name}: invalid benchmark result: {'; '.join(problems)}")
    return doc


def validate(doc: Any) -> List[str]:
    """What is wrong with a result document (an empty list when it is valid)."""
    if not isinstance(doc, dict):
        return ["a result must be a JSON object"]
    problems = []
    for key, kind in (("schema", str), ("benchmark", str), ("status", str), ("quick", bool),
                      ("load_average", list), ("figures", dict), ("params", dict)):
        if not isinstance(doc.get(key), kind):
            problems.append(f"field {key!r} must be a {kind.__name__}")
    if problems:
        return problems
    if doc["schema"] != SCHEMA:
        problems.append(f"schema {doc['schema']!r} is not {SCHEMA!r}")
    if doc["status"] not in STATUSES:
        problems.append(f"status {doc['status']!r} is not one of {', '.join(STATUSES)}")
    if doc["status"] != "ok" and not doc.get("reason"):
        problems.append(f"a {doc['status']} result must say why in 'reason'")
    if doc["status"] == "ok" and not doc["figures"]:
        problems.append("an ok result must carry at least one figure")
    for name, fig in doc["figures"].items():
        if not isinstance(fig, dict):
            problems.append(f"figure {name!r} must be an object")
            continue
        for key in ("median", "min", "max", "spread"):
            if not isinstance(fig.get(key), (int, float)) or isinstance(fig.get(key), bool):
                problems.append(f"figure {name!r}: {key!r} must be a number")
        if not isinstance(fig.get("unit"), str):
            problems.append(f"figure {name!r}: 'unit' must be a string")
        if not isinstance(fig.get("rounds"), list):
            problems.append(f"figure {name!r}: 'rounds' must be a list")
    return problems


def _write(doc: Mapping[str, Any]) -> None:
    target = os.environ.get(RESULT_ENV)
    if target:
        pathlib.Path(target).write_text(json.dumps(doc, indent=1) + "\n")


def emit(figures: Mapping[str, Mapping[str, Any]], *, params: Optional[Mapping[str, Any]] = None,
         name: Optional[str] = None, args: Optional[argparse.Namespace] = None) -> Dict[str, Any]:
    """Print the figures with the load average and write the result for the runner."""
    if args is not None and params is None:
        params = {k: v for k, v in vars(args).items()
                  if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))}
    doc = result(name or benchmark_name(), figures, params=params,
                 quick_mode=quick(args))
    print(f"\n{doc['benchmark']}: load average {' '.join(f'{x:.2f}' for x in doc['load_average'])}"
          f" on {doc['cpu_count']} cpus; median [min-max] over rounds")
    for key, fig in doc["figures"].items():
        print(f"  {key:44s} {fig['median']:12.4g} {fig['unit']:10s} "
              f"[{fig['min']:.4g}-{fig['max']:.4g}]")
    _write(doc)
    return doc


def require_model(name: str, home: Optional[os.PathLike] = None) -> pathlib.Path:
    """The prepared model's directory, or a skip naming ``lumen models prepare``.

    The suite never builds models (that takes minutes and writes the model store); a benchmark
    whose model is not prepared says so and is skipped.
    """
    from lumen_core import models

    try:
        return models.require_model(name, home)
    except models.ModelMissingError as exc:
        skip(f"{exc} (or set LUMEN_HOME)")
        raise  # unreachable: skip exits


def skip(reason: str, name: Optional[str] = None) -> None:
    """Say why this benchmark cannot run here, record it for the runner, and exit 0."""
    doc = result(name or benchmark_name(), {}, status="skipped", reason=reason)
    print(f"SKIP {doc['benchmark']}: {reason}", flush=True)
    _write(doc)
    raise SystemExit(0)

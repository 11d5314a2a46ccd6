"""The micro benchmarks (``bench/test_bench_*.py``, pytest-benchmark) as one suite entry.

The descriptor parse and the batch assembly are timed per call by pytest-benchmark, compiled
twin against pure-Python twin, in groups (see each file's docstring).  This script runs them
with ``--benchmark-only`` and a JSON report, and turns each benchmark's statistics into the
suite's figures: median per call with min and max over pytest-benchmark's rounds, in
microseconds.  Quick mode caps the time per benchmark.

    python bench/bench_micro.py [--quick] [--max-time 1.0]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile

import harness

HERE = pathlib.Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-time", type=float, default=1.0,
                    help="pytest-benchmark's --benchmark-max-time per benchmark (seconds)")
    harness.add_quick(ap, max_time=0.1)
    args = harness.parse(ap)
    if importlib.util.find_spec("pytest_benchmark") is None:
        harness.skip("pytest-benchmark is not installed (the bench extra)")
    files = sorted(str(p) for p in HERE.glob("test_bench_*.py"))
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "micro.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
               "--benchmark-only", f"--benchmark-max-time={args.max_time}",
               f"--benchmark-json={report}", "-o", "addopts="]
        proc = subprocess.run(cmd, cwd=HERE.parent)
        if proc.returncode != 0:
            print(f"pytest exited {proc.returncode}", file=sys.stderr)
            return proc.returncode
        data = json.loads(report.read_text())
    figures = {}
    for b in data["benchmarks"]:
        st = b["stats"]
        fig = harness.stat([st["median"] * 1e6], "us")
        fig.update(min=st["min"] * 1e6, max=st["max"] * 1e6,
                   spread=(st["max"] - st["min"]) / st["median"] if st["median"] else 0.0,
                   rounds=[st["median"] * 1e6], calls=st["rounds"])
        figures[f"{b.get('group') or 'micro'}: {b['name']}"] = fig
    harness.emit(figures, args=args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

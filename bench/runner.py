"""The benchmark suite's runner: every ``bench/bench_*.py`` in quick mode, one JSON file.

``python -m bench`` (``make bench``) finds the scripts by their name, so a new
``bench_<thing>.py`` joins the suite without an edit here.  Each runs in its own process
(``python bench/bench_<thing>.py --quick``, lumen_core as installed or as ``PYTHONPATH``
names it) with a time limit, writing its result document
(``harness.SCHEMA``) to a file the runner names in ``LUMEN_BENCH_RESULT``; a script that cannot
run here (no ``wrk``, no GPU, a model not prepared) records a skip with its reason, which the
runner prints.  A script that exits non-zero, runs past its limit or writes no valid result is
a failure, and the runner exits 1 after writing everything it has.  The suite's file:

    {"schema": "lumen-bench-suite/1", "quick": true, "started": ..., "finished": ...,
     "load_average": {"start": [...], "end": [...]}, "cpu_count": 2,
     "benchmarks": {"bench_null": {<the script's result document>, "wall_s": ...}, ...}}

    python -m bench [--out build/bench.json] [--only bench_null,bench_loop] [--full]
        [--timeout 180] [--list]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

try:  # run as ``python -m bench`` (package) or imported by the tests
    from bench import harness
except ImportError:  # pragma: no cover - run from inside bench/
    import harness  # type: ignore[no-redef]

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
SUITE_SCHEMA = "lumen-bench-suite/1"
PATTERN = "bench_*.py"
DEFAULT_TIMEOUT_S = 180.0


def discover(folder: pathlib.Path = HERE) -> List[pathlib.Path]:
    """Every benchmark script in ``folder``, by name (``bench_*.py``), sorted."""
    return sorted(p for p in folder.glob(PATTERN) if p.is_file())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _failed(name: str, reason: str, output: str) -> Dict[str, Any]:
    doc = harness.result(name, {}, status="failed", reason=reason)
    doc["output_tail"] = output[-4000:]
    return doc


def run_one(script: pathlib.Path, quick: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
            extra_env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run one script in its own process; its result document, or a failure saying why."""
    name = script.stem
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        out = pathlib.Path(tmp) / "result.json"
        env = dict(os.environ, **(extra_env or {}))
        env[harness.RESULT_ENV] = str(out)
        env[harness.QUICK_ENV] = "1" if quick else "0"
        # no source tree added to the path: lumen_core is the installed one (make bench), or
        # whatever PYTHONPATH names (a checkout with its extensions built in place)
        argv = [sys.executable, str(script)] + (["--quick"] if quick else [])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            text = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(
                "utf-8", "replace")
            doc = _failed(name, f"ran past its {timeout_s:g} s limit", text)
            doc["wall_s"] = round(time.perf_counter() - t0, 1)
            return doc
        wall = round(time.perf_counter() - t0, 1)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            doc = _failed(name, f"exit status {proc.returncode}", output)
        elif not out.exists():
            doc = _failed(name, "exited 0 but wrote no result (does it call harness.emit?)",
                          output)
        else:
            try:
                doc = json.loads(out.read_text())
            except ValueError as exc:
                doc = _failed(name, f"its result is not JSON: {exc}", output)
            else:
                problems = harness.validate(doc)
                if problems:
                    doc = _failed(name, "invalid result: " + "; ".join(problems), output)
        doc["wall_s"] = wall
        return doc


def validate_suite(doc: Any) -> List[str]:
    """What is wrong with a suite file (an empty list when it is valid)."""
    if not isinstance(doc, dict):
        return ["the suite file must be a JSON object"]
    problems = []
    if doc.get("schema") != SUITE_SCHEMA:
        problems.append(f"schema must be {SUITE_SCHEMA!r}")
    benches = doc.get("benchmarks")
    if not isinstance(benches, dict):
        return problems + ["'benchmarks' must be an object"]
    for name, res in benches.items():
        problems += [f"{name}: {p}" for p in harness.validate(res)]
        if isinstance(res, dict) and res.get("benchmark") != name:
            problems.append(f"{name}: its result names {res.get('benchmark')!r}")
    return problems


def run_suite(scripts: Sequence[pathlib.Path], out: pathlib.Path, quick: bool = True,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> Dict[str, Any]:
    """Run the scripts one after the other (the box has few cores) and write the suite file."""
    doc: Dict[str, Any] = {"schema": SUITE_SCHEMA, "quick": quick, "started": _now(),
                           "cpu_count": os.cpu_count(),
                           "load_average": {"start": harness.load_average()}, "benchmarks": {}}
    for i, script in enumerate(scripts, 1):
        print(f"[{i}/{len(scripts)}] {script.stem} ...", flush=True)
        res = run_one(script, quick, timeout_s)
        doc["benchmarks"][script.stem] = res
        line = f"    {res['status']} in {res.get('wall_s', 0):.0f} s"
        if res["status"] == "ok":
            line += ": " + ", ".join(f"{k} {v['median']:.4g} {v['unit']}"
                                     for k, v in list(res["figures"].items())[:4])
        else:
            line += f": {res.get('reason', '')}"
        print(line, flush=True)
        if res["status"] == "failed" and res.get("output_tail"):
            print("    " + "\n    ".join(res["output_tail"].strip().splitlines()[-8:]), flush=True)
    doc["load_average"]["end"] = harness.load_average()
    doc["finished"] = _now()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "bench.json")
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--full", action="store_true", help="the full workloads, not quick mode")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds one script may run")
    ap.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    a = ap.parse_args(argv)
    scripts = discover()
    if a.only:
        wanted = {w.strip() for w in a.only.split(",") if w.strip()}
        unknown = wanted - {s.stem for s in scripts}
        if unknown:
            ap.error(f"--only names no benchmark: {', '.join(sorted(unknown))} (see --list)")
        scripts = [s for s in scripts if s.stem in wanted]
    if a.list:
        print("\n".join(s.stem for s in scripts))
        return 0
    doc = run_suite(scripts, a.out, quick=not a.full, timeout_s=a.timeout)
    counts = {s: sum(r["status"] == s for r in doc["benchmarks"].values())
              for s in harness.STATUSES}
    print(f"\n{counts['ok']} ok, {counts['skipped']} skipped, {counts['failed']} failed; "
          f"load average {doc['load_average']['start']} -> {doc['load_average']['end']}; "
          f"wrote {a.out}")
    for name, res in doc["benchmarks"].items():
        if res["status"] != "ok":
            print(f"  {res['status']:8s} {name}: {res.get('reason', '')}")
    return 1 if counts["failed"] else 0

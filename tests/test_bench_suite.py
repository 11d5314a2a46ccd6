"""The benchmark suite's contract (``bench/runner.py``, ``bench/harness.py``), without the
slow benchmarks: every ``bench/bench_*.py`` is found by the runner and offers the quick mode
and the result it calls for, nothing in ``bench/`` imports from ``tests/``, the result
documents are checked, and the runner itself runs end to end on small stand-in scripts."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))

from bench import harness, runner  # noqa: E402


def _calls(tree: ast.AST, module: str) -> set:
    """Names of ``module.<name>(...)`` calls anywhere in ``tree``."""
    return {n.func.attr for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == module}


def test_discover_finds_every_bench_script():
    on_disk = sorted(p.name for p in BENCH.iterdir()
                     if p.name.startswith("bench_") and p.suffix == ".py")
    assert on_disk, "no benchmark scripts found"
    assert [p.name for p in runner.discover()] == on_disk


def test_discover_picks_up_a_new_script(tmp_path):
    (tmp_path / "bench_new.py").write_text("")
    (tmp_path / "helper.py").write_text("")
    (tmp_path / "test_bench_x.py").write_text("")
    assert [p.name for p in runner.discover(tmp_path)] == ["bench_new.py"]


@pytest.mark.parametrize("script", runner.discover(), ids=lambda p: p.stem)
def test_every_script_has_a_quick_mode_and_a_result(script):
    tree = ast.parse(script.read_text())
    used = _calls(tree, "harness")
    assert "add_quick" in used, f"{script.name} offers no --quick (harness.add_quick)"
    assert "emit" in used, f"{script.name} writes no result (harness.emit)"


def test_bench_imports_nothing_from_tests():
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        assert '"tests"' not in text.replace('"tests" / "fixtures"', ""), path.name
        tree = ast.parse(text)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("tests", "onnx_models", "serve_support",
                                            "conftest")), f"{path.name} imports {name}"


def test_stat_and_ratio():
    fig = harness.stat([3.0, 1.0, 2.0], "us")
    assert (fig["median"], fig["min"], fig["max"], fig["unit"]) == (2.0, 1.0, 3.0, "us")
    assert fig["spread"] == pytest.approx(1.0)
    assert harness.ratio_stat([2.0, 6.0], [1.0, 2.0])["rounds"] == [2.0, 3.0]
    with pytest.raises(ValueError):
        harness.stat([], "us")
    with pytest.raises(ValueError):
        harness.ratio_stat([1.0], [1.0, 2.0])


def test_interleave_alternates_the_order():
    seen = []
    arms = {k: (lambda k=k: seen.append(k) or 1.0) for k in "abc"}
    got = harness.interleave(arms, 3)
    assert seen == list("abccbaabc")
    assert got == {k: [1.0, 1.0, 1.0] for k in "abc"}
    with pytest.raises(ValueError):
        harness.interleave(arms, 0)


def test_proc_cpu_seconds_counts_this_process():
    before = harness.proc_cpu_seconds()
    with harness.CpuMeter() as meter:
        sum(i * i for i in range(300_000))
    assert harness.proc_cpu_seconds() >= before
    assert meter.cpu_s >= 0 and meter.wall_s > 0
    assert harness.proc_cpu_seconds(os.getpid()) >= before
    assert meter.per_request_us(0) == meter.cpu_s * 1e6


def test_result_is_valid_json_and_validate_names_each_problem():
    doc = harness.result("bench_x", {"rate": harness.value(5.0, "req/s")})
    assert harness.validate(json.loads(json.dumps(doc))) == []
    assert any("at least one figure" in p for p in harness.validate({**doc, "figures": {}}))
    assert any("reason" in p for p in harness.validate({**doc, "status": "skipped"}))
    assert any("status" in p for p in harness.validate({**doc, "status": "maybe"}))
    bad = {**doc, "figures": {"rate": {"median": "fast", "unit": 3}}}
    problems = harness.validate(bad)
    assert any("'median' must be a number" in p for p in problems)
    assert any("'unit' must be a string" in p for p in problems)
    assert harness.validate([]) == ["a result must be a JSON object"]
    with pytest.raises(ValueError, match="invalid benchmark result"):
        harness.result("bench_x", {})


def test_quick_values_apply_only_to_defaults():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    harness.add_quick(ap, requests=10, rounds=2)
    assert (harness.parse(ap, []).requests, harness.parse(ap, []).rounds) == (1000, 3)
    quick = harness.parse(ap, ["--quick", "--rounds", "5"])
    assert (quick.requests, quick.rounds, quick.quick) == (10, 5, True)


STAND_INS = {
    "bench_good.py": """
        import argparse, harness
        ap = harness.add_quick(argparse.ArgumentParser(), n=2)
        ap.add_argument("--n", type=int, default=100)
        a = harness.parse(ap)
        harness.emit({"n": harness.value(a.n, "items")}, args=a)
    """,
    "bench_absent.py": """
        import harness
        harness.skip("wrk is not on PATH")
    """,
    "bench_broken.py": """
        raise RuntimeError("boom")
    """,
    "bench_silent.py": """
        print("measured something but said nothing")
    """,
    "bench_slow.py": """
        import time
        time.sleep(30)
    """,
}


def test_runner_end_to_end_on_stand_ins(tmp_path):
    for name, body in STAND_INS.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    (tmp_path / "harness.py").write_text((BENCH / "harness.py").read_text())
    out = tmp_path / "out" / "bench.json"
    doc = runner.run_suite(runner.discover(tmp_path), out, quick=True, timeout_s=8)
    saved = json.loads(out.read_text())
    assert saved == doc
    assert runner.validate_suite(saved) == []
    res = saved["benchmarks"]
    assert res["bench_good"]["status"] == "ok"
    assert res["bench_good"]["figures"]["n"]["median"] == 2  # the quick value
    assert res["bench_good"]["quick"] is True
    assert res["bench_absent"] == {**res["bench_absent"], "status": "skipped",
                                   "reason": "wrk is not on PATH"}
    assert res["bench_broken"]["status"] == "failed"
    assert "boom" in res["bench_broken"]["output_tail"]
    assert "wrote no result" in res["bench_silent"]["reason"]
    assert "limit" in res["bench_slow"]["reason"]
    assert runner.validate_suite({**saved, "schema": "x"})  # a wrong schema is reported


def test_python_m_bench_lists_every_script():
    out = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT, check=True,
                         capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.split()
    assert out == [p.stem for p in runner.discover()]
    bad = subprocess.run([sys.executable, "-m", "bench", "--only", "bench_nothing"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert bad.returncode == 2 and "bench_nothing" in bad.stderr


def test_require_model_skips_with_the_prepare_command(tmp_path, monkeypatch):
    from lumen_core import models

    out = tmp_path / "result.json"
    monkeypatch.setenv(harness.RESULT_ENV, str(out))
    with pytest.raises(SystemExit) as exc:
        harness.require_model(models.MINILM, tmp_path / "empty-home")
    assert exc.value.code == 0
    doc = json.loads(out.read_text())
    assert doc["status"] == "skipped" and "lumen models prepare" in doc["reason"]
    assert harness.validate(doc) == []

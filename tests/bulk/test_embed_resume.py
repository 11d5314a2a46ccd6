"""``lumen embed`` killed and rerun: SIGKILL at random points (three times), then a rerun,
gives the same output file, byte for byte, as one uninterrupted run; SIGTERM stops cleanly
(exit 130, the finished row groups kept, the rerun finishes); a job's memory does not grow
with its input.

The tiny model (conftest) makes the runs quick, and its vectors depend on how far each text
is padded, so equal bytes also show that the batches were formed the same way."""
from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
from embed_support import (  # noqa: F401 - the fixtures (home, tiny)
    home_fixture,
    short_texts,
    tiny_fixture,
    write_jsonl,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = 6000
ROW_GROUP = 200
#: seconds a run may take before the test gives up on it
RUN_TIMEOUT_S = 120.0


def _cmd(src, out, tiny, *extra) -> list:
    return [sys.executable, "-m", "lumen_core.cli", "embed", str(src), "-o", str(out),
            "--config", str(tiny), "--task", "tiny", "--id-field", "id",
            "--row-group-size", str(ROW_GROUP), "--progress", "lines", *map(str, extra)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _parts(out: pathlib.Path) -> int:
    work = pathlib.Path(str(out) + ".lumen-embed")
    try:
        return sum(1 for n in os.listdir(work) if n.endswith(".parquet"))
    except FileNotFoundError:
        return 0


def _kill_after(cmd: list, out: pathlib.Path, parts: int, sig: int) -> tuple:
    """Start ``cmd``; once the work folder holds ``parts`` more part files, send ``sig``.
    Returns (exit status, stderr)."""
    before = _parts(out)
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while p.poll() is None and _parts(out) < before + parts and time.monotonic() < deadline:
        time.sleep(0.005)
    if p.poll() is None:
        p.send_signal(sig)
    _, err = p.communicate(timeout=RUN_TIMEOUT_S)
    return p.returncode, err.decode()


def _rows(n: int) -> list:
    texts = short_texts()
    rng = random.Random(3)
    return [{"id": f"r{i}", "text": rng.choice(texts) * rng.randint(1, 3)} for i in range(n)]


def test_sigkill_three_times_then_rerun_gives_the_same_bytes(tiny, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(ROWS))
    whole = tmp_path / "whole.parquet"
    r = subprocess.run(_cmd(src, whole, tiny), env=_env(), capture_output=True,
                       timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, r.stderr.decode()
    out = tmp_path / "killed.parquet"
    rng = random.Random(41)
    n_groups = ROWS // ROW_GROUP
    kills = 0
    for _ in range(3):
        rc, err = _kill_after(_cmd(src, out, tiny), out, rng.randint(1, n_groups // 5),
                              signal.SIGKILL)
        assert rc == -signal.SIGKILL, err
        kills += 1
    done = _parts(out)
    assert 3 <= done < n_groups  # the kills landed part-way (each run added part files)
    r = subprocess.run(_cmd(src, out, tiny), env=_env(), capture_output=True,
                       timeout=RUN_TIMEOUT_S)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert f"resuming: {done} row groups" in err
    assert out.read_bytes() == whole.read_bytes()
    assert pq.read_table(out).column("id").to_pylist() == [f"r{i}" for i in range(ROWS)]
    assert not pathlib.Path(str(out) + ".lumen-embed").exists()


def test_sigterm_stops_cleanly_and_the_rerun_finishes(tiny, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(ROWS))
    out = tmp_path / "out.parquet"
    rc, err = _kill_after(_cmd(src, out, tiny), out, 2, signal.SIGTERM)
    assert rc == 130, err
    assert "interrupted" in err and "rerun the same command to continue" in err
    assert "Traceback" not in err
    r = subprocess.run(_cmd(src, out, tiny), env=_env(), capture_output=True,
                       timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, r.stderr.decode()
    assert pq.read_metadata(out).num_rows == ROWS


MEMORY_PROBE = """
import json, resource, sys
from lumen_core import cli
rc = cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _peak_rss_kb(tiny, tmp_path, n: int) -> int:
    src = tmp_path / f"in-{n}.txt"
    texts = short_texts()
    with open(src, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(texts[i % len(texts)] + "\n")
    out = tmp_path / f"out-{n}.parquet"
    r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, "embed", str(src), "-o", str(out),
                        "--config", str(tiny), "--task", "tiny", "-q"],
                       env=_env(), capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    res = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert res["rc"] == 0 and pq.read_metadata(out).num_rows == n
    return res["maxrss_kb"]


def test_peak_memory_does_not_grow_with_the_input(tiny, tmp_path):
    small = _peak_rss_kb(tiny, tmp_path, 5_000)  # two row groups (4,096 rows each)
    large = _peak_rss_kb(tiny, tmp_path, 50_000)  # ten times the rows, thirteen row groups
    assert large <= 1.25 * small, (small, large)

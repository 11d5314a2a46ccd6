"""The README's `make` commands as a fresh clone runs them (issue 26): the wheel test gets an
absolute wheel path with the default relative ``DIST`` (pip installs it from a temp folder),
and `make install` says that the silent extension build is running (``VERBOSE=1`` shows it).

Dry runs (``make -n``) print the recipes with every variable expanded and run nothing.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_dry_run(*args: str) -> str:
    """``make -n ARGS`` in the repository with the defaults a user's shell has: none of the
    MAKEFLAGS a parent `make test` (or .ci/run's DIST=/abs/path) would pass down."""
    make = shutil.which("make")
    assert make is not None, "make is not installed (the README's commands need it)"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "DIST", "VERBOSE")}
    proc = subprocess.run([make, "-n", "-C", str(ROOT), *args], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_wheel_test_gets_an_absolute_path_with_the_default_dist():
    out = make_dry_run("test-wheel")
    (line,) = [ln for ln in out.splitlines() if "LUMEN_WHEEL=" in ln]
    pattern = re.search(r"ls -t (\S+)/\*manylinux\*\.whl", line).group(1)
    assert pathlib.Path(pattern).is_absolute(), line
    assert pathlib.Path(pattern) == ROOT / "dist"


def test_install_says_the_extension_build_is_silent_and_verbose_shows_it():
    quiet = make_dry_run("install", "VENV=/nonexistent/venv")
    assert "pip prints nothing while it runs" in quiet and "VERBOSE=1" in quiet
    assert re.search(r"/pip install +\"\.\[", quiet), quiet
    loud = make_dry_run("install", "VENV=/nonexistent/venv", "VERBOSE=1")
    assert re.search(r"/pip install -v \"\.\[", loud), loud


def test_every_step_of_make_test_prints_its_line():
    """Issue 38 row 16: `make install` printed one ``==>`` line per step, `make test`'s own
    steps none (a newcomer watched pytest dots without knowing which of the five runs it was).
    Each step target now prints one, before its command."""
    step = "printf '==> %s\\n'"
    for target in ("test-types", "docs-check", "test-compiled", "test-pure"):
        out = make_dry_run(target, "VENV=/nonexistent/venv").splitlines()
        lines = [ln for ln in out if ln.startswith(step)]
        assert len(lines) == 1, (target, out)
        after = out[out.index(lines[0]) + 1]  # right before its command
        assert "/nonexistent/venv/bin/" in after, (target, out)
    out = make_dry_run("test-wheel", "VENV=/nonexistent/venv").splitlines()
    (line,) = [ln for ln in out if "pytest -m wheel" in ln and ln.startswith(step)]
    assert "LUMEN_WHEEL=" in out[out.index(line) + 1], out

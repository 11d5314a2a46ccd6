"""The compiled/pure switch: twins named and placed alike, one API, every function tested twice.

``lumen_core.native.TWINS`` pairs ``lumen_core._<name>`` with its pure-Python twin
``lumen_core.<name>``; the compiled one is built from ``csrc/_<name>.pyx`` (C-level code) or
from the twin itself with the types of ``lumen_core/_<name>.pxd`` (Cython's pure-Python mode:
one source); the conftest fixtures parametrise tests over both.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import IMPLS, twins

from lumen_core import native

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parent


def test_twins_are_named_and_placed_alike():
    pyx = {p.stem for p in (ROOT / "csrc").glob("*.pyx")}
    pxd = {p.stem for p in (ROOT / "lumen_core").rglob("_*.pxd")}
    assert not pyx & pxd  # one source per compiled module
    assert sorted(pyx | pxd) == sorted(f"_{name}" for name in native.TWINS)
    for name, (compiled, pure) in native.TWINS.items():
        package = ("lumen_core.request_path" if name in native.REQUEST_PATH
                   else "lumen_core")  # the request path's twins live in its package
        assert (compiled, pure) == (f"{package}._{name}", f"{package}.{name}")
        assert (ROOT / package.replace(".", "/") / f"{name}.py").is_file()


@pytest.mark.parametrize("name", sorted(native.TWINS))
def test_twins_export_the_same_api(name):
    mods = twins(name)
    api = mods[0].__all__
    assert api, f"lumen_core.{name} declares no twin API"
    for mod in mods:
        assert mod.__name__ in native.TWINS[name]
        assert list(mod.__all__) == list(api)
        assert all(callable(getattr(mod, fn)) for fn in api)


@pytest.mark.parametrize("name", sorted(native.TWINS))
def test_every_twin_function_is_tested_on_both_implementations(name):
    """Each function of the twin API is called through the ``<name>`` (py-/c-) or ``impl``
    fixture somewhere in tests/, so both implementations run it."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in TESTS.rglob("test_*.py"))
    for fn in native.pure(name).__all__:
        if fn[0].isupper():  # a result class (Descriptor): exercised through its functions
            continue
        pattern = rf"(?<![\w.])(impl\.)?{name}\.{fn}\b"
        assert re.search(pattern, text), f"no test calls {name}.{fn} through the {name!r} or 'impl' fixture"


def test_native_picks_the_configured_implementation():
    for name, (compiled, pure) in native.TWINS.items():
        assert getattr(native, name).__name__ == (pure if native.NO_EXTENSIONS else compiled)
    assert native.using_extensions() == {name: not native.NO_EXTENSIONS for name in native.TWINS}
    assert IMPLS == (["py"] if native.NO_EXTENSIONS else ["py", "c"])


def test_no_extensions_switch_forces_the_pure_twins():
    env = dict(os.environ, LUMEN_NO_EXTENSIONS="1")
    code = ("from lumen_core import native; import json; "
            "print(json.dumps([native.using_extensions(), "
            "{n: native.load(n).__name__ for n in native.TWINS}]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    using, loaded = json.loads(out)
    assert using == {name: False for name in native.TWINS}
    assert loaded == {name: pure for name, (_, pure) in native.TWINS.items()}


def test_unknown_twin_is_an_attribute_error():
    with pytest.raises(AttributeError):
        native.not_a_twin  # noqa: B018


def test_notify_wake_writes_one_byte_and_reports_a_full_pipe(notify):
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        assert notify.wake(w) == 1
        assert os.read(r, 16) == b"\x01"
        written = 0
        while notify.wake(w) == 1:  # fill the pipe: a full one is -1, never an exception
            written += 1
        assert written > 0 and notify.wake(w) == -1
        assert len(os.read(r, written + 16)) == written
    finally:
        os.close(r)
        os.close(w)


def test_notify_drain_reads_every_pending_byte_and_never_blocks(notify):
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        assert notify.drain(r) == 0  # nothing pending: 0, no BlockingIOError
        for _ in range(5):
            notify.wake(w)
        assert notify.drain(r) == 5
        assert notify.drain(r) == 0
        os.write(w, b"x" * (notify.DRAIN_BYTES + 10))
        assert notify.drain(r) == notify.DRAIN_BYTES  # at most DRAIN_BYTES a call
        assert notify.drain(r) == 10
    finally:
        os.close(r)
        os.close(w)


def test_compiled_sources_build_no_error_message_of_their_own():
    """Every request-facing error of a compiled module comes from its pure twin's checks and
    builders; the .pyx files only raise build guards (ImportError), MemoryError, and the
    InternalError that flags a disagreement with the twin."""
    own = re.compile(r"raise\s+(TypeError|ValueError|OverflowError|InvalidArgument|LumenError)\s*\("
                     r"|\b_bad\(")
    for pyx in sorted((ROOT / "csrc").glob("_*.pyx")):
        hits = [line.strip() for line in pyx.read_text(encoding="utf-8").splitlines()
                if own.search(line)]
        assert not hits, f"{pyx.name} builds its own errors: {hits}"

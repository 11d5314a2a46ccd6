"""Shared fixtures.

``impl`` parametrises a test over both implementations of the hot path (ids ``py`` and
``compiled``, aiohttp-style).  With ``LUMEN_NO_EXTENSIONS=1`` only ``py`` runs; otherwise a
missing compiled module is a failure, not a skip: CI must build it.
"""
from __future__ import annotations

import os
import pathlib
import types

import pytest

from lumen_core import native

SHARED = pathlib.Path(os.environ.get("LUMEN_SHARED", pathlib.Path(__file__).resolve().parents[1] / ".." / "shared")).resolve()
FIXTURES = SHARED / "fixtures"

IMPLS = ["py"] if native.NO_EXTENSIONS else ["py", "compiled"]


class _Impl(types.SimpleNamespace):
    pass


def _make_impl(kind: str) -> _Impl:
    mods = {}
    for name in native.TWINS:
        if kind == "py":
            mods[name] = native.pure(name)
        else:
            try:
                mods[name] = native.compiled(name)
            except ImportError as exc:  # pragma: no cover - a build problem
                pytest.fail(f"compiled module for {name!r} is not built: {exc}; "
                            f"run `pip install .` (or set LUMEN_NO_EXTENSIONS=1)")
    return _Impl(kind=kind, **mods)


@pytest.fixture(params=IMPLS)
def impl(request) -> _Impl:
    """Namespace with ``descriptor``, ``assemble``, ``image`` modules of one implementation."""
    return _make_impl(request.param)


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"shared fixtures not found at {FIXTURES} (set LUMEN_SHARED)")
    return FIXTURES


@pytest.fixture(scope="session")
def prepared_home(tmp_path_factory) -> pathlib.Path:
    """A LUMEN_HOME with the default models prepared once per session (task and server tests
    share it; the cache lives in ``serve_support`` so its helpers reuse the same directory)."""
    from serve_support import prepared_home as _prepared_home

    return _prepared_home(tmp_path_factory)

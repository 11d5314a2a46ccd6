"""Shared fixtures.

Compiled vs pure, aiohttp-style (its ``REQUEST_PARSERS`` with ids ``py-parser`` / ``c-parser``):
every twinned module of ``lumen_core.native.TWINS`` gets a fixture of its own name
(``descriptor``, ``assemble``, ``image``, ...) parametrised over the pure-Python twin and the
compiled module, with ids ``py-<name>`` / ``c-<name>``; ``impl`` is the same choice as one
namespace holding every twin (ids ``py`` / ``c``), for tests that need several.  With
``LUMEN_NO_EXTENSIONS=1`` only the ``py`` side runs; otherwise a missing compiled module is a
failure, not a skip: CI must build it.

The test files live in folders mirroring ``lumen_core/`` (``tests/batching``, ``tests/serve``,
...); this conftest sits at the root so its fixtures reach all of them.  The helper modules
(``onnx_models``, ``serve_support``) and this module (``from conftest import twins``) stay in
``tests/``, which goes on ``sys.path`` here: pytest's prepend import mode only adds a test
file's own folder.  There are no ``__init__.py`` files, so test basenames must stay unique.
"""
from __future__ import annotations

import pathlib
import sys
import types

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from lumen_core import native  # noqa: E402

#: the reference outputs the tests match (copied once from the design repository's shared/fixtures:
#: MiniLM embeddings, Silero VAD probabilities, rapidocr readings); a clone carries them
FIXTURES = TESTS / "fixtures"

#: implementation kinds under test: "py" (the pure-Python twin) and "c" (compiled)
IMPLS = ["py"] if native.NO_EXTENSIONS else ["py", "c"]


def twin(name: str, kind: str) -> types.ModuleType:
    """Module ``name`` of one implementation (``kind`` "py" or "c")."""
    if kind == "py":
        return native.pure(name)
    try:
        return native.compiled(name)
    except ImportError as exc:  # pragma: no cover - a build problem
        pytest.fail(f"compiled module for {name!r} is not built: {exc}; "
                    f"run `pip install .` (or set LUMEN_NO_EXTENSIONS=1)")


def twins(name: str) -> list:
    """Every implementation of ``name`` under test, pure first (for agreement checks)."""
    return [twin(name, kind) for kind in IMPLS]


class _Impl(types.SimpleNamespace):
    pass


def _make_impl(kind: str) -> _Impl:
    return _Impl(kind=kind, **{name: twin(name, kind) for name in native.TWINS})


@pytest.fixture(params=IMPLS)
def impl(request) -> _Impl:
    """Namespace with every twinned module (``descriptor``, ``assemble``, ``image``, ...) of one
    implementation."""
    return _make_impl(request.param)


def _twin_fixture(name: str):
    @pytest.fixture(name=name, params=IMPLS, ids=[f"{kind}-{name}" for kind in IMPLS])
    def fixture(request) -> types.ModuleType:
        return twin(name, request.param)

    fixture.__doc__ = f"``lumen_core.{name}`` or ``lumen_core._{name}`` (ids py-{name} / c-{name})."
    return fixture


for _name in native.TWINS:
    globals()[f"{_name}_twin"] = _twin_fixture(_name)


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"test fixtures not found at {FIXTURES}")
    return FIXTURES


@pytest.fixture(scope="session")
def prepared_home(tmp_path_factory) -> pathlib.Path:
    """A LUMEN_HOME with the default models prepared once per session (task and server tests
    share it; the cache lives in ``serve_support`` so its helpers reuse the same directory)."""
    from serve_support import prepared_home as _prepared_home

    return _prepared_home(tmp_path_factory)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    """The default server (text embedding + VAD on the prepared models), one per test module."""
    import serve_support as S

    srv = S.default_server(S.prepared_home(tmp_path_factory))
    yield srv
    srv.stop()

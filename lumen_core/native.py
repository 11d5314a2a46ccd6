"""Choose the compiled hot path or its pure-Python twin (aiohttp's NO_EXTENSIONS pattern).

Every compiled module ``lumen_core._<name>`` has a pure-Python twin ``lumen_core.<name>``
exporting the same API (its ``__all__``), named and placed alike.  Two kinds:

- C-level code (buffer protocol, nogil loops, C structs: ``descriptor``, ``assemble``,
  ``image``, ``notify``) is written in ``csrc/_<name>.pyx``; the twin is the definition, and the
  compiled module imports its cold-path checks and error builders from it and only
  re-implements the hot path;
- the request path's classes (``dispatch``, ``scheduler``, ``latency``, ``entries``,
  ``messages``) have ONE source, the twin itself,
  which Cython compiles in its pure-Python mode with the C types declared in
  ``lumen_core/_<name>.pxd`` (nothing is written twice).
  ``LUMEN_NO_EXTENSIONS=1`` forces the twins; otherwise the compiled module is
used when it imports.  Callers import the chosen module from here::

    from lumen_core import native
    native.descriptor.parse_meta(meta, nbytes, contract)
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # the type checker reads the pure-Python twins: each is the definition its compiled module
    # mirrors, so ``native.messages.InferRequest`` has the twin's type (``x as x``: re-exported,
    # so strict modules may name them)
    from . import assemble as assemble
    from . import image as image
    from . import notify as notify
    from .request_path import descriptor as descriptor
    from .request_path import dispatch as dispatch
    from .request_path import entries as entries
    from .request_path import latency as latency
    from .request_path import messages as messages
    from .request_path import routes as routes
    from .request_path import scheduler as scheduler

NO_EXTENSIONS = os.environ.get("LUMEN_NO_EXTENSIONS", "").lower() in ("1", "true", "yes")

#: the twinned hot-path modules, by name
NAMES = ("descriptor", "assemble", "image", "notify", "messages", "entries", "latency",
         "scheduler", "routes", "dispatch")
#: the twins in the request path's package (``request_path/``); the others sit at the top
REQUEST_PATH = ("descriptor", "messages", "entries", "scheduler", "dispatch", "latency", "routes")
#: name -> (compiled module, pure-Python twin)
TWINS = {name: (f"{pkg}._{name}", f"{pkg}.{name}") for name in NAMES
         for pkg in ["lumen_core.request_path" if name in REQUEST_PATH else "lumen_core"]}


def pure(name: str) -> ModuleType:
    return importlib.import_module(TWINS[name][1])


def compiled(name: str) -> ModuleType:
    """The compiled module; raises ImportError when it was not built."""
    return importlib.import_module(TWINS[name][0])


def load(name: str) -> ModuleType:
    if NO_EXTENSIONS:
        return pure(name)
    try:
        return compiled(name)
    except ImportError:
        return pure(name)


def using_extensions() -> dict[str, bool]:
    """name -> True when the compiled module is in use.

    Reported by ``Runtime.extensions()``, the runtime's start-up log and the server's
    ``/healthz``, so an operator can tell a build without its extensions from a fast one.
    """
    return {name: load(name).__name__ == TWINS[name][0] for name in TWINS}


def __getattr__(name: str) -> ModuleType:
    # lazy: ``native.descriptor`` imports on first use and is then cached in globals()
    if name in TWINS:
        mod = load(name)
        globals()[name] = mod
        return mod
    raise AttributeError(name)

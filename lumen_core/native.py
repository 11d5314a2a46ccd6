"""Choose the compiled hot path or its pure-Python twin (aiohttp's NO_EXTENSIONS pattern).

Every compiled module ``lumen_core._<name>`` (built from ``csrc/_<name>.pyx``) has a
pure-Python twin ``lumen_core.<name>`` exporting the same functions (its ``__all__``): one
behaviour, two implementations, named and placed alike.  The twin is the definition; the
compiled module imports its cold-path checks and error builders from it and only re-implements
the hot path.  ``LUMEN_NO_EXTENSIONS=1`` forces the twins; otherwise the compiled module is
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
    # mirrors, so ``native.messages.InferRequest`` has the twin's type
    from . import assemble, descriptor, image, messages, notify, scheduler  # noqa: F401

NO_EXTENSIONS = os.environ.get("LUMEN_NO_EXTENSIONS", "").lower() in ("1", "true", "yes")

#: the twinned hot-path modules, by name
NAMES = ("descriptor", "assemble", "image", "notify", "messages", "scheduler")
#: name -> (compiled module, pure-Python twin)
TWINS = {name: (f"lumen_core._{name}", f"lumen_core.{name}") for name in NAMES}


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


def using_extensions() -> dict:
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

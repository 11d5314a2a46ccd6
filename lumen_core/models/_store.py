"""Where prepared models live and how a build lands there: ``$LUMEN_HOME/models/<name>/``, one
preparer at a time per store (an advisory lock), a build written in a staging directory and
swapped in whole.  Shared by the embedded models' ``prepare`` and the folder importer
(:mod:`.st_import`); kept apart from ``__init__`` so both use it without an import cycle.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
from typing import Iterator, Optional

from ..errors import ModelMissingError

HOME_ENV = "LUMEN_HOME"
DEFAULT_HOME = pathlib.Path("~/.cache/lumen")
MODELS_SUBDIR = "models"
LOCK_NAME = ".prepare.lock"


def lumen_home() -> pathlib.Path:
    """``$LUMEN_HOME``, or ``~/.cache/lumen``."""
    env = os.environ.get(HOME_ENV)
    return pathlib.Path(env).expanduser() if env else DEFAULT_HOME.expanduser()


def models_dir(home: Optional[os.PathLike] = None) -> pathlib.Path:
    return (pathlib.Path(home).expanduser() if home is not None else lumen_home()) / MODELS_SUBDIR


@contextlib.contextmanager
def exclusive(directory: pathlib.Path) -> Iterator[None]:
    """One preparer at a time per models dir (two shells running prepare must not interleave)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks, accept the race
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_NAME, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def staging_dir(root: pathlib.Path, name: str) -> pathlib.Path:
    """A fresh, empty staging directory beside ``root / name`` (remove it when done)."""
    staging = root / f".{name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def swap_in(staging: pathlib.Path, directory: pathlib.Path) -> None:
    """Replace ``directory`` by ``staging`` whole: a reader sees the old complete directory or
    the new one."""
    retired = directory.parent / f".{directory.name}.retired-{os.getpid()}"
    shutil.rmtree(retired, ignore_errors=True)
    if directory.exists():
        directory.rename(retired)
    try:
        staging.rename(directory)
    except OSError:
        if retired.exists():
            retired.rename(directory)
        raise
    shutil.rmtree(retired, ignore_errors=True)


class Prepared(dict):
    """What :func:`prepare` did: ``{name: prepared directory}``, plus ``skipped``:
    ``{name: ModelMissingError}`` of the models left out because their source package is not
    installed (``error.command`` installs it; only when no names were asked for)."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[str, ModelMissingError] = {}

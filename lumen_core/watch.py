"""Model and config files on disk, as the lifecycle watches them: a file's state (size, mtime,
inode), its content revision (sha256), waiting until a writer has finished (no half-written
file is ever loaded), and :class:`FileWatch`, the states of the watched files at the last look
(``lumen serve --watch``), and :func:`confine_model`, the check of a model file an admin
load names.  Reads run on worker threads and give up (:class:`Stopped`) when
the runtime stops, so a shutdown never waits for a big file.
"""
from __future__ import annotations

import hashlib
import os
import stat as stat_mod
import threading
import time
from typing import Iterable, Optional

from .errors import InvalidArgument, PayloadTooLarge, PermissionDenied

#: bytes read at a time while hashing a model file
HASH_CHUNK_BYTES = 1 << 20
#: a changed file is loaded once its size and mtime stayed the same this long (no half-written
#: file is ever loaded)
STABLE_QUIET_S = 0.2
#: a file still changing after this long is loaded as it is then (and failing, reported)
STABLE_MAX_WAIT_S = 30.0
#: ``lumen serve --watch``: seconds between two looks at the config and model files
WATCH_INTERVAL_S = 1.0
#: the most characters of a requested model path quoted back in an error
MAX_PATH_ECHO = 200


def file_state(path: str) -> Optional[tuple]:
    """(size, mtime_ns, inode) of ``path``, or None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class Stopped(Exception):
    """The runtime stopped while a worker thread was still reading a model file."""


def file_hash(path: str, stop: Optional[threading.Event] = None) -> str:
    """sha256 of the file's content (the revision a version is loaded from); Stopped as soon
    as ``stop`` is set (a shutdown never waits for a big file to be read)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            if stop is not None and stop.is_set():
                raise Stopped(path)
            h.update(chunk)
    return h.hexdigest()


def wait_stable(path: str, quiet_s: float = STABLE_QUIET_S,
                max_wait_s: float = STABLE_MAX_WAIT_S,
                stop: Optional[threading.Event] = None) -> Optional[tuple]:
    """Block until ``path`` keeps its state for ``quiet_s`` (a writer has finished); its state
    then (None: it does not exist).  Runs on a worker thread; Stopped when ``stop`` is set."""
    t_end = time.monotonic() + max_wait_s
    st = file_state(path)
    while True:
        if stop is not None and stop.wait(quiet_s):
            raise Stopped(path)
        if stop is None:
            time.sleep(quiet_s)
        now = file_state(path)
        if now == st or time.monotonic() >= t_end:
            return now
        st = now


def stable_revision(path: str, quiet_s: float = STABLE_QUIET_S,
                    stop: Optional[threading.Event] = None) -> tuple:
    """(state, sha256) of ``path`` once its writer has finished; (None, "") when it does not
    exist or cannot be read.  One worker-thread hop for the whole check."""
    st = wait_stable(path, quiet_s, stop=stop)
    if st is None:
        return None, ""
    try:
        return st, file_hash(path, stop)
    except OSError:
        return st, ""


def confine_model(path: str, root: str, max_bytes: int, field: str = "model") -> str:
    """The model file an admin load names, checked before anything reads it; the real path.

    A relative ``path`` is taken under ``root`` (``[server] model_root``, or the config file's
    folder); the real path (symlinks followed) must lie under the real ``root``, and nothing
    is looked up for a path outside it, so the answer tells nothing about what exists there.
    Under the root it must be an existing regular file (or a model directory) of at most
    ``max_bytes`` (``[server] admin_max_model_bytes``): a device (``/dev/zero``), a FIFO or a
    socket is refused at once, never read."""
    if "\x00" in path:
        raise InvalidArgument("a model path holds no NUL character", field)
    if not root:
        raise PermissionDenied("this server takes no model path over the admin API: set "
                               "[server] model_root (or serve from a config file: its folder "
                               "is the root), or load the versions its config names", field)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    if os.path.commonpath([real, real_root]) != real_root:
        raise PermissionDenied(f"model {path[:MAX_PATH_ECHO]!r} is not under the model root "
                               f"{root} ([server] model_root); admin loads name files there",
                               field)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise InvalidArgument(f"model {path[:MAX_PATH_ECHO]!r}: {exc.strerror or exc} (under "
                              f"the model root {root})", field) from None
    if stat_mod.S_ISDIR(st.st_mode):
        return real  # a model directory (the ocr backend's): its backend opens named files
    if not stat_mod.S_ISREG(st.st_mode):
        raise InvalidArgument(f"model {path[:MAX_PATH_ECHO]!r} is not a regular file", field)
    if st.st_size > max_bytes:
        raise PayloadTooLarge(f"model {path[:MAX_PATH_ECHO]!r} is {st.st_size} bytes; the limit "
                              f"is {max_bytes} ([server] admin_max_model_bytes)", field)
    return real


class FileWatch:
    """The states of the watched files at the last look: :meth:`changed` says which differ
    now (a path new to the watch, e.g. the model of a version the admin API loaded, is
    recorded, not a change)."""

    def __init__(self) -> None:
        self.seen: dict = {}  # watched path -> its state at the last look

    def reset(self, paths: Iterable[str]) -> None:
        """Take the current state of ``paths`` as the last look."""
        self.seen = {p: file_state(p) for p in paths}

    def changed(self, paths: Iterable[str]) -> set:
        """Of ``paths``, those whose state differs from the last look; then this look is the
        last."""
        now = {p: file_state(p) for p in paths}
        seen = self.seen
        out = {p for p, st in now.items() if p in seen and seen[p] != st}
        self.seen = now
        return out

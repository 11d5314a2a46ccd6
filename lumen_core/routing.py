"""Routing among the versions of one task: the traffic split (:func:`effective_split`,
:func:`check_traffic`), the version a request goes to (:class:`Router`: an open sequence's
version, a pin, a sticky key's point or a random one) and the head version.  The lifecycle
of the versions themselves (loading, swapping, draining) is :mod:`lumen_core.versions`.
"""
from __future__ import annotations

import hashlib
import random
import sys
from bisect import bisect_right
from typing import Any, Iterable, Mapping, Optional

from .config import traffic_weight
from .contract import KEY_MODEL_VERSION, KEY_ROUTE_KEY, KEY_SEQUENCE_ID, MAX_META_VALUE_CHARS
from .errors import InvalidArgument

_POINTS = float(1 << 64)
#: sticky keys whose version a router remembers (a new router, i.e. a new split, starts
#: empty), and the bytes their strings may take in all; past either, a key's version is
#: computed from its hash every time (the same answer, a little more work)
MAX_STICKY_KEYS = 65536
MAX_STICKY_BYTES = 16 << 20
_random = random.random


def version_key(v: str) -> tuple[int, int, str]:
    """Sort key of version labels: numeric labels by value, before any others by text."""
    return (0, int(v), v) if v.isdigit() else (1, 0, v)


def route_point(key: str) -> float:
    """A sticky key's point in ``[0, 1)``: stable across processes and restarts (so replicas
    agree), unlike ``hash()``."""
    d = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(d, "little") / _POINTS


def effective_split(requested: Mapping[str, Any], serving: Iterable[str]) -> dict[str, Any]:
    """``{version: weight}`` over the serving versions: the requested weights of those that
    serve; when none of them has a positive weight (no split configured, or its versions are
    not loaded), the highest version takes everything."""
    serving = sorted(serving, key=version_key)
    split = {v: float(requested.get(v, 0.0)) for v in serving}
    if not any(split.values()):
        split = {v: 0.0 for v in serving}
        if serving:
            split[serving[-1]] = 100.0
    return split


def check_traffic(task: str, weights: Any, serving: Iterable[str]) -> dict[str, Any]:
    """``weights`` as ``{version: float}``, or InvalidArgument (field ``traffic``) naming what
    is wrong: a version that does not serve, a weight that is not a number in
    ``0..MAX_TRAFFIC_WEIGHT``, no weight."""
    serving = sorted(serving, key=version_key)
    if not isinstance(weights, Mapping) or not weights:
        raise InvalidArgument(f"traffic of task {task!r} must be a non-empty object "
                              f"{{version: weight}} (versions: {', '.join(serving)})", "traffic")
    out = {}
    for v, w in weights.items():
        if v not in serving:
            raise InvalidArgument(f"task {task!r} has no loaded version {v!r} (loaded: "
                                  f"{', '.join(serving)}); load it first", "traffic")
        try:
            out[str(v)] = traffic_weight(w)
        except ValueError as exc:
            raise InvalidArgument(f"traffic weight of version {v!r} {exc}", "traffic") from None
    if not any(out.values()):
        raise InvalidArgument(f"traffic of task {task!r} gives every version weight 0; give "
                              f"one a positive weight", "traffic")
    return out


class Router:
    """Picks the version of one request of a task with several (installed as ``head.router``).

    Built once per change, read-only afterwards (but for the memo of sticky keys): the request
    path makes no list.  Order of the checks: an open sequence stays on the version that holds
    it (stateful tasks: ``sequences`` lists their versions, draining ones first), then a pin
    (``lumen.model.version``), then the split -- a sticky key's point (a stateful task's
    sequence id is its key), or a random one.
    """

    __slots__ = ("name", "by_version", "tasks", "cum", "total", "sequences", "_sticky",
                 "sticky_bytes")

    def __init__(self, name: str, serving: Mapping[str, Any], split: Mapping[str, Any],
                 sequences: Iterable[Any] = ()):
        self.name = name
        self.by_version = dict(serving)
        weighted = [(v, w) for v, w in sorted(split.items(), key=lambda kv: version_key(kv[0]))
                    if w > 0]
        self.tasks = tuple(serving[v] for v, _ in weighted)
        cum, total = [], 0.0
        for _v, w in weighted:
            total += w
            cum.append(total)
        self.cum = tuple(cum)
        self.total = total
        self.sequences = tuple(sequences)
        self._sticky: dict[Any, Any] = {}  # route key -> its version's task, under this split
        #: bytes of the remembered keys' strings (bounded by MAX_STICKY_BYTES)
        self.sticky_bytes = 0

    def __call__(self, meta: Any) -> Any:
        try:
            get = meta.get
        except AttributeError:  # not a mapping: parse_meta refuses it with the right error
            return self.tasks[0]
        sid = None
        if self.sequences:
            sid = get(KEY_SEQUENCE_ID)
            if sid is not None:
                for t in self.sequences:
                    if t.batcher.holds_sequence(sid):
                        return t
        v = get(KEY_MODEL_VERSION)
        if v is not None:
            t = self.by_version.get(v)
            if t is None:
                raise self._unknown(v)
            return t
        tasks = self.tasks
        if len(tasks) == 1:
            return tasks[0]
        key = get(KEY_ROUTE_KEY) or sid
        if type(key) is str and key:
            if len(key) > MAX_META_VALUE_CHARS:
                return tasks[0]  # parse_meta refuses the request: nothing hashed or kept
            t = self._sticky.get(key)
            if t is None:
                t = self._pick(route_point(key))
                size = sys.getsizeof(key)
                if len(self._sticky) < MAX_STICKY_KEYS \
                        and self.sticky_bytes + size <= MAX_STICKY_BYTES:
                    self._sticky[key] = t
                    self.sticky_bytes += size
            return t
        return self._pick(_random())

    def _pick(self, point: float) -> Any:
        """The version whose share of ``[0, total)`` holds ``point * total``."""
        i = bisect_right(self.cum, point * self.total)
        tasks = self.tasks
        return tasks[i if i < len(tasks) else -1]

    def _unknown(self, v: Any) -> InvalidArgument:
        return InvalidArgument(f"{KEY_MODEL_VERSION} {str(v)[:64]!r} is not a loaded version of "
                               f"task {self.name!r} (loaded: "
                               f"{', '.join(sorted(self.by_version, key=version_key))})",
                               KEY_MODEL_VERSION)


def head_version(split: Mapping[str, Any]) -> Optional[str]:
    """The version with the largest share of ``split`` (the highest label on a tie): the
    task's head in ``Runtime.tasks``."""
    if not split:
        return None
    return max(split, key=lambda v: (split[v], version_key(v)))

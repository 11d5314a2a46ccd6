"""``[[tasks]]``: one task's own keys, its versions and traffic split, its response cache,
and the backend-declared ``[tasks.options]`` (read against the backend's :class:`Option`s).

The task's scalar keys are declared once, as :func:`~.schema.setting` fields of
:class:`TaskConfig`; the tables under a task are parsed by their own modules
(``batching.py``, ``sequence.py``) or here (versions, traffic, cache: a few keys whose checks
depend on one another).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ..errors import ConfigError
from .batching import BatchingConfig, parse_batching
from .schema import Option, Reader, read_settings, resolve_path, setting
from .sequence import SequenceConfig, check_unused_batching, parse_sequence

MAX_INSTANCES = 64


def _model_path(r: Reader, _name: str, path: str, _values: dict) -> str:
    return resolve_path(path, r.base_dir)


def _device(r: Reader, name: str, dev: str, _values: dict) -> str:
    if dev == "cpu" or (dev.startswith("cuda:") and dev[5:].isdigit()):
        return dev
    raise r.err(name, f"must be 'cpu' or 'cuda:N', got {dev!r}")


@dataclass(frozen=True)
class VersionConfig:
    """One ``[[tasks.versions]]`` entry: a version label and its model file."""

    version: str
    model: str = ""


#: bounds of [tasks.cache] (1 TiB, 30 days)
MAX_CACHE_BYTES = 1 << 40
MAX_CACHE_TTL_S = 30 * 24 * 3600


def _ttl(r: Reader, name: str, ttl: Any, _values: dict) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0 <= ttl <= MAX_CACHE_TTL_S:
        raise r.err(name, f"must be a number of seconds in 0..{MAX_CACHE_TTL_S} "
                          f"(0: no expiry), got {ttl!r}")
    return float(ttl)


@dataclass(frozen=True)
class CacheConfig:
    """``[tasks.cache]``: the task's response cache (``lumen_core/cache.py``)."""

    max_bytes: int = setting(0, "the cache's size bound: least recently used entries are "
                                "evicted past it", lo=1, hi=MAX_CACHE_BYTES,
                             required="the cache's size bound in bytes, e.g. 67108864")
    ttl_s: float = setting(0.0, "seconds an entry is served (0: no expiry; entries are still "
                                "evicted by bytes)", kind=object, check=_ttl, kind_doc="number",
                           range_doc=f"0..{MAX_CACHE_TTL_S}")


@dataclass
class TaskConfig:
    """One ``[[tasks]]`` entry; ``name`` and ``backend`` are required, the keys declared by
    :func:`~.schema.setting` are optional, the rest are the tables under the task."""

    name: str
    backend: str
    model: str = setting("", "the model file or folder (relative: to this file's folder); or "
                             "model_id", check=_model_path, kind_doc="path")
    model_id: str = setting("", "a model in the store (lumen models list)")
    model_version: str = setting("1", "the version label of model")
    device: str = setting("cpu", "\"cpu\" or \"cuda:N\" (needs the [gpu] extra)",
                          check=_device)
    instances: int = setting(1, "ORT sessions serving the task's batches at once", lo=1,
                             hi=MAX_INSTANCES)
    intra_op_threads: int = setting(0, "threads per session (0: cores // instances)", lo=0,
                                    hi=1024)
    allow_spinning: Optional[bool] = setting(None, "ORT's spinning worker threads", kind=bool,
                                             default_doc="off when instances share cores")
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    #: [tasks.options] as written; the backend reads it through read_options(its schema)
    options: dict = field(default_factory=dict)
    #: [tasks.sequence] as written (None when absent); a stateful backend's effective one is
    #: effective_sequence(this, what it declares), see TaskBackend.sequence
    sequence: Optional[SequenceConfig] = None
    #: [tasks.cache] (None: no response cache)
    cache: Optional[CacheConfig] = None
    source: str = "<dict>"  # where this task was declared, for error messages
    key: str = "tasks[0]"
    #: ``[[tasks.versions]]`` as written (empty: one version, ``model`` / ``model_version``);
    #: ``task_versions`` turns them into one TaskConfig per version (lumen_core/versions.py)
    versions: tuple = ()
    #: ``[tasks.traffic]``: version -> weight (empty: the highest version takes all traffic)
    traffic: dict = field(default_factory=dict)


def task_versions(tc: TaskConfig) -> list:
    """One TaskConfig per version of ``tc`` (``model`` and ``model_version`` set, no versions
    of its own); a task without ``[[tasks.versions]]`` is its own single version."""
    if not tc.versions:
        return [tc]
    return [dataclasses.replace(tc, model=v.model, model_version=v.version, versions=(),
                                traffic={}, key=f"{tc.key}.versions[{i}]")
            for i, v in enumerate(tc.versions)]


def read_options(task: TaskConfig, schema: Sequence[Option]) -> dict:
    """``task.options`` checked against a backend's declared ``schema``: a new dict holding
    every declared option (defaults filled in).  An undeclared key is a ConfigError naming the
    keys the backend knows; ``task`` itself is not changed."""
    r = Reader(task.source, f"{task.key}.options", task.options)
    known = [o.name for o in schema]
    unknown = sorted(str(k) for k in r.table if k not in known)
    if unknown:
        if not known:
            raise r.err(unknown[0], f"backend {task.backend!r} takes no options")
        raise r.err(unknown[0], f"unknown option for backend {task.backend!r} "
                                f"(known: {', '.join(known)})")
    return {o.name: o.read(r) for o in schema}


def parse_task(table: Mapping, source: str = "<dict>", key: str = "tasks[0]",
               base_dir: Optional[str] = None) -> TaskConfig:
    r = Reader(source, key, table, base_dir)
    name = r.get("name", str, "")
    if not name:
        raise r.err("name", "is required (the task name requests route on)")
    backend = r.get("backend", str, "")
    if not backend:
        raise r.err("backend", "is required (onnx, text_embedding, rerank, vad, "
                               "image_embedding, ...)")
    cfg = TaskConfig(name=name, backend=backend, source=source, key=key,
                     **read_settings(r, TaskConfig))
    cfg.batching = parse_batching(r.sub("batching"), backend)
    cfg.options = r.get("options", dict, {})
    if "sequence" in r.table:
        cfg.sequence = parse_sequence(r.sub("sequence"), cfg.batching)
        check_unused_batching(r, key)
    else:
        r.used.add("sequence")
    _parse_versions(r, cfg)
    if "cache" in r.table:
        cfg.cache = _parse_cache(r.sub("cache"))
    else:
        r.used.add("cache")
    r.finish()
    return cfg


#: the largest traffic weight (weights are relative: this leaves a split of any number of
#: versions summable, and finite, in a float)
MAX_TRAFFIC_WEIGHT = 1e12


def traffic_weight(w: Any) -> float:
    """A traffic weight as a float; ValueError (the problem, to follow a key) when it is not a
    number in ``0..MAX_TRAFFIC_WEIGHT`` (a bool, NaN, an integer too large for a float)."""
    ok = not isinstance(w, bool) and isinstance(w, (int, float))
    if ok and isinstance(w, int) and w > MAX_TRAFFIC_WEIGHT:
        ok = False  # before float(): a 400-digit integer does not convert
    if ok and 0.0 <= float(w) <= MAX_TRAFFIC_WEIGHT:
        return float(w)
    if isinstance(w, int) and not isinstance(w, bool) and w.bit_length() > 64:
        got = f"an integer of {w.bit_length()} bits"  # str() of a huge int is refused
    else:
        got = repr(w)[:40]
    raise ValueError(f"must be a number >= 0 and <= {MAX_TRAFFIC_WEIGHT:g}, got {got}")


def _parse_versions(r: Reader, cfg: TaskConfig) -> None:
    """``[[tasks.versions]]`` and ``[tasks.traffic]`` into ``cfg`` (SPEC section 6)."""
    tables = r.get("versions", list, [])
    if tables and ("model" in r.table or "model_version" in r.table):
        raise r.err("versions", "a task with [[tasks.versions]] names its models there; "
                                "remove its model / model_version keys")
    versions: list = []
    for i, t in enumerate(tables):
        sub = Reader(r.source, f"{r.key('versions')}[{i}]", t, r.base_dir)
        label = sub.get("version", str, "")
        if not label:
            raise sub.err("version", "is required (a non-empty version label, e.g. \"2\")")
        if any(v.version == label for v in versions):
            raise sub.err("version", f"version {label!r} is listed twice")
        versions.append(VersionConfig(label, resolve_path(sub.get("model", str, ""),
                                                          r.base_dir)))
        sub.finish()
    cfg.versions = tuple(versions)
    traffic = r.get("traffic", dict, {})
    labels = [v.version for v in versions] or [cfg.model_version]
    for label, weight in traffic.items():
        if label not in labels:
            raise ConfigError(r.source, f"{r.key('traffic')}.{label}",
                              f"names no version of task {cfg.name!r} (versions: "
                              f"{', '.join(labels)})")
        try:
            traffic_weight(weight)
        except ValueError as exc:
            raise ConfigError(r.source, f"{r.key('traffic')}.{label}", str(exc)) from None
    if traffic and not any(traffic.values()):
        raise r.err("traffic", "gives every version weight 0; give one a positive weight")
    cfg.traffic = {str(k): traffic_weight(v) for k, v in traffic.items()}


def _parse_cache(r: Reader) -> CacheConfig:
    cache = CacheConfig(**read_settings(r, CacheConfig))
    r.finish()
    return cache

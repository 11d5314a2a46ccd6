"""TOML configuration (SPEC section 6) -> typed, validated config objects.

A config error names the file, the key and what is wrong (``lumen.toml: tasks[0].batching.
max_batch_size: must be an integer >= 1, got -1``), because a server that refuses to start must
say exactly which line to fix.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_DELAY_US = 2000
DEFAULT_MAX_QUEUE_SIZE = 1024
MAX_INSTANCES = 64
MAX_PRIORITY_LEVELS = 16


class ConfigError(ValueError):
    """A configuration problem: ``source: key: problem``."""

    def __init__(self, source: str, key: str, problem: str):
        super().__init__(f"{source}: {key}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


@dataclass
class ServerConfig:
    host: str = DEFAULT_HOST
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES


@dataclass
class BatchingConfig:
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US
    preferred_batch_sizes: tuple = ()
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    default_timeout_ms: int = 0
    priority_levels: int = 1
    default_priority_level: int = 0  # 0: the lowest level (priority_levels)


@dataclass
class TaskConfig:
    name: str
    backend: str
    model: str = ""
    model_id: str = ""
    model_version: str = "1"
    device: str = "cpu"
    instances: int = 1
    intra_op_threads: int = 0  # 0: cores // instances
    allow_spinning: Optional[bool] = None  # None: off when instances share cores
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    options: dict = field(default_factory=dict)
    sequence: Optional[dict] = None  # raw [tasks.sequence] table, parsed by the sequence batcher
    source: str = "<dict>"  # where this task was declared, for error messages
    key: str = "tasks[0]"


@dataclass
class LumenConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    tasks: list = field(default_factory=list)
    source: str = "<dict>"


class _Reader:
    """Typed access to one TOML table that reports ``source: key: problem``."""

    def __init__(self, source: str, prefix: str, table: Any):
        self.source = source
        self.prefix = prefix
        if not isinstance(table, Mapping):
            raise ConfigError(source, prefix or "<root>", f"must be a table, got {type(table).__name__}")
        self.table = table
        self.used: set = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def err(self, name: str, problem: str) -> ConfigError:
        return ConfigError(self.source, self.key(name), problem)

    def get(self, name: str, kind: type, default: Any, *, lo: Optional[int] = None,
            hi: Optional[int] = None, choices: Optional[tuple] = None) -> Any:
        self.used.add(name)
        if name not in self.table:
            return default
        v = self.table[name]
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.err(name, f"must be an integer, got {v!r}")
            if lo is not None and v < lo:
                raise self.err(name, f"must be an integer >= {lo}, got {v}")
            if hi is not None and v > hi:
                raise self.err(name, f"must be an integer <= {hi}, got {v}")
        elif kind is bool:
            if not isinstance(v, bool):
                raise self.err(name, f"must be true or false, got {v!r}")
        elif kind is str:
            if not isinstance(v, str):
                raise self.err(name, f"must be a string, got {v!r}")
            if choices is not None and v not in choices:
                raise self.err(name, f"must be one of {', '.join(choices)}, got {v!r}")
        elif kind is dict:
            if not isinstance(v, Mapping):
                raise self.err(name, f"must be a table, got {v!r}")
            v = dict(v)
        elif kind is list:
            if not isinstance(v, list):
                raise self.err(name, f"must be an array, got {v!r}")
        return v

    def sub(self, name: str) -> "_Reader":
        self.used.add(name)
        return _Reader(self.source, self.key(name), self.table.get(name, {}))

    def finish(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.err(unknown[0], f"unknown key (known: {', '.join(sorted(self.used))})")


def _parse_device(r: _Reader) -> str:
    dev = r.get("device", str, "cpu")
    if dev == "cpu":
        return dev
    if dev.startswith("cuda:") and dev[5:].isdigit():
        return dev
    raise r.err("device", f"must be 'cpu' or 'cuda:N', got {dev!r}")


def _parse_batching(r: _Reader) -> BatchingConfig:
    b = BatchingConfig(
        max_batch_size=r.get("max_batch_size", int, DEFAULT_MAX_BATCH_SIZE, lo=1, hi=65536),
        max_queue_delay_us=r.get("max_queue_delay_us", int, DEFAULT_MAX_QUEUE_DELAY_US, lo=0,
                                 hi=60_000_000),
        max_queue_size=r.get("max_queue_size", int, DEFAULT_MAX_QUEUE_SIZE, lo=1),
        default_timeout_ms=r.get("default_timeout_ms", int, 0, lo=0),
        priority_levels=r.get("priority_levels", int, 1, lo=1, hi=MAX_PRIORITY_LEVELS),
    )
    b.default_priority_level = r.get("default_priority_level", int, 0, lo=0,
                                     hi=b.priority_levels)
    pref = r.get("preferred_batch_sizes", list, [])
    for p in pref:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= b.max_batch_size:
            raise r.err("preferred_batch_sizes",
                        f"entries must be integers in 1..max_batch_size ({b.max_batch_size}), "
                        f"got {p!r}")
    b.preferred_batch_sizes = tuple(sorted(set(pref)))
    r.finish()
    return b


def _resolve_model(path: str, base_dir: Optional[str]) -> str:
    if not path:
        return path
    path = os.path.expanduser(path)
    if base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return path


def parse_task(table: Mapping, source: str = "<dict>", key: str = "tasks[0]",
               base_dir: Optional[str] = None) -> TaskConfig:
    r = _Reader(source, key, table)
    name = r.get("name", str, "")
    if not name:
        raise r.err("name", "is required (the task name requests route on)")
    backend = r.get("backend", str, "")
    if not backend:
        raise r.err("backend", "is required (onnx, text_embedding, vad, image_embedding, ...)")
    cfg = TaskConfig(name=name, backend=backend, source=source, key=key)
    cfg.model = _resolve_model(r.get("model", str, ""), base_dir)
    cfg.model_id = r.get("model_id", str, "")
    cfg.model_version = r.get("model_version", str, "1")
    cfg.device = _parse_device(r)
    cfg.instances = r.get("instances", int, 1, lo=1, hi=MAX_INSTANCES)
    cfg.intra_op_threads = r.get("intra_op_threads", int, 0, lo=0, hi=1024)
    cfg.allow_spinning = r.get("allow_spinning", bool, None)
    cfg.batching = _parse_batching(r.sub("batching"))
    cfg.options = r.get("options", dict, {})
    cfg.sequence = r.get("sequence", dict, None)
    r.finish()
    return cfg


def parse_config(data: Mapping, source: str = "<dict>", base_dir: Optional[str] = None) -> LumenConfig:
    root = _Reader(source, "", data)
    srv = root.sub("server")
    server = ServerConfig(
        host=srv.get("host", str, DEFAULT_HOST),
        http_port=srv.get("http_port", int, DEFAULT_HTTP_PORT, lo=0, hi=65535),
        grpc_port=srv.get("grpc_port", int, DEFAULT_GRPC_PORT, lo=0, hi=65535),
        max_payload_bytes=srv.get("max_payload_bytes", int, DEFAULT_MAX_PAYLOAD_BYTES, lo=1),
    )
    srv.finish()
    tables = root.get("tasks", list, [])
    tasks = []
    seen = set()
    for i, t in enumerate(tables):
        tc = parse_task(t, source, f"tasks[{i}]", base_dir)
        if tc.name in seen:
            raise ConfigError(source, f"tasks[{i}].name", f"duplicate task name {tc.name!r}")
        seen.add(tc.name)
        tasks.append(tc)
    root.finish()
    return LumenConfig(server=server, tasks=tasks, source=source)


def load_config(path: str) -> LumenConfig:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, "<file>", "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "<syntax>", str(exc)) from None
    return parse_config(data, source=path, base_dir=os.path.dirname(os.path.abspath(path)))

"""TOML configuration (SPEC section 6) -> typed, validated config objects.

A config error names the file, the key and what is wrong (``lumen.toml: tasks[0].batching.
max_batch_size: must be an integer >= 1, got -1``), because a server that refuses to start must
say exactly which line to fix.

Backend-specific keys are declared by the backends, read here: ``[tasks.options]`` against a
backend's :class:`Option` schema (:func:`read_options`), and the stateful inputs a backend
declares for its model filled into ``[tasks.sequence]`` (:func:`effective_sequence`).  Both
return new objects; a parsed :class:`TaskConfig` is never changed after parsing.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .contract import CORRID_DTYPES as CONTRACT_CORRID_DTYPES
from .contract import DTYPES, MAX_RANK
from .errors import ConfigError  # noqa: F401 - lives in errors.py; re-exported for old importers

DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
# [server] connection limits (lumen_core/serve/limits.py enforces them)
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_READ_TIMEOUT_MS = 10_000
DEFAULT_MAX_CONNECTIONS = 1000
#: a request body's deadline: it may take this long from its headers, plus one second per
#: DEFAULT_BODY_MIN_RATE bytes received (Apache mod_reqtimeout's ``body=20,MinRate=500``)
DEFAULT_BODY_TIMEOUT_MS = 20_000
DEFAULT_BODY_MIN_RATE = 500
#: [server] shm_max_regions: system shared-memory regions registered at once (one file
#: descriptor each; serve/shm.py also keeps them within a share of ``ulimit -n``)
DEFAULT_SHM_MAX_REGIONS = 256
MAX_SHM_REGIONS = 65536
#: [server] admin_max_model_bytes: the largest model file an admin load may name
DEFAULT_ADMIN_MAX_MODEL_BYTES = 4 << 30
#: endpoints that may be opened to callers without an API key (/healthz always is)
AUTH_OPTIONAL_ENDPOINTS = ("/readyz", "/metrics", "/v2/health/ready")
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_DELAY_US = 2000
DEFAULT_MAX_QUEUE_SIZE = 1024
#: a backend's own [tasks.batching] defaults where its traffic differs from the general ones,
#: applied to a task from a config file and to the backend's default task alike (one default:
#: issue 38 row 9).  vad: every live stream sends a 32 ms chunk, so batches are wide and the
#: queue holds several chunks of each of many streams
BACKEND_BATCHING_DEFAULTS: dict = {"vad": {"max_batch_size": 256, "max_queue_size": 4096}}
MAX_INSTANCES = 64
MAX_PRIORITY_LEVELS = 16
# [tasks.sequence] (stateful tasks, SPEC section 3)
SEQUENCE_STRATEGIES = ("direct", "oldest")
DEFAULT_SEQUENCE_STRATEGY = "direct"
DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000  # Triton's default: 1 s
MAX_SEQUENCE_IDLE_US = 3_600_000_000  # one hour
MAX_SEQUENCE_SLOTS = 65536
CONTROL_KINDS = ("START", "END", "READY", "CORRID")
#: a state or constant input may have any tensor dtype of the metadata contract
STATE_DTYPES = CONSTANT_DTYPES = tuple(DTYPES)
#: START / END / READY controls: the contract dtypes Triton allows for them
CONTROL_DTYPES = tuple(d for d in DTYPES if d in ("fp32", "int32", "bool"))
#: a CORRID control carries the correlation id: int64 (a contract dtype), uint64 or string
#: (their numpy dtypes: contract.CORRID_DTYPES)
CORRID_DTYPES = tuple(CONTRACT_CORRID_DTYPES)
MAX_STATE_RANK = MAX_RANK


#: [tasks.batching] keys the sequence batcher does not use, and what to do instead
SEQUENCE_UNUSED_BATCHING_KEYS = {
    "max_queue_delay_us": "set sequence.max_queue_delay_us",
    "preferred_batch_sizes": "a sequence batch holds one request per ready sequence",
    "priority_levels": "requests of a sequence run in order; priorities do not apply",
    "default_priority_level": "requests of a sequence run in order; priorities do not apply",
}


@dataclass
class ServerConfig:
    host: str = DEFAULT_HOST
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    read_timeout_ms: int = DEFAULT_READ_TIMEOUT_MS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: a request body must arrive within body_timeout_ms of its headers, extended by one
    #: second per body_min_rate bytes received (0: no extension); past it: 408 and close
    body_timeout_ms: int = DEFAULT_BODY_TIMEOUT_MS
    body_min_rate: int = DEFAULT_BODY_MIN_RATE
    #: API keys (Bearer tokens); empty: no authentication.  ``api_key_file`` (one key a line,
    #: ``#`` comments) is read when the server starts and its keys added to these
    api_keys: tuple = ()
    api_key_file: str = ""
    #: keys of the admin API (``/v1/admin``), apart from the inference keys: with any key
    #: configured, the admin API takes only these (an inference key gets 403)
    admin_api_keys: tuple = ()
    #: the folder admin loads may name model files under (empty: the config file's folder)
    model_root: str = ""
    #: the largest model file an admin load may name
    admin_max_model_bytes: int = DEFAULT_ADMIN_MAX_MODEL_BYTES
    #: of AUTH_OPTIONAL_ENDPOINTS, the ones served without a key when keys are on
    open_endpoints: tuple = ()
    #: peers (IP addresses or networks, "*" for any) whose X-Forwarded-For / X-Forwarded-Proto
    #: headers are believed: the address a reverse proxy forwards for becomes the client's (the
    #: access log's ``client``).  Empty (the default): no forwarded header is believed, so a
    #: client cannot forge its address, a local one included
    forwarded_allow_ips: tuple = ()
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: Triton's system shared-memory extension on the /v2 (OIP) routes: local clients register
    #: POSIX shm regions and name them instead of sending bytes (off by default)
    system_shared_memory: bool = False
    #: regions registered at once, over all API keys (each holds one file descriptor)
    shm_max_regions: int = DEFAULT_SHM_MAX_REGIONS
    #: OpenTelemetry spans per request and per batch (``tracing.py``; also ``LUMEN_TRACING=1``)
    tracing: bool = False
    #: the embedding task TEI's own routes serve (``POST /embed``, ``POST /``, ``GET /info``);
    #: empty: the only embedding task, else the first (``serve/tei.py``)
    tei_task: str = ""
    #: the rerank task of TEI's ``POST /rerank`` and of ``POST /v1/rerank`` without a
    #: ``model``; empty: the first rerank task (``serve/rerank.py``)
    rerank_task: str = ""

    def __repr__(self) -> str:  # never print the keys
        secret = ("api_keys", "admin_api_keys")
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if f.name not in secret)
        return (f"ServerConfig({fields}, api_keys=<{len(self.api_keys)} keys>, "
                f"admin_api_keys=<{len(self.admin_api_keys)} keys>)")


#: ``[tasks.batching] loop_execution_us``: batches that run within it run on the event loop
#: (see ``BatchingConfig``).  Handing a batch to a worker thread and back costs the two
#: threads 45-50 us of CPU on a 2-core box (bench/bench_handover.py); up to about twice that
#: the loop saves more than the overlap with the worker would, and the same null batch that
#: takes 14 us in a quiet stretch of that box takes 40-60 us in a noisy one
DEFAULT_LOOP_EXECUTION_US = 100
#: and at most: the loop answers nothing else while a batch runs on it
MAX_LOOP_EXECUTION_US = 1000
#: the largest ``[tasks.batching] latency_target_ms`` (an hour: beyond it, use deadlines)
MAX_LATENCY_TARGET_MS = 3_600_000


@dataclass
class BatchingConfig:
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US
    preferred_batch_sizes: tuple = ()
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    default_timeout_ms: int = 0
    priority_levels: int = 1
    default_priority_level: int = 0  # 0: the lowest level (priority_levels)
    #: end-to-end latency target (ms) of a request inside the server; 0: none (issue 30).
    #: With one, batches are sized so the oldest waiting request is answered within it, and
    #: a request predicted to finish past it (or past its deadline) is refused at admission
    #: with 429 and a Retry-After (a stateful task: only the start of a new sequence)
    latency_target_ms: int = 0
    #: a one-instance dynamic batcher without length-aware formation whose batches run within
    #: this many microseconds (the median of the last 8, on the loop) runs them on the event
    #: loop's own thread instead of handing each to the engine's worker thread: for so small a
    #: model the hand-over costs more CPU than the run (batching/dynamic.py, ``LoopTurn``;
    #: bench/README.md, "loop execution").  0: always the worker.
    loop_execution_us: int = DEFAULT_LOOP_EXECUTION_US


@dataclass(frozen=True)
class StateConfig:
    """One implicit state tensor (``[[tasks.sequence.state]]``).

    ``dims`` are the per-sequence dims (no batch axis); ``batch_axis`` is where the batch axis
    sits in the model's tensor (Silero: ``[2, N, 128]`` -> dims ``[2, 128]``, batch_axis 1).
    ``initial`` is ``"zeros"`` or the path of a ``.npy`` file holding one sequence's state.
    """

    input_name: str
    output_name: str
    dtype: str
    dims: tuple
    batch_axis: int = 0
    initial: str = "zeros"


@dataclass(frozen=True)
class ControlConfig:
    """One control input (``[[tasks.sequence.control]]``): a ``[N]`` tensor the runtime fills."""

    input_name: str
    kind: str  # START | END | READY | CORRID
    dtype: str


@dataclass(frozen=True)
class ConstantConfig:
    """An input that is the same for every batch (``[[tasks.sequence.constant]]``), e.g.
    Silero's scalar ``sr``; ``dims`` is its full shape (``[]`` for a scalar)."""

    input_name: str
    dtype: str
    dims: tuple
    value: Any


@dataclass
class SequenceConfig:
    """``[tasks.sequence]``: the sequence batcher's policy and the model's stateful inputs."""

    strategy: str = DEFAULT_SEQUENCE_STRATEGY
    max_sequence_idle_us: int = DEFAULT_MAX_SEQUENCE_IDLE_US
    max_candidate_sequences: int = 0  # 0: batching.max_batch_size
    max_queue_delay_us: int = 0
    #: with a delay: form a batch early once this fraction of the lane's active sequences
    #: (capped at max_batch_size) has a request ready (1.0: wait for all, up to the delay)
    minimum_slot_utilization: float = 1.0
    state: tuple = ()
    control: tuple = ()
    constant: tuple = ()


@dataclass(frozen=True)
class VersionConfig:
    """One ``[[tasks.versions]]`` entry: a version label and its model file."""

    version: str
    model: str = ""


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


@dataclass(frozen=True)
class CacheConfig:
    """``[tasks.cache]``: the task's response cache (``lumen_core/cache.py``)."""

    max_bytes: int
    ttl_s: float = 0.0  # 0: entries never expire (they are still evicted by bytes)


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


#: the value types an :class:`Option` may declare (``list``: a list of non-empty strings;
#: ``float``: a finite number, an integer accepted)
OPTION_KINDS = (int, float, bool, str, list)


@dataclass(frozen=True)
class Option:
    """One ``[tasks.options]`` key a backend declares (``TaskBackend.options_schema``).

    ``kind`` is ``int``, ``float``, ``bool``, ``str`` or ``list`` (a list of non-empty strings;
    a single string stands for a list of one).  ``lo`` / ``hi`` bound an ``int`` or ``float``; ``choices`` lists the
    values a ``str`` may take; a ``str`` is never empty.  ``default`` is what a task that leaves
    the key out gets (``None``: the backend derives it, e.g. from the model, as ``doc`` says).
    ``doc`` says what the value is, as a noun phrase; error messages quote it.
    """

    name: str
    kind: type
    default: Any
    doc: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    choices: Optional[tuple] = None

    def __post_init__(self) -> None:
        if self.kind not in OPTION_KINDS:
            raise TypeError(f"option {self.name!r}: kind must be one of {OPTION_KINDS}")

    def read(self, r: _Reader) -> Any:
        """The option's value in ``r``'s table (its default when absent), or a ConfigError."""
        r.used.add(self.name)
        if self.name not in r.table:
            return self.default
        v = r.table[self.name]
        if self.kind is int:
            if (isinstance(v, bool) or not isinstance(v, int)
                    or (self.lo is not None and v < self.lo)
                    or (self.hi is not None and v > self.hi)):
                raise r.err(self.name, f"must be an integer{self._range()}, got {v!r}")
        elif self.kind is float:
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or (self.lo is not None and v < self.lo)
                    or (self.hi is not None and v > self.hi)):
                raise r.err(self.name, f"must be a number{self._range()} ({self.doc}), "
                                       f"got {v!r}")
            v = float(v)
        elif self.kind is bool:
            if not isinstance(v, bool):
                raise r.err(self.name, f"must be true or false, got {v!r}")
        elif self.kind is str:
            if not isinstance(v, str) or not v:
                raise r.err(self.name, f"must be a non-empty string ({self.doc}), got {v!r}")
            if self.choices is not None and v not in self.choices:
                raise r.err(self.name, f"must be one of {', '.join(self.choices)} ({self.doc}), "
                                       f"got {v!r}")
        else:
            items = [v] if isinstance(v, str) else v
            if (not isinstance(items, list) or not items
                    or not all(isinstance(x, str) and x for x in items)):
                raise r.err(self.name, f"must be a list of non-empty strings ({self.doc}), "
                                       f"got {v!r}")
            v = tuple(items)
        return v

    def _range(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f" in {self.lo}..{self.hi}"
        if self.lo is not None:
            return f" >= {self.lo}"
        return f" <= {self.hi}" if self.hi is not None else ""


def read_options(task: TaskConfig, schema: Sequence[Option]) -> dict:
    """``task.options`` checked against a backend's declared ``schema``: a new dict holding
    every declared option (defaults filled in).  An undeclared key is a ConfigError naming the
    keys the backend knows; ``task`` itself is not changed."""
    r = _Reader(task.source, f"{task.key}.options", task.options)
    known = [o.name for o in schema]
    unknown = sorted(str(k) for k in r.table if k not in known)
    if unknown:
        if not known:
            raise r.err(unknown[0], f"backend {task.backend!r} takes no options")
        raise r.err(unknown[0], f"unknown option for backend {task.backend!r} "
                                f"(known: {', '.join(known)})")
    return {o.name: o.read(r) for o in schema}


def effective_sequence(configured: Optional[SequenceConfig],
                       declared: Optional[SequenceConfig]) -> Optional[SequenceConfig]:
    """The ``[tasks.sequence]`` a stateful task runs with.

    ``declared`` is what the backend declares for its model (its stateful inputs and policy
    defaults; None when the config must say everything).  No ``[tasks.sequence]`` in the
    config: ``declared``.  A ``[tasks.sequence]`` that declares neither state nor constant
    inputs (only policy, perhaps controls): it, with the declared state and constants.
    Otherwise the configured one, as is.  Never changes either argument.
    """
    if declared is None or (configured is not None and (configured.state or configured.constant)):
        return configured
    if configured is None:
        return declared
    return dataclasses.replace(configured, state=declared.state, constant=declared.constant)


def _parse_device(r: _Reader) -> str:
    dev = r.get("device", str, "cpu")
    if dev == "cpu":
        return dev
    if dev.startswith("cuda:") and dev[5:].isdigit():
        return dev
    raise r.err("device", f"must be 'cpu' or 'cuda:N', got {dev!r}")


def _parse_batching(r: _Reader, backend: str = "") -> BatchingConfig:
    """``[tasks.batching]``; a key left out takes ``backend``'s own default
    (``BACKEND_BATCHING_DEFAULTS``), else the general one."""
    own = BACKEND_BATCHING_DEFAULTS.get(backend, {})
    b = BatchingConfig(
        max_batch_size=r.get("max_batch_size", int,
                             own.get("max_batch_size", DEFAULT_MAX_BATCH_SIZE), lo=1, hi=65536),
        max_queue_delay_us=r.get("max_queue_delay_us", int, DEFAULT_MAX_QUEUE_DELAY_US, lo=0,
                                 hi=60_000_000),
        max_queue_size=r.get("max_queue_size", int,
                             own.get("max_queue_size", DEFAULT_MAX_QUEUE_SIZE), lo=1),
        default_timeout_ms=r.get("default_timeout_ms", int, 0, lo=0),
        priority_levels=r.get("priority_levels", int, 1, lo=1, hi=MAX_PRIORITY_LEVELS),
        latency_target_ms=r.get("latency_target_ms", int, 0, lo=0, hi=MAX_LATENCY_TARGET_MS),
        loop_execution_us=r.get("loop_execution_us", int, DEFAULT_LOOP_EXECUTION_US, lo=0,
                                hi=MAX_LOOP_EXECUTION_US),
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


def _parse_dims(r: _Reader, name: str, allow_empty: bool) -> tuple:
    dims = r.get(name, list, None)
    if dims is None:
        raise r.err(name, "is required (a list of non-negative integers)")
    if len(dims) > MAX_STATE_RANK or (not dims and not allow_empty):
        raise r.err(name, f"must list 1..{MAX_STATE_RANK} dimensions, got {dims!r}")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise r.err(name, f"must be non-negative integers (variable-size state dims are "
                              f"not supported), got {dims!r}")
    return tuple(dims)


def _parse_state(r: _Reader, base_dir: Optional[str]) -> StateConfig:
    dims = _parse_dims(r, "dims", allow_empty=True)
    initial = r.get("initial", str, "zeros")
    if not initial:
        raise r.err("initial", "must be 'zeros' or the path of a .npy file")
    if initial != "zeros":
        initial = _resolve_model(initial, base_dir)
        if not os.path.isfile(initial):
            raise r.err("initial", f"must be 'zeros' or an existing .npy file; no such file: {initial}")
    st = StateConfig(
        input_name=_required_str(r, "input_name"),
        output_name=_required_str(r, "output_name"),
        dtype=r.get("dtype", str, "fp32", choices=STATE_DTYPES),
        dims=dims,
        batch_axis=r.get("batch_axis", int, 0, lo=0, hi=len(dims)),
        initial=initial,
    )
    r.finish()
    return st


def _parse_control(r: _Reader) -> ControlConfig:
    name = _required_str(r, "input_name")
    kind = r.get("kind", str, "", choices=CONTROL_KINDS)
    if not kind:
        raise r.err("kind", f"is required (one of {', '.join(CONTROL_KINDS)})")
    allowed = CORRID_DTYPES if kind == "CORRID" else CONTROL_DTYPES
    dtype = r.get("dtype", str, "", choices=allowed)
    if not dtype:
        raise r.err("dtype", f"is required for a {kind} control (one of {', '.join(allowed)})")
    r.finish()
    return ControlConfig(name, kind, dtype)


def _parse_constant(r: _Reader) -> ConstantConfig:
    name = _required_str(r, "input_name")
    dtype = r.get("dtype", str, "", choices=CONSTANT_DTYPES)
    if not dtype:
        raise r.err("dtype", f"is required (one of {', '.join(CONSTANT_DTYPES)})")
    dims = _parse_dims(r, "dims", allow_empty=True) if "dims" in r.table else ()
    r.used.add("dims")
    if "value" not in r.table:
        raise r.err("value", "is required (a number, or a nested list matching dims)")
    value = r.get("value", object, None)
    try:
        arr = np.array(value, dtype=DTYPES[dtype])
    except (TypeError, ValueError, OverflowError) as exc:
        raise r.err("value", f"is not a valid {dtype} value: {exc}") from None
    if arr.ndim == 0 and dims:
        arr = np.full(dims, arr, dtype=arr.dtype)
    if arr.shape != dims:
        raise r.err("value", f"has shape {list(arr.shape)}, dims say {list(dims)}")
    r.finish()
    return ConstantConfig(name, dtype, dims, arr)


def _required_str(r: _Reader, name: str) -> str:
    v = r.get(name, str, "")
    if not v:
        raise r.err(name, "is required (a model input/output name)")
    return v


def _parse_sequence(r: _Reader, batching: BatchingConfig, base_dir: Optional[str]) -> SequenceConfig:
    sc = SequenceConfig(
        strategy=r.get("strategy", str, DEFAULT_SEQUENCE_STRATEGY, choices=SEQUENCE_STRATEGIES),
        max_sequence_idle_us=r.get("max_sequence_idle_us", int, DEFAULT_MAX_SEQUENCE_IDLE_US,
                                   lo=1000, hi=MAX_SEQUENCE_IDLE_US),
        max_candidate_sequences=r.get("max_candidate_sequences", int, 0, lo=0,
                                      hi=MAX_SEQUENCE_SLOTS),
        max_queue_delay_us=r.get("max_queue_delay_us", int, 0, lo=0, hi=60_000_000),
    )
    util = r.get("minimum_slot_utilization", object, 1.0)
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
        raise r.err("minimum_slot_utilization", f"must be a number in (0, 1], got {util!r}")
    sc.minimum_slot_utilization = float(util)
    if sc.strategy == "oldest" and sc.max_candidate_sequences and \
            sc.max_candidate_sequences < batching.max_batch_size:
        raise r.err("max_candidate_sequences",
                    f"must be >= batching.max_batch_size ({batching.max_batch_size}) so a full "
                    f"batch can form, got {sc.max_candidate_sequences}")
    inputs: dict = {}
    for section, parse in (("state", lambda t: _parse_state(t, base_dir)),
                           ("control", _parse_control), ("constant", _parse_constant)):
        tables = r.get(section, list, [])
        parsed = []
        for i, t in enumerate(tables):
            sub = _Reader(r.source, f"{r.key(section)}[{i}]", t)
            item = parse(sub)
            if item.input_name in inputs:
                raise sub.err("input_name", f"input {item.input_name!r} is already declared "
                                            f"by {inputs[item.input_name]}")
            inputs[item.input_name] = f"{r.key(section)}[{i}]"
            parsed.append(item)
        setattr(sc, section, tuple(parsed))
    kinds = [c.kind for c in sc.control]
    for k in CONTROL_KINDS:
        if kinds.count(k) > 1:
            raise r.err("control", f"declares the {k} control {kinds.count(k)} times")
    r.finish()
    return sc


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
        raise r.err("backend", "is required (onnx, text_embedding, rerank, vad, "
                               "image_embedding, ...)")
    cfg = TaskConfig(name=name, backend=backend, source=source, key=key)
    cfg.model = _resolve_model(r.get("model", str, ""), base_dir)
    cfg.model_id = r.get("model_id", str, "")
    cfg.model_version = r.get("model_version", str, "1")
    cfg.device = _parse_device(r)
    cfg.instances = r.get("instances", int, 1, lo=1, hi=MAX_INSTANCES)
    cfg.intra_op_threads = r.get("intra_op_threads", int, 0, lo=0, hi=1024)
    cfg.allow_spinning = r.get("allow_spinning", bool, None)
    cfg.batching = _parse_batching(r.sub("batching"), backend)
    cfg.options = r.get("options", dict, {})
    if "sequence" in r.table:
        cfg.sequence = _parse_sequence(r.sub("sequence"), cfg.batching, base_dir)
        batching = r.table.get("batching", {})
        for name, instead in SEQUENCE_UNUSED_BATCHING_KEYS.items():
            if name in batching:
                raise ConfigError(source, f"{key}.batching.{name}",
                                  f"is not used by a stateful task (it has [tasks.sequence]); "
                                  f"{instead}")
    else:
        r.used.add("sequence")
    _parse_versions(r, cfg, base_dir)
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


def _parse_versions(r: _Reader, cfg: TaskConfig, base_dir: Optional[str]) -> None:
    """``[[tasks.versions]]`` and ``[tasks.traffic]`` into ``cfg`` (SPEC section 6)."""
    tables = r.get("versions", list, [])
    if tables and ("model" in r.table or "model_version" in r.table):
        raise r.err("versions", "a task with [[tasks.versions]] names its models there; "
                                "remove its model / model_version keys")
    versions: list = []
    for i, t in enumerate(tables):
        sub = _Reader(r.source, f"{r.key('versions')}[{i}]", t)
        label = sub.get("version", str, "")
        if not label:
            raise sub.err("version", "is required (a non-empty version label, e.g. \"2\")")
        if any(v.version == label for v in versions):
            raise sub.err("version", f"version {label!r} is listed twice")
        versions.append(VersionConfig(label, _resolve_model(sub.get("model", str, ""), base_dir)))
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


#: bounds of [tasks.cache] (1 TiB, 30 days)
MAX_CACHE_BYTES = 1 << 40
MAX_CACHE_TTL_S = 30 * 24 * 3600


def _parse_cache(r: _Reader) -> CacheConfig:
    if "max_bytes" not in r.table:
        raise r.err("max_bytes", "is required: the cache's size bound in bytes, e.g. 67108864")
    max_bytes = r.get("max_bytes", int, 0, lo=1, hi=MAX_CACHE_BYTES)
    r.used.add("ttl_s")
    ttl = r.table.get("ttl_s", 0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0 <= ttl <= MAX_CACHE_TTL_S:
        raise r.err("ttl_s", f"must be a number of seconds in 0..{MAX_CACHE_TTL_S} "
                             f"(0: no expiry), got {ttl!r}")
    r.finish()
    return CacheConfig(max_bytes, float(ttl))


def _string_list(r: _Reader, name: str, choices: Optional[tuple] = None) -> list:
    items = r.get(name, list, [])
    for v in items:
        if not isinstance(v, str) or not v:
            raise r.err(name, f"must be an array of non-empty strings, got {v!r}")
        if choices is not None and v not in choices:
            raise r.err(name, f"entries must be among {', '.join(choices)}, got {v!r}")
    return items


def _parse_api_keys(r: _Reader, name: str = "api_keys") -> tuple:
    keys = _string_list(r, name)
    for i, k in enumerate(keys):
        if k != k.strip() or not k.isprintable() or not k.isascii():
            # a key is a header value: no whitespace at the ends, printable ASCII (never echoed)
            raise r.err(name, f"entry {i} must be printable ASCII without surrounding "
                              f"whitespace")
    return tuple(keys)


def _parse_networks(r: _Reader, name: str) -> tuple:
    """IP addresses or networks (``10.0.0.0/8``), or ``"*"`` for any."""
    import ipaddress

    items = _string_list(r, name)
    for v in items:
        if v == "*":
            continue
        try:
            ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise r.err(name, f"entries must be IP addresses, networks such as '10.0.0.0/8' or "
                              f"'*', got {v!r}") from None
    return tuple(items)


def _server_path(r: _Reader, name: str, base_dir: Optional[str]) -> str:
    path = r.get(name, str, "")
    if path and base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return path


def parse_config(data: Mapping, source: str = "<dict>", base_dir: Optional[str] = None) -> LumenConfig:
    root = _Reader(source, "", data)
    srv = root.sub("server")
    server = ServerConfig(
        host=srv.get("host", str, DEFAULT_HOST),
        http_port=srv.get("http_port", int, DEFAULT_HTTP_PORT, lo=0, hi=65535),
        grpc_port=srv.get("grpc_port", int, DEFAULT_GRPC_PORT, lo=0, hi=65535),
        max_payload_bytes=srv.get("max_payload_bytes", int, DEFAULT_MAX_PAYLOAD_BYTES, lo=1),
        max_header_bytes=srv.get("max_header_bytes", int, DEFAULT_MAX_HEADER_BYTES, lo=1024),
        read_timeout_ms=srv.get("read_timeout_ms", int, DEFAULT_READ_TIMEOUT_MS, lo=1),
        max_connections=srv.get("max_connections", int, DEFAULT_MAX_CONNECTIONS, lo=1),
        body_timeout_ms=srv.get("body_timeout_ms", int, DEFAULT_BODY_TIMEOUT_MS, lo=1),
        body_min_rate=srv.get("body_min_rate", int, DEFAULT_BODY_MIN_RATE, lo=0),
        api_keys=_parse_api_keys(srv),
        api_key_file=_server_path(srv, "api_key_file", base_dir),
        admin_api_keys=_parse_api_keys(srv, "admin_api_keys"),
        model_root=_server_path(srv, "model_root", base_dir),
        admin_max_model_bytes=srv.get("admin_max_model_bytes", int,
                                      DEFAULT_ADMIN_MAX_MODEL_BYTES, lo=1),
        open_endpoints=tuple(_string_list(srv, "open_endpoints", AUTH_OPTIONAL_ENDPOINTS)),
        forwarded_allow_ips=_parse_networks(srv, "forwarded_allow_ips"),
        tls_cert_file=_server_path(srv, "tls_cert_file", base_dir),
        tls_key_file=_server_path(srv, "tls_key_file", base_dir),
        system_shared_memory=srv.get("system_shared_memory", bool, False),
        shm_max_regions=srv.get("shm_max_regions", int, DEFAULT_SHM_MAX_REGIONS, lo=1,
                                hi=MAX_SHM_REGIONS),
        tracing=srv.get("tracing", bool, False),
        tei_task=srv.get("tei_task", str, ""),
        rerank_task=srv.get("rerank_task", str, ""),
    )
    if set(server.admin_api_keys) & set(server.api_keys):
        raise srv.err("admin_api_keys", "a key may not be both an inference key (api_keys) and "
                                        "an admin key; give the admin API keys of its own")
    if bool(server.tls_cert_file) != bool(server.tls_key_file):
        missing = "tls_key_file" if server.tls_cert_file else "tls_cert_file"
        raise srv.err(missing, "TLS needs both tls_cert_file and tls_key_file")
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
    for key in ("tei_task", "rerank_task"):  # the routes that serve one task name one
        named = getattr(server, key)
        if named and tasks and named not in seen:
            raise ConfigError(source, f"server.{key}",
                              f"names no configured task: {named!r} (tasks: "
                              f"{', '.join(sorted(seen))})")
    root.finish()
    return LumenConfig(server=server, tasks=tasks, source=source)


def model_root(cfg: LumenConfig) -> str:
    """The folder admin loads may name model files under: ``[server] model_root``, else the
    folder of the config file the runtime came from ("" when it came from no file: then an
    admin load may name no path)."""
    if cfg.server.model_root:
        return cfg.server.model_root
    src = cfg.source
    if src and not src.startswith("<") and os.path.isfile(src):
        return os.path.dirname(os.path.abspath(src))
    return ""


def read_toml(path: str) -> dict:
    """The TOML table of a config file; a missing file or bad syntax is a ConfigError."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, "<file>", "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "<syntax>", str(exc)) from None


def load_config(path: str) -> LumenConfig:
    return parse_config(read_toml(path), source=path,
                        base_dir=os.path.dirname(os.path.abspath(path)))

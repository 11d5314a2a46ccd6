"""``[tasks.sequence]``: a stateful task's sequence-batcher policy and its model's stateful
inputs (``[[tasks.sequence.state]]``, ``.control``, ``.constant``: SPEC section 3).

The policy keys are declared once, as :func:`~.schema.setting` fields of
:class:`SequenceConfig`; the input tables are parsed by hand (each is a list of small records
whose checks depend on one another: dims, dtype, value).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..contract import CORRID_DTYPES as CONTRACT_CORRID_DTYPES
from ..contract import DTYPES, MAX_RANK
from ..errors import ConfigError
from .batching import BatchingConfig
from .schema import Reader, default_of, read_settings, resolve_path, setting

SEQUENCE_STRATEGIES = ("direct", "oldest")
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


def _utilization(r: Reader, name: str, util: Any, _values: dict) -> float:
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
        raise r.err(name, f"must be a number in (0, 1], got {util!r}")
    return float(util)


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
    """``[tasks.sequence]``: the sequence batcher's policy (one :func:`~.schema.setting` field
    per key) and the model's stateful inputs."""

    strategy: str = setting("direct", "how ready sequences are batched: one slot per "
                                      "sequence, or the oldest requests of many",
                            choices=SEQUENCE_STRATEGIES)
    max_sequence_idle_us: int = setting(1_000_000, "a sequence with no request for this long "
                                                   "is ended and its slot freed (Triton's "
                                                   "default: 1 s)", lo=1000,
                                        hi=MAX_SEQUENCE_IDLE_US)
    max_candidate_sequences: int = setting(0, "sequences the oldest strategy keeps open at "
                                              "once (0: batching.max_batch_size)", lo=0,
                                           hi=MAX_SEQUENCE_SLOTS)
    max_queue_delay_us: int = setting(0, "how long a batch waits for more sequences to have a "
                                         "request ready", lo=0, hi=60_000_000)
    #: with a delay: form a batch early once this fraction of the lane's active sequences
    #: (capped at max_batch_size) has a request ready (1.0: wait for all, up to the delay)
    minimum_slot_utilization: float = setting(1.0, "with a delay: form a batch early once "
                                                   "this share of the active sequences has a "
                                                   "request ready", kind=object,
                                              check=_utilization, kind_doc="number",
                                              default_doc="`1.0`", range_doc="(0, 1]")
    state: tuple = ()
    control: tuple = ()
    constant: tuple = ()


DEFAULT_SEQUENCE_STRATEGY: str = default_of(SequenceConfig, "strategy")
DEFAULT_MAX_SEQUENCE_IDLE_US: int = default_of(SequenceConfig, "max_sequence_idle_us")


def _parse_dims(r: Reader, name: str, allow_empty: bool) -> tuple:
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


def _parse_state(r: Reader, base_dir: Optional[str]) -> StateConfig:
    dims = _parse_dims(r, "dims", allow_empty=True)
    initial = r.get("initial", str, "zeros")
    if not initial:
        raise r.err("initial", "must be 'zeros' or the path of a .npy file")
    if initial != "zeros":
        initial = resolve_path(initial, base_dir)
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


def _parse_control(r: Reader) -> ControlConfig:
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


def _parse_constant(r: Reader) -> ConstantConfig:
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


def _required_str(r: Reader, name: str) -> str:
    v = r.get(name, str, "")
    if not v:
        raise r.err(name, "is required (a model input/output name)")
    return v


def parse_sequence(r: Reader, batching: BatchingConfig) -> SequenceConfig:
    """``[tasks.sequence]``: the declared policy keys, then the stateful input tables."""
    sc = SequenceConfig(**read_settings(r, SequenceConfig))
    if sc.strategy == "oldest" and sc.max_candidate_sequences and \
            sc.max_candidate_sequences < batching.max_batch_size:
        raise r.err("max_candidate_sequences",
                    f"must be >= batching.max_batch_size ({batching.max_batch_size}) so a full "
                    f"batch can form, got {sc.max_candidate_sequences}")
    inputs: dict = {}
    for section, parse in (("state", lambda t: _parse_state(t, r.base_dir)),
                           ("control", _parse_control), ("constant", _parse_constant)):
        tables = r.get(section, list, [])
        parsed = []
        for i, t in enumerate(tables):
            sub = Reader(r.source, f"{r.key(section)}[{i}]", t, r.base_dir)
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


def check_unused_batching(r: Reader, key: str) -> None:
    """A stateful task's ``[tasks.batching]`` may not set what the sequence batcher ignores."""
    batching = r.table.get("batching", {})
    for name, instead in SEQUENCE_UNUSED_BATCHING_KEYS.items():
        if name in batching:
            raise ConfigError(r.source, f"{key}.batching.{name}",
                              f"is not used by a stateful task (it has [tasks.sequence]); "
                              f"{instead}")


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



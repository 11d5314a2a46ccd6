"""``[tasks.batching]``: the dynamic batcher's policy of one task.

Each key is declared once, as a :func:`~.schema.setting` field of :class:`BatchingConfig`; the
``DEFAULT_*`` constants other modules import are read back from those declarations.
"""
from __future__ import annotations

from dataclasses import dataclass

from .schema import Reader, default_of, read_settings, setting

MAX_PRIORITY_LEVELS = 16
#: ``loop_execution_us`` at most: the loop answers nothing else while a batch runs on it
MAX_LOOP_EXECUTION_US = 1000
#: the largest ``latency_target_ms`` (an hour: beyond it, use deadlines)
MAX_LATENCY_TARGET_MS = 3_600_000
#: a backend's own [tasks.batching] defaults where its traffic differs from the general ones,
#: applied to a task from a config file and to the backend's default task alike (one default:
#: issue 38 row 9).  vad: every live stream sends a 32 ms chunk, so batches are wide and the
#: queue holds several chunks of each of many streams
BACKEND_BATCHING_DEFAULTS: dict = {"vad": {"max_batch_size": 256, "max_queue_size": 4096}}


def _preferred(r: Reader, name: str, sizes: list, values: dict) -> tuple:
    top = values["max_batch_size"]
    for p in sizes:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= top:
            raise r.err(name, f"entries must be integers in 1..max_batch_size ({top}), got {p!r}")
    return tuple(sorted(set(sizes)))


@dataclass
class BatchingConfig:
    """``[tasks.batching]``: one field per key (the field's :func:`~.schema.setting`)."""

    max_batch_size: int = setting(32, "the most requests (rows) in one batch (a vad task: 256)",
                                  lo=1, hi=65536)
    max_queue_delay_us: int = setting(2000, "how long the oldest request may wait for company "
                                            "before its batch runs", lo=0, hi=60_000_000)
    preferred_batch_sizes: tuple = setting((), "batch sizes to form when the queue allows "
                                               "(each in 1..max_batch_size)", check=_preferred,
                                           kind_doc="array of integers")
    max_queue_size: int = setting(1024, "requests waiting at once; past it: 429 at once (a vad "
                                        "task: 4096)", lo=1)
    default_timeout_ms: int = setting(0, "the task's request timeout; a request's "
                                         "lumen.timeout_ms may only tighten it (0: none)", lo=0)
    priority_levels: int = setting(1, "priority levels (a request's lumen.priority: 1 = highest)", lo=1,
                                   hi=MAX_PRIORITY_LEVELS)
    default_priority_level: int = setting(0, "the level of a request that names none (0: the "
                                             "lowest, priority_levels)", lo=0,
                                          hi="priority_levels")
    #: end-to-end latency target (ms) of a request inside the server; 0: none (issue 30).
    #: With one, batches are sized so the oldest waiting request is answered within it, and
    #: a request predicted to finish past it (or past its deadline) is refused at admission
    #: with 429 and a Retry-After (a stateful task: only the start of a new sequence)
    latency_target_ms: int = setting(0, "end-to-end latency target inside the server (0: "
                                        "none); see docs/latency.md", lo=0,
                                     hi=MAX_LATENCY_TARGET_MS)
    #: a one-instance dynamic batcher without length-aware formation whose batches run within
    #: this many microseconds (the median of the last 8, on the loop) runs them on the event
    #: loop's own thread instead of handing each to the engine's worker thread: for so small a
    #: model the hand-over costs more CPU than the run (batching/dynamic.py, ``LoopTurn``;
    #: bench/bench_handover.py prices the hand-over).  0: always the worker.
    loop_execution_us: int = setting(100, "batches this cheap run on the event loop instead "
                                          "of a worker thread (0: never)", lo=0,
                                     hi=MAX_LOOP_EXECUTION_US)


#: the declared defaults, by the names other modules import
DEFAULT_MAX_BATCH_SIZE: int = default_of(BatchingConfig, "max_batch_size")
DEFAULT_MAX_QUEUE_DELAY_US: int = default_of(BatchingConfig, "max_queue_delay_us")
DEFAULT_MAX_QUEUE_SIZE: int = default_of(BatchingConfig, "max_queue_size")
DEFAULT_LOOP_EXECUTION_US: int = default_of(BatchingConfig, "loop_execution_us")


def parse_batching(r: Reader, backend: str = "") -> BatchingConfig:
    """``[tasks.batching]``; a key left out takes ``backend``'s own default
    (``BACKEND_BATCHING_DEFAULTS``), else the declared one."""
    own = BACKEND_BATCHING_DEFAULTS.get(backend, {})
    b = BatchingConfig(**read_settings(r, BatchingConfig, own))
    r.finish()
    return b

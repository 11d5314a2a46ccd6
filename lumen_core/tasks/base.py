"""The task backend interface.

A backend turns requests of one task into :class:`PreparedModelRequest` objects (raw route:
decode + preprocess; tensor route: the validated descriptor) and turns its slice of a batch
output into the task's outputs.  It declares a :class:`TensorContract` and a :class:`ModelSpec`;
it never sees queues, threads or ORT sessions.

Configuration: a backend declares the ``[tasks.options]`` it takes (``options_schema``, read
and checked by :func:`lumen_core.config.read_options` into ``self.options``) and, if stateful,
the stateful inputs its model needs by default (``declared_sequence``, merged by
:func:`lumen_core.config.effective_sequence` into ``self.sequence``).  It never writes to its
:class:`TaskConfig`.
"""
from __future__ import annotations

import abc
import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .. import native
from ..config import Option, SequenceConfig, TaskConfig, effective_sequence, read_options
from ..contract import TensorContract
from ..engine.plan import ModelSpec, PreparedModelRequest
from ..errors import InternalError, InvalidArgument, UnsupportedMediaType
from ..request import InferRequest
from ..request_path.descriptor import Descriptor

#: float32, whose outputs the compiled finite scan checks (``split_outputs``)
_F32 = np.dtype(np.float32)


def mime_type(mime: str) -> tuple:
    """Split ``type/subtype; k=v; ...`` into (lower-cased type, {param: value})."""
    base, _, rest = (mime or "").partition(";")
    params = {}
    for part in rest.split(";"):
        k, sep, v = part.partition("=")
        if sep:
            params[k.strip().lower()] = v.strip().strip('"')
    return base.strip().lower(), params


class TaskBackend(abc.ABC):
    """Base class of task backends.  Subclasses set ``raw_mimes`` and implement the hooks."""

    #: accepted raw mime types (base types, lower case); empty: no raw route
    raw_mimes: tuple = ()
    #: True: ``prepare`` is CPU-heavy (image decode) and runs in a worker thread
    prepare_off_loop: bool = False
    #: True for stateful tasks served by the sequence batcher
    stateful: bool = False
    #: raw payloads larger than this are prepared in a worker thread even when
    #: ``prepare_off_loop`` is False: cheap inputs stay on the loop, huge ones cannot stall it
    inline_prepare_max_bytes: int = sys.maxsize
    #: True: the raw route also takes the payload as a ``str`` (text tasks; no encode/decode)
    accepts_text: bool = False
    #: the ``[tasks.options]`` keys this backend takes; any other key is a config error
    options_schema: tuple[Option, ...] = ()
    #: the raw media types as a client writes them, parameters included (what ``/v1/tasks``
    #: lists and a 415 names); empty: ``raw_mimes`` are accepted as they are
    raw_mimes_written: tuple = ()
    #: the request options this task reads beyond the ``lumen.*`` keys every task takes:
    #: ``{meta key: what it does}``, plain names (``normalize``) and the task's own
    #: ``lumen.*`` keys; the native HTTP route refuses any other plain key, so a typo is a
    #: 400 instead of an option silently ignored
    request_options: Mapping[str, str] = {}

    def __init__(self, config: TaskConfig):
        self.config = config
        self.name = config.name
        #: ``[tasks.options]`` checked against ``options_schema``, every default filled in
        self.options: dict = read_options(config, self.options_schema)
        #: the ``[tasks.sequence]`` the task runs with: the config's, completed by
        #: ``declared_sequence`` (None for a stateless task configured without one)
        self.sequence: Optional[SequenceConfig] = effective_sequence(config.sequence,
                                                                     self.declared_sequence())
        self.contract: TensorContract = TensorContract()
        self.model: Optional[ModelSpec] = None

    def declared_sequence(self) -> Optional[SequenceConfig]:
        """Stateful backends: the stateful inputs (state, constants) the model needs, used when
        the config declares none of them.  None: the config must declare them."""
        return None

    # -- lifecycle --------------------------------------------------------------------------
    @abc.abstractmethod
    def load(self) -> ModelSpec:
        """Resolve model files, read model metadata, set ``self.contract``; return the plan."""

    def warmup_requests(self) -> list:
        """Requests the runtime pushes through the whole path at start-up."""
        return []

    def steps(self) -> Optional[list]:
        """An ensemble's steps (``batching.pipeline.StepSpec``s; its ``flow`` coroutine runs a
        request through them), or None for a single model (the default)."""
        return None

    async def flow(self, ctx: Any, item: Any) -> Any:
        """An ensemble's flow: one request through its steps (``ctx.run(step, items)``);
        only backends whose :meth:`steps` are not None have one."""
        raise NotImplementedError(f"backend {type(self).__name__} is not an ensemble")

    def batching_options(self) -> dict:
        """Extra keyword arguments for the task's ``DynamicBatcher`` (e.g. ``max_batch_tokens``
        for ragged inputs); read once at load."""
        return {}

    # -- request path -----------------------------------------------------------------------
    def prepare(self, req: InferRequest, desc: Descriptor, payload: memoryview) -> PreparedModelRequest:
        if desc.kind == "tensor":
            return self.prepare_tensor(req, desc, payload)
        if not self.raw_mimes:
            raise InvalidArgument(
                f"task {self.name!r} has no raw route; send a tensor with lumen.input.kind=tensor",
                "lumen.input.kind")
        if req.payload_mime is not None and not isinstance(req.payload_mime, str):
            raise UnsupportedMediaType(f"payload_mime must be a string such as "
                                       f"{self.raw_mimes[0]!r}, got "
                                       f"{type(req.payload_mime).__name__}", "payload_mime")
        base, params = mime_type(req.payload_mime)
        if base not in self.raw_mimes:
            raise UnsupportedMediaType(
                f"task {self.name!r} accepts {', '.join(self.accepted_mimes())} (or a tensor), "
                f"not {req.payload_mime!r}", "payload_mime")
        return self.prepare_raw(req, desc, payload, base, params)

    def prepare_raw(self, req: InferRequest, desc: Descriptor, payload: memoryview, mime: str,
                    params: dict) -> PreparedModelRequest:
        raise InternalError(f"backend {type(self).__name__} declares raw mimes "
                            f"{self.raw_mimes} but does not implement prepare_raw")

    @abc.abstractmethod
    def prepare_tensor(self, req: InferRequest, desc: Descriptor,
                       payload: memoryview) -> PreparedModelRequest:
        """Turn a validated tensor (``desc``) into a prepared request."""

    def postprocess(self, outputs: dict, items: Sequence[PreparedModelRequest]) -> list:
        """Per item: ``{name: ndarray}`` or a LumenError.  Runs in the engine's worker thread.

        Default: views of every fetched output, refused when not finite.
        """
        return split_outputs(outputs, len(items))

    def accepted_mimes(self) -> tuple:
        """The raw media types as a client writes them (``raw_mimes_written``, else
        ``raw_mimes``)."""
        return self.raw_mimes_written or self.raw_mimes

    def describe(self) -> dict:
        return {"name": self.name, "backend": self.config.backend,
                "raw_mimes": list(self.accepted_mimes()), "stateful": self.stateful,
                "request_options": dict(self.request_options),
                **self.contract.describe()}


def split_outputs(outputs: dict, n: int, rename: Optional[dict] = None) -> Any:
    """A batch's outputs as its items' results, split once for the whole batch: a
    ``entries.Rows`` (item ``i``'s result is row ``i`` of every output, made when read) when
    every row is finite, else one result per item, a non-finite item an ``InternalError``.
    ``rename`` maps output names to result names."""
    arrays = {(rename or {}).get(k, k): v for k, v in outputs.items()} if rename else outputs
    bad = None
    for arr in outputs.values():
        if arr.dtype.kind != "f":
            continue
        # one pass, rows only on a miss; a float32 output is checked by the compiled scan,
        # which keeps the GIL (numpy's isfinite gives it up past 500 elements, and the
        # worker then waits for the loop to hand it back: bench/bench_handover.py measures that
        # hand-over; bench/HISTORY.md, round 3)
        if arr.dtype == _F32 and arr.flags.c_contiguous:
            if native.assemble.first_non_finite(arr) < 0:
                continue
        elif np.isfinite(arr).all():
            continue
        flat = arr.reshape(arr.shape[0], -1)[:n]
        ok = np.isfinite(flat).all(axis=1)
        if not ok.all():
            bad = ~ok if bad is None else bad | ~ok
    rows = native.entries.Rows(arrays, n)
    if bad is None:
        return rows
    return [InternalError("the model produced a non-finite value (NaN or inf) for this input; "
                          "the result was withheld") if bad[i] else rows.row(i) for i in range(n)]

"""Plan entries of stateful models: implicit state, control inputs, context windows.

The sequence batcher pins every sequence to a *slot* of one engine instance.  Each instance
owns a :class:`SlotStore`: one array per stateful input with a slot axis where the model has
its batch axis (Silero's state ``[2, slots, 128]``).  A batch is a :class:`SequenceBatch`: the
prepared requests plus per-row arrays (slot index, START/END flags, correlation ids).  Plan
entries then work on whole batches with numpy fancy indexing:

- gather: ``np.take(store, slots, axis=batch_axis, out=arena_buffer)``;
- reset of starting rows: one masked assignment of the initial value;
- scatter after the run: ``store[..., slots, ...] = output_state``.

No Python loop over the requests of a batch touches state.  Everything here runs in the
instance's single worker thread, so stores need no locks; the event loop only ever hands out
and takes back slot *numbers*.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..config import ConstantConfig, ControlConfig, SequenceConfig, StateConfig
from ..contract import CORRID_DTYPES, DTYPES
from ..errors import ConfigError
from .plan import ConstantInput, InputPlan, OutputSpec

#: dtypes of CORRID controls beyond the contract's tensor dtypes
CORRID_NUMPY = CORRID_DTYPES


class SequenceBatch(list):
    """A batch of prepared requests plus the per-row sequence bookkeeping.

    ``slots`` (intp), ``start``, ``end`` (bool) are numpy arrays with one entry per row;
    ``corrid`` is a list (ints or strings) or None when no CORRID control is declared;
    ``store`` is the instance's :class:`SlotStore`.  Slicing keeps all of it aligned, so the
    split-and-retry path (``run_split``) works on halves unchanged.
    """

    def __init__(self, items: Sequence[Any], slots: np.ndarray, start: np.ndarray,
                 end: np.ndarray, corrid: Optional[list], store: "SlotStore"):
        super().__init__(items)
        self.slots = slots
        self.start = start
        self.end = end
        self.corrid = corrid
        self.store = store
        #: assembled inputs of this run, kept for ``commit`` (e.g. a context window's tail)
        self.feeds: dict = {}

    def __getitem__(self, index):
        if isinstance(index, slice):
            return SequenceBatch(list.__getitem__(self, index), self.slots[index],
                                 self.start[index], self.end[index],
                                 None if self.corrid is None else self.corrid[index], self.store)
        return list.__getitem__(self, index)


class SlotStore:
    """Per-instance state of every slot: ``{name: ndarray}`` with a slot axis."""

    def __init__(self, capacity: int, plans: Sequence[InputPlan]):
        self.capacity = capacity
        self.arrays: dict = {}
        for p in plans:
            if isinstance(p, StatefulPlan):
                self.arrays[p.name] = p.new_store(capacity)


class StatefulPlan(InputPlan):
    """A plan entry that reads per-slot state and writes it back after a successful run."""

    @abc.abstractmethod
    def new_store(self, capacity: int) -> np.ndarray:
        """The per-slot store this entry keeps for ``capacity`` slots."""

    @abc.abstractmethod
    def commit(self, batch: SequenceBatch, outputs: dict) -> None:
        """After a successful run: write this batch's new state into its slots."""


def _axis_index(axis: int, index: Any) -> tuple:
    return (slice(None),) * axis + (index,)


@dataclass(frozen=True, eq=False)
class StateInput(StatefulPlan):
    """Implicit state: input ``name`` of request i+1 is output ``output_name`` of request i.

    ``dims`` are one sequence's dims; the model sees them with the batch inserted at
    ``batch_axis``.  ``initial`` (shape ``dims``) is what a starting sequence begins with.
    """

    name: str
    output_name: str
    dtype: Any
    dims: tuple
    batch_axis: int
    initial: np.ndarray = field(repr=False)

    def new_store(self, capacity: int) -> np.ndarray:
        shape = self.dims[:self.batch_axis] + (capacity,) + self.dims[self.batch_axis:]
        store = np.empty(shape, dtype=self.dtype)
        store[...] = np.expand_dims(self.initial, self.batch_axis)
        return store

    # a sequence plan takes only its batcher's SequenceBatch (the items with their slots)
    def assemble(self, items: SequenceBatch, arena, stats) -> dict:  # type: ignore[override]
        axis = self.batch_axis
        shape = self.dims[:axis] + (len(items),) + self.dims[axis:]
        buf = arena.get(self.name, shape, self.dtype)
        np.take(items.store.arrays[self.name], items.slots, axis=axis, out=buf, mode="clip")
        if items.start.any():
            buf[_axis_index(axis, items.start)] = np.expand_dims(self.initial, axis)
        return {self.name: buf}

    def output_spec(self) -> OutputSpec:
        """The state output, bound by the engine with the batch at ``batch_axis``: ORT writes
        it once and :meth:`commit` scatters it into the slots once."""
        return OutputSpec(self.output_name, self.dtype, tuple(self.dims), self.batch_axis)

    def commit(self, batch: SequenceBatch, outputs: dict) -> None:
        out = outputs[self.output_name]
        axis = self.batch_axis
        want = self.dims[:axis] + (len(batch),) + self.dims[axis:]
        if out.shape != want:
            raise ValueError(f"state output {self.output_name!r} has shape {list(out.shape)}, "
                             f"the declared state needs {list(want)}")
        batch.store.arrays[self.name][_axis_index(axis, batch.slots)] = out


@dataclass(frozen=True, eq=False)
class ContextInput(StatefulPlan):
    """A window input ``[N, context + chunk]``: the last ``context`` values of the sequence's
    previous chunk (zeros at the start) followed by this request's ``chunk`` values.

    Silero VAD v5 is fed this way (64 + 512 samples); the runtime keeps the tail per slot so
    a stream's client sends only its new 512 samples.
    """

    name: str
    dtype: Any
    chunk: int
    context: int
    slot: int = 0

    def new_store(self, capacity: int) -> np.ndarray:
        return np.zeros((capacity, self.context), dtype=self.dtype)

    # a sequence plan takes only its batcher's SequenceBatch (the items with their slots)
    def assemble(self, items: SequenceBatch, arena, stats) -> dict:  # type: ignore[override]
        from .. import native

        n = len(items)
        chunks = arena.get(self.name + "#chunk", (n, self.chunk), self.dtype)
        native.assemble.gather([it.tensors[self.slot] for it in items], chunks)
        window = arena.get(self.name, (n, self.context + self.chunk), self.dtype)
        np.take(items.store.arrays[self.name], items.slots, axis=0, out=window[:, :self.context],
                mode="clip")
        if items.start.any():
            window[items.start, :self.context] = 0
        window[:, self.context:] = chunks
        items.feeds[self.name] = window
        return {self.name: window}

    def commit(self, batch: SequenceBatch, outputs: dict) -> None:
        batch.store.arrays[self.name][batch.slots] = batch.feeds[self.name][:, -self.context:]


@dataclass(frozen=True, eq=False)
class ControlInput(InputPlan):
    """A Triton control input: ``[N]`` of START / END / READY flags (0/1) or CORRID values."""

    name: str
    kind: str
    dtype: Any

    # a sequence plan takes only its batcher's SequenceBatch (the items with their slots)
    def assemble(self, items: SequenceBatch, arena, stats) -> dict:  # type: ignore[override]
        n = len(items)
        if self.kind == "CORRID":
            if self.dtype == np.dtype(object):
                return {self.name: np.array(items.corrid, dtype=object)}
            buf = arena.get(self.name, (n,), self.dtype)
            buf[:] = items.corrid
            return {self.name: buf}
        buf = arena.get(self.name, (n,), self.dtype)
        if self.kind == "START":
            buf[:] = items.start
        elif self.kind == "END":
            buf[:] = items.end
        else:  # READY: every row of a batch holds a request (batches are packed)
            buf[:] = 1
        return {self.name: buf}


def _load_initial(st: StateConfig, dtype: np.dtype, source: str, key: str) -> np.ndarray:
    if st.initial == "zeros":
        return np.zeros(st.dims, dtype=dtype)
    try:
        arr = np.load(st.initial, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(source, f"{key}.initial", f"cannot read {st.initial}: {exc}") from None
    if tuple(arr.shape) != tuple(st.dims):
        raise ConfigError(source, f"{key}.initial", f"{st.initial} holds shape {list(arr.shape)}, "
                                                   f"the state's dims are {list(st.dims)}")
    return np.ascontiguousarray(arr, dtype=dtype)


def state_plan(st: StateConfig, source: str = "<dict>", key: str = "sequence.state") -> StateInput:
    dtype = DTYPES[st.dtype]
    return StateInput(st.input_name, st.output_name, dtype, tuple(st.dims), st.batch_axis,
                      _load_initial(st, dtype, source, key))


def control_plan(c: ControlConfig) -> ControlInput:
    dtype = CORRID_NUMPY.get(c.dtype) if c.kind == "CORRID" else None
    return ControlInput(c.input_name, c.kind, dtype if dtype is not None else DTYPES[c.dtype])


def constant_plan(c: ConstantConfig) -> ConstantInput:
    return ConstantInput(c.input_name, np.asarray(c.value, dtype=DTYPES[c.dtype]))


def sequence_plans(seq: SequenceConfig, source: str = "<dict>", key: str = "tasks[0]") -> list:
    """Plan entries for every state, control and constant input a ``[tasks.sequence]`` declares."""
    plans: list = []
    for i, st in enumerate(seq.state):
        plans.append(state_plan(st, source, f"{key}.sequence.state[{i}]"))
    plans.extend(control_plan(c) for c in seq.control)
    plans.extend(constant_plan(c) for c in seq.constant)
    return plans


def check_model_io(plans: Sequence[InputPlan], model_inputs: Sequence[str],
                   model_outputs: Sequence[str], source: str, key: str) -> None:
    """Every declared input / state output must exist in the model (a config error if not)."""
    for p in plans:
        if p.name not in model_inputs:
            raise ConfigError(source, f"{key}.sequence", f"declares input {p.name!r}, which the "
                                                         f"model lacks (inputs: {list(model_inputs)})")
        out = getattr(p, "output_name", None)
        if out is not None and out not in model_outputs:
            raise ConfigError(source, f"{key}.sequence", f"declares state output {out!r}, which the "
                                                         f"model lacks (outputs: {list(model_outputs)})")


def corrid_kind(plans: Sequence[InputPlan]) -> Optional[str]:
    """'int' / 'string' when a CORRID control is declared, else None."""
    for p in plans:
        if isinstance(p, ControlInput) and p.kind == "CORRID":
            return "string" if p.dtype == np.dtype(object) else "int"
    return None

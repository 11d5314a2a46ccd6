"""The execution signature: which prepared requests may share a batch.

Two requests share a batch only when every field is equal: same task, model id and version,
model-input dtype, per-item shape (ragged inputs leave the length out: padding handles it),
layout and preprocess id.  It is built in one place, :func:`signature`, by every backend, and
it is a tuple underneath, so hashing and comparing it on the submit path cost what a plain
tuple costs.
"""
from __future__ import annotations

from typing import NamedTuple, Optional


class ExecutionSignature(NamedTuple):
    task: str
    model_id: str
    model_version: str
    dtype: str
    item_shape: Optional[tuple[int, ...]]  # None for ragged inputs (the length is not part of it)
    layout: str
    preprocess_id: str


def signature(task: str, model_id: str, model_version: str, dtype: str,
              item_shape: Optional[tuple[int, ...]], layout: str, preprocess_id: str) -> ExecutionSignature:
    """The one constructor backends use (shapes are normalised to tuples of ints)."""
    shape = None if item_shape is None else tuple(int(d) for d in item_shape)
    return ExecutionSignature(task, model_id, str(model_version), dtype, shape, layout,
                              preprocess_id)

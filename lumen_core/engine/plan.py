"""How a batch of prepared requests becomes model inputs: a small declarative plan.

A task backend declares, once at load, one plan entry per model input; the engine executes the
plan for every batch.  This keeps the engine ignorant of tasks (it never sees text or images)
and the backends ignorant of buffers and ONNX Runtime.  New kinds of input (sequence state,
control inputs) are new plan classes with an ``assemble`` method, not engine changes.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from .. import native

#: One request ready for batching: ``signature`` (only equal signatures share a batch),
#: ``tensors`` (per-input payload buffers, indexed by a plan's ``slot``), ``item_shape`` (the
#: per-item shape of dense inputs, no batch axis), ``length`` (the token count of ragged inputs,
#: for length-aware batching).  A compiled type of the request path (``entries.Prepared``):
#: backends make one per request, and may subclass it (with ``__slots__``) to carry more.
PreparedModelRequest = native.entries.Prepared


class InputPlan(abc.ABC):
    """Base of plan entries: ``assemble`` returns ``{input_name: ndarray}`` for one batch.

    ``stats`` is a per-batch dict the entry may add counters to (e.g. real / padded tokens).
    """

    name: str

    @abc.abstractmethod
    def assemble(self, items: Sequence[PreparedModelRequest], arena, stats: dict) -> dict:
        """Build this entry's model inputs for ``items`` (one batch)."""


@dataclass(frozen=True)
class DenseInput(InputPlan):
    """Fixed-size items gathered into ``[N, *item_shape]`` with one memcpy each."""

    name: str
    dtype: Any
    slot: int = 0

    def assemble(self, items, arena, stats) -> dict:
        shape = (len(items),) + tuple(items[0].item_shape)
        dest = arena.get(self.name, shape, self.dtype)
        native.assemble.gather([it.tensors[self.slot] for it in items], dest)
        return {self.name: dest}


@dataclass(frozen=True)
class RaggedInput(InputPlan):
    """Variable-length items ``[1, L_i]`` padded to ``[N, max L]``, mask filled in the same pass."""

    name: str
    dtype: Any
    pad_value: int = 0
    mask_name: Optional[str] = None
    mask_dtype: Any = np.int64
    slot: int = 0

    def assemble(self, items, arena, stats) -> dict:
        lmax = max(1, max(it.length for it in items))
        shape = (len(items), lmax)
        ids = arena.get(self.name, shape, self.dtype)
        mask = arena.get(self.mask_name, shape, self.mask_dtype) if self.mask_name else None
        real = native.assemble.gather_ragged([it.tensors[self.slot] for it in items], ids, mask,
                                             self.pad_value)
        out = {self.name: ids}
        if mask is not None and self.mask_name:
            out[self.mask_name] = mask
        stats["real_tokens"] = stats.get("real_tokens", 0) + real
        stats["padded_tokens"] = stats.get("padded_tokens", 0) + ids.size
        return out


@dataclass(frozen=True)
class ImageInput(InputPlan):
    """fp32 ``[N, 3, H, W]`` images assembled from two kinds of item, each written once.

    * an item whose tensor is a uint8 ``[H, W, 3]`` ndarray (a decoded raw image, or the uint8
      NHWC tensor route) is normalised with ``mean`` / ``std`` by the fused compiled pass
      ``native.image.normalize_hwc_to_chw`` straight into its slot ``dest[i]``;
    * any other item is an fp32 CHW buffer (the fp32 tensor route): runs of consecutive such
      items are copied with one ``native.assemble.gather`` call each.

    Why normalise here rather than when the request is prepared: the prepared item stays the
    150 KB uint8 crop instead of a private 602 KB fp32 image (4x less memory per queued
    request), and the normalised pixels are written exactly once, into the buffer ONNX Runtime
    reads, instead of once into a temporary and again by the gather memcpy.  The kernel costs
    about as much as that memcpy would (tens of microseconds per image, GIL released), so the
    worker thread does no more work than before.  Counters: ``normalised_images`` (items that
    went through the fused pass) and ``copied_images`` (fp32 items).
    """

    name: str
    mean: tuple
    std: tuple
    height: int
    width: int
    slot: int = 0

    def assemble(self, items, arena, stats) -> dict:
        n = len(items)
        dest = arena.get(self.name, (n, 3, self.height, self.width), np.float32)
        normalize = native.image.normalize_hwc_to_chw
        run_start = -1  # first index of the current run of fp32 items, -1 when none
        fused = 0
        for i, it in enumerate(items):
            t = it.tensors[self.slot]
            if isinstance(t, np.ndarray) and t.dtype == np.uint8:
                if run_start >= 0:
                    self._copy(items, run_start, i, dest)
                    run_start = -1
                normalize(t, dest[i], self.mean, self.std)
                fused += 1
            elif run_start < 0:
                run_start = i
        if run_start >= 0:
            self._copy(items, run_start, n, dest)
        stats["normalised_images"] = stats.get("normalised_images", 0) + fused
        stats["copied_images"] = stats.get("copied_images", 0) + n - fused
        return {self.name: dest}

    def _copy(self, items, start: int, stop: int, dest: np.ndarray) -> None:
        native.assemble.gather([it.tensors[self.slot] for it in items[start:stop]],
                               dest[start:stop])


@dataclass(frozen=True)
class ConstantInput(InputPlan):
    """An input that is the same for every batch (e.g. Silero's sample rate ``sr``)."""

    name: str
    value: np.ndarray

    def assemble(self, items, arena, stats) -> dict:
        return {self.name: self.value}


@dataclass(frozen=True)
class OutputSpec:
    """A model output to fetch.  With ``item_shape`` known (one item's dims, no batch axis),
    the engine binds a preallocated buffer with the batch inserted at ``batch_axis`` (0:
    ``[N, *item_shape]``; Silero's state ``[2, N, 128]`` has item_shape ``(2, 128)`` and
    batch_axis 1), so ORT writes straight into it."""

    name: str
    dtype: Any = np.float32
    item_shape: Optional[tuple] = None
    batch_axis: int = 0

    def __post_init__(self) -> None:
        if self.item_shape is not None and not 0 <= self.batch_axis <= len(self.item_shape):
            raise ValueError(f"output {self.name!r}: batch_axis {self.batch_axis} is outside "
                             f"0..{len(self.item_shape)} for item shape {self.item_shape}")


@dataclass
class ModelSpec:
    """A model file, its input plans (one entry per model input) and the outputs to fetch."""

    path: str
    inputs: list
    outputs: list

"""The text embedding's request options and output shaping: the prepared item with the
options it asks (:class:`EmbedRequest`, :class:`EmbedOptions`), an item's outputs with the
response meta it reports (:class:`EmbeddingOutputs`), and one embedding cut to ``dimensions`` and encoded as an
``embedding_type`` (:func:`shape_embedding`; the types and their formulas are in the
``text_embedding`` module docstring and ``contract.EMBEDDING_TYPES``).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..contract import EMBEDDING_QUANT_RANGE
from ..engine.plan import PreparedModelRequest
from ..errors import InvalidArgument
from ..models.minilm import NORMALIZE_EPS
from ..request_path.descriptor import parse_bool

_QUANT_LO, _QUANT_HI = EMBEDDING_QUANT_RANGE
_QUANT_SCALE = 255.0 / (_QUANT_HI - _QUANT_LO)  # levels per unit


class EmbedRequest(PreparedModelRequest):
    """A prepared request plus the options it asks (``options``: None for all defaults, the
    common case), read back in :meth:`TextEmbeddingBackend.postprocess`."""

    __slots__ = ("options",)

    def __init__(self, signature: Any, tensors: tuple, length: int, options: Any):
        super().__init__(signature, tensors, (), length)
        self.options = options


class EmbedOptions:
    """What one request asks beyond the defaults (``EmbedRequest.options``)."""

    __slots__ = ("dims", "etype", "truncated", "pooled")

    def __init__(self, dims: int, etype: str, truncated: bool, pooled: bool = False):
        self.dims = dims
        self.etype = etype
        self.truncated = truncated
        self.pooled = pooled  # normalize=false: the mean-pooled vector, not normalised


def flag_option(meta: Any, key: str) -> Optional[bool]:
    """A boolean plain option of ``meta`` (``true`` / ``false`` / ``1`` / ``0``, or a bool from
    an in-process caller); None when absent."""
    if not meta:
        return None
    v = meta.get(key)
    if v is None or isinstance(v, bool):
        return v
    if not isinstance(v, str):
        raise InvalidArgument(f"{key} must be 'true' or 'false', got {type(v).__name__}", key)
    return parse_bool(key, v)


class EmbeddingOutputs(dict):
    """One item's outputs plus response meta the backend wants reported (``meta``, e.g.
    ``lumen.truncated``): a dict like any other result, which a transport may read ``meta``
    from (``getattr(outputs, "meta", None)``)."""

    __slots__ = ("meta",)

    def __init__(self, outputs: dict, meta: dict):
        super().__init__(outputs)
        self.meta = meta


def shape_embedding(vec: np.ndarray, dims: int = 0, etype: str = "float",
                    normalize: bool = True) -> np.ndarray:
    """``vec`` (an L2-normalised fp32 vector, or with ``normalize`` False the mean-pooled one)
    cut to its first ``dims`` components and, when ``normalize``, normalised again (``dims`` 0
    or the full size: untouched), then encoded as ``etype`` (see the module docstring and
    ``contract.EMBEDDING_TYPES``)."""
    v = vec
    if 0 < dims < v.shape[-1]:
        v = v[..., :dims]
    if normalize and v is not vec:
        norm = np.linalg.norm(v, axis=-1, keepdims=True)
        v = (v / np.maximum(norm, NORMALIZE_EPS)).astype(np.float32, copy=False)
    if etype == "float":
        return v
    if etype in ("int8", "uint8"):
        u = np.clip(np.floor((v - _QUANT_LO) * _QUANT_SCALE), 0, 255).astype(np.uint8)
    else:
        u = np.packbits(v > 0, axis=-1)  # big-endian bit order: MSB first
    if etype in ("uint8", "ubinary"):
        return u
    return (u.astype(np.int16) - 128).astype(np.int8)

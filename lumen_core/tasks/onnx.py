"""Generic ``onnx`` backend: any single-input ONNX model through the tensor route.

Its contract is derived from the model itself: the input's element type gives the dtype, its
non-batch dimensions the per-dimension constraints (a fixed size stays fixed, a symbolic one is
``1 <= d``, up to ``options.max_dim`` when set), and ``options`` name the layout and the
accepted preprocess ids.  Outputs whose non-batch dims are all fixed are bound to preallocated
buffers by the engine.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import native
from ..batching.signature import signature
from ..config import Option
from ..contract import (
    DEFAULT_LAYOUT_FOR_RANK,
    DTYPES,
    LAYOUTS,
    UNBOUNDED,
    TensorContract,
    TensorSpec,
)
from ..engine.plan import DenseInput, ModelSpec, OutputSpec, PreparedModelRequest
from ..engine.session import read_io
from ..errors import ConfigError
from ..request import new_infer_request
from .base import TaskBackend

DEFAULT_PREPROCESS_ID = "none"
#: distinct (dtype, item shape, preprocess id) signatures remembered per task
MAX_CACHED_SIGNATURES = 256


class OnnxBackend(TaskBackend):
    raw_mimes = ()
    options_schema = (
        Option("layout", str, None, "the input's layout, of the input's rank; default by rank: "
                                    + ", ".join(DEFAULT_LAYOUT_FOR_RANK.values()),
               choices=tuple(LAYOUTS)),
        Option("preprocess_ids", list, (DEFAULT_PREPROCESS_ID,),
               "the preprocess ids a request may name (lumen.preprocess.id)"),
        Option("max_dim", int, UNBOUNDED, "largest size of each symbolic non-batch dimension; "
                                          "default: unbounded", lo=1),
    )

    def load(self) -> ModelSpec:
        cfg = self.config
        src, key = cfg.source, cfg.key
        if not cfg.model:
            raise ConfigError(src, f"{key}.model", "is required for backend 'onnx'")
        if not os.path.isfile(cfg.model):
            raise ConfigError(src, f"{key}.model", f"no such file: {cfg.model}")
        inputs, outputs = read_io(cfg.model)
        if len(inputs) != 1:
            raise ConfigError(src, f"{key}.model", f"backend 'onnx' serves single-input models; "
                                                   f"{cfg.model} has inputs {[i[0] for i in inputs]}")
        in_name, dtype, dims = inputs[0]
        if dtype not in DTYPES:
            raise ConfigError(src, f"{key}.model", f"input {in_name!r} has unsupported type {dtype}")
        if not dims:
            raise ConfigError(src, f"{key}.model", f"input {in_name!r} has no batch dimension")
        layout = self.options["layout"] or DEFAULT_LAYOUT_FOR_RANK.get(len(dims), "")
        if LAYOUTS.get(layout) is None or LAYOUTS[layout].rank != len(dims):
            fits = ", ".join(n for n, lay in LAYOUTS.items() if lay.rank == len(dims))
            raise ConfigError(src, f"{key}.options.layout",
                              f"must be a layout of rank {len(dims)} for input {in_name!r} "
                              f"({fits or 'no known layout has that rank'}), got {layout!r}")
        pps = self.options["preprocess_ids"]
        max_dim = self.options["max_dim"]
        spec_dims = ((1, 1),) + tuple((d, d) if d else (1, max_dim) for d in dims[1:])
        self._dense = native.routes.DenseTensor(self._signature, MAX_CACHED_SIGNATURES)
        self.model_id = cfg.model_id or os.path.splitext(os.path.basename(cfg.model))[0]
        self.contract = TensorContract(
            specs=(TensorSpec(dtype, layout, frozenset(pps), spec_dims),),
            model_id=self.model_id, model_version=cfg.model_version)
        outs = []
        self._outputs = {name: [odt if odt in DTYPES else "fp32", list(odims[1:])]
                         for name, odt, odims in outputs}
        for name, odt, odims in outputs:
            item = tuple(odims[1:]) if odims and all(d for d in odims[1:]) else None
            outs.append(OutputSpec(name, DTYPES.get(odt, np.float32), item))
        self.model = ModelSpec(cfg.model, [DenseInput(in_name, DTYPES[dtype])], outs)
        return self.model

    def describe(self) -> dict:
        """The base description plus the model's outputs: ``{name: [dtype, per-item shape]}``
        (None for a dimension the model leaves open)."""
        d = {**super().describe(), "outputs": dict(getattr(self, "_outputs", {}))}
        return d

    def prepare_tensor(self, req, desc, payload) -> PreparedModelRequest:
        return self._dense.prepare(desc, payload)

    def dense_tensor(self) -> "native.routes.DenseTensor":
        """The tensor route, prepared by the request path in C (every tensor request of this
        backend is its payload under a cached signature)."""
        return self._dense

    def _signature(self, dtype: str, item_shape: tuple, preprocess_id: str, layout: str) -> Any:
        return signature(self.name, self.model_id, self.config.model_version, dtype, item_shape,
                         layout, preprocess_id)

    def warmup_requests(self) -> list:
        """One zero tensor of the smallest accepted shape, through the public tensor route."""
        spec = self.contract.specs[0]
        shape = tuple(max(1, lo) for lo, _ in spec.dims)
        arr = np.zeros(shape, dtype=DTYPES[spec.dtype])
        return [new_infer_request(self.name)
                .for_tensor_array(arr, spec.layout, sorted(spec.preprocess_ids)[0]).build()]

"""Int8 building blocks of the prepared models (:mod:`.minilm_int8` uses them): per-channel
activation statistics from a calibration run, GPTQ rounding of weights, and the rewrite of
weight MatMuls into ``MatMulIntegerToFloat`` with one activation scale per token row.

Everything here is numpy (float64) and plain ``onnx`` protos; nothing depends on
``onnxruntime.quantization``.  The graph it writes runs on ONNX Runtime's CPU provider
(``MatMulIntegerToFloat`` is a ``com.microsoft`` contrib op of every ORT build).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

#: uint8 activations: levels 0..ACT_TOP
ACT_TOP = 255
#: floor of a row's scale (a row of zeros quantises to zeros)
ROW_SCALE_EPS = 1e-8
#: ORT's contrib-op domain (MatMulIntegerToFloat)
MS_DOMAIN = "com.microsoft"


# ---------------------------------------------------------------------------------------------
# activation statistics


class ActivationStats:
    """Running statistics of one activation's channels over the rows seen (real tokens):
    count, sum, min, max and the second-moment matrix ``X^T X`` (float64)."""

    __slots__ = ("n", "total", "lo", "hi", "xtx")

    def __init__(self, channels: int) -> None:
        self.n = 0
        self.total = np.zeros(channels)
        self.lo = np.full(channels, np.inf)
        self.hi = np.full(channels, -np.inf)
        self.xtx = np.zeros((channels, channels))

    def add(self, rows: np.ndarray) -> None:
        """Fold in ``rows`` ([n, channels])."""
        if not len(rows):
            return
        x = np.ascontiguousarray(rows, dtype=np.float32)
        self.n += len(x)
        self.total += x.sum(axis=0, dtype=np.float64)
        self.lo = np.minimum(self.lo, x.min(axis=0))
        self.hi = np.maximum(self.hi, x.max(axis=0))
        self.xtx += x.T @ x  # one batch's products in fp32 (a few hundred rows), summed in fp64

    def second_moment(self, shift: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """``E[x' x'^T]`` of ``x' = (x - shift) / scale`` (GPTQ's Hessian of a layer fed x')."""
        c = (self.xtx - np.outer(shift, self.total) - np.outer(self.total, shift)
             + self.n * np.outer(shift, shift))
        return c / np.outer(scale, scale) / max(self.n, 1)


# ---------------------------------------------------------------------------------------------
# weights


def gptq(w: np.ndarray, hessian: np.ndarray, bits: int, damp: float, block: int,
         pair_budget: Optional[int] = None) -> tuple:
    """Symmetric per-output-column ``bits``-bit quantisation of ``w`` ([K, M], x @ w) by GPTQ
    (Frantar et al. 2022): rows (input channels) are rounded one at a time, largest
    ``hessian`` diagonal first, and each rounding error is spread over the rows not yet
    rounded through the inverse Hessian, so ``x @ w_q`` tracks ``x @ w`` for the
    calibration activations rather than each weight alone.  With ``pair_budget``, every
    column keeps ``|q_2i| + |q_2i+1| <= pair_budget`` (rows in the stored order; the second
    of a pair rounded is clipped to what its partner left).  Returns (int8 [K, M], column
    scales [M] from :func:`column_scales`).  Deterministic: numpy float64, a stable sort for
    the order."""
    qmax = 2 ** (bits - 1) - 1
    w = np.array(w, dtype=np.float64)
    scale = column_scales(w, bits, pair_budget)
    h = np.array(hessian, dtype=np.float64)
    dead = np.diag(h) <= 0  # an input that is always zero: its weights do not matter
    h[dead, dead] = 1.0
    w[dead] = 0.0
    order = np.argsort(-np.diag(h), kind="stable")
    w, h = w[order], h[order][:, order]
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diag(h)))
    hinv = _upper_cholesky_of_inverse(h)
    k = len(w)
    q = np.empty_like(w)
    # rows 2i and 2i+1 (in the stored order) share one int16 pair sum on AVX2
    position = np.empty(k, dtype=np.int64)
    position[order] = np.arange(k)
    partner = None  # processing index of each row's pair partner (k: none)
    if pair_budget is not None:
        mate = order ^ 1
        partner = np.where(mate < k, position[np.minimum(mate, k - 1)], k)
    for i0 in range(0, k, block):
        i1 = min(i0 + block, k)
        wb = w[i0:i1].copy()
        err = np.empty_like(wb)
        hb = hinv[i0:i1, i0:i1]
        for j in range(i1 - i0):
            limit: Any = qmax
            if partner is not None and partner[i0 + j] < i0 + j:
                limit = np.minimum(qmax, pair_budget - np.abs(q[partner[i0 + j]]))
            q[i0 + j] = np.clip(np.rint(wb[j] / scale), -limit, limit)
            err[j] = (wb[j] - q[i0 + j] * scale) / hb[j, j]
            wb[j + 1:] -= np.outer(hb[j, j + 1:], err[j])
        w[i1:] -= hinv[i0:i1, i1:].T @ err
    out = np.empty_like(q)
    out[order] = q
    return out.astype(np.int8), scale


#: a triangular inverse below this size is LAPACK's general one
_TRI_INV_BASE = 128


def _upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """Upper triangular U with U^T U = h^-1, without forming h^-1: with R the reversal,
    R h R = L L^T gives h^-1 = (R L^-1 R)^T (R L^-1 R), and R L^-1 R is upper triangular."""
    lower = np.linalg.cholesky(h[::-1, ::-1])
    return np.ascontiguousarray(_lower_triangular_inverse(lower)[::-1, ::-1])


def _lower_triangular_inverse(m: np.ndarray) -> np.ndarray:
    """Inverse of a lower triangular matrix by halves (a third of a general inverse's work)."""
    n = len(m)
    if n <= _TRI_INV_BASE:
        return np.tril(np.linalg.inv(m))
    k = n // 2
    a, d = _lower_triangular_inverse(m[:k, :k]), _lower_triangular_inverse(m[k:, k:])
    out = np.zeros_like(m)
    out[:k, :k], out[k:, k:] = a, d
    out[k:, :k] = -(d @ m[k:, :k]) @ a
    return out


def column_scales(w: np.ndarray, bits: int, pair_budget: Optional[int] = None) -> np.ndarray:
    """Symmetric per-output-column scales of ``w`` ([K, M]): max |w| / qmax, grown where the
    largest ``|w_2i| + |w_2i+1|`` of a column would not fit ``pair_budget`` levels."""
    qmax = 2 ** (bits - 1) - 1
    amax = np.abs(w).max(axis=0)
    if pair_budget is not None and len(w) % 2 == 0:
        amax = np.maximum(amax, (np.abs(w[0::2]) + np.abs(w[1::2])).max(axis=0) * qmax
                          / pair_budget)
    return np.where(amax > 0, amax / qmax, 1.0)


def round_to_nearest(w: np.ndarray, bits: int) -> tuple:
    """Plain symmetric per-output-column rounding of ``w`` ([K, M]): (int8, column scales);
    GPTQ's baseline."""
    qmax = 2 ** (bits - 1) - 1
    w = np.asarray(w, dtype=np.float64)
    scale = column_scales(w, bits)
    return np.clip(np.rint(w / scale), -qmax, qmax).astype(np.int8), scale


# ---------------------------------------------------------------------------------------------
# graph


class Graph:
    """Producers and consumers of an ONNX graph's tensors, and its initializers as arrays
    (edited in place, written back by :meth:`commit`)."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        self.model = model
        self.producer = {o: n for n in model.graph.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in model.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        self.changed: set = set()

    def array(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def set_array(self, name: str, value: np.ndarray) -> None:
        """Replace an initializer's value (kept float64 until :meth:`commit` writes fp32)."""
        self.arrays[name] = np.asarray(value, dtype=np.float64)
        self.changed.add(name)

    def weight_matmuls(self) -> list:
        """``[(MatMul node, weight name, bias name)]`` for every ``x @ W + b`` with W a 2-D
        initializer, b a 1-D initializer added right after (in graph order)."""
        found = []
        for n in self.model.graph.node:
            if n.op_type != "MatMul" or n.input[1] not in self.arrays \
                    or self.arrays[n.input[1]].ndim != 2:
                continue
            users = self.consumers.get(n.output[0], [])
            bias = [i for u in users if u.op_type == "Add" and len(users) == 1
                    for i in u.input if i in self.arrays and self.arrays[i].ndim == 1]
            found.append((n, n.input[1], bias[0] if bias else None))
        return found

    def commit(self, nodes: list, drop: Iterable[str], added: list) -> None:
        """Replace the node list, drop the initializers named in ``drop``, write back the
        edited arrays, append the ``added`` initializer protos."""
        from onnx import numpy_helper

        drop = set(drop)
        graph = self.model.graph
        inits = [numpy_helper.from_array(self.arrays[t.name].astype(np.float32), t.name)
                 if t.name in self.changed else t
                 for t in graph.initializer if t.name not in drop]
        del graph.node[:]
        graph.node.extend(nodes)
        del graph.initializer[:]
        graph.initializer.extend(inits + added)
        if not any(o.domain == MS_DOMAIN for o in self.model.opset_import):
            from onnx import helper

            self.model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


class RowQuantiser:
    """Writes ``x @ W`` as uint8 ``x`` (one scale per token row, a fixed zero point per
    activation) times int8 ``W`` (one scale per output column):

    per activation x [.., K], once for all its MatMuls: ``x2 = x`` as [R, K];
    ``scale = max(max_row / (255 - Z), -min_row / Z, eps)`` (so no value clips);
    ``q = QuantizeLinear(x2, scale, Z, axis=0)`` (round half to even);
    per MatMul: ``MatMulIntegerToFloat(q, W_q, 1, w_scale, Z)`` (int32 accumulation, the
    zero point and column scale applied by the kernel) ``* scale`` per row, reshaped back.
    A row's scale is its own, so a text's result does not depend on its batch.  A fixed zero
    point per activation (not per row) is what lets the kernel take it: ORT's CPU
    ``MatMulInteger*`` accept one zero point per tensor only."""

    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.nodes: list = []
        self.added: list = []
        self.rows: dict[tuple, tuple] = {}

    def const(self, value: Any, name: str, dtype: Any = np.float32) -> str:
        from onnx import numpy_helper

        self.added.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list, out: str, **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out + "_node", **attrs))
        return out

    def quantise_rows(self, x: str, k: int, zero_point: int) -> tuple:
        """(uint8 [R, K], row scale [R, 1], x's leading dims) of activation ``x``, once."""
        from onnx import numpy_helper

        key = (x, zero_point)
        if key in self.rows:
            return self.rows[key]
        p = f"{x}.rowq"
        x2 = self.op("Reshape", [x, self.const([-1, k], p + ".rows", np.int64)], p + ".x2")
        hi = self.op("ReduceMax", [x2], p + ".max", axes=[1], keepdims=0)
        lo = self.op("ReduceMin", [x2], p + ".min", axes=[1], keepdims=0)
        scale = self.op("Max", [
            self.op("Mul", [hi, self.const(1.0 / (ACT_TOP - zero_point), p + ".inv_up")], p + ".up"),
            self.op("Mul", [lo, self.const(-1.0 / zero_point, p + ".inv_down")], p + ".down"),
            self.const(ROW_SCALE_EPS, p + ".eps")], p + ".scale")
        zps = self.op("ConstantOfShape", [self.op("Shape", [scale], p + ".n")], p + ".zp",
                      value=numpy_helper.from_array(np.array([zero_point], np.uint8)))
        q = self.op("QuantizeLinear", [x2, scale, zps], p + ".q", axis=0)
        col = self.op("Unsqueeze", [scale, self.const([1], p + ".axis1", np.int64)], p + ".scale_col")
        lead = self.op("Shape", [x], p + ".lead", end=-1)
        self.rows[key] = (q, col, lead)
        return self.rows[key]

    def matmul(self, node: Any, x: str, w_q: np.ndarray, w_scale: np.ndarray,
               zero_point: int) -> None:
        """``node`` (x @ W) as the int8 product of ``x`` and ``w_q`` ([K, M] int8)."""
        k, m = w_q.shape
        q, col, lead = self.quantise_rows(x, k, zero_point)
        p = node.name
        y = self.op("MatMulIntegerToFloat", [
            q, self.const(w_q, p + ".w_int8", np.int8), self.const(1.0, p + ".a_scale"),
            self.const(w_scale, p + ".w_scale"), self.const(zero_point, p + ".a_zp", np.uint8)],
            p + ".y", domain=MS_DOMAIN)
        y = self.op("Mul", [y, col], p + ".y_rows")
        shape = self.op("Concat", [lead, self.const([m], p + ".cols", np.int64)], p + ".shape",
                        axis=0)
        self.op("Reshape", [y, shape], node.output[0])

"""Small ONNX models generated with the ``onnx`` helper API, for the tests and the benchmarks.

Both ``tests/`` (as ``onnx_models``) and ``bench/`` build their toy graphs here (an MLP, a
scaler, an attention block, a CLIP-style image encoder, ...), so a benchmark measures the same
model a test checks and neither imports from the other's folder.  Nothing in the package
imports this module; it needs only ``onnx`` and ``numpy`` (the ``cpu`` extra).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
#: an input row whose first value equals this makes ``failing_mlp`` fail for its whole batch
FAIL_MARKER = 13.0


def _save(graph, path) -> str:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def mlp(path, d_in: int = 16, d_hidden: int = 64, d_out: int = 8, seed: int = 0,
        fail_marker: bool = False) -> str:
    """``y = relu(x @ W1 + b1) @ W2 + b2`` with input ``x`` [N, d_in] and output ``y`` [N, d_out].

    With ``fail_marker`` the model raises at run time when any row's first value is
    ``FAIL_MARKER``: a Reshape to ``size(x) + any_marked`` elements cannot succeed then.
    """
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((d_in, d_hidden)) / np.sqrt(d_in)).astype(np.float32)
    b1 = (rng.standard_normal(d_hidden) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((d_hidden, d_out)) / np.sqrt(d_hidden)).astype(np.float32)
    b2 = (rng.standard_normal(d_out) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "W1"), (b1, "B1"), (w2, "W2"), (b2, "B2"))]
    nodes = []
    x = "x"
    if fail_marker:
        inits += [
            numpy_helper.from_array(np.array([0], np.int64), "zero1"),
            numpy_helper.from_array(np.array([1], np.int64), "one1"),
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
            numpy_helper.from_array(np.array(FAIL_MARKER, np.float32), "marker"),
        ]
        nodes += [
            helper.make_node("Slice", ["x", "zero1", "one1", "axis1"], ["first"]),
            helper.make_node("Equal", ["first", "marker"], ["is_marked"]),
            helper.make_node("Cast", ["is_marked"], ["marked_i"], to=TensorProto.INT64),
            helper.make_node("ReduceMax", ["marked_i"], ["any_marked"], keepdims=0),
            helper.make_node("Size", ["x"], ["size_x"]),
            helper.make_node("Add", ["size_x", "any_marked"], ["flat_len"]),
            helper.make_node("Unsqueeze", ["flat_len", "zero1"], ["flat_shape"]),
            helper.make_node("Reshape", ["x", "flat_shape"], ["x_flat"]),
            helper.make_node("Shape", ["x"], ["x_shape"]),
            helper.make_node("Reshape", ["x_flat", "x_shape"], ["x_checked"]),
        ]
        x = "x_checked"
    nodes += [
        helper.make_node("MatMul", [x, "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "B1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["y0"]),
        helper.make_node("Add", ["y0", "B2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", d_out])],
        inits)
    return _save(graph, path)


def mlp_reference(x: np.ndarray, d_in: int = 16, d_hidden: int = 64, d_out: int = 8,
                  seed: int = 0) -> np.ndarray:
    """numpy twin of :func:`mlp` for checking results."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((d_in, d_hidden)) / np.sqrt(d_in)).astype(np.float32)
    b1 = (rng.standard_normal(d_hidden) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((d_hidden, d_out)) / np.sqrt(d_hidden)).astype(np.float32)
    b2 = (rng.standard_normal(d_out) * 0.1).astype(np.float32)
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def scale(path, dims=("N", "L"), dtype=TensorProto.FLOAT) -> str:
    """``y = x * 2`` over an input of the given (possibly symbolic) dims."""
    two = numpy_helper.from_array(np.array(2, dtype=helper.tensor_dtype_to_np_dtype(dtype)), "two")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "scale",
        [helper.make_tensor_value_info("x", dtype, list(dims))],
        [helper.make_tensor_value_info("y", dtype, list(dims))], [two])
    return _save(graph, path)


def nan_for_negative(path, d: int = 4) -> str:
    """``y = sqrt(x)``: a negative input yields NaN (for result validation tests)."""
    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["x"], ["y"])], "sqrt",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", d])])
    return _save(graph, path)


#: below this value at pixel [0, 0, 0] of a (normalised) input, ``image_encoder(nan_marker=True)``
#: outputs NaN for that image: sqrt(x + NAN_MARKER_OFFSET) of a negative number
NAN_MARKER_OFFSET = 100.0


def image_encoder(path, width: int = 16, d_out: int = 64, patch: int = 16, seed: int = 0,
                  extra_output: bool = False, nan_marker: bool = False) -> str:
    """A tiny CLIP-style vision encoder: ``x`` [N,3,224,224] fp32 -> ``image_embeds`` [N, d_out].

    Patch embedding (Conv ``patch`` x ``patch``, stride ``patch``) -> Relu -> Flatten -> MatMul.
    ``extra_output`` adds ``patch_tokens`` [N, width*14*14] (a second output, as real exports
    have).  ``nan_marker`` multiplies the embedding by ``sqrt(x[:,0,0,0] + NAN_MARKER_OFFSET)``,
    so an input whose first value is below ``-NAN_MARKER_OFFSET`` yields NaN.
    """
    rng = np.random.default_rng(seed)
    grid = 224 // patch
    w = (rng.standard_normal((width, 3, patch, patch)) / np.sqrt(3 * patch * patch)).astype(np.float32)
    b = (rng.standard_normal(width) * 0.1).astype(np.float32)
    proj = (rng.standard_normal((width * grid * grid, d_out)) / np.sqrt(width * grid * grid)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B"),
             numpy_helper.from_array(proj, "P")]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["conv"], kernel_shape=[patch, patch],
                         strides=[patch, patch]),
        helper.make_node("Relu", ["conv"], ["act"]),
        helper.make_node("Flatten", ["act"], ["tokens"], axis=1),
    ]
    emb = "image_embeds"
    if nan_marker:
        inits += [
            numpy_helper.from_array(np.array([0, 0, 0], np.int64), "starts"),
            numpy_helper.from_array(np.array([1, 1, 1], np.int64), "ends"),
            numpy_helper.from_array(np.array([1, 2, 3], np.int64), "axes"),
            numpy_helper.from_array(np.array([-1, 1], np.int64), "col"),
            numpy_helper.from_array(np.array(NAN_MARKER_OFFSET, np.float32), "offset"),
        ]
        nodes += [
            helper.make_node("MatMul", ["tokens", "P"], ["raw_embeds"]),
            helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["first"]),
            helper.make_node("Reshape", ["first", "col"], ["first_col"]),
            helper.make_node("Add", ["first_col", "offset"], ["shifted"]),
            helper.make_node("Sqrt", ["shifted"], ["gain"]),
            helper.make_node("Mul", ["raw_embeds", "gain"], [emb]),
        ]
    else:
        nodes.append(helper.make_node("MatMul", ["tokens", "P"], [emb]))
    outs = [helper.make_tensor_value_info(emb, TensorProto.FLOAT, ["N", d_out])]
    if extra_output:
        nodes.append(helper.make_node("Identity", ["tokens"], ["patch_tokens"]))
        outs.append(helper.make_tensor_value_info("patch_tokens", TensorProto.FLOAT,
                                                  ["N", width * grid * grid]))
    graph = helper.make_graph(
        nodes, "image_encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 224, 224])], outs, inits)
    return _save(graph, path)


def offset(path, k: float, d: int = 4) -> str:
    """``y = x + k`` over ``x`` [N, d]: versions built with different ``k`` answer
    distinguishably (the tests of model versions and hot reload tell who served from it)."""
    kk = numpy_helper.from_array(np.array(k, np.float32), "k")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "k"], ["y"])], f"offset_{k:g}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", d])], [kk])
    return _save(graph, path)


def embedding_only(path, dim: int = 384) -> str:
    """A text encoder with the MiniLM graph's inputs (int64 ``input_ids`` / ``attention_mask``
    ``[N, L]``) and only its ``embedding`` output (fp32 ``[N, dim]``, the mean of ``ids * ones``
    over the masked tokens): no ``pooled`` output, so ``normalize=false`` cannot be served."""
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["ids_f", "mask_f"], ["masked"]),
        helper.make_node("ReduceMean", ["masked"], ["mean"], axes=[1], keepdims=1),
        helper.make_node("MatMul", ["mean", "ones"], ["embedding"]),
    ]
    ones = numpy_helper.from_array(np.ones((1, dim), np.float32), "ones")
    graph = helper.make_graph(
        nodes, "embedding_only",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "L"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "L"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", dim])], [ones])
    return _save(graph, path)


def matmul(path, d: int = 16, seed: int = 0) -> str:
    """The null model: ``y = x @ W`` with ``x`` [N, d] (a 16x16 MatMul costs ORT next to
    nothing, so what a request costs around it is the runtime's own)."""
    w = (np.random.default_rng(seed).standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "null",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", d])],
        [numpy_helper.from_array(w, "W")])
    return _save(graph, path)


def attention(path, d: int = 32, seed: int = 0) -> str:
    """A one-layer self-attention encoder over ``x`` [N, L, d] (``L`` symbolic): ``y = x +
    softmax(x Wq (x Wk)^T / sqrt(d)) x Wv``, output ``y`` [N, L, d].  Its cost grows as L^2:
    the model of issue 38 row 1 (one client's long rows stall loop execution)."""
    rng = np.random.default_rng(seed)
    ws = [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for _ in range(3)]
    inits = [numpy_helper.from_array(w, n) for w, n in zip(ws, ("Wq", "Wk", "Wv"), strict=True)]
    inits.append(numpy_helper.from_array(np.array(1 / np.sqrt(d), np.float32), "inv_sqrt_d"))
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", ["x", "Wk"], ["k"]),
        helper.make_node("MatMul", ["x", "Wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"]),
        helper.make_node("Mul", ["s0", "inv_sqrt_d"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["a"]),
        helper.make_node("Add", ["x", "a"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "L", d])], inits)
    return _save(graph, path)


def attention_reference(x: np.ndarray, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    wq, wk, wv = [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for _ in range(3)]
    s = (x @ wq) @ np.swapaxes(x @ wk, -1, -2) / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return x + p @ (x @ wv)

"""The transformer encoder of every imported text model as ONNX nodes, written without torch.

One builder serves BERT, RoBERTa, XLM-RoBERTa, MPNet and DistilBERT: :mod:`._arch` maps each
checkpoint's weight names onto BERT's and says what differs (where the position table starts,
whether token types exist, MPNet's relative position bias, the activation).  The nodes are
written in the shape ``torch.onnx.export`` gives a Hugging Face ``BertModel`` (Q/K/V
MatMul+Add, Reshape, Transpose, scaled QK, additive mask from
``Unsqueeze-Unsqueeze-Cast-Sub-Mul``, erf GELU, LayerNormalization), because that is the
pattern ONNX Runtime's transformer optimizer recognises and fuses into ``Attention`` /
``SkipLayerNormalization`` / ``BiasGelu`` (``models/minilm.py`` has the measurements) and the
pattern the int8 recipe (``models/minilm_int8.py``) walks.

Position ids are ``0..L-1`` from a ``Range`` on the input's length; RoBERTa-style models
(padding_idx + 1 + i for real tokens, what ``create_position_ids_from_input_ids`` gives a
right-padded row) get the table sliced at that offset when the graph is written, so the graph
is BERT's.  Padded positions read other rows than in torch; they are masked out of attention
and pooling, so no output sees them.  Token types are all zero for single texts: row 0 is
folded into the position table (one Gather fewer).  A cross-encoder with token types
(``pair_types``) computes them in the graph: 1 after the first separator token.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

#: the graph's inputs (the names the ``text_embedding`` task feeds)
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
OPSET = 17
#: readable by every ONNX Runtime the project supports (>= 1.18)
IR_VERSION = 8
# Additive attention mask for padded keys; exp(-10000 + s) is exactly 0 in fp32 for any
# realistic score, and -10000 is the optimizer's default mask_filter_value.
MASK_FILTER_VALUE = -10000.0
#: activations by Hugging Face's ``hidden_act`` names
ERF_GELU = ("gelu",)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
ACTIVATIONS = ERF_GELU + TANH_GELU + ("relu",)


class GraphBuilder:
    """Names nodes and initializers uniquely; a thin layer over ``onnx.helper``."""

    def __init__(self, prefix: str = "", opset: int = OPSET) -> None:
        self.nodes: list = []
        self.initializers: list = []
        self._count = 0
        #: prepended to every name (nodes spliced into another graph must not collide)
        self.prefix = prefix
        #: the graph's ONNX opset: reductions take ``axes`` as an input from 18 on
        self.opset = opset

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def reduce(self, op_type: str, x: str, axes: list[int], hint: str, keepdims: int) -> str:
        """``op_type`` (ReduceMax, ReduceL2, ...) over ``axes`` in the opset's spelling."""
        if self.opset >= 18:
            return self.op(op_type, [x, self.const(axes, hint + "_axes", np.int64)], hint, keepdims=keepdims)
        return self.op(op_type, [x], hint, axes=axes, keepdims=keepdims)

    def const(self, value: Any, hint: str, dtype: Any = np.float32) -> str:
        from onnx import numpy_helper

        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: Optional[str] = None, **attrs: Any) -> str:
        from onnx import helper

        out = self._name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out + "_node", **attrs))
        return out

    def op_multi(self, op_type: str, inputs: list[str], hints: list[str], **attrs: Any) -> list[str]:
        """A node with several outputs (``Split``), named from ``hints``."""
        from onnx import helper

        outs = [self._name(h) for h in hints]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0] + "_node", **attrs))
        return outs

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray, hint: str) -> str:
        """``x @ W.T + b`` as MatMul + Add (torch stores Linear weights as [out, in])."""
        w = self.const(np.ascontiguousarray(weight.T), hint + ".weight")
        b = self.const(bias, hint + ".bias")
        return self.op("Add", [self.op("MatMul", [x, w], hint + ".matmul"), b], hint + ".add")

    def layer_norm(self, x: str, gamma: np.ndarray, beta: np.ndarray, eps: float, hint: str) -> str:
        g = self.const(gamma, hint + ".weight")
        b = self.const(beta, hint + ".bias")
        return self.op("LayerNormalization", [x, g, b], hint, axis=-1, epsilon=eps)

    def identity(self, x: str, name: str) -> None:
        """Expose ``x`` under the graph output name ``name``."""
        from onnx import helper

        self.nodes.append(helper.make_node("Identity", [x], [name], name=name + "_out"))

    def model(self, name: str, outputs: dict[str, list], producer: str) -> Any:
        """The checked ``onnx.ModelProto``: inputs ``input_ids`` / ``attention_mask`` (int64
        [batch, sequence]), ``outputs`` ``{name: shape}`` (fp32)."""
        from onnx import TensorProto, checker, helper

        batch, seq = "batch", "sequence"
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [batch, seq]),
             helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, [batch, seq])],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)
             for out, shape in outputs.items()],
            initializer=self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name=producer)
        model.ir_version = IR_VERSION
        checker.check_model(model)
        return model


def embeddings(g: GraphBuilder, w: dict[str, np.ndarray], spec: Any) -> str:
    """Word + position (+ token type) embeddings, LayerNorm: [N, L, H]."""
    word = g.const(w["embeddings.word_embeddings.weight"], "word_embeddings")
    pos_table = w["embeddings.position_embeddings.weight"][
        spec.position_offset:spec.position_offset + spec.max_positions]
    types = w.get("embeddings.token_type_embeddings.weight")
    if types is not None and spec.pair_separator is None:
        pos_table = pos_table + types[0]  # single texts: token type 0 everywhere
    pos = g.const(pos_table, "position_embeddings")
    shape = g.op("Shape", [INPUT_IDS], "ids_shape")
    seq_len = g.op("Gather", [shape, g.const(1, "one_idx", np.int64)], "seq_len", axis=0)
    positions = g.op(
        "Range", [g.const(0, "zero", np.int64), seq_len, g.const(1, "one", np.int64)], "positions"
    )
    positions = g.op("Unsqueeze", [positions, g.const([0], "axes0", np.int64)], "positions_2d")
    positions = g.op("Expand", [positions, shape], "position_ids")
    summed = g.op(
        "Add",
        [g.op("Gather", [word, INPUT_IDS], "word_gather"), g.op("Gather", [pos, positions], "pos_gather")],
        "embed_sum",
    )
    if types is not None and spec.pair_separator is not None:
        summed = g.op("Add", [summed, g.op("Gather", [g.const(types, "token_type_embeddings"),
                                                      pair_token_types(g, spec.pair_separator)],
                                           "type_gather")], "embed_sum_types")
    return g.layer_norm(summed, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"],
                        spec.eps, "embeddings.LayerNorm")


def pair_token_types(g: GraphBuilder, separator: int) -> str:
    """int64 [N, L]: 0 up to and including the first ``separator`` token, 1 after it (what a
    BERT tokenizer gives ``[CLS] a [SEP] b [SEP]``); padding after the pair reads 1, masked."""
    sep = g.op("Cast", [g.op("Equal", [INPUT_IDS, g.const(separator, "sep_id", np.int64)], "is_sep")],
               "is_sep_i", to=7)
    before = g.op("CumSum", [sep, g.const(1, "axis1", np.int64)], "seps_before", exclusive=1)
    return g.op("Min", [before, g.const(1, "one_type", np.int64)], "token_type_ids")


def additive_mask(g: GraphBuilder) -> str:
    """[N, 1, 1, L] fp32: 0 for real tokens, MASK_FILTER_VALUE for padding."""
    m = g.op("Unsqueeze", [ATTENTION_MASK, g.const([1], "axes1", np.int64)], "mask_u1")
    m = g.op("Unsqueeze", [m, g.const([2], "axes2", np.int64)], "mask_u2")
    m = g.op("Cast", [m], "mask_f", to=1)
    m = g.op("Sub", [g.const(1.0, "one_f"), m], "mask_inv")
    return g.op("Mul", [m, g.const(MASK_FILTER_VALUE, "mask_filter")], "mask_add")


def relative_position_bias(g: GraphBuilder, table: np.ndarray, span: int) -> str:
    """[1, heads, L, L] fp32: MPNet's bias for query i and key j, ``table[j - i + span - 1]``
    (``table`` [2 * span - 1, heads], the per-distance rows :func:`._arch.mpnet_bias_table`
    precomputes from the bucketed embedding)."""
    shape = g.op("Shape", [INPUT_IDS], "bias_ids_shape")
    seq_len = g.op("Gather", [shape, g.const(1, "bias_one_idx", np.int64)], "bias_seq_len", axis=0)
    r = g.op("Range", [g.const(0, "bias_zero", np.int64), seq_len, g.const(1, "bias_one", np.int64)],
             "bias_range")
    keys = g.op("Unsqueeze", [r, g.const([0], "bias_axes0", np.int64)], "bias_keys")
    queries = g.op("Unsqueeze", [r, g.const([1], "bias_axes1", np.int64)], "bias_queries")
    rel = g.op("Add", [g.op("Sub", [keys, queries], "bias_rel"), g.const(span - 1, "bias_shift", np.int64)],
               "bias_index")
    values = g.op("Gather", [g.const(table, "relative_attention_bias"), rel], "bias_values")
    values = g.op("Transpose", [values], "bias_heads", perm=[2, 0, 1])
    return g.op("Unsqueeze", [values, g.const([0], "bias_axes0b", np.int64)], "position_bias")


def attention(g: GraphBuilder, x: str, mask: str, w: dict[str, np.ndarray], p: str, heads: int,
              hidden: int) -> str:
    head_dim = hidden // heads
    split = g.const([0, 0, heads, head_dim], "split_heads_shape", np.int64)

    def heads_of(name: str, perm: list[int]) -> str:
        y = g.linear(x, w[f"{p}.attention.self.{name}.weight"], w[f"{p}.attention.self.{name}.bias"],
                     f"{p}.{name}")
        return g.op("Transpose", [g.op("Reshape", [y, split], f"{p}.{name}_heads")], f"{p}.{name}_t", perm=perm)

    q = heads_of("query", [0, 2, 1, 3])
    k = heads_of("key", [0, 2, 3, 1])
    v = heads_of("value", [0, 2, 1, 3])
    scores = g.op("MatMul", [q, k], f"{p}.qk")
    scores = g.op("Div", [scores, g.const(np.sqrt(head_dim), "sqrt_head_dim")], f"{p}.qk_scaled")
    scores = g.op("Add", [scores, mask], f"{p}.qk_masked")
    probs = g.op("Softmax", [scores], f"{p}.probs", axis=-1)
    ctx = g.op("MatMul", [probs, v], f"{p}.context")
    ctx = g.op("Transpose", [ctx], f"{p}.context_t", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const([0, 0, hidden], "merge_heads_shape", np.int64)], f"{p}.context_2d")
    out = g.linear(ctx, w[f"{p}.attention.output.dense.weight"], w[f"{p}.attention.output.dense.bias"],
                   f"{p}.attention.output")
    return g.op("Add", [out, x], f"{p}.attention.residual")


def activation(g: GraphBuilder, x: str, kind: str, p: str) -> str:
    """The FFN activation in the form torch exports it."""
    if kind in ERF_GELU:  # x * 0.5 * (1 + erf(x / sqrt 2))
        e = g.op("Erf", [g.op("Div", [x, g.const(np.sqrt(2.0), "sqrt2")], f"{p}.gelu_div")], f"{p}.gelu_erf")
        e = g.op("Add", [e, g.const(1.0, "one_f")], f"{p}.gelu_add")
        return g.op("Mul", [g.op("Mul", [x, e], f"{p}.gelu_mul"), g.const(0.5, "half")], f"{p}.gelu")
    if kind in TANH_GELU:  # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))
        cube = g.op("Pow", [x, g.const(3.0, "three")], f"{p}.gelu_cube")
        inner = g.op("Add", [x, g.op("Mul", [cube, g.const(0.044715, "gelu_c")], f"{p}.gelu_c3")],
                     f"{p}.gelu_inner")
        t = g.op("Tanh", [g.op("Mul", [inner, g.const(np.sqrt(2.0 / np.pi), "gelu_k")], f"{p}.gelu_k")],
                 f"{p}.gelu_tanh")
        t = g.op("Add", [t, g.const(1.0, "one_f")], f"{p}.gelu_add")
        return g.op("Mul", [g.op("Mul", [x, g.const(0.5, "half")], f"{p}.gelu_half"), t], f"{p}.gelu")
    if kind == "relu":
        return g.op("Relu", [x], f"{p}.relu")
    raise ValueError(f"activation {kind!r}")


def layer(g: GraphBuilder, x: str, mask: str, w: dict[str, np.ndarray], i: int, spec: Any) -> str:
    p = f"encoder.layer.{i}"
    h = attention(g, x, mask, w, p, spec.heads, spec.hidden)
    h = g.layer_norm(h, w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"],
                     spec.eps, f"{p}.attention.LayerNorm")
    f = g.linear(h, w[f"{p}.intermediate.dense.weight"], w[f"{p}.intermediate.dense.bias"], f"{p}.intermediate")
    f = g.linear(activation(g, f, spec.activation, p), w[f"{p}.output.dense.weight"],
                 w[f"{p}.output.dense.bias"], f"{p}.output")
    f = g.op("Add", [f, h], f"{p}.output.residual")
    return g.layer_norm(f, w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"], spec.eps,
                        f"{p}.output.LayerNorm")


def encoder(g: GraphBuilder, w: dict[str, np.ndarray], spec: Any) -> str:
    """The last hidden state [N, L, H] of the encoder ``spec`` (an ``_arch.EncoderSpec``)
    over the canonical (BERT-named) weights ``w``."""
    x = embeddings(g, w, spec)
    mask = additive_mask(g)
    if spec.relative_bias is not None:  # MPNet: one [N, H, L, L] bias + mask for every layer
        bias = relative_position_bias(g, spec.relative_bias, spec.max_positions)
        mask = g.op("Add", [bias, mask], "mask_and_position_bias")
    for i in range(spec.layers):
        x = layer(g, x, mask, w, i, spec)
    return x

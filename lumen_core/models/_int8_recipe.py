"""The int8 recipe of the text encoders (``models/minilm_int8.py`` measured it on
all-MiniLM-L6-v2; ``models/text_int8.py`` applies it to any imported BERT-family folder):
calibration over generated texts, SmoothQuant-style smoothing folded into the fp32 weights,
channel pairing, GPTQ-rounded int8 weights and uint8 activations with a scale per token row
(the building blocks are :mod:`._quant`).  ``minilm_int8``'s docstring has the recipe in
order and the figures; this module holds the code, parameterised by the graph (how many
weight MatMuls, its pad id, whether the text is lower-cased first).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..corpus import make_corpus
from ..engine.session import cpu_session
from ..errors import ModelMissingError
from . import _quant
from ._files import PREPARE_COMMAND, ProgressFn
from ._graph import ATTENTION_MASK, INPUT_IDS
from .text_tokenize import pad_batch

#: weights: symmetric int8 per output column (-127..127)
WEIGHT_BITS = 8
#: on CPUs without VNNI, MLAS multiplies uint8 activations by int8 weights with AVX2's
#: ``vpmaddubsw``, which adds the products of rows 2i and 2i+1 into an int16 that saturates
#: (255 * 127 * 2 > 32767: 10-19% error on a random matrix); keeping |w_2i| + |w_2i+1| <= 128
#: in every column makes every pair sum fit (255 * 128 < 32767), so the integer products are
#: exact on every CPU.  Channels are ordered so that a large-weight row sits next to a small
#: one where that is free (GELU and attention-context inputs), the column scale grows where a
#: pair still exceeds the budget, and GPTQ clips what its error feedback pushes over.
PAIR_BUDGET = 128
#: the fixed uint8 zero point of each kind of MatMul input (the scale is per token row):
#: LayerNorm outputs and the attention context are centred by the smoothing, so symmetric;
#: GELU's output lies in [-0.17, inf), so most levels go above zero
ZERO_POINTS = {"layernorm": 128, "context": 128, "gelu": 16}
#: calibration: this many texts of `lumen bench`'s corpus generator with a seed of its own
#: (not DEFAULT_SEED, the benchmark's corpus), run through the fp32 graph on one thread
CALIBRATION_TEXTS = 64
CALIBRATION_SEED = 1
CALIBRATION_BATCH = 32
CALIBRATION_THREADS = 1
#: SmoothQuant's migration strength: channel k of a LayerNorm output or the attention context
#: is divided by s_k = a_k^alpha / w_k^(1 - alpha) (a_k: its calibration half-range after
#: centring, w_k: the largest |weight| it meets), its consumers' weight row k multiplied
SMOOTHING_ALPHA = 0.6
#: GPTQ: diagonal damping (fraction of the mean diagonal) and block size
GPTQ_DAMP = 0.03
GPTQ_BLOCK = 128
#: the quantised graph must match the fp32 one this well on minilm.SELF_CHECK_TEXTS
SELF_CHECK_MIN_COSINE = 0.99
def matmul_inputs(g: Any, expected: int, label: str) -> dict:
    """``{input tensor: [(MatMul node, weight, bias)]}`` of the fp32 graph's weight MatMuls
    (Q, K and V share one input); a ModelMissingError if the graph is not the expected one."""
    matmuls = g.weight_matmuls()
    if len(matmuls) != expected or any(b is None for _, _, b in matmuls):
        raise ModelMissingError(f"{label}: expected {expected} weight MatMuls with a "
                                f"bias in the fp32 graph, found {len(matmuls)}",
                                command=PREPARE_COMMAND)
    inputs: dict[str, list] = {}
    for node, w, b in matmuls:
        inputs.setdefault(node.input[0], []).append((node, w, b))
    return inputs


def quantize_model(model: Any, tokenizer: Any, progress: Optional[ProgressFn], expected: int,
                   label: str, pad_token_id: int = 0, lower: bool = False) -> int:
    """Rewrite the fp32 ``model`` (an encoder graph of ``_graph``: ``expected`` weight MatMuls)
    in place into the int8 graph; return the number of MatMuls quantised."""
    say = progress or (lambda _msg: None)
    g = _quant.Graph(model)
    inputs = matmul_inputs(g, expected, label)
    say(f"{label}: calibration ({CALIBRATION_TEXTS} texts through the fp32 graph)")
    plan = Folds(g, inputs, calibrate(model, tokenizer, list(inputs), pad_token_id, lower))
    say(f"{label}: GPTQ rounding of {expected} weight matrices to {WEIGHT_BITS} bits")
    # GPTQ treats output columns independently given the input's Hessian: one call per input
    # (Q, K and V side by side) costs one inverse instead of three
    rounded: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for x, users in inputs.items():
        w_q, w_scale = _quant.gptq(np.concatenate([g.array(w) for _, w, _ in users], axis=1),
                                   plan.hessian(x), WEIGHT_BITS, GPTQ_DAMP, GPTQ_BLOCK,
                                   PAIR_BUDGET)
        edges = np.cumsum([0] + [g.array(w).shape[1] for _, w, _ in users])
        for (node, _, _), lo, hi in zip(users, edges[:-1], edges[1:], strict=True):
            rounded[node.name] = (w_q[:, lo:hi], w_scale[lo:hi])
    rq = _quant.RowQuantiser(g)
    for node in list(model.graph.node):
        if node.name not in rounded:
            rq.nodes.append(node)
            rq.nodes.extend(plan.after.get(node.name, ()))
            continue
        x = node.input[0]
        rq.matmul(node, plan.renamed.get(x, x), *rounded[node.name], ZERO_POINTS[plan.kind[x]])
    g.commit(rq.nodes, drop=[w for users in inputs.values() for _, w, _ in users],
             added=rq.added + plan.added)
    return len(rounded)


def calibration_texts(lower: bool = False) -> list[str]:
    """CALIBRATION_TEXTS texts of ``lumen bench``'s corpus generator (CALIBRATION_SEED)."""
    texts = make_corpus(CALIBRATION_TEXTS, CALIBRATION_SEED)
    return [t.lower() for t in texts] if lower else texts


def calibrate(model: Any, tokenizer: Any, names: list, pad_token_id: int = 0,
              lower: bool = False) -> dict:
    """``{tensor: ActivationStats}`` of the fp32 ``model``'s tensors ``names`` over the real
    tokens of the calibration texts (sorted batches, one ORT thread: the same numbers on
    every run of one machine)."""
    import onnx
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in names:
        probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    sess = cpu_session(probe.SerializeToString(), intra_op_threads=CALIBRATION_THREADS)
    del probe
    texts = calibration_texts(lower)
    ids = sorted((enc.ids for enc in tokenizer.encode_batch(texts)), key=len)
    stats: dict = {}
    for i in range(0, len(ids), CALIBRATION_BATCH):
        input_ids, mask = pad_batch(ids[i:i + CALIBRATION_BATCH], pad_token_id)
        outs = sess.run(names, {INPUT_IDS: input_ids, ATTENTION_MASK: mask})
        real = mask.reshape(-1).astype(bool)
        for name, out in zip(names, outs, strict=True):
            rows = out.reshape(-1, out.shape[-1])[real]
            stats.setdefault(name, _quant.ActivationStats(rows.shape[1])).add(rows)
    return stats


class Folds:
    """Which kind each MatMul input is, and the per-channel maps folded into the fp32
    weights where they cost nothing at run time (the fp32 graph computes the same function):

    - smoothing (SmoothQuant-style) of LayerNorm outputs and the attention context: a
      LayerNorm output gets a second LayerNorm with gamma / s and (beta - mu) / s for its
      MatMuls (the residual keeps the original); the context ``probs @ V`` is shifted and
      scaled through V's projection (softmax rows sum to 1); the consumers' weight rows are
      multiplied by s and ``mu @ W`` is added to their biases.  GELU's output is not smoothed
      (a nonlinearity sits before it);
    - pairing: the GELU output's channels (through the FFN input's columns) and the
      context's within each head (through V's columns) are reordered so that each adjacent
      pair of weight rows holds a large and a small one (PAIR_BUDGET)."""

    def __init__(self, g: Any, inputs: dict, stats: dict) -> None:
        from onnx import helper

        self.g, self.stats = g, stats
        self.kind: dict[str, str] = {}
        self.affine: dict[str, tuple] = {}  # input -> (mu, s)
        self.renamed: dict[str, str] = {}  # input -> the smoothed tensor the MatMuls read
        self.after: dict[str, list] = {}  # node name -> nodes to insert after it
        self.added: list = []
        for x, users in inputs.items():
            producer = g.producer.get(x)
            value = self._value_projection(x)
            if producer is not None and producer.op_type == "LayerNormalization":
                self.kind[x] = "layernorm"
            elif value is not None:
                self.kind[x] = "context"
            else:
                self.kind[x] = "gelu"
                continue
            st = stats[x]
            mu = (st.lo + st.hi) / 2.0
            half = (st.hi - st.lo) / 2.0
            w_max = np.max([np.abs(g.array(w)).max(axis=1) for _, w, _ in users], axis=0)
            ok = (half > 0) & (w_max > 0)
            s = np.ones_like(mu)
            s[ok] = half[ok] ** SMOOTHING_ALPHA / w_max[ok] ** (1.0 - SMOOTHING_ALPHA)
            s[ok] /= np.exp(np.mean(np.log(s[ok])))  # geometric mean 1
            self.affine[x] = (mu, s)
            for _, w, b in users:
                weight = g.array(w).astype(np.float64)
                g.set_array(b, g.array(b) + mu @ weight)
                g.set_array(w, weight * s[:, None])
            if self.kind[x] == "layernorm":
                pre, gamma, beta = producer.input
                p = f"{x}.smooth"
                self.added += [self._init(g.array(gamma) / s, p + ".gamma"),
                               self._init((g.array(beta) - mu) / s, p + ".beta")]
                node = helper.make_node("LayerNormalization", [pre, p + ".gamma", p + ".beta"],
                                        [p], name=p + "_node")
                node.attribute.extend(producer.attribute)
                self.after.setdefault(producer.name, []).append(node)
                self.renamed[x] = p
            else:
                assert value is not None  # kind "context": a value projection feeds it
                w_v, b_v = value
                g.set_array(w_v, g.array(w_v) / s[None, :])
                g.set_array(b_v, (g.array(b_v) - mu) / s)
        self.perm: dict[str, np.ndarray] = {}  # input -> the channel order its MatMuls see
        for x, users in inputs.items():
            self._pair_up(x, users)

    def hessian(self, x: str) -> np.ndarray:
        """GPTQ's Hessian for the MatMuls reading ``x``: the second moment of the smoothed,
        reordered input they see."""
        st = self.stats[x]
        k = len(st.total)
        shift, scale = self.affine.get(x, (np.zeros(k), np.ones(k)))
        h = st.second_moment(shift, scale)
        order = self.perm.get(x)
        return h if order is None else h[order][:, order]

    def _pair_up(self, x: str, users: list) -> None:
        """Reorder the channels of ``x`` (where its producer's weights allow it for free) so
        that each adjacent pair (2i, 2i+1) holds a row with large weights and one with small."""
        g = self.g
        if self.kind[x] == "gelu":
            up = self._ffn_input(x)
            block = None
        elif self.kind[x] == "context":
            up = self._value_projection(x)
            block = self._head_dim(x)
        else:
            return
        if up is None:
            return
        weight = np.abs(np.concatenate([g.array(w) for _, w, _ in users], axis=1))
        # a row's weight relative to its columns' largest, on average
        score = (weight / np.maximum(weight.max(axis=0), np.finfo(np.float64).tiny)).mean(axis=1)
        k = len(score)
        block = block or k
        if k % block or block % 2:
            return
        perm = np.empty(k, dtype=np.int64)
        for b0 in range(0, k, block):
            idx = b0 + np.argsort(-score[b0:b0 + block], kind="stable")
            n = len(idx)
            pairs = np.stack([idx[: n // 2], idx[n // 2:][::-1]], axis=1).reshape(-1)
            perm[b0:b0 + block] = pairs
        w_up, b_up = up
        g.set_array(w_up, g.array(w_up)[:, perm])
        g.set_array(b_up, g.array(b_up)[perm])
        for _, w, _ in users:
            g.set_array(w, g.array(w)[perm])
        self.perm[x] = perm

    def _ffn_input(self, x: str) -> Optional[tuple]:
        """(weight, bias) of the MatMul + Add whose output reaches ``x`` through elementwise
        ops with scalar constants only (GELU), so permuting its columns permutes ``x``."""
        g = self.g
        frontier, seen = [x], set()
        while frontier:
            t = frontier.pop()
            node = g.producer.get(t)
            if node is None or t in seen:
                continue
            seen.add(t)
            if node.op_type == "Add":
                bias = [i for i in node.input if i in g.arrays and g.arrays[i].ndim == 1]
                src = [g.producer.get(i) for i in node.input if i not in g.arrays]
                if len(bias) == 1 and len(src) == 1 and src[0] is not None \
                        and src[0].op_type == "MatMul" and src[0].input[1] in g.arrays:
                    return src[0].input[1], bias[0]
            if node.op_type not in ("Add", "Mul", "Div", "Erf"):
                return None
            for i in node.input:
                if i in g.arrays:
                    if g.arrays[i].size != 1:
                        return None
                else:
                    frontier.append(i)
        return None

    def _head_dim(self, x: str) -> int:
        """The attention head size of context ``x`` (its merge-heads Reshape's last dim)."""
        t = self.g.producer[self.g.producer[x].input[0]].input[0]  # Reshape <- Transpose
        v_heads = self.g.producer[self.g.producer[t].input[1]]  # probs @ V: V's Transpose
        return int(self.g.array(self.g.producer[v_heads.input[0]].input[1])[-1])

    @staticmethod
    def _init(value: np.ndarray, name: str) -> Any:
        from onnx import numpy_helper

        return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)

    #: from the attention context back to V's projection, as _graph writes it:
    #: merge heads (Reshape, Transpose), probs @ V (MatMul, input 1), split heads (Transpose,
    #: Reshape), V's bias Add and its MatMul
    _CONTEXT_PATH = ("Reshape", "Transpose", "MatMul", "Transpose", "Reshape", "Add", "MatMul")

    def _value_projection(self, x: str) -> Optional[tuple]:
        """(weight, bias) names of the value projection whose heads make ``x``, if ``x`` is
        an attention context."""
        g, t, node = self.g, x, None
        for step, op in enumerate(self._CONTEXT_PATH):
            node = g.producer.get(t)
            if node is None or node.op_type != op:
                return None
            if step == 2:
                t = node.input[1]
            elif op == "Add":
                bias = [i for i in node.input if i in g.arrays]
                t = next(i for i in node.input if i not in g.arrays)
            else:
                t = node.input[0]
        assert node is not None
        if node.input[1] not in g.arrays or len(bias) != 1:
            return None
        return node.input[1], bias[0]

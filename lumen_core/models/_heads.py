"""What follows the encoder in an imported text model's graph: sentence-transformers' pooling
modes and Normalize (``embed``), or a one-label classifier head (``rerank``).

Each pooling mode is sentence-transformers' ``Pooling._forward_padded`` for right-padded rows
(the graph's contract), written so that ORT runs it as a few batched ops:

- ``mean``: sum over real tokens / max(count, 1e-9), the sum as one ``[N,1,L] x [N,L,H]``
  MatMul; ``mean_sqrt_len_tokens``: the same sum / sqrt(max(count, 1e-9));
- ``weightedmean``: weights 1..L on real tokens (pad length 0 for right padding), sum / sum
  of weights;
- ``cls``: the first real token, position 0 of a right-padded row;
- ``max``: the element-wise max over real tokens (padding set to -inf);
- ``lasttoken``: the last real token, at index count - 1 of a right-padded row.

Several modes concatenate in the order the folder lists them (``pooling`` ``"max+mean"``).
Normalize is ``F.normalize``: ``x / max(||x||, 1e-12)``.
"""
from __future__ import annotations

import numpy as np

from ._graph import ATTENTION_MASK, GraphBuilder

POOLING_MODES = ("cls", "mean", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean")
# sentence-transformers clamps the token count (torch.clamp(min=1e-9)) and F.normalize's eps.
POOL_MIN_COUNT = 1e-9
NORMALIZE_EPS = 1e-12


class _Mask:
    """The mask in the forms several modes share, built once."""

    def __init__(self, g: GraphBuilder) -> None:
        self.g = g
        self._f: str = ""
        self._count: str = ""

    @property
    def f(self) -> str:  # fp32 [N, L]
        if not self._f:
            self._f = self.g.op("Cast", [ATTENTION_MASK], "pool_mask_f", to=1)
        return self._f

    @property
    def count(self) -> str:  # fp32 [N, 1], clamped
        if not self._count:
            g = self.g
            count = g.op("ReduceSum", [self.f, g.const([1], "axes1_pool", np.int64)], "pool_count", keepdims=1)
            self._count = g.op("Max", [count, g.const(POOL_MIN_COUNT, "pool_min_count")], "pool_count_clamped")
        return self._count


def _weighted_sum(g: GraphBuilder, weights: str, hidden: str, hint: str) -> str:
    """sum_t weights[n, t] * hidden[n, t, :] as one batched MatMul: [N, H]."""
    w3 = g.op("Unsqueeze", [weights, g.const([1], "axes1_u", np.int64)], hint + "_w3d")
    summed = g.op("MatMul", [w3, hidden], hint + "_sum_3d")
    return g.op("Squeeze", [summed, g.const([1], "axes1_s", np.int64)], hint + "_sum")


def _first_token(g: GraphBuilder, hidden: str, hint: str) -> str:
    return g.op("Gather", [hidden, g.const(0, "first_idx", np.int64)], hint, axis=1)


def pool(g: GraphBuilder, hidden: str, modes: tuple[str, ...]) -> str:
    """The pooled vector [N, len(modes) * H] of the last hidden state ``hidden`` [N, L, H]."""
    mask = _Mask(g)
    parts = []
    mean_sum = ""
    for mode in modes:
        if mode in ("mean", "mean_sqrt_len_tokens"):
            if not mean_sum:
                mean_sum = _weighted_sum(g, mask.f, hidden, "pool")
            if mode == "mean":
                parts.append(g.op("Div", [mean_sum, mask.count], "pool_mean"))
            else:
                root = g.op("Sqrt", [mask.count], "pool_sqrt_count")
                parts.append(g.op("Div", [mean_sum, root], "pool_mean_sqrt_len"))
        elif mode == "weightedmean":
            shape = g.op("Shape", [ATTENTION_MASK], "wm_shape")
            length = g.op("Gather", [shape, g.const(1, "wm_one_idx", np.int64)], "wm_len", axis=0)
            steps = g.op("Range", [g.const(1.0, "wm_start"), g.op("Add", [
                g.op("Cast", [length], "wm_len_f", to=1), g.const(1.0, "wm_one")], "wm_stop"),
                g.const(1.0, "wm_step")], "wm_steps")
            weights = g.op("Mul", [mask.f, steps], "wm_weights")
            total = g.op("ReduceSum", [weights, g.const([1], "wm_axes1", np.int64)], "wm_total", keepdims=1)
            total = g.op("Max", [total, g.const(POOL_MIN_COUNT, "wm_min")], "wm_total_clamped")
            parts.append(g.op("Div", [_weighted_sum(g, weights, hidden, "wm"), total], "pool_weightedmean"))
        elif mode == "cls":
            parts.append(_first_token(g, hidden, "pool_cls"))
        elif mode == "max":
            real = g.op("Cast", [g.op("Unsqueeze", [ATTENTION_MASK, g.const([2], "axes2_max", np.int64)],
                                      "max_mask_3d")], "max_mask_b", to=9)
            masked = g.op("Where", [real, hidden, g.const(-np.inf, "minus_inf")], "max_masked")
            parts.append(g.reduce("ReduceMax", masked, [1], "pool_max", keepdims=0))
        elif mode == "lasttoken":
            mask_i = g.op("ReduceSum", [ATTENTION_MASK, g.const([1], "lt_axes1", np.int64)], "lt_count",
                          keepdims=1)
            last = g.op("Sub", [mask_i, g.const(1, "lt_one", np.int64)], "lt_last")
            shape = g.op("Shape", [ATTENTION_MASK], "lt_shape")
            length = g.op("Gather", [shape, g.const(1, "lt_one_idx", np.int64)], "lt_len", axis=0)
            index = g.op("Range", [g.const(0, "lt_zero", np.int64), length, g.const(1, "lt_step", np.int64)],
                         "lt_index")
            onehot = g.op("Cast", [g.op("Equal", [index, last], "lt_is_last")], "lt_onehot", to=1)
            onehot = g.op("Mul", [onehot, mask.f], "lt_onehot_real")
            parts.append(_weighted_sum(g, onehot, hidden, "pool_lasttoken"))
        else:
            raise ValueError(f"pooling mode {mode!r}")
    return parts[0] if len(parts) == 1 else g.op("Concat", parts, "pool_concat", axis=1)


def normalize(g: GraphBuilder, x: str) -> str:
    norm = g.reduce("ReduceL2", x, [1], "l2", keepdims=1)
    norm = g.op("Max", [norm, g.const(NORMALIZE_EPS, "l2_eps")], "l2_clamped")
    return g.op("Div", [x, norm], "normalized")


def classifier(g: GraphBuilder, hidden: str, head: dict[str, np.ndarray]) -> str:
    """Logits [N, labels]: dense + tanh on the first token, then the output projection (BERT's
    pooler + classifier and RoBERTa's classification head have this one shape)."""
    first = _first_token(g, hidden, "cls_token")
    h = g.op("Tanh", [g.linear(first, head["dense.weight"], head["dense.bias"], "head.dense")], "head.tanh")
    return g.linear(h, head["out.weight"], head["out.bias"], "head.out")


def add_embed_outputs(g: GraphBuilder, hidden: str, modes: tuple[str, ...], normalized: bool,
                      embedding: str, pooled: str) -> None:
    """``pooled`` (before normalisation) and ``embedding`` (what ``encode`` returns)."""
    vec = pool(g, hidden, modes)
    g.identity(normalize(g, vec) if normalized else vec, embedding)
    g.identity(vec, pooled)


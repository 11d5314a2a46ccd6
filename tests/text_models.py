"""Prepared text-model directories for the serving tests, made without the importer.

The importer (``models/st_import.py``) writes ``model.onnx``, ``tokenizer.json`` and a
``manifest.json`` with a ``"text_model"`` block (TEXT_MODEL_CONTRACT.md).  These helpers make
the same layout from what the test session already has: the prepared all-MiniLM-L6-v2 under a
new name with a block of its own (prompts, lower-casing), and a tiny cross-encoder-like graph
(``input_ids`` / ``attention_mask`` -> ``logits`` [N, 1]: an embedding table, a masked mean, a
dot product) whose scores numpy reproduces (:func:`rerank_reference`).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import numpy as np
import onnx_models as M
from onnx import TensorProto, helper, numpy_helper

from lumen_core import models
from lumen_core.models import minilm

#: the MiniLM block the brief names: all-MiniLM-L6-v2 with e5-style prompts
MINILM_BLOCK = {
    "kind": "embed", "architecture": "bert", "dimension": 384, "max_seq_length": 256,
    "max_positions": 512, "do_lower_case": False, "pad_token_id": 0, "pooling": "mean",
    "normalize": True, "prompts": {"query": "query: ", "passage": "passage: "},
    "default_prompt_name": None, "num_labels": 1, "source": "tests", "content_hash": "",
}
#: width of the tiny reranker's embedding table
RERANK_WIDTH = 8
RERANK_SEED = 7


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_block(directory: pathlib.Path, block: dict, files: tuple = ()) -> None:
    """Set ``directory/manifest.json``'s ``"text_model"`` block (and its output entries for
    ``files``, as the importer lists them)."""
    manifest = models.read_manifest(directory) or {"format": 1, "name": directory.name}
    manifest["text_model"] = block
    if files:
        manifest["outputs"] = {f: {"bytes": (directory / f).stat().st_size, "sha256": ""}
                               for f in files}
    (directory / models.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))


def minilm_as(home: pathlib.Path, name: str, source_home: pathlib.Path, **overrides: Any) -> pathlib.Path:
    """The prepared MiniLM of ``source_home`` copied (hard links) into ``home``'s store as
    ``name``, with a ``"text_model"`` block (:data:`MINILM_BLOCK` updated by ``overrides``)."""
    src = models.model_dir(models.MINILM, source_home)
    dst = models.models_dir(home) / name
    dst.mkdir(parents=True, exist_ok=True)
    for f in (models.MODEL_FILE, minilm.TOKENIZER_FILE, models.MANIFEST_NAME):
        if not (dst / f).exists():
            _link_or_copy(str(src / f), str(dst / f))
    manifest = json.loads((src / models.MANIFEST_NAME).read_text())
    manifest["name"] = name
    (dst / models.MANIFEST_NAME).unlink()
    (dst / models.MANIFEST_NAME).write_text(json.dumps(manifest))
    write_block(dst, {**MINILM_BLOCK, **overrides})
    return dst


def rerank_weights(vocab: int) -> tuple:
    rng = np.random.default_rng(RERANK_SEED)
    table = (rng.standard_normal((vocab, RERANK_WIDTH)) * 0.5).astype(np.float32)
    w = rng.standard_normal((RERANK_WIDTH, 1)).astype(np.float32)
    return table, w


def tiny_reranker(directory: pathlib.Path, tokenizer: pathlib.Path, max_seq_length: int = 32,
                  **overrides: Any) -> pathlib.Path:
    """A prepared rerank directory: ``logits = mean(table[ids] over the mask) @ w`` plus a
    term that depends on the position of the first [SEP] (so that the pair boundary counts)."""
    directory.mkdir(parents=True, exist_ok=True)
    _link_or_copy(str(tokenizer), str(directory / minilm.TOKENIZER_FILE))
    vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    table, w = rerank_weights(len(vocab))
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"]),           # [N, L, W]
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),          # [N, L, 1]
        helper.make_node("Mul", ["emb", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0),  # [N, W]
        helper.make_node("ReduceSum", ["maskf", "axis1"], ["count"], keepdims=1),    # [N, 1]
        helper.make_node("Div", ["summed", "count"], ["mean"]),
        helper.make_node("MatMul", ["mean", "w"], ["logits"]),                 # [N, 1]
    ]
    inits = [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array([2], np.int64), "axis2")]
    graph = helper.make_graph(
        nodes, "tiny_reranker",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "L"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "L"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 1])], inits)
    M._save(graph, directory / models.MODEL_FILE)
    block = {"kind": "rerank", "architecture": "bert", "dimension": 1,
             "max_seq_length": max_seq_length, "max_positions": 512, "do_lower_case": False,
             "pad_token_id": 0, "pooling": "", "normalize": False, "prompts": {},
             "default_prompt_name": None, "num_labels": 1, "source": "tests", "content_hash": ""}
    write_block(directory, {**block, **overrides},
                (models.MODEL_FILE, minilm.TOKENIZER_FILE))
    return directory


def rerank_reference(tokenizer_path: pathlib.Path, query: str, docs: list,
                     max_seq_length: int) -> np.ndarray:
    """The tiny reranker's raw scores, computed as CrossEncoder feeds a model: each (query,
    document) pair encoded by the tokenizer, longest_first truncation to max_seq_length."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.no_padding()
    tok.enable_truncation(max_seq_length, strategy="longest_first")
    table, w = rerank_weights(tok.get_vocab_size())
    out = []
    for d in docs:
        ids = tok.encode(query, d).ids
        out.append(float(table[ids].mean(axis=0) @ w[:, 0]))
    return np.array(out, dtype=np.float32)

"""int8 for any imported BERT-family embedding model (``lumen models import DIR --int8``).

The recipe measured on all-MiniLM-L6-v2 (``models/minilm_int8.py``, code in
:mod:`._int8_recipe`) applied to the fp32 graph :mod:`.st_import` wrote: calibration over
generated texts, smoothing and pairing folded into the weights, GPTQ int8 weights, uint8
activations with a scale per token row.  Then a self-check: the int8 graph's pooled vectors
over the calibration texts against the fp32 graph's; below SELF_CHECK_MIN_COSINE the import is
refused (the fp32 model is what that folder should be served as), nothing is written.
"""
from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from ..engine.session import cpu_session
from ._files import MODEL_FILE, ProgressFn
from ._graph import ATTENTION_MASK, INPUT_IDS
from ._int8_recipe import (
    CALIBRATION_BATCH,
    SELF_CHECK_MIN_COSINE,
    calibration_texts,
    quantize_model,
)
from ._st_folder import FolderSpec, ModelImportError
from .text_tokenize import pad_batch

GRAPH = "int8-row-smooth-gptq"
#: weight MatMuls per encoder layer: Q, K, V, attention output, FFN in, FFN out
MATMULS_PER_LAYER = 6
POOLED = "pooled"
#: the BERT-pattern encoders the recipe's graph walk knows (ModernBERT's bias-free gated layers not)
INT8_FAMILIES = ("bert", "roberta", "xlm-roberta", "mpnet", "distilbert")


def _layers(spec: FolderSpec) -> int:
    return int(spec.config.get("num_hidden_layers", spec.config.get("n_layers", 0)))


def _pooled(path: pathlib.Path, ids: list, pad: int) -> np.ndarray:
    sess = cpu_session(path)
    out = []
    for i in range(0, len(ids), CALIBRATION_BATCH):
        input_ids, mask = pad_batch(ids[i:i + CALIBRATION_BATCH], pad)
        out.append(sess.run([POOLED], {INPUT_IDS: input_ids, ATTENTION_MASK: mask})[0])
    return np.concatenate(out).astype(np.float64)


def check_int8(spec: FolderSpec) -> None:
    """ModelImportError unless ``spec`` is a model ``--int8`` can quantize (an embedding model
    of a BERT-pattern family built from safetensors): asked before anything is built."""
    if spec.kind != "embed" or spec.onnx is not None or spec.family not in INT8_FAMILIES:
        what = ("a cross-encoder" if spec.kind != "embed" else "an ONNX export" if spec.onnx is not None
                else f"a {spec.family} model")
        raise ModelImportError(spec.folder, (spec.onnx or spec.weights[-1]).name,
                               f"--int8 is for embedding models built from safetensors, not {what}")


def quantize_dir(directory: pathlib.Path, spec: FolderSpec, text_model: dict, say: ProgressFn,
                 label: str) -> dict[str, Any]:
    """Replace ``directory``'s fp32 model.onnx by its int8 graph; return the manifest details
    (graph, int8_matmuls, self_check_cosine).  ModelImportError when the model is not an
    imported BERT-family embedding graph or the self-check fails."""
    import onnx
    from tokenizers import Tokenizer

    check_int8(spec)
    fp32 = directory / "fp32.onnx"
    (directory / MODEL_FILE).replace(fp32)
    model = onnx.load(str(fp32))
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    pad, lower = int(text_model["pad_token_id"]), bool(text_model["do_lower_case"])
    n = quantize_model(model, tokenizer, say, MATMULS_PER_LAYER * _layers(spec), label, pad, lower)
    onnx.checker.check_model(model)
    onnx.save_model(model, str(directory / MODEL_FILE))
    del model
    ids = sorted((e.ids for e in tokenizer.encode_batch(calibration_texts(lower))), key=len)
    a, b = _pooled(fp32, ids, pad), _pooled(directory / MODEL_FILE, ids, pad)
    cosine = float(((a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())
    fp32.unlink()
    if not cosine >= SELF_CHECK_MIN_COSINE:
        raise ModelImportError(spec.folder, spec.weights[-1].name,
                               f"the int8 graph reaches cosine {cosine:.4f} to fp32 over its {len(ids)} "
                               f"calibration texts (< {SELF_CHECK_MIN_COSINE}): not written; import "
                               "without --int8 to serve the fp32 model")
    say(f"{label}: int8 self-check: min cosine {cosine:.4f} to fp32 over {len(ids)} calibration texts")
    return {"graph": GRAPH, "int8_matmuls": n, "self_check_cosine": round(cosine, 6)}

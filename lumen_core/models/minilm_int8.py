"""all-MiniLM-L6-v2 with int8 weights (``all-minilm-l6-v2-int8``), for CPU serving.

Built by ``lumen models prepare`` from the same fp32 graph :mod:`.minilm` writes (rebuilt in
memory from the package's safetensors, so this preparer does not depend on the fp32 output
being present), with ONNX Runtime's dynamic quantisation: every weight MatMul becomes
``DynamicQuantizeLinear`` + ``MatMulInteger`` with int8 weights quantised per output channel,
except the MatMuls in ``FP32_MATMULS``, which stay fp32.  The graph's I/O is the fp32 model's
(``input_ids`` / ``attention_mask`` -> ``embedding``), so the ``text_embedding`` backend serves
it unchanged.

How the mix was chosen (2-core box, ORT 1.32, 2 intra-op threads; ``bench/bench_int8.py``):
per-tensor weights reach only cosine 0.61 on the reference texts and per-channel 0.983; the
single MatMuls whose quantisation costs most were found one node at a time (quantise only
that node) and then by leaving one more out of the mix at a time.  Keeping layer 0's FFN
output and attention output projections and layer 4's FFN input projection in fp32 gives
cosine >= 0.992 against sentence-transformers on every non-empty reference text embedded on
its own.  Weight-only ``MatMulNBits`` (8 bits, block 32, int8 compute) was more accurate
(0.999) but slower than fp32 on this CPU, and 4 bits lost accuracy (0.89).

Dynamic quantisation picks one activation scale per tensor, i.e. per *batch*: a text batched
with others may come out slightly differently than alone (min cosine 0.982 on the reference
texts batched 16 or 32 together, README "int8").

The quantiser's output is deterministic for a given ONNX Runtime; the manifest records the
ORT version with the source hashes (a different ORT rebuilds) and the output's sha256 like
every prepared model.
"""
from __future__ import annotations

import pathlib
import shutil
from typing import Any, Optional

import numpy as np

from ..engine.session import cpu_session
from ..errors import ModelMissingError
from . import minilm
from ._files import MODEL_FILE, PREPARE_COMMAND, ProgressFn

MODEL_ID = "all-minilm-l6-v2-int8"
MODEL_VERSION = "1"
# Bump when the quantisation recipe changes, so `prepare` rebuilds old outputs.
REVISION = 1
#: name prefixes (as minilm.build_graph names them) of the weight MatMuls kept in fp32
FP32_MATMULS = (
    "encoder.layer.0.output.matmul",
    "encoder.layer.0.attention.output.matmul",
    "encoder.layer.4.intermediate.matmul",
)
#: weights quantised per output channel (per-tensor: cosine 0.61 on the reference texts)
PER_CHANNEL = True
#: the quantised graph must match the fp32 one this well on minilm.SELF_CHECK_TEXTS
SELF_CHECK_MIN_COSINE = 0.99


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def source_info() -> dict[str, Any]:
    """The fp32 model's source (package, hashes) plus what else decides the output."""
    return {**minilm.source_info(), "int8_revision": REVISION, "onnxruntime": _ort_version(),
            "fp32_matmuls": list(FP32_MATMULS), "per_channel": PER_CHANNEL}


def excluded_nodes(model: Any) -> list:
    """Names of the MatMul nodes of ``model`` that stay fp32."""
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and n.name.startswith(FP32_MATMULS)]


def quantize(fp32_path: pathlib.Path, out_path: pathlib.Path) -> list:
    """Write the int8 model of ``fp32_path`` to ``out_path``; return the fp32-kept nodes."""
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    keep = excluded_nodes(onnx.load(str(fp32_path), load_external_data=False))
    if len(keep) != len(FP32_MATMULS):
        raise ModelMissingError(f"{MODEL_ID}: expected {len(FP32_MATMULS)} MatMuls named "
                                f"{FP32_MATMULS} in the fp32 graph, found {keep}",
                                command=PREPARE_COMMAND)
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # "please consider pre-processing": not for this graph
    try:
        quantize_dynamic(str(fp32_path), str(out_path), per_channel=PER_CHANNEL,
                         weight_type=QuantType.QInt8, nodes_to_exclude=keep)
    finally:
        logging.disable(previous)
    return keep


def build(out_dir: pathlib.Path, progress: Optional[ProgressFn] = None) -> dict[str, Any]:
    """Write model.onnx (int8) and tokenizer.json into ``out_dir``; return manifest details."""
    import onnx

    say = progress or (lambda _msg: None)
    src = minilm.source_dir()
    say(f"{MODEL_ID}: building the fp32 graph from {minilm.DIST}")
    weights, config = minilm.load_weights(src)
    plain = out_dir / "fp32.onnx"
    onnx.save_model(minilm.build_graph(weights, config), str(plain))
    del weights
    say(f"{MODEL_ID}: dynamic int8 quantisation (per-channel, {len(FP32_MATMULS)} MatMuls "
        f"kept fp32)")
    keep = quantize(plain, out_dir / MODEL_FILE)
    shutil.copyfile(src / minilm.TOKENIZER_FILE, out_dir / minilm.TOKENIZER_FILE)
    tokenizer = minilm.load_tokenizer(out_dir / minilm.TOKENIZER_FILE)
    texts = [t for t in minilm.SELF_CHECK_TEXTS if t]
    fp32_sess, int8_sess = cpu_session(plain), cpu_session(out_dir / MODEL_FILE)
    cos = min(float(np.dot(minilm.embed(fp32_sess, tokenizer, [t])[0],  # both L2-normalised
                           minilm.embed(int8_sess, tokenizer, [t])[0])) for t in texts)
    plain.unlink()
    if cos < SELF_CHECK_MIN_COSINE:
        raise ModelMissingError(f"{MODEL_ID}: the quantised graph reaches cosine {cos:.4f} "
                                f"against fp32 on the self-check texts (< "
                                f"{SELF_CHECK_MIN_COSINE}); this ONNX Runtime "
                                f"({_ort_version()}) quantises differently: prepare the "
                                f"other models alone with `{PREPARE_COMMAND} {minilm.MODEL_ID} "
                                f"silero-vad`", command=PREPARE_COMMAND)
    say(f"{MODEL_ID}: self-check cosine vs fp32 {cos:.4f}")
    return {
        "model_id": MODEL_ID,
        "model_version": MODEL_VERSION,
        "revision": REVISION,
        "graph": "int8-dynamic",
        "fp32_nodes": keep,
        "self_check_cosine": round(cos, 6),
        "inputs": {minilm.INPUT_IDS: ["int64", ["N", "L"]],
                   minilm.ATTENTION_MASK: ["int64", ["N", "L"]]},
        "outputs_spec": {minilm.OUTPUT: ["float32", ["N", minilm.EMBEDDING_DIM]]},
        "max_seq_length": minilm.MAX_SEQ_LENGTH,
        "output_files": [MODEL_FILE, minilm.TOKENIZER_FILE],
    }

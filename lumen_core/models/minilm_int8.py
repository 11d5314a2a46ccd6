"""all-MiniLM-L6-v2 with int8 weights and activations (``all-minilm-l6-v2-int8``), for CPU
serving.

Built by ``lumen models prepare`` from the same fp32 graph :mod:`.minilm` writes (rebuilt in
memory from the package's safetensors, so this preparer does not depend on the fp32 output
being present).  Revision 4's recipe, in order (the int8 building blocks live in
:mod:`._quant`):

1. **Calibration.** CALIBRATION_TEXTS texts of ``lumen bench``'s corpus generator, with a seed
   of their own (not the benchmark corpus), run through the fp32 graph on one ORT thread;
   per channel of every MatMul input: min, max, sum and ``X^T X`` over the real tokens.
2. **Smoothing** (SmoothQuant-style, folded into fp32 weights, free at run time): each channel
   of a LayerNorm output and of the attention context is centred on its calibration
   mid-range and divided by ``s_k = a_k^alpha / w_k^(1 - alpha)``; the consumers' weight rows
   are multiplied by ``s`` and ``mu @ W`` goes into their biases.  A LayerNorm output gets a
   second LayerNorm with the folded gamma/beta for its MatMuls (the residual keeps the
   original); the context is folded through V's projection (softmax rows sum to 1).  This
   takes the outlier channels (BERT's residual stream has a few with magnitude ~30 or a
   constant offset of ~5) out of the per-row activation range.
3. **Pairing** (free as well): the channels of the GELU output and of the context (within each
   head) are reordered, through the FFN input's / V's output columns, so that each adjacent
   pair of weight rows holds a large and a small one (see PAIR_BUDGET).
4. **Weights:** 8-bit symmetric per output column, rounded by GPTQ with the calibration
   Hessians (act-order, damping GPTQ_DAMP), with ``|w_2i| + |w_2i+1| <= 128`` in every column
   so that AVX2's int16 pair sums cannot saturate: the integer products are exact on any CPU.
5. **Activations:** uint8 with **one scale per token row** (``max / (255 - Z)`` or ``-min / Z``,
   whichever is larger, so nothing clips) and a fixed zero point Z per kind of input
   (ZERO_POINTS): ``ReduceMax``/``ReduceMin``, ``QuantizeLinear`` (per-axis) and
   ``com.microsoft.MatMulIntegerToFloat`` (the zero point and the column scales applied in the
   GEMM) times the row scale: 3 passes over an activation and one over each product, where
   revision 3 took 11 elementwise ops per MatMul (its per-row zero points, which the kernel
   cannot take, needed a correction product).  A row's scale is its own, so a text's
   embedding does not depend on what it is batched with.

The graph's I/O is the fp32 model's (``embedding`` and the mean-pooled ``pooled``), so the
``text_embedding`` backend serves it unchanged.

Measured by ``bench/bench_int8.py``: ``--accuracy`` gives the cosine to the fp32 model over
all 2,000 texts of the seeded 5-200-word corpus, alone and batched alike (the longest texts
are the worst; the hardest input found is one word repeated to 256 tokens, since every
token's error points the same way and mean pooling does not average it out), ``--offline``
the texts per CPU-second against fp32.  The speed-up depends on the CPU's integer GEMMs (VNNI
or not).  The figures, the variants tried and the machines are in bench/HISTORY.md
("bench_int8") and bench/HISTORY.md ("int8 MiniLM, revision 4"); the model card below
states them for users.

Deterministic: numpy float64 for everything but the calibration run, whose fp32 arithmetic is
ORT's on this machine (one thread, fixed batches): the same machine and versions give the same
bytes; another CPU's fp32 kernels may move a few GPTQ rounding decisions.  The manifest records
ORT's and numpy's versions, the recipe's constants and the output's sha256.
"""
from __future__ import annotations

import pathlib
from typing import Any, Optional

import numpy as np

from ..engine.session import cpu_session
from ..errors import ModelMissingError
from . import minilm, st_import
from ._files import MODEL_FILE, PREPARE_COMMAND, ProgressFn
from ._int8_recipe import (  # noqa: F401  (the recipe's constants: tests and the manifest read them here)
    CALIBRATION_BATCH,
    CALIBRATION_SEED,
    CALIBRATION_TEXTS,
    GPTQ_DAMP,
    PAIR_BUDGET,
    SELF_CHECK_MIN_COSINE,
    SMOOTHING_ALPHA,
    WEIGHT_BITS,
    ZERO_POINTS,
    Folds,
    calibrate,
    quantize_model,
)
from ._int8_recipe import matmul_inputs as _matmul_inputs

_Folds = Folds  # the name tests/models/test_int8.py reads

MODEL_ID = "all-minilm-l6-v2-int8"
MODEL_VERSION = "1"
# Bump when the quantisation recipe changes, so `prepare` rebuilds old outputs.
# 3: the fp32 graph's second output (minilm.POOLED) is kept.
# 4: calibrated smoothing folded into the LayerNorms / value projections, GPTQ weights, a fixed
#    zero point per activation (QuantizeLinear + MatMulIntegerToFloat instead of 11 elementwise
#    ops per MatMul).
# 5: the fp32 graph built by the generic folder importer; the manifest's "text_model" block.
REVISION = 5
GRAPH = "int8-row-smooth-gptq"
#: weight MatMuls in the encoder: 6 layers x (Q, K, V, attention output, FFN in, FFN out)
EXPECTED_MATMULS = 36
#: what the model is and what it measured (``bench/bench_int8.py``; bench/HISTORY.md has the
#: runs): ``models.model_card``, shown by the text_embedding backend in /v1/tasks and
#: /v1/models so a user can choose between this and the fp32 model
CARD = {
    "summary": ("all-MiniLM-L6-v2 with int8 weights and activations for CPU serving: the same "
                "384-d sentence embeddings as text_embed to cosine >= 0.998 over a 2,000-text "
                "corpus, at about 1.9x its texts per CPU-second on a VNNI CPU"),
    "quantisation": ("all 36 weight MatMuls int8 (MatMulIntegerToFloat): 8-bit GPTQ weights per "
                     "output column, calibrated on 64 generated texts; uint8 activations with "
                     "a scale per token row (an embedding does not depend on its batch) and a "
                     "fixed zero point; SmoothQuant-style smoothing folded into the LayerNorms "
                     "and value projections"),
    "accuracy_vs_fp32": {"texts": "lumen bench's seeded corpus: 2,000 texts of 5-200 words",
                         "min_cosine": 0.9981, "p1_cosine": 0.9986, "mean_cosine": 0.9993,
                         "alone_equals_batched": True},
    "speed_vs_fp32": {"texts_per_cpu_second_ratio": 1.95,
                      "how": "one thread, sorted batches of 32, median of 5 interleaved rounds "
                             "(1.92-2.19)",
                      "cpu": "2-core AMD EPYC (Zen 5, AVX-512 VNNI), ONNX Runtime 1.32; "
                             "about 1.3x expected on CPUs without VNNI (not measured)"},
}


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def source_info() -> dict[str, Any]:
    """The fp32 model's source (package, hashes) plus what else decides the output."""
    return {**minilm.source_info(), "int8_revision": REVISION, "onnxruntime": _ort_version(),
            "numpy": np.__version__, "weight_bits": WEIGHT_BITS, "pair_budget": PAIR_BUDGET,
            "zero_points": ZERO_POINTS,
            "calibration": {"texts": CALIBRATION_TEXTS, "seed": CALIBRATION_SEED,
                            "batch": CALIBRATION_BATCH},
            "smoothing_alpha": SMOOTHING_ALPHA, "gptq_damp": GPTQ_DAMP}


def matmul_inputs(g: Any) -> dict:
    """The MiniLM graph's weight MatMuls by input (``_int8_recipe.matmul_inputs``)."""
    return _matmul_inputs(g, EXPECTED_MATMULS, MODEL_ID)


def quantize(fp32_path: pathlib.Path, out_path: pathlib.Path) -> int:
    """Write the int8 model of ``fp32_path`` to ``out_path``; return the MatMuls quantised."""
    import onnx

    model = onnx.load(str(fp32_path))
    tokenizer = minilm.load_tokenizer(minilm.source_dir() / minilm.TOKENIZER_FILE)
    n = quantize_model(model, tokenizer, None, EXPECTED_MATMULS, MODEL_ID)
    onnx.checker.check_model(model)
    onnx.save_model(model, str(out_path))
    return n


def build(out_dir: pathlib.Path, progress: Optional[ProgressFn] = None) -> dict[str, Any]:
    """Write model.onnx (int8) and tokenizer.json into ``out_dir``; return manifest details."""
    import onnx

    say = progress or (lambda _msg: None)
    src = minilm.source_dir()
    say(f"{MODEL_ID}: building the fp32 graph from {minilm.DIST}")
    # the fp32 model as every folder is imported (its text_model block is this model's too)
    fp32 = st_import.build_into(st_import.folder_spec(src), out_dir, say, MODEL_ID)
    plain = out_dir / "fp32.onnx"
    (out_dir / MODEL_FILE).replace(plain)
    model = onnx.load(str(plain))
    tokenizer = minilm.load_tokenizer(out_dir / minilm.TOKENIZER_FILE)
    n_int8 = quantize_model(model, tokenizer, say, EXPECTED_MATMULS, MODEL_ID)
    onnx.checker.check_model(model)
    onnx.save_model(model, str(out_dir / MODEL_FILE))
    del model
    texts = [t for t in minilm.SELF_CHECK_TEXTS if t]
    fp32_sess, int8_sess = cpu_session(plain), cpu_session(out_dir / MODEL_FILE)
    # each text alone and all of them in one padded batch (both L2-normalised)
    cos = min(min(float(np.dot(minilm.embed(fp32_sess, tokenizer, [t])[0],
                               minilm.embed(int8_sess, tokenizer, [t])[0])) for t in texts),
              float((minilm.embed(fp32_sess, tokenizer, texts)
                     * minilm.embed(int8_sess, tokenizer, texts)).sum(axis=1).min()))
    plain.unlink()
    if cos < SELF_CHECK_MIN_COSINE:
        raise ModelMissingError(f"{MODEL_ID}: the quantised graph reaches cosine {cos:.4f} "
                                f"against fp32 on the self-check texts (< "
                                f"{SELF_CHECK_MIN_COSINE}); this ONNX Runtime's "
                                f"({_ort_version()}) integer kernels compute differently: "
                                f"prepare the other models alone with `{PREPARE_COMMAND} "
                                f"{minilm.MODEL_ID} silero-vad`", command=PREPARE_COMMAND)
    say(f"{MODEL_ID}: self-check cosine vs fp32 {cos:.4f}")
    return {
        "model_id": MODEL_ID,
        "model_version": MODEL_VERSION,
        "revision": REVISION,
        "graph": GRAPH,
        "int8_matmuls": n_int8,
        "self_check_cosine": round(cos, 6),
        "inputs": {minilm.INPUT_IDS: ["int64", ["N", "L"]],
                   minilm.ATTENTION_MASK: ["int64", ["N", "L"]]},
        "outputs_spec": minilm.OUTPUTS_SPEC,
        "max_seq_length": minilm.MAX_SEQ_LENGTH,
        "text_model": fp32["text_model"],
        "output_files": [MODEL_FILE, minilm.TOKENIZER_FILE],
    }

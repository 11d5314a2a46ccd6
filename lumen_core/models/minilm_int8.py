"""all-MiniLM-L6-v2 with int8 weights (``all-minilm-l6-v2-int8``), for CPU serving.

Built by ``lumen models prepare`` from the same fp32 graph :mod:`.minilm` writes (rebuilt in
memory from the package's safetensors, so this preparer does not depend on the fp32 output
being present).  Every weight MatMul ``x @ W`` becomes ``MatMulInteger`` with weights
quantised symmetrically per output channel (``WEIGHT_BITS``) and the activation ``x``
[N, L, K] quantised **per token row** over K (``_RowQuantiser``, plain ONNX ops, no
``onnxruntime.quantization``): ReduceMin/ReduceMax with keepdims, uint8 asymmetric like
DynamicQuantizeLinear (scale = (max(0, max) - min(0, min)) / 255, zero point
round(-min / scale)); ORT's CPU MatMulInteger accepts only a scalar a_zero_point, so the
product runs without it and ``zp_row * colsum(W_q)`` is subtracted after, then the result is
scaled by row scale x column scale.  Q/K/V share one quantisation of their input.  A row's
scale is its own, so a text's embedding does not depend on what it is batched with (alone vs
batched 32: max difference 3e-8).  The graph's I/O is the fp32 model's (``embedding`` and the
mean-pooled ``pooled``), so the ``text_embedding`` backend serves it unchanged.

Measured here (2-core AMD EPYC, AVX2 without VNNI, ORT 1.32; 1 thread, CPU time, sorted
batches of 32 of the seeded corpus; min / mean cosine vs sentence-transformers on the 15
non-empty reference texts, alone and batched 32):

- revision 1 (``quantize_dynamic``, one activation scale per batch, 3 MatMuls fp32):
  0.99215 / 0.99456 alone, **0.98477** batched; 1.38x fp32.
- this recipe (asym uint8 rows, 7-bit weights, all 36 MatMuls int8): 0.99036 / 0.99653
  alone and batched; 1.27x (1.22-1.33) fp32, 1.19-1.24x per CPU-second served
  (``bench/bench_int8.py``), i.e. about 10% slower than revision 1.
- symmetric int8 rows with 8-bit weights (``sym_s8``): 0.99162 with every MatMul int8, but
  0.31x fp32: MLAS has no fast S8S8 kernel on AVX2.
- uint8 rows with 8-bit int8 weights: 10-19% error on a random test matrix, because AVX2's
  ``vpmaddubsw`` saturates u8 x s8 pair sums at int16; 7-bit weights (or 7-bit
  activations, which lose more: 0.98115 symmetric) cannot saturate.  Symmetric uint8 rows
  (zero point 128, ``sym_u8``) with 7-bit weights: 1.38-1.42x but 0.98903; uint8 x uint8
  (``sym_u8u8``): 0.99162 but 1.08x.
- ``com.microsoft.MatMulIntegerToFloat`` (scalar a_scale only on CPU, so the row scale and
  zero-point correction stay separate): 0.99030, no faster; mixing symmetric and asymmetric
  rows per MatMul input: only "asymmetric except the FFN input" keeps 0.99 (0.99004) and it is
  not faster within the spread.  A profile puts the per-row (de)quantisation at a third of the
  int8 graph's time (bench/README.md, "More revision-2 variants").

The output is a deterministic function of the package's weights (numpy rounding); the
manifest still records the ORT version (the self-check runs its integer kernels) with the
source hashes and the output's sha256 like every prepared model.
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
# 3: the fp32 graph's second output (minilm.POOLED) is kept.
REVISION = 3
GRAPH = "int8-row"
#: name prefixes (as minilm.build_graph names them) of weight MatMuls kept in fp32: none (the
#: dynamic recipe of revision 1 needed layer 0's FFN output and attention output and layer 4's
#: FFN input; per-row activations do not)
FP32_MATMULS: tuple = ()
#: how activations are quantised per token row (one of SCHEMES), and the weights' bits
#: (symmetric, per output channel)
SCHEME = "asym_u8"
WEIGHT_BITS = 7
#: the quantised graph must match the fp32 one this well on minilm.SELF_CHECK_TEXTS
SELF_CHECK_MIN_COSINE = 0.99
#: activation schemes of the per-row quantiser: symmetric int8 (zero point 0), symmetric in
#: uint8 (zero point 128), asymmetric uint8 with a zero point per row
SCHEMES = ("sym_s8", "sym_u8", "asym_u8", "sym_u8u8")
#: floor of a row's scale (a row of zeros quantises to zeros)
ROW_SCALE_EPS = 1e-8


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def source_info() -> dict[str, Any]:
    """The fp32 model's source (package, hashes) plus what else decides the output."""
    return {**minilm.source_info(), "int8_revision": REVISION, "onnxruntime": _ort_version(),
            "fp32_matmuls": list(FP32_MATMULS), "scheme": SCHEME, "weight_bits": WEIGHT_BITS}


def quantize_model(model: Any) -> list:
    """Rewrite the fp32 ``model`` (an ``onnx.ModelProto`` of :func:`minilm.build_graph`) in
    place into the int8 graph; return the names of the MatMuls kept fp32."""
    keep = _RowQuantiser(model, SCHEME, WEIGHT_BITS).run(FP32_MATMULS)
    if len(keep) != len(FP32_MATMULS):
        raise ModelMissingError(f"{MODEL_ID}: expected {len(FP32_MATMULS)} MatMuls named "
                                f"{FP32_MATMULS} in the fp32 graph, found {keep}",
                                command=PREPARE_COMMAND)
    return keep


def quantize(fp32_path: pathlib.Path, out_path: pathlib.Path) -> list:
    """Write the int8 model of ``fp32_path`` to ``out_path``; return the fp32-kept nodes."""
    import onnx

    model = onnx.load(str(fp32_path))
    keep = quantize_model(model)
    onnx.checker.check_model(model)
    onnx.save_model(model, str(out_path))
    return keep


def build(out_dir: pathlib.Path, progress: Optional[ProgressFn] = None) -> dict[str, Any]:
    """Write model.onnx (int8) and tokenizer.json into ``out_dir``; return manifest details."""
    import onnx

    say = progress or (lambda _msg: None)
    src = minilm.source_dir()
    say(f"{MODEL_ID}: building the fp32 graph from {minilm.DIST}")
    weights, config = minilm.load_weights(src)
    plain = out_dir / "fp32.onnx"
    model = minilm.build_graph(weights, config)
    del weights
    onnx.save_model(model, str(plain))
    say(f"{MODEL_ID}: int8 quantisation (weights per output channel, activations per token "
        f"row, {len(FP32_MATMULS)} MatMuls kept fp32)")
    keep = quantize_model(model)
    onnx.checker.check_model(model)
    onnx.save_model(model, str(out_dir / MODEL_FILE))
    del model
    shutil.copyfile(src / minilm.TOKENIZER_FILE, out_dir / minilm.TOKENIZER_FILE)
    tokenizer = minilm.load_tokenizer(out_dir / minilm.TOKENIZER_FILE)
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
        "fp32_nodes": keep,
        "self_check_cosine": round(cos, 6),
        "inputs": {minilm.INPUT_IDS: ["int64", ["N", "L"]],
                   minilm.ATTENTION_MASK: ["int64", ["N", "L"]]},
        "outputs_spec": minilm.OUTPUTS_SPEC,
        "max_seq_length": minilm.MAX_SEQ_LENGTH,
        "output_files": [MODEL_FILE, minilm.TOKENIZER_FILE],
    }


# ---------------------------------------------------------------------------------------------
# per-row activation quantisation (built directly, no onnxruntime.quantization)


class _RowQuantiser:
    """Rewrites weight MatMuls of an fp32 graph into per-row-quantised ``MatMulInteger``."""

    def __init__(self, model: Any, scheme: str, weight_bits: int, act_bits: int = 8) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, not {scheme!r}")
        self.model, self.scheme, self.qmax = model, scheme, 2 ** (weight_bits - 1) - 1
        self.act_top = 2 ** act_bits - 1  # asymmetric: levels 0..act_top
        self.act_half = 2 ** (act_bits - 1) - 1  # symmetric: -act_half..act_half
        self.inits = {t.name: t for t in model.graph.initializer}
        self.nodes: list = []
        self.new_inits: list = []
        self.rows: dict[str, tuple] = {}  # activation -> (quantised, row scale, row zp or None)

    def const(self, value: Any, name: str, dtype: Any = np.float32) -> str:
        from onnx import numpy_helper

        self.new_inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list, out: str, **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out + "_node", **attrs))
        return out

    def quantise_rows(self, x: str) -> tuple:
        """(quantised x, scale [.., 1], zero point [.., 1] or None) of activation ``x``, once."""
        from onnx import TensorProto

        if x in self.rows:
            return self.rows[x]
        p = f"{x}.rowq"
        hi = self.op("ReduceMax", [x], p + ".max", axes=[-1], keepdims=1)
        lo = self.op("ReduceMin", [x], p + ".min", axes=[-1], keepdims=1)
        eps = self.const(ROW_SCALE_EPS, p + ".eps")
        if self.scheme == "asym_u8":  # DynamicQuantizeLinear's recipe, per row
            zero = self.const(0.0, p + ".zero")
            hi0 = self.op("Max", [hi, zero], p + ".max0")
            lo0 = self.op("Min", [lo, zero], p + ".min0")
            span = self.op("Sub", [hi0, lo0], p + ".span")
            scale = self.op("Max", [self.op("Div", [span, self.const(self.act_top, p + ".levels")],
                                            p + ".scale0"), eps], p + ".scale")
            inv = self.op("Reciprocal", [scale], p + ".inv")
            top = self.const(self.act_top, p + ".top")
            zp = self.op("Clip", [self.op("Round", [self.op("Neg", [self.op(
                "Mul", [lo0, inv], p + ".lo_q")], p + ".neg_lo_q")], p + ".zp_r"), zero, top],
                p + ".zp")
            # round-half-up via +0.5 and Cast's truncation of a value clipped to [0, 255]
            shifted = self.op("Add", [self.op("Mul", [x, inv], p + ".xs"),
                                      self.op("Add", [zp, self.const(0.5, p + ".half")],
                                              p + ".zp_half")], p + ".xz")
            q = self.op("Cast", [self.op("Clip", [shifted, zero, top], p + ".xc")], p + ".q",
                        to=TensorProto.UINT8)
            self.rows[x] = (q, scale, zp)
        else:  # symmetric: scale = max|x| / 127 per row, zero point 0 (int8) or 128 (uint8)
            amax = self.op("Max", [self.op("Max", [hi, self.op("Neg", [lo], p + ".neg_min")],
                                           p + ".amax0"), eps], p + ".amax")
            levels = self.const(self.act_half, p + ".levels")
            scale = self.op("Div", [amax, levels], p + ".scale")
            inv = self.op("Div", [levels, amax], p + ".inv")
            xs = self.op("Mul", [x, inv], p + ".xs")  # in [-127, 127]
            if self.scheme == "sym_s8":
                q = self.op("Cast", [self.op("Round", [xs], p + ".xr")], p + ".q",
                            to=TensorProto.INT8)
            else:  # + 128.5 then truncation = round half up into [1, 255]
                q = self.op("Cast", [self.op("Add", [xs, self.const(self.act_half + 1.5, p + ".offset")],
                                             p + ".xo")], p + ".q", to=TensorProto.UINT8)
            self.rows[x] = (q, scale, None)
        return self.rows[x]

    def matmul(self, node: Any) -> None:
        """``node`` (x @ W, W an initializer) as int8 MatMulInteger + per-row/column scales."""
        from onnx import TensorProto, numpy_helper

        x, w_name = node.input
        p = node.name
        w = numpy_helper.to_array(self.inits[w_name]).astype(np.float64)
        w_amax = np.abs(w).max(axis=0)
        w_scale = np.where(w_amax > 0, w_amax / self.qmax, 1.0)
        b = np.clip(np.rint(w / w_scale), -self.qmax, self.qmax).astype(np.int8)
        q, scale, zp = self.quantise_rows(x)
        if self.scheme == "sym_u8u8":  # both uint8, zero points 128
            inputs = [q, self.const(b.astype(np.int16) + 128, p + ".w_uint8", np.uint8),
                      self.const(self.act_half + 1, p + ".a_zp", np.uint8),
                      self.const(128, p + ".w_zp", np.uint8)]
        else:
            inputs = [q, self.const(b, p + ".w_int8", np.int8)]
        if self.scheme == "sym_u8":
            inputs.append(self.const(self.act_half + 1, p + ".a_zp", np.uint8))
        acc = self.op("Cast", [self.op("MatMulInteger", inputs, p + ".acc")], p + ".accf",
                      to=TensorProto.FLOAT)
        if zp is not None:  # sum_k (q - zp) b = sum_k q b - zp * colsum(b)
            colsum = self.const(b.astype(np.int64).sum(axis=0), p + ".colsum")
            acc = self.op("Sub", [acc, self.op("Mul", [zp, colsum], p + ".zp_colsum")],
                          p + ".acc_zp")
        wsc = self.op("Mul", [acc, self.const(w_scale, p + ".w_scale")], p + ".acc_w")
        self.op("Mul", [wsc, scale], node.output[0])

    def run(self, exclude: tuple) -> list:
        """Rewrite the model in place; return the names of the MatMuls kept fp32."""
        kept, used = [], set()
        old = list(self.model.graph.node)
        for node in old:
            if node.op_type != "MatMul" or node.input[1] not in self.inits:
                self.nodes.append(node)
            elif node.name.startswith(exclude):
                kept.append(node.name)
                self.nodes.append(node)
            else:
                used.add(node.input[1])
                self.matmul(node)
        graph = self.model.graph
        keep_inits = [t for t in graph.initializer if t.name not in used]
        del graph.node[:]
        graph.node.extend(self.nodes)
        del graph.initializer[:]
        graph.initializer.extend(keep_inits + self.new_inits)
        return kept

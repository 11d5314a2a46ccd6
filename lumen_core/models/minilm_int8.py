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

Measured (bench/bench_int8.py; figures and the variants tried in bench/README.md, "int8
MiniLM, revision 4"), cosine to the fp32 model over all 2,000 texts of the seeded 5-200-word
corpus, alone and batched alike: **min 0.9981, p1 0.9986, mean 0.9993**, 0.9991 for the 94
texts of 150+ words (revision 3: min 0.9908 on the AVX-512 VNNI box, 0.9811 on an AVX2 one,
the worst the longest texts).  Against sentence-transformers' 15 reference texts: min 0.9974,
the hardest input found being one word repeated to 256 tokens (every token's error points the
same way, so mean pooling does not average it out).  Speed: 1.95x fp32's texts per
CPU-second (one thread, sorted batches of 32, median of 5 interleaved rounds, 1.92-2.19) on
the AVX-512 VNNI box, where the integer GEMMs are ~4x fp32's; on AVX2 without VNNI they are
~1.9x, which bounds any int8 graph of this model near 1.55x (about 1.3x expected for this one).

Deterministic: numpy float64 for everything but the calibration run, whose fp32 arithmetic is
ORT's on this machine (one thread, fixed batches): the same machine and versions give the same
bytes; another CPU's fp32 kernels may move a few GPTQ rounding decisions.  The manifest records
ORT's and numpy's versions, the recipe's constants and the output's sha256.
"""
from __future__ import annotations

import pathlib
from typing import Any, Optional

import numpy as np

from ..corpus import make_corpus
from ..engine.session import cpu_session
from ..errors import ModelMissingError
from . import _quant, minilm, st_import
from ._files import MODEL_FILE, PREPARE_COMMAND, ProgressFn

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
#: weight MatMuls in the encoder: 6 layers x (Q, K, V, attention output, FFN in, FFN out)
EXPECTED_MATMULS = 36
#: what the model is and what it measured (``bench/bench_int8.py``; bench/README.md has the
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
    """``{input tensor: [(MatMul node, weight, bias)]}`` of the fp32 graph's weight MatMuls
    (Q, K and V share one input); a ModelMissingError if the graph is not the expected one."""
    matmuls = g.weight_matmuls()
    if len(matmuls) != EXPECTED_MATMULS or any(b is None for _, _, b in matmuls):
        raise ModelMissingError(f"{MODEL_ID}: expected {EXPECTED_MATMULS} weight MatMuls with a "
                                f"bias in the fp32 graph, found {len(matmuls)}",
                                command=PREPARE_COMMAND)
    inputs: dict[str, list] = {}
    for node, w, b in matmuls:
        inputs.setdefault(node.input[0], []).append((node, w, b))
    return inputs


def quantize_model(model: Any, tokenizer: Any, progress: Optional[ProgressFn] = None) -> int:
    """Rewrite the fp32 ``model`` (an ``onnx.ModelProto`` of :func:`minilm.build_graph`) in
    place into the int8 graph; return the number of MatMuls quantised."""
    say = progress or (lambda _msg: None)
    g = _quant.Graph(model)
    inputs = matmul_inputs(g)
    say(f"{MODEL_ID}: calibration ({CALIBRATION_TEXTS} texts through the fp32 graph)")
    plan = _Folds(g, inputs, calibrate(model, tokenizer, list(inputs)))
    say(f"{MODEL_ID}: GPTQ rounding of {EXPECTED_MATMULS} weight matrices to {WEIGHT_BITS} bits")
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


def quantize(fp32_path: pathlib.Path, out_path: pathlib.Path) -> int:
    """Write the int8 model of ``fp32_path`` to ``out_path``; return the MatMuls quantised."""
    import onnx

    model = onnx.load(str(fp32_path))
    tokenizer = minilm.load_tokenizer(minilm.source_dir() / minilm.TOKENIZER_FILE)
    n = quantize_model(model, tokenizer)
    onnx.checker.check_model(model)
    onnx.save_model(model, str(out_path))
    return n


def calibrate(model: Any, tokenizer: Any, names: list) -> dict:
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
    texts = make_corpus(CALIBRATION_TEXTS, CALIBRATION_SEED)
    ids = sorted((enc.ids for enc in tokenizer.encode_batch(texts)), key=len)
    stats: dict = {}
    for i in range(0, len(ids), CALIBRATION_BATCH):
        input_ids, mask = minilm.pad_batch(ids[i:i + CALIBRATION_BATCH])
        outs = sess.run(names, {minilm.INPUT_IDS: input_ids, minilm.ATTENTION_MASK: mask})
        real = mask.reshape(-1).astype(bool)
        for name, out in zip(names, outs, strict=True):
            rows = out.reshape(-1, out.shape[-1])[real]
            stats.setdefault(name, _quant.ActivationStats(rows.shape[1])).add(rows)
    return stats


class _Folds:
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

    #: from the attention context back to V's projection, as minilm.build_graph writes it:
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
    n_int8 = quantize_model(model, tokenizer, say)
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

"""The int8 all-MiniLM-L6-v2 (models/minilm_int8.py, models/_quant.py) and the
``text_embed_int8`` default task: accuracy against sentence-transformers' reference embeddings
and against the fp32 model on long corpus texts, hash-recorded and deterministic preparation,
the same I/O as the fp32 model, and the int8 building blocks (per-row quantiser, GPTQ)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import onnx
import pytest
import serve_support as S

from lumen_core import models
from lumen_core.corpus import make_corpus
from lumen_core.engine.session import cpu_session
from lumen_core.models import _files as files
from lumen_core.models import _quant, minilm, minilm_int8
from lumen_core.runtime import Runtime
from lumen_core.tasks import default_task_tables
from lumen_core.tasks.text_embedding import INT8_TASK_NAME, TASK_NAME

MIN_COSINE = 0.99
#: long corpus texts (the hardest for revision 3 of the recipe: 0.981 on an AVX2 box, 0.994
#: on this sample on an AVX-512 VNNI one) must stay this close to the fp32 vectors; revision 4
#: measured min 0.9981 over all 2,000 corpus texts (bench/bench_int8.py --accuracy)
LONG_MIN_COSINE = 0.995
#: the long-text sample: this many of the longest texts of a seeded draw from the corpus
LONG_SAMPLE = 300
LONG_TEXTS = 16
BATCH = 32
#: per-row activation scales: a text's embedding does not depend on its batch (fp32 kernels
#: over a longer padded batch still differ in the last bits, hence not exactly equal)
BATCH_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    texts = json.loads((fixtures_dir / "minilm_reference.json").read_text())["texts"]
    return texts, np.load(fixtures_dir / "minilm_reference_embeddings.npy")


def filled_batch(texts: list) -> list:
    """``texts`` then seeded corpus texts up to one batch of BATCH."""
    return texts + make_corpus()[: BATCH - len(texts)]


@pytest.fixture(scope="module")
def served(prepared_home, reference):
    """{task: [embedding of each reference text, each sent alone]} from the default runtime,
    plus {(task, "batched"): [the same texts sent as one group of BATCH with others]}."""
    texts, _ = reference
    texts = [t for t in texts if t]  # an empty text is a 400 (TEI)

    async def main(rt):
        async with rt:
            out = {}
            for task in (TASK_NAME, INT8_TASK_NAME):
                out[task] = [(await rt.infer(rt.text_request(task, t))).outputs[minilm.OUTPUT]
                             for t in texts]
                group = await rt.infer_many([rt.text_request(task, t) for t in filled_batch(texts)])
                out[(task, "batched")] = [r.outputs[minilm.OUTPUT] for r in group[: len(texts)]]
            return out

    with S.lumen_home_env(prepared_home):
        tables = default_task_tables()
        assert INT8_TASK_NAME in [t["name"] for t in tables]
        return asyncio.run(main(Runtime.from_dict({"tasks": tables})))


def cosines(vectors, reference) -> list:
    texts, ref = reference
    ref = [r for t, r in zip(texts, ref, strict=True) if t]
    return [float(np.dot(v, r)) / float(np.linalg.norm(r))
            for v, r in zip(vectors, ref, strict=True)]


def test_int8_task_matches_sentence_transformers(served, reference):
    for how, vectors in (("alone", served[INT8_TASK_NAME]),
                         (f"batched {BATCH}", served[(INT8_TASK_NAME, "batched")])):
        cos = cosines(vectors, reference)
        print(f"int8 vs sentence-transformers, {how}: min cosine {min(cos):.5f}, "
              f"mean {np.mean(cos):.5f} over {len(cos)} non-empty texts")
        assert min(cos) >= MIN_COSINE, (how, [round(c, 4) for c in cos])
    # activation scales per token row: what a text is batched with does not move it
    gap = max(float(np.abs(a - b).max()) for a, b in
              zip(served[INT8_TASK_NAME], served[(INT8_TASK_NAME, "batched")], strict=True))
    assert gap < BATCH_TOLERANCE, gap
    for v in served[INT8_TASK_NAME]:
        assert v.dtype == np.float32 and v.shape == (minilm.EMBEDDING_DIM,)
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-4
    # it is a different model: not the fp32 numbers
    assert not np.allclose(served[INT8_TASK_NAME][0], served[TASK_NAME][0], atol=1e-4)


def test_int8_graph_is_batch_independent(prepared_home, reference):
    """One session, one padded batch of BATCH (the reference texts among longer corpus texts)
    against each text alone: per-row activation quantisation, so equal up to fp32 noise."""
    directory = models.require_model(models.MINILM_INT8, prepared_home)
    sess = cpu_session(directory / models.MODEL_FILE)
    tokenizer = minilm.load_tokenizer(directory / minilm.TOKENIZER_FILE)
    texts = [t for t in reference[0] if t]
    alone = np.stack([minilm.embed(sess, tokenizer, [t])[0] for t in texts])
    batched = minilm.embed(sess, tokenizer, filled_batch(texts))[: len(texts)]
    assert float(np.abs(alone - batched).max()) < BATCH_TOLERANCE
    assert min(cosines(batched, reference)) >= MIN_COSINE


def _long_texts() -> list:
    """The LONG_TEXTS longest of a seeded draw of LONG_SAMPLE corpus texts (80-200 words)."""
    corpus = make_corpus()
    rng = np.random.default_rng(28)
    drawn = [corpus[i] for i in rng.choice(len(corpus), LONG_SAMPLE, replace=False)]
    return sorted(drawn, key=lambda t: -len(t.split()))[:LONG_TEXTS]


def test_int8_holds_on_long_texts_alone_and_batched(prepared_home):
    """Long realistic texts, where per-row quantisation error accumulates most: every one
    within LONG_MIN_COSINE of the fp32 model's vector, sent alone and in one padded batch."""
    texts = _long_texts()
    assert min(len(t.split()) for t in texts) >= 80
    vectors = {}
    for name in (models.MINILM, models.MINILM_INT8):
        directory = models.require_model(name, prepared_home)
        sess = cpu_session(directory / models.MODEL_FILE)
        tokenizer = minilm.load_tokenizer(directory / minilm.TOKENIZER_FILE)
        vectors[name] = (minilm.embed(sess, tokenizer, texts),
                         np.stack([minilm.embed(sess, tokenizer, [t])[0] for t in texts]))
    fp32 = vectors[models.MINILM][0]
    for how, int8 in zip(("batched", "alone"), vectors[models.MINILM_INT8], strict=True):
        cos = (fp32 * int8).sum(axis=1)
        print(f"int8 vs fp32 on {len(texts)} long texts, {how}: min {cos.min():.5f}, "
              f"mean {cos.mean():.5f}")
        assert cos.min() >= LONG_MIN_COSINE, (how, np.round(cos, 4).tolist())


def test_prepared_int8_model_is_hash_recorded_and_quantised(prepared_home):
    directory = models.require_model(models.MINILM_INT8, prepared_home)
    manifest = models.read_manifest(directory)
    assert manifest["name"] == models.MINILM_INT8 and manifest["graph"] == minilm_int8.GRAPH
    entry = manifest["outputs"][models.MODEL_FILE]
    assert entry["sha256"] == files.sha256_file(directory / models.MODEL_FILE)
    assert manifest["source"]["onnxruntime"] and manifest["self_check_cosine"] >= MIN_COSINE
    assert manifest["source"]["calibration"] == {"texts": minilm_int8.CALIBRATION_TEXTS,
                                                 "seed": minilm_int8.CALIBRATION_SEED,
                                                 "batch": minilm_int8.CALIBRATION_BATCH}
    assert manifest["int8_matmuls"] == 36
    graph = onnx.load(str(directory / models.MODEL_FILE)).graph
    ops = [n.op_type for n in graph.node]
    inits = {t.name: t for t in graph.initializer}
    # 6 layers x 6 weight MatMuls (Q, K, V, attention output, FFN in, FFN out) all int8; the
    # only fp32 MatMuls left multiply activations (probs @ V, the mean pooling)
    assert ops.count("MatMulIntegerToFloat") == 36
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    # one per-row quantisation per distinct input (Q/K/V share one): 4 per layer
    assert ops.count("ReduceMax") == ops.count("QuantizeLinear") == 4 * 6
    assert "DynamicQuantizeLinear" not in ops and "MatMulInteger" not in ops
    # the smoothing's second LayerNorm for each of the 12 that feed MatMuls
    assert ops.count("LayerNormalization") == 13 + 12
    assert [i.name for i in graph.input] == [minilm.INPUT_IDS, minilm.ATTENTION_MASK]
    assert [o.name for o in graph.output] == [minilm.OUTPUT, minilm.POOLED]
    fp32_size = (models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE).stat().st_size
    for node in graph.node:
        if node.op_type == "MatMulIntegerToFloat":
            w = onnx.numpy_helper.to_array(inits[node.input[1]]).astype(np.int64)
            assert inits[node.input[1]].data_type == onnx.TensorProto.INT8
            assert int(np.abs(w).max()) <= 127
            # no AVX2 int16 pair sum can saturate: 255 * (|w_2i| + |w_2i+1|) <= 32767
            assert int((np.abs(w[0::2]) + np.abs(w[1::2])).max()) <= minilm_int8.PAIR_BUDGET
            assert int(onnx.numpy_helper.to_array(inits[node.input[4]])) in \
                minilm_int8.ZERO_POINTS.values()
    # the encoder's weights shrink 4x; the fp32 word-embedding table (47 MB) stays
    assert entry["bytes"] < fp32_size * 0.7


def test_quantisation_is_deterministic(prepared_home, tmp_path):
    fp32 = tmp_path / "fp32.onnx"
    weights, config = minilm.load_weights(minilm.source_dir())
    onnx.save_model(minilm.build_graph(weights, config), str(fp32))
    assert minilm_int8.quantize(fp32, tmp_path / "int8.onnx") == 36
    recorded = models.read_manifest(models.model_dir(models.MINILM_INT8, prepared_home))
    assert files.sha256_file(tmp_path / "int8.onnx") == recorded["outputs"][models.MODEL_FILE]["sha256"]


def _two_matmuls() -> onnx.ModelProto:
    """x @ W + b + x @ W' + b' (x fp32 [n, l, 64]): two weight MatMuls sharing one input."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y0"], name="a.matmul"),
             helper.make_node("Add", ["y0", "b"], ["z0"], name="a.add"),
             helper.make_node("MatMul", ["x", "w2"], ["y1"], name="b.matmul"),
             helper.make_node("Add", ["y1", "b"], ["z1"], name="b.add"),
             helper.make_node("Add", ["z0", "z1"], ["y"], name="add")]
    graph = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "l", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "l", 16])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w[:, ::-1].copy(), "w2"),
         numpy_helper.from_array(np.linspace(-1, 1, 16).astype(np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", minilm.OPSET)])


def _quantise_two(model: onnx.ModelProto, zero_point: int, bits: int = 7) -> list:
    """Every weight MatMul of ``model`` through the RowQuantiser (plain rounding); returns
    the (node, weight, bias) it found."""
    g = _quant.Graph(model)
    found = g.weight_matmuls()
    rq = _quant.RowQuantiser(g)
    names = {node.name for node, _, _ in found}
    for node in list(model.graph.node):
        if node.name in names:
            rq.matmul(node, node.input[0], *_quant.round_to_nearest(g.array(node.input[1]), bits),
                      zero_point)
        else:
            rq.nodes.append(node)
    g.commit(rq.nodes, drop=[w for _, w, _ in found], added=rq.added)
    return found


@pytest.mark.parametrize("zero_point", sorted(set(minilm_int8.ZERO_POINTS.values())))
def test_row_quantiser_is_per_row_and_close_to_fp32(zero_point):
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    # rows of very different scales and offsets (some all above zero), one row of zeros
    x = (rng.normal(size=(3, 5, 64)) * rng.uniform(0.05, 30, size=(3, 5, 1))
         + rng.normal(size=(3, 5, 1)) * 3).astype(np.float32)
    x[1, 2] = 0.0
    model = _two_matmuls()
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    expect = x @ w["w"] + x @ w["w2"] + 2 * w["b"]
    found = _quantise_two(model, zero_point)
    assert [(n.name, b) for n, _, b in found] == [("a.matmul", "b"), ("b.matmul", "b")]
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulIntegerToFloat") == 2 and "MatMul" not in ops
    # one quantisation of x for both MatMuls; the fp32 weights are gone
    assert ops.count("ReduceMax") == ops.count("QuantizeLinear") == 1
    assert {t.name for t in model.graph.initializer}.isdisjoint({"w", "w2"})
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": x})[0]
    for i in range(x.shape[0]):  # each row's scale is its own: a sub-batch gives the same rows
        np.testing.assert_array_equal(sess.run(None, {"x": x[i:i + 1, :3]})[0], y[i:i + 1, :3])
    np.testing.assert_allclose(y[1, 2], 2 * w["b"], atol=1e-6)  # zeros stay exact
    span = np.abs(x).max(axis=-1, keepdims=True) * np.abs(w["w"]).sum(axis=0).max()
    assert float((np.abs(y - expect) / np.maximum(span, 1e-6)).max()) < 0.02


def test_gptq_beats_rounding_on_correlated_inputs():
    """GPTQ spreads each rounding error over the weights not yet rounded, so on inputs like
    the calibration ones the product error is smaller than plain rounding's, with the same
    integer range and scales."""
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(48, 48))
    x = rng.normal(size=(2000, 48)) @ mix + rng.normal(size=48)  # correlated channels
    w = rng.normal(size=(48, 24))
    stats = _quant.ActivationStats(48)
    stats.add(x[:1000])
    stats.add(x[1000:])
    # fp32 products within a batch, summed in fp64
    np.testing.assert_allclose(stats.second_moment(np.zeros(48), np.ones(48)), x.T @ x / 2000,
                               rtol=1e-5, atol=1e-5)
    q_g, s_g = _quant.gptq(w, stats.second_moment(np.zeros(48), np.ones(48)), 7, 0.01, 16)
    q_r, s_r = _quant.round_to_nearest(w, 7)
    np.testing.assert_array_equal(s_g, s_r)
    assert q_g.dtype == np.int8 and np.abs(q_g).max() <= 63
    err = {k: float(np.linalg.norm(x @ w - x @ (q * s))) for k, q, s in
           (("gptq", q_g, s_g), ("round", q_r, s_r))}
    assert err["gptq"] < 0.8 * err["round"], err
    # deterministic; a shifted and scaled input's moment is the one of (x - mu) / s
    np.testing.assert_array_equal(_quant.gptq(w, stats.second_moment(np.zeros(48), np.ones(48)),
                                              7, 0.01, 16)[0], q_g)
    mu, sc = x.mean(axis=0), x.std(axis=0)
    xs = (x - mu) / sc
    np.testing.assert_allclose(stats.second_moment(mu, sc), xs.T @ xs / 2000, rtol=1e-4, atol=1e-4)


def test_smoothing_and_pairing_keep_the_fp32_function():
    """The folds the recipe makes before rounding (LayerNorm copies, shifts and scales into
    biases and weights, channel reordering through V and the FFN input) leave the fp32 graph
    computing the same embeddings, whatever the calibration ranges."""
    import onnxruntime as ort

    weights, config = minilm.load_weights(minilm.source_dir())
    model = minilm.build_graph(weights, config)
    tokenizer = minilm.load_tokenizer(minilm.source_dir() / minilm.TOKENIZER_FILE)
    texts = make_corpus()[:8]

    def embed(m: onnx.ModelProto) -> np.ndarray:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return minilm.embed(sess, tokenizer, texts)

    before = embed(model)
    g = _quant.Graph(model)
    inputs = minilm_int8.matmul_inputs(g)
    rng = np.random.default_rng(5)
    stats = {}
    for x, users in inputs.items():  # arbitrary ranges: offsets and spreads per channel
        k = g.array(users[0][1]).shape[0]
        stats[x] = _quant.ActivationStats(k)
        stats[x].add(rng.normal(size=(64, k)) * rng.uniform(0.1, 20, k) + rng.normal(size=k) * 3)
    folds = minilm_int8._Folds(g, inputs, stats)
    assert sorted(folds.kind.values()) == ["context"] * 6 + ["gelu"] * 6 + ["layernorm"] * 12
    assert len(folds.perm) == 12 and len(folds.after) == 12
    nodes = []
    for node in list(model.graph.node):
        if node.input and node.input[0] in folds.renamed and node.op_type == "MatMul":
            node.input[0] = folds.renamed[node.input[0]]
        nodes.append(node)
        nodes.extend(folds.after.get(node.name, ()))
    g.commit(nodes, drop=[], added=folds.added)
    np.testing.assert_allclose(embed(model), before, atol=2e-5)
    for x, order in folds.perm.items():  # each reordering is a permutation pairing big+small
        assert sorted(order.tolist()) == list(range(len(order)))
        assert folds.hessian(x).shape == (len(order), len(order))


def test_gptq_pair_budget_keeps_avx2_pair_sums_exact():
    """8-bit weights whose adjacent rows (2i, 2i+1) could make a uint8 x int8 pair sum exceed
    int16 (AVX2 vpmaddubsw saturates) are kept within the budget in every column, at a
    small cost in error; the budget-free result does exceed it on the same weights."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1500, 64)) @ rng.normal(size=(64, 64))
    w = rng.normal(size=(64, 32)) * np.where(rng.random(64) < 0.1, 8.0, 1.0)[:, None]
    h = x.T @ x / len(x)
    free, s_free = _quant.gptq(w, h, 8, 0.03, 16)
    kept, s_kept = _quant.gptq(w, h, 8, 0.03, 16, pair_budget=minilm_int8.PAIR_BUDGET)

    def pair_max(q: np.ndarray) -> int:
        q = np.abs(q.astype(np.int64))
        return int((q[0::2] + q[1::2]).max())

    assert pair_max(free) > minilm_int8.PAIR_BUDGET >= pair_max(kept)
    assert 255 * minilm_int8.PAIR_BUDGET <= 32767
    err = {k: float(np.linalg.norm(x @ w - x @ (q * s))) for k, q, s in
           (("free", free, s_free), ("kept", kept, s_kept))}
    assert err["kept"] < 2.0 * err["free"], err

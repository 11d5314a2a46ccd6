"""The int8 all-MiniLM-L6-v2 (models/minilm_int8.py) and the ``text_embed_int8`` default task:
accuracy against sentence-transformers' reference embeddings, hash-recorded and deterministic
preparation, the same I/O as the fp32 model."""
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
from lumen_core.models import minilm, minilm_int8
from lumen_core.runtime import Runtime
from lumen_core.tasks import default_task_tables
from lumen_core.tasks.text_embedding import INT8_TASK_NAME, TASK_NAME

MIN_COSINE = 0.99
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


def test_prepared_int8_model_is_hash_recorded_and_quantised(prepared_home):
    directory = models.require_model(models.MINILM_INT8, prepared_home)
    manifest = models.read_manifest(directory)
    assert manifest["name"] == models.MINILM_INT8 and manifest["graph"] == minilm_int8.GRAPH
    entry = manifest["outputs"][models.MODEL_FILE]
    assert entry["sha256"] == files.sha256_file(directory / models.MODEL_FILE)
    assert manifest["source"]["onnxruntime"] and manifest["self_check_cosine"] >= MIN_COSINE
    graph = onnx.load(str(directory / models.MODEL_FILE)).graph
    ops = [n.op_type for n in graph.node]
    kept = [n.name for n in graph.node
            if n.op_type == "MatMul" and n.name.startswith(minilm_int8.FP32_MATMULS)]
    # 6 layers x 6 weight MatMuls (Q, K, V, attention output, FFN in, FFN out), FP32_MATMULS
    # kept fp32; one per-row activation quantisation per distinct input (Q/K/V share one)
    n_fp32 = len(minilm_int8.FP32_MATMULS)
    assert ops.count("MatMulInteger") == 36 - n_fp32 and len(kept) == n_fp32
    assert "DynamicQuantizeLinear" not in ops and ops.count("ReduceMax") == 4 * 6 - n_fp32
    assert [i.name for i in graph.input] == [minilm.INPUT_IDS, minilm.ATTENTION_MASK]
    assert [o.name for o in graph.output] == [minilm.OUTPUT, minilm.POOLED]
    fp32_size = (models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE).stat().st_size
    inits = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "MatMulInteger":  # weights stored as 8-bit integers
            assert inits[node.input[1]].data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    # the encoder's weights shrink 4x; the fp32 word-embedding table (47 MB) stays
    assert entry["bytes"] < fp32_size * 0.7


def test_quantisation_is_deterministic(prepared_home, tmp_path):
    fp32 = tmp_path / "fp32.onnx"
    weights, config = minilm.load_weights(minilm.source_dir())
    onnx.save_model(minilm.build_graph(weights, config), str(fp32))
    minilm_int8.quantize(fp32, tmp_path / "int8.onnx")
    recorded = models.read_manifest(models.model_dir(models.MINILM_INT8, prepared_home))
    assert files.sha256_file(tmp_path / "int8.onnx") == recorded["outputs"][models.MODEL_FILE]["sha256"]


def _two_matmuls() -> onnx.ModelProto:
    """x @ W + x @ W' (x fp32 [n, l, 64]): two weight MatMuls that share one activation."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y0"], name="a.matmul"),
             helper.make_node("MatMul", ["x", "w2"], ["y1"], name="b.matmul"),
             helper.make_node("Add", ["y0", "y1"], ["y"], name="add")]
    graph = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "l", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "l", 16])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w[:, ::-1].copy(), "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", minilm.OPSET)])


@pytest.mark.parametrize("scheme", minilm_int8.SCHEMES)
def test_row_quantiser_is_per_row_and_close_to_fp32(scheme):
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    # rows of very different scales and offsets, one row of zeros
    x = (rng.normal(size=(3, 5, 64)) * rng.uniform(0.05, 30, size=(3, 5, 1))
         + rng.normal(size=(3, 5, 1))).astype(np.float32)
    x[1, 2] = 0.0
    model = _two_matmuls()
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    expect = x @ w["w"] + x @ w["w2"]
    # 7-bit weights: no u8 x s8 pair can saturate int16 (AVX2's vpmaddubsw) in any scheme
    kept = minilm_int8._RowQuantiser(model, scheme, 7).run(("b.",))
    assert kept == ["b.matmul"]
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulInteger") == 1 and ops.count("MatMul") == 1
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": x})[0]
    for i in range(x.shape[0]):  # each row's scale is its own: a sub-batch gives the same rows
        row = sess.run(None, {"x": x[i:i + 1, :3]})[0]
        np.testing.assert_array_equal(row, y[i:i + 1, :3])
    assert float(np.abs(y[1, 2] - expect[1, 2]).max()) == 0.0  # zeros stay exact
    rel = np.abs(y - expect).max(axis=-1) / np.abs(expect).max(axis=-1).clip(1e-6)
    assert float(rel[np.abs(expect).max(axis=-1) > 0].max()) < 0.03, rel


def test_row_quantiser_shares_one_activation_quantisation():
    model = _two_matmuls()
    assert minilm_int8._RowQuantiser(model, minilm_int8.SCHEME, 7).run(()) == []
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulInteger") == 2 and ops.count("ReduceMax") == 1
    assert {t.name for t in model.graph.initializer}.isdisjoint({"w", "w2"})  # fp32 weights gone

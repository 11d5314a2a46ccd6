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
from lumen_core.models import _files as files
from lumen_core.models import minilm, minilm_int8
from lumen_core.runtime import Runtime
from lumen_core.tasks import default_task_tables
from lumen_core.tasks.text_embedding import INT8_TASK_NAME, TASK_NAME

MIN_COSINE = 0.99


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    texts = json.loads((fixtures_dir / "minilm_reference.json").read_text())["texts"]
    return texts, np.load(fixtures_dir / "minilm_reference_embeddings.npy")


@pytest.fixture(scope="module")
def served(prepared_home, reference):
    """{task: [embedding of each reference text, each sent alone]} from the default runtime."""
    texts, _ = reference

    async def main(rt):
        async with rt:
            # an empty text is a 400 (TEI): the non-empty ones, each alone
            return {task: [(await rt.infer(rt.text_request(task, t))).outputs[minilm.OUTPUT]
                           for t in texts if t] for task in (TASK_NAME, INT8_TASK_NAME)}

    with S.lumen_home_env(prepared_home):
        tables = default_task_tables()
        assert INT8_TASK_NAME in [t["name"] for t in tables]
        return asyncio.run(main(Runtime.from_dict({"tasks": tables})))


def test_int8_task_matches_sentence_transformers(served, reference):
    texts, ref = reference
    ref = [r for t, r in zip(texts, ref, strict=True) if t]
    cos = [float(np.dot(v, r)) / float(np.linalg.norm(r))
           for v, r in zip(served[INT8_TASK_NAME], ref, strict=True)]
    print(f"int8 vs sentence-transformers: min cosine {min(cos):.5f}, mean {np.mean(cos):.5f} "
          f"over {len(cos)} non-empty texts")
    assert min(cos) >= MIN_COSINE, [round(c, 4) for c in cos]
    for v in served[INT8_TASK_NAME]:
        assert v.dtype == np.float32 and v.shape == (minilm.EMBEDDING_DIM,)
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-4
    # it is a different model: not the fp32 numbers
    assert not np.allclose(served[INT8_TASK_NAME][0], served[TASK_NAME][0], atol=1e-4)


def test_prepared_int8_model_is_hash_recorded_and_quantised(prepared_home):
    directory = models.require_model(models.MINILM_INT8, prepared_home)
    manifest = models.read_manifest(directory)
    assert manifest["name"] == models.MINILM_INT8 and manifest["graph"] == "int8-dynamic"
    entry = manifest["outputs"][models.MODEL_FILE]
    assert entry["sha256"] == files.sha256_file(directory / models.MODEL_FILE)
    assert manifest["source"]["onnxruntime"] and manifest["self_check_cosine"] >= MIN_COSINE
    graph = onnx.load(str(directory / models.MODEL_FILE)).graph
    ops = [n.op_type for n in graph.node]
    kept = [n.name for n in graph.node
            if n.op_type == "MatMul" and n.name.startswith(minilm_int8.FP32_MATMULS)]
    # 6 layers x 6 weight MatMuls (Q, K, V, attention output, FFN in, FFN out), 3 kept fp32
    assert ops.count("MatMulInteger") == 36 - 3 and len(kept) == len(minilm_int8.FP32_MATMULS)
    assert [i.name for i in graph.input] == [minilm.INPUT_IDS, minilm.ATTENTION_MASK]
    assert [o.name for o in graph.output] == [minilm.OUTPUT]
    fp32_size = (models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE).stat().st_size
    assert entry["bytes"] < fp32_size / 2  # int8 weights


def test_quantisation_is_deterministic(prepared_home, tmp_path):
    fp32 = tmp_path / "fp32.onnx"
    weights, config = minilm.load_weights(minilm.source_dir())
    onnx.save_model(minilm.build_graph(weights, config), str(fp32))
    minilm_int8.quantize(fp32, tmp_path / "int8.onnx")
    recorded = models.read_manifest(models.model_dir(models.MINILM_INT8, prepared_home))
    assert files.sha256_file(tmp_path / "int8.onnx") == recorded["outputs"][models.MODEL_FILE]["sha256"]

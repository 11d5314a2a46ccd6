"""Text tasks on any prepared text model: the "text_model" block (size, prompts, lower-casing),
the model a task names (store, folder, file) and never a silent substitute (issue 36, items 1,
4 and 7).  The prepared directories are made by ``tests/text_models.py`` (the importer's
layout), from the session's prepared MiniLM.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import numpy as np
import pytest
import text_models as TM

import lumen_core as lc
from lumen_core import models
from lumen_core.config import load_config
from lumen_core.errors import ConfigError
from lumen_core.models.text_model import TextModelError, parse_text_model, read_text_model
from lumen_core.tasks import text_embedding as te
from lumen_core.tasks.text_source import BERT_UNCASED_PREPROCESS_ID, preprocess_id

TOL = 1e-5


@pytest.fixture(scope="module")
def home(prepared_home, tmp_path_factory):
    """A store holding the MiniLM under new names, with prompts (and one with a default
    prompt and lower-casing), beside nothing else."""
    h = tmp_path_factory.mktemp("text_models_home")
    TM.minilm_as(h, "mini-prompts", prepared_home)
    TM.minilm_as(h, "mini-default", prepared_home, default_prompt_name="query",
                 do_lower_case=True)
    return h


def plain_table(prepared_home, name="plain"):
    return {"name": name, "backend": "text_embedding",
            "model": str(models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE)}


def embed(runtime, task, text, **meta):
    async def main():
        return await runtime.infer(lc.InferRequest(task, text, "text/plain", dict(meta)))
    return asyncio.run_coroutine_threadsafe(main(), runtime.loop).result(60).outputs["embedding"]


@pytest.fixture(scope="module")
def rt(home, prepared_home):
    old = os.environ.get("LUMEN_HOME")
    os.environ["LUMEN_HOME"] = str(home)
    try:
        runtime = lc.Runtime.from_dict({"tasks": [
            plain_table(prepared_home),
            {"name": "prompts", "backend": "text_embedding", "model_id": "mini-prompts"},
            {"name": "default", "backend": "text_embedding", "model_id": "mini-default"},
        ]})
        runtime.start_background()
    finally:
        if old is None:
            del os.environ["LUMEN_HOME"]
        else:
            os.environ["LUMEN_HOME"] = old
    yield runtime
    runtime.stop_background()


# ------------------------------------------------------------------------------ prompts
def test_a_prompt_name_puts_the_prompt_before_the_text(rt):
    for name, prefix in (("query", "query: "), ("passage", "passage: ")):
        got = embed(rt, "prompts", "How do I cook rice?", prompt_name=name)
        want = embed(rt, "plain", prefix + "How do I cook rice?")
        np.testing.assert_allclose(got, want, atol=TOL)
    # no prompt_name and no default prompt: the text as it is
    np.testing.assert_allclose(embed(rt, "prompts", "How do I cook rice?"),
                               embed(rt, "plain", "How do I cook rice?"), atol=TOL)


def test_the_default_prompt_and_lower_casing_apply_without_options(rt):
    want = embed(rt, "plain", "query: how do i cook rice?")
    np.testing.assert_allclose(embed(rt, "default", "How Do I COOK Rice?"), want, atol=TOL)
    # a named prompt replaces the default one
    np.testing.assert_allclose(embed(rt, "default", "Rice", prompt_name="passage"),
                               embed(rt, "plain", "passage: rice"), atol=TOL)


def test_the_fast_path_applies_the_default_prompt(rt):
    from lumen_core import native

    route = rt.tasks["default"]
    backend = route.backend
    fast = backend.text_fast_path()
    for text in ("Hello", "Héllo WÖRLD", "a " * 100):
        req = lc.InferRequest("default", text, "text/plain")
        desc = native.descriptor.parse_meta(req.meta, len(text.encode()), route.contract)
        got, want = fast.prepare(req, text), backend.prepare(req, desc, text)
        assert got is not None
        np.testing.assert_array_equal(np.asarray(got.tensors[0]), np.asarray(want.tensors[0]))
        assert backend.tokenizer.encode("query: " + text.lower()).ids == \
            np.asarray(got.tensors[0]).tolist()


def test_an_unknown_prompt_name_lists_the_prompts(rt):
    with pytest.raises(lc.InvalidArgument) as info:
        embed(rt, "prompts", "x", prompt_name="qurey")
    assert info.value.field == "prompt_name"
    assert "'query'" in info.value.message and "'passage'" in info.value.message
    with pytest.raises(lc.InvalidArgument) as info:
        embed(rt, "plain", "x", prompt_name="query")
    assert "none" in info.value.message


def test_token_ids_with_a_prompt_name_are_refused(rt):
    req = (lc.new_infer_request("prompts").for_tensor_array(
        np.array([[101, 7592, 102]], np.int64), "NL", BERT_UNCASED_PREPROCESS_ID)
        .with_meta("prompt_name", "query").build())

    async def main():
        return await rt.infer(req)
    with pytest.raises(lc.InvalidArgument) as info:
        asyncio.run_coroutine_threadsafe(main(), rt.loop).result(60)
    assert info.value.field == "prompt_name"


def test_describe_lists_prompts_and_the_model(rt):
    d = rt.describe("prompts")
    assert d["prompts"] == {"query": "query: ", "passage": "passage: "}
    assert d["default_prompt_name"] is None and d["model_id"] == "mini-prompts"
    assert d["embedding"]["dim"] == 384 and d["text_model"]["pooling"] == "mean"
    assert rt.describe("default")["default_prompt_name"] == "query"
    assert "prompt_name" in d["request_options"]
    # the MiniLM's tokenizer under another name keeps the MiniLM's preprocess id
    assert d["tokenizer"] == BERT_UNCASED_PREPROCESS_ID


# ------------------------------------------------------------------- which model, or an error
def _start(tables):
    asyncio.run(lc.Runtime.from_dict({"tasks": tables}).start())


def test_an_unprepared_model_id_is_a_config_error_naming_the_store(home, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(home))
    with pytest.raises(ConfigError) as info:
        _start([{"name": "t", "backend": "text_embedding", "model_id": "all-minilm-l12-v2"}])
    msg = str(info.value)
    assert "tasks[0].model_id" in msg and "'all-minilm-l12-v2'" in msg
    assert "mini-prompts (embed)" in msg and "mini-default (embed)" in msg
    assert "lumen models prepare" in msg and "lumen models import DIR --name all-minilm-l12-v2" in msg


def test_a_prepared_model_that_is_not_text_is_a_config_error(home, prepared_home, monkeypatch):
    ocr = models.model_dir(models.OCR, prepared_home)
    dst = models.models_dir(home) / models.OCR
    if not dst.exists():
        shutil.copytree(ocr, dst, copy_function=os.link)
    monkeypatch.setenv("LUMEN_HOME", str(home))
    with pytest.raises(ConfigError, match="is not a text model"):
        _start([{"name": "t", "backend": "text_embedding", "model_id": models.OCR}])


def test_a_folder_in_the_config_is_relative_to_the_config_file(home, tmp_path):
    folder = tmp_path / "models" / "my-model"
    shutil.copytree(models.models_dir(home) / "mini-prompts", folder, copy_function=os.link)
    cfg = tmp_path / "lumen.toml"
    cfg.write_text('[[tasks]]\nname = "mine"\nbackend = "text_embedding"\n'
                   'model = "models/my-model"\n')

    async def main():
        async with lc.Runtime(load_config(str(cfg))) as runtime:
            res = await runtime.infer(lc.InferRequest("mine", "hi", "text/plain",
                                                      {"prompt_name": "query"}))
            return res.outputs["embedding"], runtime.describe("mine")

    vec, desc = asyncio.run(main())
    assert vec.shape == (384,) and desc["model_id"] == "my-model"
    assert desc["prompts"]["query"] == "query: "


def test_a_max_seq_length_past_the_models_positions_is_a_config_error(home, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(home))
    with pytest.raises(ConfigError, match=r"options\.max_seq_length.*at most 512"):
        _start([{"name": "t", "backend": "text_embedding", "model_id": "mini-prompts",
                 "options": {"max_seq_length": 513}}])


# --------------------------------------------------------------------------- the block itself
def test_the_block_parses_strictly(tmp_path):
    tm = parse_text_model(TM.MINILM_BLOCK, "m.json")
    assert tm.dimension == 384 and tm.prompts["query"] == "query: "
    for bad, what in (({**TM.MINILM_BLOCK, "kind": "classify"}, "kind"),
                      ({**TM.MINILM_BLOCK, "dimension": "384"}, "dimension"),
                      ({k: v for k, v in TM.MINILM_BLOCK.items() if k != "max_seq_length"},
                       "max_seq_length"),
                      ({**TM.MINILM_BLOCK, "default_prompt_name": "search"}, "default_prompt_name"),
                      ({**TM.MINILM_BLOCK, "pooling_mode": "mean"}, "pooling_mode")):
        with pytest.raises(TextModelError, match=what):
            parse_text_model(bad, "m.json")
    with pytest.raises(TextModelError, match="manifest.json: missing"):
        read_text_model(tmp_path)


def test_the_preprocess_id_follows_the_tokenizer(prepared_home, tmp_path):
    tok = models.model_dir(models.MINILM, prepared_home) / "tokenizer.json"
    assert preprocess_id(str(tok), "anything") == BERT_UNCASED_PREPROCESS_ID
    data = json.loads(tok.read_text())
    data["model"]["vocab"]["zzzz-new-token"] = len(data["model"]["vocab"])
    data["truncation"] = None  # not part of the identity
    other = tmp_path / "tokenizer.json"
    other.write_text(json.dumps(data))
    pp = preprocess_id(str(other), "other")
    assert pp.startswith("tokenizer_") and pp.endswith("_v1")
    data["padding"] = {"strategy": "BatchLongest"}
    other.write_text(json.dumps(data))
    assert preprocess_id(str(other), "other") == pp
    assert te.PREPROCESS_ID == BERT_UNCASED_PREPROCESS_ID

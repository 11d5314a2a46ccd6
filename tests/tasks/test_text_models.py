"""Text tasks on any prepared text model: the "text_model" block (size, prompts, lower-casing),
the model a task names (store, folder, file) and never a silent substitute (issue 36, items 1,
4 and 7).  The models are the committed sentence-transformers folders of
``tests/fixtures/st_models/`` built by the real importer (``lumen models import``'s
``import_folder``, and ``prepare_folder`` for ``model = "folder"``), and served vectors are
checked against the committed ``SentenceTransformer.encode`` references.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import numpy as np
import pytest
import serve_support as S
import st_fixtures as F

import lumen_core as lc
from lumen_core import models
from lumen_core.config import load_config
from lumen_core.errors import ConfigError
from lumen_core.models import minilm, st_import
from lumen_core.models.text_model import TextModelError, parse_text_model, read_text_model
from lumen_core.tasks import text_embedding as te
from lumen_core.tasks.text_source import BERT_UNCASED_PREPROCESS_ID, preprocess_id

TOL = 1e-5
#: prompts, none by default (XLM-R, last token)
PROMPTS = "xlmr-lasttoken"
#: prompts, "query" by default (MPNet)
DEFAULT = "mpnet-mean-prompt"
#: do_lower_case (BERT, cls)
LOWER = "bert-cls-lower"
#: a block of the shape the importer writes, for the parser's checks
BLOCK = {
    "kind": "embed", "architecture": "bert", "dimension": 384, "max_seq_length": 256,
    "max_positions": 512, "do_lower_case": False, "pad_token_id": 0, "pooling": "mean",
    "normalize": True, "prompts": {"query": "query: ", "passage": "passage: "},
    "default_prompt_name": None, "num_labels": 1, "source": "tests", "content_hash": "",
}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A store holding three imported folders (``lumen models import``) and the MiniLM
    package's own folder imported like any other, beside nothing else."""
    h = tmp_path_factory.mktemp("text_models_home")
    F.imported(h, PROMPTS, "xl-prompts")
    F.imported(h, DEFAULT, "mp-default")
    F.imported(h, LOWER, "bert-lower")
    st_import.import_folder(minilm.source_dir(), name="minilm-folder", home=h)
    return h


def embed(runtime, task, text, **meta):
    async def main():
        return await runtime.infer(lc.InferRequest(task, text, "text/plain", dict(meta)))
    return asyncio.run_coroutine_threadsafe(main(), runtime.loop).result(60).outputs["embedding"]


@pytest.fixture(scope="module")
def rt(home, prepared_home):
    """The imported models by ``model_id``, and every committed folder by ``model =
    "folder"`` (task ``f-<folder>``: prepared by the importer into ``home``'s cache)."""
    with S.lumen_home_env(home):
        runtime = lc.Runtime.from_dict({"tasks": [
            {"name": "prompts", "backend": "text_embedding", "model_id": "xl-prompts"},
            {"name": "default", "backend": "text_embedding", "model_id": "mp-default"},
            {"name": "lower", "backend": "text_embedding", "model_id": "bert-lower"},
            {"name": "minilm-folder", "backend": "text_embedding", "model_id": "minilm-folder"},
            {"name": "minilm", "backend": "text_embedding",
             "model": str(models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE)},
            *({"name": f"f-{name}", "backend": "text_embedding", "model": str(F.ST_MODELS / name)}
              for name in F.EMBED),
        ]})
        runtime.start_background()
    yield runtime
    runtime.stop_background()


# ------------------------------------------------------- served vectors = sentence-transformers
@pytest.mark.parametrize("name", F.EMBED)
def test_served_vectors_equal_sentence_transformers(rt, name):
    """Every architecture and pooling, through the runtime (``rt.infer``), against the
    committed ``SentenceTransformer.encode`` vectors (cosine >= 0.9999; the norm within 1e-3
    where not normalised), and ``encode(prompt_name=...)``'s with ``prompt_name``.  The
    empty reference text is left out: the server refuses an empty text (a 400)."""
    ref = F.reference(name)
    keep = [i for i, t in enumerate(ref["texts"]) if t]
    want = F.reference_vectors(name)[keep]
    got = np.stack([embed(rt, f"f-{name}", ref["texts"][i]) for i in keep])
    assert got.shape == want.shape and F.cosines(got, want).min() >= F.MIN_COSINE
    if not rt.describe(f"f-{name}")["embedding"]["normalized"]:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1),
                                   rtol=1e-3)
    if "prompt_name" in ref:
        want = F.reference_vectors(name, prompt=True)[keep]
        got = np.stack([embed(rt, f"f-{name}", ref["texts"][i], prompt_name=ref["prompt_name"])
                        for i in keep])
        assert F.cosines(got, want).min() >= F.MIN_COSINE


def test_the_minilm_folder_imported_serves_the_builtin_vectors(rt):
    for text in ("Hello world", "Ünïcode and 東京", "word " * 400):
        np.testing.assert_allclose(embed(rt, "minilm-folder", text), embed(rt, "minilm", text),
                                   atol=TOL)


# ------------------------------------------------------------------------------ prompts
def test_a_prompt_name_puts_the_prompt_before_the_text(rt):
    for name, prefix in (("query", "query: "), ("passage", "passage: ")):
        got = embed(rt, "prompts", "How do I cook rice?", prompt_name=name)
        want = embed(rt, "prompts", prefix + "How do I cook rice?")
        np.testing.assert_allclose(got, want, atol=TOL)
        assert np.abs(got - embed(rt, "prompts", "How do I cook rice?")).max() > 10 * TOL
    # no prompt_name and no default prompt: the text as it is (the empty "document" prompt)
    np.testing.assert_allclose(embed(rt, "prompts", "How do I cook rice?"),
                               embed(rt, "prompts", "How do I cook rice?", prompt_name="document"),
                               atol=TOL)


def test_the_default_prompt_and_lower_casing_apply_without_options(rt):
    # "document" is the empty prompt: the text exactly as sent
    want = embed(rt, "default", "query: How do I cook rice?", prompt_name="document")
    np.testing.assert_allclose(embed(rt, "default", "How do I cook rice?"), want, atol=TOL)
    # a named prompt replaces the default one
    np.testing.assert_allclose(embed(rt, "default", "Rice", prompt_name="passage"),
                               embed(rt, "default", "passage: Rice", prompt_name="document"),
                               atol=TOL)
    np.testing.assert_allclose(embed(rt, "lower", "How Do I COOK Rice?"),
                               embed(rt, "lower", "how do i cook rice?"), atol=TOL)


@pytest.mark.parametrize("task, model_text", [
    ("default", lambda t: "query: " + t), ("lower", lambda t: t.lower())])
def test_the_fast_path_applies_the_default_prompt(rt, task, model_text):
    from lumen_core import native

    route = rt.tasks[task]
    backend = route.backend
    fast = backend.text_fast_path()
    for text in ("Hello", "Héllo WÖRLD", "a " * 6):  # short: these models take 20-30 tokens
        req = lc.InferRequest(task, text, "text/plain")
        desc = native.descriptor.parse_meta(req.meta, len(text.encode()), route.contract)
        got, want = fast.prepare(req, text), backend.prepare(req, desc, text)
        assert got is not None
        np.testing.assert_array_equal(np.asarray(got.tensors[0]), np.asarray(want.tensors[0]))
        assert backend.tokenizer.encode(model_text(text)).ids == \
            np.asarray(got.tensors[0]).tolist()


def test_an_unknown_prompt_name_lists_the_prompts(rt):
    with pytest.raises(lc.InvalidArgument) as info:
        embed(rt, "prompts", "x", prompt_name="qurey")
    assert info.value.field == "prompt_name"
    assert "'query'" in info.value.message and "'passage'" in info.value.message
    with pytest.raises(lc.InvalidArgument) as info:
        embed(rt, "minilm", "x", prompt_name="query")
    assert "none" in info.value.message


def test_token_ids_with_a_prompt_name_are_refused(rt):
    req = (lc.new_infer_request("prompts").for_tensor_array(
        np.array([[0, 5, 2]], np.int64), "NL", rt.describe("prompts")["tokenizer"])
        .with_meta("prompt_name", "query").build())

    async def main():
        return await rt.infer(req)
    with pytest.raises(lc.InvalidArgument) as info:
        asyncio.run_coroutine_threadsafe(main(), rt.loop).result(60)
    assert info.value.field == "prompt_name"


def test_describe_lists_prompts_and_the_model(rt):
    d = rt.describe("prompts")
    assert d["prompts"] == {"document": "", "passage": "passage: ", "query": "query: "}
    assert d["default_prompt_name"] is None and d["model_id"] == "xl-prompts"
    dim = F.reference_vectors(PROMPTS).shape[1]
    assert d["embedding"]["dim"] == dim and d["text_model"]["pooling"] == "lasttoken"
    assert rt.describe("default")["default_prompt_name"] == "query"
    assert "prompt_name" in d["request_options"]
    assert d["tokenizer"].startswith("tokenizer_")  # its own tokenizer, its own id
    # the MiniLM's tokenizer under another name keeps the MiniLM's preprocess id
    assert rt.describe("minilm-folder")["tokenizer"] == BERT_UNCASED_PREPROCESS_ID


# ------------------------------------------------------------------- which model, or an error
def _start(tables):
    asyncio.run(lc.Runtime.from_dict({"tasks": tables}).start())


def test_an_unprepared_model_id_is_a_config_error_naming_the_store(home, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(home))
    with pytest.raises(ConfigError) as info:
        _start([{"name": "t", "backend": "text_embedding", "model_id": "all-minilm-l12-v2"}])
    msg = str(info.value)
    assert "tasks[0].model_id" in msg and "'all-minilm-l12-v2'" in msg
    assert "xl-prompts (embed)" in msg and "mp-default (embed)" in msg
    assert "lumen models prepare" in msg and "lumen models import DIR --name all-minilm-l12-v2" in msg


def test_a_prepared_model_that_is_not_text_is_a_config_error(home, prepared_home, monkeypatch):
    ocr = models.model_dir(models.OCR, prepared_home)
    dst = models.models_dir(home) / models.OCR
    if not dst.exists():
        shutil.copytree(ocr, dst, copy_function=os.link)
    monkeypatch.setenv("LUMEN_HOME", str(home))
    with pytest.raises(ConfigError, match="is not a text model"):
        _start([{"name": "t", "backend": "text_embedding", "model_id": models.OCR}])


def test_a_folder_in_the_config_is_relative_to_the_config_file(tmp_path, monkeypatch):
    """A sentence-transformers folder (not prepared) beside the config: the importer prepares
    it into the store's cache, the task is named after the folder, the prompt applies."""
    folder = tmp_path / "models" / "my-model"
    shutil.copytree(F.ST_MODELS / DEFAULT, folder)
    cfg = tmp_path / "lumen.toml"
    cfg.write_text('[[tasks]]\nname = "mine"\nbackend = "text_embedding"\n'
                   'model = "models/my-model"\n')
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "home"))
    ref = F.reference(DEFAULT)

    async def main():
        async with lc.Runtime(load_config(str(cfg))) as runtime:
            res = await runtime.infer(lc.InferRequest("mine", ref["texts"][0], "text/plain",
                                                      {"prompt_name": ref["prompt_name"]}))
            return res.outputs["embedding"], runtime.describe("mine")

    vec, desc = asyncio.run(main())
    assert F.cosines(vec, F.reference_vectors(DEFAULT, prompt=True)[0]).min() >= F.MIN_COSINE
    assert desc["model_id"] == "my-model" and desc["prompts"]["query"] == "query: "
    assert list((tmp_path / "home" / "models" / ".folders").iterdir())  # built once, cached


def test_a_max_seq_length_past_the_models_positions_is_a_config_error(home, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(home))
    positions = read_text_model(models.models_dir(home) / "xl-prompts").max_positions
    with pytest.raises(ConfigError, match=rf"options\.max_seq_length.*at most {positions}"):
        _start([{"name": "t", "backend": "text_embedding", "model_id": "xl-prompts",
                 "options": {"max_seq_length": positions + 1}}])


# --------------------------------------------------------------------------- the block itself
def test_the_block_parses_strictly(tmp_path):
    tm = parse_text_model(BLOCK, "m.json")
    assert tm.dimension == 384 and tm.prompts["query"] == "query: "
    for bad, what in (({**BLOCK, "kind": "classify"}, "kind"),
                      ({**BLOCK, "dimension": "384"}, "dimension"),
                      ({k: v for k, v in BLOCK.items() if k != "max_seq_length"},
                       "max_seq_length"),
                      ({**BLOCK, "default_prompt_name": "search"}, "default_prompt_name"),
                      ({**BLOCK, "pooling_mode": "mean"}, "pooling_mode")):
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

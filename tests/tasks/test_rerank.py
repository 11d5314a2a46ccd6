"""The rerank backend: (query, document) pairs encoded as CrossEncoder encodes them (the
tokenizer's pair template, longest-first truncation), batched by length, scores equal to the
model's on those ids and CrossEncoder.predict's committed scores.  The model is the tiny BERT
cross-encoder folder ``tests/fixtures/st_models/bert-cross`` named in the task's config
(``model = "folder"``: the real importer prepares it)."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import serve_support as S
import st_fixtures as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import lumen_core as lc
from lumen_core import models
from lumen_core.errors import ConfigError
from lumen_core.models import st_import
from lumen_core.models.text_tokenize import longest_first
from lumen_core.tasks.rerank import LONG_TEXT_CHARS

FOLDER = "bert-cross"
MAX_LEN = F.reference(FOLDER)["max_length"]
TASK = "rr"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("rerank_home")


@pytest.fixture(scope="module")
def rr_dir(home):
    """The folder as the task's ``model = "folder"`` prepares it (the importer's cache)."""
    return st_import.prepare_folder(F.ST_MODELS / FOLDER, home=home)


@pytest.fixture(scope="module")
def tok_path(rr_dir):
    return rr_dir / "tokenizer.json"


@pytest.fixture(scope="module")
def rt(home, rr_dir):
    with S.lumen_home_env(home):
        runtime = lc.Runtime.from_dict({"tasks": [
            {"name": TASK, "backend": "rerank", "model": str(F.ST_MODELS / FOLDER),
             "batching": {"max_queue_delay_us": 20000}}]})
        runtime.start_background()
    yield runtime
    runtime.stop_background()


def score(runtime, query, docs, **meta):
    reqs = [lc.InferRequest(TASK, d, "text/plain", {"query": query, **meta}) for d in docs]
    return asyncio.run_coroutine_threadsafe(runtime.infer_many(reqs), runtime.loop).result(60)


@pytest.fixture(scope="module")
def plain_tok(prepared_home):
    """A tokenizer in which "a" and "b" are one token each (the MiniLM's)."""
    return Tokenizer.from_file(str(models.model_dir(models.MINILM, prepared_home) / "tokenizer.json"))


@settings(max_examples=300, deadline=None)
@given(n_a=st.integers(0, 80), n_b=st.integers(0, 80), budget=st.integers(2, 40))
def test_longest_first_is_the_tokenizers_rule(plain_tok, n_a, n_b, budget):
    """Against the Rust tokenizers truncation itself, on encodings of those lengths."""
    a, b = " ".join(["a"] * n_a), " ".join(["b"] * n_b)
    plain_tok.enable_truncation(budget + 3, strategy="longest_first")
    enc = plain_tok.encode(a, b)
    want = (sum(1 for s in enc.sequence_ids if s == 0), sum(1 for s in enc.sequence_ids if s == 1))
    assert longest_first(n_a, n_b, budget) == want


def test_scores_equal_crossencoder_predict(rt):
    """The committed ``CrossEncoder.predict`` scores of the folder's reference pairs, served
    through the runtime (each query's documents in one call)."""
    ref = F.reference(FOLDER)
    for (query, doc), raw in zip(ref["pairs"], ref["raw"], strict=True):
        got = score(rt, query, [doc])[0].outputs["logits"][0]
        assert abs(float(got) - raw) <= F.RAW_ATOL


def test_scores_equal_the_models_on_crossencoder_ids(rt, rr_dir):
    rng = random.Random(3)
    words = "rice cooking water boil pan heat salt the a of to quickly Ünïcode 東京".split()
    query = "how to cook rice"
    docs = [" ".join(rng.choice(words) for _ in range(n)) for n in (1, 3, 8, 20, 40, 200)]
    docs.append("x " * (LONG_TEXT_CHARS * 3))  # tokenized by prefix
    res = score(rt, query, docs)
    got = np.array([r.outputs["logits"][0] for r in res], np.float32)
    want = F.crossencoder_raw(rr_dir, query, docs, MAX_LEN)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert max(int(r.meta["lumen.tokens"]) for r in res) == MAX_LEN


@pytest.mark.parametrize("query_words", [1, 10, 20, 40])
def test_long_documents_and_queries_cut_as_the_tokenizer_cuts(rt, tok_path, query_words):
    backend = rt.tasks[TASK].backend
    ref = Tokenizer.from_file(str(tok_path))
    ref.no_padding()
    ref.enable_truncation(MAX_LEN, strategy="longest_first")
    plain = Tokenizer.from_file(str(tok_path))
    plain.no_truncation()
    query = " ".join(f"q{i}" for i in range(query_words))
    for doc in ("short doc", "word " * 5000, "Ünï " * 3000 + "end", "a" * 9000 + " b c"):
        ids, n = backend.pair_ids(query, doc)
        assert ids == ref.encode(query, doc).ids
        whole = len(plain.encode(query, doc).ids)
        assert (n > 0) == (whole > MAX_LEN) and n <= whole


def test_errors_name_the_field(rt):
    for meta, field in (({}, "query"), ({"query": ""}, "query"),
                        ({"query": "q", "truncate": "maybe"}, "truncate")):
        with pytest.raises(lc.InvalidArgument) as info:
            asyncio.run_coroutine_threadsafe(
                rt.infer(lc.InferRequest(TASK, "doc", "text/plain", meta)), rt.loop).result(60)
        assert info.value.field == field
    with pytest.raises(lc.PayloadTooLarge):
        asyncio.run_coroutine_threadsafe(rt.infer(lc.InferRequest(
            TASK, "word " * 100, "text/plain", {"query": "q", "truncate": "false"})),
            rt.loop).result(60)


def test_describe_and_kind_checks(rt, rr_dir, prepared_home):
    d = rt.describe(TASK)
    assert d["backend"] == "rerank" and d["rerank"]["num_labels"] == 1
    assert d["max_seq_length"] == MAX_LEN and d["model_id"] == FOLDER
    # an embedding backend on a rerank model, and the other way round: named config errors
    with pytest.raises(ConfigError, match='backend = "rerank"'):
        asyncio.run(lc.Runtime.from_dict({"tasks": [
            {"name": "e", "backend": "text_embedding", "model": str(rr_dir)}]}).start())
    mini = models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE
    with pytest.raises(ConfigError, match='backend = "text_embedding"'):
        asyncio.run(lc.Runtime.from_dict({"tasks": [
            {"name": "r", "backend": "rerank", "model": str(mini)}]}).start())


def test_the_documents_of_one_call_batch_together(rt, rr_dir):
    """infer_many submits a call's documents at once: they run in fewer batches than there
    are documents (the task's queue delay lets them gather), each with its own score."""
    task = rt.tasks[TASK]

    def batches() -> tuple:
        return (sum(i.stats["batches"] for i in task.instances),
                sum(i.stats["items"] for i in task.instances))

    docs = [f"document number {i} about rice" for i in range(16)]
    b0, n0 = batches()
    res = score(rt, QUERY_FOR_BATCH, docs)
    b1, n1 = batches()
    assert n1 - n0 == len(docs) and b1 - b0 < len(docs)
    want = F.crossencoder_raw(rr_dir, QUERY_FOR_BATCH, docs, MAX_LEN)
    np.testing.assert_allclose([r.outputs["logits"][0] for r in res], want, atol=1e-5)


QUERY_FOR_BATCH = "rice"

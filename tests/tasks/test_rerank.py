"""The rerank backend: (query, document) pairs encoded as CrossEncoder encodes them (the
tokenizer's pair template, longest-first truncation), batched by length, scores equal to the
model's on those ids; the tiny cross-encoder of ``tests/text_models.py`` stands in for an
imported one (its scores are reproduced in numpy)."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import text_models as TM
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import lumen_core as lc
from lumen_core import models
from lumen_core.errors import ConfigError
from lumen_core.models.text_tokenize import longest_first
from lumen_core.tasks.rerank import LONG_TEXT_CHARS

MAX_LEN = 32
TASK = "rr"


@pytest.fixture(scope="module")
def tok_path(prepared_home):
    return models.model_dir(models.MINILM, prepared_home) / "tokenizer.json"


@pytest.fixture(scope="module")
def rr_dir(tmp_path_factory, tok_path):
    return TM.tiny_reranker(tmp_path_factory.mktemp("rr") / "tiny-rr", tok_path, MAX_LEN)


@pytest.fixture(scope="module")
def rt(rr_dir):
    runtime = lc.Runtime.from_dict({"tasks": [
        {"name": TASK, "backend": "rerank", "model": str(rr_dir),
         "batching": {"max_queue_delay_us": 20000}}]})
    runtime.start_background()
    yield runtime
    runtime.stop_background()


def score(runtime, query, docs, **meta):
    reqs = [lc.InferRequest(TASK, d, "text/plain", {"query": query, **meta}) for d in docs]
    return asyncio.run_coroutine_threadsafe(runtime.infer_many(reqs), runtime.loop).result(60)


@pytest.fixture(scope="module")
def plain_tok(tok_path):
    return Tokenizer.from_file(str(tok_path))


@settings(max_examples=300, deadline=None)
@given(n_a=st.integers(0, 80), n_b=st.integers(0, 80), budget=st.integers(2, 40))
def test_longest_first_is_the_tokenizers_rule(plain_tok, n_a, n_b, budget):
    """Against the Rust tokenizers truncation itself, on encodings of those lengths."""
    a, b = " ".join(["a"] * n_a), " ".join(["b"] * n_b)
    plain_tok.enable_truncation(budget + 3, strategy="longest_first")
    enc = plain_tok.encode(a, b)
    want = (sum(1 for s in enc.sequence_ids if s == 0), sum(1 for s in enc.sequence_ids if s == 1))
    assert longest_first(n_a, n_b, budget) == want


def test_scores_equal_the_models_on_crossencoder_ids(rt, tok_path):
    rng = random.Random(3)
    words = "rice cooking water boil pan heat salt the a of to quickly Ünïcode 東京".split()
    query = "how to cook rice"
    docs = [" ".join(rng.choice(words) for _ in range(n)) for n in (1, 3, 8, 20, 40, 200)]
    docs.append("x " * (LONG_TEXT_CHARS * 3))  # tokenized by prefix
    res = score(rt, query, docs)
    got = np.array([r.outputs["logits"][0] for r in res], np.float32)
    want = TM.rerank_reference(tok_path, query, docs, MAX_LEN)
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
    assert d["max_seq_length"] == MAX_LEN and d["model_id"] == "tiny-rr"
    # an embedding backend on a rerank model, and the other way round: named config errors
    with pytest.raises(ConfigError, match='backend = "rerank"'):
        asyncio.run(lc.Runtime.from_dict({"tasks": [
            {"name": "e", "backend": "text_embedding", "model": str(rr_dir)}]}).start())
    mini = models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE
    with pytest.raises(ConfigError, match='backend = "text_embedding"'):
        asyncio.run(lc.Runtime.from_dict({"tasks": [
            {"name": "r", "backend": "rerank", "model": str(mini)}]}).start())


def test_the_documents_of_one_call_batch_together(rt, tok_path):
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
    want = TM.rerank_reference(tok_path, QUERY_FOR_BATCH, docs, MAX_LEN)
    np.testing.assert_allclose([r.outputs["logits"][0] for r in res], want, atol=1e-5)


QUERY_FOR_BATCH = "rice"

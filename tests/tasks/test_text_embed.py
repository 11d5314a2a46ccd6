"""text_embed on the prepared all-MiniLM-L6-v2: both routes against the sentence-transformers
fixture, concurrency, every rejection, raw + tensor sharing a batch, length-aware formation.

One runtime per module (ORT session creation dominates); concurrency runs on its loop thread.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lumen_core as lc
from lumen_core import models
from lumen_core.batching.dynamic import DynamicBatcher, _length_window
from lumen_core.config import BatchingConfig
from lumen_core.engine.session import cpu_session
from lumen_core.errors import ConfigError, ModelMissingError
from lumen_core.models import minilm
from lumen_core.tasks import default_task_tables
from lumen_core.tasks import text_embedding as te

FIXTURE_TOLERANCE = 1e-4
TASK = te.TASK_NAME
PP = te.PREPROCESS_ID
WAIT_S = 120


def table(home, **batching) -> dict:
    batching.setdefault("max_queue_size", 2048)
    return {"name": TASK, "backend": te.BACKEND_NAME,
            "model": str(models.model_dir(models.MINILM, home) / models.MODEL_FILE),
            "batching": batching}


@pytest.fixture(scope="module")
def rt(prepared_home):
    runtime = lc.Runtime.from_dict({"tasks": [table(prepared_home)]})
    runtime.start_background()
    yield runtime
    runtime.stop_background()


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    with open(fixtures_dir / "minilm_reference.json", encoding="utf-8") as fh:
        meta = json.load(fh)
    return meta["texts"], meta["input_ids"], np.load(fixtures_dir / "minilm_reference_embeddings.npy")


def on_loop(runtime, coro):
    """Run ``coro`` on the runtime's loop thread (where its batcher lives); return its result."""
    return asyncio.run_coroutine_threadsafe(coro, runtime.loop).result(WAIT_S)


def raw(text, mime="text/plain"):
    payload = text if isinstance(text, (bytes, bytearray)) else text.encode("utf-8")
    return lc.InferRequest(task=TASK, payload=payload, payload_mime=mime)


def tensor(ids, dtype=np.int64, layout="NL", pp=PP):
    arr = np.asarray(ids, dtype=dtype).reshape(1, -1)
    return lc.new_infer_request(TASK).for_tensor_array(arr, layout=layout, preprocess_id=pp).build()


def gather(runtime, reqs, return_exceptions=False):
    async def main():
        return await asyncio.gather(*[runtime.infer(r) for r in reqs],
                                    return_exceptions=return_exceptions)
    return on_loop(runtime, main())


# ------------------------------------------------------------------------------ correctness
def test_fixture_through_both_routes(rt, reference):
    texts, ids, expected = reference
    assert "" in texts and max(len(i) for i in ids) == te.DEFAULT_MAX_SEQ_LENGTH
    # an empty text is refused (issue 12 item 7, as TEI); its fixture row, [CLS] [SEP], is
    # checked through the tensor route
    keep = [i for i, t in enumerate(texts) if t]
    res = gather(rt, [raw(texts[i]) for i in keep] + [tensor(i) for i in ids])
    got = np.stack([r.outputs["embedding"] for r in res])
    assert got.dtype == np.float32 and got.shape == (len(keep) + len(ids), te.EMBEDDING_DIM)
    np.testing.assert_allclose(got[:len(keep)], expected[keep], atol=FIXTURE_TOLERANCE, rtol=0)
    np.testing.assert_allclose(got[len(keep):], expected, atol=FIXTURE_TOLERANCE, rtol=0)
    # the raw route's ids are the fixture's (incl. the truncated one): lumen.tokens reports them
    assert [int(r.meta["lumen.tokens"]) for r in res[:len(keep)]] == [len(ids[i]) for i in keep]
    backend = rt.tasks[TASK].backend
    assert [backend._token_ids(t, False) for t in texts] == ids


@pytest.mark.parametrize("payload", ["", b""], ids=["str", "bytes"])
def test_an_empty_text_is_a_payload_error_and_fails_alone(rt, payload):
    req = lc.InferRequest(task=TASK, payload=payload, payload_mime="text/plain")
    res = gather(rt, [req, raw("hello world")], return_exceptions=True)
    assert isinstance(res[0], lc.InvalidArgument) and res[0].field == "payload"
    assert "empty" in res[0].message
    assert res[1].outputs["embedding"].shape == (te.EMBEDDING_DIM,)


def _long_texts() -> list:
    rng = random.Random(7)
    words = ("the batcher groups requests by execution signature while Ünïcödé tèxt, "
             "naïve café 東京 and ПРИВЕТ mix; punctuation!? 12345").split()
    prose = " ".join(rng.choice(words) for _ in range(4000))
    cut = te.LONG_TEXT_CHARS
    return [
        prose,
        "long " * 1000,
        " " * 9000 + prose[:3000],                      # no tokens in the first prefixes
        "x" * (cut + 50) + " " + prose[:4000],          # a >100-char word cut by the prefix
        prose[:cut - 3] + "e\u0301" * 40 + prose[:3000],  # combining marks across the cut
        "東京大学" * 1500,                                # every CJK character is a word
        "a" * (cut - 1) + " b" * 300,
        "\t\n".join(prose[:5000].split(" ")),
        "word " * 60 + "z" * 5000,                       # fewer tokens than the limit
    ]


@pytest.mark.parametrize("off_loop", [False, True], ids=["encode", "encode_batch"])
def test_prefix_first_truncation_equals_the_full_tokenization(rt, off_loop):
    backend = rt.tasks[TASK].backend
    full = minilm.load_tokenizer(models.model_dir(models.MINILM, _home(rt)) / minilm.TOKENIZER_FILE)
    for text in _long_texts():
        assert backend._token_ids(text, off_loop) == full.encode(text).ids, text[:40]


def _home(runtime):
    import pathlib

    return pathlib.Path(runtime.tasks[TASK].backend.model.path).parents[2]


def test_charsets_decode_to_the_same_text(rt):
    text = "Café naïve — ünïcödé"
    ascii_text = "plain ascii text"
    res = gather(rt, [
        raw(text), raw(text.encode("latin-1", "replace"), "text/plain; charset=ISO-8859-1"),
        raw(text.encode("utf-16"), "text/plain;charset=utf-16"),
        raw(text.encode("utf-8"), 'Text/Plain; Charset="UTF-8"'),
        raw(ascii_text), raw(ascii_text.encode("ascii"), "text/plain; charset=us-ascii"),
    ])
    vecs = [r.outputs["embedding"] for r in res]
    # latin-1 cannot hold the em dash: '?' replaces it, so that text differs in one token
    np.testing.assert_allclose(vecs[2], vecs[0], atol=1e-6)
    np.testing.assert_allclose(vecs[3], vecs[0], atol=1e-6)
    np.testing.assert_allclose(vecs[5], vecs[4], atol=1e-6)
    assert np.abs(vecs[1] - vecs[0]).max() > 1e-3


def test_huge_payload_is_tokenized_off_the_loop_and_truncated(rt, reference):
    texts, _, expected = reference
    long_idx = texts.index(max(texts, key=len))
    big = texts[long_idx] + " long" * 20000  # ~100 kB: past INLINE_PREPARE_MAX_BYTES
    assert len(big.encode()) > te.INLINE_PREPARE_MAX_BYTES
    r = gather(rt, [raw(big)])[0]
    assert r.meta["lumen.tokens"] == str(te.DEFAULT_MAX_SEQ_LENGTH)
    np.testing.assert_allclose(r.outputs["embedding"], expected[long_idx], atol=FIXTURE_TOLERANCE)


def test_many_concurrent_mixed_length_callers_get_their_own_vectors(rt, prepared_home):
    rng = random.Random(3)
    vocab = "alpha beta gamma delta runtime queue token batch signature ünïcödé 東 data".split()
    distinct = [" ".join(rng.choice(vocab) for _ in range(n))
                for n in [rng.choice((1, 2, 3, 5, 8, 13, 30, 90)) for _ in range(48)]]
    tok = minilm.load_tokenizer(models.model_dir(models.MINILM, prepared_home) / minilm.TOKENIZER_FILE)
    sess = cpu_session(models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE)
    expected = np.concatenate([minilm.embed(sess, tok, [t]) for t in distinct])
    picks = [rng.randrange(len(distinct)) for _ in range(320)]
    reqs = [raw(distinct[k]) if i % 3 else tensor(tok.encode(distinct[k]).ids)
            for i, k in enumerate(picks)]
    before = dict(rt.tasks[TASK].runners[0].stats)
    res = gather(rt, reqs)
    for k, r in zip(picks, res, strict=True):
        np.testing.assert_allclose(r.outputs["embedding"], expected[k], atol=FIXTURE_TOLERANCE)
    assert max(int(r.meta["lumen.batch.size"]) for r in res) > 1
    stats = rt.tasks[TASK].runners[0].stats
    real = stats["real_tokens"] - before["real_tokens"]
    slots = stats["padded_tokens"] - before["padded_tokens"]
    # length-blind batches of 32 over these lengths pad most slots; sorted ones very few
    assert real == sum(len(tok.encode(distinct[k]).ids) for k in picks)
    assert (slots - real) / slots < 0.35
    assert 0.0 <= rt.tasks[TASK].padding_ratio < 1.0


# ------------------------------------------------------------------------------ rejections
@pytest.mark.parametrize("req, cls, field", [
    (raw(b"caf\xe9 au lait"), lc.InvalidArgument, "payload"),
    (raw(b"\xff\xfe\x00"), lc.InvalidArgument, "payload"),
    (raw("x", "image/png"), lc.UnsupportedMediaType, "payload_mime"),
    (raw("x", "application/json"), lc.UnsupportedMediaType, "payload_mime"),
    (raw("x", "text/plain; charset=klingon"), lc.UnsupportedMediaType, "payload_mime"),
    (raw("x", "text/plain; charset=base64"), lc.UnsupportedMediaType, "payload_mime"),
    (raw("x", "text/plain; charset=" + "u" * 200), lc.UnsupportedMediaType, "payload_mime"),
    (raw(b"+2AA-", "text/plain; charset=utf-7"), lc.InvalidArgument, "payload"),
    (raw("x", "text/plain; charset=utf\x008"), lc.UnsupportedMediaType, "payload_mime"),
    (tensor([101, 30522, 102]), lc.InvalidArgument, "payload"),
    (tensor([101, 7592, -1, 102]), lc.InvalidArgument, "payload"),
    (tensor(np.zeros((1, 0))), lc.InvalidArgument, "lumen.tensor.shape"),
    (tensor(np.full(257, 100)), lc.InvalidArgument, "lumen.tensor.shape"),
    (tensor([101, 102], dtype=np.float32), lc.InvalidArgument, "lumen.tensor.dtype"),
    (tensor([101, 102], dtype=np.int32), lc.InvalidArgument, "lumen.tensor.dtype"),
    (tensor([101, 102], pp="clip_image_openai_v1"), lc.InvalidArgument, "lumen.preprocess.id"),
    (tensor([101, 102], layout="NC"), lc.InvalidArgument, "lumen.tensor.layout"),
], ids=["bad-utf8", "bad-utf8-bom", "image-mime", "json-mime", "unknown-charset",
        "bytes-codec", "huge-charset", "lone-surrogate", "nul-charset", "oov-id", "negative-id", "L=0", "L=257",
        "fp32", "int32", "preprocess-id", "layout"])
def test_each_bad_request_gets_its_specific_error(rt, req, cls, field):
    with pytest.raises(cls) as info:
        gather(rt, [req])
    assert type(info.value) is cls and info.value.field == field, info.value


def test_out_of_vocab_error_names_the_first_bad_position(rt):
    with pytest.raises(lc.InvalidArgument, match="token id 99999 at position 2"):
        gather(rt, [tensor([101, 2023, 99999, -5, 102])])
    # the bad requests in a crowd fail alone; the others still get vectors
    res = gather(rt, [tensor([101, 2023, 102]), tensor([101, 40000, 102]), raw("fine")],
                 return_exceptions=True)
    assert isinstance(res[1], lc.InvalidArgument)
    assert res[0].outputs["embedding"].shape == (te.EMBEDDING_DIM,)
    assert res[2].outputs["embedding"].shape == (te.EMBEDDING_DIM,)


def test_writable_tensor_payload_is_copied_at_validation(rt):
    backend = rt.tasks[TASK].backend
    buf = bytearray(np.array([101, 7592, 102], dtype=np.int64).tobytes())
    req = lc.InferRequest(task=TASK, payload=buf, payload_mime="application/octet-stream",
                          meta=tensor([101, 7592, 102]).meta)
    desc = lc.native.descriptor.parse_meta(req.meta, len(buf), backend.contract)
    prepared = backend.prepare(req, desc, memoryview(buf))
    buf[8:16] = np.int64(10**9).tobytes()  # a caller scribbling after validation
    assert list(np.asarray(prepared.tensors[0])) == [101, 7592, 102]
    assert prepared.length == 3 and prepared.signature == backend.prepare(
        raw("hello"), lc.native.descriptor.parse_meta({}, 5, backend.contract),
        memoryview(b"hello"), ).signature


# ------------------------------------------------------------------------------ batching
def test_raw_and_tensor_requests_of_one_text_share_a_batch(rt):
    task = rt.tasks[TASK]
    text = "raw and tensor requests converge on one signature"
    ids = task.backend._token_ids(text, False)
    gate = threading.Event()
    engine = task.instances[0]
    real_run = engine.run

    def gated_run(feeds, n):  # the first batch holds the only worker until the pair queued
        gate.wait(WAIT_S)
        return real_run(feeds, n)

    engine.run = gated_run

    async def main():
        first = asyncio.ensure_future(rt.infer(raw("occupies the worker")))
        while task.batcher.in_flight == 0:
            await asyncio.sleep(0.001)
        pair = asyncio.ensure_future(asyncio.gather(rt.infer(raw(text)), rt.infer(tensor(ids))))
        while task.batcher.pending < 2:
            await asyncio.sleep(0.001)
        gate.set()
        await first
        return await pair

    try:
        a, b = on_loop(rt, main())
    finally:
        gate.set()
        engine.run = real_run
    assert a.meta["lumen.batch.size"] == b.meta["lumen.batch.size"] == "2"
    np.testing.assert_array_equal(a.outputs["embedding"], b.outputs["embedding"])


class _Item:
    __slots__ = ("signature", "length")

    def __init__(self, length):
        self.signature = "s"
        self.length = length


class _Worker:
    """A runner whose batches wait for ``gate``; ``started`` is set once the first is taken."""

    def __init__(self, gate):
        self.gate = gate
        self.started = threading.Event()
        self.batches: list = []

    def execute(self, items):
        self.started.set()
        self.gate.wait(WAIT_S)
        self.batches.append([it.length for it in items])
        return [it.length for it in items]


def test_length_aware_formation_groups_lengths_and_never_starves_the_oldest():
    lengths = [200, 9, 12, 190, 11, 60, 10, 64, 180, 8, 58, 13, 256, 62, 14, 9]
    gate = threading.Event()
    worker = _Worker(gate)
    batcher = DynamicBatcher("t", BatchingConfig(max_batch_size=8, max_queue_delay_us=0),
                             [worker], max_batch_tokens=1024)

    async def main():
        first = asyncio.ensure_future(batcher.infer(_Item(5)))  # dispatched at once, gated
        await asyncio.to_thread(worker.started.wait, WAIT_S)
        rest = [asyncio.ensure_future(batcher.infer(_Item(n))) for n in lengths]
        await asyncio.sleep(0)
        gate.set()
        await first
        return [r.value for r in await asyncio.gather(*rest)]

    assert asyncio.run(main()) == lengths  # each caller gets its own result
    batches = worker.batches[1:]
    assert sorted(n for b in batches for n in b) == sorted(lengths)
    assert 200 in batches[0]  # the oldest request is in the first batch formed
    for b in batches:
        assert len(b) <= 8 and len(b) * max(b) <= 1024
    slots = sum(len(b) * max(b) for b in batches)
    fifo = [lengths[i:i + 8] for i in range(0, len(lengths), 8)]
    fifo_slots = sum(len(b) * max(b) for b in fifo)
    # grouped: under 10% of the slots are padding; length-blind batches would pad about 70%
    assert (slots - sum(lengths)) / slots < 0.1 < 0.5 < (fifo_slots - sum(lengths)) / fifo_slots


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 256), min_size=1, max_size=64), st.data())
def test_length_window_properties(lengths, data):
    lengths = sorted(lengths)
    p = data.draw(st.integers(0, len(lengths) - 1))
    n = data.draw(st.integers(1, 32))
    budget = data.draw(st.integers(1, 8192))
    lo, hi = _length_window(lengths, p, n, budget)
    assert lo <= p < hi and hi - lo <= n
    assert hi - lo == 1 or (hi - lo) * lengths[hi - 1] <= budget


def test_fifo_is_unchanged_without_a_token_budget():
    gate = threading.Event()
    worker = _Worker(gate)
    batcher = DynamicBatcher("t", BatchingConfig(max_batch_size=4, max_queue_delay_us=0), [worker])

    async def main():
        first = asyncio.ensure_future(batcher.infer(_Item(1)))
        await asyncio.to_thread(worker.started.wait, WAIT_S)
        rest = [asyncio.ensure_future(batcher.infer(_Item(n))) for n in (200, 3, 150, 2, 9)]
        await asyncio.sleep(0)
        gate.set()
        await first
        await asyncio.gather(*rest)

    asyncio.run(main())
    assert worker.batches == [[1], [200, 3, 150, 2], [9]]


# ------------------------------------------------------------------------------ registration
def test_default_runtime_registers_text_embed_when_prepared(prepared_home, monkeypatch, tmp_path):
    monkeypatch.setenv("LUMEN_HOME", str(prepared_home))
    tables = {t["name"]: t for t in default_task_tables()}
    assert tables[TASK]["backend"] == te.BACKEND_NAME
    cfg = lc.Runtime.default().config
    assert TASK in [t.name for t in cfg.tasks]
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    with pytest.raises(lc.ModelMissingError, match="lumen models prepare"):
        te.default_task_table()
    assert TASK not in [t["name"] for t in default_task_tables()]


def test_configured_task_without_prepared_model_fails_naming_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    runtime = lc.Runtime.from_dict({"tasks": [{"name": TASK, "backend": te.BACKEND_NAME}]})
    with pytest.raises(ModelMissingError, match="lumen models prepare"):
        asyncio.run(runtime.start())


@pytest.mark.parametrize("options, key", [
    ({"max_seq_length": 1024}, "max_seq_length"),
    ({"max_batch_tokens": -1}, "max_batch_tokens"),
    ({"tokenizer": "/nonexistent/tokenizer.json"}, "tokenizer"),
    ({"pooling": "cls"}, "pooling"),
])
def test_option_errors_name_the_key(prepared_home, options, key):
    t = table(prepared_home)
    t["options"] = options
    with pytest.raises(ConfigError, match=rf"options\.{key}"):
        asyncio.run(lc.Runtime.from_dict({"tasks": [t]}).start())


def test_missing_model_file_is_a_config_error(tmp_path):
    t = {"name": TASK, "backend": te.BACKEND_NAME, "model": str(tmp_path / "nope.onnx")}
    with pytest.raises(ConfigError, match="lumen models prepare"):
        asyncio.run(lc.Runtime.from_dict({"tasks": [t]}).start())


def test_short_max_seq_length_truncates_both_routes(prepared_home):
    t = table(prepared_home)
    t["options"] = {"max_seq_length": 8}

    async def main():
        async with lc.Runtime.from_dict({"tasks": [t]}) as runtime:
            r = await runtime.infer(raw("one two three four five six seven eight nine ten"))
            with pytest.raises(lc.InvalidArgument) as info:
                await runtime.infer(tensor(np.full(9, 100)))
            return r, info.value

    r, err = asyncio.run(main())
    assert r.meta["lumen.tokens"] == "8" and err.field == "lumen.tensor.shape"


def test_truncation_is_reported_to_in_process_callers(rt):
    long = " ".join(["word"] * 600)  # far past max_seq_length tokens
    cut, whole = gather(rt, [raw(long), raw("a short text")])
    assert cut.meta.get("lumen.truncated") == "true" and cut.stats.tokens == te.DEFAULT_MAX_SEQ_LENGTH
    assert "lumen.truncated" not in whole.meta


# ------------------------------------------------------------------------- normalize=false
def pooled_req(text, **meta):
    return lc.InferRequest(task=TASK, payload=text.encode("utf-8"), payload_mime="text/plain",
                           meta={"normalize": "false", **meta})


def test_normalize_false_returns_the_mean_pooled_vector(rt, reference):
    texts, _, expected = reference
    keep = [i for i, t in enumerate(texts) if t]
    alone = [gather(rt, [pooled_req(texts[i])])[0].outputs["embedding"] for i in keep]
    # batched with the normalised requests for the same texts (one batch, mixed options)
    mixed = gather(rt, [pooled_req(texts[i]) for i in keep] + [raw(texts[i]) for i in keep])
    batched = np.stack([r.outputs["embedding"] for r in mixed[:len(keep)]])
    unit = np.stack([r.outputs["embedding"] for r in mixed[len(keep):]])
    alone = np.stack(alone)
    assert alone.dtype == np.float32 and alone.shape == (len(keep), te.EMBEDDING_DIM)
    norms = np.linalg.norm(alone, axis=1)
    assert (norms > 1.0).all()  # MiniLM's mean-pooled vectors are far from unit length
    np.testing.assert_allclose(batched, alone, atol=1e-5 * norms.max(), rtol=0)
    # its direction is sentence-transformers' embedding, and L2 reproduces normalize=true
    np.testing.assert_allclose(alone / norms[:, None], expected[keep], atol=FIXTURE_TOLERANCE, rtol=0)
    np.testing.assert_allclose(batched / np.linalg.norm(batched, axis=1, keepdims=True), unit,
                               atol=1e-5, rtol=0)
    # an in-process caller may send a bool
    via_bool = gather(rt, [lc.InferRequest(task=TASK, payload=texts[keep[0]].encode(),
                                           payload_mime="text/plain", meta={"normalize": False})])
    np.testing.assert_allclose(via_bool[0].outputs["embedding"], alone[0], atol=1e-5 * norms[0])


def test_normalize_false_with_dimensions_and_types(rt, reference):
    texts, ids, _ = reference
    full = gather(rt, [pooled_req(texts[1])])[0].outputs["embedding"]
    cut, bits, unit_bits, tens = gather(rt, [
        pooled_req(texts[1], **{"lumen.embedding.dimensions": "32"}),
        pooled_req(texts[1], **{"lumen.embedding.type": "ubinary"}),
        lc.InferRequest(task=TASK, payload=texts[1].encode(), payload_mime="text/plain",
                        meta={"lumen.embedding.type": "ubinary"}),
        lc.new_infer_request(TASK).for_tensor_array(np.asarray(ids[1], np.int64).reshape(1, -1),
                                                    layout="NL", preprocess_id=PP)
        .with_meta("normalize", "false").build()])
    # TEI's order: cut to D, and no second normalisation when normalize is false
    np.testing.assert_allclose(cut.outputs["embedding"], full[:32], atol=1e-5 * np.abs(full).max())
    assert np.linalg.norm(cut.outputs["embedding"]) > 1.0
    # sign bits do not depend on the scale
    np.testing.assert_array_equal(bits.outputs["embedding"], unit_bits.outputs["embedding"])
    np.testing.assert_allclose(tens.outputs["embedding"], full, atol=1e-5 * np.abs(full).max())
    for etype in ("int8", "uint8"):  # the fixed [-1, 1] range would clip it: refused
        with pytest.raises(lc.InvalidArgument) as info:
            gather(rt, [pooled_req(texts[1], **{"lumen.embedding.type": etype})])
        assert info.value.field == "normalize" and "clip" in info.value.message
    with pytest.raises(lc.InvalidArgument) as info:
        gather(rt, [pooled_req(texts[1], normalize="perhaps")])
    assert info.value.field == "normalize"


def test_a_model_without_a_pooled_output_refuses_normalize_false(prepared_home, tmp_path):
    import onnx_models

    t = {"name": TASK, "backend": te.BACKEND_NAME,
         "model": onnx_models.embedding_only(tmp_path / "embedding_only.onnx"),
         "options": {"tokenizer": str(models.model_dir(models.MINILM, prepared_home)
                                      / minilm.TOKENIZER_FILE)}}

    async def main():
        async with lc.Runtime.from_dict({"tasks": [t]}) as runtime:
            ok = await runtime.infer(raw("hello"))
            with pytest.raises(lc.InvalidArgument) as info:
                await runtime.infer(pooled_req("hello"))
            return ok, info.value, runtime.describe(TASK)

    ok, err, desc = asyncio.run(main())
    assert ok.outputs["embedding"].shape == (te.EMBEDDING_DIM,)
    assert err.field == "normalize" and "'pooled'" in err.message
    assert desc["embedding"]["normalize_false"] is False


def test_plain_text_fast_path_makes_the_backends_item(rt):
    """The request path prepares plain text in C (routes.TextPrep); it must make exactly the
    item the backend makes, and hand everything else back to the backend."""
    from lumen_core import native

    route = rt.tasks["text_embed"]
    backend = route.backend
    fast = backend.text_fast_path()
    texts = ["hello", "Héllo wörld, ünïcode!", "a " * 200, "🙂 emoji and CJK 汉字", "x"]
    for text in texts:
        for payload, mime in ((text, "text/plain; charset=utf-8"),
                              (memoryview(text.encode()), "text/plain")):
            req = lc.InferRequest("text_embed", payload, mime)
            desc = native.descriptor.parse_meta(req.meta, len(text.encode()), route.contract)
            got = fast.prepare(req, payload)
            want = backend.prepare(req, desc, payload)
            assert got is not None and got.signature == want.signature
            assert got.length == want.length
            np.testing.assert_array_equal(np.asarray(got.tensors[0]), np.asarray(want.tensors[0]))
    # not the common case: the backend's (options, other charsets, truncation, bad text)
    assert fast.prepare(lc.InferRequest("text_embed", "hi", "text/plain", {"normalize": "false"}),
                        "hi") is None
    assert fast.prepare(lc.InferRequest("text_embed", b"hi", "text/plain; charset=latin-1"),
                        memoryview(b"hi")) is None
    long = "word " * 400  # more tokens than max_seq_length: truncation is the backend's
    assert fast.prepare(lc.InferRequest("text_embed", long, "text/plain"), long) is None
    assert fast.prepare(lc.InferRequest("text_embed", b"\xff", "text/plain"),
                        memoryview(b"\xff")) is None
    assert fast.prepare(lc.InferRequest("text_embed", "", "text/plain"), "") is None

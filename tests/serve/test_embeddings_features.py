"""Embedding features over HTTP (issue 16 items 1, 2, 4, 6; issue 12 item 7): OpenAI
``dimensions``, compact ``embedding_type`` encodings, several embedding tasks in one server,
``/v1/tokenize``, ``truncate`` / ``normalize`` and ``lumen.truncated``; the real ``openai``
client where the OpenAI API has the feature, raw JSON for the extensions.

The server runs the default tasks plus ``text_embed_short`` (the same MiniLM cut at 16 tokens,
a second embedding task).  ``/v1/tokenize`` asks the runtime's ``tokenize`` query.
"""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import serve_support as S

from lumen_core.models import minilm, minilm_int8
from lumen_core.runtime import Runtime
from lumen_core.tasks import default_task_tables
from lumen_core.tasks.embedding_output import shape_embedding
from lumen_core.tasks.text_embedding import INT8_TASK_NAME

TOL = 1e-4
SHORT = "text_embed_short"
SHORT_LEN = 16
LONG_TEXT = " ".join(["hello"] * 40)  # 42 tokens with [CLS]/[SEP]



@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    with S.lumen_home_env(home):
        extra = {"name": SHORT, "backend": "text_embedding", "model_version": "1",
                 "options": {"max_seq_length": SHORT_LEN}}
        cfg = {"tasks": default_task_tables() + [extra]}
        server = S.ServerThread(Runtime.from_dict(cfg), grpc=False)
    yield server
    server.stop()


@pytest.fixture()
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="dummy", max_retries=0)


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    texts = json.loads((fixtures_dir / "minilm_reference.json").read_text())["texts"]
    return texts, np.load(fixtures_dir / "minilm_reference_embeddings.npy")


def err(resp: httpx.Response) -> dict:
    return resp.json()["error"]


def embed(http, **body) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": "text_embed", **body})


def cut(ref: np.ndarray, d: int) -> np.ndarray:
    v = ref[..., :d]
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


# -- 1. dimensions ----------------------------------------------------------------------------
def test_dimensions_with_the_openai_client(oai, reference):
    texts, ref = reference
    res = oai.embeddings.create(model="text_embed", input=texts[:3], dimensions=64)  # base64
    got = np.array([d.embedding for d in sorted(res.data, key=lambda d: d.index)], np.float32)
    assert got.shape == (3, 64)
    np.testing.assert_allclose(got, cut(ref[:3], 64), atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    res = oai.embeddings.create(model="text_embed", input=texts[0], dimensions=384,
                                encoding_format="float")
    np.testing.assert_allclose(res.data[0].embedding, ref[0], atol=TOL)
    for bad in (0, 385):
        with pytest.raises(openai.BadRequestError) as info:
            oai.embeddings.create(model="text_embed", input="x", dimensions=bad)
        assert "1..384" in str(info.value)


def test_dimensions_errors_name_the_range(http):
    for bad in (0, 385, -3, "8", True, 1.5):
        r = embed(http, input="x", dimensions=bad)
        assert r.status_code == 400, (bad, r.text)
        assert err(r)["field"] == "dimensions" and err(r)["code"] == "invalid_argument"
    assert "1..384" in err(embed(http, input="x", dimensions=385))["message"]


def test_native_route_dimensions(http, reference):
    texts, ref = reference
    r = http.post("/v1/infer/text_embed", content=texts[1].encode(),
                  params={"lumen.embedding.dimensions": "32"},
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]["embedding"]
    assert out["dtype"] == "fp32" and out["shape"] == [32]
    np.testing.assert_allclose(out["data"], cut(ref[1], 32), atol=TOL)
    for bad in ("0", "385", "abc"):
        r = http.post("/v1/infer/text_embed", content=b"x", params={"lumen.embedding.dimensions": bad},
                      headers={"Content-Type": "text/plain"})
        assert r.status_code == 400 and err(r)["field"] == "lumen.embedding.dimensions"
        assert "1..384" in err(r)["message"]
    # a typo in the namespace is still refused
    r = http.post("/v1/infer/text_embed", content=b"x", params={"lumen.embedding.dimension": "8"},
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 400


# -- 2. compact encodings -----------------------------------------------------------------------
def expected(ref: np.ndarray, etype: str, d: int = 0) -> np.ndarray:
    v = cut(ref, d) if d else ref
    if etype in ("int8", "uint8"):
        u = np.clip(np.floor((v + 1.0) * 127.5), 0, 255).astype(np.int64)
        return u - 128 if etype == "int8" else u
    bits = np.packbits(v > 0, axis=-1).astype(np.int64)
    return bits - 128 if etype == "binary" else bits


def test_shape_embedding_semantics():
    v = np.array([0.5, -0.5, 0.0, 1.0, -1.0, 0.1, -0.1, 0.2, 0.3], np.float32)
    v = v / np.linalg.norm(v)
    ub = shape_embedding(v, 0, "ubinary")
    assert ub.dtype == np.uint8 and ub.tolist() == [0b10010101, 0b10000000]  # MSB first, padded
    assert shape_embedding(v, 0, "binary").tolist() == [0b10010101 - 128, 0]
    assert shape_embedding(np.array([-1.0, 1.0, 0.0], np.float32), 0, "uint8").tolist() == [0, 255, 127]
    assert shape_embedding(np.array([-1.0, 1.0, 0.0], np.float32), 0, "int8").tolist() == [-128, 127, -1]
    assert shape_embedding(v, 4, "float").shape == (4,)


@pytest.mark.parametrize("etype", ["int8", "uint8", "binary", "ubinary"])
def test_embedding_type_json(http, reference, etype):
    texts, ref = reference
    r = embed(http, input=texts[:4], embedding_type=etype, encoding_format="float")
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]])
    want = expected(ref[:4], etype)
    assert got.shape == want.shape
    # a component within float noise of a bucket edge may land one level over
    assert np.abs(got - want).max() <= (1 if etype.endswith("int8") else 0) or etype.endswith("binary")
    if etype.endswith("binary"):  # a sign flip only for a component at ~0
        assert (got != want).mean() < 0.01
    # with dimensions: cut, renormalise, then quantise
    r = embed(http, input=texts[2], embedding_type=etype, dimensions=20, encoding_format="float")
    emb = r.json()["data"][0]["embedding"]
    assert len(emb) == (20 if etype.endswith("int8") else 3)


def test_embedding_type_refuses_base64_and_unknown(http, oai):
    r = embed(http, input="x", embedding_type="int8", encoding_format="base64")
    assert r.status_code == 400 and err(r)["field"] == "encoding_format"
    # the openai client asks for base64 unless told: the same refusal, not misread bytes
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model="text_embed", input="x", extra_body={"embedding_type": "binary"})
    ok = oai.embeddings.create(model="text_embed", input="x", encoding_format="float",
                               extra_body={"embedding_type": "ubinary"})
    assert len(ok.data[0].embedding) == 48
    r = embed(http, input="x", embedding_type="fp16")
    assert r.status_code == 400 and err(r)["field"] == "embedding_type"
    # float + base64 stays float32 little-endian
    r = embed(http, input="x", embedding_type="float", encoding_format="base64")
    assert len(base64.b64decode(r.json()["data"][0]["embedding"])) == 384 * 4


@pytest.mark.parametrize("fmt", ["", 0, False, [], "Float", {}])
def test_a_falsy_or_unknown_encoding_format_is_a_400(http, fmt):
    """Issue 38 row 9: only an absent or null encoding_format means float; "", 0, false, []
    used to be read as float silently."""
    r = embed(http, input="x", encoding_format=fmt)
    assert r.status_code == 400 and err(r)["field"] == "encoding_format", r.text
    assert "float, base64" in err(r)["message"]


def test_a_null_encoding_format_is_float(http):
    r = embed(http, input="x", encoding_format=None)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


@pytest.mark.parametrize("etype,dtype,n", [("int8", "int8", 384), ("uint8", "uint8", 384),
                                           ("binary", "int8", 48), ("ubinary", "uint8", 48),
                                           ("float", "fp32", 384)])
def test_native_route_returns_the_dtype_as_a_tensor(http, reference, etype, dtype, n):
    texts, ref = reference
    r = http.post("/v1/infer/text_embed", content=texts[0].encode(),
                  params={"lumen.embedding.type": etype},
                  headers={"Content-Type": "text/plain", "Accept": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert r.headers["lumen-tensor-dtype"] == dtype and r.headers["lumen-tensor-shape"] == f"[{n}]"
    np_dtype = {"int8": "i1", "uint8": "u1", "fp32": "<f4"}[dtype]
    got = np.frombuffer(r.content, np_dtype)
    if etype == "float":
        np.testing.assert_allclose(got, ref[0], atol=TOL)
    else:
        assert np.abs(got.astype(np.int64) - expected(ref[0], etype)).max() <= 1
    bad = http.post("/v1/infer/text_embed", content=b"x", params={"lumen.embedding.type": "int4"},
                    headers={"Content-Type": "text/plain"})
    assert bad.status_code == 400 and err(bad)["field"] == "lumen.embedding.type"


# -- 4. several embedding tasks -----------------------------------------------------------------
def test_models_lists_embedding_tasks_and_model_picks_the_task(oai, http, reference):
    texts, ref = reference
    models = {m.id: m for m in oai.models.list().data}
    assert {"text_embed", SHORT, "vad"} <= set(models)
    listed = http.get("/v1/models").json()["data"]
    caps = {m["id"]: m["capabilities"] for m in listed}
    assert caps["text_embed"] == ["embed"] and caps[SHORT] == ["embed"] and caps["vad"] == []
    assert {m["id"]: m.get("embedding_dim") for m in listed}[SHORT] == 384
    a = oai.embeddings.create(model="text_embed", input=LONG_TEXT, encoding_format="float")
    b = oai.embeddings.create(model=SHORT, input=LONG_TEXT, encoding_format="float")
    assert a.model == "text_embed" and b.model == SHORT
    assert a.usage.prompt_tokens == 42 and b.usage.prompt_tokens == SHORT_LEN
    assert not np.allclose(a.data[0].embedding, b.data[0].embedding, atol=1e-3)
    short = oai.embeddings.create(model=SHORT, input=texts[0], encoding_format="float")
    np.testing.assert_allclose(short.data[0].embedding, ref[0], atol=TOL)  # fits in 16 tokens


def test_models_and_tasks_show_each_prepared_models_card(http):
    """/v1/models and /v1/tasks say what each prepared embedding model is and what it
    measured, so a client can choose between text_embed and text_embed_int8."""
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    tasks = http.get("/v1/tasks").json()["tasks"]
    assert listed["text_embed"]["model_card"] == minilm.CARD == tasks["text_embed"]["model_card"]
    int8 = listed[INT8_TASK_NAME]
    assert int8["description"] == minilm_int8.CARD["summary"] and "int8" in int8["description"]
    assert int8["model_card"] == minilm_int8.CARD == tasks[INT8_TASK_NAME]["model_card"]
    measured = int8["model_card"]["accuracy_vs_fp32"]
    assert 0.99 <= measured["min_cosine"] <= measured["p1_cosine"] <= measured["mean_cosine"]
    assert int8["model_card"]["speed_vs_fp32"]["texts_per_cpu_second_ratio"] > 1
    assert "description" not in listed["vad"]


def test_a_task_that_does_not_embed_is_a_400_naming_those_that_do(oai, http):
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model="vad", input="hello")
    assert "text_embed" in str(info.value) and SHORT in str(info.value)
    r = embed(http, model="vad", input=["a", "b"])
    assert r.status_code == 400 and err(r)["field"] == "model"
    assert err(r)["message"].endswith(f"text_embed, text_embed_int8, {SHORT}")
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="nope", input="x")


# -- 6. tokenize, truncate, normalize -----------------------------------------------------------
def test_tokenize(http):
    r = http.post("/v1/tokenize", json={"model": "text_embed", "inputs": ["Hello world!", "é"]})
    assert r.status_code == 200, r.text
    first, second = r.json()
    assert [t["id"] for t in first] == [101, 7592, 2088, 999, 102]
    assert [t["text"] for t in first] == ["[CLS]", "hello", "world", "!", "[SEP]"]
    assert [(t["start"], t["stop"]) for t in first] == [(0, 0), (0, 5), (6, 11), (11, 12), (0, 0)]
    assert [t["special"] for t in first] == [True, False, False, False, True]
    assert [(t["start"], t["stop"]) for t in second if not t["special"]] == [(0, 1)]  # characters
    # the task's truncation, unless truncate is false
    cut_ = http.post("/v1/tokenize", json={"model": SHORT, "inputs": LONG_TEXT}).json()[0]
    assert len(cut_) == SHORT_LEN and cut_[-1]["text"] == "[SEP]"
    full = http.post("/v1/tokenize", json={"model": SHORT, "inputs": LONG_TEXT,
                                           "truncate": False}).json()[0]
    assert len(full) == 42
    assert len(http.post("/v1/tokenize", json={"model": "text_embed",
                                               "inputs": LONG_TEXT}).json()[0]) == 42


def test_tokenize_errors(http):
    several = http.post("/v1/tokenize", json={"inputs": "x"})  # two tasks tokenize here
    assert several.status_code == 400 and SHORT in err(several)["message"]
    assert http.post("/v1/tokenize", json={"model": "vad", "inputs": "x"}).status_code == 400
    assert http.post("/v1/tokenize", json={"model": "nope", "inputs": "x"}).status_code == 404
    assert http.post("/v1/tokenize", json={"model": "text_embed", "inputs": 3}).status_code == 400
    r = http.post("/v1/tokenize", json={"model": "text_embed", "inputs": "x", "truncate": "no"})
    assert r.status_code == 400 and err(r)["field"] == "truncate"
    r = http.post("/v1/tokenize", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415


def test_truncate_false_and_truncated_meta(http):
    r = http.post(f"/v1/infer/{SHORT}", content=LONG_TEXT.encode(),
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 200 and r.json()["meta"]["lumen.truncated"] == "true"
    r = http.post("/v1/infer/text_embed", content=LONG_TEXT.encode(),
                  headers={"Content-Type": "text/plain"})
    assert "lumen.truncated" not in r.json()["meta"]
    r = http.post(f"/v1/infer/{SHORT}", content=LONG_TEXT.encode(), params={"truncate": "false"},
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 413 and err(r)["code"] == "payload_too_large"
    assert "42 tokens" in err(r)["message"] and str(SHORT_LEN) in err(r)["message"]
    ok = http.post(f"/v1/infer/{SHORT}", content=b"short", params={"truncate": "false"},
                   headers={"Content-Type": "text/plain"})
    assert ok.status_code == 200
    bad = http.post(f"/v1/infer/{SHORT}", content=b"x", params={"truncate": "maybe"},
                    headers={"Content-Type": "text/plain"})
    assert bad.status_code == 400 and err(bad)["field"] == "truncate"
    # /v1/embeddings: the same option in the body
    r = http.post("/v1/embeddings", json={"model": SHORT, "input": ["a", LONG_TEXT], "truncate": False})
    assert r.status_code == 413 and "42 tokens" in err(r)["message"]
    assert embed(http, input="x", truncate="yes").status_code == 400


def native(http, text: str, task: str = "text_embed", **params) -> httpx.Response:
    return http.post(f"/v1/infer/{task}", content=text.encode(), params=params,
                     headers={"Content-Type": "text/plain"})


@pytest.mark.parametrize("task", ["text_embed", "text_embed_int8"])
def test_normalize_false_native_and_openai_routes(http, reference, task):
    texts, ref = reference
    keep = [i for i, t in enumerate(texts) if t]
    # native route, raw JSON reply: one text alone
    r = native(http, texts[1], task, normalize="false")
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]["embedding"]
    assert out["dtype"] == "fp32" and out["shape"] == [384]
    alone = np.array(out["data"], np.float32)
    unit = np.array(native(http, texts[1], task).json()["outputs"]["embedding"]["data"])
    norm = float(np.linalg.norm(alone))
    assert norm > 1.0
    np.testing.assert_allclose(alone / norm, unit, atol=1e-5)
    # /v1/embeddings extension field: every reference text in one call (batched together)
    r = http.post("/v1/embeddings", json={"model": task, "input": [texts[i] for i in keep],
                                          "normalize": False, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
    norms = np.linalg.norm(got, axis=1)
    np.testing.assert_allclose(got[keep.index(1)], alone, atol=1e-5 * norm)  # batch-independent
    cos = ((got / norms[:, None]) * ref[keep]).sum(axis=1)
    assert cos.min() >= (0.9999 if task == "text_embed" else 0.99), cos.min()
    # base64 (the openai client's default) carries the same float32 vector
    b64 = http.post("/v1/embeddings", json={"model": task, "input": texts[1], "normalize": False,
                                            "encoding_format": "base64"}).json()
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"),
                               alone, atol=1e-5 * norm)
    # dimensions: cut, not normalised again (TEI); normalize=true still cuts and normalises
    r = embed(http, input=texts[1], dimensions=16, normalize=False, encoding_format="float")
    np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                               native(http, texts[1], normalize="false").json()
                               ["outputs"]["embedding"]["data"][:16], atol=1e-5 * norm)
    r = embed(http, input=texts[1], dimensions=16, normalize=True, encoding_format="float")
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], cut(ref[1], 16), atol=TOL)


def test_normalize_errors(http):
    r = native(http, "x", normalize="maybe")
    assert r.status_code == 400 and err(r)["field"] == "normalize"
    assert embed(http, input="x", normalize="no").status_code == 400
    assert err(embed(http, input="x", normalize="no"))["field"] == "normalize"
    r = embed(http, input="x", normalize=False, embedding_type="int8", encoding_format="float")
    assert r.status_code == 400 and err(r)["field"] == "normalize" and "clip" in err(r)["message"]
    r = native(http, "x", normalize="false", **{"lumen.embedding.type": "uint8"})
    assert r.status_code == 400 and err(r)["field"] == "normalize"
    r = embed(http, input="x", normalize=False, embedding_type="binary", encoding_format="float")
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 48


def test_token_ids_route_takes_the_options(http, reference):
    _, ref = reference
    r = embed(http, input=[101, 7592, 2088, 102], dimensions=16, encoding_format="float")
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], cut(ref[2], 16), atol=TOL)


def test_token_ids_longer_than_the_model_are_cut_or_413_as_text(http):
    """Issue 38 row 8: token ids over max_seq_length answered 400 naming lumen.tensor.shape
    (a field the request does not have), truncate or not.  Now they are treated as the text
    is (TEI): cut keeping the final [SEP] when truncate is true (the default), else a 413
    naming the count and the limit."""
    ids = [101] + [7592] * 40 + [102]  # LONG_TEXT's 42 ids
    as_text = embed(http, model=SHORT, input=LONG_TEXT, encoding_format="float")
    cut_ids = embed(http, model=SHORT, input=ids, encoding_format="float")
    assert cut_ids.status_code == 200, cut_ids.text
    np.testing.assert_allclose(cut_ids.json()["data"][0]["embedding"],
                               as_text.json()["data"][0]["embedding"], atol=1e-5)
    assert cut_ids.json()["usage"]["prompt_tokens"] == SHORT_LEN
    first = embed(http, model=SHORT, input=ids[:SHORT_LEN - 1] + [102], encoding_format="float")
    np.testing.assert_allclose(cut_ids.json()["data"][0]["embedding"],
                               first.json()["data"][0]["embedding"], atol=1e-5)
    # ids without a final [SEP]: the first max_seq_length of them
    plain = embed(http, model=SHORT, input=[7592] * 40, encoding_format="float")
    head = embed(http, model=SHORT, input=[7592] * SHORT_LEN, encoding_format="float")
    np.testing.assert_allclose(plain.json()["data"][0]["embedding"],
                               head.json()["data"][0]["embedding"], atol=1e-5)
    r = embed(http, model=SHORT, input=ids, truncate=False)
    assert r.status_code == 413 and err(r)["field"] == "input", r.text
    assert "42 tokens" in err(r)["message"] and str(SHORT_LEN) in err(r)["message"]
    r = embed(http, model=SHORT, input=[[101, 102], ids], truncate=False)
    assert r.status_code == 413 and err(r)["field"] == "input[1]", r.text
    # the figure: 300 ids to the default task
    r = embed(http, input=[101] + [7592] * 298 + [102], encoding_format="float")
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384, r.text


# -- issue 26 row 8: a native option the task does not read is a 400, not ignored ---------------
def test_unknown_native_options_are_a_400_naming_the_known_ones(http, srv):
    r = native(http, "hello", normalise="false")  # a typo: it used to return the unit vector
    assert r.status_code == 400 and err(r)["field"] == "normalise"
    msg = err(r)["message"]
    assert "did you mean 'normalize'?" in msg
    for name in ("normalize", "truncate", "lumen.embedding.dimensions", "lumen.embedding.type"):
        assert name in msg, msg
    r = native(http, "hello", dimensions="8")  # OpenAI's body name is not the native one
    assert r.status_code == 400 and "did you mean 'lumen.embedding.dimensions'?" in err(r)["message"]
    r = native(http, "hello", **{"lumen.embedding.dimensions": "8"})
    assert r.status_code == 200 and len(r.json()["outputs"]["embedding"]["data"]) == 8
    # each task names its own: vad reads the lumen.vad.* keys, and no plain one
    chunk = np.zeros(512, np.int16).tobytes()
    r = http.post("/v1/infer/vad", content=chunk, params={"threshold": "0.3"},
                  headers={"Content-Type": "audio/L16;rate=16000"})
    assert r.status_code == 400 and "did you mean 'lumen.vad.threshold'?" in err(r)["message"]
    # the names are published with each task
    tasks = http.get("/v1/tasks").json()["tasks"]
    assert set(tasks["text_embed"]["request_options"]) == {
        "normalize", "truncate", "lumen.embedding.dimensions", "lumen.embedding.type",
        "prompt_name"}
    assert "lumen.vad.threshold" in tasks["vad"]["request_options"]
    # an unknown task still answers 404 (the options of no task are not checked)
    r = http.post("/v1/infer/nope?normalise=false", content=b"x",
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 404


def test_embeddings_on_the_servers_own_connections_single_list_and_refusals(srv, reference):
    """``/v1/embeddings`` is served from the HTTP parser's callbacks (serve/door_protocol.py):
    a single input (admitted from the callback) and a list (one group) pipelined on one
    connection answer in order with the reference vectors; a body that is not JSON is refused
    415 before it is sent; a bad item is a 400 naming ``input``."""
    texts, want = reference

    def post(obj: dict, extra: bytes = b"") -> bytes:
        body = json.dumps(obj).encode()
        return (b"POST /embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n%s\r\n%s" % (len(body), extra, body))

    s = S.raw_connect(srv)
    s.sendall(post({"model": "text_embed", "input": texts[0]})
              + post({"model": "text_embed", "input": texts[1:3]})
              + post({"model": "text_embed", "input": ["fine", {"not": "text"}]},
                     b"Connection: close\r\n"))
    raw = S.read_until_closed(s)
    s.close()
    replies = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        n = int(dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
                [b"content-length"])
        replies.append((int(head.split()[1]), json.loads(rest[:n])))
        raw = rest[n:]
    assert [r[0] for r in replies] == [200, 200, 400]
    got = [d["embedding"] for r in replies[:2] for d in r[1]["data"]]
    np.testing.assert_allclose(np.array(got), want[:3], atol=TOL)
    assert replies[2][1]["error"]["field"] == "input"

    s = S.raw_connect(srv)
    s.settimeout(10)
    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
              b"Content-Length: 1000\r\n\r\n")  # the headers alone
    head = s.recv(65536)
    s.close()
    assert head.startswith(b"HTTP/1.1 415"), head[:100]

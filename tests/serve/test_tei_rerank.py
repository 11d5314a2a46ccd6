"""TEI's own routes (/embed, /, /info), the rerank routes (TEI's /rerank, Cohere's
/v1/rerank), prompts over HTTP and /v1/models with several text tasks at once (issue 36,
items 4-6), through real clients: huggingface_hub's InferenceClient and openai's.  The text
models are the committed sentence-transformers folders (``tests/fixtures/st_models/``) imported
into one store by the real importer and served at once by ``model_id``; served vectors and
scores are checked against the committed sentence-transformers references."""
from __future__ import annotations

import os
import shutil

import httpx
import numpy as np
import openai
import pytest
import serve_support as S
import st_fixtures as F

from lumen_core import models
from lumen_core.errors import ConfigError
from lumen_core.runtime import Runtime
from lumen_core.serve.rerank import MAX_RERANK_DOCUMENTS, sigmoid

RR_LEN = F.reference("bert-cross")["max_length"]
QUERY = "how to cook rice"
DOCS = ["boil the rice in salted water", "the stock market fell", "rice",
        "cooking rice: rinse, boil, steam and rest the rice before serving"]
#: imported name -> committed folder
IMPORTS = {"e5ish": "xlmr-lasttoken", "mpnet": "mpnet-mean-prompt", "rr": "bert-cross",
           "rr-roberta": "roberta-cross"}


@pytest.fixture(scope="module")
def dirs(prepared_home, tmp_path_factory):
    """``lumen models import`` of four folders (two embedders with prompts, two
    cross-encoders) into one store."""
    home = tmp_path_factory.mktemp("tei")
    out = {name: F.imported(home, folder, name) for name, folder in IMPORTS.items()}
    return {**out, "home": home,
            "mini": models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE}


def tables(dirs) -> list:
    return [{"name": "text_embed", "backend": "text_embedding", "model": str(dirs["mini"])},
            {"name": "e5ish", "backend": "text_embedding", "model_id": "e5ish"},
            {"name": "rr", "backend": "rerank", "model_id": "rr"},
            {"name": "mpnet", "backend": "text_embedding", "model_id": "mpnet"},
            {"name": "rr-roberta", "backend": "rerank", "model_id": "rr-roberta"}]


def server(dirs, tasks, **cfg) -> S.ServerThread:
    """A started server on ``dirs``' store (the imported models found by ``model_id``)."""
    with S.lumen_home_env(dirs["home"]):
        return S.ServerThread(Runtime.from_dict({"server": cfg, "tasks": tasks}), grpc=False)


@pytest.fixture(scope="module")
def srv(dirs):
    server_ = server(dirs, tables(dirs))
    yield server_
    server_.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def vec(http, route, body):
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    return np.asarray(r.json(), np.float32)


# ------------------------------------------------------------------------------ TEI embed
def test_inference_client_embed_and_openai_give_the_same_vectors(srv, http):
    from huggingface_hub import InferenceClient

    texts = ["Hello world", "Ünïcode and 東京"]
    client = InferenceClient(base_url=srv.url)
    hf = np.stack([np.asarray(client.feature_extraction(t), np.float32).reshape(-1)
                   for t in texts])
    embed = vec(http, "/embed", {"inputs": texts})
    root = vec(http, "/", {"inputs": texts})
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="dummy", max_retries=0)
    o = np.stack([np.asarray(d.embedding, np.float32) for d in
                  oai.embeddings.create(model="text_embed", input=texts).data])
    assert embed.shape == (2, 384)
    np.testing.assert_array_equal(embed, root)
    np.testing.assert_allclose(hf, embed, atol=1e-6)
    np.testing.assert_allclose(o, embed, atol=1e-6)
    # one string in, one vector (TEI's shape: a list of one)
    assert vec(http, "/embed", {"inputs": "Hello world"}).shape == (1, 384)
    # the client's options travel: normalize=false, dimensions
    pooled = np.asarray(client.feature_extraction("Hello world", normalize=False), np.float32)
    assert np.linalg.norm(pooled) > 1.5
    cut = np.asarray(client.feature_extraction("Hello world", dimensions=16), np.float32)
    assert cut.reshape(-1).shape == (16,)


def test_embed_errors_name_the_field(http):
    for body, field in (({"inputs": 3}, "inputs"), ({"inputs": []}, "inputs"),
                        ({"inputs": "x", "truncation_direction": "left"}, "truncation_direction"),
                        ({"inputs": "x", "normalize": "no"}, "normalize"),
                        ({"inputs": "x", "prompt_name": "query"}, "prompt_name"),
                        ({"inputs": ["a", ""]}, "inputs[1]"),
                        ({"inputs": ["a"] * 3000}, "inputs")):
        r = http.post("/embed", json=body)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)


def test_info_answers_as_tei(http):
    info = http.get("/info").json()
    assert info["model_id"] == "all-minilm-l6-v2" and info["task"] == "text_embed"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 2048
    assert info["model_dtype"] == "float32" and "version" in info


def test_the_tei_task_is_configurable_and_checked(dirs):
    ts = tables(dirs)
    srv = server(dirs, ts, tei_task="e5ish")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/info").json()["model_id"] == "e5ish"
            a = vec(c, "/embed", {"inputs": "rice", "prompt_name": "query"})
            b = vec(c, "/embed", {"inputs": "query: rice"})
            np.testing.assert_allclose(a, b, atol=1e-6)
    finally:
        srv.stop()
    with pytest.raises(ConfigError, match="server.tei_task"), S.lumen_home_env(dirs["home"]):
        Runtime.from_dict({"server": {"tei_task": "nope"}, "tasks": ts})
    # only a rerank task: /embed is a 404 naming the tasks, /info describes the reranker
    srv = server(dirs, ts[2:3])
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/embed", json={"inputs": "x"})
            assert r.status_code == 404 and "rr" in r.json()["error"]["message"]
            assert "reranker" in c.get("/info").json()["model_type"]
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ prompts
def test_prompt_name_on_every_route(http):
    oai = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="d",
                        max_retries=0)
    # e5ish has no default prompt: "query: rice" is the prompted text as sent
    want = np.asarray(oai.embeddings.create(model="e5ish", input="query: rice",
                                            encoding_format="float").data[0].embedding)
    r = http.post("/v1/embeddings", json={"model": "e5ish", "input": "rice",
                                          "prompt_name": "query"})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], want, atol=1e-6)
    r = http.post("/v1/infer/e5ish", content="rice", params={"prompt_name": "query"},
                  headers={"Content-Type": "text/plain"})
    np.testing.assert_allclose(r.json()["outputs"]["embedding"]["data"], want, atol=1e-6)
    r = http.post("/v1/embeddings", json={"model": "e5ish", "input": "rice",
                                          "prompt_name": "search"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["field"] == "prompt_name"
    assert "'query'" in err["message"] and "'passage'" in err["message"]
    r = http.post("/v1/infer/e5ish", content="rice", params={"prompt_name": "search"},
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "prompt_name"


# ------------------------------------------------------------------------------ /v1/models
def test_models_lists_each_text_task_with_dimension_prompts_and_capabilities(http):
    data = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert data["text_embed"]["capabilities"] == ["embed"]
    assert data["text_embed"]["embedding_dim"] == 384 and data["text_embed"]["prompts"] == {}
    prompts = {"document": "", "passage": "passage: ", "query": "query: "}
    for name in ("e5ish", "mpnet"):
        dim = F.reference_vectors(IMPORTS[name]).shape[1]
        assert data[name]["capabilities"] == ["embed"] and data[name]["model_id"] == name
        assert data[name]["embedding_dim"] == dim and data[name]["prompts"] == prompts
        assert data[name]["max_seq_length"] == F.reference(IMPORTS[name])["max_seq_length"]
    assert data["e5ish"]["default_prompt_name"] is None
    assert data["mpnet"]["default_prompt_name"] == "query"
    for name in ("rr", "rr-roberta"):
        assert data[name]["capabilities"] == ["rerank"] and data[name]["model_id"] == name
        assert data[name]["max_seq_length"] == F.reference(IMPORTS[name])["max_length"]
    tasks = http.get("/v1/tasks").json()["tasks"]
    assert tasks["e5ish"]["prompts"]["query"] == "query: "


# ------------------------------------------------------------------------------ rerank
@pytest.mark.parametrize("name", ["e5ish", "mpnet"])
def test_openai_vectors_equal_sentence_transformers(http, name):
    """/v1/embeddings of an imported model = the committed ``encode`` vectors (cosine >=
    0.9999), and with ``prompt_name`` = ``encode(prompt_name=...)``'s (empty text left out:
    a 400 here)."""
    folder = IMPORTS[name]
    ref = F.reference(folder)
    keep = [i for i, t in enumerate(ref["texts"]) if t]
    texts = [ref["texts"][i] for i in keep]
    for prompt, extra in ((False, {}), (True, {"prompt_name": ref["prompt_name"]})):
        # (mpnet's default prompt applies without prompt_name, as encode() applied it)
        want = F.reference_vectors(folder, prompt)[keep]
        r = http.post("/v1/embeddings", json={"model": name, "input": texts, **extra})
        assert r.status_code == 200, r.text
        got = np.asarray([d["embedding"] for d in r.json()["data"]], np.float32)
        assert F.cosines(got, want).min() >= F.MIN_COSINE, (name, prompt)


@pytest.mark.parametrize("name", ["rr", "rr-roberta"])
def test_rerank_scores_equal_crossencoder_predict(http, name):
    """The committed ``CrossEncoder.predict`` scores over both routes: raw within 1e-3,
    sigmoid within 1e-4, sorted, ``top_n`` honoured (each query's documents in one call)."""
    ref = F.reference(IMPORTS[name])
    by_query: dict = {}
    for (q, d), raw, sig in zip(ref["pairs"], ref["raw"], ref["sigmoid"], strict=True):
        by_query.setdefault(q, []).append((d, raw, sig))
    for q, rows in by_query.items():
        docs, raw, sig = [r[0] for r in rows], np.array([r[1] for r in rows]), [r[2] for r in rows]
        order = list(np.argsort(-raw, kind="stable"))
        body = {"query": q, "texts": docs, "raw_scores": True}
        tei = http.post("/rerank", json=body) if name == "rr" else None
        if tei is not None:
            assert tei.status_code == 200, tei.text
            assert [e["index"] for e in tei.json()] == order
            for e in tei.json():
                assert abs(e["score"] - raw[e["index"]]) <= F.RAW_ATOL
        for top_n in (1, len(docs)):
            r = http.post("/v1/rerank", json={"model": name, "query": q, "documents": docs,
                                              "top_n": top_n})
            assert r.status_code == 200, r.text
            res = r.json()["results"]
            assert [e["index"] for e in res] == order[:top_n]
            for e in res:
                assert abs(e["relevance_score"] - sig[e["index"]]) <= F.SIGMOID_ATOL


def test_tei_rerank_sorts_sigmoid_scores(http, dirs):
    want = F.crossencoder_raw(dirs["rr"], QUERY, DOCS, RR_LEN)
    r = http.post("/rerank", json={"query": QUERY, "texts": DOCS})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [e["index"] for e in out] == list(np.argsort(-want, kind="stable"))
    for e in out:
        assert abs(e["score"] - sigmoid(float(want[e["index"]]))) < 1e-5 and "text" not in e
    raw = http.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True,
                                     "return_text": True}).json()
    for e in raw:
        assert abs(e["score"] - float(want[e["index"]])) < 1e-5
        assert e["text"] == DOCS[e["index"]]


def test_cohere_rerank_honours_top_n_and_return_documents(http, dirs):
    want = F.crossencoder_raw(dirs["rr"], QUERY, DOCS, RR_LEN)
    body = {"model": "rr", "query": QUERY, "top_n": 2, "return_documents": True,
            "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2], DOCS[3]]}
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["model"] == "rr" and len(res["results"]) == 2 and res["usage"]["total_tokens"] > 0
    best = list(np.argsort(-want, kind="stable")[:2])
    assert [e["index"] for e in res["results"]] == best
    for e in res["results"]:
        assert abs(e["relevance_score"] - sigmoid(float(want[e["index"]]))) < 1e-5
        assert e["document"] == {"text": DOCS[e["index"]]}
    # no model: the server's rerank task; all documents without top_n
    res = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert len(res["results"]) == len(DOCS) and "document" not in res["results"][0]


def test_rerank_errors(http):
    cases = (
        ("/v1/rerank", {"model": "text_embed", "query": "q", "documents": ["a"]}, 400, "model"),
        ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["a"]}, 404, "model"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": [3]}, 400, "documents[0]"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, 400, "query"),
        ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, 400, "documents[1]"),
        ("/rerank", {"query": "q", "texts": ["a"] * (MAX_RERANK_DOCUMENTS + 1)}, 400, "texts"),
        ("/rerank", {"query": "q", "texts": []}, 400, "texts"),
        ("/rerank", {"query": "q", "texts": ["word " * (RR_LEN + 1)], "truncate": False}, 413,
         "texts[0]"),
    )
    for route, body, status, field in cases:
        r = http.post(route, json=body)
        assert r.status_code == status and r.json()["error"]["field"] == field, (body, r.text)


def test_a_prepared_folder_can_be_moved_and_served_by_name(dirs, tmp_path, monkeypatch):
    """``model_id`` of an imported model in the store serves it (the folder's name)."""
    home = tmp_path / "home"
    shutil.copytree(dirs["rr"], models.models_dir(home) / "my-reranker", copy_function=os.link)
    monkeypatch.setenv("LUMEN_HOME", str(home))
    rt = Runtime.from_dict({"tasks": [{"name": "r", "backend": "rerank",
                                       "model_id": "my-reranker"}]})
    srv = S.ServerThread(rt, grpc=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/rerank", json={"query": QUERY, "texts": DOCS[:2]})
            assert r.status_code == 200 and len(r.json()) == 2
    finally:
        srv.stop()

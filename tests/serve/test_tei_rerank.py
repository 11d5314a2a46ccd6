"""TEI's own routes (/embed, /, /info), the rerank routes (TEI's /rerank, Cohere's
/v1/rerank), prompts over HTTP and /v1/models with several text tasks at once (issue 36,
items 4-6), through real clients: huggingface_hub's InferenceClient and openai's."""
from __future__ import annotations

import os
import shutil

import httpx
import numpy as np
import openai
import pytest
import serve_support as S
import text_models as TM

from lumen_core import models
from lumen_core.errors import ConfigError
from lumen_core.runtime import Runtime
from lumen_core.serve.rerank import MAX_RERANK_DOCUMENTS, sigmoid

RR_LEN = 32
QUERY = "how to cook rice"
DOCS = ["boil the rice in salted water", "the stock market fell", "rice",
        "cooking rice: rinse, boil, steam and rest the rice before serving"]


@pytest.fixture(scope="module")
def dirs(prepared_home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tei")
    TM.minilm_as(tmp, "e5ish", prepared_home)
    tok = models.model_dir(models.MINILM, prepared_home) / "tokenizer.json"
    return {"e5ish": models.models_dir(tmp) / "e5ish",
            "rr": TM.tiny_reranker(tmp / "tiny-rr", tok, RR_LEN), "tok": tok,
            "mini": models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE}


def tables(dirs) -> list:
    return [{"name": "text_embed", "backend": "text_embedding", "model": str(dirs["mini"])},
            {"name": "e5ish", "backend": "text_embedding", "model": str(dirs["e5ish"])},
            {"name": "rr", "backend": "rerank", "model": str(dirs["rr"])}]


@pytest.fixture(scope="module")
def srv(dirs):
    server = S.ServerThread(Runtime.from_dict({"server": {}, "tasks": tables(dirs)}), grpc=False)
    yield server
    server.stop()


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
    srv = S.ServerThread(Runtime.from_dict({"server": {"tei_task": "e5ish"}, "tasks": ts}),
                         grpc=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/info").json()["model_id"] == "e5ish"
            a = vec(c, "/embed", {"inputs": "rice", "prompt_name": "query"})
            b = vec(c, "/embed", {"inputs": "query: rice"})
            np.testing.assert_allclose(a, b, atol=1e-6)
    finally:
        srv.stop()
    with pytest.raises(ConfigError, match="server.tei_task"):
        Runtime.from_dict({"server": {"tei_task": "nope"}, "tasks": ts})
    # only a rerank task: /embed is a 404 naming the tasks, /info describes the reranker
    srv = S.ServerThread(Runtime.from_dict({"server": {}, "tasks": ts[2:]}), grpc=False)
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
    want = np.asarray(oai.embeddings.create(model="text_embed", input="query: rice",
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
    assert data["e5ish"]["prompts"] == {"query": "query: ", "passage": "passage: "}
    assert data["e5ish"]["model_id"] == "e5ish" and data["e5ish"]["embedding_dim"] == 384
    assert data["rr"]["capabilities"] == ["rerank"] and data["rr"]["max_seq_length"] == RR_LEN
    tasks = http.get("/v1/tasks").json()["tasks"]
    assert tasks["e5ish"]["prompts"]["query"] == "query: "


# ------------------------------------------------------------------------------ rerank
def test_tei_rerank_sorts_sigmoid_scores(http, dirs):
    want = TM.rerank_reference(dirs["tok"], QUERY, DOCS, RR_LEN)
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
    want = TM.rerank_reference(dirs["tok"], QUERY, DOCS, RR_LEN)
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
        ("/rerank", {"query": "q", "texts": ["word " * 100], "truncate": False}, 413,
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

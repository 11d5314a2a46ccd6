"""The response cache through HTTP: the real ``openai`` client on a cached embedding task
(hits, option separation), ``lumen.cache`` in native response meta, Prometheus counters, and
a stateful task refusing a cache."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
import serve_support as S

from lumen_core.errors import ConfigError
from lumen_core.runtime import Runtime
from lumen_core.tasks import default_task_tables

CACHED = "embed_cached"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    with S.lumen_home_env(home):
        tables = [t for t in default_task_tables() if t["name"] == "text_embed"]
        cached = {**tables[0], "name": CACHED, "cache": {"max_bytes": 1 << 20, "ttl_s": 600}}
        server = S.ServerThread(Runtime.from_dict({"tasks": tables + [cached]}), grpc=False)
    yield server
    server.stop()


def test_openai_client_hits_and_options(srv):
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="dummy", max_retries=0)
    texts = ["a cached sentence", "another one", "a cached sentence"]
    first = oai.embeddings.create(model=CACHED, input=texts)
    second = oai.embeddings.create(model=CACHED, input=texts)
    plain = oai.embeddings.create(model="text_embed", input=texts)
    for a, b, c in zip(first.data, second.data, plain.data, strict=True):
        assert a.embedding == b.embedding
        np.testing.assert_allclose(a.embedding, c.embedding, atol=1e-5)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 0
    st = srv.runtime.cache_stats()[CACHED]
    assert st["misses"] == 2 and st["hits"] + st["coalesced"] == 4
    # another dimensions value is another entry, never the full vector
    short = oai.embeddings.create(model=CACHED, input=texts[:1], dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert srv.runtime.cache_stats()[CACHED]["misses"] == 3
    again = oai.embeddings.create(model=CACHED, input=texts[:1], dimensions=8)
    assert again.data[0].embedding == short.data[0].embedding

    samples = S.scrape(srv.url)
    assert S.metric(samples, "lumen_cache_misses_total", task=CACHED) == 3
    assert S.metric(samples, "lumen_cache_hits_total", task=CACHED) + \
        S.metric(samples, "lumen_cache_coalesced_total", task=CACHED) == 5
    assert S.metric(samples, "lumen_cache_bytes", task=CACHED) > 0
    assert S.metric(samples, "lumen_cache_entries", task=CACHED) == 3
    assert ("lumen_cache_hits_total", frozenset({("task", "text_embed")})) not in samples


def test_native_route_marks_hits_and_truncate_separates(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        body = "native route text " * 3
        r1 = c.post(f"/v1/infer/{CACHED}", content=body, headers={"content-type": "text/plain"})
        r2 = c.post(f"/v1/infer/{CACHED}", content=body, headers={"content-type": "text/plain"})
        assert r1.status_code == r2.status_code == 200
        assert r1.json()["meta"]["lumen.cache"] == "miss"
        assert r2.json()["meta"]["lumen.cache"] == "hit"
        assert r1.json()["outputs"] == r2.json()["outputs"]
        r3 = c.post(f"/v1/infer/{CACHED}?truncate=false", content=body,
                    headers={"content-type": "text/plain"})
        assert r3.json()["meta"]["lumen.cache"] == "miss"  # another option: another entry
        # the uncached task never says anything about a cache
        r4 = c.post("/v1/infer/text_embed", content=body, headers={"content-type": "text/plain"})
        assert "lumen.cache" not in r4.json()["meta"]


def test_a_cached_answer_is_never_shared_across_api_keys(tmp_path):
    """Key B sending what key A sent gets a computation of its own, never A's cached answer
    (and no 'hit' that tells B what A asked)."""
    cfg = S.onnx_config(tmp_path, slow=False, api_keys=["key-a", "key-b"])
    cfg["tasks"] = [{**t, "cache": {"max_bytes": 1 << 20}} for t in cfg["tasks"]
                    if t["name"] == "mlp"]
    server = S.ServerThread(Runtime.from_dict(cfg), grpc=True)
    x = S.mlp_input(9)

    def native(key: str) -> str:
        r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(),
                       params=S.tensor_meta(x.shape),
                       headers={"Authorization": f"Bearer {key}",
                                "Content-Type": "application/octet-stream"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["meta"]["lumen.cache"]

    def oip_grpc(key: str) -> str:
        import tritonclient.grpc as grpcclient

        c = grpcclient.InferenceServerClient(server.grpc_target)
        try:
            inp = grpcclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            res = c.infer("mlp", [inp], headers={"authorization": f"Bearer {key}"})
            return res.get_response().parameters["lumen.cache"].string_param
        finally:
            c.close()

    try:
        assert native("key-a") == "miss" and native("key-a") == "hit"
        assert native("key-b") == "miss" and native("key-b") == "hit"
        assert oip_grpc("key-a") == "hit"  # the same key over gRPC: its own entry
        assert server.runtime.cache_stats()["mlp"]["entries"] == 2
    finally:
        server.stop()


def test_stateful_task_refuses_a_cache(prepared_home):
    async def main(rt):
        async with rt:
            pass

    # the task resolves its model when the table is built and again when it loads: both
    # inside LUMEN_HOME's block (CI runs with an empty LUMEN_HOME)
    with S.lumen_home_env(prepared_home):
        vad = [t for t in default_task_tables() if t["name"] == "vad"][0]
        rt = Runtime.from_dict({"tasks": [{**vad, "cache": {"max_bytes": 1024}}]})
        with pytest.raises(ConfigError, match=r"cache.*stateful"):
            asyncio.run(main(rt))

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

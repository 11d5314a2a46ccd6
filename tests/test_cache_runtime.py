"""The response cache inside the Runtime ([tasks.cache]): config, the hook in ``infer`` /
``infer_many``, many concurrent callers, version separation, errors not cached, and no hook at
all when no task has a cache."""
from __future__ import annotations

import asyncio

import numpy as np
import onnx_models as M
import pytest

from lumen_core.cache import COALESCED, HIT, MISS
from lumen_core.config import CacheConfig, parse_config
from lumen_core.contract import RESP_CACHE
from lumen_core.errors import ConfigError, LumenError
from lumen_core.request import new_infer_request
from lumen_core.runtime import Runtime

D_IN, D_OUT = 16, 8


def _cfg(tmp_path, cache: dict | None = None) -> dict:
    mlp = M.mlp(tmp_path / "mlp.onnx", d_in=D_IN, d_out=D_OUT)
    nan = M.nan_for_negative(tmp_path / "nan.onnx", d=4)
    common = {"backend": "onnx", "intra_op_threads": 1}
    cached = {"cache": cache} if cache is not None else {}
    return {"tasks": [
        {"name": "mlp", "model": mlp, **common, **cached},
        {"name": "plain", "model": mlp, **common},
        {"name": "nan", "model": nan, **common, **cached},
    ]}


def _req(task: str, x: np.ndarray, **meta):
    b = new_infer_request(task).for_tensor_array(x, "NC", "none")
    for k, v in meta.items():
        b.with_meta(k, v)
    return b.build()


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, D_IN)).astype(np.float32)


def test_config_parses_and_checks_the_cache_table():
    cfg = parse_config({"tasks": [{"name": "a", "backend": "onnx", "model": "m.onnx",
                                   "cache": {"max_bytes": 1024, "ttl_s": 2.5}}]})
    assert cfg.tasks[0].cache == CacheConfig(1024, 2.5)
    cfg = parse_config({"tasks": [{"name": "a", "backend": "onnx", "model": "m.onnx"}]})
    assert cfg.tasks[0].cache is None
    for bad, key in (({}, "max_bytes"), ({"max_bytes": 0}, "max_bytes"),
                     ({"max_bytes": 10, "ttl_s": -1}, "ttl_s"),
                     ({"max_bytes": 10, "ttl_s": "1"}, "ttl_s"),
                     ({"max_bytes": 10, "ttl_s": float("inf")}, "ttl_s"),
                     ({"max_bytes": 10, "size": 3}, "size")):
        with pytest.raises(ConfigError, match=rf"tasks\[0\]\.cache\.{key}"):
            parse_config({"tasks": [{"name": "a", "backend": "onnx", "model": "m.onnx",
                                     "cache": bad}]})


def test_no_cache_no_hook(tmp_path):
    rt = Runtime.from_dict(_cfg(tmp_path))
    # the dispatcher's own coroutine answers rt.infer: no method swapped in for the cache, not
    # one extra check (or coroutine frame) per request
    assert "infer" not in vars(rt) and "infer_many" not in vars(rt)
    for coro in (rt.infer(_req("plain", _x(0))), rt.infer_many([_req("plain", _x(0))])):
        try:
            assert coro.__qualname__ in ("Dispatcher.infer", "Dispatcher.infer_many")
        finally:
            coro.close()
    assert rt.cache_stats() == {}


def test_many_concurrent_callers_hits_coalescing_and_outputs(tmp_path):
    rt = Runtime.from_dict(_cfg(tmp_path, {"max_bytes": 1 << 20}))

    async def main():
        async with rt:
            xs = [_x(i) for i in range(8)]
            expected = [(await rt.infer(_req("plain", x))).outputs["y"] for x in xs]
            res = await asyncio.gather(*(rt.infer(_req("mlp", xs[i % 8])) for i in range(64)))
            for i, r in enumerate(res):
                np.testing.assert_allclose(r.outputs["y"], expected[i % 8], rtol=1e-6)
            states = [r.meta[RESP_CACHE] for r in res]
            assert states.count(MISS) == 8
            assert states.count(HIT) + states.count(COALESCED) == 56
            st = rt.cache_stats()["mlp"]
            assert st["misses"] == 8 and st["hits"] + st["coalesced"] == 56 and st["entries"] == 8
            again = await rt.infer(_req("mlp", xs[0], **{"lumen.priority": 1}))
            assert again.meta[RESP_CACHE] == HIT and again.stats.batch_size == 0
            # plain task: never marked, never counted
            assert RESP_CACHE not in (await rt.infer(_req("plain", xs[0]))).meta
            assert set(rt.cache_stats()) == {"mlp", "nan"}
    asyncio.run(main())


def test_infer_many_mixes_cached_and_uncached_tasks(tmp_path):
    rt = Runtime.from_dict(_cfg(tmp_path, {"max_bytes": 1 << 20}))

    async def main():
        async with rt:
            x = _x(1)
            reqs = [_req("mlp", x), _req("plain", x), _req("mlp", x), _req("nan", -np.ones((1, 4), np.float32)),
                    _req("plain", _x(2))]
            out = await rt.infer_many(reqs)
            assert out[0].meta[RESP_CACHE] == MISS and out[2].meta[RESP_CACHE] == COALESCED
            assert RESP_CACHE not in out[1].meta
            np.testing.assert_allclose(out[0].outputs["y"], out[1].outputs["y"], rtol=1e-6)
            assert isinstance(out[3], LumenError)  # NaN output: refused, alone
            assert out[4].outputs["y"].shape == (1, D_OUT) or out[4].outputs["y"].shape == (D_OUT,)
            out2 = await rt.infer_many(reqs[:1])
            assert out2[0].meta[RESP_CACHE] == HIT
    asyncio.run(main())


def test_errors_are_not_cached_and_versions_never_shared(tmp_path):
    rt = Runtime.from_dict(_cfg(tmp_path, {"max_bytes": 1 << 20}))

    async def main():
        async with rt:
            bad = -np.ones((1, 4), np.float32)
            errs = await asyncio.gather(*(rt.infer(_req("nan", bad)) for _ in range(10)),
                                        return_exceptions=True)
            assert all(isinstance(e, LumenError) for e in errs)
            assert len({id(e) for e in errs}) == 1  # one computation, the same error for all
            with pytest.raises(LumenError):
                await rt.infer(_req("nan", bad))
            st = rt.cache_stats()["nan"]
            assert st["misses"] == 2 and st["entries"] == 0  # computed again, never stored

            x = _x(3)
            v1 = await rt.infer(_req("mlp", x))
            assert v1.meta[RESP_CACHE] == MISS
            rt.tasks["mlp"].version = "2"  # what a version swap serves next
            v2 = await rt.infer(_req("mlp", x))
            assert v2.meta[RESP_CACHE] == MISS
            rt.tasks["mlp"].version = "1"
            assert (await rt.infer(_req("mlp", x))).meta[RESP_CACHE] == HIT
    asyncio.run(main())


def test_invalid_requests_are_refused_before_the_cache(tmp_path):
    rt = Runtime.from_dict(_cfg(tmp_path, {"max_bytes": 1 << 20}))

    async def main():
        async with rt:
            x = _x(4)
            await rt.infer(_req("mlp", x))
            with pytest.raises(LumenError) as ei:
                await rt.infer(_req("mlp", x, **{"lumen.priority": 9}))
            assert ei.value.field == "lumen.priority"
            assert rt.cache_stats()["mlp"]["hits"] == 0
    asyncio.run(main())


def test_versions_and_splits_key_on_the_serving_version(tmp_path):
    """Two loaded versions with different weights: a pin and a split each cache per version,
    and a response is never served for the other version."""
    v1 = M.mlp(tmp_path / "v1.onnx", d_in=D_IN, d_out=D_OUT, seed=1)
    v2 = M.mlp(tmp_path / "v2.onnx", d_in=D_IN, d_out=D_OUT, seed=2)
    rt = Runtime.from_dict({"tasks": [{
        "name": "mlp", "backend": "onnx", "intra_op_threads": 1,
        "versions": [{"version": "1", "model": v1}, {"version": "2", "model": v2}],
        "traffic": {"1": 1, "2": 1}, "cache": {"max_bytes": 1 << 20}}]})

    async def main():
        async with rt:
            x = _x(5)
            a = await rt.infer(_req("mlp", x, **{"lumen.model.version": "1"}))
            b = await rt.infer(_req("mlp", x, **{"lumen.model.version": "2"}))
            assert a.meta[RESP_CACHE] == MISS and b.meta[RESP_CACHE] == MISS
            assert not np.allclose(a.outputs["y"], b.outputs["y"])
            seen = set()
            for _ in range(20):  # the split: each answer is its version's
                r = await rt.infer(_req("mlp", x))
                seen.add(r.stats.version)
                want = a if r.stats.version == "1" else b
                np.testing.assert_array_equal(r.outputs["y"], want.outputs["y"])
            # an unpinned request is another key than a pinned one (meta is kept verbatim):
            # one computation per version it reached, every other answer from the cache
            assert rt.cache_stats()["mlp"]["misses"] == 2 + len(seen)
    asyncio.run(main())


def test_a_call_larger_than_the_queue_is_400_as_uncached(tmp_path):
    """infer_many with more items of a cached task than its queue holds: the same 400 naming
    max_queue_size as the uncached task gives, not a 429 that no retry can pass."""
    cfg = _cfg(tmp_path, {"max_bytes": 1 << 20})
    for t in cfg["tasks"]:
        t["batching"] = {"max_queue_size": 8}
    rt = Runtime.from_dict(cfg)

    async def main():
        async with rt:
            for task in ("plain", "mlp"):
                out = await rt.infer_many([_req(task, _x(i)) for i in range(9)])
                codes = {getattr(r, "code", "ok") for r in out}
                assert codes == {"invalid_argument"}, (task, codes)
                assert "max_queue_size = 8" in out[0].message
            # within the queue: served (and the uncached items of the call too)
            out = await rt.infer_many([_req("mlp", _x(i)) for i in range(8)] + [_req("plain", _x(0))])
            assert all(not isinstance(r, LumenError) for r in out)
    asyncio.run(main())


def test_cache_entries_belong_to_their_tenant(tmp_path):
    """A response cached for one tenant (an API key's scope, set by the transports) is never
    served to another, nor shared while it runs: no membership oracle."""
    from lumen_core.cache import TENANT

    rt = Runtime.from_dict(_cfg(tmp_path, {"max_bytes": 1 << 20}))

    async def as_tenant(tenant, req):
        TENANT.set(tenant)  # this task's context only
        return await rt.infer(req)

    async def main():
        async with rt:
            x = _x(6)
            a = await asyncio.create_task(as_tenant("a", _req("mlp", x)))
            b = await asyncio.create_task(as_tenant("b", _req("mlp", x)))
            assert a.meta[RESP_CACHE] == MISS and b.meta[RESP_CACHE] == MISS
            again = await asyncio.create_task(as_tenant("a", _req("mlp", x)))
            assert again.meta[RESP_CACHE] == HIT
            both = await asyncio.gather(as_tenant("c", _req("mlp", _x(7))),
                                        as_tenant("d", _req("mlp", _x(7))))
            assert [r.meta[RESP_CACHE] for r in both] == [MISS, MISS]  # never coalesced
    asyncio.run(main())

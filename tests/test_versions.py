"""Model versions of a task: config, pinning (``lumen.model.version``), the traffic split,
sticky route keys, ``set_traffic`` and the version every response names (versions.py, routing.py)."""
from __future__ import annotations

import asyncio
import collections

import numpy as np
import onnx_models as M
import pytest

import lumen_core as lc
from lumen_core import routing
from lumen_core.config import MAX_TRAFFIC_WEIGHT, parse_config, task_versions
from lumen_core.contract import MAX_META_VALUE_CHARS
from lumen_core.errors import ConfigError
from lumen_core.routing import Router, check_traffic, effective_split, route_point, version_key

D = 4


def _versions_cfg(tmp_path, ks=(1.0, 2.0), traffic=None, **task) -> dict:
    versions = [{"version": str(i + 1), "model": M.offset(tmp_path / f"v{i + 1}.onnx", k, D)}
                for i, k in enumerate(ks)]
    t = {"name": "emb", "backend": "onnx", "intra_op_threads": 1, "versions": versions,
         "batching": {"max_queue_delay_us": 0, "max_queue_size": 4096}, **task}
    if traffic is not None:
        t["traffic"] = traffic
    return {"tasks": [t]}


def _req(x: np.ndarray, **meta) -> lc.InferRequest:
    b = lc.new_infer_request("emb").for_tensor_array(x.reshape(1, D), "NC", "none")
    for k, v in meta.items():
        b.with_meta(k, v)
    return b.build()


def _served(resp) -> float:
    """The offset of the version that answered (inputs are zeros)."""
    return float(resp.outputs["y"].reshape(-1)[0])


def test_config_versions_and_traffic(tmp_path):
    cfg = parse_config(_versions_cfg(tmp_path, traffic={"1": 90, "2": 10}))
    tc = cfg.tasks[0]
    assert [v.version for v in tc.versions] == ["1", "2"]
    assert tc.traffic == {"1": 90.0, "2": 10.0}
    per = task_versions(tc)
    assert [(v.model_version, v.model.endswith(f"v{v.model_version}.onnx")) for v in per] == \
        [("1", True), ("2", True)]
    assert per[1].key == "tasks[0].versions[1]"
    plain = parse_config({"tasks": [{"name": "m", "backend": "onnx", "model": "x.onnx",
                                     "model_version": "7"}]}).tasks[0]
    assert [v.model_version for v in task_versions(plain)] == ["7"]


@pytest.mark.parametrize("change, key, what", [
    (lambda t: t.update(model="x.onnx"), "tasks[0].versions", "names its models there"),
    (lambda t: t["versions"].append({"version": "1", "model": "y"}), "tasks[0].versions[2].version",
     "listed twice"),
    (lambda t: t["versions"][0].pop("version"), "tasks[0].versions[0].version", "is required"),
    (lambda t: t["versions"][0].update(extra=1), "tasks[0].versions[0].extra", "unknown key"),
    (lambda t: t.update(traffic={"3": 1}), "tasks[0].traffic.3", "names no version"),
    (lambda t: t.update(traffic={"1": -1}), "tasks[0].traffic.1", ">= 0"),
    (lambda t: t.update(traffic={"1": "x"}), "tasks[0].traffic.1", ">= 0"),
    (lambda t: t.update(traffic={"1": 0, "2": 0}), "tasks[0].traffic", "weight 0"),
])
def test_config_errors_name_the_key(tmp_path, change, key, what):
    cfg = _versions_cfg(tmp_path)
    change(cfg["tasks"][0])
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg, source="lumen.toml")
    assert f"lumen.toml: {key}:" in str(ei.value) and what in str(ei.value)


def test_split_helpers():
    assert sorted(["10", "9", "b", "a", "2"], key=version_key) == ["2", "9", "10", "a", "b"]
    assert effective_split({}, ["1", "2", "10"]) == {"1": 0.0, "2": 0.0, "10": 100.0}
    assert effective_split({"1": 90, "2": 10}, ["1", "2"]) == {"1": 90.0, "2": 10.0}
    # the weighted version did not load: the highest that serves takes everything
    assert effective_split({"3": 10}, ["1", "2"]) == {"1": 0.0, "2": 100.0}
    assert 0.0 <= route_point("user-1") < 1.0 and route_point("a") == route_point("a")
    for bad, what in (({}, "non-empty"), ({"9": 1}, "no loaded version"),
                      ({"1": -1}, ">= 0"), ({"1": True}, ">= 0"), ({"1": float("nan")}, ">= 0"),
                      ({"1": 0}, "weight 0")):
        with pytest.raises(lc.InvalidArgument) as ei:
            check_traffic("emb", bad, ["1", "2"])
        assert ei.value.field == "traffic" and what in ei.value.message


def test_traffic_weights_that_overflow_are_400(tmp_path):
    """A weight too large for a float, or weights whose sum overflows, are refused (the HTTP
    traffic route and the config alike), never a 500 or a split that sends all to one."""
    for bad in ({"1": 10 ** 400}, {"1": 1e308, "2": 1e308},
                {"1": MAX_TRAFFIC_WEIGHT * 2}):
        with pytest.raises(lc.InvalidArgument) as ei:
            check_traffic("emb", bad, ["1", "2"])
        assert ei.value.field == "traffic" and "weight" in ei.value.message
    base = {"name": "emb", "backend": "onnx",
            "versions": [{"version": "1", "model": "a.onnx"}, {"version": "2", "model": "b.onnx"}]}
    for bad in ({"1": 10 ** 400}, {"1": 1e308, "2": 1e308}):
        with pytest.raises(ConfigError, match="traffic"):
            parse_config({"tasks": [{**base, "traffic": bad}]}, source="lumen.toml")
    assert check_traffic("emb", {"1": 3, "2": 1}, ["1", "2"]) == {"1": 3.0, "2": 1.0}


def test_refused_route_keys_are_not_remembered_and_the_memo_is_bounded(monkeypatch):
    a, b = object(), object()
    r = Router("emb", {"1": a, "2": b}, {"1": 50.0, "2": 50.0})
    long_key = "k" * (MAX_META_VALUE_CHARS + 1)  # the request will be refused: never kept
    for i in range(20):
        r({"lumen.route.key": f"{i}{long_key}"})
    assert r.sticky_bytes == 0
    monkeypatch.setattr(routing, "MAX_STICKY_BYTES", 64 * 1024)
    for i in range(2000):
        assert r({"lumen.route.key": f"{i:04d}" + "x" * 1000}) in (a, b)
    assert 0 < r.sticky_bytes <= 64 * 1024
    # a key the memo no longer takes still lands where its point says
    k = "9999" + "x" * 1000
    assert r({"lumen.route.key": k}) is r({"lumen.route.key": k})


def test_router_picks_by_point_and_pin():
    a, b = object(), object()
    r = Router("emb", {"1": a, "2": b}, {"1": 90.0, "2": 10.0})
    assert r({"lumen.model.version": "2"}) is b
    keys = [f"k{i}" for i in range(4000)]
    got = [r({"lumen.route.key": k}) for k in keys]
    assert got == [r({"lumen.route.key": k}) for k in keys]  # sticky
    share = sum(g is b for g in got) / len(got)
    assert abs(share - 0.10) < 0.03
    with pytest.raises(lc.InvalidArgument) as ei:
        r({"lumen.model.version": "3"})
    assert ei.value.field == "lumen.model.version" and "loaded: 1, 2" in ei.value.message


def test_pinning_default_and_response_version(tmp_path):
    async def main():
        async with lc.Runtime.from_dict(_versions_cfg(tmp_path)) as rt:
            infer = rt.infer
            x = np.zeros(D, np.float32)
            for _ in range(20):  # no split configured: the highest version takes all
                r = await infer(_req(x))
                assert _served(r) == 2.0 and r.meta["lumen.model.version"] == "2"
            r1 = await infer(_req(x, **{"lumen.model.version": "1"}))
            assert _served(r1) == 1.0 and r1.meta["lumen.model.version"] == "1"
            with pytest.raises(lc.InvalidArgument) as ei:
                await infer(_req(x, **{"lumen.model.version": "9"}))
            assert ei.value.field == "lumen.model.version"
            assert "loaded: 1, 2" in ei.value.message
            # infer_many routes each item to its version; errors stay per item
            many = await rt.infer_many([_req(x, **{"lumen.model.version": v})
                                        for v in ("1", "2", "9", "1")])
            assert [_served(m) for m in many if not isinstance(m, lc.LumenError)] == [1, 2, 1]
            assert [m.meta["lumen.model.version"] for m in many
                    if not isinstance(m, lc.LumenError)] == ["1", "2", "1"]
            assert isinstance(many[2], lc.InvalidArgument)
            assert rt.describe("emb")["model_version"] == "2"  # the head: the default version
    asyncio.run(main())


def test_single_version_task_names_its_version(tmp_path):
    cfg = {"tasks": [{"name": "emb", "backend": "onnx", "intra_op_threads": 1,
                      "model": M.offset(tmp_path / "m.onnx", 5.0, D), "model_version": "3"}]}

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            assert rt.tasks["emb"].router is None  # one version: the request path is unchanged
            x = np.zeros(D, np.float32)
            r = await rt.infer(_req(x))
            assert r.meta["lumen.model.version"] == "3" and _served(r) == 5.0
            r = await rt.infer(_req(x, **{"lumen.model.version": "3"}))
            assert _served(r) == 5.0
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(_req(x, **{"lumen.model.version": "4"}))
            assert ei.value.field == "lumen.model.version"
            # a route key is a known lumen.* key even without a split
            r = await rt.infer(_req(x, **{"lumen.route.key": "u1"}))
            assert _served(r) == 5.0
    asyncio.run(main())


def test_split_90_10_and_sticky_keys(tmp_path):
    async def main():
        async with lc.Runtime.from_dict(_versions_cfg(tmp_path, traffic={"1": 90, "2": 10})) as rt:
            infer = rt.infer
            x = np.zeros(D, np.float32)
            rs = await asyncio.gather(*(infer(_req(x)) for _ in range(2000)))
            counts = collections.Counter(r.meta["lumen.model.version"] for r in rs)
            assert abs(counts["2"] / 2000 - 0.10) < 0.03, counts
            assert all(_served(r) == float(r.meta["lumen.model.version"]) for r in rs)
            keys = [f"user-{i}" for i in range(300)]

            async def by_key():
                out = await asyncio.gather(*(infer(_req(x, **{"lumen.route.key": k}))
                                             for k in keys))
                return [r.meta["lumen.model.version"] for r in out]
            first = await by_key()
            for _ in range(3):
                assert await by_key() == first  # the same key, the same version
            assert 0 < first.count("2") < 300 * 0.25
            # a new split moves traffic; a key keeps its version while the split stays
            rt.set_traffic("emb", {"1": 50, "2": 50})
            second = await by_key()
            assert second == await by_key()
            assert 0.35 < second.count("2") / 300 < 0.65
            # growing version 2's share only moves keys towards it
            assert all(b == "2" for a, b in zip(first, second, strict=True) if a == "2")
            view = rt.set_traffic("emb", {"2": 1})
            assert view["traffic"] == {"1": 0.0, "2": 1.0} and view["default_version"] == "2"
            rs = await asyncio.gather(*(infer(_req(x)) for _ in range(50)))
            assert {r.meta["lumen.model.version"] for r in rs} == {"2"}
            with pytest.raises(lc.InvalidArgument):
                rt.set_traffic("emb", {"3": 1})
            with pytest.raises(lc.TaskNotFound):
                rt.set_traffic("nope", {"1": 1})
    asyncio.run(main())


def test_metrics_carry_the_version(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from lumen_core.serve.metrics import PrometheusObserver

    async def main():
        async with lc.Runtime.from_dict(_versions_cfg(tmp_path, traffic={"1": 1, "2": 1})) as rt:
            obs = rt.observer = PrometheusObserver(rt)
            x = np.zeros(D, np.float32)
            for v in ("1", "1", "2"):
                await rt.infer(_req(x, **{"lumen.model.version": v}))
            with pytest.raises(lc.InvalidArgument):
                await rt.infer(_req(x, **{"lumen.model.version": "7"}))
            text = obs.exposition().decode()
        samples = {(s.name, frozenset(s.labels.items())): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}

        def get(name, **labels):
            return samples.get((name, frozenset(labels.items())), 0.0)
        assert get("lumen_requests_total", task="emb", route="tensor", code="ok", version="1") == 2
        assert get("lumen_requests_total", task="emb", route="tensor", code="ok", version="2") == 1
        assert sum(v for (n, lab), v in samples.items() if n == "lumen_requests_total"
                   and ("code", "invalid_argument") in lab) == 1
        assert get("lumen_model_versions", task="emb", version="1", state="ready") == 1
        assert get("lumen_traffic_weight", task="emb", version="2") == 0.5
    asyncio.run(main())

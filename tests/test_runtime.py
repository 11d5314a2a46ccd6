"""Runtime + generic onnx backend + ORT engine, end to end on small generated models."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnx_models as M
import pytest

import lumen_core as lc
from lumen_core.errors import ConfigError

#: seconds a test waits for an event that must come
WAIT_S = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    M.mlp(d / "mlp.onnx")
    M.mlp(d / "failing.onnx", fail_marker=True)
    M.scale(d / "scale.onnx", dims=("N", "L"))
    M.scale(d / "scale_fixed.onnx", dims=("N", 3, 4))
    M.nan_for_negative(d / "sqrt.onnx")
    return d


def task(name, path, **batching):
    batching.setdefault("max_queue_delay_us", 0)
    return {"name": name, "backend": "onnx", "model": str(path), "batching": batching}


def mlp_req(x: np.ndarray, task_name="mlp", **meta):
    b = lc.new_infer_request(task_name).for_tensor_array(x.reshape(1, -1), layout="NC",
                                                         preprocess_id="none")
    for k, v in meta.items():
        b.with_meta(k, v)
    return b.build()


def test_thousand_concurrent_callers_on_a_real_model(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx", max_batch_size=32, max_queue_size=2000)]}
    xs = np.random.default_rng(1).standard_normal((1000, 16)).astype(np.float32)
    ref = M.mlp_reference(xs)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            return await asyncio.gather(*[rt.infer(mlp_req(xs[i])) for i in range(1000)])

    res = asyncio.run(main())
    for i, r in enumerate(res):
        np.testing.assert_allclose(r.outputs["y"], ref[i], atol=1e-5)
    sizes = [int(r.meta["lumen.batch.size"]) for r in res]
    assert max(sizes) > 1 and max(sizes) <= 32
    assert all(int(r.meta["lumen.compute_us"]) > 0 for r in res)


def test_model_failure_lands_only_on_the_marked_request(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "failing.onnx", max_batch_size=16)]}
    xs = np.random.default_rng(2).standard_normal((64, 16)).astype(np.float32)
    xs[[5, 40], 0] = M.FAIL_MARKER
    ref = M.mlp_reference(xs)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            return await asyncio.gather(*[rt.infer(mlp_req(xs[i])) for i in range(64)],
                                        return_exceptions=True)

    res = asyncio.run(main())
    for i, r in enumerate(res):
        if i in (5, 40):
            assert isinstance(r, lc.InternalError), r
        else:
            np.testing.assert_allclose(r.outputs["y"], ref[i], atol=1e-5)


def test_non_finite_output_is_an_internal_error_for_that_request_only(model_dir):
    cfg = {"tasks": [task("sqrt", model_dir / "sqrt.onnx", max_batch_size=8)]}
    xs = np.abs(np.random.default_rng(3).standard_normal((16, 4))).astype(np.float32)
    xs[3, 2] = -1.0

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            return await asyncio.gather(*[rt.infer(mlp_req(xs[i], "sqrt")) for i in range(16)],
                                        return_exceptions=True)

    res = asyncio.run(main())
    assert isinstance(res[3], lc.InternalError) and "non-finite" in res[3].message
    for i, r in enumerate(res):
        if i != 3:
            np.testing.assert_allclose(r.outputs["y"], np.sqrt(xs[i]), rtol=1e-6)


def test_signatures_never_mix_and_shapes_batch_separately(model_dir):
    cfg = {"tasks": [dict(task("scale", model_dir / "scale.onnx", max_batch_size=16),
                          options={"layout": "NL"})]}
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal((1, 1 + i % 4)).astype(np.float32) for i in range(80)]

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            reqs = [lc.new_infer_request("scale").for_tensor_array(a, "NL", "none").build()
                    for a in arrays]
            return await asyncio.gather(*[rt.infer(r) for r in reqs])

    res = asyncio.run(main())
    for a, r in zip(arrays, res, strict=True):
        np.testing.assert_allclose(r.outputs["y"], a[0] * 2)


def test_generic_contract_is_derived_from_the_model(model_dir):
    cfg = {"tasks": [task("fixed", model_dir / "scale_fixed.onnx"),
                     dict(task("dyn", model_dir / "scale.onnx"),
                          options={"preprocess_ids": ["p1", "p2"], "max_dim": 8, "layout": "NL"})]}

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            desc = rt.describe()
            sig = desc["fixed"]["tensor_signatures"][0]
            assert sig["dtype"] == "fp32" and sig["layout"] == "NCL" and sig["shape"] == [1, 3, 4]
            dyn = desc["dyn"]["tensor_signatures"][0]
            assert dyn["shape"] == [1, [1, 8]] and dyn["preprocess_ids"] == ["p1", "p2"]
            ok = await rt.infer(lc.new_infer_request("fixed").for_tensor_array(
                np.ones((1, 3, 4), np.float32), "NCL", "none").build())
            assert ok.outputs["y"].shape == (3, 4)
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(lc.new_infer_request("fixed").for_tensor_array(
                    np.ones((1, 3, 5), np.float32), "NCL", "none").build())
            assert ei.value.field == "lumen.tensor.shape"
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(lc.new_infer_request("dyn").for_tensor_array(
                    np.ones((1, 9), np.float32), "NL", "p1").build())
            assert ei.value.field == "lumen.tensor.shape"
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(lc.new_infer_request("dyn").for_tensor_array(
                    np.ones((1, 4), np.float32), "NL", "p3").build())
            assert ei.value.field == "lumen.preprocess.id"
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(lc.new_infer_request("dyn").for_tensor_array(
                    np.ones((1, 4), np.int64), "NL", "p1").build())
            assert ei.value.field == "lumen.tensor.dtype"

    asyncio.run(main())


def test_request_errors_are_specific(model_dir):
    cfg = {"server": {"max_payload_bytes": 1024},
           "tasks": [task("mlp", model_dir / "mlp.onnx")]}
    x = np.ones(16, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            with pytest.raises(lc.TaskNotFound) as ei:
                await rt.infer(lc.InferRequest("nope", b"", "text/plain"))
            assert ei.value.field == "task" and "mlp" in ei.value.message
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(lc.InferRequest("mlp", b"hello", "text/plain"))
            assert ei.value.field == "lumen.input.kind"
            with pytest.raises(lc.PayloadTooLarge):
                await rt.infer(lc.InferRequest("mlp", b"x" * 2048, "application/octet-stream"))
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(lc.InferRequest("mlp", 12345, "application/octet-stream"))
            assert ei.value.field == "payload"
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(mlp_req(x, **{"lumen.priority": "2"}))
            assert ei.value.field == "lumen.priority"
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(mlp_req(x, **{"lumen.model.id": "other"}))
            assert ei.value.field == "lumen.model.id"
            # the process keeps serving after every error
            ok = await rt.infer(mlp_req(x, **{"lumen.model.id": "mlp", "lumen.timeout_ms": "5000"}))
            assert ok.outputs["y"].shape == (8,)

    asyncio.run(main())


def test_exit_drains_in_flight_work(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx", max_batch_size=4)]}
    xs = np.ones((40, 16), np.float32)

    async def main():
        rt = lc.Runtime.from_dict(cfg)
        async with rt:
            futs = [asyncio.ensure_future(rt.infer(mlp_req(xs[i]))) for i in range(40)]
            await asyncio.sleep(0)
        assert all(f.done() and not f.exception() for f in futs)
        with pytest.raises(lc.Unavailable):
            await rt.infer(mlp_req(xs[0]))

    asyncio.run(main())


def test_infer_sync_from_a_plain_thread(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx")]}
    x = np.random.default_rng(5).standard_normal(16).astype(np.float32)
    with lc.Runtime.from_dict(cfg) as rt:
        r = rt.infer_sync(mlp_req(x))
        np.testing.assert_allclose(r.outputs["y"], M.mlp_reference(x[None])[0], atol=1e-5)
        assert r.task == "mlp" and len(r.correlation_id) == 32


def test_multiple_instances_share_the_load(model_dir):
    cfg = {"tasks": [dict(task("mlp", model_dir / "mlp.onnx", max_batch_size=8), instances=2,
                          intra_op_threads=1)]}
    xs = np.random.default_rng(6).standard_normal((200, 16)).astype(np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            # each instance's first batch waits until the other instance ran one: with one
            # worker taking all the work this would stall (and fail), whatever the box's speed
            instances = rt.tasks["mlp"].instances
            ran = [threading.Event() for _ in instances]
            for k, inst in enumerate(instances):
                def run(feeds, n, _k=k, _run=inst.run):
                    ran[_k].set()
                    assert ran[1 - _k].wait(WAIT_S), "the other instance never got a batch"
                    return _run(feeds, n)
                inst.run = run
            res = await asyncio.gather(*[rt.infer(mlp_req(xs[i])) for i in range(200)])
            counts = [i.stats["items"] for i in instances]
            return res, counts

    res, counts = asyncio.run(main())
    np.testing.assert_allclose(np.stack([r.outputs["y"] for r in res]), M.mlp_reference(xs), atol=1e-5)
    assert sum(counts) >= 200 and all(c > 0 for c in counts)


@pytest.mark.parametrize("cfg, key, problem", [
    ({"tasks": [{"name": "a", "backend": "onnx", "model": "x.onnx", "batching": {"max_batch_size": 0}}]},
     "tasks[0].batching.max_batch_size", ">= 1"),
    ({"tasks": [{"name": "a", "backend": "onnx", "model": "x.onnx", "instancez": 2}]},
     "tasks[0].instancez", "unknown key"),
    ({"tasks": [{"name": "a", "backend": "onnx", "device": "tpu"}]}, "tasks[0].device", "cuda:N"),
    ({"tasks": [{"backend": "onnx"}]}, "tasks[0].name", "required"),
    ({"tasks": [{"name": "a", "backend": "onnx"}, {"name": "a", "backend": "onnx"}]},
     "tasks[1].name", "duplicate"),
    ({"server": {"http_port": "80"}}, "server.http_port", "integer"),
    ({"tasks": [{"name": "a", "backend": "onnx", "batching": {"preferred_batch_sizes": [64]}}]},
     "tasks[0].batching.preferred_batch_sizes", "max_batch_size"),
])
def test_config_errors_name_file_key_and_problem(cfg, key, problem):
    with pytest.raises(ConfigError) as ei:
        lc.Runtime.from_dict(cfg, source="my.toml")
    assert ei.value.key == key and problem in ei.value.problem
    assert str(ei.value).startswith(f"my.toml: {key}: ")


def test_config_file_and_load_errors(tmp_path, model_dir):
    p = tmp_path / "lumen.toml"
    p.write_text('[[tasks]]\nname = "m"\nbackend = "onnx"\nmodel = "missing.onnx"\n')
    rt = lc.Runtime.from_config(str(p))
    with pytest.raises(ConfigError) as ei:
        asyncio.run(rt.start())
    assert ei.value.key == "tasks[0].model" and str(p) in str(ei.value)
    p.write_text('[[tasks]]\nname = "m"\nbackend = "nope"\n')
    with pytest.raises(ConfigError) as ei:
        asyncio.run(lc.Runtime.from_config(str(p)).start())
    assert ei.value.key == "tasks[0].backend" and "onnx" in ei.value.problem
    p.write_text("[[tasks]\n")
    with pytest.raises(ConfigError) as ei:
        lc.Runtime.from_config(str(p))
    assert ei.value.key == "<syntax>"
    # relative model paths resolve against the config file's folder
    (tmp_path / "m.onnx").write_bytes((model_dir / "mlp.onnx").read_bytes())
    p.write_text('[[tasks]]\nname = "m"\nbackend = "onnx"\nmodel = "m.onnx"\n[tasks.batching]\nmax_queue_delay_us = 0\n')

    async def main():
        async with lc.Runtime.from_config(str(p)) as rt:
            r = await rt.infer(mlp_req(np.ones(16, np.float32), "m"))
            assert r.outputs["y"].shape == (8,)

    asyncio.run(main())


def test_runtime_serves_again_after_a_stop_and_restart(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx")]}
    x = np.random.default_rng(6).standard_normal(16).astype(np.float32)

    async def main():
        rt = lc.Runtime.from_dict(cfg)
        async with rt:
            await rt.infer(mlp_req(x))
        async with rt:  # a second start serves again instead of refusing as "shutting down"
            return await rt.infer(mlp_req(x))

    r = asyncio.run(main())
    np.testing.assert_allclose(r.outputs["y"], M.mlp_reference(x[None])[0], atol=1e-5)


def test_failed_background_start_leaves_no_loop_thread(tmp_path):
    import threading

    cfg = {"tasks": [task("mlp", tmp_path / "missing.onnx")]}
    rt = lc.Runtime.from_dict(cfg)
    with pytest.raises(ConfigError):  # the model file is missing
        with rt:
            pass
    assert rt._thread is None
    assert not [t for t in threading.enumerate() if t.name == "lumen-runtime"]


# ------------------------------------------------------------------ infer_many (issue 11)
def test_infer_many_mixed_valid_and_invalid_items_fail_alone(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx", max_batch_size=8),
                     task("sqrt", model_dir / "sqrt.onnx", max_batch_size=8)]}
    xs = np.random.default_rng(5).standard_normal((20, 16)).astype(np.float32)
    ref = M.mlp_reference(xs)
    reqs = [mlp_req(xs[i]) for i in range(20)]
    reqs[3] = mlp_req(xs[3], **{"lumen.tensor.dtype": "fp16"})  # lies about its dtype
    reqs[7] = lc.InferRequest("nope", b"", "")  # unknown task
    reqs[11] = lc.new_infer_request("sqrt").for_tensor_array(
        -np.ones((1, 4), np.float32), "NC", "none").build()  # another task: NaN output
    reqs[12] = lc.new_infer_request("sqrt").for_tensor_array(
        np.full((1, 4), 4.0, np.float32), "NC", "none").build()

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            return await rt.infer_many(reqs)

    out = asyncio.run(main())
    assert len(out) == 20
    assert isinstance(out[3], lc.InvalidArgument) and out[3].field == "lumen.tensor.dtype"
    assert isinstance(out[7], lc.TaskNotFound)
    assert isinstance(out[11], lc.InternalError) and "non-finite" in out[11].message
    np.testing.assert_allclose(out[12].outputs["y"], np.full(4, 2.0), rtol=1e-6)
    for i in set(range(20)) - {3, 7, 11, 12}:
        np.testing.assert_allclose(out[i].outputs["y"], ref[i], atol=1e-5)
        assert out[i].correlation_id == reqs[i].correlation_id
        assert 1 <= out[i].stats.batch_size <= 8


def test_infer_many_admits_a_group_as_a_unit(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx", max_batch_size=4, max_queue_size=10)]}
    xs = np.zeros((11, 16), np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            too_many = await rt.infer_many([mlp_req(x) for x in xs])
            fits = await rt.infer_many([mlp_req(x) for x in xs[:10]])
            return too_many, fits

    too_many, fits = asyncio.run(main())
    # more than the whole queue can never run: refused up front, not retryable, names the limit
    assert all(isinstance(r, lc.InvalidArgument) for r in too_many)
    assert "max_queue_size" in too_many[0].message
    assert all(isinstance(r, lc.InferResponse) for r in fits)


def test_infer_many_sync_and_deadlines_per_item(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx", max_batch_size=4)]}
    xs = np.random.default_rng(6).standard_normal((6, 16)).astype(np.float32)
    with lc.Runtime.from_dict(cfg) as rt:
        out = rt.infer_many_sync([mlp_req(x, **{"lumen.timeout_ms": 60_000}) for x in xs])
    np.testing.assert_allclose(np.stack([o.outputs["y"] for o in out]), M.mlp_reference(xs),
                               atol=1e-5)


def test_random_cancels_under_load_lose_and_duplicate_nothing(model_dir):
    # many callers, worker-side formation, random cancellations and tight deadlines: every
    # caller that was not cancelled gets its own result or a deadline error, none twice
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx", max_batch_size=16, max_queue_size=4000,
                          )], }
    cfg["tasks"][0]["instances"] = 2
    n = 1500
    xs = np.random.default_rng(7).standard_normal((n, 16)).astype(np.float32)
    ref = M.mlp_reference(xs)
    rng = np.random.default_rng(8)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            futs = []
            for i in range(n):
                meta = {"lumen.timeout_ms": 1} if i % 7 == 0 else {}
                futs.append(asyncio.ensure_future(rt.infer(mlp_req(xs[i], **meta))))
                if i % 50 == 0:
                    await asyncio.sleep(0)
            cancelled = set()
            for i in rng.choice(n, 300, replace=False):
                if futs[i].cancel():
                    cancelled.add(int(i))
            res = await asyncio.gather(*futs, return_exceptions=True)
            pending = rt.tasks["mlp"].batcher.pending
            return res, cancelled, pending

    res, cancelled, pending = asyncio.run(main())
    assert pending == 0
    ok = 0
    for i, r in enumerate(res):
        if i in cancelled:
            assert isinstance(r, asyncio.CancelledError)
        elif isinstance(r, lc.DeadlineExceeded):
            assert i % 7 == 0
        else:
            np.testing.assert_allclose(r.outputs["y"], ref[i], atol=1e-5)
            ok += 1
    assert ok >= n - len(cancelled) - (n // 7 + 1)


def test_load_query_reports_queue_state(model_dir):
    cfg = {"tasks": [task("mlp", model_dir / "mlp.onnx", max_batch_size=4)]}

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            idle = rt.load()
            await rt.infer(mlp_req(np.zeros(16, np.float32)))
            return idle, rt.load()

    idle, after = asyncio.run(main())
    cost = idle["mlp"].pop("cost")  # the learnt cost model (issue 30): one sample a batch
    assert idle == {"mlp": {"pending": 0, "in_flight": 0, "padding_ratio": 0.0}}
    assert after["mlp"]["pending"] == 0
    assert cost["latency_target_ms"] == 0 and cost["workers"] == 1
    assert after["mlp"]["cost"]["samples"] == cost["samples"] + 1

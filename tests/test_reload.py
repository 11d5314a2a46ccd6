"""Hot reload without failed requests (versions.py): swaps of a model file, added and removed
versions and corrupt / missing / wrong files under continuous load; the watcher; the wait for
a file that is still being written."""
from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import threading
import time

import numpy as np
import onnx
import onnx_models as M
import pytest
from onnx import TensorProto, helper

import lumen_core as lc
from lumen_core.versions import FAILED, READY
from lumen_core.watch import file_state, wait_stable

D = 4
#: concurrent in-process callers during the load test
CALLERS = 200
#: seconds a changed file must stay unchanged in these tests (the default is longer)
QUIET_S = 0.02


def _toml(path: pathlib.Path, versions: dict, traffic: dict | None = None) -> None:
    lines = ["[[tasks]]", 'name = "emb"', 'backend = "onnx"', "intra_op_threads = 1",
             "[tasks.batching]", "max_queue_delay_us = 0", "max_batch_size = 64",
             "max_queue_size = 100000"]
    for v, model in versions.items():
        lines += ["[[tasks.versions]]", f'version = "{v}"', f'model = "{model}"']
    if traffic:
        lines += ["[tasks.traffic]"] + [f'"{v}" = {w}' for v, w in traffic.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def _write_model(path: pathlib.Path, k: float, in_place: bool) -> str:
    """Write the ``+k`` model to ``path`` (in place, or by rename); its sha256."""
    tmp = path.with_name(path.name + ".new")
    M.offset(tmp, k, D)
    data = tmp.read_bytes()
    if in_place:
        tmp.unlink()
        with open(path, "wb") as fh:
            fh.write(data)
    else:
        os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def _req(**meta) -> lc.InferRequest:
    x = np.zeros((1, D), np.float32)
    b = lc.new_infer_request("emb").for_tensor_array(x, "NC", "none")
    for k, v in meta.items():
        b.with_meta(k, v)
    return b.build()


def _two_inputs(path: pathlib.Path) -> None:
    """A model the onnx backend refuses (two inputs): a wrong contract."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])], "two",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", D]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", D])])
    M._save(graph, path)


class Load:
    """CALLERS coroutines calling ``infer`` back to back until stopped; every outcome kept."""

    def __init__(self, infer, rt):
        self.infer, self.rt = infer, rt
        self.stop = False
        self.results: list = []  # (submitted ns, version, served offset)
        self.errors: list = []

    async def caller(self, i: int) -> None:
        while not self.stop:
            t = time.monotonic_ns()
            meta = {"lumen.route.key": f"c{i}"} if i % 2 else {}
            try:
                r = await self.infer(self.rt, _req(**meta))
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                self.errors.append(repr(exc))
                continue
            self.results.append((t, r.meta.get("lumen.model.version"),
                                 float(r.outputs["y"].reshape(-1)[0])))

    def __enter__(self):
        self.tasks = [asyncio.ensure_future(self.caller(i)) for i in range(CALLERS)]
        return self

    def __exit__(self, *exc):
        self.stop = True

    async def finish(self) -> None:
        self.stop = True
        await asyncio.gather(*self.tasks)


def test_swaps_versions_and_bad_files_under_load_fail_nothing(tmp_path):
    """Under CALLERS concurrent callers for the whole test: ten swaps of the model file (in
    place and by rename), a version added and removed twice, a corrupt file and a wrong one.
    Zero failures; every response names its version; none comes from a revision whose unload
    had finished when the request was sent.  (``rt.infer`` is the twin ``native`` chose: the
    suite's two modes cover both.)"""
    model = tmp_path / "emb.onnx"
    v2 = tmp_path / "emb_v2.onnx"
    cfg = tmp_path / "lumen.toml"
    revision = {_write_model(model, 100.0, in_place=False): 100.0}
    revision[_write_model(v2, 200.0, in_place=False)] = 200.0
    _toml(cfg, {"1": model})

    async def main():
        rt = lc.Runtime.from_config(str(cfg))
        rt._lifecycle.quiet_s = QUIET_S
        async with rt:
            with Load(lambda rt, req: rt.infer(req), rt) as load:
                await asyncio.sleep(0.05)
                for g in range(1, 11):  # ten swaps of the model file
                    revision[_write_model(model, 100.0 + g, in_place=g % 2 == 0)] = 100.0 + g
                    view = await rt.reload("emb")
                    assert [v["state"] for v in view["versions"]] == [READY]
                    await asyncio.sleep(0.02)
                for _ in range(2):  # a version added (with a split), then removed
                    _toml(cfg, {"1": model, "2": v2}, {"1": 50, "2": 50})
                    view = await rt.reload()
                    assert sorted(v["version"] for v in view["emb"]["versions"]) == ["1", "2"]
                    await asyncio.sleep(0.05)
                    _toml(cfg, {"1": model})
                    await rt.reload()
                    await asyncio.sleep(0.02)
                model.write_bytes(b"this is not an onnx model")  # corrupt
                view = await rt.reload("emb")
                states = {(v["version"], v["state"]) for v in view["versions"]}
                assert states == {("1", READY), ("1", FAILED)}
                assert view["load_failures"] == {"1": 1} and view["last_error"]
                await asyncio.sleep(0.05)
                served_before = len(load.results)
                await asyncio.sleep(0.05)
                assert len(load.results) > served_before  # the old revision still serves
                _two_inputs(model)  # a wrong contract: refused too
                view = await rt.reload("emb")
                assert view["load_failures"] == {"1": 2}
                revision[_write_model(model, 150.0, in_place=True)] = 150.0  # later: picked up
                view = await rt.reload("emb")
                assert [v["state"] for v in view["versions"]] == [READY]
                assert view["versions"][0]["revision"] in revision
                await asyncio.sleep(0.05)
                await load.finish()
            events = list(rt._lifecycle.sets["emb"].events)
        assert not load.errors, load.errors[:5]
        assert len(load.results) > 2000
        unloaded = {}
        for e in events:
            if e["event"] == "unloaded" and e["version"] == "1":
                unloaded.setdefault(revision[e["revision"]], e["t_ns"])
        served = {k for _t, _v, k in load.results}
        assert {101.0, 110.0, 150.0, 200.0} <= served, sorted(served)
        for t, version, k in load.results:
            assert version == ("2" if k == 200.0 else "1")
            if k in unloaded:
                # nothing submitted after a revision's unload finished was answered by it
                assert t < unloaded[k], (k, t, unloaded[k])
    asyncio.run(main())


def test_admin_operations_in_process(tmp_path):
    model, v2 = tmp_path / "a.onnx", tmp_path / "b.onnx"
    _write_model(model, 1.0, in_place=False)
    _write_model(v2, 2.0, in_place=False)
    cfg = {"tasks": [{"name": "emb", "backend": "onnx", "intra_op_threads": 1,
                      "model": str(model)}]}

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            rt._lifecycle.quiet_s = QUIET_S
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.load_version("emb", "2")
            assert ei.value.field == "version" and "give its model" in ei.value.message
            view = await rt.load_version("emb", "2", str(v2))
            assert sorted(v["version"] for v in view["versions"]) == ["1", "2"]
            assert view["default_version"] == "2"  # no split: the highest takes all
            r = await rt.infer(_req())
            assert r.meta["lumen.model.version"] == "2"
            rt.set_traffic("emb", {"1": 1})
            assert (await rt.infer(_req())).meta["lumen.model.version"] == "1"
            assert (await rt.infer(_req(**{"lumen.model.version": "2"}))).outputs["y"].reshape(-1)[0] == 2
            view = await rt.unload_version("emb", "2")
            assert [v["version"] for v in view["versions"]] == ["1"]
            assert rt.tasks["emb"].router is None  # back to one version: no routing cost
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.unload_version("emb", "1")
            assert "only loaded version" in ei.value.message
            with pytest.raises(lc.InvalidArgument):
                await rt.unload_version("emb", "7")
            with pytest.raises(lc.TaskNotFound):
                await rt.reload("nope")
            # a missing file fails the load and keeps version 1 serving
            # (issue 38 row 10: an error naming the cause, not a view that says "failed")
            with pytest.raises(lc.LoadFailed) as ei:
                await rt.load_version("emb", "3", str(tmp_path / "missing.onnx"))
            assert ei.value.http_status == 422 and ei.value.field == "model"
            assert "no such file" in ei.value.message
            view = rt.lifecycle("emb")
            assert {(v["version"], v["state"]) for v in view["versions"]} == \
                {("1", READY), ("3", FAILED)}
            assert "no such file" in view["last_error"]
            assert (await rt.infer(_req())).meta["lumen.model.version"] == "1"
            assert rt.versions("emb") == ["1"]
            # apply_config: a task added, then dropped
            other = dict(cfg["tasks"][0], name="other")
            await rt.apply_config({"tasks": [cfg["tasks"][0], other]})
            assert rt.task_names() == ["emb", "other"]
            await rt.apply_config({"tasks": [cfg["tasks"][0]]})
            assert rt.task_names() == ["emb"]
            with pytest.raises(lc.ConfigError):
                await rt.apply_config({"tasks": [{"name": "x"}]})
            assert rt.task_names() == ["emb"]
    asyncio.run(main())


def test_watch_picks_up_changes_after_a_failure(tmp_path):
    model = tmp_path / "w.onnx"
    _write_model(model, 1.0, in_place=False)
    cfg = {"tasks": [{"name": "emb", "backend": "onnx", "intra_op_threads": 1,
                      "model": str(model)}]}

    async def until(rt, cond, what):
        for _ in range(400):
            view = rt.lifecycle("emb")
            if cond(view):
                return view
            await asyncio.sleep(0.025)
        raise AssertionError(f"timed out waiting for {what}: {view}")

    async def served(rt):
        return float((await rt.infer(_req())).outputs["y"].reshape(-1)[0])

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            rt._lifecycle.quiet_s = QUIET_S
            rt.watch(0.02)
            rev2 = _write_model(model, 2.0, in_place=True)
            await until(rt, lambda v: v["versions"][0]["revision"] == rev2, "revision 2")
            assert await served(rt) == 2.0
            model.write_bytes(b"\x00garbage")
            await until(rt, lambda v: v["load_failures"].get("1") == 1, "the failed load")
            assert await served(rt) == 2.0  # what served keeps serving
            await asyncio.sleep(0.1)
            assert rt.lifecycle("emb")["load_failures"] == {"1": 1}  # no retry of the same file
            rev3 = _write_model(model, 3.0, in_place=False)  # the watcher still looks
            await until(rt, lambda v: [x["revision"] for x in v["versions"]] == [rev3],
                        "revision 3")
            assert await served(rt) == 3.0
            os.utime(model)  # touched, same content: nothing reloads
            await asyncio.sleep(0.15)
            assert [e["event"] for e in rt.lifecycle("emb")["events"]].count("ready") == 3
    asyncio.run(main())


def test_wait_stable_waits_for_the_writer(tmp_path):
    path = tmp_path / "growing.bin"
    path.write_bytes(b"")
    done = threading.Event()

    def writer():
        with open(path, "ab") as fh:
            for _ in range(8):
                fh.write(b"x" * 1000)
                fh.flush()
                time.sleep(0.03)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    st = wait_stable(str(path), quiet_s=0.1)
    assert done.is_set() and st == file_state(str(path)) and st[0] == 8000
    t.join()
    assert wait_stable(str(tmp_path / "none"), quiet_s=0.01) is None


def test_stateful_swap_keeps_open_sequences_on_their_version(tmp_path, monkeypatch):
    """A swap of a stateful task's model: sequences open on the old version finish there
    (their state intact), new ones start on the new version, and the old one unloads once
    the last of its sequences ended."""
    from batching import test_sequence as TS

    from lumen_core import tasks

    monkeypatch.setitem(tasks.BACKENDS, "accumulator", "batching.test_sequence:AccumulatorBackend")
    acc = TS.accumulator_model(tmp_path / "acc.onnx")
    cfg = TS.config(acc, max_batch_size=32)  # a slot for every sequence
    x = np.ones(TS.D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            rt._lifecycle.quiet_s = QUIET_S
            old = rt.tasks["acc"]
            await asyncio.gather(*(rt.infer(TS.req(s, x, start=True)) for s in range(16)))
            pathlib.Path(acc).write_bytes(pathlib.Path(acc).read_bytes())  # same content
            assert [e["event"] for e in (await rt.reload("acc"))["events"]].count("ready") == 1
            m = onnx.load(acc)
            m.doc_string = "revision 2"
            onnx.save(m, acc)
            reload = asyncio.ensure_future(rt.reload("acc"))
            for _ in range(400):
                if rt.tasks["acc"] is not old:
                    break
                await asyncio.sleep(0.01)
            new = rt.tasks["acc"]
            assert new is not old and new.router is not None  # old drains: it still routes
            assert not reload.done()  # waiting for the old version's sequences
            # open sequences continue on the old version, state intact; new ones start anew
            mid = await asyncio.gather(*(rt.infer(TS.req(s, x)) for s in range(16)))
            assert all(float(r.outputs["y"].reshape(-1)[0]) == 2.0 for r in mid)
            fresh = await rt.infer(TS.req(100, x, start=True))
            assert float(fresh.outputs["y"].reshape(-1)[0]) == 1.0
            assert new.batcher.holds_sequence("100") and not old.batcher.holds_sequence("100")
            ends = await asyncio.gather(*(rt.infer(TS.req(s, x, end=True)) for s in range(16)))
            assert all(float(r.outputs["y"].reshape(-1)[0]) == 3.0 for r in ends)
            view = await asyncio.wait_for(reload, 30)
            assert [v["state"] for v in view["versions"]] == [READY]
            assert rt.tasks["acc"].router is None
            r = await rt.infer(TS.req(100, x, end=True))
            assert float(r.outputs["y"].reshape(-1)[0]) == 2.0
    asyncio.run(main())


def test_watch_keeps_a_version_the_admin_api_loaded(tmp_path):
    """Issue 26 row 6: under --watch, a version loaded through the admin API stays: the new
    model path entering the watch is no file change (it used to reload the config ~1 tick
    later and drop the version); its own file changing reloads it in place; a touch of the
    config (same content) changes nothing; a real config change wins and drops it."""
    v1, v2 = tmp_path / "v1.onnx", tmp_path / "v2.onnx"
    _write_model(v1, 1.0, in_place=False)
    _write_model(v2, 2.0, in_place=False)
    cfg = tmp_path / "lumen.toml"
    _toml(cfg, {"1": v1})
    ticks = 0.02

    async def until(rt, cond, what):
        for _ in range(400):
            if cond(rt.lifecycle("emb")):
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"timed out waiting for {what}: {rt.lifecycle('emb')}")

    def versions(view):
        return sorted(v["version"] for v in view["versions"])

    async def main():
        async with lc.Runtime.from_config(str(cfg)) as rt:
            rt._lifecycle.quiet_s = QUIET_S
            rt.watch(ticks)
            await rt.load_version("emb", "2", str(v2))
            await asyncio.sleep(10 * ticks)
            assert versions(rt.lifecycle("emb")) == ["1", "2"]
            assert (await rt.infer(_req())).meta["lumen.model.version"] == "2"
            rev3 = _write_model(v2, 3.0, in_place=False)  # its file changes: reloaded, kept
            # the old revision drains (listed as draining) before it is unloaded
            await until(rt, lambda v: any(x["revision"] == rev3 for x in v["versions"])
                        and versions(v) == ["1", "2"], "version 2's new revision, alone")
            assert float((await rt.infer(_req())).outputs["y"].reshape(-1)[0]) == 3.0
            os.utime(cfg)  # touched, same content: no re-read
            await asyncio.sleep(10 * ticks)
            assert versions(rt.lifecycle("emb")) == ["1", "2"]
            _toml(cfg, {"1": v1}, traffic={"1": 100})  # the config changes: it wins
            await until(rt, lambda v: versions(v) == ["1"], "the config's versions")
    asyncio.run(main())

"""Sequence batcher: state hand-over, control inputs, lifecycle errors, backlog, cancellation.

The model is a generated accumulator: ``acc_out = acc_in + x`` over an implicit state
``[2, N, 4]`` (batch axis 1, so gather/scatter along a non-leading axis is exercised), output
``y = acc_out[0]``, and the START / END / READY / CORRID controls echoed as outputs.  After k
requests of a sequence, ``y`` must be the running sum of its inputs since its start.
"""
from __future__ import annotations

import asyncio
import threading
import time
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lumen_core as lc
from lumen_core import tasks
from lumen_core.batching.sequence import SequenceBatcher
from lumen_core.config import BatchingConfig, SequenceConfig, parse_task
from lumen_core.contract import TensorContract, TensorSpec
from lumen_core.engine.plan import DenseInput, ModelSpec, OutputSpec, PreparedModelRequest
from lumen_core.engine.state import SequenceBatch, check_model_io, sequence_plans
from lumen_core.errors import ConfigError
from lumen_core.tasks.base import TaskBackend, split_outputs

D = 4
OPSET = 17
STRATEGIES = ("direct", "oldest")


def accumulator_model(path, corrid_type: int = TensorProto.UINT64) -> str:
    """``acc_out = acc_in + x`` ([2, N, D], batch axis 1); controls echoed as outputs."""
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axis0"], ["x3"]),
        helper.make_node("Add", ["acc_in", "x3"], ["acc_out"]),
        helper.make_node("Gather", ["acc_out", "zero"], ["y"], axis=0),
        helper.make_node("Identity", ["START"], ["start_out"]),
        helper.make_node("Identity", ["END"], ["end_out"]),
        helper.make_node("Identity", ["READY"], ["ready_out"]),
        helper.make_node("Identity", ["CORRID"], ["corrid_out"]),
    ]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array(0, np.int64), "zero")]
    graph = helper.make_graph(
        nodes, "accumulator",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", D]),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2, "N", D]),
         helper.make_tensor_value_info("START", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("END", TensorProto.INT32, ["N"]),
         helper.make_tensor_value_info("READY", TensorProto.BOOL, ["N"]),
         helper.make_tensor_value_info("CORRID", corrid_type, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", D]),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2, "N", D]),
         helper.make_tensor_value_info("start_out", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("end_out", TensorProto.INT32, ["N"]),
         helper.make_tensor_value_info("ready_out", TensorProto.BOOL, ["N"]),
         helper.make_tensor_value_info("corrid_out", corrid_type, ["N"])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


class AccumulatorBackend(TaskBackend):
    """A minimal stateful backend: tensor route fp32 [1, D]; state/controls from the config."""

    stateful = True

    def load(self) -> ModelSpec:
        from lumen_core.engine.session import read_io

        cfg = self.config
        ins, outs = read_io(cfg.model)
        plans = sequence_plans(cfg.sequence, cfg.source, cfg.key)
        check_model_io(plans, [i[0] for i in ins], [o[0] for o in outs], cfg.source, cfg.key)
        self.contract = TensorContract(
            specs=(TensorSpec("fp32", "NC", frozenset({"none"}), ((1, 1), (D, D))),),
            model_id="acc", model_version="1")
        outputs = [OutputSpec("y", np.float32, (D,)), OutputSpec("acc_out", np.float32, None)]
        outputs += [OutputSpec(n, None, None) for n in ("start_out", "end_out", "ready_out",
                                                        "corrid_out")]
        self.model = ModelSpec(cfg.model, [DenseInput("x", np.float32)] + plans, outputs)
        return self.model

    def prepare_tensor(self, req, desc, payload) -> PreparedModelRequest:
        return PreparedModelRequest(("acc",), (payload,), (D,))

    def postprocess(self, outputs: dict, items) -> list:
        keep = {k: v for k, v in outputs.items() if k != "acc_out"}
        return split_outputs(keep, len(items))


@pytest.fixture(autouse=True)
def _register(monkeypatch):
    monkeypatch.setitem(tasks.BACKENDS, "accumulator", f"{__name__}:AccumulatorBackend")


@pytest.fixture(scope="module")
def acc_path(tmp_path_factory):
    return accumulator_model(tmp_path_factory.mktemp("seq") / "acc.onnx")


CONTROLS = [{"input_name": "START", "kind": "START", "dtype": "fp32"},
            {"input_name": "END", "kind": "END", "dtype": "int32"},
            {"input_name": "READY", "kind": "READY", "dtype": "bool"},
            {"input_name": "CORRID", "kind": "CORRID", "dtype": "uint64"}]


def config(path, strategy="direct", max_batch_size=8, max_queue_size=256, idle_us=10_000_000,
           candidates=0, delay_us=0, instances=1, corrid="uint64", initial="zeros",
           util=1.0) -> dict:
    controls = [dict(c) for c in CONTROLS]
    controls[3]["dtype"] = corrid
    seq = {"strategy": strategy, "max_sequence_idle_us": idle_us,
           "max_queue_delay_us": delay_us, "minimum_slot_utilization": util,
           "state": [{"input_name": "acc_in", "output_name": "acc_out", "dtype": "fp32",
                      "dims": [2, D], "batch_axis": 1, "initial": initial}],
           "control": controls}
    if candidates:
        seq["max_candidate_sequences"] = candidates
    return {"tasks": [{"name": "acc", "backend": "accumulator", "model": str(path),
                       "instances": instances, "intra_op_threads": 1,
                       "batching": {"max_batch_size": max_batch_size,
                                    "max_queue_size": max_queue_size},
                       "sequence": seq}]}


def req(sid, x, start=False, end=False, **meta) -> lc.InferRequest:
    b = lc.new_infer_request("acc").for_tensor_array(
        np.asarray(x, np.float32).reshape(1, D), layout="NC", preprocess_id="none")
    if sid is not None:
        b.with_meta("lumen.sequence.id", str(sid))
    if start:
        b.with_meta("lumen.sequence.start", "true")
    if end:
        b.with_meta("lumen.sequence.end", "true")
    for k, v in meta.items():
        b.with_meta(k, v)
    return b.build()


def run(coro):
    return asyncio.run(coro)


def batcher(rt):
    return rt.tasks["acc"].batcher


# ----------------------------------------------------------------------------- hand-over
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_handover_and_controls_interleaved(acc_path, strategy):
    n_seq, steps = 24, 6
    xs = np.random.default_rng(3).standard_normal((n_seq, steps, D)).astype(np.float32)
    cfg = config(acc_path, strategy, max_batch_size=8, candidates=32 if strategy == "oldest" else 0)

    async def stream(rt, k):
        out = []
        for t in range(steps):
            out.append(await rt.infer(req(1000 + k, xs[k, t], start=t == 0, end=t == steps - 1)))
            await asyncio.sleep(0)
        return out

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            res = await asyncio.gather(*[stream(rt, k) for k in range(n_seq)])
            assert batcher(rt).active_sequences == 0  # every sequence ended
            return res

    res = run(main())
    sizes = []
    for k in range(n_seq):
        np.testing.assert_allclose([r.outputs["y"] for r in res[k]], np.cumsum(xs[k], axis=0),
                                   rtol=1e-6, atol=1e-6)
        assert [float(r.outputs["start_out"]) for r in res[k]] == [1.0] + [0.0] * (steps - 1)
        assert [int(r.outputs["end_out"]) for r in res[k]] == [0] * (steps - 1) + [1]
        assert all(bool(r.outputs["ready_out"]) for r in res[k])
        assert {int(r.outputs["corrid_out"]) for r in res[k]} == {1000 + k}
        assert res[k][0].outputs["corrid_out"].dtype == np.uint64
        sizes += [int(r.meta["lumen.batch.size"]) for r in res[k]]
    assert max(sizes) > 1 and max(sizes) <= 8  # batched, never past max_batch_size


def test_oldest_batches_at_most_max_batch_from_more_candidates(acc_path):
    cfg = config(acc_path, "oldest", max_batch_size=3, candidates=12)
    xs = np.arange(12 * D, dtype=np.float32).reshape(12, D)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            starts = await asyncio.gather(*[rt.infer(req(k, xs[k], start=True)) for k in range(12)])
            assert batcher(rt).active_sequences == 12 and batcher(rt).backlog == 0
            seconds = await asyncio.gather(*[rt.infer(req(k, xs[k], end=True)) for k in range(12)])
            return starts, seconds

    starts, seconds = run(main())
    for k in range(12):
        np.testing.assert_allclose(seconds[k].outputs["y"], 2 * xs[k])
    assert max(int(r.meta["lumen.batch.size"]) for r in starts + seconds) == 3


def test_two_instances_keep_each_sequence_on_its_lane(acc_path):
    cfg = config(acc_path, "direct", max_batch_size=4, instances=2)
    xs = np.random.default_rng(4).standard_normal((8, 5, D)).astype(np.float32)

    async def stream(rt, k):
        return [await rt.infer(req(k, xs[k, t], start=t == 0, end=t == 4)) for t in range(5)]

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            return await asyncio.gather(*[stream(rt, k) for k in range(8)])

    for k, rs in enumerate(run(main())):
        np.testing.assert_allclose([r.outputs["y"] for r in rs], np.cumsum(xs[k], 0), atol=1e-6)


def test_initial_state_from_npy_file(acc_path, tmp_path):
    init = np.arange(2 * D, dtype=np.float32).reshape(2, D)
    np.save(tmp_path / "init.npy", init)
    cfg = config(acc_path, initial=str(tmp_path / "init.npy"))
    x = np.ones(D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            a = await rt.infer(req(1, x, start=True))
            b = await rt.infer(req(1, x, start=True))  # restart: back to the file's state
            return a, b

    a, b = run(main())
    np.testing.assert_allclose(a.outputs["y"], init[0] + 1)
    np.testing.assert_allclose(b.outputs["y"], init[0] + 1)


def test_string_corrid(acc_path, tmp_path):
    path = accumulator_model(tmp_path / "acc_str.onnx", TensorProto.STRING)
    cfg = config(path, corrid="string")

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            return await rt.infer(req("stream-α", np.zeros(D), start=True))

    assert run(main()).outputs["corrid_out"] == "stream-α"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("util, waits", [(1.0, True), (0.5, False)])
def test_lane_waits_for_its_sequences_up_to_the_delay(acc_path, strategy, util, waits):
    cfg = config(acc_path, strategy, max_batch_size=4, delay_us=2_000_000, util=util)
    x = np.ones(D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            # two sequences; the first start runs alone (only one sequence exists yet)
            await rt.infer(req(1, x, start=True))
            await asyncio.gather(rt.infer(req(2, x, start=True)), rt.infer(req(1, x)))
            first = asyncio.ensure_future(rt.infer(req(1, x)))
            await asyncio.sleep(0.05)
            early = first.done()
            second = await rt.infer(req(2, x))
            return early, await first, second

    early, first, second = run(main())
    assert early is not waits
    assert int(first.meta["lumen.batch.size"]) == (2 if waits else 1)
    np.testing.assert_allclose(first.outputs["y"], 3 * x)
    np.testing.assert_allclose(second.outputs["y"], 2 * x)


# ----------------------------------------------------------------------------- errors
def _error(cfg, *requests):
    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            for r in requests[:-1]:
                await rt.infer(r)
            with pytest.raises(lc.LumenError) as ei:
                await rt.infer(requests[-1])
            return ei.value

    return run(main())


def test_missing_sequence_id(acc_path):
    err = _error(config(acc_path), req(None, np.zeros(D)))
    assert isinstance(err, lc.InvalidArgument) and err.field == "lumen.sequence.id"


def test_unknown_sequence_without_start(acc_path):
    err = _error(config(acc_path), req(7, np.zeros(D)))
    assert isinstance(err, lc.InvalidArgument) and err.field == "lumen.sequence.start"
    assert "unknown sequence '7'" in err.message


def test_integer_corrid_needs_an_integer_id(acc_path):
    err = _error(config(acc_path), req("abc", np.zeros(D), start=True))
    assert isinstance(err, lc.InvalidArgument) and err.field == "lumen.sequence.id"
    assert "uint64" in err.message


def test_idle_timeout_frees_slot_and_names_the_timeout(acc_path):
    cfg = config(acc_path, max_batch_size=1, idle_us=20_000)
    x = np.ones(D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            await rt.infer(req(1, x, start=True))
            assert batcher(rt).active_sequences == 1
            for _ in range(100):  # the sweep runs every idle/4; give it ample time
                await asyncio.sleep(0.01)
                if batcher(rt).active_sequences == 0:
                    break
            assert batcher(rt).active_sequences == 0
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(req(1, x))
            # the only slot is free again: another sequence runs, and a restart starts at zero
            await rt.infer(req(2, x, start=True, end=True))
            again = await rt.infer(req(1, x, start=True))
            return ei.value, again

    err, again = run(main())
    assert err.field == "lumen.sequence.id" and "max_sequence_idle_us" in err.message
    np.testing.assert_allclose(again.outputs["y"], x)


def test_end_then_restart_and_restart_of_active_id(acc_path):
    x = np.full(D, 2.0, np.float32)

    async def main():
        async with lc.Runtime.from_dict(config(acc_path)) as rt:
            await rt.infer(req(5, x, start=True))
            await rt.infer(req(5, x, end=True))
            with pytest.raises(lc.InvalidArgument) as ended:
                await rt.infer(req(5, x))
            first = await rt.infer(req(5, x, start=True))  # a new sequence on the ended id
            second = await rt.infer(req(5, x))
            restarted = await rt.infer(req(5, x, start=True))  # start on an active id
            return ended.value, first, second, restarted

    ended, first, second, restarted = run(main())
    assert "has ended" in ended.message
    np.testing.assert_allclose(first.outputs["y"], x)
    np.testing.assert_allclose(second.outputs["y"], 2 * x)
    np.testing.assert_allclose(restarted.outputs["y"], x)
    assert float(restarted.outputs["start_out"]) == 1.0


def test_request_after_accepted_end_is_refused(acc_path):
    x = np.ones(D, np.float32)
    err = _error(config(acc_path), req(3, x, start=True, end=True), req(3, x))
    assert isinstance(err, lc.InvalidArgument) and "has ended" in err.message


# ----------------------------------------------------------------------------- backlog, cancel
def test_backlog_waits_for_a_slot_and_is_bounded(acc_path):
    cfg = config(acc_path, max_batch_size=2, max_queue_size=2)
    x = np.ones(D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            b = batcher(rt)
            await rt.infer(req(1, x, start=True))
            await rt.infer(req(2, x, start=True))
            c1 = asyncio.ensure_future(rt.infer(req(3, x, start=True)))
            c2 = asyncio.ensure_future(rt.infer(req(3, 2 * x)))
            await asyncio.sleep(0.05)
            assert not c1.done() and b.backlog == 1 and b.pending == 2
            with pytest.raises(lc.Overloaded):  # the backlog counts against max_queue_size
                await rt.infer(req(4, x, start=True))
            await rt.infer(req(1, x, end=True))  # frees a slot: sequence 3 moves in
            r1, r2 = await asyncio.gather(c1, c2)
            assert b.backlog == 0 and b.active_sequences == 2
            return r1, r2

    r1, r2 = run(main())
    np.testing.assert_allclose(r1.outputs["y"], x)
    np.testing.assert_allclose(r2.outputs["y"], 3 * x)
    assert float(r1.outputs["start_out"]) == 1.0


def test_cancel_and_deadline_of_waiting_requests_keep_the_sequence_intact(acc_path):
    cfg = config(acc_path, max_batch_size=1)
    x = np.arange(1, D + 1, dtype=np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            await rt.infer(req(1, x, start=True))  # holds the only slot
            # sequence 2 waits in the backlog: its start, then three more requests
            s1 = asyncio.ensure_future(rt.infer(req(2, 10 * x, start=True)))
            s2 = asyncio.ensure_future(rt.infer(req(2, 100 * x)))
            s3 = asyncio.ensure_future(rt.infer(req(2, 1000 * x, **{"lumen.timeout_ms": "20"})))
            s4 = asyncio.ensure_future(rt.infer(req(2, 10000 * x)))
            await asyncio.sleep(0.01)
            s1.cancel()  # the start itself goes away: the next request still starts fresh
            await asyncio.sleep(0.05)  # s3's deadline expires in the backlog
            assert batcher(rt).pending == 2
            await rt.infer(req(1, x, end=True))
            with pytest.raises(asyncio.CancelledError):
                await s1
            with pytest.raises(lc.DeadlineExceeded):
                await s3
            return await s2, await s4

    r2, r4 = run(main())
    np.testing.assert_allclose(r2.outputs["y"], 100 * x)
    assert float(r2.outputs["start_out"]) == 1.0
    np.testing.assert_allclose(r4.outputs["y"], 10100 * x)


def test_cancelled_end_reopens_the_sequence(acc_path):
    cfg = config(acc_path, max_batch_size=1)
    x = np.ones(D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            await rt.infer(req(1, x, start=True))
            w1 = asyncio.ensure_future(rt.infer(req(2, x, start=True)))
            w2 = asyncio.ensure_future(rt.infer(req(2, x, end=True)))
            await asyncio.sleep(0.01)
            w2.cancel()
            await asyncio.sleep(0)
            more = asyncio.ensure_future(rt.infer(req(2, x)))  # accepted: the end never ran
            await rt.infer(req(1, x, end=True))
            await w1
            return await more

    np.testing.assert_allclose(run(main()).outputs["y"], 2 * np.ones(D))


def test_drain_finishes_backlogged_work(acc_path):
    # the slot holder goes idle; draining keeps sweeping, so the backlogged sequence still runs
    cfg = config(acc_path, max_batch_size=1, idle_us=30_000)
    x = np.ones(D, np.float32)

    async def main():
        rt = lc.Runtime.from_dict(cfg)
        await rt.start()
        await rt.infer(req(1, x, start=True))
        waiting = asyncio.ensure_future(rt.infer(req(2, x, start=True, end=True)))
        await asyncio.sleep(0.005)
        assert batcher(rt).backlog == 1
        await rt.stop()
        assert waiting.done()
        return await waiting

    np.testing.assert_allclose(run(main()).outputs["y"], x)


# ----------------------------------------------------------------------------- units, config
def test_sequence_batch_slices_stay_aligned():
    items = [object() for _ in range(5)]
    b = SequenceBatch(items, np.arange(10, 15), np.array([1, 0, 0, 1, 0], bool),
                      np.zeros(5, bool), [1, 2, 3, 4, 5], store=None)
    half = b[2:]
    assert list(half) == items[2:] and half.slots.tolist() == [12, 13, 14]
    assert half.start.tolist() == [False, True, False] and half.corrid == [3, 4, 5]
    assert b[0] is items[0] and half.feeds == {}


@pytest.mark.parametrize("patch, key", [
    ({"strategy": "fifo"}, "sequence.strategy"),
    ({"max_sequence_idle_us": 5}, "sequence.max_sequence_idle_us"),
    ({"strategy": "oldest", "max_candidate_sequences": 2}, "sequence.max_candidate_sequences"),
    ({"bogus": 1}, "sequence.bogus"),
    ({"minimum_slot_utilization": 0}, "sequence.minimum_slot_utilization"),
    ({"minimum_slot_utilization": "half"}, "sequence.minimum_slot_utilization"),
    ({"state": [{"output_name": "o", "dims": [2]}]}, "sequence.state[0].input_name"),
    ({"state": [{"input_name": "i", "output_name": "o", "dims": [-1]}]}, "sequence.state[0].dims"),
    ({"state": [{"input_name": "i", "output_name": "o", "dims": [2], "batch_axis": 2}]},
     "sequence.state[0].batch_axis"),
    ({"state": [{"input_name": "i", "output_name": "o", "dims": [2], "initial": "nope.npy"}]},
     "sequence.state[0].initial"),
    ({"control": [{"input_name": "S", "kind": "START", "dtype": "uint64"}]},
     "sequence.control[0].dtype"),
    ({"control": [{"input_name": "C", "kind": "CORRID", "dtype": "fp32"}]},
     "sequence.control[0].dtype"),
    ({"control": [{"input_name": "S", "kind": "BEGIN", "dtype": "fp32"}]},
     "sequence.control[0].kind"),
    ({"control": [{"input_name": "S", "kind": "START", "dtype": "fp32"},
                  {"input_name": "S2", "kind": "START", "dtype": "fp32"}]}, "sequence.control"),
    ({"constant": [{"input_name": "sr", "dtype": "int64"}]}, "sequence.constant[0].value"),
    ({"constant": [{"input_name": "sr", "dtype": "int64", "dims": [2], "value": [1, 2, 3]}]},
     "sequence.constant[0].value"),
    ({"state": [{"input_name": "x", "output_name": "o", "dims": [1]}],
      "constant": [{"input_name": "x", "dtype": "int64", "value": 1}]},
     "sequence.constant[0].input_name"),
])
def test_config_errors_name_the_key(patch, key):
    table = {"name": "t", "backend": "accumulator", "batching": {"max_batch_size": 4},
             "sequence": patch}
    with pytest.raises(ConfigError) as ei:
        parse_task(table, "lumen.toml", "tasks[0]")
    assert ei.value.source == "lumen.toml" and ei.value.key == f"tasks[0].{key}"


@pytest.mark.parametrize("name", ["max_queue_delay_us", "preferred_batch_sizes",
                                  "priority_levels", "default_priority_level"])
def test_batching_keys_a_stateful_task_ignores_are_config_errors(name):
    value = [2] if name == "preferred_batch_sizes" else 1
    table = {"name": "t", "backend": "accumulator",
             "batching": {"max_batch_size": 4, name: value}, "sequence": {}}
    with pytest.raises(ConfigError) as ei:
        parse_task(table, "lumen.toml", "tasks[0]")
    assert ei.value.key == f"tasks[0].batching.{name}" and "stateful" in ei.value.problem


def test_constant_config_parses_scalar_and_broadcast():
    tc = parse_task({"name": "t", "backend": "vad", "sequence": {"constant": [
        {"input_name": "sr", "dtype": "int64", "value": 16000},
        {"input_name": "w", "dtype": "fp32", "dims": [3], "value": 0.5}]}})
    sr, w = tc.sequence.constant
    assert sr.value.dtype == np.int64 and sr.value.shape == () and int(sr.value) == 16000
    assert w.value.tolist() == [0.5, 0.5, 0.5]


def test_model_lacking_a_declared_input_is_a_config_error(acc_path):
    cfg = config(acc_path)
    cfg["tasks"][0]["sequence"]["state"][0]["input_name"] = "acc_typo"

    async def main():
        async with lc.Runtime.from_dict(cfg):
            pass

    with pytest.raises(ConfigError) as ei:
        run(main())
    assert "acc_typo" in str(ei.value) and ei.value.key == "tasks[0].sequence"


class FailingAccumulatorBackend(AccumulatorBackend):
    """The accumulator whose run fails for any request with a NaN in ``x`` (fault injection)."""

    def postprocess(self, outputs: dict, items) -> list:
        if any(np.isnan(np.frombuffer(it.tensors[0], np.float32)).any() for it in items):
            raise RuntimeError("poisoned input")
        return super().postprocess(outputs, items)


def test_failed_start_leaves_the_next_request_on_the_initial_state(acc_path, monkeypatch):
    # The slot still holds the previous sequence's final state; a sequence whose start request
    # fails in the model must not inherit it: its next request begins from the initial state.
    monkeypatch.setitem(tasks.BACKENDS, "failing_acc", f"{__name__}:FailingAccumulatorBackend")
    cfg = config(acc_path, max_batch_size=1)
    cfg["tasks"][0]["backend"] = "failing_acc"
    x = np.ones(D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            await rt.infer(req(1, 5 * x, start=True))
            await rt.infer(req(1, 5 * x, end=True))  # slot 0 now holds 10 * x
            with pytest.raises(lc.InternalError):
                await rt.infer(req(2, np.full(D, np.nan, np.float32), start=True))
            return await rt.infer(req(2, x))

    r = run(main())
    np.testing.assert_allclose(r.outputs["y"], x)
    assert float(r.outputs["start_out"]) == 1.0


def test_cancelled_restart_after_an_end_leaves_the_sequence_ended(acc_path):
    # end, then a restart of the same id that goes away: the sequence stays ended, so a
    # request without start is refused instead of continuing the ended sequence's state
    cfg = config(acc_path, max_batch_size=1)
    x = np.ones(D, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            await rt.infer(req(1, x, start=True))
            # hold the engine while the end runs, so the restart is surely still queued when
            # it is cancelled (a worker forms its next batch the moment one finishes: without
            # the gate the restart could already be running, and then it rightly restarts)
            gate = threading.Event()
            engine = rt.tasks["acc"].instances[0]
            run_engine = engine.run

            def held(feeds, n):
                gate.wait(30)
                return run_engine(feeds, n)

            engine.run = held
            end = asyncio.ensure_future(rt.infer(req(1, x, end=True)))
            restart = asyncio.ensure_future(rt.infer(req(1, x, start=True)))
            # the end runs (held at the gate); the restart waits behind it.  Both are queued
            # first: wait for the worker to take the end, not just for both to arrive
            waited = 0.0
            while not (batcher(rt).in_flight == 1 and batcher(rt).pending == 1):
                assert waited < 10, (batcher(rt).in_flight, batcher(rt).pending)
                await asyncio.sleep(0.001)
                waited += 0.001
            restart.cancel()
            await asyncio.sleep(0)
            gate.set()
            await end
            engine.run = run_engine
            with pytest.raises(asyncio.CancelledError):
                await restart
            with pytest.raises(lc.InvalidArgument, match="ended"):
                await rt.infer(req(1, x))
            assert batcher(rt).active_sequences == 0  # the slot is free again

    run(main())


# ------------------------------------------- review findings (worker-side formation, round 2)
class _Runner:
    """A stateless runner for the bare sequence batcher: returns each item's tag."""

    spec = types.SimpleNamespace(inputs=[])

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.ran: list = []

    def execute(self, items):
        self.ran.append([it.tag for it in items])
        if self.delay_s:
            time.sleep(self.delay_s)
        return [it.tag for it in items]


class _Tagged:
    signature = ("s",)

    def __init__(self, tag):
        self.tag = tag


def _desc(sid, start=False, end=False):
    return types.SimpleNamespace(sequence_id=sid, sequence_start=start, sequence_end=end)


def test_a_request_past_its_deadline_never_runs_even_when_its_timer_is_late():
    async def main():
        r = _Runner(delay_s=0.1)
        b = SequenceBatcher("t", BatchingConfig(max_batch_size=1), SequenceConfig(), [r])
        first = b.submit(_Tagged("A"), _desc("1", start=True))  # runs 100 ms
        await asyncio.sleep(0.01)
        late = b.submit(_Tagged("B"), _desc("1"), timeout_ms=20)
        time.sleep(0.15)  # the loop is busy: the 20 ms timer cannot fire
        with pytest.raises(lc.DeadlineExceeded, match="in the queue"):
            await late.waiter
        assert await first.waiter == "A"
        await b.drain()
        await b.close()
        return r.ran

    assert asyncio.run(main()) == [["A"]]


def test_a_refused_group_leaves_no_sequence_behind():
    async def main():
        b = SequenceBatcher("t", BatchingConfig(max_batch_size=2), SequenceConfig(), [_Runner()])
        with pytest.raises(lc.InvalidArgument, match="unknown sequence 'Y'"):
            b.submit_many([(_Tagged("x0"), _desc("X", start=True), 1, 0),
                           (_Tagged("y"), _desc("Y"), 1, 0)])
        assert (b.active_sequences, b.pending, b.backlog) == (0, 0, 0)
        with pytest.raises(lc.InvalidArgument, match="unknown sequence 'X'"):
            b.submit(_Tagged("x1"), _desc("X"))  # X never began
        group, entries = b.submit_many([])
        assert group.future.done() and entries == []
        await b.close()

    asyncio.run(main())


def test_close_without_drain_answers_what_is_still_queued():
    async def main():
        cfg = SequenceConfig(max_queue_delay_us=10_000_000, minimum_slot_utilization=1.0)
        b = SequenceBatcher("t", BatchingConfig(max_batch_size=4), cfg, [_Runner()])
        first = [b.submit(_Tagged(s), _desc(s, start=True)) for s in ("1", "2")]
        assert [await e.waiter for e in first] == ["1", "2"]  # both hold a slot now
        a = b.submit(_Tagged("a"), _desc("1"))  # one of two streams ready: the lane waits
        await asyncio.sleep(0.01)
        await b.close()
        with pytest.raises(lc.Unavailable):
            await a.waiter
        assert b.pending == 0

    asyncio.run(main())

"""The one engine protocol: CPU instances run assembled batches and return every output.

Silero's state output ``stateN`` is ``[2, N, 128]`` (batch axis 1): it is declared with its
batch axis and scattered into the sequences' slots once.  A CPU instance runs with
``InferenceSession.run`` (no IO binding: see ``engine/ort.py``), so every output is a fresh
array and views that callers keep of an earlier batch stay valid.
"""
from __future__ import annotations

import asyncio

import numpy as np
import onnx_models as M
import pytest

import lumen_core as lc
from lumen_core import models
from lumen_core.batching.runner import BatchRunner
from lumen_core.engine.base import output_shape
from lumen_core.engine.ort import CpuEngineInstance, make_instances
from lumen_core.engine.plan import DenseInput, ModelSpec, OutputSpec, PreparedModelRequest
from lumen_core.tasks import vad


@pytest.fixture(scope="module")
def silero_path(tmp_path_factory) -> str:
    h = tmp_path_factory.mktemp("lumen_home")
    models.prepare(names=[models.SILERO_VAD], home=h)
    return str(models.model_dir(models.SILERO_VAD, h) / models.MODEL_FILE)


def test_output_shape_puts_the_batch_at_its_axis():
    assert output_shape(OutputSpec("y", np.float32, (384,)), 7) == (7, 384)
    assert output_shape(OutputSpec("stateN", np.float32, (2, 128), 1), 7) == (2, 7, 128)
    with pytest.raises(ValueError, match="batch_axis 3"):
        OutputSpec("bad", np.float32, (2, 128), 3)


def test_silero_state_rides_the_run_and_earlier_outputs_stay_valid(silero_path, fixtures_dir):
    cfg = {"tasks": [{"name": "vad", "backend": "vad", "model": silero_path,
                      "intra_op_threads": 1, "batching": {"max_batch_size": 8}}]}
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    audio, probs = ref["audio"].astype(np.float32), ref["probs"]
    steps = 20

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            task = rt.tasks["vad"]
            engine = task.instances[0]
            state = [o for o in engine.spec.outputs if o.name == vad.STATE_OUTPUT]
            assert state and state[0].item_shape == vad.STATE_DIMS
            assert state[0].batch_axis == vad.STATE_BATCH_AXIS
            got = np.zeros((len(audio), steps), np.float32)
            first: list = []

            async def stream(k):
                for c in range(steps):
                    meta = {"lumen.sequence.id": f"s{k}"}
                    if c == 0:
                        meta["lumen.sequence.start"] = "true"
                    chunk = audio[k, c * vad.CHUNK_SAMPLES:(c + 1) * vad.CHUNK_SAMPLES]
                    r = await rt.infer(lc.InferRequest("vad", chunk.astype("<f4").tobytes(),
                                                       "audio/pcm;format=f32le;rate=16000", meta))
                    got[k, c] = r.outputs["speech_prob"][0]
                    if c == 0:
                        first.append((k, r.outputs["speech_prob"]))  # a view of its batch

            await asyncio.gather(*[stream(k) for k in range(len(audio))])
            assert engine.stats["batches"] >= steps
            return got, first

    got, first = asyncio.run(main())
    np.testing.assert_allclose(got, probs[:, :steps], atol=1e-4)
    for k, view in first:  # 19 later batches ran: the first batch's outputs are untouched
        np.testing.assert_allclose(view[0], probs[k, 0], atol=1e-4)


def test_runner_composes_assemble_run_postprocess(tmp_path):
    path = M.mlp(tmp_path / "mlp.onnx")
    spec = ModelSpec(path, [DenseInput("x", np.float32)], [OutputSpec("y", np.float32, (8,))])
    (engine,) = make_instances(spec, "t", "cpu", 1, 1, None)
    assert isinstance(engine, CpuEngineInstance)
    calls = []

    def post(outputs, items):
        calls.append(len(items))
        return [outputs["y"][i] for i in range(len(items))]

    runner = BatchRunner(engine, post)
    xs = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    items = [PreparedModelRequest(("s",), (xs[i],), (16,)) for i in range(5)]
    out = runner.execute(items)
    np.testing.assert_allclose(np.stack(out), M.mlp_reference(xs), atol=1e-5)
    assert calls == [5] and engine.stats == {"batches": 1, "items": 5}
    runner.close()


def test_a_declared_output_the_model_lacks_fails_at_load(tmp_path):
    path = M.mlp(tmp_path / "mlp.onnx")
    spec = ModelSpec(path, [DenseInput("x", np.float32)], [OutputSpec("nope", np.float32, (8,))])
    with pytest.raises(lc.InternalError, match="no output"):
        make_instances(spec, "t", "cpu", 1, 1, None)

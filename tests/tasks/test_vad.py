"""The ``vad`` task on Silero VAD v5: per-stream equality with the reference while dozens of
streams run interleaved and batched, through every route; input validation; default task.

Silero is prepared once per module into a temporary LUMEN_HOME (a file copy + one check run).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import lumen_core as lc
from lumen_core import models
from lumen_core.engine.session import cpu_session
from lumen_core.models import silero
from lumen_core.tasks import vad

TOLERANCE = 1e-4
CHUNK = vad.CHUNK_SAMPLES
STREAMS_PER_REFERENCE = 12  # 3 reference streams x 12 = 36 concurrent sequences
L16 = "audio/L16;rate=16000"
F32 = "audio/pcm;format=f32le;rate=16000"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("lumen_home")
    models.prepare(names=[models.SILERO_VAD], home=h)
    return h


@pytest.fixture(scope="module")
def model_path(home) -> str:
    return str(models.model_dir(models.SILERO_VAD, home) / models.MODEL_FILE)


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    return ref["audio"].astype(np.float32), ref["probs"]


def vad_config(model_path, strategy="direct", max_batch_size=16, **seq) -> dict:
    seq = {"strategy": strategy, **seq}
    if strategy == "oldest":
        seq.setdefault("max_candidate_sequences", 64)
    return {"tasks": [{"name": "vad", "backend": "vad", "model": model_path,
                       "intra_op_threads": 1,
                       "batching": {"max_batch_size": max_batch_size, "max_queue_size": 1024},
                       "sequence": seq}]}


def chunk_request(samples: np.ndarray, route: str, sid: str, start: bool, end: bool) -> lc.InferRequest:
    meta = {"lumen.sequence.id": sid}
    if start:
        meta["lumen.sequence.start"] = "true"
    if end:
        meta["lumen.sequence.end"] = "true"
    if route == "tensor":
        b = lc.new_infer_request("vad").for_tensor_array(samples.reshape(1, CHUNK), "NL",
                                                         vad.PREPROCESS_ID)
        for k, v in meta.items():
            b.with_meta(k, v)
        return b.build()
    if route == "l16":
        pcm = np.round(samples * 32768).clip(-32768, 32767).astype("<i2")
        return lc.InferRequest(task="vad", payload=pcm.tobytes(), payload_mime=L16, meta=meta)
    return lc.InferRequest(task="vad", payload=samples.astype("<f4").tobytes(),
                           payload_mime=F32, meta=meta)


def quantised(audio: np.ndarray) -> np.ndarray:
    """What the L16 route sees: samples rounded to PCM16."""
    return np.round(audio * 32768).clip(-32768, 32767).astype(np.int16) * np.float32(1 / 32768)


async def run_streams(rt, audio: np.ndarray, routes: list, batched: bool = True) -> np.ndarray:
    """Stream ``audio[k]`` chunk by chunk on sequence k, all sequences concurrently."""
    n, total = audio.shape
    steps = total // CHUNK
    probs = np.zeros((n, steps), dtype=np.float32)
    sizes: list = []

    async def stream(k: int) -> None:
        for c in range(steps):
            r = await rt.infer(chunk_request(audio[k, c * CHUNK:(c + 1) * CHUNK], routes[k],
                                             f"stream-{k}", c == 0, c == steps - 1))
            assert r.outputs["speech_prob"].shape == (1,)
            assert r.outputs["speech_prob"].dtype == np.float32
            probs[k, c] = r.outputs["speech_prob"][0]
            sizes.append(int(r.meta["lumen.batch.size"]))
            if (k + c) % 3 == 0:
                await asyncio.sleep(0)  # vary the interleaving between streams

    await asyncio.gather(*[stream(k) for k in range(n)])
    if batched:
        assert max(sizes) > 1  # the streams really were batched together
    return probs


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_interleaved_streams_match_reference_on_every_route(model_path, reference, strategy):
    audio, probs = reference
    n_ref = len(audio)
    streams = np.repeat(audio, STREAMS_PER_REFERENCE, axis=0)
    routes = [("pcm", "tensor", "l16")[k % 3] for k in range(len(streams))]

    async def main():
        async with lc.Runtime.from_dict(vad_config(model_path, strategy)) as rt:
            out = await run_streams(rt, streams, routes)
            assert rt.tasks["vad"].batcher.active_sequences == 0
            return out

    got = run(main())
    sess = cpu_session(model_path, intra_op_threads=1)
    probs_l16 = silero.run_streams(sess, quantised(audio))
    for k in range(len(streams)):
        want = probs_l16[k // STREAMS_PER_REFERENCE] if routes[k] == "l16" else probs[k // STREAMS_PER_REFERENCE]
        np.testing.assert_allclose(got[k], want, atol=TOLERANCE, rtol=0,
                                   err_msg=f"stream {k} ({routes[k]}) of reference {k // STREAMS_PER_REFERENCE}")
    assert n_ref == 3


def test_l16_route_stays_close_to_the_float_reference(model_path, reference):
    """PCM16 rounding moves probabilities by ~1e-4 at most on the fixture audio."""
    audio, probs = reference
    sess = cpu_session(model_path, intra_op_threads=1)
    assert np.abs(silero.run_streams(sess, quantised(audio)) - probs).max() < 5 * TOLERANCE


def test_restart_resets_state_and_context(model_path, reference):
    audio, probs = reference
    half = 12

    async def main():
        async with lc.Runtime.from_dict(vad_config(model_path)) as rt:
            first = await run_streams(rt, audio[:, :half * CHUNK], ["pcm"] * 3)
            # the same ids again from the top: fresh state and zero context, same answers
            again = await run_streams(rt, audio, ["pcm"] * 3)
            return first, again

    first, again = run(main())
    np.testing.assert_allclose(first, probs[:, :half], atol=TOLERANCE)
    np.testing.assert_allclose(again, probs, atol=TOLERANCE)


def run(coro):
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("payload, mime, err, field", [
    (bytes(1024), "audio/L16;rate=8000", lc.UnsupportedMediaType, "payload_mime"),
    (bytes(1024), "audio/L16", lc.UnsupportedMediaType, "payload_mime"),
    (bytes(1024), "audio/L16;rate=16000;channels=2", lc.UnsupportedMediaType, "payload_mime"),
    (bytes(2048), "audio/pcm;format=s16le;rate=16000", lc.UnsupportedMediaType, "payload_mime"),
    (bytes(2048), "audio/pcm;rate=16000", lc.UnsupportedMediaType, "payload_mime"),
    (bytes(1000), "audio/L16;rate=16000", lc.InvalidArgument, "payload"),
    (bytes(1024), "audio/pcm;format=f32le;rate=16000", lc.InvalidArgument, "payload"),
    (bytes(1024), "audio/wav", lc.UnsupportedMediaType, "payload_mime"),
])
def test_raw_input_errors(model_path, payload, mime, err, field):
    async def main():
        async with lc.Runtime.from_dict(vad_config(model_path)) as rt:
            with pytest.raises(err) as ei:
                await rt.infer(lc.InferRequest(task="vad", payload=payload, payload_mime=mime,
                                               meta={"lumen.sequence.id": "a",
                                                     "lumen.sequence.start": "true"}))
            return ei.value

    e = run(main())
    assert e.field == field


def test_non_finite_samples_are_refused_and_do_not_poison_the_stream(model_path, reference):
    """A NaN or inf sample (f32 raw or tensor route) is InvalidArgument, never fed to the model:
    Silero answers a NaN chunk with a finite probability and its state stays corrupted, so every
    later chunk of the stream would silently be wrong."""
    audio, probs = reference
    chunks = audio[0].reshape(-1, CHUNK)

    async def main():
        async with lc.Runtime.from_dict(vad_config(model_path)) as rt:
            out, fields = [], []
            for i, chunk in enumerate(chunks):
                if i in (3, 4):
                    bad = chunk.copy()
                    bad[100] = np.nan if i == 3 else np.inf
                    for route in ("f32", "tensor"):
                        with pytest.raises(lc.InvalidArgument) as ei:
                            await rt.infer(chunk_request(bad, route, "nan", False, False))
                        fields.append(ei.value.field)
                res = await rt.infer(chunk_request(chunk, "f32", "nan", i == 0,
                                                   i == len(chunks) - 1))
                out.append(float(res.outputs["speech_prob"][0]))
            return np.array(out), fields

    got, fields = run(main())
    assert fields == ["payload"] * 4
    np.testing.assert_allclose(got, probs[0], atol=TOLERANCE)


def test_tensor_and_sequence_errors(model_path):
    async def main():
        async with lc.Runtime.from_dict(vad_config(model_path)) as rt:
            errors = []
            for arr, pp, meta in [
                (np.zeros((1, 256), np.float32), vad.PREPROCESS_ID, {"lumen.sequence.start": "true"}),
                (np.zeros((1, CHUNK), np.float32), "other", {"lumen.sequence.start": "true"}),
                (np.zeros((1, CHUNK), np.float32), vad.PREPROCESS_ID, {}),
            ]:
                b = lc.new_infer_request("vad").for_tensor_array(arr, "NL", pp)
                b.with_meta("lumen.sequence.id", "t")
                for k, v in meta.items():
                    b.with_meta(k, v)
                with pytest.raises(lc.InvalidArgument) as ei:
                    await rt.infer(b.build())
                errors.append(ei.value.field)
            with pytest.raises(lc.InvalidArgument) as ei:  # no sequence id at all
                await rt.infer(lc.InferRequest(task="vad", payload=bytes(1024), payload_mime=L16))
            errors.append(ei.value.field)
            return errors

    assert run(main()) == ["lumen.tensor.shape", "lumen.preprocess.id", "lumen.sequence.start",
                           "lumen.sequence.id"]


def test_loading_serves_the_declared_state_and_leaves_the_config_unchanged(model_path):
    # the config declares policy only; the backend supplies Silero's state and sr constant
    async def main():
        rt = lc.Runtime.from_dict(vad_config(model_path))
        seq = rt.config.tasks[0].sequence
        async with rt:
            first = await rt.infer(chunk_request(np.zeros(CHUNK, np.float32), "l16", "c", True,
                                                 True))
        return seq, rt.config.tasks[0].sequence, first

    before, after, first = run(main())
    assert after is before and after.state == () and after.constant == ()
    assert 0.0 <= float(first.outputs["speech_prob"][0]) <= 1.0


def test_describe_and_model_identity(model_path):
    async def main():
        async with lc.Runtime.from_dict(vad_config(model_path)) as rt:
            d = rt.describe()["vad"]
            ok = await rt.infer(chunk_request(np.zeros(CHUNK, np.float32), "pcm", "m", True, True))
            b = lc.new_infer_request("vad").for_raw_input(bytes(1024), L16)
            b.with_meta("lumen.sequence.id", "m2").with_meta("lumen.sequence.start", "true")
            b.with_meta("lumen.model.id", "other-model")
            with pytest.raises(lc.InvalidArgument) as ei:
                await rt.infer(b.build())
            return d, ok, ei.value

    d, ok, err = run(main())
    assert d["stateful"] and d["raw_mimes"] == [vad.MIME_L16_ACCEPTED, vad.MIME_PCM_ACCEPTED]
    assert d["model_id"] == "silero-vad"
    assert d["tensor_signatures"] == [{"dtype": "fp32", "layout": "NL", "shape": [1, CHUNK],
                                       "preprocess_ids": [vad.PREPROCESS_ID]}]
    assert 0.0 <= float(ok.outputs["speech_prob"][0]) <= 1.0
    assert err.field == "lumen.model.id"


def test_default_runtime_serves_vad_when_prepared(home, monkeypatch, tmp_path, reference):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))  # nothing prepared there
    with pytest.raises(models.ModelMissingError, match="lumen models prepare"):
        vad.default_task_table()
    monkeypatch.setenv("LUMEN_HOME", str(home))
    table = vad.default_task_table()
    assert table is not None and table["backend"] == "vad"
    audio, probs = reference

    async def main():
        rt = lc.Runtime.default()
        rt.config.tasks = [t for t in rt.config.tasks if t.name == "vad"]
        async with rt:
            assert len(rt.tasks["vad"].instances) == vad.DEFAULT_INSTANCES
            # three streams over two single-thread lanes need not share a batch
            return await run_streams(rt, audio, ["l16", "pcm", "tensor"], batched=False)

    got = run(main())
    np.testing.assert_allclose(got[1:], probs[1:], atol=TOLERANCE)
    sess = cpu_session(models.model_dir(models.SILERO_VAD, home) / models.MODEL_FILE, 1)
    np.testing.assert_allclose(got[0], silero.run_streams(sess, quantised(audio[:1]))[0],
                               atol=TOLERANCE)


def test_missing_model_names_the_prepare_command(monkeypatch, tmp_path):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    cfg = {"tasks": [{"name": "vad", "backend": "vad"}]}

    async def main():
        async with lc.Runtime.from_dict(cfg):
            pass

    with pytest.raises(Exception) as ei:
        run(main())
    assert "lumen models prepare" in str(ei.value)


def test_listed_mimes_are_accepted_as_written(model_path):
    """Issue 26 row 11: /v1/tasks and the 415 name the mimes as a client must write them
    (``audio/L16;rate=16000``, ...), not the bare types that are refused without a rate."""
    async def main():
        async with lc.Runtime.from_dict(vad_config(model_path)) as rt:
            listed = rt.describe("vad")["raw_mimes"]
            for i, mime in enumerate(listed):  # each one works exactly as listed
                width = 2 if "L16" in mime else 4
                await rt.infer(lc.InferRequest(task="vad", payload=bytes(CHUNK * width),
                                               payload_mime=mime,
                                               meta={"lumen.sequence.id": f"w{i}",
                                                     "lumen.sequence.start": "true",
                                                     "lumen.sequence.end": "true"}))
            with pytest.raises(lc.UnsupportedMediaType) as ei:
                await rt.infer(lc.InferRequest(task="vad", payload=bytes(1024),
                                               payload_mime="audio/flac",
                                               meta={"lumen.sequence.id": "x",
                                                     "lumen.sequence.start": "true"}))
            return listed, ei.value.message

    listed, message = run(main())
    assert listed == ["audio/L16;rate=16000", "audio/pcm;rate=16000;format=f32le"]
    assert f"accepts {', '.join(listed)} (or a tensor)" in message, message

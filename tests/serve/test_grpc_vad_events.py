"""gRPC ``InferStream`` segment events (``lumen.vad.events=true`` on a sequence's start
request): replies carry the events each chunk settles, equal to silero-vad's segments."""
from __future__ import annotations

import json
import pathlib
import wave

import grpc
import pytest
from serve_support import ServerThread

import lumen_core as lc
from lumen_core import models
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE = json.loads((FIXTURES / "vad_speech_reference.json").read_text())
NAME = "vad_speech_1.wav"
L16 = "audio/L16;rate=16000"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("lumen_home")
    models.prepare(names=[models.SILERO_VAD], home=home)
    path = str(models.model_dir(models.SILERO_VAD, home) / models.MODEL_FILE)
    task = {"name": "vad", "backend": "vad", "model": path, "intra_op_threads": 1,
            "batching": {"max_batch_size": 32, "max_queue_size": 4096},
            "sequence": {"strategy": "direct"}}
    srv = ServerThread(lc.Runtime.from_dict({"tasks": [task]}))
    yield srv
    srv.stop()


def chunks() -> list:
    with wave.open(str(FIXTURES / NAME)) as w:
        pcm = w.readframes(w.getnframes())
    pcm += bytes(-len(pcm) % 1024)
    return [pcm[i:i + 1024] for i in range(0, len(pcm), 1024)]


def requests(sid: str, events: bool, extra: dict = None):
    parts = chunks()
    for i, c in enumerate(parts):
        meta = {"lumen.sequence.id": sid}
        if i == 0:
            meta["lumen.sequence.start"] = "true"
            if events:
                meta["lumen.vad.events"] = "true"
                meta.update(extra or {})
        if i == len(parts) - 1:
            meta["lumen.sequence.end"] = "true"
        yield pb.InferRequest(task="vad", payload=c, payload_mime=L16, meta=meta,
                              correlation_id=str(i))


def test_stream_replies_carry_silero_segment_events(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        events = []
        for r in stub.InferStream(requests("g1", True)):
            assert r.WhichOneof("result") == "response", r.error
            if "lumen.vad.events" in r.response.meta:
                events += json.loads(r.response.meta["lumen.vad.events"])
        want = REFERENCE[NAME]["segments"]
        assert [e["event"] for e in events] == ["start", "end"] * len(want)
        for (s, e), a, b in zip(want, events[::2], events[1::2], strict=True):
            assert abs(a["ms"] - s / 16) <= 32 and abs(b["ms"] - e / 16) <= 32
        # without the flag: no events; options apply
        for r in stub.InferStream(requests("g2", False)):
            assert "lumen.vad.events" not in r.response.meta
        n = 0
        for r in stub.InferStream(requests("g3", True,
                                           {"lumen.vad.min_silence_duration_ms": "3000"})):
            if "lumen.vad.events" in r.response.meta:
                n += len(json.loads(r.response.meta["lumen.vad.events"]))
        assert 0 < n < len(events)
        bad = list(stub.InferStream(requests("g4", True, {"lumen.vad.threshold": "x"})))
        assert bad[0].WhichOneof("result") == "error"
        assert bad[0].error.field == "lumen.vad.threshold"

"""Issue 12 item 13: ``describe()`` (``/v1/tasks``) lists exactly what vad accepts (full media
types with parameters, bytes per request), a ``default_mime``, and every task's outputs; OIP's
model metadata carries those outputs and a BYTES input without ``content_type`` is read as the
task's ``default_mime``."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import serve_support as S

VAD_CHUNK = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("describe")
    srv = S.default_server(home, S.onnx_config(tmp, slow=False)["tasks"],
                           server_kwargs={"grpc": False})
    yield srv
    srv.stop()


def _tasks(server) -> dict:
    r = httpx.get(server.url + "/v1/tasks", timeout=30)
    assert r.status_code == 200
    body = r.json()
    tasks = body.get("tasks", body) if isinstance(body, dict) else body
    if isinstance(tasks, list):
        tasks = {t["name"]: t for t in tasks}
    return tasks


def test_vad_lists_exactly_what_it_accepts(server):
    vad = _tasks(server)["vad"]
    accepts = {a["mime"]: a for a in vad["accepts"]}
    assert set(accepts) == {"audio/L16;rate=16000", "audio/pcm;rate=16000;format=f32le"}
    assert accepts["audio/L16;rate=16000"]["chunk_bytes"] == VAD_CHUNK * 2
    assert accepts["audio/pcm;rate=16000;format=f32le"]["chunk_bytes"] == VAD_CHUNK * 4
    assert all(a["chunk_samples"] == VAD_CHUNK for a in accepts.values())
    assert vad["default_mime"] == "audio/L16;rate=16000"
    assert vad["outputs"] == {"speech_prob": ["fp32", [1]]}


def test_every_task_declares_its_outputs(server):
    tasks = _tasks(server)
    for name, desc in tasks.items():
        outs = desc.get("outputs")
        assert isinstance(outs, dict) and outs, name
        for spec in outs.values():
            assert isinstance(spec[0], str) and isinstance(spec[1], list), (name, spec)
    assert tasks["text_embed"]["outputs"] == {"embedding": ["fp32", [384]]}
    assert tasks["mlp"]["outputs"] == {n: [dt, shape] for n, (dt, shape) in
                                       tasks["mlp"]["outputs"].items()}
    assert all(shape == [S.D_OUT] for _, shape in tasks["mlp"]["outputs"].values())


def test_oip_metadata_uses_the_declared_outputs(server):
    r = httpx.get(server.url + "/v2/models/vad", timeout=30)
    assert r.status_code == 200
    assert r.json()["outputs"] == [{"name": "speech_prob", "datatype": "FP32", "shape": [1]}]
    mlp = httpx.get(server.url + "/v2/models/mlp", timeout=30).json()
    assert [o["shape"] for o in mlp["outputs"]] == [[S.D_OUT]]
    assert all(o["datatype"] == "FP32" for o in mlp["outputs"])


def test_oip_bytes_without_content_type_reads_the_default_mime(server, fixtures_dir):
    """Before: the first raw mime (bare ``audio/l16``) was used and refused (no rate)."""
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    pcm16 = np.clip(np.round(ref["audio"][0, :VAD_CHUNK] * 32768), -32768, 32767).astype("<i2")
    # the chunk goes as binary tensor data (the BYTES element: uint32 length, then bytes)
    raw = pcm16.tobytes()
    params = {"sequence_id": "default-mime", "sequence_start": True, "sequence_end": True}
    head = {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [1],
                        "parameters": {"binary_data_size": 4 + len(raw)}}],
            "parameters": params}
    hjson = json.dumps(head).encode()
    payload = hjson + len(raw).to_bytes(4, "little") + raw
    r = httpx.post(server.url + "/v2/models/vad/infer", content=payload, timeout=30,
                   headers={"Inference-Header-Content-Length": str(len(hjson)),
                            "Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert "speech_prob" in r.text

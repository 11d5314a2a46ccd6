"""gRPC API (``lumen.v1.Inference``): unary Infer, status codes with the lumen error metadata,
a bidirectional stream that survives a bad request, three interleaved Silero VAD sequences on one
stream against the reference probabilities, and the committed generated code being current."""
from __future__ import annotations

import pathlib
import shutil

import grpc
import numpy as np
import onnx_models as M
import pytest
import serve_support as S

from lumen_core.errors import from_code
from lumen_core.serve import proto as proto_pkg
from lumen_core.serve.grpc import ERROR_CODE_KEY, ERROR_FIELD_KEY
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc

VAD_CHUNK = 512
VAD_MIME = "audio/pcm;format=f32le;rate=16000"
VAD_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("grpc")
    srv = S.default_server(home, S.onnx_config(tmp, slow=False)["tasks"],
                           max_payload_bytes=S.MAX_PAYLOAD)
    yield srv
    srv.stop()


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.InferenceStub(channel)


def mlp_request(x: np.ndarray, cid: str = "", **meta: str) -> pb.InferRequest:
    m = S.tensor_meta(x.shape)
    m.update(meta)
    return pb.InferRequest(task="mlp", payload=x.tobytes(), payload_mime="application/octet-stream",
                           meta=m, correlation_id=cid)


def tensor(t: pb.Tensor) -> np.ndarray:
    assert t.dtype == "fp32"
    return np.frombuffer(t.data, dtype="<f4").reshape(tuple(t.shape))


def test_unary_infer(stub):
    x = S.mlp_input(7)
    resp = stub.Infer(mlp_request(x, "grpc-1"))
    assert resp.correlation_id == "grpc-1" and resp.task == "mlp"
    np.testing.assert_allclose(tensor(resp.outputs["y"]), M.mlp_reference(x, d_out=S.D_OUT)[0],
                               rtol=1e-5, atol=1e-5)
    assert int(resp.meta["lumen.batch.size"]) >= 1


@pytest.mark.parametrize("make, status, code, field", [
    (lambda: pb.InferRequest(task="nope", payload=b"x", payload_mime="text/plain"),
     grpc.StatusCode.NOT_FOUND, "not_found", "task"),
    (lambda: mlp_request(S.mlp_input(), **{"lumen.tensor.shape": "[1,15]"}),
     grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "payload"),
    (lambda: mlp_request(S.mlp_input(), **{"lumen.bogus": "1"}),
     grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "lumen.bogus"),
    (lambda: pb.InferRequest(task="vad", payload=b"\0" * 1024, payload_mime="image/png",
                             meta={"lumen.sequence.id": "x", "lumen.sequence.start": "true"}),
     grpc.StatusCode.INVALID_ARGUMENT, "unsupported_media_type", "payload_mime"),
    (lambda: pb.InferRequest(task="mlp", payload=b"\0" * (S.MAX_PAYLOAD + 4),
                             meta=S.tensor_meta((1, (S.MAX_PAYLOAD + 4) // 4))),
     grpc.StatusCode.INVALID_ARGUMENT, "payload_too_large", "payload"),
])
def test_status_codes_and_error_metadata(stub, make, status, code, field):
    with pytest.raises(grpc.RpcError) as info:
        stub.Infer(make())
    err = info.value
    assert err.code() == status
    md = dict(err.trailing_metadata())
    assert md[ERROR_CODE_KEY] == code and md[ERROR_FIELD_KEY] == field
    assert from_code(md[ERROR_CODE_KEY], err.details(), md[ERROR_FIELD_KEY]).code == code


def test_stream_answers_each_request_and_survives_an_error(stub):
    xs = [S.mlp_input(20 + i) for i in range(6)]
    reqs = [mlp_request(x, f"s{i}") for i, x in enumerate(xs)]
    reqs.insert(3, mlp_request(S.mlp_input(), "bad", **{"lumen.tensor.shape": "[1,15]"}))
    replies = {r.correlation_id: r for r in stub.InferStream(iter(reqs))}
    assert set(replies) == {f"s{i}" for i in range(6)} | {"bad"}
    bad = replies["bad"]
    assert bad.WhichOneof("result") == "error"
    assert bad.error.code == "invalid_argument" and bad.error.field == "payload"
    for i, x in enumerate(xs):
        r = replies[f"s{i}"]
        assert r.WhichOneof("result") == "response"
        np.testing.assert_allclose(tensor(r.response.outputs["y"]),
                                   M.mlp_reference(x, d_out=S.D_OUT)[0], rtol=1e-5, atol=1e-5)


def test_stream_vad_sequences_match_the_reference(stub, fixtures_dir):
    """Three streams interleaved chunk by chunk on one call, each sent without waiting for
    replies: the server must keep each sequence's order and state apart."""
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    audio, probs = ref["audio"], ref["probs"]
    n_streams, n_chunks = probs.shape

    def requests():
        for c in range(n_chunks):
            for s in range(n_streams):
                meta = {"lumen.sequence.id": f"grpc-vad-{s}"}
                if c == 0:
                    meta["lumen.sequence.start"] = "true"
                if c == n_chunks - 1:
                    meta["lumen.sequence.end"] = "true"
                chunk = np.ascontiguousarray(audio[s, c * VAD_CHUNK:(c + 1) * VAD_CHUNK], "<f4")
                yield pb.InferRequest(task="vad", payload=chunk.tobytes(), payload_mime=VAD_MIME,
                                      meta=meta, correlation_id=f"{s}:{c}")

    got = np.full(probs.shape, np.nan, np.float32)
    for r in stub.InferStream(requests()):
        assert r.WhichOneof("result") == "response", r.error
        s, c = map(int, r.correlation_id.split(":"))
        (name, t), = r.response.outputs.items()
        got[s, c] = tensor(t).reshape(-1)[0]
    np.testing.assert_allclose(got, probs, atol=VAD_TOLERANCE)


def test_generated_code_is_current(tmp_path):
    """The committed *_pb2.py equal a fresh protoc run on the committed lumen.proto."""
    pkg = pathlib.Path(proto_pkg.__file__).parent
    root = tmp_path / "root"
    dest = root / pathlib.Path(proto_pkg.PROTO_RELPATH).parent
    dest.mkdir(parents=True)
    shutil.copy(pkg / "lumen.proto", dest / "lumen.proto")
    out = proto_pkg.generate(str(root), str(root))
    for name in proto_pkg.GENERATED:
        assert (out / name).read_bytes() == (pkg / name).read_bytes(), (
            f"{name} is out of date: run `python -m lumen_core.serve.proto` and commit the result")

"""gRPC API (``lumen.v1.Inference``): unary Infer, status codes with the lumen error metadata,
a bidirectional stream that survives a bad request, three interleaved Silero VAD sequences on one
stream against the reference probabilities, a stream's requests bound by the task's queue limit
(refusals, order within the sequence kept) and by the stream's own in-flight window
(backpressure), and the committed generated code being current."""
from __future__ import annotations

import pathlib
import shutil
import threading

import grpc
import numpy as np
import onnx_models as M
import pytest
import serve_support as S

from lumen_core.errors import from_code
from lumen_core.serve import grpc as grpc_mod
from lumen_core.serve import proto as proto_pkg
from lumen_core.serve.grpc import ERROR_CODE_KEY, ERROR_FIELD_KEY
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc

VAD_CHUNK = 512
VAD_MIME = "audio/pcm;format=f32le;rate=16000"
VAD_TOLERANCE = 1e-4
#: the queue limit of the ``vad_tight`` task, and how long each of its batches waits
TIGHT_QUEUE = 8
TIGHT_DELAY_US = 100_000
#: ``hold``: 1.25 MiB fp32 rows (y = 2x), every lone request waits HOLD_DELAY_US in the queue
HOLD_COLS = 327_680
HOLD_DELAY_US = 200_000
FLOW_MAX_PAYLOAD = 2 * 1024 * 1024


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


@pytest.fixture(scope="module")
def flow_server(tmp_path_factory):
    """The default tasks plus ``vad_tight`` (Silero VAD, queue of TIGHT_QUEUE, one lane whose
    batches wait up to TIGHT_DELAY_US for all of its sequences) and ``hold`` (big rows, a large
    queue, batches that wait HOLD_DELAY_US), with payloads up to FLOW_MAX_PAYLOAD."""
    home = S.prepared_home(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("grpc_flow")
    tight = {"name": "vad_tight", "backend": "vad", "instances": 1, "intra_op_threads": 1,
             "batching": {"max_batch_size": 8, "max_queue_size": TIGHT_QUEUE},
             "sequence": {"strategy": "direct", "max_sequence_idle_us": 60_000_000,
                          "max_queue_delay_us": TIGHT_DELAY_US, "minimum_slot_utilization": 1.0}}
    hold = {"name": "hold", "backend": "onnx", "intra_op_threads": 1,
            "model": M.scale(tmp / "hold.onnx", dims=("N", HOLD_COLS)),
            "batching": {"max_queue_delay_us": HOLD_DELAY_US, "max_batch_size": 1024,
                         "max_queue_size": 1024}}
    srv = S.default_server(home, [tight, hold], max_payload_bytes=FLOW_MAX_PAYLOAD)
    yield srv
    srv.stop()


def vad_request(task: str, chunk: np.ndarray, sid: str, cid: str, start: bool = False) -> pb.InferRequest:
    meta = {"lumen.sequence.id": sid}
    if start:
        meta["lumen.sequence.start"] = "true"
    return pb.InferRequest(task=task, payload=np.ascontiguousarray(chunk, "<f4").tobytes(),
                           payload_mime=VAD_MIME, meta=meta, correlation_id=cid)


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
    # issue 38 row 9: a plain key the task does not read is the HTTP route's 400, not ignored
    (lambda: mlp_request(S.mlp_input(), normalise="false"),
     grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "normalise"),
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


def test_stream_past_the_queue_limit_is_paced_not_refused_and_keeps_sequence_order(
        flow_server, fixtures_dir):
    """30 chunks of one sequence sent without waiting, to a task whose queue holds 8 and whose
    batches are held back (a second, idle sequence shares the lane).  Issue 38 row 4: the
    chunks past the queue limit used to be refused mid-sequence (the stream window is larger
    than the queue), which corrupts the sequence's state for good.  Now the stream stops
    reading while the queue is full: nothing is refused, every chunk gets its own reply, in
    the order sent, equal to the same chunks run one by one as a fresh sequence."""
    audio = np.load(fixtures_dir / "silero_vad_reference.npz")["audio"][0]
    n_ref = audio.size // VAD_CHUNK
    n_chunks = 30
    chunks = [audio[(c % n_ref) * VAD_CHUNK:(c % n_ref + 1) * VAD_CHUNK] for c in range(n_chunks)]
    with grpc.insecure_channel(flow_server.grpc_target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        # the idle sequence: it holds a slot of the only lane and never has a request ready,
        # so each batch of the streamed sequence waits out TIGHT_DELAY_US
        stub.Infer(vad_request("vad_tight", chunks[0], "idle", "idle-0", start=True))
        reqs = [vad_request("vad_tight", ch, "busy", str(i), start=(i == 0))
                for i, ch in enumerate(chunks)]
        replies = list(stub.InferStream(iter(reqs)))
        accepted = [int(r.correlation_id) for r in replies if r.WhichOneof("result") == "response"]
        refused = [r.error for r in replies if r.WhichOneof("result") == "error"]
        assert sorted(r.correlation_id for r in replies) == sorted(str(i) for i in range(n_chunks))
        assert not refused, refused[:3]
        assert accepted == list(range(n_chunks))  # replies of one sequence in order
        got = {int(r.correlation_id): tensor(next(iter(r.response.outputs.values()))).reshape(-1)[0]
               for r in replies if r.WhichOneof("result") == "response"}
        # the accepted chunks alone, in order, one at a time on a fresh sequence of `vad`
        want = [tensor(next(iter(stub.Infer(vad_request("vad", chunks[i], "replay", f"r{i}",
                                                        start=(n == 0))).outputs.values())))
                .reshape(-1)[0] for n, i in enumerate(accepted)]
    np.testing.assert_allclose([got[i] for i in accepted], want, atol=VAD_TOLERANCE)


def test_stream_is_slowed_not_buffered_past_its_in_flight_window(flow_server):
    """300 messages of 1.25 MiB (375 MiB) on one stream to a task with a large queue whose
    batches wait: the server stops reading the stream while its window is full, so the client
    is never far ahead of its replies, the server's in-flight payload stays within
    STREAM_MAX_IN_FLIGHT_BYTES, and every message is still answered, in full."""
    n = 300
    x = np.arange(HOLD_COLS, dtype=np.float32).reshape(1, HOLD_COLS)
    payload = x.tobytes()
    meta = S.tensor_meta(x.shape)
    servicer = flow_server.server.grpc.servicer
    sent = {"n": 0}
    lock = threading.Lock()

    def requests():
        for i in range(n):
            with lock:
                sent["n"] += 1
            yield pb.InferRequest(task="hold", payload=payload, payload_mime="application/octet-stream",
                                  meta=meta, correlation_id=str(i))

    received, max_ahead, peak_bytes, peak_requests = 0, 0, 0, 0
    expect = (x * 2).tobytes()
    with grpc.insecure_channel(flow_server.grpc_target) as channel:
        for r in pb_grpc.InferenceStub(channel).InferStream(requests()):
            received += 1
            with lock:
                max_ahead = max(max_ahead, sent["n"] - received)
            peak_bytes = max(peak_bytes, servicer.stream_in_flight_bytes)
            peak_requests = max(peak_requests, servicer.stream_in_flight)
            assert r.WhichOneof("result") == "response", r.error
            assert r.response.outputs["y"].data == expect
    assert received == n
    window = grpc_mod.STREAM_MAX_IN_FLIGHT_BYTES // len(payload)
    assert 2 <= peak_requests <= window and peak_bytes <= grpc_mod.STREAM_MAX_IN_FLIGHT_BYTES
    # the window plus what HTTP/2 flow control lets through: far from the whole stream
    assert max_ahead < n // 2, max_ahead
    assert servicer.stream_in_flight == 0 and servicer.stream_in_flight_bytes == 0


# -- issue 38 row 4: streams paced by their queues, never refused mid-sequence ----------------
PACED_QUEUE = 64


@pytest.fixture(scope="module")
def paced_server(tmp_path_factory):
    """``vad_q64``: Silero VAD with a queue of PACED_QUEUE (the issue's figure); ``vad_slots``:
    the same with 4 sequence slots (one instance, batches of 4)."""
    home = S.prepared_home(tmp_path_factory)
    q64 = {"name": "vad_q64", "backend": "vad", "instances": 1, "intra_op_threads": 1,
           "batching": {"max_queue_size": PACED_QUEUE}}
    slots = {"name": "vad_slots", "backend": "vad", "instances": 1, "intra_op_threads": 1,
             "batching": {"max_batch_size": 4, "max_queue_size": PACED_QUEUE}}
    srv = S.default_server(home, [q64, slots])
    yield srv
    srv.stop()


def _chunks(fixtures_dir, n):
    audio = np.load(fixtures_dir / "silero_vad_reference.npz")["audio"][0]
    n_ref = audio.size // VAD_CHUNK
    return [audio[(c % n_ref) * VAD_CHUNK:(c % n_ref + 1) * VAD_CHUNK] for c in range(n)]


def _stream(target, task, sid, chunks):
    """One stream of one sequence (``chunks`` sent without waiting): its replies."""
    reqs = [vad_request(task, ch, sid, str(i), start=(i == 0)) for i, ch in enumerate(chunks)]
    reqs[-1].meta["lumen.sequence.end"] = "true"
    with grpc.insecure_channel(target) as channel:
        return list(pb_grpc.InferenceStub(channel).InferStream(iter(reqs)))


def _check_sequence(replies, n):
    refused = [r.error for r in replies if r.WhichOneof("result") == "error"]
    assert not refused, (len(refused), refused[:2])
    assert [int(r.correlation_id) for r in replies] == list(range(n))  # all, in order


def test_a_fast_stream_of_1000_chunks_past_a_queue_of_64_loses_none(paced_server, fixtures_dir):
    """The issue's figure: lumen.v1 InferStream, max_queue_size = 64, 1,000 chunks of one
    sequence sent at once had 752 refused (the first at chunk 129); now none, and the
    probabilities equal the same audio run as a sequence chunk by chunk."""
    n = 1000
    chunks = _chunks(fixtures_dir, n)
    replies = _stream(paced_server.grpc_target, "vad_q64", "fast", chunks)
    _check_sequence(replies, n)
    got = [tensor(next(iter(r.response.outputs.values()))).reshape(-1)[0] for r in replies[:100]]
    with grpc.insecure_channel(paced_server.grpc_target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        want = [tensor(next(iter(stub.Infer(vad_request("vad_q64", chunks[i], "replay", f"r{i}",
                                                        start=(i == 0))).outputs.values())))
                .reshape(-1)[0] for i in range(100)]
    np.testing.assert_allclose(got, want, atol=VAD_TOLERANCE)


def test_streams_beyond_the_sequence_slots_wait_and_lose_no_chunk(paced_server, fixtures_dir):
    """The issue's second figure at a test scale: more streams than sequence slots (10 streams
    of 100 chunks, 4 slots, a queue of 64).  The streams beyond the slots used to fill the
    queue with chunks that could not run, and chunks were refused; now a stream whose sequence
    waits for a slot reads nothing until it has one: every chunk of every stream answered."""
    n, streams = 100, 10
    chunks = _chunks(fixtures_dir, n)
    out: dict = {}

    def one(k):
        out[k] = _stream(paced_server.grpc_target, "vad_slots", f"s{k}", chunks)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(out) == list(range(streams))
    for k in range(streams):
        _check_sequence(out[k], n)

"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``) driven by the real
``tritonclient.grpc`` (its client modules run on our protobuf 7): health and metadata,
``text_embed`` by BYTES text and INT64 token ids equal to the native API, ``vad`` as sequences
through ``ModelStreamInfer`` equal to the Silero fixture, errors as the client raises them,
typed ``contents`` (no raw bytes), and the committed generated code being current."""
from __future__ import annotations

import pathlib
import queue
import shutil

import numpy as np
import pytest
import serve_support as S

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from lumen_core.serve import proto as proto_pkg  # noqa: E402

VAD_CHUNK = 512
VAD_TOLERANCE = 1e-4
EMBED_TOLERANCE = 1e-4
STREAM_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("oip_grpc")
    srv = S.default_server(home, S.onnx_config(tmp, slow=False)["tasks"],
                           max_payload_bytes=1 << 20, system_shared_memory=True)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_target)
    yield c
    c.close()


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "lumen-core" and "binary_tensor_data" in meta["extensions"]
    assert client.is_model_ready("text_embed") and client.is_model_ready("text_embed", "1")
    assert not client.is_model_ready("no_such_task")
    m = client.get_model_metadata("text_embed", as_json=True)
    assert m["versions"] == ["1"]
    assert {i["datatype"] for i in m["inputs"]} == {"INT64", "BYTES"}
    assert m["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": ["384"]}]
    with pytest.raises(InferenceServerException, match="unknown model") as e:
        client.get_model_metadata("no_such_task")
    assert "NOT_FOUND" in e.value.status()


def test_text_embed_by_bytes_and_by_token_ids_equal_the_native_api(server, client):
    rt = server.runtime
    text = "a quick test of the open inference protocol"
    native = server.call(rt.infer(rt.text_request("text_embed", text))).outputs["embedding"]
    inp = grpcclient.InferInput("raw", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode()], dtype=object))
    res = client.infer("text_embed", [inp], request_id="g1",
                       outputs=[grpcclient.InferRequestedOutput("embedding")])
    np.testing.assert_allclose(res.as_numpy("embedding"), native, atol=EMBED_TOLERANCE)
    assert res.get_response().id == "g1"
    ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
    native = server.call(rt.infer(rt.token_ids_request("text_embed", ids[0].tolist())))
    tok = grpcclient.InferInput("ids", list(ids.shape), "INT64")
    tok.set_data_from_numpy(ids)
    res = client.infer("text_embed", [tok], model_version="1")
    np.testing.assert_allclose(res.as_numpy("embedding"), native.outputs["embedding"],
                               atol=EMBED_TOLERANCE)


def test_vad_sequences_through_model_stream_infer(client, fixtures_dir):
    """Three sequences interleaved on one stream, each equal to the fixture."""
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    audio, probs = ref["audio"], ref["probs"]
    n_seq, n = audio.shape[0], audio.shape[1] // VAD_CHUNK
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for k in range(n):
            for s in range(n_seq):
                chunk = audio[s, k * VAD_CHUNK:(k + 1) * VAD_CHUNK].astype(np.float32)[None]
                inp = grpcclient.InferInput("x", [1, VAD_CHUNK], "FP32")
                inp.set_data_from_numpy(chunk)
                client.async_stream_infer("vad", [inp], request_id=f"{s}:{k}",
                                          sequence_id=500 + s, sequence_start=k == 0,
                                          sequence_end=k == n - 1)
        got = np.zeros((n_seq, n))
        for _ in range(n_seq * n):
            result, error = results.get(timeout=STREAM_TIMEOUT_S)
            assert error is None, error
            s, k = map(int, result.get_response().id.split(":"))
            got[s, k] = result.as_numpy("speech_prob").reshape(-1)[0]
    finally:
        client.stop_stream()
    np.testing.assert_allclose(got, probs, atol=VAD_TOLERANCE)


def test_stream_error_keeps_the_stream_open(client):
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        x = S.mlp_input()
        bad = grpcclient.InferInput("x", [1, S.D_IN], "FP32")
        bad.set_data_from_numpy(x)
        client.async_stream_infer("no_such_task", [bad])
        client.async_stream_infer("mlp", [bad])
        (r1, e1), (r2, e2) = (results.get(timeout=STREAM_TIMEOUT_S) for _ in range(2))
    finally:
        client.stop_stream()
    assert e1 is not None and "unknown model" in str(e1)
    assert e2 is None and r2.get_response().model_name == "mlp"


def test_streams_share_the_servers_window_and_counts(server, client):
    """ModelStreamInfer runs on the same stream engine as lumen.v1's InferStream: its requests
    are counted in the servicer's in-flight figures while unanswered and leave them after."""
    servicer = server.server.grpc.servicer
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        x = S.mlp_input()
        inp = grpcclient.InferInput("x", [1, S.D_IN], "FP32")
        inp.set_data_from_numpy(x)
        for _ in range(20):
            client.async_stream_infer("mlp", [inp])
        got = [results.get(timeout=STREAM_TIMEOUT_S) for _ in range(20)]
    finally:
        client.stop_stream()
    assert all(e is None for _, e in got)
    S.wait_for(lambda: servicer.stream_in_flight == 0 and servicer.stream_in_flight_bytes == 0,
               "the stream's counts to return to zero")


def test_errors_as_the_client_raises_them(client):
    x = S.mlp_input()
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="unknown model") as e:
        client.infer("no_such_task", [inp])
    assert "NOT_FOUND" in e.value.status()
    wide = grpcclient.InferInput("x", [1, S.D_IN + 4], "FP32")
    wide.set_data_from_numpy(np.zeros((1, S.D_IN + 4), np.float32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("mlp", [wide])
    assert "INVALID_ARGUMENT" in e.value.status()
    f64 = grpcclient.InferInput("x", list(x.shape), "FP64")
    f64.set_data_from_numpy(x.astype(np.float64))
    with pytest.raises(InferenceServerException, match="datatype 'FP64' is not supported"):
        client.infer("mlp", [f64])


def test_typed_contents_without_raw_bytes(server):
    """A client that sends ``contents.fp32_contents`` (not raw_input_contents) is answered the
    same as one that sends raw bytes."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    x = S.mlp_input(5)
    req = service_pb2.ModelInferRequest(model_name="mlp")
    t = req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    t.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(server.grpc_target) as ch:
        resp = service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req)
    out = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32)
    native = server.call(server.runtime.infer(_tensor_request(x)))
    (name,) = native.outputs
    assert resp.outputs[0].name == name
    np.testing.assert_allclose(out, native.outputs[name].reshape(-1), rtol=1e-6)


def _tensor_request(x: np.ndarray):
    from lumen_core.request import InferRequest

    return InferRequest("mlp", x.tobytes(), "application/octet-stream", S.tensor_meta(x.shape))


def test_shared_memory_input_equals_inline_bytes(server, client):
    """A region registered over gRPC (seen by the HTTP routes too) carries the input; the
    answer equals the inline one; a region not registered is refused."""
    import os

    import httpx
    import tritonclient.utils.shared_memory as shm

    x = S.mlp_input(11)
    inline = grpcclient.InferInput("x", list(x.shape), "FP32")
    inline.set_data_from_numpy(x)
    want = client.infer("mlp", [inline])
    name = want.get_response().outputs[0].name
    key = f"/lumen_oip_grpc_test_{os.getpid()}"
    handle = shm.create_shared_memory_region("g_in", key, x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("g_in", key, x.nbytes)
        status = client.get_system_shared_memory_status(as_json=True)
        assert status["regions"]["g_in"]["key"] == key
        http_status = httpx.get(f"{server.url}/v2/systemsharedmemory/status", timeout=10).json()
        assert [r["name"] for r in http_status] == ["g_in"]
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_shared_memory("g_in", x.nbytes)
        got = client.infer("mlp", [inp])
        np.testing.assert_array_equal(got.as_numpy(name), want.as_numpy(name))
        want_arr = want.as_numpy(name)
        out_handle = shm.create_shared_memory_region("g_out", key + "_out", want_arr.nbytes)
        try:
            client.register_system_shared_memory("g_out", key + "_out", want_arr.nbytes)
            req_out = grpcclient.InferRequestedOutput(name)
            req_out.set_shared_memory("g_out", want_arr.nbytes)
            client.infer("mlp", [inp], outputs=[req_out])
            got = shm.get_contents_as_numpy(out_handle, want_arr.dtype, want_arr.shape)
            np.testing.assert_array_equal(got, want_arr)
        finally:
            client.unregister_system_shared_memory("g_out")
            shm.destroy_shared_memory_region(out_handle)
        client.unregister_system_shared_memory("g_in")
        with pytest.raises(InferenceServerException, match="no shared memory region") as e:
            client.infer("mlp", [inp])
        assert "INVALID_ARGUMENT" in e.value.status()
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def test_generated_oip_code_is_current(tmp_path):
    pkg = pathlib.Path(proto_pkg.__file__).parent
    root = tmp_path / "root"
    dest = root / pathlib.Path(proto_pkg.OIP_PROTO_RELPATH).parent
    dest.mkdir(parents=True)
    for name in ("lumen.proto", "open_inference_grpc.proto"):
        shutil.copy(pkg / name, dest / name)
    out = proto_pkg.generate(str(root), str(root))
    for name in proto_pkg.OIP_GENERATED:
        assert (out / name).read_bytes() == (pkg / name).read_bytes(), (
            f"{name} is out of date: run `python -m lumen_core.serve.proto` and commit the result")


def test_oversized_message_is_payload_too_large(server):
    """A ModelInfer message over max_payload_bytes + headroom is answered INVALID_ARGUMENT
    with lumen-error-code payload_too_large, never parsed."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[bytes(2 << 20)])
    req.inputs.add(name="x", datatype="FP32", shape=[1, 2 << 18])
    with grpc.insecure_channel(server.grpc_target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(e.value.trailing_metadata())["lumen-error-code"] == "payload_too_large"


#: BYTES elements of a refused input: far more than one, few enough for a quick test
MANY_ELEMENTS = 128 * 1024
#: the most Python memory (all threads: the server runs in this process) refusing them may
#: take: the message and a copy of its bytes, 1.6 MB (a view per element was 27 MB, a list
#: of the typed elements 6.7 MB)
REFUSAL_PEAK_BYTES = 4 << 20


@pytest.mark.parametrize("how", ["raw", "typed"])
def test_many_bytes_elements_are_refused_without_building_them(server, how):
    """Issue 25 row 2: ``ModelInfer`` with a BYTES input of many empty elements (in
    raw_input_contents, or typed bytes_contents) is refused at once: INVALID_ARGUMENT naming
    the one-element rule, with no per-element object made."""
    import tracemalloc

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="text_embed")
    t = req.inputs.add(name="raw", datatype="BYTES", shape=[1])
    if how == "raw":
        req.raw_input_contents.append(b"\0\0\0\0" * MANY_ELEMENTS)
    else:
        t.contents.bytes_contents.extend([b"ab"] * MANY_ELEMENTS)
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        tracemalloc.start()
        try:
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(req, timeout=STREAM_TIMEOUT_S)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one element" in e.value.details()
    assert peak < REFUSAL_PEAK_BYTES


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    """Silero VAD with a queue of 64 (issue 38 row 4's figure) whose batches wait up to 5 ms
    for a second sequence (an idle one holds the lane's other slot), so a stream is faster
    than the model on any box."""
    home = S.prepared_home(tmp_path_factory)
    q64 = {"name": "vad_q64", "backend": "vad", "instances": 1, "intra_op_threads": 1,
           "batching": {"max_batch_size": 2, "max_queue_size": 64},
           "sequence": {"strategy": "direct", "max_sequence_idle_us": 60_000_000,
                        "max_queue_delay_us": 5000, "minimum_slot_utilization": 1.0}}
    srv = S.default_server(home, [q64])
    yield srv
    srv.stop()


def test_a_fast_model_stream_infer_sequence_past_the_queue_loses_no_chunk(paced, fixtures_dir):
    """Issue 38 row 4: OIP ModelStreamInfer, max_queue_size = 64, 600 chunks of one sequence
    sent at once had 475 refused mid-sequence; the stream is now paced by the queue (it stops
    reading while the queue is full): every chunk answered, in order, none refused."""
    audio = np.load(fixtures_dir / "silero_vad_reference.npz")["audio"][0]
    n_ref = audio.size // VAD_CHUNK
    n = 600
    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(paced.grpc_target)
    idle = grpcclient.InferInput("x", [1, VAD_CHUNK], "FP32")
    idle.set_data_from_numpy(audio[None, :VAD_CHUNK].astype(np.float32))
    c.infer("vad_q64", [idle], sequence_id=78, sequence_start=True)  # holds the other slot
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for k in range(n):
            j = k % n_ref
            inp = grpcclient.InferInput("x", [1, VAD_CHUNK], "FP32")
            inp.set_data_from_numpy(audio[j * VAD_CHUNK:(j + 1) * VAD_CHUNK].astype(np.float32)[None])
            c.async_stream_infer("vad_q64", [inp], request_id=str(k), sequence_id=77,
                                 sequence_start=k == 0, sequence_end=k == n - 1)
        got = [results.get(timeout=STREAM_TIMEOUT_S) for _ in range(n)]
    finally:
        c.stop_stream()
        c.close()
    errors = [str(e) for _, e in got if e is not None]
    assert not errors, (len(errors), errors[:2])
    assert [int(r.get_response().id) for r, _ in got] == list(range(n))

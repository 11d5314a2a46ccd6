"""The Open Inference Protocol (KServe v2) under /v2, driven by the real ``tritonclient``
(HTTP): health and metadata, ``text_embed`` by BYTES text and by INT64 token ids equal to the
native API, a generic tensor task with JSON and binary tensors, ``vad`` as a sequence through
the sequence parameters equal to the Silero fixture, and errors as the client raises them."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import serve_support as S

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

VAD_CHUNK = 512
VAD_TOLERANCE = 1e-4
EMBED_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("oip")
    srv = S.default_server(home, S.onnx_config(tmp, slow=False)["tasks"], server_kwargs={
        "grpc": False}, max_payload_bytes=1 << 20, system_shared_memory=True)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "lumen-core"
    assert "binary_tensor_data" in meta["extensions"]
    assert client.is_model_ready("text_embed")
    assert client.is_model_ready("text_embed", "1")
    assert not client.is_model_ready("no_such_task")
    assert not client.is_model_ready("text_embed", "7")


def test_model_metadata_from_the_contract(client):
    meta = client.get_model_metadata("text_embed")
    assert meta["name"] == "text_embed" and meta["versions"] == ["1"]
    by_type = {i["datatype"]: i for i in meta["inputs"]}
    assert by_type["INT64"]["shape"] == [1, -1]
    assert by_type["BYTES"]["shape"] == [1]
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [384]}]
    mlp = client.get_model_metadata("mlp", "1")
    assert mlp["inputs"][0]["datatype"] == "FP32"
    assert mlp["inputs"][0]["shape"][1] == S.D_IN
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("no_such_task")


def _native(server, text: str) -> np.ndarray:
    from lumen_core.request import InferRequest

    resp = server.call(server.runtime.infer(InferRequest("text_embed", text.encode(),
                                                         "text/plain")))
    return resp.outputs["embedding"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_text_embed_by_bytes_text_equals_the_native_api(server, client, binary):
    text = "the quick brown fox jumps over the lazy dog"
    inp = httpclient.InferInput("raw", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode()], dtype=object), binary_data=binary)
    out = httpclient.InferRequestedOutput("embedding", binary_data=binary)
    res = client.infer("text_embed", [inp], outputs=[out], request_id="r1")
    emb = res.as_numpy("embedding")
    assert emb.dtype == np.float32 and emb.shape == (384,)
    np.testing.assert_allclose(emb, _native(server, text), atol=EMBED_TOLERANCE)
    assert res.get_response()["id"] == "r1"


def test_text_embed_by_int64_token_ids_equals_the_native_api(server, client):
    rt = server.runtime
    ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)  # [CLS] hello world [SEP]
    native = server.call(rt.infer(rt.token_ids_request("text_embed", ids[0].tolist())))
    inp = httpclient.InferInput("bert_wordpiece_uncased_v1", list(ids.shape), "INT64")
    inp.set_data_from_numpy(ids)
    res = client.infer("text_embed", [inp])  # no outputs named: all, binary
    np.testing.assert_allclose(res.as_numpy("embedding"), native.outputs["embedding"],
                               atol=EMBED_TOLERANCE)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_generic_tensor_task_json_and_binary(server, client, binary):
    x = S.mlp_input(3)
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    res = client.infer("mlp", [inp], model_version="1")
    (name,) = [o["name"] for o in res.get_response()["outputs"]]
    native = server.call(server.runtime.infer(_tensor_request(x)))
    np.testing.assert_allclose(res.as_numpy(name), native.outputs[name], rtol=1e-6)


def _tensor_request(x: np.ndarray):
    from lumen_core.request import InferRequest

    return InferRequest("mlp", x.tobytes(), "application/octet-stream", S.tensor_meta(x.shape))


def test_vad_sequence_by_http_parameters_equals_the_fixture(client, fixtures_dir):
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    audio, probs = ref["audio"], ref["probs"]
    for s in range(audio.shape[0]):
        got = []
        n = audio.shape[1] // VAD_CHUNK
        for k in range(n):
            chunk = audio[s, k * VAD_CHUNK:(k + 1) * VAD_CHUNK].astype(np.float32)[None]
            inp = httpclient.InferInput("x", [1, VAD_CHUNK], "FP32")
            inp.set_data_from_numpy(chunk)
            res = client.infer("vad", [inp], sequence_id=1000 + s, sequence_start=k == 0,
                               sequence_end=k == n - 1)
            got.append(float(res.as_numpy("speech_prob").reshape(-1)[0]))
        np.testing.assert_allclose(got, probs[s], atol=VAD_TOLERANCE)


def test_errors_as_the_client_raises_them(server, client):
    x = S.mlp_input()
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="unknown model") as e:
        client.infer("no_such_task", [inp])
    assert e.value.status() == "404"
    with pytest.raises(InferenceServerException, match="no version"):
        client.infer("mlp", [inp], model_version="9")
    bad = httpclient.InferInput("x", [1, S.D_IN + 1], "FP32")
    bad.set_data_from_numpy(S.mlp_input().repeat(2, axis=1)[:, :S.D_IN + 1].copy())
    with pytest.raises(InferenceServerException) as e:
        client.infer("mlp", [bad])
    assert e.value.status() == "400"
    f64 = httpclient.InferInput("x", list(x.shape), "FP64")
    f64.set_data_from_numpy(x.astype(np.float64))
    with pytest.raises(InferenceServerException, match="datatype 'FP64' is not supported"):
        client.infer("mlp", [f64])
    with pytest.raises(InferenceServerException, match="exactly one input"):
        client.infer("mlp", [inp, inp])


def test_raw_http_errors_are_oip_shaped(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v2/models/mlp/infer", content=b"{not json")
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, S.D_IN],
                                       "parameters": {"binary_data_size": 8}}]}).encode()
        r = c.post("/v2/models/mlp/infer", content=body + b"\0" * 4,
                   headers={"Inference-Header-Content-Length": str(len(body))})
        assert r.status_code == 400 and "binary_data_size" in r.json()["error"]
        r = c.post("/v2/models/mlp/infer", content=body + b"\0" * 8,
                   headers={"Inference-Header-Content-Length": str(len(body))})
        assert r.status_code == 400, r.text  # 8 bytes for 16 floats: the tensor route says so
        r = c.get("/v2/health/ready")
        assert r.status_code == 200 and r.json() == {"ready": True}


def test_vad_raw_bytes_with_content_type_priority_and_timeout(client, fixtures_dir):
    """A BYTES input goes the raw route under the request's content_type parameter; priority
    and timeout are accepted (mapped to lumen.priority / lumen.timeout_ms)."""
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    chunk = ref["audio"][0, :VAD_CHUNK].astype("<f4").tobytes()
    inp = httpclient.InferInput("raw", [1], "BYTES")
    inp.set_data_from_numpy(np.array([chunk], dtype=object))
    res = client.infer("vad", [inp], sequence_id="raw-seq", sequence_start=True,
                       sequence_end=True, priority=1, timeout=30_000_000,
                       parameters={"content_type": "audio/pcm;format=f32le;rate=16000"})
    prob = float(res.as_numpy("speech_prob").reshape(-1)[0])
    assert abs(prob - float(ref["probs"][0, 0])) < VAD_TOLERANCE


def test_shared_memory_input_equals_inline_bytes(client):
    """An input in a registered system shared-memory region (tritonclient.utils.shared_memory)
    gives the inline answer; status and unregister; hostile registrations and uses refused."""
    import os

    import tritonclient.utils.shared_memory as shm

    x = S.mlp_input(7)
    inline = httpclient.InferInput("x", list(x.shape), "FP32")
    inline.set_data_from_numpy(x)
    want = client.infer("mlp", [inline])
    (name,) = [o["name"] for o in want.get_response()["outputs"]]
    key = f"/lumen_oip_test_{os.getpid()}"
    handle = shm.create_shared_memory_region("in0", key, 64 + x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x], offset=64)
        client.register_system_shared_memory("in0", key, 64 + x.nbytes)
        assert client.get_system_shared_memory_status("in0")[0]["byte_size"] == 64 + x.nbytes
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_shared_memory("in0", x.nbytes, offset=64)
        got = client.infer("mlp", [inp])
        np.testing.assert_array_equal(got.as_numpy(name), want.as_numpy(name))
        past = httpclient.InferInput("x", list(x.shape), "FP32")
        past.set_shared_memory("in0", x.nbytes, offset=65)
        with pytest.raises(InferenceServerException, match="exceeds"):
            client.infer("mlp", [past])
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_system_shared_memory("in0", key, 8)
        with pytest.raises(InferenceServerException, match="must be one name"):
            client.register_system_shared_memory("evil", "/../etc/passwd", 8)
        with pytest.raises(InferenceServerException, match="within the object"):
            client.register_system_shared_memory("big", key, 1 << 20)
        with pytest.raises(InferenceServerException, match="unable to open"):
            client.register_system_shared_memory("none", "/lumen_no_such_region", 8)
        # the output into a region too: the client reads it from there
        out_key = key + "_out"
        want_arr = want.as_numpy(name)
        out_handle = shm.create_shared_memory_region("out0", out_key, want_arr.nbytes)
        try:
            client.register_system_shared_memory("out0", out_key, want_arr.nbytes)
            req_out = httpclient.InferRequestedOutput(name)
            req_out.set_shared_memory("out0", want_arr.nbytes)
            res = client.infer("mlp", [inp], outputs=[req_out])
            assert res.get_output(name)["parameters"]["shared_memory_region"] == "out0"
            got = shm.get_contents_as_numpy(out_handle, want_arr.dtype, want_arr.shape)
            np.testing.assert_array_equal(got, want_arr)
            small = httpclient.InferRequestedOutput(name)
            small.set_shared_memory("out0", want_arr.nbytes - 4)
            with pytest.raises(InferenceServerException, match="was given"):
                client.infer("mlp", [inp], outputs=[small])
        finally:
            client.unregister_system_shared_memory("out0")
            shm.destroy_shared_memory_region(out_handle)
        os.truncate("/dev/shm/" + key.lstrip("/"), 16)  # shrunk under the server
        with pytest.raises(InferenceServerException, match="truncated"):
            client.infer("mlp", [inp])
        client.unregister_system_shared_memory("in0")
        assert client.get_system_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match="no shared memory region"):
            client.infer("mlp", [inp])
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def test_shared_memory_is_off_unless_enabled():
    from lumen_core.errors import InvalidArgument
    from lumen_core.serve.shm import Caller, ShmRegistry

    reg = ShmRegistry(enabled=False)
    with pytest.raises(InvalidArgument, match="system_shared_memory = true"):
        reg.register(Caller(None, True), "r", "/k", 0, 8)
    with pytest.raises(InvalidArgument, match="off on this server"):
        reg.view(Caller(None, True), "r", 0, 8)


def test_api_keys_on_the_oip_routes(tmp_path):
    """With API keys on: /v2/health/live is open, everything else needs the key (HTTP and the
    gRPC service alike)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from lumen_core.runtime import Runtime

    key = "oip-test-key-0123456789"
    srv = S.ServerThread(Runtime.from_dict(S.onnx_config(tmp_path, slow=False, api_keys=[key])))
    try:
        host = srv.url.removeprefix("http://")
        anon = httpclient.InferenceServerClient(host)
        assert anon.is_server_live()
        with pytest.raises(InferenceServerException):
            anon.get_model_metadata("mlp")
        authed = httpclient.InferenceServerClient(host)
        x = S.mlp_input()
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        auth = {"Authorization": f"Bearer {key}"}
        assert authed.infer("mlp", [inp], headers=auth).get_response()["model_name"] == "mlp"
        with pytest.raises(InferenceServerException):
            authed.infer("mlp", [inp])
        req = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[x.tobytes()])
        req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
        md = [("authorization", f"Bearer {key}")]
        with grpc.insecure_channel(srv.grpc_target) as ch:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(req)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = stub.ModelInfer(req, metadata=md)
            assert out.model_name == "mlp"
            # issue 25 row 6: readiness and metadata need the key too (ModelReady would tell
            # who has no key which models exist); liveness stays open, as on HTTP
            assert stub.ServerLive(service_pb2.ServerLiveRequest()).live
            for call, msg in ((stub.ServerReady, service_pb2.ServerReadyRequest()),
                              (stub.ModelReady, service_pb2.ModelReadyRequest(name="mlp")),
                              (stub.ModelReady, service_pb2.ModelReadyRequest(name="nope")),
                              (stub.ServerMetadata, service_pb2.ServerMetadataRequest())):
                for metadata in (None, [("authorization", "Bearer wrong-key")]):
                    with pytest.raises(grpc.RpcError) as e:
                        call(msg, metadata=metadata)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, call
            assert stub.ServerReady(service_pb2.ServerReadyRequest(), metadata=md).ready
            assert stub.ModelReady(service_pb2.ModelReadyRequest(name="mlp"), metadata=md).ready
            assert not stub.ModelReady(service_pb2.ModelReadyRequest(name="nope"),
                                       metadata=md).ready
            assert stub.ServerMetadata(service_pb2.ServerMetadataRequest(),
                                       metadata=md).name == "lumen-core"
        anon.close()
        authed.close()
    finally:
        srv.stop()


def test_compressed_requests(server, client):
    x = S.mlp_input(2)
    for algo in ("gzip", "deflate"):
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = client.infer("mlp", [inp], request_compression_algorithm=algo)
        assert res.get_response()["model_name"] == "mlp"
    with httpx.Client(base_url=server.url, timeout=30) as c:
        import zlib
        bomb = zlib.compress(b"\0" * (4 << 20))  # inflates past the 1 MiB limit
        r = c.post("/v2/models/mlp/infer", content=bomb, headers={"Content-Encoding": "deflate"})
        assert r.status_code == 413 and "decompressed" in r.json()["error"]
        r = c.post("/v2/models/mlp/infer", content=b"{}", headers={"Content-Encoding": "br"})
        assert r.status_code == 415


# -- hostile clients, round 2 (issue 25) --------------------------------------------------------
#: BYTES elements of a refused input: far more than one, few enough for a quick test
MANY_ELEMENTS = 128 * 1024
#: the most Python memory the refusal of MANY_ELEMENTS may allocate (a view per element: 20 MB)
REFUSAL_PEAK_BYTES = 64 * 1024


def _post_infer(server, task: str, inp: dict, binary: bytes = b"", **headers):
    head = json.dumps({"inputs": [inp]}).encode()
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(head))
    return httpx.post(f"{server.url}/v2/models/{task}/infer", content=head + binary,
                      headers=headers, timeout=30)


def test_many_bytes_elements_are_refused_without_building_them(server):
    """Row 1: a BYTES input of many empty elements is refused at the second element (a 400
    naming the one-element rule), not after a view of each was built on the event loop."""
    import tracemalloc

    from lumen_core.errors import InvalidArgument
    from lumen_core.serve.oip_mapping import bytes_elements

    binary = memoryview(b"\0\0\0\0" * MANY_ELEMENTS)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="one element"):
            bytes_elements(binary, "raw")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < REFUSAL_PEAK_BYTES
    assert len(bytes_elements(b"\x02\0\0\0hi", "raw")) == 1
    for shape in ([1], [MANY_ELEMENTS]):
        inp = {"name": "raw", "datatype": "BYTES", "shape": shape,
               "parameters": {"binary_data_size": len(binary)}}
        r = _post_infer(server, "text_embed", inp, bytes(binary))
        assert r.status_code == 400 and "one element" in r.json()["error"], r.text


def test_a_huge_inference_header_length_is_a_400(server):
    """Row 3: Inference-Header-Content-Length of 5,000 digits (past Python's int digit limit)."""
    r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=b"{}", timeout=30,
                   headers={"Inference-Header-Content-Length": "9" * 5000})
    assert r.status_code == 400, r.text
    assert "Inference-Header-Content-Length" in r.json()["error"]


@pytest.mark.parametrize("datatype", [["FP32"], {"FP32": 1}, 32, True],
                         ids=["list", "object", "number", "bool"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_a_datatype_that_is_not_a_string_is_a_400(server, datatype, binary):
    """Row 4: ``datatype`` as a list or an object was a 500 "unhashable type"."""
    x = S.mlp_input()
    inp = {"name": "x", "datatype": datatype, "shape": list(x.shape)}
    if binary:
        inp["parameters"] = {"binary_data_size": x.nbytes}
        r = _post_infer(server, "mlp", inp, x.tobytes())
    else:
        inp["data"] = x.reshape(-1).tolist()
        r = _post_infer(server, "mlp", inp)
    assert r.status_code == 400, r.text
    assert "datatype" in r.json()["error"]


@pytest.mark.parametrize("task,datatype,data", [
    ("text_embed", "INT64", [101.7, 7592.2, 2088.0, 102.9]),
    ("text_embed", "INT64", ["101", "7592", "2088", "102"]),
    ("text_embed", "INT64", [True, 7592, 2088, 102]),
    ("text_embed", "INT64", [101, 7592, 2088, 2 ** 64]),
    ("mlp", "FP32", ["1.5"] * S.D_IN),
    ("mlp", "FP32", [True] * S.D_IN),
], ids=["int64-floats", "int64-strings", "int64-bool", "int64-too-big", "fp32-strings",
        "fp32-bools"])
def test_json_data_of_the_wrong_kind_is_a_400_not_converted(server, task, datatype, data):
    """Row 5: INT64 data given as floats or strings was silently truncated into token ids."""
    inp = {"name": "x", "datatype": datatype, "shape": [1, len(data)], "data": data}
    r = _post_infer(server, task, inp)
    assert r.status_code == 400, r.text
    assert "'data' must be" in r.json()["error"]


def test_json_data_of_the_right_kind_still_converts(server):
    ids = [101, 7592, 2088, 102]
    inp = {"name": "x", "datatype": "INT64", "shape": [1, 4], "data": ids}
    assert _post_infer(server, "text_embed", inp).status_code == 200
    inp = {"name": "x", "datatype": "FP32", "shape": [1, S.D_IN], "data": [1] * S.D_IN}
    assert _post_infer(server, "mlp", inp).status_code == 200  # integers are FP32 numbers

"""Hostile request shapes at the front doors of issue 25 (Done when: "no 500 on client input
anywhere"): the Open Inference Protocol over REST and gRPC, and the WebSocket stream's
messages.  Hypothesis builds requests that are near the protocol (the right keys with values
of any JSON type, odd datatypes, shapes and parameters, lying lengths, random bytes) and
anything else; whatever it sends, the answer is a client error or a result, never a 500,
``INTERNAL`` / ``UNKNOWN`` or a 4500 close, and nothing is logged as an unhandled error.
Examples are bounded and derandomized, so the pass takes a few seconds and is the same each run.
"""
from __future__ import annotations

import asyncio
import json
import logging
import struct

import grpc
import httpx
import pytest
import serve_support as S
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402 - the protocol's own messages
from tritonclient.grpc import service_pb2_grpc as pb_grpc  # noqa: E402

#: examples per front door: enough to reach each branch of the parsers, few enough for seconds
REST_EXAMPLES = 150
GRPC_EXAMPLES = 100
WS_EXAMPLES = 60
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
WAIT_S = 30
#: close codes of a server fault: the internal error's, and WebSocket's own "internal error"
FAULT_CLOSES = (4500, 1011)

MODELS = ["mlp", "text_embed", "vad", "nope", ""]
OUTPUTS = ["embedding", "y", "speech_prob", "z"]
DATATYPES = ["FP32", "INT64", "BYTES", "UINT8", "BOOL", "FP16", "INT8", "INT32", "FP64", ""]
PARAM_KEYS = ["binary_data_size", "binary_data", "binary_data_output", "content_type",
              "sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
              "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset",
              "lumen.tensor.layout", "lumen.preprocess.id", "lumen.model.version",
              "lumen.sequence.id", "lumen.bogus", "x"]
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=False), st.text(max_size=12))
JSON_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12)


def _or_any(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly ``strategy``, sometimes any JSON value in its place."""
    return st.one_of(strategy, strategy, JSON_VALUES)


_SHAPES = st.lists(st.one_of(st.integers(0, 4), st.integers(-2, 2**40)), max_size=4)
_PARAMS = st.dictionaries(st.sampled_from(PARAM_KEYS), _SCALARS, max_size=3)
_DATA = st.one_of(st.lists(st.integers(-5, 30000), max_size=20),
                  st.lists(st.floats(-10, 10), max_size=20),
                  st.lists(st.text(max_size=8), max_size=3),
                  st.lists(st.lists(st.integers(0, 9), max_size=4), max_size=4), JSON_VALUES)
_INPUT = st.fixed_dictionaries({}, optional={
    "name": _or_any(st.sampled_from(["x", "raw", "bert_wordpiece_uncased_v1"])),
    "datatype": _or_any(st.sampled_from(DATATYPES)), "shape": _or_any(_SHAPES),
    "data": _DATA, "parameters": _or_any(_PARAMS)})
_BODY = st.fixed_dictionaries({}, optional={
    "inputs": _or_any(st.lists(_or_any(_INPUT), max_size=2)),
    "outputs": _or_any(st.lists(st.fixed_dictionaries(
        {"name": _or_any(st.sampled_from(OUTPUTS))},
        optional={"parameters": _or_any(_PARAMS)}), max_size=2)),
    "parameters": _or_any(_PARAMS), "id": _or_any(st.text(max_size=8))})


#: what a header value may hold as a client sends it (httpx refuses the rest itself)
_HEADER_CHARS = st.characters(min_codepoint=33, max_codepoint=126)


def _bytes_elements(items: list) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


_BINARY = st.one_of(st.just(b""), st.binary(max_size=96),
                    st.lists(st.binary(max_size=8), max_size=5).map(_bytes_elements))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = S.prepared_home(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("fuzz")
    srv = S.default_server(home, S.onnx_config(tmp, slow=False)["tasks"],
                           max_payload_bytes=1 << 20)
    yield srv
    srv.stop()


@pytest.fixture()
def no_unhandled_errors(caplog):
    """Fails the test if the server logged an unhandled error (a traceback) meanwhile."""
    with caplog.at_level(logging.ERROR, logger="lumen"):
        yield
    faults = [r.getMessage() for r in caplog.records
              if r.name.startswith("lumen") and r.levelno >= logging.ERROR]
    assert not faults, faults


def test_oip_rest_request_shapes(server, no_unhandled_errors):
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
        @settings(max_examples=REST_EXAMPLES, **FUZZ)
        @given(model=st.sampled_from(MODELS), body=_or_any(_BODY), binary=_BINARY,
               header=st.one_of(st.none(), st.just("auto"), st.text(_HEADER_CHARS, max_size=8),
                                st.integers(-5, 10**30).map(str), st.just("9" * 5000)),
               encoding=st.sampled_from([None, "gzip", "deflate", "identity", "br"]))
        def run(model, body, binary, header, encoding):
            head = json.dumps(body).encode()
            headers = {"Content-Type": "application/json"}
            if header == "auto":
                header = str(len(head))
            if header is not None:
                headers["Inference-Header-Content-Length"] = header
            if encoding is not None:
                headers["Content-Encoding"] = encoding
            r = client.post(f"/v2/models/{model}/infer", content=head + binary, headers=headers)
            assert r.status_code < 500, (r.status_code, r.text)
            if r.status_code >= 400:  # the OIP shape, or Lumen's for the router's own 404
                assert r.json()["error"], r.text

        run()


_GRPC_PARAM = st.one_of(st.builds(lambda v: pb.InferParameter(bool_param=v), st.booleans()),
                        st.builds(lambda v: pb.InferParameter(int64_param=v),
                                  st.integers(-2**63, 2**63 - 1)),
                        st.builds(lambda v: pb.InferParameter(string_param=v),
                                  st.text(max_size=10)),
                        st.builds(lambda v: pb.InferParameter(double_param=v),
                                  st.floats(allow_nan=False)))
_GRPC_PARAMS = st.dictionaries(st.sampled_from(PARAM_KEYS), _GRPC_PARAM, max_size=3)


#: the typed contents fields of an input, and their element values
_CONTENTS = {"fp32_contents": st.floats(-5, 5, width=32), "bool_contents": st.booleans(),
             "bytes_contents": st.binary(max_size=16),
             "uint_contents": st.integers(0, 2**32 - 1),
             "int_contents": st.integers(-2**31, 2**31 - 1),
             "int64_contents": st.integers(-2**63, 2**63 - 1)}


@st.composite
def _model_infer(draw) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=draw(st.sampled_from(MODELS)),
                               model_version=draw(st.sampled_from(["", "", "1", "7"])),
                               id=draw(st.text(max_size=6)))
    for k, v in draw(_GRPC_PARAMS).items():
        msg.parameters[k].CopyFrom(v)
    for _ in range(draw(st.integers(0, 2))):
        t = msg.inputs.add(
            name=draw(st.sampled_from(["x", "raw", "", "bert_wordpiece_uncased_v1"])),
            datatype=draw(st.one_of(st.sampled_from(DATATYPES), st.text(max_size=6))),
            shape=draw(st.lists(st.integers(-3, 2**40), max_size=4)))
        for k, v in draw(_GRPC_PARAMS).items():
            t.parameters[k].CopyFrom(v)
        field = draw(st.sampled_from([None, *_CONTENTS]))
        if field is not None:
            getattr(t.contents, field).extend(draw(st.lists(_CONTENTS[field], max_size=20)))
    for _ in range(draw(st.integers(0, 2))):
        msg.raw_input_contents.append(draw(_BINARY))
    for name in draw(st.lists(st.sampled_from(OUTPUTS), max_size=2)):
        o = msg.outputs.add(name=name)
        for k, v in draw(_GRPC_PARAMS).items():
            o.parameters[k].CopyFrom(v)
    return msg


def test_oip_grpc_request_shapes(server, no_unhandled_errors):
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        @settings(max_examples=GRPC_EXAMPLES, **FUZZ)
        @given(msg=_model_infer(), stream=st.lists(_model_infer(), max_size=3),
               name=st.text(max_size=8), version=st.text(max_size=4))
        def run(msg, stream, name, version):
            try:
                stub.ModelInfer(msg, timeout=WAIT_S)
            except grpc.RpcError as e:
                assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                    e.code(), e.details())
            for reply in stub.ModelStreamInfer(iter(stream), timeout=WAIT_S):
                assert not reply.error_message.startswith("internal"), reply.error_message
            for call, req in ((stub.ModelReady, pb.ModelReadyRequest(name=name, version=version)),
                              (stub.ModelMetadata,
                               pb.ModelMetadataRequest(name=name, version=version))):
                try:
                    call(req, timeout=WAIT_S)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details())

        run()


_WS_KEYS = ["mime", "probabilities", "event", "api_key", "lumen.vad.threshold",
            "lumen.vad.min_silence_duration_ms", "lumen.sequence.id", "lumen.bogus", "x"]
_WS_VALUES = st.one_of(_SCALARS, st.sampled_from(
    ["audio/L16;rate=16000", "audio/pcm;format=f32le;rate=16000", "audio/L16;rate=8000",
     "end", "eof", "0.6", "true"]), JSON_VALUES)
_WS_TEXT = st.one_of(
    st.dictionaries(st.sampled_from(_WS_KEYS), _WS_VALUES, max_size=3).map(json.dumps),
    JSON_VALUES.map(json.dumps), st.text(max_size=40),
    st.sampled_from([2, 8000]).map(lambda n: "[" * n + "]" * n))  # past the decoder's depth
_WS_MESSAGES = st.lists(st.one_of(_WS_TEXT, st.binary(max_size=2048)), max_size=4)
_WS_QUERY = st.dictionaries(st.sampled_from(_WS_KEYS), st.text(max_size=10), max_size=2)


def test_websocket_message_shapes(server, no_unhandled_errors):
    base = server.url.replace("http://", "ws://")

    async def session(task: str, query: dict, messages: list) -> tuple:
        url = f"{base}/v1/stream/{task}?" + str(httpx.QueryParams(query))
        async with websockets.connect(url) as ws:
            for m in messages:
                try:
                    await ws.send(m)
                except websockets.ConnectionClosed:
                    break
            try:
                await ws.send(json.dumps({"event": "end"}))
            except websockets.ConnectionClosed:
                pass
            events = []
            try:
                async for text in ws:
                    events.append(json.loads(text))
            except websockets.ConnectionClosed:
                pass
            return ws.close_code, events

    @settings(max_examples=WS_EXAMPLES, **FUZZ)
    @given(task=st.sampled_from(["vad", "vad", "mlp", "nope"]), query=_WS_QUERY,
           messages=_WS_MESSAGES)
    def run(task, query, messages):
        code, events = asyncio.run(asyncio.wait_for(session(task, query, messages), WAIT_S))
        assert code not in FAULT_CLOSES, (code, events)
        assert code == 1000 or events[-1]["event"] == "error", (code, events)

    run()

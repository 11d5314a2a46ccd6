"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService`` beside
``lumen.v1.Inference`` on the same server, model = task.

Messages come from the vendored ``proto/open_inference_grpc.proto`` (its package is renamed so
it can live in one process with tritonclient's own copy; the service is registered here under
the protocol's name, so the wire is the protocol's).  The mapping onto the runtime is the
REST one (:mod:`.oip_mapping`): a numeric input is a tensor-route request, a one-element
``BYTES`` input a raw-route request; ``raw_input_contents`` or the typed ``contents`` carry
the data, outputs go back as ``raw_output_contents``.  ``ModelStreamInfer`` answers each request of a stream in
turn (an error is an ``error_message`` and the stream stays open), the transport for
sequences; it shares ``lumen.v1.Inference``'s stream window (:func:`.streams.windowed_replies`:
at most ``stream_window`` requests and ``stream_window_bytes`` of their tensor bytes and of
their replies not yet sent, admitted and unanswered per stream; the stream is not read further
meanwhile) and in-flight counts.

Errors are gRPC statuses from Lumen's error table, with the ``lumen-error-code`` /
``lumen-error-field`` trailing metadata of the Lumen service.
"""
from __future__ import annotations

import logging
import math
from typing import Any, AsyncIterator, Optional

import grpc
import numpy as np

from ..contract import DTYPES, KEY_MODEL_VERSION, KEY_SEQUENCE_ID
from ..errors import InternalError, InvalidArgument, LumenError, PayloadTooLarge, Unavailable
from . import codec, shm
from . import oip_mapping as oip
from .auth import unscope_error
from .proto import open_inference_grpc_pb2 as pb
from .streams import call_metadata

log = logging.getLogger("lumen.oip.grpc")

#: the service's name in the protocol (what every OIP client calls)
SERVICE = "inference.GRPCInferenceService"
ERROR_CODE_KEY = "lumen-error-code"
ERROR_FIELD_KEY = "lumen-error-field"
#: the HTTP route whose ``open_endpoints`` entry also opens ``ServerReady``
READY_ENDPOINT = "/v2/health/ready"


def _message_bytes(msg: Any) -> int:
    """The tensor bytes a ModelInferRequest carries (what the stream window bounds)."""
    return sum(len(b) for b in msg.raw_input_contents) or msg.ByteSize()


#: typed ``contents`` field per OIP datatype (raw_input_contents is what tritonclient sends)
_CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT32": "int_contents",
                   "INT64": "int64_contents", "UINT8": "uint_contents", "FP32": "fp32_contents",
                   "BYTES": "bytes_contents"}


class _TooLarge:
    """What the deserializer hands the servicer for a message over the limit (never parsed)."""

    __slots__ = ("nbytes", "limit")

    def __init__(self, nbytes: int, limit: int):
        self.nbytes = nbytes
        self.limit = limit

    def error(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request message is {self.nbytes} bytes; the limit is "
                               f"{self.limit} (server.max_payload_bytes plus headroom)", "payload")


def _deserializer(limit: int) -> Any:
    parse = pb.ModelInferRequest.FromString

    def deserialize(data: bytes) -> Any:
        return _TooLarge(len(data), limit) if len(data) > limit else parse(data)

    return deserialize


def _param(p: Any) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def _params(m: Any) -> dict:
    return {k: v for k, v in ((k, _param(p)) for k, p in m.items()) if v is not None}


def _set_param(m: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        m[key].bool_param = value
    elif isinstance(value, int):
        m[key].int64_param = value
    else:
        m[key].string_param = str(value)


class OipServicer:
    """``inference.GRPCInferenceService`` over the Lumen servicer ``base`` (its runtime, API
    keys, draining flag and request counter are shared)."""

    def __init__(self, base: Any, version: Optional[str] = None):
        self.base = base
        self.version = oip.package_version() if version is None else version
        self.shm = shm.registry_for(base.runtime)

    @property
    def rt(self) -> Any:
        return self.base.runtime

    def handlers(self, max_message_bytes: int) -> dict:
        ser = lambda cls: cls.SerializeToString  # noqa: E731
        u = grpc.unary_unary_rpc_method_handler
        return {
            "ServerLive": u(self.ServerLive, pb.ServerLiveRequest.FromString,
                            ser(pb.ServerLiveResponse)),
            "ServerReady": u(self.ServerReady, pb.ServerReadyRequest.FromString,
                             ser(pb.ServerReadyResponse)),
            "ModelReady": u(self.ModelReady, pb.ModelReadyRequest.FromString,
                            ser(pb.ModelReadyResponse)),
            "ServerMetadata": u(self.ServerMetadata, pb.ServerMetadataRequest.FromString,
                                ser(pb.ServerMetadataResponse)),
            "ModelMetadata": u(self.ModelMetadata, pb.ModelMetadataRequest.FromString,
                               ser(pb.ModelMetadataResponse)),
            "ModelInfer": u(self.ModelInfer, _deserializer(max_message_bytes),
                            ser(pb.ModelInferResponse)),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                self.ModelStreamInfer, _deserializer(max_message_bytes),
                ser(pb.ModelStreamInferResponse)),
            "SystemSharedMemoryStatus": u(
                self.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest.FromString,
                ser(pb.SystemSharedMemoryStatusResponse)),
            "SystemSharedMemoryRegister": u(
                self.SystemSharedMemoryRegister,
                pb.SystemSharedMemoryRegisterRequest.FromString,
                ser(pb.SystemSharedMemoryRegisterResponse)),
            "SystemSharedMemoryUnregister": u(
                self.SystemSharedMemoryUnregister,
                pb.SystemSharedMemoryUnregisterRequest.FromString,
                ser(pb.SystemSharedMemoryUnregisterResponse)),
        }

    def add_to(self, server: Any, max_message_bytes: int) -> None:
        handlers = self.handlers(max_message_bytes)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    # -- plumbing -------------------------------------------------------------------------
    async def _abort(self, context: Any, method: str, exc: LumenError) -> None:
        self.base.count_call("oip." + method, exc.grpc_status)
        context.set_trailing_metadata(((ERROR_CODE_KEY, exc.code),
                                       (ERROR_FIELD_KEY, exc.field or "")))
        await context.abort(grpc.StatusCode[exc.grpc_status], exc.message)

    def _ready(self) -> bool:
        return not self.base.draining and bool(self.rt.ready)

    async def _authenticate(self, context: Any, method: str) -> None:
        """Abort the call UNAUTHENTICATED unless it carries a key (when keys are on)."""
        try:
            self.base.key_scope(context)
        except LumenError as exc:
            await self._abort(context, method, exc)

    def _caller(self, context: Any) -> shm.Caller:
        """The caller's key scope (Unauthenticated without a key) and whether its peer is
        local, for shared memory (``.owner`` is the scope every request is keyed under)."""
        return shm.grpc_caller(self.base.key_scope(context), context.peer(),
                               context.invocation_metadata() or ())

    # -- health and metadata --------------------------------------------------------------
    # With API keys on, everything but liveness needs a key, as on HTTP: ModelReady would tell
    # a caller without one which models exist; ServerReady is open when HTTP's
    # /v2/health/ready is (``[server] open_endpoints``)
    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        if READY_ENDPOINT not in self.base.keys.open_endpoints:
            await self._authenticate(context, "ServerReady")
        return pb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        await self._authenticate(context, "ModelReady")
        try:
            oip.check_model(self.rt, request.name, request.version)
        except LumenError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        await self._authenticate(context, "ServerMetadata")
        m = oip.server_metadata(self.version, self.shm.enabled)
        return pb.ServerMetadataResponse(name=m["name"], version=m["version"],
                                         extensions=m["extensions"])

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            self.base.key_scope(context)
            m = oip.model_metadata(self.rt, request.name, request.version)
        except LumenError as exc:
            await self._abort(context, "ModelMetadata", exc)
        T = pb.ModelMetadataResponse.TensorMetadata  # noqa: N806
        return pb.ModelMetadataResponse(
            name=m["name"], versions=m["versions"], platform=m["platform"],
            inputs=[T(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                    for t in m["inputs"]],
            outputs=[T(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                     for t in m["outputs"]])

    # -- system shared memory -------------------------------------------------------------
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            regions = self.shm.status(self._caller(context), request.name)
        except LumenError as exc:
            await self._abort(context, "SystemSharedMemoryStatus", exc)
        out = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            st = out.regions[r["name"]]
            st.name, st.key, st.offset, st.byte_size = (r["name"], r["key"], r["offset"],
                                                        r["byte_size"])
        return out

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            self.shm.register(self._caller(context), request.name, request.key, request.offset,
                              request.byte_size)
        except LumenError as exc:
            await self._abort(context, "SystemSharedMemoryRegister", exc)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            self.shm.unregister(self._caller(context), request.name)
        except LumenError as exc:
            await self._abort(context, "SystemSharedMemoryUnregister", exc)
        return pb.SystemSharedMemoryUnregisterResponse()

    # -- inference ------------------------------------------------------------------------
    def _request(self, msg: Any, caller: shm.Caller) -> tuple:
        """(the runtime request, the task's model version) for one ModelInferRequest."""
        if isinstance(msg, _TooLarge):
            raise msg.error()
        if self.base.draining:
            raise Unavailable("the server is shutting down; not accepting new requests")
        task = msg.model_name
        contract = oip.check_model(self.rt, task, msg.model_version)
        oip.check_inputs(list(msg.inputs))
        inp = msg.inputs[0]
        name = inp.name[:oip.MAX_ECHO]
        shape = tuple(int(d) for d in inp.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input {name!r}: 'shape' must be non-negative, got "
                                  f"{list(shape)}", "shape")
        inp_params = _params(inp.parameters)
        view = shm.input_view(self.shm, caller, inp_params)
        if view is None:
            data = self._input_data(msg, inp, name, shape)
        elif msg.raw_input_contents:
            raise InvalidArgument(f"input {name!r} names a shared memory region and also "
                                  f"carries raw_input_contents; send one of them",
                                  "shared_memory_region")
        else:
            data = oip.bytes_elements(view, name) if inp.datatype == codec.OIP_BYTES else view
        keys = self.base.keys
        req = oip.build_request(self.rt, task, name, inp.datatype, shape, data,
                                _params(msg.parameters), inp_params, msg.id,
                                lambda m: keys.scoped_meta(m, caller.owner))
        if msg.model_version:  # pins the version (check_model knows it is loaded)
            req.meta[KEY_MODEL_VERSION] = msg.model_version
        return req, contract.model_version

    @staticmethod
    def _input_data(msg: Any, inp: Any, name: str, shape: tuple) -> Any:
        datatype = inp.datatype
        if msg.raw_input_contents:
            if len(msg.raw_input_contents) != len(msg.inputs):
                raise InvalidArgument(f"raw_input_contents has {len(msg.raw_input_contents)} "
                                      f"entries for {len(msg.inputs)} inputs",
                                      "raw_input_contents")
            raw = msg.raw_input_contents[0]
            if datatype == codec.OIP_BYTES:
                return oip.bytes_elements(raw, name)
            return raw  # the tensor route checks its length against dtype x shape
        field = _CONTENTS_FIELD.get(datatype)
        dtype = codec.OIP_TO_DTYPE.get(datatype)
        if field is None or (dtype is None and datatype != codec.OIP_BYTES):
            if dtype is None:
                return b""  # build_request names the bad datatype
            raise InvalidArgument(f"input {name!r}: {datatype} data must be sent in "
                                  f"raw_input_contents", "raw_input_contents")
        values = getattr(inp.contents, field)
        if datatype == codec.OIP_BYTES:
            return values  # build_request takes its one element (no list of millions made)
        if len(values) != math.prod(shape):
            raise InvalidArgument(f"input {name!r}: contents has {len(values)} elements, shape "
                                  f"{list(shape)} needs {math.prod(shape)}", "contents")
        assert dtype is not None  # BYTES (no dtype) returned above
        try:
            return np.asarray(values, dtype=DTYPES[dtype])
        except (OverflowError, ValueError):
            raise InvalidArgument(f"input {name!r}: a value does not fit {datatype}",
                                  "contents") from None

    def _response(self, resp: Any, msg: Any, version: str, caller: shm.Caller) -> Any:
        wanted = [o.name for o in msg.outputs] or None
        shm_for = {o.name: p for o in msg.outputs
                   if oip.P_SHM_REGION in (p := _params(o.parameters))}
        served = resp.stats.version if resp.stats is not None else ""
        out = pb.ModelInferResponse(model_name=resp.task, model_version=served or version,
                                    id=msg.id)
        for name, arr in oip.output_arrays(resp, wanted):
            dt = codec.oip_datatype(arr)
            t = out.outputs.add(name=name, datatype=dt, shape=list(arr.shape))
            data = oip.bytes_tensor(arr) if dt == codec.OIP_BYTES else codec.tensor_bytes(arr)
            if name in shm_for:
                n = shm.output_write(self.shm, caller, shm_for[name], data)
                _set_param(t.parameters, oip.P_SHM_REGION, shm_for[name][oip.P_SHM_REGION])
                _set_param(t.parameters, oip.P_SHM_BYTE_SIZE, n)
                data = b""  # keeps raw_output_contents aligned with outputs
            out.raw_output_contents.append(data)
        for k, v in oip.response_parameters(resp).items():
            _set_param(out.parameters, k, v)
        return out

    async def _infer(self, msg: Any, caller: shm.Caller) -> Any:
        try:
            req, version = self._request(msg, caller)
            resp = await self.rt.infer(req)
            return self._response(resp, msg, version, caller)
        except LumenError as exc:
            raise unscope_error(exc, caller.owner) from None
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL, never kills the server
            log.exception("unhandled error in ModelInfer")
            raise InternalError(f"internal server error: {exc}") from exc

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        tr = getattr(self.base.runtime, "tracing", None)
        if tr is None:
            return await self._model_infer(request, context)
        # the transport span: a child of the caller's W3C traceparent metadata, if any
        with tr.rpc_span(SERVICE, "ModelInfer", call_metadata(context)):
            return await self._model_infer(request, context)

    async def _model_infer(self, request: Any, context: Any) -> Any:
        try:
            reply = await self._infer(request, self._caller(context))
        except LumenError as exc:
            await self._abort(context, "ModelInfer", exc)
        self.base.count_call("oip.ModelInfer", "OK")
        return reply

    async def _stream_one(self, msg: Any, caller: shm.Caller,
                          carrier: Optional[dict] = None) -> Any:
        tr = getattr(self.base.runtime, "tracing", None)
        if tr is None:
            return await self._stream_reply(msg, caller)
        with tr.rpc_span(SERVICE, "ModelStreamInfer", carrier):
            return await self._stream_reply(msg, caller)

    async def _stream_reply(self, msg: Any, caller: shm.Caller) -> Any:
        try:
            reply = pb.ModelStreamInferResponse(infer_response=await self._infer(msg, caller))
        except LumenError as exc:
            self.base.count_call("oip.ModelStreamInfer", exc.grpc_status)
            return pb.ModelStreamInferResponse(
                error_message=exc.message,
                infer_response=pb.ModelInferResponse(
                    model_name=getattr(msg, "model_name", ""), id=getattr(msg, "id", "")))
        self.base.count_call("oip.ModelStreamInfer", "OK")
        return reply

    async def ModelStreamInfer(self, request_iterator: AsyncIterator,  # noqa: N802
                               context: Any) -> AsyncIterator:
        try:
            caller = self._caller(context)
        except LumenError as exc:
            await self._abort(context, "ModelStreamInfer", exc)
        base = self.base  # one window rule and one in-flight count for both services
        carrier = call_metadata(context) if getattr(base.runtime, "tracing", None) else None
        async for reply in base.stream(request_iterator, _message_bytes,
                                       lambda msg: self._stream_one(msg, caller, carrier),
                                       lambda msg: self._stream_target(msg, caller)):
            yield reply

    def _stream_target(self, msg: Any, caller: shm.Caller) -> tuple:
        """``(task, scoped sequence id or None)`` of a stream message, for the pacing
        (``InferenceServicer.stream``); ``("", None)`` for one refused whatever the queue."""
        if isinstance(msg, _TooLarge):
            return "", None
        p = msg.parameters.get(oip.P_SEQUENCE_ID)
        sid = _param(p) if p is not None else None
        if sid in (None, 0, ""):
            return msg.model_name, None
        try:
            meta = self.base.keys.scoped_meta({KEY_SEQUENCE_ID: str(sid)}, caller.owner)
        except LumenError:
            return "", None
        return msg.model_name, meta[KEY_SEQUENCE_ID]

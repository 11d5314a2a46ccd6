"""The request model and its builder (SPEC section 1).

The builder only writes ``meta`` and never copies a payload that can be sent as is, so these
tests check both: the exact meta each method produces, and object identity / shared memory of
the payload.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest

import lumen_core as lc
from lumen_core import contract as C
from lumen_core.request import MIME_OCTET_STREAM

CLIP_PP = "clip_image_openai_v1"
CLIP = C.TensorContract(
    specs=(C.TensorSpec("fp32", "NCHW", {CLIP_PP}, ((1, 1), (3, 3), (4, 4), (4, 4))),),
    model_id="clip_vision_encoder", model_version="v1")


def test_plain_request_defaults():
    payload = bytearray(b"hello")
    req = lc.InferRequest(task="text_embed", payload=payload, payload_mime="text/plain")
    assert req.payload is payload
    assert (req.task, req.payload_mime, req.meta) == ("text_embed", "text/plain", {})
    assert "5 bytes" in repr(req)


def test_correlation_id_is_generated_uuid4_hex():
    a = lc.new_infer_request("t").for_raw_input(b"x", "text/plain").build()
    b = lc.InferRequest(task="t")
    for cid in (a.correlation_id, b.correlation_id):
        assert len(cid) == 32 and uuid.UUID(hex=cid).version == 4 and cid == cid.lower()
    assert a.correlation_id != b.correlation_id


def test_with_correlation_id():
    req = lc.new_infer_request("t").with_correlation_id("abc").build()
    assert req.correlation_id == "abc"


def test_for_raw_input():
    payload = memoryview(b"\xff\xd8jpeg")
    req = lc.new_infer_request("image_embed").for_raw_input(payload, "image/jpeg").build()
    assert req.payload is payload
    assert (req.task, req.payload_mime, req.meta) == ("image_embed", "image/jpeg", {})


def test_for_raw_input_drops_tensor_keys_but_keeps_request_keys():
    desc = lc.TensorDescriptor("fp32", (1, 3, 4, 4), "NCHW", CLIP_PP)
    req = (lc.new_infer_request("image_embed")
           .with_meta(C.KEY_PRIORITY, 2)
           .for_tensor_input(b"\0" * 192, desc)
           .for_raw_input(b"img", "image/png")
           .build())
    assert req.meta == {C.KEY_PRIORITY: "2", C.KEY_PREPROCESS_ID: CLIP_PP}
    assert req.payload_mime == "image/png"


def test_for_tensor_input_writes_the_descriptor_keys():
    payload = b"\0" * 192
    desc = lc.TensorDescriptor(dtype="fp32", shape=(1, 3, 4, 4), layout="NCHW",
                               preprocess_id=CLIP_PP, model_id="clip_vision_encoder",
                               model_version="v1")
    req = lc.new_infer_request("image_embed").for_tensor_input(payload, desc).build()
    assert req.payload is payload
    assert req.payload_mime == MIME_OCTET_STREAM
    assert req.meta == {
        C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "fp32", C.KEY_SHAPE: "[1,3,4,4]",
        C.KEY_LAYOUT: "NCHW", C.KEY_PREPROCESS_ID: CLIP_PP,
        C.KEY_MODEL_ID: "clip_vision_encoder", C.KEY_MODEL_VERSION: "v1",
    }


def test_tensor_descriptor_optional_keys_are_omitted():
    meta = lc.TensorDescriptor("int64", [1, np.int64(7)], "NL").to_meta()
    assert meta == {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "int64", C.KEY_SHAPE: "[1,7]",
                    C.KEY_LAYOUT: "NL"}


def test_for_tensor_array_is_zero_copy_for_contiguous_little_endian():
    arr = np.arange(48, dtype="<f4").reshape(1, 3, 4, 4)
    req = lc.new_infer_request("image_embed").for_tensor_array(arr, "NCHW", CLIP_PP).build()
    assert req.payload is arr
    assert req.meta[C.KEY_DTYPE] == "fp32" and req.meta[C.KEY_SHAPE] == "[1,3,4,4]"


def test_for_tensor_array_non_contiguous_is_made_contiguous():
    base = np.arange(96, dtype=np.float32).reshape(1, 3, 4, 8)
    view = base[..., ::2]
    req = lc.new_infer_request("image_embed").for_tensor_array(view, "NCHW", CLIP_PP).build()
    out = req.payload
    assert out.flags.c_contiguous and not np.shares_memory(out, base)
    np.testing.assert_array_equal(out, view)
    assert req.meta[C.KEY_SHAPE] == "[1,3,4,4]"


def test_for_tensor_array_big_endian_is_swapped_to_little():
    arr = np.arange(48, dtype=">f4").reshape(1, 3, 4, 4)
    req = lc.new_infer_request("image_embed").for_tensor_array(arr, "NCHW", CLIP_PP).build()
    out = req.payload
    assert out.dtype == np.dtype("<f4") and out.flags.c_contiguous
    np.testing.assert_array_equal(out, arr)
    assert bytes(memoryview(out)) == np.arange(48, dtype="<f4").tobytes()
    assert req.meta[C.KEY_DTYPE] == "fp32"


@pytest.mark.parametrize("dtype,name", [(np.uint8, "uint8"), (np.int64, "int64"),
                                        (np.float16, "fp16"), (np.int32, "int32"),
                                        (np.int8, "int8"), (np.bool_, "bool")])
def test_for_tensor_array_dtype_names(dtype, name):
    arr = np.zeros((1, 5), dtype=dtype)
    req = lc.new_infer_request("t").for_tensor_array(arr, "NC").build()
    assert req.payload is arr and req.meta[C.KEY_DTYPE] == name


@pytest.mark.parametrize("dtype", [np.float64, np.complex64, np.uint16])
def test_for_tensor_array_unsupported_dtype(dtype):
    with pytest.raises(ValueError, match="no lumen dtype"):
        lc.new_infer_request("t").for_tensor_array(np.zeros((1, 2), dtype=dtype), "NC")


def test_with_meta_stringifies_values():
    req = (lc.new_infer_request("t")
           .with_meta(C.KEY_PREPROCESS_SKIP, True)
           .with_meta(C.KEY_SEQUENCE_END, False)
           .with_meta(C.KEY_TIMEOUT_MS, 250)
           .with_metas({"x-user": "u1", C.KEY_PRIORITY: 1})
           .build())
    assert req.meta == {C.KEY_PREPROCESS_SKIP: "true", C.KEY_SEQUENCE_END: "false",
                        C.KEY_TIMEOUT_MS: "250", "x-user": "u1", C.KEY_PRIORITY: "1"}


def test_build_snapshots_meta():
    builder = lc.new_infer_request("t").with_meta("a", "1")
    first = builder.build()
    builder.with_meta("b", "2")
    assert first.meta == {"a": "1"} and builder.build().meta == {"a": "1", "b": "2"}


def test_builder_methods_chain():
    builder = lc.new_infer_request("t")
    assert isinstance(builder, lc.InferRequestBuilder)
    assert builder.for_raw_input(b"", "text/plain") is builder
    assert builder.with_meta("k", "v") is builder
    assert builder.with_metas({}) is builder
    assert builder.with_correlation_id("c") is builder


def test_built_tensor_request_passes_parse_meta(impl):
    arr = np.random.default_rng(0).random((1, 3, 4, 4), dtype=np.float32)
    req = (lc.new_infer_request("image_embed")
           .for_tensor_array(arr, "NCHW", CLIP_PP, model_id="clip_vision_encoder",
                             model_version="v1")
           .with_meta(C.KEY_PRIORITY, 1)
           .build())
    d = impl.descriptor.parse_meta(req.meta, memoryview(req.payload).nbytes, CLIP)
    assert (d.kind, d.dtype, d.shape, d.layout, d.nbytes, d.priority) == (
        "tensor", "fp32", (1, 3, 4, 4), "NCHW", arr.nbytes, 1)


def test_built_raw_request_passes_parse_meta(impl):
    req = lc.new_infer_request("text_embed").for_raw_input(b"hi", "text/plain").build()
    assert impl.descriptor.parse_meta(req.meta, 2, CLIP).kind == "raw"

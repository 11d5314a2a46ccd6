"""Hostile input through ``Runtime.infer`` on every raw route: only LumenErrors come out.

Random bytes, random mime strings (with odd parameters) and random meta dicts go through
``text_embed``, ``vad`` and ``image_embed``; whatever the input, the answer is a result or a
LumenError subclass, and the runtime still serves a good request afterwards (SPEC section 2:
a bad request never takes down a batch, a worker or the process).
"""
from __future__ import annotations

import asyncio

import numpy as np
import onnx_models as M
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lumen_core as lc
from lumen_core import models
from lumen_core.contract import RESERVED_KEYS

WAIT_S = 60
#: examples per route: enough to hit odd mimes and meta, small enough for a few seconds
MAX_EXAMPLES = 60
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
PNG_HEAD = b"\x89PNG\r\n\x1a\n"
JPEG_HEAD = b"\xff\xd8\xff"
WEBP_HEAD = b"RIFF\x00\x00\x00\x00WEBP"


def _on_loop(runtime: lc.Runtime, coro):
    return asyncio.run_coroutine_threadsafe(coro, runtime.loop).result(WAIT_S)


def _mimes(bases: list) -> st.SearchStrategy:
    """Accepted base types with random (odd) parameters, plus arbitrary text."""
    param = st.tuples(st.sampled_from(["rate", "format", "channels", "charset", "x", "", " RATE "]),
                      st.sampled_from(["=", "", "=="]),
                      st.one_of(st.sampled_from(["16000", "f32le", "1", "2", "utf-8", "utf-7",
                                                 "base64", "rot13", "utf-16", "idna", '"16000"',
                                                 "", "latin-1", "punycode", "hex"]),
                                st.text(max_size=12)))
    params = st.lists(param, max_size=4).map(lambda ps: "".join(f";{k}{s}{v}" for k, s, v in ps))
    base = st.one_of(st.sampled_from(bases), st.text(max_size=20))
    return st.one_of(st.sampled_from(bases), st.tuples(base, params).map("".join),
                     st.text(max_size=40))


_LUMEN_KEYS = sorted(RESERVED_KEYS) + ["lumen.bogus"]
_META_VALUES = st.one_of(
    st.sampled_from(["raw", "tensor", "true", "false", "1", "0", "-1", "fp32", "int64", "uint8",
                     "[1,512]", "[1,3,224,224]", "[1,224,224,3]", "[1,4]", "NL", "NCHW", "NHWC",
                     "silero_vad_16k_v5", "bert_wordpiece_uncased_v1", "clip_image_openai_v1",
                     "clip_image_openai_v1_uint8", "contiguous", "little", "s1", ""]),
    st.text(max_size=30))
_META = st.dictionaries(st.one_of(st.sampled_from(_LUMEN_KEYS), st.text(max_size=10)),
                        _META_VALUES, max_size=5)


def _payloads(sizes: list, heads: list) -> st.SearchStrategy:
    """Random bytes, of random or route-typical sizes, sometimes with a format's magic bytes."""
    sized = st.sampled_from(sizes).flatmap(lambda n: st.binary(min_size=n, max_size=n))
    headed = st.tuples(st.sampled_from(heads), st.binary(max_size=256)).map(lambda t: t[0] + t[1])
    raw = st.one_of(st.binary(max_size=300), sized, headed)
    # the same bytes as any buffer a caller may hand over (SPEC 1: any C-contiguous buffer)
    kinds = st.sampled_from([bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.uint8),
                             lambda b: np.frombuffer(b[:len(b) // 4 * 4], "<f4").reshape(1, -1)])
    return st.tuples(raw, kinds).map(lambda t: t[1](t[0]))


def _check_served(runtime: lc.Runtime, req: lc.InferRequest, good: lc.InferRequest) -> None:
    try:
        _on_loop(runtime, runtime.infer(req))
    except lc.LumenError:
        pass
    # anything else propagates and fails the test; the runtime must still answer a good request
    out = _on_loop(runtime, runtime.infer(good))
    assert all(np.isfinite(np.asarray(v)).all() for v in out.outputs.values())


# ------------------------------------------------------------------------------ runtimes
@pytest.fixture(scope="module")
def text_rt(prepared_home):
    rt = lc.Runtime.from_dict({"tasks": [{
        "name": "text_embed", "backend": "text_embedding",
        "model": str(models.model_dir(models.MINILM, prepared_home) / models.MODEL_FILE)}]})
    with rt:
        yield rt


@pytest.fixture(scope="module")
def vad_rt(prepared_home):
    path = str(models.model_dir(models.SILERO_VAD, prepared_home) / models.MODEL_FILE)
    rt = lc.Runtime.from_dict({"tasks": [{"name": "vad", "backend": "vad", "model": path,
                                          "intra_op_threads": 1,
                                          "batching": {"max_batch_size": 8}}]})
    with rt:
        yield rt


@pytest.fixture(scope="module")
def image_rt(tmp_path_factory):
    path = M.image_encoder(tmp_path_factory.mktemp("fuzz_models") / "enc.onnx", d_out=16)
    rt = lc.Runtime.from_dict({"tasks": [{"name": "image_embed", "backend": "image_embedding",
                                          "model": path,
                                          "batching": {"max_queue_delay_us": 0}}]})
    with rt:
        yield rt


# ------------------------------------------------------------------------------ fuzz tests
@FUZZ
@given(payload=_payloads([0, 1, 5, 4096, 5000], [b"", b"\xff\xfe", b"\xed\xa0\x80"]),
       mime=_mimes(["text/plain", "TEXT/PLAIN"]), meta=_META)
def test_text_embed_raw_route_only_raises_lumen_errors(text_rt, payload, mime, meta):
    good = lc.new_infer_request("text_embed").for_raw_input(b"still serving", "text/plain").build()
    _check_served(text_rt, lc.InferRequest("text_embed", payload, mime, meta), good)


_SEQ = st.integers(0, 10**9).map(lambda i: f"fuzz-{i}")


@FUZZ
@given(payload=_payloads([1024, 2048, 1023], [b""]),
       mime=_mimes(["audio/L16;rate=16000", "audio/pcm;format=f32le;rate=16000", "audio/l16"]), meta=_META, sid=_SEQ,
       start=st.booleans())
def test_vad_raw_route_only_raises_lumen_errors(vad_rt, payload, mime, meta, sid, start):
    meta = {"lumen.sequence.id": sid, "lumen.sequence.end": "true",
            **({"lumen.sequence.start": "true"} if start else {}), **meta}
    good = lc.InferRequest("vad", bytes(1024), "audio/L16;rate=16000",
                           {"lumen.sequence.id": sid + "-good", "lumen.sequence.start": "true",
                            "lumen.sequence.end": "true"})
    _check_served(vad_rt, lc.InferRequest("vad", payload, mime, meta), good)


@FUZZ
@given(payload=_payloads([0, 1, 12, 150528], [PNG_HEAD, JPEG_HEAD, WEBP_HEAD]),
       mime=_mimes(["image/png", "image/jpeg", "image/webp"]), meta=_META)
def test_image_embed_raw_route_only_raises_lumen_errors(image_rt, payload, mime, meta):
    good = (lc.new_infer_request("image_embed")
            .for_tensor_array(np.zeros((1, 224, 224, 3), np.uint8), "NHWC",
                              "clip_image_openai_v1_uint8").build())
    _check_served(image_rt, lc.InferRequest("image_embed", payload, mime, meta), good)


@pytest.mark.parametrize("mime", [None, 7, b"text/plain", ["text/plain"]])
def test_non_string_mime_is_unsupported_media_type(text_rt, vad_rt, image_rt, mime):
    """A payload_mime that is not a str (a careless embedding caller) is the caller's error
    (unsupported_media_type on payload_mime), not an internal one."""
    for rt, task, payload in ((text_rt, "text_embed", b"x"), (vad_rt, "vad", bytes(1024)),
                              (image_rt, "image_embed", PNG_HEAD)):
        meta = {"lumen.sequence.id": "m", "lumen.sequence.start": "true",
                "lumen.sequence.end": "true"} if task == "vad" else {}
        with pytest.raises(lc.UnsupportedMediaType) as ei:
            _on_loop(rt, rt.infer(lc.InferRequest(task, payload, mime, meta)))
        assert ei.value.field == "payload_mime"

"""The ``lumen.*`` contract: one test per validation rule, then compiled-vs-pure agreement.

Every rule test runs on both implementations (``descriptor`` fixture) and asserts the exception
class and the exact ``field`` (the key a client must fix).  The hypothesis tests at the bottom
check that the compiled parser and the pure-Python definition agree on random near-valid and
hostile metas, message text included, and that hostile values only ever raise LumenError.
"""
from __future__ import annotations

import pickle
import string
import types
from collections import OrderedDict
from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lumen_core import contract as C
from lumen_core import native
from lumen_core.errors import InvalidArgument, LumenError
from lumen_core.request_path import descriptor as D

CLIP_PP = "clip_image_openai_v1"
UINT8_PP = "uint8_hwc_rgb_v1"
TOKENS_PP = "bert_wordpiece_v1"
MAX_TOKENS = 256

CLIP_SPEC = C.TensorSpec("fp32", "NCHW", {CLIP_PP}, ((1, 1), (3, 3), (224, 224), (224, 224)))
UINT8_SPEC = C.TensorSpec("uint8", "NHWC", {UINT8_PP}, ((1, 1), (224, 224), (224, 224), (3, 3)))
TOKENS_SPEC = C.TensorSpec("int64", "NL", {TOKENS_PP}, ((1, 1), (1, MAX_TOKENS)))
UNBOUNDED_SPEC = C.TensorSpec("fp32", "NC", {"feat_v1"}, ((1, 1), (4, C.UNBOUNDED)))

IMAGE = C.TensorContract(specs=(CLIP_SPEC, UINT8_SPEC), model_id="clip_vision_encoder",
                         model_version="v1", raw_preprocess_ids={CLIP_PP})
TOKENS = C.TensorContract(specs=(TOKENS_SPEC,), model_id="all-MiniLM-L6-v2", model_version="1")
FEATURES = C.TensorContract(specs=(UNBOUNDED_SPEC,), model_id="feat", model_version="2")

CLIP_NBYTES = 4 * 3 * 224 * 224


def clip_meta(**extra: str) -> dict:
    """A valid fp32 NCHW tensor meta for IMAGE (8 lumen keys), plus ``extra``."""
    meta = {
        C.KEY_INPUT_KIND: "tensor",
        C.KEY_DTYPE: "fp32",
        C.KEY_SHAPE: "[1,3,224,224]",
        C.KEY_LAYOUT: "NCHW",
        C.KEY_PREPROCESS_ID: CLIP_PP,
        C.KEY_MODEL_ID: "clip_vision_encoder",
        C.KEY_MODEL_VERSION: "v1",
        C.KEY_PRIORITY: "1",
    }
    meta.update(extra)
    return meta


def without(meta: dict, key: str) -> dict:
    meta = dict(meta)
    del meta[key]
    return meta


def expect_error(descriptor, meta, nbytes: int, contract, field):
    """Parse and return the InvalidArgument, asserting its exact class and ``field``."""
    with pytest.raises(LumenError) as info:
        descriptor.parse_meta(meta, nbytes, contract)
    assert type(info.value) is InvalidArgument
    assert info.value.field == field
    assert info.value.message == str(info.value)
    return info.value


# ------------------------------------------------------------------ valid requests
def test_valid_image_fp32_nchw(descriptor):
    d = descriptor.parse_meta(clip_meta(), CLIP_NBYTES, IMAGE)
    assert d.astuple() == ("tensor", "fp32", (1, 3, 224, 224), "NCHW", CLIP_PP,
                           "clip_vision_encoder", "v1", CLIP_NBYTES, 0, 1, 0, None, False, False)


def test_valid_image_uint8_nhwc(descriptor):
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "uint8", C.KEY_SHAPE: "[1, 224, 224, 3]",
            C.KEY_LAYOUT: "NHWC", C.KEY_PREPROCESS_ID: UINT8_PP, C.KEY_PREPROCESS_SKIP: "true",
            C.KEY_FORMAT: "contiguous", C.KEY_BYTE_ORDER: "little"}
    d = descriptor.parse_meta(meta, 224 * 224 * 3, IMAGE)
    assert (d.kind, d.dtype, d.shape, d.layout, d.preprocess_id) == (
        "tensor", "uint8", (1, 224, 224, 3), "NHWC", UINT8_PP)
    assert (d.nbytes, d.spec_index, d.model_id, d.model_version) == (224 * 224 * 3, 1, None, None)


@pytest.mark.parametrize("length", [1, 7, MAX_TOKENS])
def test_valid_token_ids(descriptor, length):
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "int64", C.KEY_SHAPE: f"[1,{length}]",
            C.KEY_LAYOUT: "NL", C.KEY_PREPROCESS_ID: TOKENS_PP}
    d = descriptor.parse_meta(meta, 8 * length, TOKENS)
    assert (d.shape, d.nbytes, d.spec_index) == ((1, length), 8 * length, 0)


@pytest.mark.parametrize("meta", [None, {}, {"x-trace": "abc", "user.key": "1"}],
                         ids=["none", "empty", "foreign-keys"])
def test_no_lumen_keys_is_the_raw_default(descriptor, meta):
    d = descriptor.parse_meta(meta, 5, IMAGE)
    assert d.astuple() == D.Descriptor().astuple()


def test_foreign_values_are_not_inspected(descriptor):
    d = descriptor.parse_meta({"x-blob": object(), "x-long": "v" * 100_000}, 0, IMAGE)
    assert d.kind == "raw"


def test_non_dict_mappings_behave_like_dicts(descriptor):
    class Frozen(Mapping):
        def __init__(self, data):
            self._data = dict(data)

        def __getitem__(self, key):
            return self._data[key]

        def __iter__(self):
            return iter(self._data)

        def __len__(self):
            return len(self._data)

    want = descriptor.parse_meta(clip_meta(), CLIP_NBYTES, IMAGE).astuple()
    for meta in (OrderedDict(clip_meta()), types.MappingProxyType(clip_meta()),
                 Frozen(clip_meta())):
        assert descriptor.parse_meta(meta, CLIP_NBYTES, IMAGE).astuple() == want
    expect_error(descriptor, Frozen({C.KEY_PRIORITY: "0"}), 0, IMAGE, C.KEY_PRIORITY)


def test_str_subclass_keys_and_values(descriptor):
    class S(str):
        pass

    meta = {S(k): S(v) for k, v in clip_meta().items()}
    d = descriptor.parse_meta(meta, CLIP_NBYTES, IMAGE)
    assert d.astuple() == descriptor.parse_meta(clip_meta(), CLIP_NBYTES, IMAGE).astuple()


def test_request_keys_on_raw_route(descriptor):
    meta = {C.KEY_PRIORITY: "3", C.KEY_TIMEOUT_MS: "250", C.KEY_SEQUENCE_ID: "s-1",
            C.KEY_SEQUENCE_START: "TRUE", C.KEY_SEQUENCE_END: "0",
            C.KEY_PREPROCESS_ID: CLIP_PP, C.KEY_MODEL_ID: "clip_vision_encoder",
            C.KEY_MODEL_VERSION: "v1", C.KEY_PREPROCESS_SKIP: "false"}
    d = descriptor.parse_meta(meta, 1234, IMAGE)
    assert d.astuple() == ("raw", None, None, None, CLIP_PP, "clip_vision_encoder", "v1", 0, -1,
                           3, 250, "s-1", True, False)


# ------------------------------------------------------------------ step 0: the meta itself
@pytest.mark.parametrize("meta", [[(C.KEY_INPUT_KIND, "raw")], "lumen.input.kind", 5,
                                  {C.KEY_INPUT_KIND: "raw"}.keys()])
def test_meta_that_is_not_a_mapping(descriptor, meta):
    """``Runtime.infer`` passes ``req.meta`` as given: a non-mapping is the caller's error."""
    err = expect_error(descriptor, meta, 0, IMAGE, None)
    assert type(meta).__name__ in err.message and descriptor.parse_meta(
        [], 0, IMAGE) == D.Descriptor()  # an empty container is no meta at all, as before


def test_non_str_key(descriptor):
    err = expect_error(descriptor, {1: "x", C.KEY_PRIORITY: "1"}, 0, IMAGE, None)
    assert "int" in err.message


def test_unknown_lumen_key(descriptor):
    err = expect_error(descriptor, {"lumen.prority": "1"}, 0, IMAGE, "lumen.prority")
    assert C.KEY_PRIORITY in err.message  # lists the known keys


def test_unknown_non_ascii_lumen_key(descriptor):
    expect_error(descriptor, {"lumen.préprocess.id": "x"}, 0, IMAGE, "lumen.préprocess.id")


def test_prefix_is_case_sensitive_and_exact(descriptor):
    d = descriptor.parse_meta({"Lumen.priority": 0, "lumen": 1, "lumenx.a": None}, 0, IMAGE)
    assert d.astuple() == D.Descriptor().astuple()


@pytest.mark.parametrize("value", [1, None, b"1", ["1"]], ids=["int", "none", "bytes", "list"])
def test_non_str_value(descriptor, value):
    err = expect_error(descriptor, {C.KEY_PRIORITY: value}, 0, IMAGE, C.KEY_PRIORITY)
    assert type(value).__name__ in err.message


def test_over_long_value(descriptor):
    value = "a" * (C.MAX_META_VALUE_CHARS + 1)
    err = expect_error(descriptor, {C.KEY_MODEL_ID: value}, 0, IMAGE, C.KEY_MODEL_ID)
    assert str(C.MAX_META_VALUE_CHARS) in err.message
    assert value not in err.message  # a hostile value is never echoed whole


def test_first_offender_in_iteration_order_wins(descriptor):
    expect_error(descriptor, {C.KEY_PRIORITY: 1, "lumen.nope": "x"}, 0, IMAGE, C.KEY_PRIORITY)
    expect_error(descriptor, {"lumen.nope": "x", C.KEY_PRIORITY: 1}, 0, IMAGE, "lumen.nope")


# ------------------------------------------------------------------ step 1: request keys
@pytest.mark.parametrize("value", ["", "Tensor", "raw ", "image", "tensör"])
def test_bad_kind(descriptor, value):
    expect_error(descriptor, {C.KEY_INPUT_KIND: value}, 0, IMAGE, C.KEY_INPUT_KIND)


@pytest.mark.parametrize("value,want", [("1", 1), ("007", 7), ("999999999", 999999999)])
def test_priority_parses(descriptor, value, want):
    assert descriptor.parse_meta({C.KEY_PRIORITY: value}, 0, IMAGE).priority == want


@pytest.mark.parametrize("value", ["0", "", "-1", "+1", "1.0", "one", " 1", "1234567890", "١"])
def test_bad_priority(descriptor, value):
    expect_error(descriptor, {C.KEY_PRIORITY: value}, 0, IMAGE, C.KEY_PRIORITY)


@pytest.mark.parametrize("value,want", [("1", 1), ("250", 250), ("999999999999", 999999999999)])
def test_timeout_parses(descriptor, value, want):
    assert descriptor.parse_meta({C.KEY_TIMEOUT_MS: value}, 0, IMAGE).timeout_ms == want


@pytest.mark.parametrize("value", ["0", "000", "", "1e3", "1000000000000", "-5"])
def test_bad_timeout(descriptor, value):
    expect_error(descriptor, {C.KEY_TIMEOUT_MS: value}, 0, IMAGE, C.KEY_TIMEOUT_MS)


def test_sequence_id(descriptor):
    value = "s" * C.MAX_SEQUENCE_ID_CHARS
    assert descriptor.parse_meta({C.KEY_SEQUENCE_ID: value}, 0, IMAGE).sequence_id == value
    expect_error(descriptor, {C.KEY_SEQUENCE_ID: ""}, 0, IMAGE, C.KEY_SEQUENCE_ID)
    expect_error(descriptor, {C.KEY_SEQUENCE_ID: value + "s"}, 0, IMAGE, C.KEY_SEQUENCE_ID)


@pytest.mark.parametrize("key,attr", [(C.KEY_SEQUENCE_START, "sequence_start"),
                                      (C.KEY_SEQUENCE_END, "sequence_end")])
@pytest.mark.parametrize("value,want", [("true", True), ("True", True), ("1", True),
                                        ("false", False), ("FALSE", False), ("0", False)])
def test_sequence_flags_parse(descriptor, key, attr, value, want):
    assert getattr(descriptor.parse_meta({key: value}, 0, IMAGE), attr) is want


@pytest.mark.parametrize("key", [C.KEY_SEQUENCE_START, C.KEY_SEQUENCE_END, C.KEY_PREPROCESS_SKIP])
@pytest.mark.parametrize("value", ["yes", "", "2", "truee", "tru\u0435"])
def test_bad_boolean(descriptor, key, value):
    expect_error(descriptor, {key: value}, 0, IMAGE, key)


def test_skip_true_needs_tensor(descriptor):
    expect_error(descriptor, {C.KEY_PREPROCESS_SKIP: "true"}, 0, IMAGE, C.KEY_PREPROCESS_SKIP)


def test_skip_false_contradicts_tensor(descriptor):
    meta = clip_meta(**{C.KEY_PREPROCESS_SKIP: "false"})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_PREPROCESS_SKIP)


# ------------------------------------------------------------------ step 2: raw route
@pytest.mark.parametrize("key", C.TENSOR_KEYS)
def test_tensor_keys_refused_on_raw(descriptor, key):
    expect_error(descriptor, {key: "x"}, 0, IMAGE, key)
    expect_error(descriptor, {C.KEY_INPUT_KIND: "raw", key: "x"}, 0, IMAGE, key)


def test_raw_preprocess_id(descriptor):
    assert descriptor.parse_meta({C.KEY_PREPROCESS_ID: CLIP_PP}, 9, IMAGE).preprocess_id \
        == CLIP_PP
    expect_error(descriptor, {C.KEY_PREPROCESS_ID: UINT8_PP}, 9, IMAGE, C.KEY_PREPROCESS_ID)
    expect_error(descriptor, {C.KEY_PREPROCESS_ID: CLIP_PP}, 9, TOKENS, C.KEY_PREPROCESS_ID)


def test_raw_model_id_and_version(descriptor):
    expect_error(descriptor, {C.KEY_MODEL_ID: "other"}, 0, IMAGE, C.KEY_MODEL_ID)
    expect_error(descriptor, {C.KEY_MODEL_VERSION: "v2"}, 0, IMAGE, C.KEY_MODEL_VERSION)


# ------------------------------------------------------------------ step 3: tensor route
def test_dtype_missing(descriptor):
    expect_error(descriptor, without(clip_meta(), C.KEY_DTYPE), CLIP_NBYTES, IMAGE, C.KEY_DTYPE)


@pytest.mark.parametrize("value", ["float32", "FP32", "", "fp64", "fp32\x00"])
def test_dtype_unknown(descriptor, value):
    meta = clip_meta(**{C.KEY_DTYPE: value})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_DTYPE)


def test_dtype_not_accepted(descriptor):
    err = expect_error(descriptor, clip_meta(**{C.KEY_DTYPE: "fp16"}), CLIP_NBYTES, IMAGE, C.KEY_DTYPE)
    assert "fp32" in err.message and "uint8" in err.message  # names what is accepted


def test_dtype_checked_before_shape(descriptor):
    meta = clip_meta(**{C.KEY_DTYPE: "int8", C.KEY_SHAPE: "garbage"})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_DTYPE)


def test_shape_missing(descriptor):
    expect_error(descriptor, without(clip_meta(), C.KEY_SHAPE), CLIP_NBYTES, IMAGE, C.KEY_SHAPE)


@pytest.mark.parametrize("text", ["", " ", "[1,3,224,224", "[1,,3]", "[1 3]",
                                  "[1.5]", "[a]", "[1]x", "[1,]", "[,1]", "[[1]]", "{1}",
                                  "[\uff11]", "[1e3]", "[0x10]", "[1]]", "null",
                                  # the bracket-free form: the same rules, no bracket at all
                                  "1,3,224,224]", "]1,3,224,224", "1,3,224,", ",1,3,224,224",
                                  "1 3 224 224", "1,,3,224,224", "1;3;224;224", "1,3,224,224x"])
def test_shape_garbage(descriptor, text):
    expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: text}), CLIP_NBYTES, IMAGE, C.KEY_SHAPE)


def test_shape_negative(descriptor):
    err = expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: "[1,-3,224,224]"}), CLIP_NBYTES, IMAGE,
                       C.KEY_SHAPE)
    assert "negative" in err.message


def test_shape_rank_0(descriptor):
    expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: "[ ]"}), CLIP_NBYTES, IMAGE, C.KEY_SHAPE)


def test_shape_rank_9(descriptor):
    err = expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: "[1,1,1,1,1,1,1,1,1]"}), 4, IMAGE,
                       C.KEY_SHAPE)
    assert str(C.MAX_RANK) in err.message


@pytest.mark.parametrize("dim", [str(C.INT64_MAX + 1), "9" * 20, "0" * 19 + "1"])
def test_shape_dim_overflow(descriptor, dim):
    err = expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: f"[1,{dim}]"}), 4, IMAGE, C.KEY_SHAPE)
    assert "overflows int64" in err.message


def test_shape_dim_at_int64_max_parses(descriptor):
    # parses, then the byte length (4 * (2**63-1)) overflows: an error, never a wrap-around
    err = expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: f"[{C.INT64_MAX}]"}), 0, IMAGE,
                       C.KEY_SHAPE)
    assert "2**63-1 bytes" in err.message


@pytest.mark.parametrize("shape", [[1, 2**31, 2**31, 2], [1, 3, 2**40, 2**40],
                                   [2**62, 2, 0]])
def test_shape_product_overflow(descriptor, shape):
    err = expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: str(shape)}), 0, IMAGE, C.KEY_SHAPE)
    assert "2**63-1 bytes" in err.message


def test_shape_product_of_zero_dim_first_is_fine(descriptor):
    # the contract multiplies left to right: a zero dim before huge ones never overflows
    meta = clip_meta(**{C.KEY_SHAPE: f"[1,0,{2**40},{2**40}]"})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.FIELD_PAYLOAD)


def test_shape_over_max_chars(descriptor):
    text = "[1," + " " * C.MAX_SHAPE_CHARS + "3,224,224]"
    err = expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: text}), CLIP_NBYTES, IMAGE, C.KEY_SHAPE)
    assert str(C.MAX_SHAPE_CHARS) in err.message


def test_shape_100kb_string(descriptor):
    text = "[" + "1," * 50_000 + "1]"
    err = expect_error(descriptor, clip_meta(**{C.KEY_SHAPE: text}), CLIP_NBYTES, IMAGE, C.KEY_SHAPE)
    assert len(err.message) < 200


@pytest.mark.parametrize("text", ["1,3,224,224", " 1, 3 ,224,224 ", "\t1,3,224,224\n"])
def test_shape_without_brackets(descriptor, text):
    """Issue 38 row 11: ``shape=1,3,224,224`` in a query string needs no ``curl -g``."""
    meta = clip_meta(**{C.KEY_SHAPE: text})
    assert descriptor.parse_meta(meta, CLIP_NBYTES, IMAGE).shape == (1, 3, 224, 224)
    assert D.parse_shape(text) == native.descriptor.parse_shape(text) == (1, 3, 224, 224)


def test_shape_whitespace_is_allowed(descriptor):
    meta = clip_meta(**{C.KEY_SHAPE: " \t[ 1 ,3,\n224 , 224 ]\r\n"})
    assert descriptor.parse_meta(meta, CLIP_NBYTES, IMAGE).shape == (1, 3, 224, 224)


#: fp32 rank 4 under two layouts (and two preprocess ids): nothing to imply
TWO_LAYOUTS = C.TensorContract(specs=(CLIP_SPEC, C.TensorSpec("fp32", "NHWC", {"hwc_v1"}, (
    (1, 1), (224, 224), (224, 224), (3, 3)))), model_id="clip_vision_encoder", model_version="v1")


def test_layout_missing(descriptor):
    bare = without(without(clip_meta(), C.KEY_LAYOUT), C.KEY_PREPROCESS_ID)
    expect_error(descriptor, bare, CLIP_NBYTES, TWO_LAYOUTS, C.KEY_LAYOUT)
    # one layout for the dtype and rank: nothing else to name, so none needs naming
    got = descriptor.parse_meta(without(clip_meta(), C.KEY_LAYOUT), CLIP_NBYTES, IMAGE)
    assert (got.layout, got.preprocess_id, got.spec_index) == ("NCHW", CLIP_PP, 0)


def test_layout_and_preprocess_id_implied(descriptor):
    """Issue 38 row 11: a task with one choice of each needs neither key (as ``lumen infer``
    and OIP imply them); the given one narrows the other; a wrong one is still refused."""
    bare = without(without(clip_meta(), C.KEY_LAYOUT), C.KEY_PREPROCESS_ID)
    got = descriptor.parse_meta(bare, CLIP_NBYTES, IMAGE)
    assert (got.layout, got.preprocess_id, got.spec_index) == ("NCHW", CLIP_PP, 0)
    hwc = dict(bare, **{C.KEY_SHAPE: "1,224,224,3"})
    got = descriptor.parse_meta(dict(hwc, **{C.KEY_PREPROCESS_ID: "hwc_v1"}), CLIP_NBYTES,
                                TWO_LAYOUTS)
    assert (got.layout, got.preprocess_id) == ("NHWC", "hwc_v1")
    got = descriptor.parse_meta(dict(hwc, **{C.KEY_LAYOUT: "NHWC"}), CLIP_NBYTES, TWO_LAYOUTS)
    assert (got.layout, got.preprocess_id) == ("NHWC", "hwc_v1")
    got = descriptor.parse_meta(dict(bare, **{C.KEY_PREPROCESS_ID: CLIP_PP}), CLIP_NBYTES,
                                TWO_LAYOUTS)
    assert (got.layout, got.preprocess_id) == ("NCHW", CLIP_PP)
    tokens = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "int64", C.KEY_SHAPE: "1,16"}
    got = descriptor.parse_meta(tokens, 8 * 16, TOKENS)
    assert (got.shape, got.layout, got.preprocess_id) == ((1, 16), "NL", TOKENS_PP)
    expect_error(descriptor, bare, CLIP_NBYTES, TWO_LAYOUTS, C.KEY_LAYOUT)
    expect_error(descriptor, dict(bare, **{C.KEY_LAYOUT: "NHWC", C.KEY_PREPROCESS_ID: CLIP_PP}),
                 CLIP_NBYTES, TWO_LAYOUTS, C.KEY_PREPROCESS_ID)
    expect_error(descriptor, dict(bare, **{C.KEY_SHAPE: "1,3,50176"}), CLIP_NBYTES, IMAGE,
                 C.KEY_LAYOUT)  # no rank-3 signature: the layout is still required


def test_implied_signature_needs_one_choice():
    sigs = [("int64", "NL", 2, {"a"}), ("int64", "NL", 2, {"a", "b"}), ("fp32", "NC", 2, {"f"})]
    assert C.implied_signature(sigs[:1], "int64", 2) == ("NL", "a")
    assert C.implied_signature(sigs, "int64", 2) == ("NL", None)
    assert C.implied_signature(sigs, "int64", 2, preprocess_id="b") == ("NL", "b")
    assert C.implied_signature(sigs, "int64", 3) == (None, None)
    assert C.implied_signature(sigs, "fp32", 2, "NC") == ("NC", "f")
    assert C.implied_signature(sigs, "fp32", 2, "NL") == ("NL", None)
    # two layouts of one id: the id is still implied, the layout not
    assert C.implied_signature([("fp32", "NCHW", 4, {"x"}), ("fp32", "NHWC", 4, {"x"})],
                               "fp32", 4) == (None, "x")


@pytest.mark.parametrize("value", ["nchw", "NCWH", "", "NCHW "])
def test_layout_unknown(descriptor, value):
    expect_error(descriptor, clip_meta(**{C.KEY_LAYOUT: value}), CLIP_NBYTES, IMAGE, C.KEY_LAYOUT)


def test_layout_not_accepted(descriptor):
    meta = clip_meta(**{C.KEY_LAYOUT: "CHW", C.KEY_SHAPE: "[3,224,224]"})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_LAYOUT)


def test_layout_rank_mismatch(descriptor):
    meta = clip_meta(**{C.KEY_SHAPE: "[1,3,50176]"})
    err = expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_LAYOUT)
    assert "rank 4" in err.message and "rank 3" in err.message


@pytest.mark.parametrize("nbytes", [0, CLIP_NBYTES - 1, CLIP_NBYTES + 1, -CLIP_NBYTES, 2**64])
def test_payload_length(descriptor, nbytes):
    err = expect_error(descriptor, clip_meta(), nbytes, IMAGE, C.FIELD_PAYLOAD)
    assert str(CLIP_NBYTES) in err.message


def test_preprocess_missing(descriptor):
    meta = without(clip_meta(), C.KEY_PREPROCESS_ID)
    two_ids = C.TensorContract(specs=(CLIP_SPEC, C.TensorSpec(
        "fp32", "NCHW", {"other_v1"}, CLIP_SPEC.dims)), model_id="clip_vision_encoder",
        model_version="v1")
    expect_error(descriptor, meta, CLIP_NBYTES, two_ids, C.KEY_PREPROCESS_ID)
    assert descriptor.parse_meta(meta, CLIP_NBYTES, IMAGE).preprocess_id == CLIP_PP


def test_preprocess_not_accepted(descriptor):
    meta = clip_meta(**{C.KEY_PREPROCESS_ID: "clip_image_openai_v2"})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_PREPROCESS_ID)


def test_batch_dim_must_be_1(descriptor):
    meta = clip_meta(**{C.KEY_SHAPE: "[2,3,224,224]"})
    err = expect_error(descriptor, meta, 2 * CLIP_NBYTES, IMAGE, C.KEY_SHAPE)
    assert "batch" in err.message


def test_layout_without_batch_axis_has_no_batch_rule(descriptor):
    spec = C.TensorSpec("fp32", "CHW", {"p"}, ((2, 2), (1, 8), (1, 8)))
    contract = C.TensorContract(specs=(spec,), model_id="m")
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "fp32", C.KEY_SHAPE: "[2,4,4]",
            C.KEY_LAYOUT: "CHW", C.KEY_PREPROCESS_ID: "p"}
    assert descriptor.parse_meta(meta, 4 * 32, contract).shape == (2, 4, 4)


def test_tensor_model_id_mismatch(descriptor):
    meta = clip_meta(**{C.KEY_MODEL_ID: "clip_text_encoder"})
    err = expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_MODEL_ID)
    assert "clip_vision_encoder" in err.message


def test_tensor_model_version_mismatch(descriptor):
    meta = clip_meta(**{C.KEY_MODEL_VERSION: "v2"})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_MODEL_VERSION)


@pytest.mark.parametrize("value", ["strided", "", "Contiguous"])
def test_format(descriptor, value):
    meta = clip_meta(**{C.KEY_FORMAT: value})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_FORMAT)


@pytest.mark.parametrize("value", ["big", "LITTLE", "native"])
def test_byte_order(descriptor, value):
    meta = clip_meta(**{C.KEY_BYTE_ORDER: value})
    expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_BYTE_ORDER)


def test_signature_combination(descriptor):
    # fp32, NCHW and the uint8 preprocess id are each accepted, but by different signatures
    meta = clip_meta(**{C.KEY_PREPROCESS_ID: UINT8_PP})
    err = expect_error(descriptor, meta, CLIP_NBYTES, IMAGE, C.KEY_PREPROCESS_ID)
    assert "no tensor signature" in err.message


def test_fixed_dimension(descriptor):
    meta = clip_meta(**{C.KEY_SHAPE: "[1,3,112,224]"})
    err = expect_error(descriptor, meta, CLIP_NBYTES // 2, IMAGE, C.KEY_SHAPE)
    assert "dimension 2" in err.message and "needs 224" in err.message


@pytest.mark.parametrize("length", [0, MAX_TOKENS + 1])
def test_range_dimension(descriptor, length):
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "int64", C.KEY_SHAPE: f"[1,{length}]",
            C.KEY_LAYOUT: "NL", C.KEY_PREPROCESS_ID: TOKENS_PP}
    err = expect_error(descriptor, meta, 8 * length, TOKENS, C.KEY_SHAPE)
    assert f"1 <= d <= {MAX_TOKENS}" in err.message


def test_unbounded_dimension(descriptor):
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "fp32", C.KEY_LAYOUT: "NC",
            C.KEY_PREPROCESS_ID: "feat_v1"}
    ok = descriptor.parse_meta({**meta, C.KEY_SHAPE: "[1,100000]"}, 400_000, FEATURES)
    assert ok.shape == (1, 100_000)
    err = expect_error(descriptor, {**meta, C.KEY_SHAPE: "[1,3]"}, 12, FEATURES, C.KEY_SHAPE)
    assert err.message.endswith("needs 4 <= d")


def test_bounds_beyond_int64_in_a_spec(descriptor):
    spec = C.TensorSpec("uint8", "N", {"p"}, ((2**64, 2**65),))
    contract = C.TensorContract(specs=(spec,))
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "uint8", C.KEY_SHAPE: "[1]",
            C.KEY_LAYOUT: "N", C.KEY_PREPROCESS_ID: "p"}
    expect_error(descriptor, meta, 1, contract, C.KEY_SHAPE)


def test_no_contract_accepts_no_tensor(descriptor):
    expect_error(descriptor, clip_meta(), CLIP_NBYTES, C.EMPTY_CONTRACT, C.KEY_DTYPE)
    expect_error(descriptor, {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "fp32"}, 0,
                 C.EMPTY_CONTRACT, C.KEY_DTYPE)


# ------------------------------------------------------------------ the Descriptor object
def test_descriptor_api(descriptor):
    d = descriptor.parse_meta(clip_meta(**{C.KEY_SEQUENCE_ID: "s"}), CLIP_NBYTES, IMAGE)
    ref = D.parse_meta(clip_meta(**{C.KEY_SEQUENCE_ID: "s"}), CLIP_NBYTES, IMAGE)
    assert [getattr(d, k) for k in D.Descriptor.__slots__] == list(ref.astuple())
    assert d == ref and ref == d and not (d != ref)
    assert repr(d) == repr(ref)
    assert pickle.loads(pickle.dumps(d)) == d
    d.priority = 7  # downstream may fill defaults in place, as with the pure class
    assert d.priority == 7 and d != ref
    default = type(d)()
    assert default.astuple() == D.Descriptor().astuple()
    with pytest.raises(TypeError):
        hash(d)


def test_native_switch_exposes_parse_meta():
    mod = native.descriptor
    assert mod.__name__ == (D.__name__ if native.NO_EXTENSIONS else "lumen_core.request_path._descriptor")
    assert mod.parse_meta(None, 0).kind == "raw"


@pytest.mark.parametrize("text", ["[1]", " [ 1 , 2 ] ", f"[{C.INT64_MAX}]", "[0,0,0,0,0,0,0,0]"])
def test_parse_shape(descriptor, text):
    assert descriptor.parse_shape(text) == D.parse_shape(text)


# ------------------------------------------------------------------ property tests
PROPERTY_SETTINGS = settings(max_examples=300, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])

CONTRACTS = (IMAGE, TOKENS, FEATURES)
ALL_SPECS = [(c, i) for c in CONTRACTS for i in range(len(c.specs))]
ASCII_VALUES = st.text(alphabet=string.printable, max_size=12)
SOME_VALUES = st.one_of(
    ASCII_VALUES,
    st.text(max_size=40),
    st.sampled_from(["raw", "tensor", "true", "FALSE", "1", "0", "contiguous", "little",
                     "fp32", "uint8", "int64", "NCHW", "NL", "NHWC", CLIP_PP, TOKENS_PP,
                     "clip_vision_encoder", "v1", "[1,3,224,224]", "[1, 7]", "[]", "[-1]",
                     "[1,2,3,4,5,6,7,8,9]", f"[{2**63}]", f"[1,{2**40},{2**40}]"]),
    st.from_regex(r"\A\s*\[\s*\d{1,21}(\s*,\s*-?\d{1,21}){0,9}\s*\]?\s*\Z", fullmatch=True),
    st.integers(0, 10**13).map(str),
)
MUTATIONS = st.one_of(SOME_VALUES, st.integers(), st.none(), st.binary(max_size=4))
KEYS = st.one_of(st.sampled_from(sorted(C.RESERVED_KEYS)),
                 st.sampled_from(["lumen.unknown", "x-user", "Lumen.priority", "lumen."]),
                 st.text(max_size=20))


@st.composite
def near_valid(draw):
    """A valid tensor meta for a random signature, then zero to two keys mutated."""
    contract, index = draw(st.sampled_from(ALL_SPECS))
    spec = contract.specs[index]
    shape = [draw(st.integers(lo, lo + 3 if hi == C.UNBOUNDED else min(hi, lo + 3)))
             for lo, hi in spec.dims]
    sep = draw(st.sampled_from([",", ", ", " ,\t"]))
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: spec.dtype,
            C.KEY_SHAPE: "[" + sep.join(map(str, shape)) + "]", C.KEY_LAYOUT: spec.layout,
            C.KEY_PREPROCESS_ID: draw(st.sampled_from(sorted(spec.preprocess_ids)))}
    optional = draw(st.sets(st.sampled_from([
        C.KEY_MODEL_ID, C.KEY_MODEL_VERSION, C.KEY_PRIORITY, C.KEY_TIMEOUT_MS, C.KEY_FORMAT,
        C.KEY_BYTE_ORDER, C.KEY_SEQUENCE_ID, C.KEY_PREPROCESS_SKIP]), max_size=4))
    for key in sorted(optional):
        meta[key] = {C.KEY_MODEL_ID: contract.model_id,
                     C.KEY_MODEL_VERSION: contract.model_version, C.KEY_PRIORITY: "2",
                     C.KEY_TIMEOUT_MS: "100", C.KEY_FORMAT: "contiguous",
                     C.KEY_BYTE_ORDER: "little", C.KEY_SEQUENCE_ID: "seq",
                     C.KEY_PREPROCESS_SKIP: "true"}[key]
    for _ in range(draw(st.integers(0, 2))):
        key = draw(KEYS)
        if draw(st.booleans()) and key in meta:
            del meta[key]
        else:
            meta[key] = draw(MUTATIONS)
    nbytes = C.DTYPE_SIZES[spec.dtype]
    for d in shape:
        nbytes *= d
    nbytes = draw(st.one_of(st.just(nbytes), st.integers(-2, 2).map(lambda k: nbytes + k),
                            st.integers(-(2**70), 2**70)))
    return meta, nbytes, contract


def outcome(parse, meta, nbytes, contract):
    """What a parser does with the input: its tuple, or (exception class, field, message)."""
    try:
        return ("ok", parse(meta, nbytes, contract).astuple())
    except LumenError as exc:
        return ("error", type(exc), exc.field, exc.message)


if not native.NO_EXTENSIONS:
    # Agreement is defined where the compiled twin is in play (conftest fails if it is unbuilt).

    @PROPERTY_SETTINGS
    @given(near_valid())
    def test_compiled_agrees_on_near_valid_metas(case):
        meta, nbytes, contract = case
        compiled = native.compiled("descriptor").parse_meta
        assert outcome(compiled, meta, nbytes, contract) == outcome(D.parse_meta, meta, nbytes,
                                                                    contract)

    @PROPERTY_SETTINGS
    @given(st.dictionaries(KEYS, MUTATIONS, max_size=6), st.integers(-1, 10**6),
           st.sampled_from(CONTRACTS + (C.EMPTY_CONTRACT,)))
    def test_compiled_agrees_on_arbitrary_metas(meta, nbytes, contract):
        compiled = native.compiled("descriptor").parse_meta
        assert outcome(compiled, meta, nbytes, contract) == outcome(D.parse_meta, meta, nbytes,
                                                                    contract)

    @PROPERTY_SETTINGS
    @given(st.one_of(SOME_VALUES, st.text(alphabet=" \t\r\n[],-0123456789x", max_size=40)))
    def test_compiled_shape_parser_agrees(text):
        compiled = native.compiled("descriptor").parse_shape
        try:
            want = ("ok", D.parse_shape(text))
        except LumenError as exc:
            want = ("error", type(exc), exc.field, exc.message)
        try:
            got = ("ok", compiled(text))
        except LumenError as exc:
            got = ("error", type(exc), exc.field, exc.message)
        assert got == want


HOSTILE = st.one_of(
    st.text(),  # any unicode except surrogates
    st.text(max_size=3000),
    st.integers(1, 200_000).map(lambda n: "[" + "9" * n),
    st.integers(1, 60_000).map(lambda n: "[" + "1," * n + "1]"),
    st.sampled_from(["\x00", "\u202e", "\U0010ffff" * 300, "\ufeff1", "[\u0661]"]),
)


@settings(PROPERTY_SETTINGS, suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(sorted(C.RESERVED_KEYS)), value=HOSTILE,
       base=st.sampled_from(["tensor", "raw"]))
def test_hostile_values_only_raise_lumen_errors(descriptor, key, value, base):
    meta = clip_meta() if base == "tensor" else {C.KEY_PRIORITY: "1"}
    meta[key] = value
    try:
        d = descriptor.parse_meta(meta, CLIP_NBYTES, IMAGE)
    except LumenError as exc:
        assert type(exc) is InvalidArgument and exc.field is not None
        assert len(exc.message) < 2000  # never echoes a hostile value whole
    else:
        assert d.kind in ("raw", "tensor")


# ------------------------------------------------------------------ contracts as arguments
def test_duck_typed_contract_behaves_like_tensor_contract(descriptor):
    duck = types.SimpleNamespace(**{k: getattr(IMAGE, k) for k in (
        "specs", "model_id", "model_version", "raw_preprocess_ids", "dtypes", "layouts",
        "preprocess_ids", "index")})
    parse = descriptor.parse_meta
    assert parse(clip_meta(), CLIP_NBYTES, duck) == parse(clip_meta(), CLIP_NBYTES, IMAGE)
    expect_error(descriptor, clip_meta(**{C.KEY_MODEL_ID: "x"}), CLIP_NBYTES, duck, C.KEY_MODEL_ID)
    expect_error(descriptor, {C.KEY_PREPROCESS_ID: "x"}, 0, duck, C.KEY_PREPROCESS_ID)


def test_many_contracts_in_turn(descriptor):
    # more contracts than the compiled parser keeps prepared, each used twice in turn
    contracts = [C.TensorContract(specs=(CLIP_SPEC,), model_id=f"m{i}") for i in range(80)]
    for _ in range(2):
        for i, contract in enumerate(contracts):
            meta = clip_meta(**{C.KEY_MODEL_ID: f"m{i}", C.KEY_MODEL_VERSION: "1"})
            assert descriptor.parse_meta(meta, CLIP_NBYTES, contract).model_id == f"m{i}"
            other = contracts[i - 1]
            expect_error(descriptor, meta, CLIP_NBYTES, other, C.KEY_MODEL_ID)


def test_first_matching_signature_wins(descriptor):
    wide = C.TensorSpec("int64", "NL", {TOKENS_PP}, ((1, 1), (1, 8)))
    narrow = C.TensorSpec("int64", "NL", {TOKENS_PP, "other_v1"}, ((1, 1), (1, 2)))
    contract = C.TensorContract(specs=(wide, narrow))
    meta = {C.KEY_INPUT_KIND: "tensor", C.KEY_DTYPE: "int64", C.KEY_SHAPE: "[1,5]",
            C.KEY_LAYOUT: "NL", C.KEY_PREPROCESS_ID: TOKENS_PP}
    assert descriptor.parse_meta(meta, 40, contract).spec_index == 0
    meta[C.KEY_PREPROCESS_ID] = "other_v1"
    expect_error(descriptor, meta, 40, contract, C.KEY_SHAPE)  # only the narrow one names it

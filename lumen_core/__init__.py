"""Lumen Core: task-wise ONNX Runtime inference with Triton-class batching.

This module only re-exports the public API.
"""
from .contract import TensorContract, TensorSpec  # noqa: F401
from .errors import (  # noqa: F401
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    LumenError,
    Overloaded,
    PayloadTooLarge,
    TaskNotFound,
    Unavailable,
    UnsupportedMediaType,
)
from .request import (  # noqa: F401
    InferRequest,
    InferRequestBuilder,
    InferResponse,
    TensorDescriptor,
    new_infer_request,
)

__version__ = "0.1.0"


def __getattr__(name):
    # the runtime pulls in onnxruntime; import it only when asked for
    if name in ("Runtime",):
        from .runtime import Runtime

        return Runtime
    raise AttributeError(name)

"""The gRPC contract (``lumen.proto``) and its generated Python code.

The generated ``lumen_pb2.py`` / ``lumen_pb2_grpc.py`` are committed rather than built at
install time: installing the server then needs only the ``grpcio`` and ``protobuf`` runtimes,
not ``grpcio-tools`` (a large native build dependency), and a wheel is the same on every
machine.  Reproducibility is kept by one command run from the repository root
(``python -m lumen_core.serve.proto``, which calls :func:`generate`), and by a test that
regenerates the code into a temporary folder and compares it with the committed files byte for
byte.

Generated with grpcio-tools 1.85.1 (protoc 7.35.1): the code checks at import that the runtime
is at least that new, hence ``grpcio>=1.85.1`` and ``protobuf>=7.35.1,<8`` in the ``serve``
extra.  The proto path is ``lumen_core/serve/proto/lumen.proto`` relative to the ``-I``
root so the generated service module imports its messages as
``lumen_core.serve.proto.lumen_pb2`` (a package-relative import; protoc has no other way).
"""
from __future__ import annotations

import pathlib
from typing import Optional

PROTO_RELPATH = "lumen_core/serve/proto/lumen.proto"
GENERATED = ("lumen_pb2.py", "lumen_pb2_grpc.py")
#: the Open Inference Protocol's service (vendored, see its header): messages only, as the
#: service is registered by hand under its protocol name (``serve/oip_grpc.py``)
OIP_PROTO_RELPATH = "lumen_core/serve/proto/open_inference_grpc.proto"
OIP_GENERATED = ("open_inference_grpc_pb2.py",)


def generate_args(root: str, out: str) -> list:
    """The protoc command line (without the program name) for the ``grpc_tools.protoc`` module."""
    return [f"-I{root}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"{root}/{PROTO_RELPATH}"]


def oip_generate_args(root: str, out: str) -> list:
    """The protoc command line for the OIP proto (messages only)."""
    return [f"-I{root}", f"--python_out={out}", f"{root}/{OIP_PROTO_RELPATH}"]


def generate(root: Optional[str] = None, out: Optional[str] = None) -> pathlib.Path:
    """Run protoc (from grpcio-tools) on ``lumen.proto`` and, when it is present under
    ``root``, the OIP proto; return the folder the code went to."""
    from grpc_tools import protoc

    root = root or str(pathlib.Path(__file__).resolve().parents[3])
    out = out or root
    runs = [generate_args(root, out)]
    if (pathlib.Path(root) / OIP_PROTO_RELPATH).is_file():
        runs.append(oip_generate_args(root, out))
    for args in runs:
        rc = protoc.main(["grpc_tools.protoc", *args])
        if rc != 0:
            raise RuntimeError(f"protoc failed with status {rc}")
    return pathlib.Path(out) / pathlib.Path(PROTO_RELPATH).parent

"""The ``lumen`` command line.

One module per subcommand (``serve``, ``infer``, ``embed``, ``bench``, ``models``: its ``cmd_*(args) ->
int`` and the ``add_*`` that declares its arguments), what they share in ``common``, wired
up in ``build_parser``; ``main`` turns the errors a user can fix into one message and exit status
``EXIT_USAGE`` instead of a traceback.  Heavy imports (onnx, onnxruntime) happen inside the
subcommand functions so ``lumen --help`` stays instant.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from .. import __version__
from ..errors import LumenError
from . import bench, embed, infer, models, serve
from .common import EXIT_OK, EXIT_USAGE, PROG

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_OK", "EXIT_USAGE", "PROG", "build_parser", "main",
           "missing_extra_message"]

#: top-level module of a missing dependency -> the extra that installs it
EXTRA_FOR_MODULE = {
    "uvicorn": "serve", "starlette": "serve", "httptools": "serve", "grpc": "serve",
    "prometheus_client": "serve", "google": "serve", "uvloop": "serve",
    "onnxruntime": "cpu", "onnx": "cpu", "tokenizers": "cpu", "safetensors": "cpu", "PIL": "cpu",
    "httpx": "test", "matplotlib": "bench", "ray": "ray", "pyarrow": "bulk", "cv2": "ocr", "pyclipper": "ocr",
}
#: exit status after stdout's reader went away (`lumen infer ... | head`): a process killed by
#: SIGPIPE reports 128 + 13 to its shell
EXIT_BROKEN_PIPE = 141


def missing_extra_message(exc: ModuleNotFoundError) -> str:
    """What to install for a missing optional dependency."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_FOR_MODULE.get(top)
    if extra is None:
        return f"missing Python module {exc.name!r}: {exc}"
    return (f"this command needs the [{extra}] extra (module {top!r} is missing): "
            f'pip install "lumen-core[{extra}]"')


_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    serve.add_serve, infer.add_infer, embed.add_embed, bench.add_bench, models.add_models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Lumen Core: task-wise ONNX Runtime inference.")
    parser.add_argument("--version", action="version", version=f"lumen-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _GROUPS:
        add(sub)
    return parser


def _model_missing_error() -> type[Exception]:
    from .. import errors

    cls: Optional[type[Exception]] = getattr(errors, "ModelMissingError", None)
    if cls is None:
        try:
            from ..errors import ModelMissingError
        except ModuleNotFoundError:  # the [cpu] extra is missing: nothing raises it then
            return LumenError
        cls = ModelMissingError
    return cls


def _quiet_stdout() -> None:
    """After the reader of stdout went away (`lumen infer ... | head`): point stdout at
    /dev/null, so neither this process nor the interpreter's exit flush writes to the closed
    pipe again (no "[Errno 32] Broken pipe", no "Exception ignored" at exit)."""
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ModelMissingError = _model_missing_error()  # noqa: N806 - a class

    args = build_parser().parse_args(argv)
    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # inside the try: a reader gone away is a BrokenPipeError here
        return rc
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except ModuleNotFoundError as exc:
        print(f"{PROG}: error: {missing_extra_message(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (ModelMissingError, LumenError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

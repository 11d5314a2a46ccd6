"""File helpers shared by the model preparers: hashing, locating source packages, manifests.

Kept apart from ``__init__`` so the per-model modules can use them without an import cycle.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
from typing import Any, Callable, Optional

from ..errors import ModelMissingError

PREPARE_COMMAND = "lumen models prepare"
#: the ONNX file every prepared model directory holds
MODEL_FILE = "model.onnx"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
HASH_CHUNK_BYTES = 1 << 20

ProgressFn = Callable[[str], None]


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def locate_package_dir(module: str) -> Optional[pathlib.Path]:
    """Directory of an installed package, found without importing it.

    The model packages import heavy things (torch, sentence-transformers) from their
    ``__init__``; ``find_spec`` only reads the file system.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def distribution_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_command(dist: str, version: str) -> str:
    return f"pip install --no-deps {dist}=={version}"


def packaged_path(module: str, relative: str, required: tuple, dist: str, version: str,
                  what: str) -> pathlib.Path:
    """``<installed module>/relative`` when every ``required`` file below it exists; otherwise
    a ModelMissingError naming the exact pip command that installs ``dist``."""
    pkg = locate_package_dir(module)
    path = pkg / relative if pkg is not None else None
    if path is None or not all((path / f).is_file() for f in required):
        lacking = "/".join(x for x in (relative, required[0]) if x)
        raise ModelMissingError(
            f"the PyPI package {dist!r}, the source of {what}, is not installed "
            f"(or lacks {module}/{lacking}); run `{pip_command(dist, version)}`, "
            f"then `{PREPARE_COMMAND}`",
            command=pip_command(dist, version), package=dist,
        )
    return path


def read_manifest(directory: pathlib.Path) -> Optional[dict[str, Any]]:
    try:
        with open(directory / MANIFEST_NAME, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(directory: pathlib.Path, manifest: dict[str, Any]) -> None:
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, directory / MANIFEST_NAME)


def output_entries(directory: pathlib.Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {
        name: {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
        for name in names
    }


def outputs_intact(directory: pathlib.Path, manifest: dict[str, Any], deep: bool) -> bool:
    """True when every output the manifest lists is present with its size (and, if ``deep``, hash)."""
    outputs = manifest.get("outputs")
    if not isinstance(outputs, dict) or not outputs:
        return False
    for name, entry in outputs.items():
        path = directory / name
        try:
            if path.stat().st_size != entry["bytes"]:
                return False
            if deep and sha256_file(path) != entry["sha256"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
    return True

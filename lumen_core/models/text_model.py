"""What a prepared text model is, read from its ``manifest.json``: the ``"text_model"`` block.

Every text model the server runs (the built-in all-MiniLM-L6-v2, a sentence-transformers
folder imported with ``lumen models import``, a folder named in a config) is a directory of
``model.onnx``, ``tokenizer.json`` and ``manifest.json``; the manifest's ``"text_model"``
block says how to feed it (sequence length, lower-casing, pad id, prompts) and what it returns
(kind, dimension, pooling, normalisation).  The serving side reads ONE format for every text
model through :func:`read_text_model`; the importer (``models/st_import.py``) writes it.
Pure manifest parsing: no ONNX, no tokenizer, so a task can ask cheaply at load.

This module is the one home of the block: the importer re-exports :class:`TextModel` and
:func:`read_text_model` (``st_import``), and writes ``TextModel.to_dict()``.  A configured ONNX
file without a manifest is fed as all-MiniLM-L6-v2 (``models.minilm.minilm_text_model``).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional

from ._files import MANIFEST_NAME, MODEL_FILE, outputs_intact, read_manifest

#: the manifest key of the block
TEXT_MODEL_KEY = "text_model"
#: the kinds of text model: sentence embeddings, cross-encoder scores
KIND_EMBED = "embed"
KIND_RERANK = "rerank"
KINDS = (KIND_EMBED, KIND_RERANK)
#: the commands that put a text model into the store (named by every "not prepared" error)
IMPORT_COMMAND = "lumen models import DIR --name NAME"
#: the graph's outputs: an embed model's vector (normalised iff ``normalize``) and the pooled
#: vector before normalisation; a rerank model's raw scores
OUTPUT, POOLED, LOGITS = "embedding", "pooled", "logits"


class TextModelError(ValueError):
    """A manifest whose ``"text_model"`` block is missing or malformed (names the file and
    the field)."""


@dataclass(frozen=True)
class TextModel:
    """The ``"text_model"`` block (TEXT_MODEL_CONTRACT.md): how to feed a text model and what
    it returns."""

    kind: str                 # "embed" | "rerank"
    architecture: str         # "bert" | "roberta" | "xlm-roberta" | "mpnet" | "distilbert" | "modernbert" | "onnx-export"
    dimension: int            # embedding size (embed); num_labels (1) for rerank
    max_seq_length: int       # tokens incl. special tokens
    max_positions: int        # the position table's usable length
    do_lower_case: bool       # lower-case the text before tokenizing
    pad_token_id: int
    pooling: str              # "cls" | "mean" | ..., several joined by "+" ("max+mean"); "" for rerank
    normalize: bool           # the embedding is L2-normalised
    prompts: dict = field(default_factory=dict)  # name -> prefix text
    default_prompt_name: Optional[str] = None
    num_labels: int = 1       # rerank: 1
    source: str = ""          # the folder it was built from
    content_hash: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def outputs(self) -> list[str]:
        """The graph's output names, the first the one a task returns."""
        return [LOGITS] if self.kind == KIND_RERANK else [OUTPUT, POOLED]


#: field -> (type, required); the rest take the dataclass defaults
_FIELDS: dict = {
    "kind": (str, True), "architecture": (str, False), "dimension": (int, True),
    "max_seq_length": (int, True), "max_positions": (int, False),
    "do_lower_case": (bool, False), "pad_token_id": (int, False), "pooling": (str, False),
    "normalize": (bool, False), "prompts": (dict, False),
    "default_prompt_name": (str, False), "num_labels": (int, False), "source": (str, False),
    "content_hash": (str, False),
}
_DEFAULTS = {"architecture": "", "do_lower_case": False, "pad_token_id": 0, "pooling": "",
             "normalize": False}


def parse_text_model(block: Any, where: str) -> TextModel:
    """The :class:`TextModel` of a ``"text_model"`` block (``where`` names the manifest in
    errors); TextModelError naming the field that is wrong."""
    if not isinstance(block, dict):
        raise TextModelError(f"{where}: {TEXT_MODEL_KEY!r} must be an object, got "
                             f"{type(block).__name__}")
    unknown = sorted(set(block) - set(_FIELDS))
    if unknown:
        raise TextModelError(f"{where}: {TEXT_MODEL_KEY}.{unknown[0]} is not a field of the "
                             f"block (fields: {', '.join(_FIELDS)})")
    values: dict = {}
    for name, (kind, required) in _FIELDS.items():
        if name not in block or (block[name] is None and not required):
            if required:
                raise TextModelError(f"{where}: {TEXT_MODEL_KEY}.{name} is missing")
            continue
        v = block[name]
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise TextModelError(f"{where}: {TEXT_MODEL_KEY}.{name} must be a {kind.__name__}, "
                                 f"got {v!r}")
        values[name] = v
    for name, default in _DEFAULTS.items():
        values.setdefault(name, default)
    values.setdefault("max_positions", values["max_seq_length"])
    tm = TextModel(**values)
    if tm.kind not in KINDS:
        raise TextModelError(f"{where}: {TEXT_MODEL_KEY}.kind must be one of {', '.join(KINDS)}, "
                             f"got {tm.kind!r}")
    if tm.dimension < 1 or tm.max_seq_length < 2 or tm.max_positions < tm.max_seq_length:
        raise TextModelError(f"{where}: {TEXT_MODEL_KEY}: dimension must be >= 1 and "
                             f"2 <= max_seq_length <= max_positions, got dimension "
                             f"{tm.dimension}, max_seq_length {tm.max_seq_length}, "
                             f"max_positions {tm.max_positions}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in tm.prompts.items()):
        raise TextModelError(f"{where}: {TEXT_MODEL_KEY}.prompts must map names to prefix texts")
    if tm.default_prompt_name is not None and tm.default_prompt_name not in tm.prompts:
        raise TextModelError(f"{where}: {TEXT_MODEL_KEY}.default_prompt_name "
                             f"{tm.default_prompt_name!r} is none of the prompts "
                             f"({', '.join(tm.prompts) or 'none'})")
    return tm


def read_text_model(directory: os.PathLike) -> TextModel:
    """The ``"text_model"`` block of ``directory/manifest.json``; TextModelError when the
    manifest or the block is missing or malformed."""
    where = str(pathlib.Path(directory) / MANIFEST_NAME)
    manifest = read_manifest(pathlib.Path(directory))
    if manifest is None:
        raise TextModelError(f"{where}: missing or not a JSON object")
    if TEXT_MODEL_KEY not in manifest:
        raise TextModelError(f"{where}: has no {TEXT_MODEL_KEY!r} block (prepared by an older "
                             f"lumen-core, or not a text model)")
    return parse_text_model(manifest[TEXT_MODEL_KEY], where)


def prepared_text_models(models_root: pathlib.Path) -> dict[str, TextModel]:
    """The text models prepared under ``models_root``, by name, sorted: every directory with a
    model file and a readable ``"text_model"`` block (the built-in MiniLMs and each imported
    folder; the hash-cached builds of ``models/.folders`` are left out).  What a "not
    prepared" error and ``/v1/models`` list."""
    out: dict[str, TextModel] = {}
    try:
        entries = sorted(p for p in models_root.iterdir() if p.is_dir()
                         and not p.name.startswith("."))
    except OSError:
        return out
    for p in entries:
        if not (p / MODEL_FILE).is_file():
            continue
        try:
            out[p.name] = read_text_model(p)
        except TextModelError:
            continue  # not a text model (VAD, OCR), or prepared before the block
    return out


def find_prepared(name: str, models_root: pathlib.Path) -> Optional[pathlib.Path]:
    """The prepared directory of text model ``name`` under ``models_root`` when it is there
    whole (its manifest lists outputs that are present with their sizes), else None."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    directory = models_root / name
    manifest = read_manifest(directory)
    if manifest is None or not outputs_intact(directory, manifest, deep=False):
        return None
    return directory


def importer() -> ModuleType:
    """``lumen_core.models.st_import``, the folder importer, loaded when a folder or ``lumen
    models import`` needs it (it pulls in the graph builders; a server of prepared models never
    loads it).  ImportError when this build has none."""
    return importlib.import_module(f"{__package__}.st_import")

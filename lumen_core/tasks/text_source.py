"""Which model a text task (``text_embedding``, ``rerank``) runs, and how to feed it.

A text task names its model one of three ways (docs/own-models.md):

- ``model_id = "NAME"`` (or nothing: ``all-minilm-l6-v2``): a model prepared in the store,
  ``$LUMEN_HOME/models/NAME/`` (``lumen models prepare`` builds the built-in ones, ``lumen
  models import DIR --name NAME`` any sentence-transformers folder).  A name that is not
  prepared is a ConfigError listing the prepared text models and both commands; never a
  silent substitute (issue 36, item 7).
- ``model = "path/to/folder"``: a sentence-transformers folder (or an ONNX export folder),
  prepared once by ``models.st_import.prepare_folder`` and cached by its content hash; a
  folder that is already a prepared directory (``model.onnx`` + a manifest with the
  ``"text_model"`` block) is used as it is.
- ``model = "file.onnx"``: an ONNX file with the MiniLM graph I/O; its tokenizer is the
  ``tokenizer.json`` beside it, and how to feed it the manifest beside it when that has the
  block, else all-MiniLM-L6-v2's values (``models.minilm.minilm_text_model``).

The result, :class:`TextSource`, carries the files, the :class:`TextModel` and the preprocess
id of the tokenizer (:func:`preprocess_id`), which the tensor route's clients name.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..batching.signature import signature
from ..config import TaskConfig
from ..contract import TensorContract, TensorSpec
from ..engine.plan import ModelSpec, RaggedInput
from ..errors import ConfigError, InvalidArgument
from ..models import (
    MINILM,
    MINILM_INT8,
    MODEL_FILE,
    PREPARE_COMMAND,
    model_card,
    models_dir,
    read_manifest,
    require_model,
)
from ..models.minilm import (
    ATTENTION_MASK,
    INPUT_IDS,
    TOKEN_DTYPE,
    TOKENIZER_FILE,
    minilm_text_model,
)
from ..models.text_model import (
    IMPORT_COMMAND,
    KIND_EMBED,
    TEXT_MODEL_KEY,
    TextModel,
    TextModelError,
    find_prepared,
    importer,
    prepared_text_models,
    read_text_model,
)

#: the preprocess id of all-MiniLM-L6-v2's tokenizer (bert-base-uncased WordPiece): kept for
#: every tokenizer of that vocabulary and normalisation, so existing tensor clients still work
BERT_UNCASED_PREPROCESS_ID = "bert_wordpiece_uncased_v1"
#: sha256 (first 16 hex digits) of the canonical form (:func:`_canonical_tokenizer`) of the
#: prepared all-MiniLM-L6-v2 tokenizer
BERT_UNCASED_TOKENIZER_HASH = "31d2340967bbbd56"
#: the prepared models that are all-MiniLM-L6-v2 (their manifests may predate the block)
MINILM_MODELS = (MINILM, MINILM_INT8)
#: the parts of tokenizer.json that decide the ids (truncation / padding are the server's)
_TOKENIZER_PARTS = ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "model")


@dataclass(frozen=True)
class TextSource:
    """A text task's model: its files, what it is, and the identity of its tokenizer."""

    model_path: str
    tokenizer_path: str
    text_model: TextModel
    model_id: str
    #: a model from the store or a prepared folder (its outputs are the contract's), not a
    #: configured ONNX file whose outputs must be read
    prepared: bool
    card: Optional[dict] = None


def resolve(cfg: TaskConfig, kind: str, backend: str) -> TextSource:
    """The model of text task ``cfg``, which must be a ``kind`` model (``backend`` names the
    backend that serves the other kind in the error)."""
    if cfg.model:
        if os.path.isdir(cfg.model):
            src = _folder(cfg)
        elif os.path.isfile(cfg.model):
            src = _file(cfg)
        else:
            raise ConfigError(cfg.source, f"{cfg.key}.model",
                              f"no such file or folder: {cfg.model} (leave it out to use the "
                              f"prepared all-MiniLM-L6-v2 from `{PREPARE_COMMAND}`)")
    else:
        src = _prepared(cfg)
    if src.text_model.kind != kind:
        other = "rerank" if kind == KIND_EMBED else "text_embedding"
        raise ConfigError(cfg.source, f"{cfg.key}.backend",
                          f"model {src.model_id!r} is a {src.text_model.kind!r} model, not "
                          f"{kind!r}: serve it with backend = \"{other}\" (this task's backend is "
                          f"{backend!r})")
    return src


def load_source(cfg: TaskConfig, options: dict, kind: str, backend: str) -> tuple:
    """``(source, tokenizer path, max_seq_length)`` of a text task at load: :func:`resolve`,
    then the task's ``tokenizer`` and ``max_seq_length`` options checked against the model
    (the sequence length defaults to the model's, and may not pass its positions)."""
    src = resolve(cfg, kind, backend)
    tm = src.text_model
    tok_path = options["tokenizer"] or src.tokenizer_path
    if not os.path.isfile(tok_path):
        raise ConfigError(cfg.source, f"{cfg.key}.options.tokenizer",
                          f"must name the model's tokenizer.json; no such file: {tok_path!r}")
    asked = options["max_seq_length"]
    if asked is not None and asked > tm.max_positions:
        raise ConfigError(cfg.source, f"{cfg.key}.options.max_seq_length",
                          f"must be at most {tm.max_positions} (the positions of model "
                          f"{src.model_id!r}), got {asked}")
    return src, tok_path, asked or tm.max_seq_length


def _prepared(cfg: TaskConfig) -> TextSource:
    name = cfg.model_id or MINILM
    if name in MINILM_MODELS:  # require_model names `lumen models prepare`, checks the revision
        directory = require_model(name)
    else:
        root = models_dir()
        found = find_prepared(name, root)
        if found is None:
            raise not_prepared(cfg, name, root)
        directory = found
    try:
        tm = read_text_model(directory)
    except TextModelError as exc:
        if name not in MINILM_MODELS:
            raise ConfigError(cfg.source, f"{cfg.key}.model_id",
                              f"prepared model {name!r} is not a text model this server can "
                              f"feed ({exc}); import a sentence-transformers folder with "
                              f"`{IMPORT_COMMAND}`") from None
        tm = minilm_text_model()  # prepared before the block: the constants of minilm.py
    card = model_card(name) if name in MINILM_MODELS else None
    return TextSource(str(directory / MODEL_FILE), str(directory / TOKENIZER_FILE), tm, name,
                      True, card)


def not_prepared(cfg: TaskConfig, name: str, root: pathlib.Path) -> ConfigError:
    """The error for a ``model_id`` that is not in the store: the text models that are, and
    the commands that put one there."""
    have = prepared_text_models(root)
    listed = ", ".join(f"{n} ({tm.kind})" for n, tm in have.items()) or "none"
    return ConfigError(cfg.source, f"{cfg.key}.model_id",
                       f"no prepared model {name[:200]!r} under {root}; the prepared text models "
                       f"are: {listed}. Run `{PREPARE_COMMAND}` (the built-in models) or "
                       f"`lumen models import DIR --name {name[:200]}` (a sentence-transformers "
                       f"folder), or name the folder with model = \"path/to/folder\"")


def _folder(cfg: TaskConfig) -> TextSource:
    folder = pathlib.Path(cfg.model)
    manifest = read_manifest(folder)
    if manifest is None or TEXT_MODEL_KEY not in manifest or not (folder / MODEL_FILE).is_file():
        try:  # the importer (models/st_import.py), loaded only for a folder that needs it
            st_import = importer()
        except ImportError as exc:
            raise ConfigError(cfg.source, f"{cfg.key}.model",
                              f"{folder} is a folder, and this build cannot import model "
                              f"folders ({exc})") from None
        folder = pathlib.Path(st_import.prepare_folder(folder))
    try:
        tm = read_text_model(folder)
    except TextModelError as exc:
        raise ConfigError(cfg.source, f"{cfg.key}.model", str(exc)) from None
    # named after the user's folder (not the cache directory it was prepared into)
    return TextSource(str(folder / MODEL_FILE), str(folder / TOKENIZER_FILE), tm,
                      cfg.model_id or pathlib.Path(cfg.model).name, True)


def _file(cfg: TaskConfig) -> TextSource:
    here = pathlib.Path(cfg.model).parent
    manifest = read_manifest(here)
    tm = minilm_text_model()
    if manifest is not None and TEXT_MODEL_KEY in manifest:
        try:
            tm = read_text_model(here)
        except TextModelError as exc:
            raise ConfigError(cfg.source, f"{cfg.key}.model", str(exc)) from None
    return TextSource(cfg.model, str(here / TOKENIZER_FILE), tm, cfg.model_id or MINILM, False)


def _canonical_tokenizer(path: str) -> Optional[str]:
    """sha256 (16 hex digits) of the parts of ``tokenizer.json`` that decide the ids."""
    try:
        with open(path, encoding="utf-8") as fh:
            data: Any = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    canon = json.dumps({k: data.get(k) for k in _TOKENIZER_PARTS}, sort_keys=True,
                       separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def preprocess_id(tokenizer_path: str, model_id: str) -> str:
    """The preprocess id token ids of this tokenizer travel under on the tensor route: the
    MiniLM's (``bert_wordpiece_uncased_v1``) for all-MiniLM-L6-v2 and any tokenizer with its
    vocabulary and normalisation, else ``tokenizer_<hash>_v1`` of the tokenizer's content, so
    two models share an id exactly when their ids mean the same tokens."""
    digest = _canonical_tokenizer(tokenizer_path)
    if model_id in MINILM_MODELS or digest == BERT_UNCASED_TOKENIZER_HASH or digest is None:
        return BERT_UNCASED_PREPROCESS_ID
    return f"tokenizer_{digest}_v1"


def token_ids(payload: memoryview, vocab_size: int, model_id: str) -> tuple:
    """``(ids, tensor)`` of a tensor-route payload of int64 token ids (dtype, layout and shape
    already checked by the descriptor): every id inside the vocabulary (an out-of-range id
    would make the model's Gather fail for the whole batch), ``tensor`` the payload itself, or
    a copy when it is writable (it could change between this check and batch assembly)."""
    ids = np.frombuffer(payload, dtype="<i8")
    # negative ids wrap to huge unsigned values: one reduction checks both bounds
    if int(ids.view("<u8").max()) >= vocab_size:
        pos = int(np.argmax(ids.view("<u8") >= vocab_size))
        raise InvalidArgument(f"token id {int(ids[pos])} at position {pos} is outside the "
                              f"vocabulary [0, {vocab_size}) of {model_id}", "payload")
    return ids, (ids.copy() if not payload.readonly else payload)


#: token ids on the tensor route: int64 ``[1, L]`` ``NL``
TOKEN_LAYOUT = "NL"
TOKEN_NP = np.dtype("<i8")


def token_plan(cfg: TaskConfig, src: TextSource, model_id: str, pp: str, max_seq_length: int,
               outputs: list) -> tuple:
    """``(signature, contract, model spec)`` of a text task: one ragged int64 token input
    (padded with the model's pad id, its attention mask filled in the same pass) under
    preprocess id ``pp``, token ids ``[1, 1..max_seq_length]`` on the tensor route, and
    ``outputs`` (``OutputSpec``s)."""
    sig = signature(cfg.name, model_id, cfg.model_version, TOKEN_DTYPE, None, TOKEN_LAYOUT, pp)
    contract = TensorContract(
        specs=(TensorSpec(TOKEN_DTYPE, TOKEN_LAYOUT, frozenset({pp}),
                          ((1, 1), (1, max_seq_length))),),
        model_id=model_id, model_version=cfg.model_version, raw_preprocess_ids=frozenset({pp}))
    spec = ModelSpec(src.model_path,
                     [RaggedInput(INPUT_IDS, TOKEN_NP, pad_value=src.text_model.pad_token_id,
                                  mask_name=ATTENTION_MASK, mask_dtype=TOKEN_NP)], outputs)
    return sig, contract, spec

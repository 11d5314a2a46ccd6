"""Reading a sentence-transformers folder (what ``SentenceTransformer.save``, ``CrossEncoder.save``
or a hub snapshot holds) into a :class:`FolderSpec`, without torch or sentence-transformers.

Module types are recognised by the last part of their name (``sentence_transformers.models.Pooling``
of 2.x and ``sentence_transformers.sentence_transformer.modules.pooling.Pooling`` of 6.x alike).
Each setting is read where sentence-transformers reads it:

- ``max_seq_length``: ``sentence_bert_config.json`` (2.x-5.x), else the tokenizer's
  ``model_max_length`` (``tokenizer_config.json``, 6.x), capped by the positions the model has;
- ``do_lower_case``: ``sentence_bert_config.json`` (6.x bakes a ``Lowercase`` normalizer into
  ``tokenizer.json`` instead, which the tokenizer then applies itself);
- pooling: ``1_Pooling/config.json``, ``pooling_mode`` (6.x) or the ``pooling_mode_*`` flags
  (earlier; concatenated in the order cls, max, mean, mean_sqrt_len_tokens, weightedmean,
  lasttoken, as sentence-transformers converts them);
- prompts: ``config_sentence_transformers.json``.

A folder without ``modules.json`` is a plain Hugging Face folder: a sequence classifier is a
cross-encoder (what ``CrossEncoder`` loads), an encoder gets mean pooling (what
``SentenceTransformer`` does with it).  Every problem is a :class:`ModelImportError` naming the
folder, the file and what is supported.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Optional

from ._arch import CLASSIFIERS, ENCODERS, ArchError, encoder_spec, family_of
from ._heads import POOLING_MODES

#: config.json ``architectures`` an imported folder may have (another head over a supported
#: encoder, e.g. ``MPNetForMaskedLM``, counts as the encoder: the head is not used)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ENCODERS + CLASSIFIERS
#: what the one-line errors list as supported
SUPPORTED_TEXT = (f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} with model.safetensors, or an "
                  f"ONNX export (model.onnx) of one; pooling {', '.join(POOLING_MODES)}; Normalize")
#: module types (last part of modules.json's ``type``) the importer understands
MODULE_TYPES = ("Transformer", "Pooling", "Normalize")
LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean",
                        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean",
                        "pooling_mode_lasttoken": "lasttoken"}
SENTENCE_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                    "sentence_distilbert_config.json", "sentence_camembert_config.json",
                    "sentence_xlm-roberta_config.json")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
ONNX_FILES = ("model.onnx", "onnx/model.onnx")
TOKENIZER = "tokenizer.json"
#: tokenizer_config.json's "no limit" (transformers' VERY_LARGE_INTEGER and friends)
NO_LIMIT = 1 << 30


class ModelImportError(ValueError):
    """A folder that cannot be imported: ``<folder>: <file>: <problem>; supported: ...`` on one
    line (the CLI prints it and exits 2; a config naming the folder fails to load with it)."""

    def __init__(self, folder: Any, file: str, problem: str) -> None:
        super().__init__(f"{folder}: {file}: {problem}; {SUPPORTED_TEXT}")
        self.folder = str(folder)
        self.file = file
        self.problem = problem


@dataclasses.dataclass
class FolderSpec:
    folder: pathlib.Path
    kind: str  # "embed" | "rerank"
    architecture: str  # family, or "onnx-export"
    family: str
    config: dict
    transformer_dir: pathlib.Path
    weights: list  # safetensors files ([] for an ONNX export)
    onnx: Optional[pathlib.Path]
    tokenizer: pathlib.Path
    max_seq_length: int
    max_positions: int
    do_lower_case: bool
    pooling: tuple
    normalize: bool
    prompts: dict
    default_prompt_name: Optional[str]
    num_labels: int
    files: list  # every file read, for the content hash


def _json(folder: pathlib.Path, path: pathlib.Path, required: bool = True) -> Any:
    rel = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
    if not path.is_file():
        if required:
            raise ModelImportError(folder, rel, "missing")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelImportError(folder, rel, f"not valid JSON ({exc})") from None


def _module_kind(entry: Any, folder: pathlib.Path) -> str:
    kind = str(entry.get("type", "")) if isinstance(entry, dict) else ""
    last = kind.rsplit(".", 1)[-1]
    if last not in MODULE_TYPES:
        raise ModelImportError(folder, "modules.json", f"module type {kind or entry!r} is not supported "
                                                       f"(modules: {', '.join(MODULE_TYPES)})")
    return last


def read_folder(src: Any) -> FolderSpec:
    """The folder's model as a FolderSpec; ModelImportError for anything it cannot be."""
    folder = pathlib.Path(src).expanduser().resolve()
    if not folder.is_dir():
        raise ModelImportError(folder, ".", "not a folder")
    files: list[pathlib.Path] = []
    modules = _json(folder, folder / "modules.json", required=False)
    transformer_dir, pooling_dir, normalize = folder, None, False
    sentence: dict = {}
    if modules is not None:
        files.append(folder / "modules.json")
        if not isinstance(modules, list) or not modules:
            raise ModelImportError(folder, "modules.json", "expected a list of modules")
        kinds = [_module_kind(m, folder) for m in modules]
        if kinds[0] != "Transformer" or kinds.count("Transformer") != 1:
            raise ModelImportError(folder, "modules.json", f"expected one Transformer module first, got "
                                                           f"{', '.join(kinds)}")
        transformer_dir = folder / str(modules[0].get("path") or "")
        for m, k in zip(modules, kinds, strict=True):
            if k == "Pooling":
                pooling_dir = folder / str(m.get("path") or "")
            normalize = normalize or k == "Normalize"
        if kinds.index("Normalize") < kinds.index("Pooling") if {"Normalize", "Pooling"} <= set(kinds) else False:
            raise ModelImportError(folder, "modules.json", "Normalize before Pooling is not supported")
        for name in SENTENCE_CONFIGS:
            path = transformer_dir / name
            if path.is_file():
                sentence = _json(folder, path) or {}
                files.append(path)
                break
    config_path = transformer_dir / "config.json"
    onnx = next((transformer_dir / f for f in ONNX_FILES if (transformer_dir / f).is_file()), None)
    config = _json(folder, config_path, required=onnx is None) or {}
    if config:
        files.append(config_path)
    archs = config.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    try:
        family = family_of(config) if (config or onnx is None) else "bert"
    except ArchError as exc:
        raise ModelImportError(folder, _rel(folder, config_path), exc.problem) from None
    # a head other than a sequence classifier (``MPNetForMaskedLM``, ``BertForPreTraining``) is
    # ignored, as sentence-transformers' AutoModel ignores it: the encoder under it is the model
    classifier = arch.endswith("ForSequenceClassification") \
        or sentence.get("transformer_task") == "sequence-classification"
    if classifier and arch not in CLASSIFIERS:
        raise ModelImportError(folder, _rel(folder, config_path), f"architecture {arch or '?'} is not supported")
    kind = "rerank" if classifier else "embed"
    num_labels = 1
    if kind == "rerank":
        num_labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
        if num_labels != 1:
            raise ModelImportError(folder, _rel(folder, config_path),
                                   f"{arch} with {num_labels} labels: a reranker has one")
        if family not in ("bert", "roberta", "xlm-roberta"):
            raise ModelImportError(folder, _rel(folder, config_path), f"a {family} cross-encoder is not supported")
        if onnx is not None:
            raise ModelImportError(folder, _rel(folder, onnx), "an ONNX export of a cross-encoder is not supported")
    weights = _weights(folder, transformer_dir, onnx)
    files += weights + ([onnx] if onnx is not None else [])
    tokenizer = next((d / TOKENIZER for d in (transformer_dir, folder) if (d / TOKENIZER).is_file()), None)
    if tokenizer is None:
        raise ModelImportError(folder, _rel(folder, transformer_dir / TOKENIZER),
                               "missing (only a fast tokenizer's tokenizer.json is read; save the tokenizer "
                               "with transformers >= 4 to write it)")
    files.append(tokenizer)
    if config:
        try:
            spec = encoder_spec(config)
        except ArchError as exc:
            raise ModelImportError(folder, _rel(folder, config_path), exc.problem) from None
        max_positions = spec.max_positions
    else:  # a bare ONNX export: sentence-transformers' or the tokenizer's limit
        max_positions = NO_LIMIT
    max_seq = sentence.get("max_seq_length")
    tok_config_path = tokenizer.parent / "tokenizer_config.json"
    if max_seq is None and tok_config_path.is_file():
        files.append(tok_config_path)
        max_seq = (_json(folder, tok_config_path) or {}).get("model_max_length")
    if not isinstance(max_seq, (int, float)) or max_seq <= 0 or max_seq >= NO_LIMIT:
        max_seq = max_positions
    max_seq = int(min(max_seq, max_positions))
    if max_seq >= NO_LIMIT:
        raise ModelImportError(folder, "sentence_bert_config.json", "no max_seq_length, no tokenizer "
                                                                    "model_max_length and no config.json")
    pooling: tuple = ()
    if kind == "embed":
        pooling = _pooling(folder, pooling_dir, files, config)
    prompts, default_prompt = _prompts(folder, files)
    return FolderSpec(
        folder=folder, kind=kind, architecture="onnx-export" if onnx is not None else family,
        family=family, config=config, transformer_dir=transformer_dir, weights=weights, onnx=onnx,
        tokenizer=tokenizer, max_seq_length=max_seq,
        max_positions=max_seq if max_positions >= NO_LIMIT else max_positions,
        do_lower_case=bool(sentence.get("do_lower_case", False)), pooling=pooling,
        normalize=normalize, prompts=prompts, default_prompt_name=default_prompt,
        num_labels=num_labels, files=files)


def _rel(folder: pathlib.Path, path: pathlib.Path) -> str:
    return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)


def _weights(folder: pathlib.Path, tdir: pathlib.Path, onnx: Optional[pathlib.Path]) -> list:
    if onnx is not None:
        return []
    if (tdir / WEIGHTS).is_file():
        return [tdir / WEIGHTS]
    if (tdir / WEIGHTS_INDEX).is_file():
        index = _json(folder, tdir / WEIGHTS_INDEX)
        shards = sorted(set((index or {}).get("weight_map", {}).values()))
        missing = [s for s in shards if not (tdir / s).is_file()]
        if not shards or missing:
            raise ModelImportError(folder, _rel(folder, tdir / WEIGHTS_INDEX),
                                   f"shard {missing[0] if missing else '(none listed)'} is missing")
        return [tdir / WEIGHTS_INDEX] + [tdir / s for s in shards]
    if (tdir / TORCH_WEIGHTS).is_file():
        raise ModelImportError(folder, _rel(folder, tdir / TORCH_WEIGHTS),
                               "only pytorch_model.bin, which needs torch to read (no torch here); "
                               "save the model with safe_serialization=True (model.safetensors), once, "
                               "where torch is installed")
    raise ModelImportError(folder, _rel(folder, tdir / WEIGHTS), "missing (and no model.onnx)")


def _pooling(folder: pathlib.Path, pooling_dir: Optional[pathlib.Path], files: list, config: dict) -> tuple:
    if pooling_dir is None:
        if (folder / "modules.json").is_file():
            raise ModelImportError(folder, "modules.json", "no Pooling module")
        return ("mean",)  # a plain encoder folder: what SentenceTransformer(folder) adds
    path = pooling_dir / "config.json"
    cfg = _json(folder, path)
    files.append(path)
    rel = _rel(folder, path)
    if not isinstance(cfg, dict):
        raise ModelImportError(folder, rel, "expected an object")
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = tuple(m for key, m in LEGACY_POOLING_FLAGS.items() if cfg.get(key)) or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad or not modes:
        raise ModelImportError(folder, rel, f"pooling mode {bad[0] if bad else mode!r} is not supported")
    if cfg.get("include_prompt", True) is False:
        raise ModelImportError(folder, rel, "include_prompt false (prompt tokens left out of pooling) "
                                            "is not supported")
    dim = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    hidden = config.get("hidden_size", config.get("dim"))
    if dim is not None and hidden is not None and dim != hidden:
        raise ModelImportError(folder, rel, f"embedding dimension {dim} differs from the model's "
                                            f"hidden size {hidden}")
    return modes


def _prompts(folder: pathlib.Path, files: list) -> tuple:
    path = folder / "config_sentence_transformers.json"
    cfg = _json(folder, path, required=False)
    if cfg is None:
        return {}, None
    files.append(path)
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in prompts.items()):
        raise ModelImportError(folder, path.name, "prompts must map names to strings")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelImportError(folder, path.name, f"default_prompt_name {default!r} is not one of the "
                                                  f"prompts ({', '.join(prompts) or 'none'})")
    return dict(prompts), default

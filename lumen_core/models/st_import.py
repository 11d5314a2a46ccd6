"""Any sentence-transformers folder as a prepared text model: ``lumen models import DIR`` and
``model = "path/to/folder"`` (issue 36).

A folder (:mod:`._st_folder` reads it) becomes ``model.onnx`` + ``tokenizer.json`` +
``manifest.json`` in the layout of the built-in ``all-minilm-l6-v2`` (which is itself built
this way: ``models/minilm.py``).  The graph is written without torch from the safetensors
(:mod:`._graph`, :mod:`._arch`: BERT, RoBERTa, XLM-RoBERTa, MPNet, DistilBERT), or is the
folder's ONNX export with pooling appended (:mod:`._onnx_export`); pooling and Normalize
(:mod:`._heads`) run inside it.  Inputs ``input_ids`` / ``attention_mask`` (int64, right
padded); outputs ``embedding`` + ``pooled`` (embed) or ``logits`` (rerank, one label, raw).

The manifest's ``"text_model"`` block (:class:`TextModel`, defined in :mod:`.text_model`
and re-exported here) is all the serving side needs to
tokenise (``text_tokenize``) and describe the model.  ``prepare_folder`` caches a build by the
folder's content hash under ``$LUMEN_HOME/models/.folders/<hash>/``; ``import_folder`` builds
into ``$LUMEN_HOME/models/<name>/``.  Every problem with a folder is one
:class:`ModelImportError` line naming the folder, the file and the supported set.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import shutil
from typing import Any, Optional

import numpy as np

from ..engine.session import cpu_session
from . import _arch, _graph, _heads, _modernbert, _onnx_export
from ._files import (
    MANIFEST_FORMAT,
    MODEL_FILE,
    ProgressFn,
    output_entries,
    outputs_intact,
    read_manifest,
    sha256_file,
    write_manifest,
)
from ._st_folder import SUPPORTED_ARCHITECTURES, FolderSpec, ModelImportError, read_folder
from ._store import Prepared, exclusive, models_dir, staging_dir, swap_in
from .text_model import LOGITS, OUTPUT, POOLED, TEXT_MODEL_KEY, TextModel, read_text_model
from .text_tokenize import encode_pairs, encode_texts

__all__ = ["LOGITS", "OUTPUT", "POOLED", "SUPPORTED_ARCHITECTURES", "ModelImportError", "TextModel",
           "build_into", "content_hash", "import_folder", "prepare_folder", "read_text_model"]

#: bump when the graph or manifest this module writes changes (cached builds are redone)
IMPORT_REVISION = 1
TOKENIZER_FILE = "tokenizer.json"
FOLDERS_SUBDIR = ".folders"
#: the ONNX producer_name of the graphs written here
PRODUCER = "lumen_core.models.st_import"
#: names ``lumen models import`` accepts (a directory name under the model store)
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")
#: run through every build once: the graph must load and answer, alone and batched
SELF_CHECK_TEXTS = ("A dynamic batcher groups requests that share an execution signature.",
                    "hello world", "")


# ---------------------------------------------------------------------------------------------
# building


def _load_weights(spec: FolderSpec) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    weights: dict[str, np.ndarray] = {}
    for path in spec.weights:
        if path.suffix == ".json":
            continue
        try:
            weights.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise ModelImportError(spec.folder, path.name, f"not a readable safetensors file "
                                                           f"({type(exc).__name__}: {str(exc)[:120]})") from None
    return weights


def _tokenizer(spec: FolderSpec) -> Any:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(spec.tokenizer))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ModelImportError(spec.folder, spec.tokenizer.name, f"not a readable tokenizer "
                                                                 f"({str(exc)[:120]})") from None
    tok.enable_truncation(spec.max_seq_length)
    tok.no_padding()
    return tok


def _check_vocabulary(spec: FolderSpec, tok: Any, rows: int) -> None:
    top = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    if top > rows:
        raise ModelImportError(spec.folder, spec.tokenizer.name,
                               f"token ids reach {top - 1} but the embedding table has {rows} rows "
                               "(a tokenizer of another model?)")


def _pair_separator(spec: FolderSpec, tok: Any) -> int:
    """The id after whose first occurrence a BERT pair's token types are 1, read from the
    tokenizer's own pair encoding (and checked against it)."""
    enc = tok.encode("a", "b")
    types = list(enc.type_ids)
    if 1 not in types:
        raise ModelImportError(spec.folder, spec.tokenizer.name, "its pair encoding sets no token type 1")
    sep = enc.ids[types.index(1) - 1]
    derived = np.minimum(np.cumsum(np.asarray(enc.ids) == sep) - (np.asarray(enc.ids) == sep), 1)
    if derived.tolist() != types:
        raise ModelImportError(spec.folder, spec.tokenizer.name, "token types of a pair are not 0 up to "
                                                                 "the first separator and 1 after it")
    return int(sep)


def build_graph(spec: FolderSpec, tok: Any) -> tuple[Any, int]:
    """(``onnx.ModelProto``, pad_token_id) of the folder's model."""
    if spec.onnx is not None:
        try:
            model = _onnx_export.load(spec.onnx)
            _onnx_export.splice(model, spec.pooling, spec.normalize, OUTPUT, POOLED)
        except _onnx_export.ExportError as exc:
            raise ModelImportError(spec.folder, spec.onnx.relative_to(spec.folder).as_posix(), str(exc)) from None
        if spec.config.get("vocab_size"):
            _check_vocabulary(spec, tok, int(spec.config["vocab_size"]))
        pad = spec.config.get("pad_token_id")
        return model, int(pad) if isinstance(pad, int) else (tok.token_to_id("[PAD]") or 0)
    enc = _arch.encoder_spec(spec.config)
    raw = _load_weights(spec)
    _check_vocabulary(spec, tok, enc.vocab_size)
    g = _graph.GraphBuilder()
    try:
        if enc.family == "modernbert":
            hidden, head = _modernbert.encoder(g, raw, spec.config, enc), None
        else:
            weights = _arch.canonical_weights(raw, enc)
            head = _arch.classifier_weights(raw, enc.family) if spec.kind == "rerank" else None
            if spec.kind == "rerank" and "embeddings.token_type_embeddings.weight" in weights \
                    and len(weights["embeddings.token_type_embeddings.weight"]) > 1:
                enc.pair_separator = _pair_separator(spec, tok)
            hidden = _graph.encoder(g, weights, enc)
    except _arch.ArchError as exc:
        raise ModelImportError(spec.folder, exc.file if exc.file == "config.json" else spec.weights[-1].name,
                               exc.problem) from None
    del raw
    if head is not None:
        g.identity(_heads.classifier(g, hidden, head), LOGITS)
        outputs = {LOGITS: ["batch", spec.num_labels]}
    else:
        _heads.add_embed_outputs(g, hidden, spec.pooling, spec.normalize, OUTPUT, POOLED)
        width = enc.hidden * len(spec.pooling)
        outputs = {OUTPUT: ["batch", width], POOLED: ["batch", width]}
    return g.model(f"{enc.family}_{spec.kind}", outputs, PRODUCER), enc.pad_token_id


def content_hash(spec: FolderSpec) -> str:
    """sha256 over the importer's revision and every file the import reads (path and hash)."""
    digest = hashlib.sha256(f"lumen-st-import/{IMPORT_REVISION}\n".encode())
    for path in sorted(set(spec.files)):
        digest.update(f"{path.relative_to(spec.folder).as_posix()} {sha256_file(path)}\n".encode())
    return digest.hexdigest()


def _self_check(spec: FolderSpec, model_path: pathlib.Path, tm: TextModel) -> int:
    """Run the written graph on SELF_CHECK_TEXTS alone and batched; return the output width."""
    try:
        sess = cpu_session(model_path)
        if tm.kind == "rerank":
            pairs = [(t, u) for t, u in zip(SELF_CHECK_TEXTS, SELF_CHECK_TEXTS[1:] + SELF_CHECK_TEXTS[:1],
                                            strict=True)]
            ids, mask = encode_pairs(model_path.parent / TOKENIZER_FILE, pairs, tm)
            single = [encode_pairs(model_path.parent / TOKENIZER_FILE, [p], tm) for p in pairs]
        else:
            ids, mask = encode_texts(model_path.parent / TOKENIZER_FILE, SELF_CHECK_TEXTS, tm)
            single = [encode_texts(model_path.parent / TOKENIZER_FILE, [t], tm) for t in SELF_CHECK_TEXTS]
        out = sess.run([tm.outputs()[0]], {_graph.INPUT_IDS: ids, _graph.ATTENTION_MASK: mask})[0]
        alone = np.concatenate([sess.run([tm.outputs()[0]], {_graph.INPUT_IDS: i, _graph.ATTENTION_MASK: m})[0]
                                for i, m in single])
    except Exception as exc:  # ORT's errors name no file; this one does
        raise ModelImportError(spec.folder, (spec.onnx or spec.weights[-1]).name,
                               f"the built graph does not run ({type(exc).__name__}: {str(exc)[:200]})") from None
    scale = max(float(np.abs(alone).max()), 1.0)
    if not np.isfinite(out).all() or float(np.abs(out - alone).max()) > 1e-4 * scale:
        raise ModelImportError(spec.folder, (spec.onnx or spec.weights[-1]).name,
                               "the built graph gives a text other numbers batched than alone "
                               "(an export that depends on the padding?)")
    return int(out.shape[1])


def build_into(spec: FolderSpec, out_dir: pathlib.Path, say: ProgressFn, label: str,
               digest: Optional[str] = None) -> dict[str, Any]:
    """Write model.onnx and tokenizer.json of ``spec`` into ``out_dir``; return the manifest
    details (``output_files`` and the ``text_model`` block among them)."""
    import onnx

    tok = _tokenizer(spec)
    digest = digest or content_hash(spec)
    say(f"{label}: building the {spec.architecture} {spec.kind} graph from {spec.folder}")
    model, pad = build_graph(spec, tok)
    onnx.save_model(model, str(out_dir / MODEL_FILE))
    del model
    tok.save(str(out_dir / TOKENIZER_FILE))
    draft = TextModel(kind=spec.kind, architecture=spec.architecture, dimension=0,
                      max_seq_length=spec.max_seq_length, max_positions=spec.max_positions,
                      do_lower_case=spec.do_lower_case, pad_token_id=pad,
                      pooling="+".join(spec.pooling), normalize=spec.normalize,
                      prompts=dict(spec.prompts), default_prompt_name=spec.default_prompt_name,
                      num_labels=spec.num_labels, source=str(spec.folder), content_hash=digest)
    tm = dataclasses.replace(draft, dimension=_self_check(spec, out_dir / MODEL_FILE, draft))
    say(f"{label}: {tm.kind} model, {tm.dimension} dims, max_seq_length {tm.max_seq_length}")
    return {
        "graph": "plain",
        "inputs": {_graph.INPUT_IDS: ["int64", ["N", "L"]], _graph.ATTENTION_MASK: ["int64", ["N", "L"]]},
        "outputs_spec": {name: ["float32", ["N", tm.dimension]] for name in tm.outputs()},
        "max_seq_length": tm.max_seq_length,
        TEXT_MODEL_KEY: tm.to_dict(),
        "output_files": [MODEL_FILE, TOKENIZER_FILE],
    }


# ---------------------------------------------------------------------------------------------
# the model store


def _current(directory: pathlib.Path, digest: str, deep: bool) -> bool:
    manifest = read_manifest(directory)
    return (manifest is not None and manifest.get("format") == MANIFEST_FORMAT
            and manifest.get("revision") == IMPORT_REVISION
            and (manifest.get(TEXT_MODEL_KEY) or {}).get("content_hash") == digest
            and outputs_intact(directory, manifest, deep=deep))


def _build_dir(spec: FolderSpec, root: pathlib.Path, name: str, digest: str, say: ProgressFn,
               int8: bool) -> pathlib.Path:
    directory = root / name
    staging = staging_dir(root, name)
    try:
        details = build_into(spec, staging, say, name, digest)
        if int8:
            from . import text_int8

            details.update(text_int8.quantize_dir(staging, spec, details[TEXT_MODEL_KEY], say, name))
        files = details.pop("output_files")
        write_manifest(staging, {"format": MANIFEST_FORMAT, "name": name, "model_id": name,
                                 "revision": IMPORT_REVISION,
                                 "source": {"folder": str(spec.folder), "content_hash": digest,
                                            "int8": int8},
                                 **details, "outputs": output_entries(staging, files)})
        swap_in(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"{name}: prepared ({directory})")
    return directory


def prepare_folder(src: os.PathLike, *, home: Optional[os.PathLike] = None,
                   progress: Optional[ProgressFn] = None) -> pathlib.Path:
    """The prepared directory of the folder ``src`` (``model = "path/to/folder"`` in a config):
    built once, then found by the folder's content hash under ``models/.folders/<hash>/``."""
    say: ProgressFn = progress or (lambda _msg: None)
    spec = read_folder(src)
    digest = content_hash(spec)
    root = models_dir(home) / FOLDERS_SUBDIR
    name = digest[:24]
    if _current(root / name, digest, deep=False):
        return root / name
    with exclusive(root):
        if _current(root / name, digest, deep=False):  # another process built it meanwhile
            return root / name
        return _build_dir(spec, root, name, digest, say, int8=False)


def import_folder(src: os.PathLike, *, name: Optional[str] = None, int8: bool = False,
                  home: Optional[os.PathLike] = None, progress: Optional[ProgressFn] = None) -> Prepared:
    """``lumen models import DIR [--name NAME] [--int8]``: build the folder into
    ``models/<name>/`` (name: the folder's base name lower-cased, ``-int8`` appended with
    ``int8``); up to date when the folder's content hash and the outputs match."""
    say: ProgressFn = progress or (lambda _msg: None)
    spec = read_folder(src)
    if name is None:
        name = spec.folder.name.lower() + ("-int8" if int8 else "")
    if not NAME_PATTERN.match(name):
        raise ModelImportError(spec.folder, ".", f"model name {name!r} must be lower-case letters, digits, "
                                                 "'.', '_' or '-' (pass --name)")
    if int8:  # refused before anything is built
        from .text_int8 import check_int8

        check_int8(spec)
    digest = content_hash(spec)
    root = models_dir(home)
    done = Prepared()
    with exclusive(root):
        manifest = read_manifest(root / name) or {}
        if (root / name).exists() and "folder" not in (manifest.get("source") or {}):
            raise ModelImportError(spec.folder, ".", f"{root / name} holds a model that was not imported "
                                                     "from a folder (a built-in one?); pass another --name")
        if _current(root / name, digest, deep=True) and (manifest.get("source") or {}).get("int8") == int8:
            say(f"{name}: up to date ({root / name})")
            done[name] = root / name
        else:
            done[name] = _build_dir(spec, root, name, digest, say, int8)
    return done


def folder_spec(src: os.PathLike) -> FolderSpec:
    """The folder read (``_st_folder.read_folder``), for the built-in preparers and tools."""
    return read_folder(src)


"""The committed sentence-transformers folders (``tests/fixtures/st_models/``) and their
references, for the tests that serve imported models.

The folders are tiny random models of each architecture and pooling, saved by
sentence-transformers itself; ``reference.json`` / ``reference*.npy`` hold what
``SentenceTransformer.encode`` (and ``CrossEncoder.predict``) returned for them
(``tests/fixtures/make_st_models.py``).  Models are built by the real importer
(``models/st_import.py``); nothing here stands in for it.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

import numpy as np

from lumen_core.engine.session import cpu_session
from lumen_core.models import st_import

ST_MODELS = pathlib.Path(__file__).resolve().parent / "fixtures" / "st_models"
#: the embedding folders, one per architecture / pooling
EMBED = ["bert-mean-norm", "bert-cls-lower", "bert-max-mean", "roberta-weightedmean",
         "xlmr-lasttoken", "mpnet-mean-prompt", "distilbert-meansqrt", "modernbert-mean",
         "onnx-bert-mean"]
#: the cross-encoder folders (one label)
CROSS = ["bert-cross", "roberta-cross"]
MIN_COSINE = 0.9999
RAW_ATOL = 1e-3
SIGMOID_ATOL = 1e-4


def reference(name: str) -> dict:
    """The folder's ``reference.json`` (texts or pairs, max length, prompt name, scores)."""
    return json.loads((ST_MODELS / name / "reference.json").read_text(encoding="utf-8"))


def reference_vectors(name: str, prompt: bool = False) -> np.ndarray:
    """``encode(texts)`` (``prompt``: ``encode(texts, prompt_name=ref["prompt_name"])``)."""
    return np.load(ST_MODELS / name / ("reference_prompt.npy" if prompt else "reference.npy"))


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    return (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


def imported(home: pathlib.Path, folder: str, name: Optional[str] = None) -> pathlib.Path:
    """``lumen models import tests/fixtures/st_models/<folder> --name <name>`` into ``home``'s
    store; the prepared directory."""
    name = name or folder
    return pathlib.Path(st_import.import_folder(ST_MODELS / folder, name=name, home=home)[name])


def crossencoder_raw(directory: pathlib.Path, query: str, docs: list, max_length: int) -> np.ndarray:
    """A prepared cross-encoder's raw scores on the ids CrossEncoder would feed it: the
    tokenizer's own pair encoding with its own longest_first truncation (independent of the
    server's pair code), one row at a time through ONNX Runtime."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="longest_first")
    lower = st_import.read_text_model(directory).do_lower_case
    sess = cpu_session(directory / "model.onnx")
    out = []
    for d in docs:
        q, d = (query.lower(), d.lower()) if lower else (query, d)
        ids = np.asarray([tok.encode(q, d).ids], np.int64)
        feed: Any = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        out.append(float(sess.run(["logits"], feed)[0][0, 0]))
    return np.array(out, np.float32)

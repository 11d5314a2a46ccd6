"""Fixtures and helpers of the ``lumen embed`` tests (a module of its own, not a second
``conftest.py``: test modules import from ``conftest`` by name, and two of them would shadow
each other), imported by the test files: the prepared models, a tiny text-embedding model
(the MiniLM tokenizer in front of ``onnx_models.embedding_only``: costs next to nothing, and
its output depends on the padded length, so it shows whether batches are formed the same way
twice), inputs in every format, and a way to run the command."""
from __future__ import annotations

import json
import pathlib

import onnx_models as M
import pytest
import serve_support as S

from lumen_core import cli, models
from lumen_core.models import minilm

pytest.importorskip("pyarrow", reason="the [bulk] extra (pyarrow) is not installed")

#: distinct short texts the equality tests repeat (short: the real model must stay quick)
DISTINCT = 100


@pytest.fixture(name="home")
def home_fixture(prepared_home, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("LUMEN_HOME", str(prepared_home))
    return prepared_home


@pytest.fixture(name="tiny")
def tiny_fixture(home, tmp_path) -> pathlib.Path:
    """A lumen.toml with task ``tiny`` (text_embedding backend, the tiny model)."""
    model = M.embedding_only(tmp_path / "tiny.onnx")
    tok = models.require_model(models.MINILM, home=home) / minilm.TOKENIZER_FILE
    cfg = {"server": {}, "tasks": [{"name": "tiny", "backend": "text_embedding", "model": str(model),
                      "instances": 2, "intra_op_threads": 1,
                      "options": {"tokenizer": str(tok)}}]}
    path = tmp_path / "tiny.toml"
    path.write_text(S.to_toml(cfg))
    return path


def short_texts(n: int = DISTINCT) -> list:
    """``n`` distinct short corpus texts (5-20 words)."""
    from lumen_core.corpus import make_corpus

    return [t for t in make_corpus(4 * n) if len(t.split()) <= 20][:n]


def write_jsonl(path: pathlib.Path, rows: list) -> pathlib.Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def run_embed(capsys, *argv: str) -> tuple:
    """``(exit status, stderr)`` of ``lumen embed ARGV`` run in this process."""
    rc = cli.main(["embed", *map(str, argv)])
    out, err = capsys.readouterr()
    assert out == ""  # everything a job says goes to stderr
    return rc, err

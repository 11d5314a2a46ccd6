"""``lumen models import`` and start-up errors of text models (issue 36, items 1 and 7): the
CLI runs the importer (``models/st_import.py``) on the committed sentence-transformers folders
of ``tests/fixtures/st_models/`` and prints its errors as one line, exit 2; a folder in a
config is prepared by the importer; a corrupt ONNX file is a one-line config error naming the
task and the file."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import st_fixtures as F

from lumen_core import cli, models
from lumen_core.errors import ConfigError, InvalidArgument
from lumen_core.models import st_import

IMPORTER = "lumen_core.models.st_import"


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_models_import_builds_the_folder_into_the_store(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "models", "import", str(F.ST_MODELS / "mpnet-mean-prompt"),
                           "--name", "bge-small", "--home", str(tmp_path / "h"))
    assert rc == 0, err
    directory = models.models_dir(tmp_path / "h") / "bge-small"
    assert out == f"bge-small\t{directory}\n" and 'model_id = "bge-small"' in err
    assert "building the mpnet embed graph" in err and "text_embedding task" in err
    tm = st_import.read_text_model(directory)
    assert (tm.kind, tm.architecture, tm.default_prompt_name) == ("embed", "mpnet", "query")
    # again: up to date, nothing rebuilt
    rc, out, err = run_cli(capsys, "models", "import", str(F.ST_MODELS / "mpnet-mean-prompt"),
                           "--name", "bge-small", "--home", str(tmp_path / "h"))
    assert rc == 0 and "up to date" in err and "building" not in err
    # a cross-encoder: served by a rerank task
    rc, out, err = run_cli(capsys, "models", "import", str(F.ST_MODELS / "bert-cross"),
                           "--home", str(tmp_path / "h"))
    assert rc == 0 and out.startswith("bert-cross\t") and "on a rerank task" in err


def test_models_import_errors_are_one_line_exit_2(capsys, tmp_path):
    folder = tmp_path / "gpt"
    shutil.copytree(F.ST_MODELS / "bert-mean-norm", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2Model"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    rc, out, err = run_cli(capsys, "models", "import", str(folder), "--home", str(tmp_path / "h"))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(folder) in err and "config.json" in err and "BertModel" in err
    # --int8 of a cross-encoder: refused, one line
    rc, out, err = run_cli(capsys, "models", "import", str(F.ST_MODELS / "bert-cross"), "--int8",
                           "--home", str(tmp_path / "h"))
    assert rc == 2 and err.count("\n") == 1 and "cross-encoder" in err


def test_models_import_without_an_importer_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, IMPORTER, None)  # import fails: ModuleNotFoundError
    rc, _, err = run_cli(capsys, "models", "import", str(tmp_path))
    assert rc == 2 and "no model importer" in err and err.count("\n") == 1


def test_a_folder_in_the_config_is_prepared_by_the_importer(tmp_path, monkeypatch):
    """A folder that is not a prepared directory goes to ``st_import.prepare_folder`` (cached
    under the store's ``.folders``); the task is named after the folder and serves its model."""
    import asyncio

    import lumen_core as lc

    src = tmp_path / "st-folder"
    shutil.copytree(F.ST_MODELS / "xlmr-lasttoken", src)
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "h"))
    ref = F.reference("xlmr-lasttoken")

    async def main():
        t = {"name": "t", "backend": "text_embedding", "model": str(src)}
        async with lc.Runtime.from_dict({"tasks": [t]}) as rt:
            res = await rt.infer(lc.InferRequest("t", ref["texts"][0], "text/plain",
                                                 {"prompt_name": ref["prompt_name"]}))
            return res.outputs["embedding"], rt.describe("t")["model_id"]

    vec, model_id = asyncio.run(main())
    assert model_id == "st-folder"
    assert F.cosines(vec, F.reference_vectors("xlmr-lasttoken", prompt=True)[0]).min() >= F.MIN_COSINE
    assert len(list((tmp_path / "h" / "models" / ".folders").glob("[!.]*"))) == 1


def test_a_corrupt_onnx_file_is_a_one_line_error_naming_task_and_file(tmp_path, capsys):
    bad = tmp_path / "x.onnx"
    bad.write_bytes(b"\x08\x07garbage, not a model")
    cfg = tmp_path / "lumen.toml"
    cfg.write_text(f'[[tasks]]\nname = "mine"\nbackend = "onnx"\nmodel = "{bad}"\n')
    rc, _, err = run_cli(capsys, "serve", "--config", str(cfg), "--http-port", "0",
                         "--grpc-port", "0")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "tasks[0].model" in err and "'mine'" in err and str(bad) in err


def test_a_corrupt_prepared_model_is_a_config_error(tmp_path):
    import asyncio

    import lumen_core as lc

    d = tmp_path / "rr"
    shutil.copytree(st_import.prepare_folder(F.ST_MODELS / "bert-cross", home=tmp_path / "h"), d)
    (d / "model.onnx").write_bytes(b"not onnx at all")
    t = {"name": "r", "backend": "rerank", "model": str(d)}
    with pytest.raises(ConfigError) as info:
        asyncio.run(lc.Runtime.from_dict({"tasks": [t]}).start())
    assert "task 'r'" in str(info.value) and str(d / "model.onnx") in str(info.value)
    assert not isinstance(info.value, InvalidArgument)

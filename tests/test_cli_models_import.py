"""``lumen models import`` and start-up errors of text models (issue 36, items 1 and 7): the
CLI calls the importer (``models/st_import.py``, stood in for here by a module of the
contract's shape, until the importer is merged) and prints its errors as one line, exit 2; a
corrupt ONNX file is a one-line config error naming the task and the file."""
from __future__ import annotations

import sys
import types

import pytest
import text_models as TM

from lumen_core import cli, models
from lumen_core.errors import ConfigError, InvalidArgument

IMPORTER = "lumen_core.models.st_import"


class FakeImportError(ConfigError):
    pass


@pytest.fixture
def importer(monkeypatch):
    """A stand-in ``st_import`` recording its calls (``fail``: raise a ModelImportError)."""
    mod = types.ModuleType(IMPORTER)
    mod.calls = []
    mod.fail = None

    def import_folder(src, *, name=None, int8=False, home=None, progress=None):
        mod.calls.append(("import_folder", str(src), name, int8, home))
        if mod.fail:
            raise FakeImportError(str(src), "config.json", mod.fail)
        progress("building")
        prepared = models.Prepared()
        prepared[name or "folder"] = f"{home}/models/{name or 'folder'}"
        return prepared

    def prepare_folder(src, *, home=None, progress=None):
        mod.calls.append(("prepare_folder", str(src)))
        return mod.prepared_dir

    mod.import_folder, mod.prepare_folder = import_folder, prepare_folder
    monkeypatch.setitem(sys.modules, IMPORTER, mod)
    monkeypatch.setattr(models, "st_import", mod, raising=False)
    return mod


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_models_import_calls_the_importer_and_names_the_model(importer, capsys, tmp_path):
    rc, out, err = run_cli(capsys, "models", "import", str(tmp_path), "--name", "bge-small",
                           "--int8", "--home", str(tmp_path / "h"))
    assert rc == 0
    assert importer.calls == [("import_folder", str(tmp_path), "bge-small", True,
                               str(tmp_path / "h"))]
    assert out.startswith("bge-small\t") and 'model_id = "bge-small"' in err
    assert "building" in err


def test_models_import_errors_are_one_line_exit_2(importer, capsys, tmp_path):
    importer.fail = "architecture 'GPT2Model' is not supported (supported: BertModel, ...)"
    rc, out, err = run_cli(capsys, "models", "import", str(tmp_path))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "GPT2Model" in err and "Traceback" not in err


def test_models_import_without_an_importer_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, IMPORTER, None)  # import fails: ModuleNotFoundError
    rc, _, err = run_cli(capsys, "models", "import", str(tmp_path))
    assert rc == 2 and "no model importer" in err and err.count("\n") == 1


def test_a_folder_in_the_config_is_prepared_by_the_importer(importer, tmp_path, prepared_home):
    """A folder that is not a prepared directory goes to ``st_import.prepare_folder``; the
    directory it returns is served."""
    import asyncio

    import lumen_core as lc

    src = tmp_path / "st-folder"
    src.mkdir()
    (src / "config.json").write_text("{}")
    importer.prepared_dir = TM.minilm_as(tmp_path / "h", "built", prepared_home)

    async def main():
        t = {"name": "t", "backend": "text_embedding", "model": str(src)}
        async with lc.Runtime.from_dict({"tasks": [t]}) as rt:
            res = await rt.infer(lc.InferRequest("t", "hi", "text/plain",
                                                 {"prompt_name": "query"}))
            return res.outputs["embedding"].shape, rt.describe("t")["model_id"]

    assert asyncio.run(main()) == ((384,), "st-folder")
    assert importer.calls == [("prepare_folder", str(src))]


def test_a_corrupt_onnx_file_is_a_one_line_error_naming_task_and_file(tmp_path, capsys):
    bad = tmp_path / "x.onnx"
    bad.write_bytes(b"\x08\x07garbage, not a model")
    cfg = tmp_path / "lumen.toml"
    cfg.write_text(f'[[tasks]]\nname = "mine"\nbackend = "onnx"\nmodel = "{bad}"\n')
    rc, _, err = run_cli(capsys, "serve", "--config", str(cfg), "--http-port", "0",
                         "--grpc-port", "0")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "tasks[0].model" in err and "'mine'" in err and str(bad) in err


def test_a_corrupt_prepared_model_is_a_config_error(tmp_path, prepared_home):
    import asyncio

    import lumen_core as lc

    tok = models.model_dir(models.MINILM, prepared_home) / "tokenizer.json"
    d = TM.tiny_reranker(tmp_path / "rr", tok)
    (d / "model.onnx").write_bytes(b"not onnx at all")
    t = {"name": "r", "backend": "rerank", "model": str(d)}
    with pytest.raises(ConfigError) as info:
        asyncio.run(lc.Runtime.from_dict({"tasks": [t]}).start())
    assert "task 'r'" in str(info.value) and str(d / "model.onnx") in str(info.value)
    assert not isinstance(info.value, InvalidArgument)

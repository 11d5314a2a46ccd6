"""The built wheel, as a user gets it (issue 19 item 1): installed into a fresh virtualenv, run
from a folder outside the source tree, its compiled extensions load and ``lumen serve`` answers.

Marked ``wheel`` and deselected by default (pyproject addopts); ``make test-wheel`` (part of
``make test``, so CI) builds the sdist and the manylinux wheel with ``make wheel`` and runs this
with ``LUMEN_WHEEL`` naming it.  Without ``LUMEN_WHEEL`` the test builds a wheel itself (needs
the ``build`` package; the manylinux tag is then only checked when auditwheel is installed).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import venv
import zipfile

import httpx
import numpy as np
import onnx_models as M
import pytest
import serve_support as S

pytestmark = pytest.mark.wheel

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: seconds for `pip install WHEEL[cpu,serve]` into the fresh virtualenv (wheels come from the cache)
INSTALL_TIMEOUT_S = 600
#: seconds `lumen serve` may take to print its ready line
READY_TIMEOUT_S = 120
#: a shipped extension larger than this was not stripped (unstripped they were 0.7-1.7 MB;
#: stripped 45-410 KB)
MAX_EXTENSION_BYTES = 600_000


def _build_wheel(out: pathlib.Path) -> pathlib.Path:
    pytest.importorskip("build", reason="no LUMEN_WHEEL and no `build` package: run make test-wheel")
    raw = out / "raw"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(raw), str(ROOT)],
                   check=True, capture_output=True, timeout=900)
    (whl,) = raw.glob("lumen_core-*.whl")
    auditwheel = shutil.which("auditwheel", path=os.path.dirname(sys.executable))
    if auditwheel is None:
        return whl
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    subprocess.run([auditwheel, "repair", "--wheel-dir", str(out), str(whl)], check=True,
                   capture_output=True, timeout=300, env=env)
    (fixed,) = out.glob("lumen_core-*manylinux*.whl")
    return fixed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    given = os.environ.get("LUMEN_WHEEL")
    if given:
        # absolute: pip installs it from a temp folder (a relative DIST must still work)
        path = pathlib.Path(given).resolve()
        assert path.is_file(), f"LUMEN_WHEEL={given!r} is not a file"
        return path
    return _build_wheel(tmp_path_factory.mktemp("dist"))


def _clean_env(**extra: str) -> dict:
    """The environment of a user's shell: no source tree or test venv on any path, the
    compiled extensions not switched off."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LUMEN_NO_EXTENSIONS",
                        "PYTHONSAFEPATH", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh virtualenv holding the wheel with its [cpu,serve] extras; returns its bin/."""
    home = tmp_path_factory.mktemp("wheel_venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(home / "venv")
    bindir = home / "venv" / "bin"
    proc = subprocess.run([str(bindir / "python"), "-m", "pip", "install",
                           "--disable-pip-version-check", "-q", f"{wheel}[cpu,serve]"],
                          cwd=home, env=_clean_env(), capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return bindir


def _elf_sections(data: bytes) -> set:
    """Section names of a 64-bit little-endian ELF file (enough to tell stripped from not)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize = int.from_bytes(data[0x3A:0x3C], "little")
    shnum = int.from_bytes(data[0x3C:0x3E], "little")
    shstrndx = int.from_bytes(data[0x3E:0x40], "little")

    def header(i: int) -> tuple:
        h = data[shoff + i * shentsize: shoff + (i + 1) * shentsize]
        return int.from_bytes(h[0:4], "little"), int.from_bytes(h[0x18:0x20], "little")

    strtab_off = header(shstrndx)[1]
    names = set()
    for i in range(shnum):
        name_off = header(i)[0]
        end = data.index(b"\0", strtab_off + name_off)
        names.add(data[strtab_off + name_off:end].decode())
    return names


def test_wheel_tag_licence_and_stripped_extensions(wheel):
    print(f"\nwheel: {wheel.name} ({wheel.stat().st_size / 1e6:.2f} MB)")
    assert re.search(r"-cp3\d+-cp3\d+-.*manylinux", wheel.name) or not os.environ.get("LUMEN_WHEEL"), \
        f"{wheel.name}: make wheel must produce a manylinux wheel (auditwheel repair)"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        lic = [n for n in names if re.fullmatch(r"lumen_core-[^/]+\.dist-info/licenses/(LICENSE|NOTICE)", n)]
        assert len(lic) == 2, names
        assert b"Apache License" in z.read(next(n for n in lic if n.endswith("LICENSE")))
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in meta and "Classifier: Typing :: Typed" in meta
        sos = [n for n in names if n.endswith(".so") and "/_" in n]
        # every compiled module where native.TWINS places it: beside its pure twin
        from lumen_core import native

        assert {n.split(".cpython")[0].replace("/", ".") for n in sos} == {
            compiled for compiled, _pure in native.TWINS.values()}, sos
        assert len(sos) == 10
        for n in sos:
            data = z.read(n)
            sections = _elf_sections(data)
            assert ".symtab" not in sections and ".debug_info" not in sections, (n, sections)
            assert len(data) < MAX_EXTENSION_BYTES, (n, len(data))
        assert not any(n.startswith(("tests/", "csrc/")) for n in names)


def test_sdist_carries_the_licence_beside_the_wheel(wheel):
    sdists = list(wheel.parent.glob("lumen_core-*.tar.gz"))
    assert sdists, "no sdist beside the wheel: `make wheel` writes both"
    with tarfile.open(sdists[0]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    # both kinds of compiled source: C-level .pyx and the .pxd that compiles a twin itself
    assert {"LICENSE", "NOTICE", "pyproject.toml", "setup.py", "csrc/_descriptor.pyx",
            "lumen_core/request_path/_scheduler.pxd", "lumen_core/request_path/scheduler.py", "lumen_core/request_path/_entries.pxd",
            "lumen_core/request_path/entries.py", "lumen_core/request_path/_latency.pxd", "lumen_core/request_path/latency.py",
            "lumen_core/request_path/_dispatch.pxd",
            "lumen_core/request_path/dispatch.py"} <= names
    assert not any(n.endswith((".so", ".c")) for n in names), names


def test_installed_wheel_loads_its_compiled_extensions(installed, tmp_path):
    code = ("import json, lumen_core, lumen_core.native as n; print(json.dumps({'file': "
            "lumen_core.__file__, 'version': lumen_core.__version__, 'ext': n.using_extensions()}))")
    out = subprocess.run([str(installed / "python"), "-c", code], cwd=tmp_path, env=_clean_env(),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    info = json.loads(out)
    assert pathlib.Path(info["file"]).is_relative_to(installed.parent), info  # not the tree
    assert not pathlib.Path(info["file"]).is_relative_to(ROOT / "lumen_core"), info
    assert info["ext"] and all(info["ext"].values()), info["ext"]
    assert info["version"] not in ("", "0+unknown")


def test_installed_wheel_serves_a_request(installed, tmp_path):
    cfg = {"server": {"http_port": 0, "grpc_port": 0},
           "tasks": [{"name": "mlp", "backend": "onnx", "intra_op_threads": 1,
                      "model": M.mlp(tmp_path / "mlp.onnx", d_in=S.D_IN, d_out=S.D_OUT),
                      "batching": {"max_queue_delay_us": 0}}]}
    (tmp_path / "lumen.toml").write_text(S.to_toml(cfg))
    proc = subprocess.Popen([str(installed / "lumen"), "serve", "--config", "lumen.toml",
                             "--log-format", "json", "--access-log"],
                            cwd=tmp_path, env=_clean_env(LUMEN_HOME=str(tmp_path / "home")),
                            stderr=subprocess.PIPE, text=True)
    lines: list = []
    try:
        port = _ready_port(proc, lines)
        url = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{url}/healthz", timeout=10).json()
        assert health["status"] == "ok" and health["compiled_extensions"] is True, health
        x = S.mlp_input()
        r = httpx.post(f"{url}/v1/infer/mlp", content=x.tobytes(), params=S.tensor_meta(x.shape),
                       headers={"X-Correlation-Id": "wheel-1"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        y = np.array(body["outputs"]["y"]["data"], np.float32).reshape(S.D_OUT)
        np.testing.assert_allclose(y, M.mlp_reference(x, d_in=S.D_IN, d_out=S.D_OUT)[0],
                                   rtol=1e-4, atol=1e-5)
        assert body["correlation_id"] == "wheel-1"
        S.wait_for(lambda: any("wheel-1" in ln for ln in lines), "the access line")
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    access = [json.loads(ln) for ln in lines if '"lumen.access"' in ln]
    assert [(a["path"], a["status"], a["task"]) for a in access if a.get("correlation_id") == "wheel-1"] \
        == [("/v1/infer/mlp", 200, "mlp")]


def _ready_port(proc: subprocess.Popen, lines: list) -> int:
    """The HTTP port of the ready line; keeps collecting stderr into ``lines`` afterwards."""
    found: dict = {}
    ready = threading.Event()

    def read() -> None:
        for raw in proc.stderr:
            lines.append(raw)
            if "lumen ready" in raw and not ready.is_set():
                m = re.search(r"http://127\.0\.0\.1:(\d+)", raw)
                found["port"] = int(m.group(1)) if m else None
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            break
    assert found.get("port"), "lumen serve from the wheel never got ready:\n" + "".join(lines)
    return found["port"]

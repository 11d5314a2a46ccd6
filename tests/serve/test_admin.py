"""The admin API over HTTP (serve/admin.py): listing, traffic, load / unload, reload (also the
server's SIGHUP path), behind the API key; versions over /v1/infer and OIP; HTTP requests
during swaps all succeed; the lifecycle metrics."""
from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import onnx_models as M
import pytest
import serve_support as S
from prometheus_client.parser import text_string_to_metric_families

from lumen_core import Runtime
from lumen_core.cli import build_parser

KEY = "inference-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "admin-key-1"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
D = 4
QUIET_S = 0.02
#: admin loads name files of at most this size in the `server` fixture
MAX_MODEL_BYTES = 1 << 20


def _write(path: pathlib.Path, k: float) -> None:
    tmp = path.with_name(path.name + ".new")
    M.offset(tmp, k, D)
    os.replace(tmp, path)


def _config(path: pathlib.Path, v1: pathlib.Path, v2: pathlib.Path, extra: str = "") -> None:
    path.write_text(f"""
[server]
api_keys = ["{KEY}"]
admin_api_keys = ["{ADMIN_KEY}"]
{extra}
[[tasks]]
name = "emb"
backend = "onnx"
intra_op_threads = 1
[tasks.batching]
max_queue_delay_us = 0
[[tasks.versions]]
version = "1"
model = "{v1}"
[[tasks.versions]]
version = "2"
model = "{v2}"
[tasks.traffic]
"1" = 100
""")


@pytest.fixture()
def server(tmp_path):
    v1, v2 = tmp_path / "v1.onnx", tmp_path / "v2.onnx"
    _write(v1, 1.0)
    _write(v2, 2.0)
    cfg = tmp_path / "lumen.toml"
    _config(cfg, v1, v2, f"admin_max_model_bytes = {MAX_MODEL_BYTES}\n")
    rt = Runtime.from_config(str(cfg))
    rt._lifecycle.quiet_s = QUIET_S
    srv = S.ServerThread(rt, grpc=False)
    srv.v1, srv.v2 = v1, v2
    try:
        yield srv
    finally:
        srv.stop()


def _infer(url: str, **meta) -> httpx.Response:
    x = np.zeros((1, D), np.float32)
    return httpx.post(f"{url}/v1/infer/emb", content=x.tobytes(),
                      params={**S.tensor_meta(x.shape), **meta},
                      headers={"Content-Type": "application/octet-stream", **AUTH}, timeout=30)


def _served(r: httpx.Response) -> tuple:
    body = r.json()
    return body["meta"]["lumen.model.version"], body["outputs"]["y"]["data"][0]


def test_admin_needs_the_key(server):
    for method, path in (("GET", "/v1/admin/tasks"), ("POST", "/v1/admin/tasks/emb/reload"),
                         ("PUT", "/v1/admin/tasks/emb/traffic"),
                         ("POST", "/v1/admin/tasks/emb/versions/2/unload")):
        r = httpx.request(method, server.url + path, json={"1": 1}, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "unauthenticated"


def test_list_traffic_pin_unload_load(server):
    url = server.url
    r = httpx.get(f"{url}/v1/admin/tasks", headers=ADMIN, timeout=10)
    assert r.status_code == 200
    emb = r.json()["tasks"]["emb"]
    assert [(v["version"], v["state"]) for v in emb["versions"]] == [("1", "ready"), ("2", "ready")]
    assert emb["traffic"] == {"1": 100.0, "2": 0.0} and emb["default_version"] == "1"
    assert len(emb["versions"][0]["revision"]) == 64 and emb["load_failures"] == {}
    assert _served(_infer(url)) == ("1", 1.0)
    assert _served(_infer(url, **{"lumen.model.version": "2"})) == ("2", 2.0)
    bad = _infer(url, **{"lumen.model.version": "3"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "lumen.model.version"

    r = httpx.put(f"{url}/v1/admin/tasks/emb/traffic", json={"2": 1}, headers=ADMIN, timeout=10)
    assert r.status_code == 200 and r.json()["default_version"] == "2"
    assert _served(_infer(url)) == ("2", 2.0)
    for body in ({"9": 1}, {"1": -1}, [], {"1": 10 ** 400}, {"1": 1e308, "2": 1e308}):
        r = httpx.put(f"{url}/v1/admin/tasks/emb/traffic", json=body, headers=ADMIN, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["field"] == "traffic", body

    r = httpx.post(f"{url}/v1/admin/tasks/emb/versions/2/unload", headers=ADMIN, timeout=30)
    assert r.status_code == 200
    assert [v["version"] for v in r.json()["versions"]] == ["1"]
    assert _served(_infer(url)) == ("1", 1.0)  # the split falls back to what serves
    r = httpx.post(f"{url}/v1/admin/tasks/emb/versions/1/unload", headers=ADMIN, timeout=30)
    assert r.status_code == 400 and "only loaded version" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/admin/tasks/emb/versions/2/load", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and r.json()["default_version"] == "2"  # its weight is back
    assert _served(_infer(url)) == ("2", 2.0)
    v3 = server.v1.with_name("v3.onnx")
    _write(v3, 3.0)
    r = httpx.post(f"{url}/v1/admin/tasks/emb/versions/3/load", json={"model": str(v3)},
                   headers=ADMIN, timeout=30)
    assert r.status_code == 200
    assert _served(_infer(url, **{"lumen.model.version": "3"})) == ("3", 3.0)
    r = httpx.post(f"{url}/v1/admin/tasks/nope/reload", headers=ADMIN, timeout=10)
    assert r.status_code == 404

    # OIP: the model lists its versions; /versions/{v} pins one
    meta = httpx.get(f"{url}/v2/models/emb", headers=AUTH, timeout=10).json()
    assert meta["versions"] == ["1", "2", "3"]
    body = {"inputs": [{"name": "none", "datatype": "FP32", "shape": [1, D],
                        "data": [0.0] * D}]}
    r = httpx.post(f"{url}/v2/models/emb/versions/1/infer", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["model_version"] == "1" and r.json()["outputs"][0]["data"][0] == 1.0
    r = httpx.post(f"{url}/v2/models/emb/versions/9/infer", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 404


def test_admin_keys_are_apart_from_inference_keys(server):
    url = server.url
    r = httpx.get(f"{url}/v1/admin/tasks", headers=AUTH, timeout=10)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "permission_denied"
    assert "admin_api_keys" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/admin/tasks", headers=ADMIN, timeout=10).status_code == 200
    bad = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{url}/v1/admin/tasks", headers=bad, timeout=10).status_code == 401
    # an admin key is not an inference key
    x = np.zeros((1, D), np.float32)
    r = httpx.post(f"{url}/v1/infer/emb", content=x.tobytes(), params=S.tensor_meta(x.shape),
                   headers={"Content-Type": "application/octet-stream", **ADMIN}, timeout=10)
    assert r.status_code == 401


def test_inference_keys_alone_never_open_the_admin_api():
    from lumen_core.errors import PermissionDenied, Unauthenticated
    from lumen_core.serve.auth import ApiKeys

    keys = ApiKeys(["k"])
    with pytest.raises(PermissionDenied, match="none configured"):
        keys.check_admin("Bearer k")
    with pytest.raises(Unauthenticated):
        keys.check_admin("Bearer other")
    ApiKeys().check_admin(None)  # no key at all: open, as every route is
    ApiKeys(admin_keys=["a"]).check_admin("Bearer a")
    with pytest.raises(Unauthenticated):
        ApiKeys(admin_keys=["a"]).check_admin(None)
    with pytest.raises(ValueError, match="both"):
        Runtime.from_dict({"server": {"api_keys": ["k"], "admin_api_keys": ["k"]}})


def _load(url: str, model: str, version: str = "9") -> httpx.Response:
    return httpx.post(f"{url}/v1/admin/tasks/emb/versions/{version}/load",
                      json={"model": model}, headers=ADMIN, timeout=10)


def test_admin_loads_are_confined_to_the_model_root(server, tmp_path_factory):
    url = server.url
    root = server.v1.parent  # the config file's folder
    # outside the root: refused, telling nothing of what exists there
    outside = []
    for p in ("/etc/passwd", "/etc/no_such_file_here", "/dev/zero", "../elsewhere.onnx",
              str(root / ".." / "x.onnx")):
        r = _load(url, p)
        assert r.status_code == 403, (p, r.text)
        err = r.json()["error"]
        assert err["field"] == "model" and "model root" in err["message"]
        outside.append(err["message"].replace(p, "<p>"))
    assert len(set(outside)) == 1, outside
    (root / "escape.onnx").symlink_to("/etc/passwd")
    assert _load(url, "escape.onnx").status_code == 403
    # under the root: a missing file names the request's path and field, not the config
    r = _load(url, "missing.onnx")
    err = r.json()["error"]
    assert r.status_code == 400 and err["field"] == "model", r.text
    assert "'missing.onnx'" in err["message"] and "lumen.toml" not in err["message"]
    # not a regular file: refused at once, never read
    os.mkfifo(root / "pipe.onnx")
    r = _load(url, "pipe.onnx")
    assert r.status_code == 400 and "not a regular file" in r.json()["error"]["message"]
    with open(root / "big.onnx", "wb") as fh:
        fh.truncate(MAX_MODEL_BYTES + 1)
    r = _load(url, "big.onnx")
    assert r.status_code == 413 and "admin_max_model_bytes" in r.json()["error"]["message"]
    # a file that fails to load: its error names the load request, not a config key
    (root / "corrupt.onnx").write_bytes(b"corrupt")
    r = _load(url, "corrupt.onnx")
    assert r.status_code == 422, r.text
    assert "lumen.toml" not in r.json()["error"]["message"]
    view = httpx.get(f"{url}/v1/admin/tasks/emb", headers=ADMIN, timeout=10).json()
    failed = [v for v in view["versions"] if v["version"] == "9"]
    assert failed and failed[0]["state"] == "failed"
    assert "lumen.toml" not in failed[0]["error"]
    # a relative path is taken under the root
    _write(root / "v3.onnx", 3.0)
    assert _load(url, "v3.onnx", "3").status_code == 200
    assert _served(_infer(url, **{"lumen.model.version": "3"})) == ("3", 3.0)


def test_a_failed_load_is_an_error_status(server):
    """Issue 38 row 10: a load that fails is a 422 naming the cause (``curl -f`` and scripts
    see it), not a 200 whose body says ``"state": "failed"``; what served keeps serving."""
    root = server.v1.parent
    (root / "broken.onnx").write_bytes(b"not an onnx graph")
    r = _load(server.url, "broken.onnx", "5")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "load_failed" and err["field"] == "model"
    assert "'emb' version '5' failed to load" in err["message"]
    assert "load again" in err["message"]  # what to do
    # the cause itself, as the version's state shows it
    view = httpx.get(f"{server.url}/v1/admin/tasks/emb", headers=ADMIN, timeout=10).json()
    (five,) = [v for v in view["versions"] if v["version"] == "5"]
    assert five["state"] == "failed" and five["error"] in err["message"]
    assert _served(_infer(server.url)) == ("1", 1.0)
    curl = shutil.which("curl")
    if curl is not None:  # the manual's own call: curl -f exits 22 on an HTTP error status
        p = subprocess.run([curl, "-sf", "-X", "POST", "-H", f"Authorization: {ADMIN['Authorization']}",
                            "-H", "Content-Type: application/json", "-d", '{"model": "broken.onnx"}',
                            f"{server.url}/v1/admin/tasks/emb/versions/5/load"],
                           capture_output=True, timeout=30)
        assert p.returncode == 22, (p.returncode, p.stdout, p.stderr)
    # a config version whose file went bad: the same status, the field is the version
    server.v2.write_bytes(b"corrupt")
    r = httpx.post(f"{server.url}/v1/admin/tasks/emb/versions/2/load", headers=ADMIN,
                   timeout=10)
    assert r.status_code == 422 and r.json()["error"]["field"] == "version", r.text


def _read_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith("rchar"))


def test_shutdown_never_waits_for_an_admin_load(tmp_path):
    """A huge (sparse) file under the root is being read when the server stops: the read
    gives up at once, so the shutdown neither waits out its grace period for the load nor
    leaves a worker thread reading."""
    v1, v2 = tmp_path / "v1.onnx", tmp_path / "v2.onnx"
    _write(v1, 1.0)
    _write(v2, 2.0)
    cfg = tmp_path / "lumen.toml"
    _config(cfg, v1, v2, "admin_max_model_bytes = 1099511627776\n")
    huge = tmp_path / "huge.onnx"
    with open(huge, "wb") as fh:
        fh.truncate(1 << 40)
    rt = Runtime.from_config(str(cfg))
    rt._lifecycle.quiet_s = QUIET_S
    srv = S.ServerThread(rt, grpc=False, grace_s=30.0)
    loader = threading.Thread(target=lambda: _load_quietly(srv.url, "huge.onnx"), daemon=True)
    try:
        before = _read_bytes()
        loader.start()
        S.wait_for(lambda: _read_bytes() - before > 64 << 20, "the admin load reading the file")
        async def stop() -> None:
            await srv.server.shutdown()

        t0 = time.monotonic()
        srv.call(stop(), timeout=10)
        assert time.monotonic() - t0 < 5.0  # not the 30 s grace
        # every worker thread (the one hashing the file too) ends at once
        srv.call(srv.loop.shutdown_default_executor(), timeout=5)
    finally:
        srv.loop.call_soon_threadsafe(srv.loop.stop)
        huge.unlink()
    loader.join(10)


def _load_quietly(url: str, model: str) -> None:
    try:
        _load(url, model)
    except httpx.HTTPError:
        pass  # the server went away under it


def test_reload_under_http_load(server):
    """Swaps of version 1's file (by POST .../reload and by the server's SIGHUP handler) and
    a corrupt file while 64 HTTP clients keep sending: every request succeeds."""
    url = server.url
    errors: list = []
    results: list = []
    stop = threading.Event()

    def clients() -> None:
        async def one(client: httpx.AsyncClient) -> None:
            x = np.zeros((1, D), np.float32).tobytes()
            while not stop.is_set():
                r = await client.post(f"{url}/v1/infer/emb", content=x,
                                      params=S.tensor_meta((1, D)),
                                      headers={"Content-Type": "application/octet-stream",
                                               **AUTH})
                if r.status_code != 200:
                    errors.append(r.text)
                else:
                    results.append(_served(r))

        async def main() -> None:
            async with httpx.AsyncClient(timeout=30,
                                         limits=httpx.Limits(max_connections=64)) as client:
                await asyncio.gather(*(one(client) for _ in range(64)))
        asyncio.run(main())

    t = threading.Thread(target=clients)
    t.start()
    try:
        for k in (11.0, 12.0, 13.0):
            _write(server.v1, k)
            r = httpx.post(f"{url}/v1/admin/tasks/emb/reload", headers=ADMIN, timeout=60)
            assert r.status_code == 200
            S.wait_for(lambda k=k: ("1", k) in results[-20:], f"the swap to +{k:g} serving")
        _write(server.v1, 14.0)
        async def sighup() -> None:
            await server.server.reload()  # what the SIGHUP handler runs
        server.call(sighup())
        server.v1.write_bytes(b"corrupt")
        r = httpx.post(f"{url}/v1/admin/tasks/emb/reload", headers=ADMIN, timeout=60)
        view = r.json()
        assert {(v["version"], v["state"]) for v in view["versions"]} >= \
            {("1", "ready"), ("1", "failed")}
        assert view["load_failures"] == {"1": 1}
        n = len(results)
        S.wait_for(lambda: len(results) > n + 50, "requests served after the failed load")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors[:3]
    assert {v for v, _k in results} == {"1"}
    assert {11.0, 12.0, 13.0, 14.0} <= {k for _v, k in results}
    assert results[-1] == ("1", 14.0)  # the corrupt file never served
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    samples = {(x.name, frozenset(x.labels.items())): x.value
               for fam in text_string_to_metric_families(text) for x in fam.samples}
    assert S.metric(samples, "lumen_model_load_failures_total", task="emb", version="1") == 1
    assert S.metric(samples, "lumen_requests_total", task="emb", code="ok", version="1") > 0


def test_serve_watch_flags():
    args = build_parser().parse_args(["serve", "--watch", "--watch-interval", "0.5"])
    assert args.watch and args.watch_interval == 0.5
    assert not build_parser().parse_args(["serve"]).watch


def test_lumen_serve_watch_and_sighup(tmp_path):
    """`lumen serve --watch` in a subprocess picks up a swapped model file by itself, and
    SIGHUP triggers a reload (logged) without stopping the server."""
    v1, v2 = tmp_path / "v1.onnx", tmp_path / "v2.onnx"
    _write(v1, 1.0)
    _write(v2, 2.0)
    cfg = tmp_path / "lumen.toml"
    _config(cfg, v1, v2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "lumen_core.cli", "serve", "--config", str(cfg),
                             "--http-port", "0", "--grpc-port", "0", "--watch",
                             "--watch-interval", "0.1"],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list = []
    try:
        port = None
        for line in proc.stderr:
            lines.append(line)
            if "lumen ready" in line:
                port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
                break
        assert port is not None, "".join(lines)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        assert _served(_infer(url)) == ("1", 1.0)
        _write(v1, 5.0)
        S.wait_for(lambda: _served(_infer(url)) == ("1", 5.0), "the watcher's swap")
        proc.send_signal(signal.SIGHUP)
        S.wait_for(lambda: any("SIGHUP" in ln for ln in lines), "the SIGHUP reload line")
        assert _served(_infer(url)) == ("1", 5.0) and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_oip_grpc_pins_and_names_versions(tmp_path):
    """tritonclient over gRPC: model_version pins a loaded version, the reply names the one
    that served, metadata lists the loaded versions."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    v1, v2 = tmp_path / "v1.onnx", tmp_path / "v2.onnx"
    _write(v1, 1.0)
    _write(v2, 2.0)
    rt = Runtime.from_dict({"tasks": [{
        "name": "emb", "backend": "onnx", "intra_op_threads": 1,
        "versions": [{"version": "1", "model": str(v1)}, {"version": "2", "model": str(v2)}]}]})
    srv = S.ServerThread(rt, grpc=True)
    client = grpcclient.InferenceServerClient(srv.grpc_target)
    try:
        assert client.get_model_metadata("emb").versions == ["1", "2"]
        x = grpcclient.InferInput("none", [1, D], "FP32")
        x.set_data_from_numpy(np.zeros((1, D), np.float32))
        for pin, want in (("1", 1.0), ("2", 2.0), ("", 2.0)):
            r = client.infer("emb", [x], model_version=pin)
            assert r.get_response().model_version == (pin or "2")
            assert r.as_numpy("y").reshape(-1)[0] == want
        with pytest.raises(InferenceServerException) as ei:
            client.infer("emb", [x], model_version="9")
        assert "no version '9'" in str(ei.value)
    finally:
        client.close()
        srv.stop()

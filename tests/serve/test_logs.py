"""Server logs (issue 19 item 4): --log-format text|json, the access log's fields, and the
request's correlation id on every line logged while it is served."""
from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading

import httpx
import pytest
import serve_support as S

from lumen_core import cli
from lumen_core.runtime import Runtime
from lumen_core.serve import logs

CID = "trace-me-42"


@pytest.fixture()
def log_stream():
    """Our handler (JSON lines) on a StringIO for the test, undone afterwards."""
    stream = io.StringIO()
    undo = logs.configure("warning", "json", access=True, stream=stream)
    try:
        yield stream
    finally:
        undo()


def _lines(stream: io.StringIO) -> list:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = S.onnx_config(tmp_path_factory.mktemp("logs"), slow=False)
    srv = S.ServerThread(Runtime.from_dict(cfg), grpc=False, access_log=True)
    try:
        yield srv
    finally:
        srv.stop()


def _access(stream: io.StringIO, cid: str, want: int = 1) -> dict:
    """The access line of the request ``cid`` (it is written after the reply, so wait)."""
    def found() -> list:
        return [ln for ln in _lines(stream)
                if ln["logger"] == "lumen.access" and ln.get("correlation_id") == cid]

    S.wait_for(lambda: len(found()) >= want, f"the access line of {cid}")
    (line,) = found()
    return line


def test_access_line_fields_for_infer(server, log_stream):
    x = S.mlp_input()
    r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(),
                   params=S.tensor_meta(x.shape), headers={"X-Correlation-Id": CID}, timeout=30)
    assert r.status_code == 200 and r.headers["x-correlation-id"] == CID
    line = _access(log_stream, CID)
    assert line["method"] == "POST" and line["path"] == "/v1/infer/mlp"
    assert line["status"] == 200 and line["task"] == "mlp"
    assert line["bytes"] == len(r.content) and line["bytes_in"] == x.nbytes
    assert 0 < line["ms"] < 30_000 and line["client"] == "127.0.0.1"
    assert line["level"] == "INFO" and line["ts"].endswith("Z")
    assert CID in line["message"] and "/v1/infer/mlp" in line["message"]
    assert "lumen.tensor" not in json.dumps(line)  # the query string (request meta) stays out


def test_access_line_names_the_embeddings_model_and_errors(server, log_stream):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "nope", "input": ["a"]},
                   headers={"X-Correlation-Id": CID + "-e"}, timeout=30)
    assert r.status_code == 404
    line = _access(log_stream, CID + "-e")
    assert (line["path"], line["status"], line["task"]) == ("/v1/embeddings", 404, "nope")
    assert line["bytes"] == len(r.content)
    assert r.headers["x-correlation-id"] == CID + "-e"  # echoed on every reply, errors too


def test_a_request_without_an_id_gets_one_and_answers_under_it(server, log_stream):
    x = S.mlp_input()
    r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(),
                   params=S.tensor_meta(x.shape), timeout=30)
    assert r.status_code == 200
    cid = r.headers["x-correlation-id"]
    assert len(cid) == 32 and r.json()["correlation_id"] == cid  # the runtime used it too
    assert _access(log_stream, cid)["task"] == "mlp"
    r = httpx.get(f"{server.url}/healthz", timeout=10)
    line = _access(log_stream, r.headers["x-correlation-id"])
    assert line["task"] == "-" and line["status"] == 200


def test_lines_logged_while_serving_a_request_carry_its_id(server, log_stream, monkeypatch):
    """A line logged on the request's path (here: inside the runtime call) names it."""
    app = server.server.http
    infer = app.runtime.infer

    async def logged_infer(req):
        logging.getLogger("lumen.test").warning("inside the runtime for %s", req.task)
        return await infer(req)

    monkeypatch.setattr(app.runtime, "infer", logged_infer)
    x = S.mlp_input()
    r = httpx.post(f"{server.url}/v1/infer/mlp", content=x.tobytes(),
                   params=S.tensor_meta(x.shape), headers={"X-Correlation-Id": CID + "-in"},
                   timeout=30)
    assert r.status_code == 200
    _access(log_stream, CID + "-in")
    inside = [ln for ln in _lines(log_stream) if ln["logger"] == "lumen.test"]
    assert inside and inside[-1]["correlation_id"] == CID + "-in"
    assert inside[-1]["message"] == "inside the runtime for mlp"


def test_a_forged_correlation_id_cannot_split_a_text_line(server):
    stream = io.StringIO()
    undo = logs.configure("warning", "text", access=True, stream=stream)
    try:
        r = httpx.get(f"{server.url}/healthz", headers={"X-Correlation-Id": 'a" 500 x=y'},
                      timeout=10)
        assert r.status_code == 200
        S.wait_for(lambda: "/healthz" in stream.getvalue(), "the access line")
    finally:
        undo()
    line = [ln for ln in stream.getvalue().splitlines() if "/healthz" in ln][-1]
    assert ' INFO lumen.access: 127.0.0.1 "GET /healthz" 200 task=- ' in line
    assert line.endswith("cid=a??500?x=y")  # the spaces cannot fake a status or a field


def test_a_forged_model_name_cannot_add_a_log_line(server, log_stream):
    r = httpx.post(f"{server.url}/v1/embeddings", timeout=30,
                   json={"model": 'x"\n2026 INFO lumen.access: forged', "input": ["a"]},
                   headers={"X-Correlation-Id": CID + "-f"})
    assert r.status_code == 404
    assert _access(log_stream, CID + "-f")["task"] == "x??2026?INFO?lumen.access:?forged"


def test_text_and_json_formatters():
    rec = logging.LogRecord("lumen.http", logging.ERROR, __file__, 1, "boom %d", (7,), None)
    token = logs.CORRELATION_ID.set("c1")
    try:
        logs.CorrelationIdFilter().filter(rec)
    finally:
        logs.CORRELATION_ID.reset(token)
    assert rec.correlation_id == "c1"
    assert logs.TextFormatter().format(rec).endswith("ERROR lumen.http: boom 7 cid=c1")
    obj = json.loads(logs.JsonFormatter().format(rec))
    assert obj["message"] == "boom 7" and obj["correlation_id"] == "c1"
    assert obj["level"] == "ERROR" and obj["logger"] == "lumen.http"
    try:
        raise ValueError("bad")
    except ValueError:
        rec2 = logging.LogRecord("x", logging.ERROR, __file__, 1, "m", (), sys.exc_info())
    logs.CorrelationIdFilter().filter(rec2)  # outside a request: no id
    obj2 = json.loads(logs.JsonFormatter().format(rec2))
    assert "correlation_id" not in obj2 and "ValueError: bad" in obj2["exc"]
    with pytest.raises(ValueError):
        logs.formatter("xml")


def test_configure_undo_restores_the_root_logger():
    root = logging.getLogger()
    before = (list(root.handlers), root.level, logs.access_log.level)
    undo = logs.configure("debug", "json", access=True)
    assert root.level == logging.DEBUG
    undo()
    assert (list(root.handlers), root.level, logs.access_log.level) == before


def test_log_format_flag_parses():
    args = cli.build_parser().parse_args(["serve", "--log-format", "json", "--access-log"])
    assert args.log_format == "json" and args.access_log
    assert cli.build_parser().parse_args(["serve"]).log_format == "text"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--log-format", "xml"])


def test_lumen_serve_json_logs_end_to_end(tmp_path):
    """`lumen serve --log-format json --access-log` in a subprocess: every stderr line is a
    JSON object, the ready line among them, and a request's access line names its id."""
    cfg = S.onnx_config(tmp_path, slow=False)
    toml = tmp_path / "lumen.toml"
    toml.write_text(S.to_toml(cfg))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "lumen_core.cli", "serve", "--config", str(toml),
                             "--http-port", "0", "--grpc-port", "0", "--log-format", "json",
                             "--access-log"], stderr=subprocess.PIPE, text=True, env=env)
    lines: list = []
    try:
        port = None
        for raw in proc.stderr:
            lines.append(raw)
            if "lumen ready" in raw:
                msg = json.loads(raw)["message"]
                port = int(msg.split("http://127.0.0.1:")[1].split()[0].rstrip(","))
                break
        assert port is not None, "".join(lines)
        rest: list = []
        reader = threading.Thread(target=lambda: rest.extend(proc.stderr), daemon=True)
        reader.start()
        x = S.mlp_input()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/infer/mlp", content=x.tobytes(),
                       params=S.tensor_meta(x.shape), headers={"X-Correlation-Id": CID},
                       timeout=30)
        assert r.status_code == 200
        S.wait_for(lambda: any(CID in ln for ln in rest), "the access line")
        proc.terminate()
        assert proc.wait(30) == 0
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    objs = [json.loads(ln) for ln in lines + rest if ln.strip()]  # every line is JSON
    access = [o for o in objs if o["logger"] == "lumen.access"]
    assert len(access) == 1 and access[0]["correlation_id"] == CID
    assert access[0]["status"] == 200 and access[0]["task"] == "mlp"
    assert any(o["message"] == "lumen stopped" for o in objs)


FORGED = "203.0.113.9"


def test_forwarded_headers_are_believed_only_from_configured_proxies(server, log_stream,
                                                                     tmp_path):
    """Issue 25, also seen: uvicorn believed X-Forwarded-For from 127.0.0.1, so any local
    client could forge the access log's address; now only ``[server] forwarded_allow_ips``."""
    fwd = {"X-Forwarded-For": FORGED}
    r = httpx.get(f"{server.url}/v1/tasks", headers={**fwd, "X-Correlation-Id": "fwd-1"},
                  timeout=10)
    assert r.status_code == 200
    assert _access(log_stream, "fwd-1")["client"] == "127.0.0.1"
    cfg = S.onnx_config(tmp_path, slow=False, forwarded_allow_ips=["127.0.0.1"])
    proxied = S.ServerThread(Runtime.from_dict(cfg), grpc=False, access_log=True)
    try:
        httpx.get(f"{proxied.url}/v1/tasks", headers={**fwd, "X-Correlation-Id": "fwd-2"},
                  timeout=10)
        assert _access(log_stream, "fwd-2")["client"] == FORGED
    finally:
        proxied.stop()


def test_forwarded_allow_ips_must_be_addresses():
    from lumen_core.config import parse_config
    from lumen_core.errors import ConfigError

    ok = parse_config({"server": {"forwarded_allow_ips": ["10.0.0.0/8", "::1", "*"]}})
    assert ok.server.forwarded_allow_ips == ("10.0.0.0/8", "::1", "*")
    assert parse_config({}).server.forwarded_allow_ips == ()
    with pytest.raises(ConfigError, match="forwarded_allow_ips"):
        parse_config({"server": {"forwarded_allow_ips": ["proxy.local"]}})


def test_no_keys_on_a_public_address_is_a_warning_at_start(tmp_path, caplog):
    """Issue 25, also seen: without keys the admin API is open; fine on loopback, said at
    start when the server listens elsewhere (and not when keys are set)."""
    import asyncio

    from lumen_core.serve.server import LumenServer, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    cfg = S.onnx_config(tmp_path, slow=False)
    del cfg["tasks"][1:]

    async def warnings(host: str, **server) -> list:
        caplog.clear()
        rt = Runtime.from_dict({**cfg, "server": {**cfg["server"], **server}})
        srv = LumenServer(rt, host=host, http_port=0, grpc_port=None)
        await srv.start()
        await srv.shutdown()
        return [r.getMessage() for r in caplog.records
                if r.name == "lumen.serve" and r.levelno == logging.WARNING]

    async def go() -> tuple:
        return (await warnings("127.0.0.1"), await warnings("0.0.0.0"),
                await warnings("0.0.0.0", api_keys=["k-0123456789"]))

    with caplog.at_level(logging.INFO, logger="lumen.serve"):
        loopback, public, keyed = asyncio.run(go())
    assert loopback == [] and keyed == []
    (line,) = public
    assert "0.0.0.0" in line and "admin API" in line and "api_keys" in line

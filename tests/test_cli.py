"""The ``lumen`` command: serve/infer/bench wiring, mime guessing, error messages, and the load
generator's pieces (percentiles, progress lines, HTTP framing against a live server)."""
from __future__ import annotations

import asyncio
import io
import json
import os
import pathlib
import subprocess
import sys
import time
import wave

import numpy as np
import onnx_models as M
import pytest
import serve_support as S

from lumen_core import cli, loadgen, models, openloop
from lumen_core.cli import common as cli_common
from lumen_core.cli import infer as cli_infer


def run_cli(capsys, *argv: str) -> tuple:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    texts = json.loads((fixtures_dir / "minilm_reference.json").read_text())["texts"]
    return texts, np.load(fixtures_dir / "minilm_reference_embeddings.npy")


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("serve", "infer", "embed", "bench", "models"):
        assert cmd in out


def test_infer_npy_in_process_with_config(tmp_path, capsys):
    cfg = S.onnx_config(tmp_path, slow=False)
    (tmp_path / "lumen.toml").write_text(S.to_toml(cfg))
    x = S.mlp_input(5)
    np.save(tmp_path / "x.npy", x)
    rc, out, _ = run_cli(capsys, "infer", "mlp", str(tmp_path / "x.npy"),
                         "--config", str(tmp_path / "lumen.toml"),
                         "--meta", "lumen.preprocess.id=none")
    assert rc == 0
    body = json.loads(out)
    assert body["task"] == "mlp" and body["outputs"]["y"]["shape"] == [S.D_OUT]
    np.testing.assert_allclose(body["outputs"]["y"]["data"], M.mlp_reference(x, d_out=S.D_OUT)[0],
                               rtol=1e-5, atol=1e-5)


def test_in_process_infer_and_grpc_do_not_load_the_http_stack(tmp_path):
    """`lumen infer` in process encodes its reply with serve/codec.py, and the gRPC module
    needs no HTTP module either: neither pulls in Starlette (checked in a fresh interpreter)."""
    cfg = S.onnx_config(tmp_path, slow=False)
    toml = tmp_path / "lumen.toml"
    toml.write_text(S.to_toml(cfg))
    x = S.mlp_input(6)
    np.save(tmp_path / "x.npy", x)
    argv = ["infer", "mlp", str(tmp_path / "x.npy"), "--config", str(toml),
            "--meta", "lumen.preprocess.id=none"]
    code = ("import sys\n"
            "from lumen_core import cli\n"
            "import lumen_core.serve.grpc\n"
            f"rc = cli.main({argv!r})\n"
            "loaded = sorted(m for m in ('starlette', 'lumen_core.serve.http') if m in sys.modules)\n"
            "print('rc', rc, 'http modules', loaded, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "rc 0 http modules []", proc.stderr
    body = json.loads(proc.stdout)
    assert set(body) == {"correlation_id", "task", "outputs", "meta"}
    np.testing.assert_allclose(body["outputs"]["y"]["data"], M.mlp_reference(x, d_out=S.D_OUT)[0],
                               rtol=1e-5, atol=1e-5)


def test_infer_text_file_in_process_and_over_http(tmp_path, capsys, embed_server, reference,
                                                  tmp_path_factory, monkeypatch):
    texts, ref = reference
    f = tmp_path / "hello.txt"
    f.write_text(texts[2])
    monkeypatch.setenv("LUMEN_HOME", str(S.prepared_home(tmp_path_factory)))
    rc, out, _ = run_cli(capsys, "infer", "text_embed", str(f))
    assert rc == 0
    np.testing.assert_allclose(json.loads(out)["outputs"]["embedding"]["data"], ref[2], atol=1e-4)
    rc, out, _ = run_cli(capsys, "infer", "text_embed", str(f), "--url", embed_server.url)
    assert rc == 0
    np.testing.assert_allclose(json.loads(out)["outputs"]["embedding"]["data"], ref[2], atol=1e-4)


def test_infer_errors_are_one_line(tmp_path, capsys, embed_server):
    odd = tmp_path / "payload.zzz"
    odd.write_bytes(b"x")
    rc, _, err = run_cli(capsys, "infer", "text_embed", str(odd), "--url", embed_server.url)
    assert rc == cli.EXIT_USAGE and "--mime" in err
    txt = tmp_path / "a.txt"
    txt.write_text("hi")
    rc, _, err = run_cli(capsys, "infer", "no_such_task", str(txt), "--url", embed_server.url)
    assert rc == cli.EXIT_USAGE and "unknown task" in err and "Traceback" not in err


@pytest.mark.parametrize("reply", [b'{"error": "no such route"}', b'{"error": {"code": 7}}', b"[1]"])
def test_infer_url_against_a_foreign_error_body_is_one_line(tmp_path, capsys, reply):
    """A server that is not Lumen (or a proxy in front of it) answers an error in another
    JSON shape: still one line naming the status, never a traceback."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's handler name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(502)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    txt = tmp_path / "a.txt"
    txt.write_text("hi")
    try:
        rc, _, err = run_cli(capsys, "infer", "t", str(txt), "--url",
                             f"http://127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
        srv.server_close()
    assert rc == cli.EXIT_USAGE and "502" in err and "Traceback" not in err


def test_serve_without_prepared_models_says_what_to_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "empty"))
    rc, _, err = run_cli(capsys, "serve", "--http-port", "0")
    assert rc == cli.EXIT_USAGE and "lumen models prepare" in err


def test_bench_against_a_live_server(tmp_path, capsys, embed_server):
    out_json = tmp_path / "bench.json"
    rc, out, err = run_cli(capsys, "bench", "--target", f"ours={embed_server.url}", "-c", "2", "4",
                           "-n", "24", "--warmup", "4", "--json", str(out_json))
    assert rc == 0, err
    assert loadgen.TABLE_HEADER in out
    rows = json.loads(out_json.read_text())
    assert [(r["target"], r["concurrency"], r["requests"], r["errors"]) for r in rows] == [
        ("ours", 2, 24, 0), ("ours", 4, 24, 0)]
    for r in rows:
        assert r["rps"] > 0 and r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert "(100%)" in err  # not a terminal: plain progress lines


def test_bench_open_loop_against_a_live_server(tmp_path, capsys, embed_server):
    out_json, png = tmp_path / "open.json", tmp_path / "open.png"
    rc, out, err = run_cli(capsys, "bench", "--target", f"ours={embed_server.url}", "--rate",
                           "40", "--duration", "0.3", "--target-ms", "10000", "--json",
                           str(out_json), "--plot", str(png))
    assert rc == 0, err
    assert openloop.OPEN_HEADER in out and "goodput (ok within 10000 ms)" in out
    (r,) = json.loads(out_json.read_text())
    assert r["target"] == "ours" and r["rate"] == 40 and r["sent"] > 0
    assert r["ok"] == r["ok_in_target"] == r["sent"]  # light load: every answer in time
    assert r["refused"] == r["deadline"] == r["errors"] == 0
    assert sum(s["sent"] for s in r["per_second"]) == r["sent"]
    assert r["goodput"] == pytest.approx(r["ok_in_target"] / 0.3)
    assert png.stat().st_size > 0


def test_bench_open_loop_in_process_with_a_latency_target(tmp_path, capsys, tmp_path_factory,
                                                         monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(S.prepared_home(tmp_path_factory)))
    cfg = tmp_path / "lumen.toml"
    cfg.write_text('[[tasks]]\nname = "text_embed"\nbackend = "text_embedding"\n'
                   'model_id = "all-minilm-l6-v2"\n[tasks.batching]\nlatency_target_ms = 60000\n')
    out_json = tmp_path / "open.json"
    rc, out, err = run_cli(capsys, "bench", "--in-process", "--config", str(cfg), "--rate",
                           "40", "--duration", "0.3", "--json", str(out_json))
    assert rc == 0, err
    (r,) = json.loads(out_json.read_text())
    assert r["target"] == "in-process" and r["sent"] > 0
    assert r["ok"] == r["sent"] and r["refused"] == r["errors"] == 0


def test_open_loop_sends_whatever_the_answers():
    """Arrivals keep their Poisson schedule while earlier requests are still unanswered."""
    answer_s = 0.3

    async def call(i):
        await asyncio.sleep(answer_s)
        return 200

    async def main():
        t0 = time.perf_counter()
        outcomes, first, seconds = await openloop.open_loop(call, 10, 100.0, 0.2, seed=1)
        return outcomes, first, seconds, time.perf_counter() - t0

    outcomes, first, seconds, took = asyncio.run(main())
    assert len(outcomes) > 5 and first == "" and seconds == 0.2
    assert all(sent_at < 0.2 and status == 200 for sent_at, status, _ in outcomes)
    assert took < 0.2 + 2 * answer_s  # a closed loop would take len(outcomes) * 0.3 s


def test_open_loop_summary_counts_each_outcome_per_second():
    outcomes = [(0.1, 200, 0.010), (0.2, 200, 0.030), (0.5, 429, 0.002), (1.2, 504, 1.0),
                (1.3, 200, 0.020), (1.4, 500, 0.1), (1.9, 0, 0.0)]
    r = openloop.open_loop_summary("t", 7.0, 25.0, 2.0, outcomes)
    assert (r.sent, r.ok, r.ok_in_target, r.refused, r.deadline, r.errors) == (7, 3, 2, 1, 1, 2)
    assert r.goodput == 1.0  # 2 good answers over 2 s
    assert r.latency_ms["p50"] == pytest.approx(20.0) and r.latency_ms["p99"] == pytest.approx(30.0)
    assert r.refusal_ms["p50"] == pytest.approx(2.0)
    first, second = r.per_second
    assert (first["second"], first["sent"], first["ok"], first["refused"]) == (0, 3, 2, 1)
    assert (second["sent"], second["deadline"], second["errors"], second["ok_in_target"]) == (
        4, 1, 2, 1)
    assert "total" in openloop.format_open_loop(r)


def test_bench_counts_errors_from_a_wrong_model(capsys, embed_server):
    rc, _, err = run_cli(capsys, "bench", "--url", embed_server.url, "--model", "nope", "-c", "1",
                         "-n", "2", "--warmup", "0")
    assert rc == cli.EXIT_USAGE and "404" in err


def test_bench_needs_a_target(capsys):
    rc, _, err = run_cli(capsys, "bench", "-n", "1")
    assert rc == cli.EXIT_USAGE and "--url" in err


@pytest.mark.parametrize("flag", ["-c", "--corpus-size"])
def test_bench_rejects_a_zero_count_flag_with_a_usage_error(capsys, flag):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--url", "http://127.0.0.1:1", flag, "0"])
    assert exc.value.code == cli.EXIT_USAGE and "must be >= 1" in capsys.readouterr().err


def test_bench_connection_is_not_reused_after_a_timed_out_request():
    """A request the load generator gave up on leaves its reply in flight on the socket; the
    next request must get its own reply, not that stale one (so it opens a new connection)."""
    first_delay_s = 0.5

    async def run() -> list:
        served = {"n": 0}
        writers: list = []

        async def handle(reader, writer):
            writers.append(writer)
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    body = await reader.readexactly(length)
                    served["n"] += 1
                    if served["n"] == 1:
                        await asyncio.sleep(first_delay_s)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = loadgen.Connection(f"http://127.0.0.1:{port}/v1/embeddings")
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(conn.post(b"first"), first_delay_s / 5)
            replies = [await conn.post(b"second"), await conn.post(b"third")]
        finally:
            conn.close()
            server.close()
            for w in writers:  # server.close() leaves accepted connections open
                w.close()
            await server.wait_closed()
        return replies

    assert asyncio.run(run()) == [(200, b"second"), (200, b"third")]


def test_percentile_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert loadgen.percentile(values, 50) == 50
    assert loadgen.percentile(values, 99) == 99
    assert loadgen.percentile(values, 100) == 100
    assert loadgen.percentile([], 99) == 0.0
    assert loadgen.percentile([7.0], 1) == 7.0


def test_progress_plain_lines_when_not_a_terminal():
    buf = io.StringIO()
    p = loadgen.Progress("x c=1", 20, buf)
    for done in range(0, 21, 5):
        p.update(done)
    p.close()
    lines = buf.getvalue().splitlines()
    assert [ln.split("(")[1].split(")")[0] for ln in lines] == [
        "10%", "20%", "30%", "40%", "50%", "60%", "70%", "80%", "90%", "100%"]


def test_embeddings_url_defaults_the_path():
    assert loadgen.embeddings_url("http://h:1") == "http://h:1/v1/embeddings"
    assert loadgen.embeddings_url("http://h:1/embeddings") == "http://h:1/embeddings"
    with pytest.raises(ValueError):
        loadgen.embeddings_url("https://h:1")


def test_corpus_is_seeded_and_length_mixed():
    a, b = loadgen.make_corpus(200, 1), loadgen.make_corpus(200, 1)
    assert a == b and a != loadgen.make_corpus(200, 2)
    words = [len(t.split()) for t in loadgen.make_corpus()]
    assert len(words) == loadgen.DEFAULT_SIZE
    assert sum(w <= 20 for w in words) >= 0.45 * len(words)
    assert max(words) <= 200 and sum(w > 80 for w in words) >= 0.08 * len(words)


# -- issue 12: errors a newcomer can act on, WAV sequences, flags ---------------------------------
def test_version_flag(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("lumen-core ") and out.split()[1] != ""


def test_serve_flags_parse():
    args = cli.build_parser().parse_args(
        ["serve", "--api-key", "a", "--api-key", "b", "--tls-cert", "c.pem", "--tls-key", "k.pem",
         "--log-level", "info", "--access-log"])
    assert args.api_key == ["a", "b"] and args.tls_cert == "c.pem" and args.tls_key == "k.pem"
    assert args.log_level == "info" and args.access_log


def test_a_missing_extra_names_the_pip_command(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "lumen_core.serve.server", raising=False)
    rc, _, err = run_cli(capsys, "serve", "--http-port", "0")
    assert rc == cli.EXIT_USAGE and 'pip install "lumen-core[serve]"' in err
    assert "Traceback" not in err


def test_in_process_infer_with_nothing_prepared_says_to_prepare(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "empty"))
    f = tmp_path / "a.txt"
    f.write_text("hi")
    rc, _, err = run_cli(capsys, "infer", "text_embed", str(f))
    assert rc == cli.EXIT_USAGE and "lumen models prepare" in err


def test_url_connection_errors_name_the_url(tmp_path, capsys):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    f = tmp_path / "a.txt"
    f.write_text("hi")
    url = f"http://127.0.0.1:{port}"
    rc, _, err = run_cli(capsys, "infer", "text_embed", str(f), "--url", url)
    assert rc == cli.EXIT_USAGE and url in err and "Traceback" not in err


def _wav(path, samples: np.ndarray, rate: int = 16000, channels: int = 1) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())


def test_infer_vad_prints_the_segments_of_any_wav(tmp_path, capsys, embed_server,
                                                 tmp_path_factory, monkeypatch, fixtures_dir):
    """Issue 38 row 12: ``lumen infer vad file.wav`` prints the file's speech segments (one
    JSON reply, in process and with --url alike), not a line per 32 ms chunk; a 44.1 kHz
    stereo file gives the 16 kHz mono file's segments (resampled whole)."""
    import soxr

    name = "vad_speech_2.wav"
    ref = json.loads((fixtures_dir / "vad_speech_reference.json").read_text())[name]
    with wave.open(str(fixtures_dir / name)) as w:
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    y = soxr.resample(x, 16000, 44100, quality="VHQ")
    stereo = np.stack([y * 1.05, y * 0.95], axis=1)
    f = tmp_path / "speech44k.wav"
    _wav(f, np.clip(np.round(stereo * 32768), -32768, 32767), rate=44100, channels=2)
    monkeypatch.setenv("LUMEN_HOME", str(S.prepared_home(tmp_path_factory)))
    outs = []
    for extra in ((), ("--url", embed_server.url)):
        rc, out, _ = run_cli(capsys, "infer", "vad", str(f), *extra)
        assert rc == 0
        (line,) = out.splitlines()  # one reply, not one per chunk
        outs.append(json.loads(line))
    for got in outs:
        assert abs(got["duration_ms"] - ref["samples"] / 16) <= 32
        assert len(got["segments"]) == len(ref["segments"]), got
        for g, (s0, e0) in zip(got["segments"], ref["segments"], strict=True):
            assert abs(g["start_ms"] - s0 / 16) <= 32 and abs(g["end_ms"] - e0 / 16) <= 32
    rc, out, _ = run_cli(capsys, "infer", "vad", str(fixtures_dir / name), "--meta",
                         "probabilities=true")
    assert rc == 0 and len(json.loads(out)["probabilities"]) == -(-ref["samples"] // 512)
    # a stateful task without segments still streams chunks: 16 kHz mono PCM16 only
    bad = tmp_path / "stereo48k.wav"
    _wav(bad, np.zeros(2000, np.int16), rate=48000, channels=2)
    with pytest.raises(ValueError, match="16000 Hz mono 16-bit PCM.*ffmpeg"):
        cli_infer.read_wav_chunks(str(bad))


def test_a_busy_grpc_port_is_one_line_before_any_model_loads(tmp_path):
    """Issue 38 row 14: a second server moved only with --http-port found gRPC's port taken
    after loading its models, and gRPC's C-core printed its own line first.  Now the ports
    are claimed first: one line, naming the port and the ways to move it (or turn gRPC off),
    exit 2, and nothing loaded."""
    import socket

    cfg = S.onnx_config(tmp_path, slow=False)
    (tmp_path / "lumen.toml").write_text(S.to_toml(cfg))
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        r = lumen("serve", "--config", str(tmp_path / "lumen.toml"), "--http-port", "0",
                  "--grpc-port", str(port), "--log-level", "info")
    finally:
        holder.close()
    assert r.returncode == cli.EXIT_USAGE, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr  # no add_port.cc line, no model loading logged
    (line,) = lines
    assert line.startswith("lumen: error: gRPC port ") and f"127.0.0.1:{port}" in line, line
    assert "already in use" in line and "--grpc-port 0" in line and "--grpc-port P" in line
    assert "Errno" not in line


# -- issue 26: a newcomer's second day, through the real `lumen` executable ----------------------
#: the installed console script beside this interpreter (what a user's shell runs)
LUMEN = str(pathlib.Path(sys.executable).with_name("lumen"))
API_KEY = "issue26-key-0123"
#: [CLS] hello [SEP] in the MiniLM (bert-base-uncased) vocabulary
HELLO_IDS = [101, 7592, 102]


def lumen(*argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run ``lumen ARGV`` in a subprocess; ``env`` adds to this process's environment (where
    LUMEN_API_KEY is never set; a PYTHONPATH goes in front of the one there is)."""
    full = {k: v for k, v in os.environ.items() if k != cli_common.API_KEY_ENV}
    for k, v in env.items():
        if k == "PYTHONPATH" and full.get(k):
            v = v + os.pathsep + full[k]
        full[k] = v
    return subprocess.run([LUMEN, *argv], capture_output=True, text=True, timeout=timeout,
                          env=full)


def shadow_module(root: pathlib.Path, name: str, body: str = "") -> str:
    """A folder for PYTHONPATH holding a package ``name`` (``body`` its __init__) that hides
    the installed one: the subprocess sees the package as a user without it would."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(body)
    return str(root)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """``text_embed`` alone behind an API key, plain HTTP (what `lumen infer --url` and
    `lumen bench` talk to)."""
    from lumen_core.runtime import Runtime
    from lumen_core.tasks import default_task_table

    with S.lumen_home_env(S.prepared_home(tmp_path_factory)):
        srv = S.ServerThread(Runtime.from_dict({"server": {"api_keys": [API_KEY]},
                                                "tasks": [default_task_table("text_embed")]}),
                             grpc=False)
    yield srv
    srv.stop()


def test_prepare_skips_a_model_whose_package_is_missing(tmp_path, tmp_path_factory):
    """Row 3: without rapidocr, `lumen models prepare` still prepares (here: finds up to date)
    every other model, text_embed_int8's included, lists the skipped one with its pip command
    and exits 0; asked for by name, the missing package is an error (exit 2)."""
    home = S.prepared_home(tmp_path_factory)
    path = shadow_module(tmp_path / "site", "rapidocr")
    r = lumen("models", "prepare", "--home", str(home), PYTHONPATH=path)
    assert r.returncode == 0, r.stderr
    prepared = dict(line.split("\t") for line in r.stdout.splitlines())
    assert set(prepared) == {models.MINILM, models.SILERO_VAD, models.MINILM_INT8, models.FACES}
    assert f"{models.OCR}: skipped, its source package 'rapidocr' is not installed" in r.stderr
    assert f"  {models.OCR}: `pip install --no-deps rapidocr==3.10.0`" in r.stderr
    assert f"then run `lumen models prepare --home {home}` again" in r.stderr
    r = lumen("models", "prepare", models.OCR, "--home", str(home), PYTHONPATH=path)
    assert r.returncode == cli.EXIT_USAGE and "Traceback" not in r.stderr
    # the message reads as a sentence (it said "the ocr models comes from ...")
    assert ("the PyPI package 'rapidocr', the source of the ocr models, is not installed"
            in r.stderr), r.stderr
    assert "pip install --no-deps rapidocr==3.10.0" in r.stderr


def test_serve_says_why_each_default_task_is_left_out(tmp_path):
    """Row 4: one warning line per default task left out, naming why and what to run: a
    model never prepared (`lumen models prepare`), the [ocr] extra missing (its pip command)."""
    path = shadow_module(tmp_path / "site", "cv2",
                         "raise ModuleNotFoundError(\"No module named 'cv2'\", name='cv2')\n")
    r = lumen("serve", "--http-port", "0", "--grpc-port", "0",
              LUMEN_HOME=str(tmp_path / "empty"), PYTHONPATH=path)
    assert r.returncode == cli.EXIT_USAGE and "no default task can be served here: run `lumen models prepare`" in r.stderr
    left = [ln for ln in r.stderr.splitlines() if "left out" in ln
            and not ln.startswith("lumen: error:")]
    assert [ln.split("default task ")[1].split(" ")[0] for ln in left] == [
        "'text_embed'", "'text_embed_int8'", "'vad'", "'ocr'", "'face_detection'"], r.stderr
    for line in left[:3]:
        assert "is not prepared" in line and "run `lumen models prepare`" in line, line
    assert "[ocr] extra" in left[3] and 'pip install "lumen-core[ocr]"' in left[3], left[3]
    assert 'pip install "lumen-core[faces]"' in left[4], left[4]


def test_infer_and_bench_send_an_api_key(keyed_server, tmp_path):
    """Row 5: --api-key, else $LUMEN_API_KEY, on `lumen infer --url` and `lumen bench`."""
    url = keyed_server.url
    f = tmp_path / "a.txt"
    f.write_text("hello")
    r = lumen("infer", "text_embed", str(f), "--url", url)
    assert r.returncode == cli.EXIT_USAGE and "API key" in r.stderr and "Traceback" not in r.stderr
    for r in (lumen("infer", "text_embed", str(f), "--url", url, "--api-key", API_KEY),
              lumen("infer", "text_embed", str(f), "--url", url, LUMEN_API_KEY=API_KEY)):
        assert r.returncode == 0, r.stderr
        assert len(json.loads(r.stdout)["outputs"]["embedding"]["data"]) == 384
    bench = ("bench", "--url", url, "-c", "1", "-n", "2", "--warmup", "0", "--corpus-size", "2")
    r = lumen(*bench)
    assert r.returncode == cli.EXIT_USAGE and "401" in r.stderr
    for r in (lumen(*bench, "--api-key", API_KEY), lumen(*bench, LUMEN_API_KEY=API_KEY)):
        assert r.returncode == 0, r.stderr
        assert loadgen.TABLE_HEADER in r.stdout


def test_infer_npy_token_ids_take_layout_and_preprocess_id_from_the_contract(
        keyed_server, tmp_path, tmp_path_factory):
    """Row 9: `[1, 3]` int64 ids need no --layout or lumen.preprocess.id: the task's contract
    has one signature for int64 of rank 2 (NL, bert_wordpiece_uncased_v1); over --url (asked
    of GET /v1/tasks) and in process.  The embedding is that of the text the ids spell."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([HELLO_IDS], np.int64))
    text = tmp_path / "hello.txt"
    text.write_text("hello")
    key = {"LUMEN_API_KEY": API_KEY}
    want = json.loads(lumen("infer", "text_embed", str(text), "--url", keyed_server.url,
                            **key).stdout)["outputs"]["embedding"]["data"]
    remote = lumen("infer", "text_embed", str(ids), "--url", keyed_server.url, **key)
    assert remote.returncode == 0, remote.stderr
    local = lumen("infer", "text_embed", str(ids),
                  LUMEN_HOME=str(S.prepared_home(tmp_path_factory)))
    assert local.returncode == 0, local.stderr
    for r in (remote, local):
        np.testing.assert_allclose(json.loads(r.stdout)["outputs"]["embedding"]["data"], want,
                                   atol=1e-5)


def test_contract_choice_needs_one_choice():
    sig = {"dtype": "int64", "layout": "NL", "shape": [1, [1, 256]], "preprocess_ids": ["a"]}
    desc = {"tensor_signatures": [sig]}
    assert cli_infer.contract_choice(desc, "int64", 2) == ("NL", "a")
    assert cli_infer.contract_choice(desc, "fp32", 2) == (None, None)  # no int64: the server says
    assert cli_infer.contract_choice(desc, "int64", 3) == (None, None)
    assert cli_infer.contract_choice(desc, "int64", 2, "NC") == ("NC", None)
    two = {"tensor_signatures": [sig, dict(sig, preprocess_ids=["a", "b"])]}
    assert cli_infer.contract_choice(two, "int64", 2) == ("NL", None)
    assert cli_infer.contract_choice(None, "int64", 2) == (None, None)


def test_infer_into_a_closed_pipe_exits_quietly(tmp_path):
    """Row 12: `lumen infer ... | head` whose reader is gone: no "[Errno 32] Broken pipe", no
    "Exception ignored" at exit; the status of a process SIGPIPE ended."""
    cfg = S.onnx_config(tmp_path, slow=False)
    (tmp_path / "lumen.toml").write_text(S.to_toml(cfg))
    np.save(tmp_path / "x.npy", S.mlp_input(3))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away before the reply is written
    try:
        proc = subprocess.run([LUMEN, "infer", "mlp", str(tmp_path / "x.npy"), "--config",
                               str(tmp_path / "lumen.toml"), "--meta", "lumen.preprocess.id=none"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE, proc.stderr
    for bad in ("Broken pipe", "Errno 32", "Exception ignored", "Traceback"):
        assert bad not in proc.stderr, proc.stderr


def test_serve_names_every_busy_port(tmp_path):
    """Row 12: with both ports busy, the one error line names HTTP's and gRPC's (it named
    gRPC's only, so the next start failed again on HTTP's)."""
    import socket

    cfg = S.onnx_config(tmp_path, slow=False)
    (tmp_path / "lumen.toml").write_text(S.to_toml(cfg))
    holders = [socket.socket() for _ in range(2)]
    try:
        for s in holders:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
        http_port, grpc_port = (s.getsockname()[1] for s in holders)
        r = lumen("serve", "--config", str(tmp_path / "lumen.toml"), "--http-port",
                  str(http_port), "--grpc-port", str(grpc_port))
    finally:
        for s in holders:
            s.close()
    assert r.returncode == cli.EXIT_USAGE, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("lumen: error:")]
    assert f"127.0.0.1:{http_port}" in line and "--http-port" in line, line
    assert f"127.0.0.1:{grpc_port}" in line and "--grpc-port" in line, line

"""``lumen embed --url``: against a real ``lumen serve`` subprocess (rows equal the in-process
run), and against a small fake OpenAI server that answers 429 with Retry-After and 503 first,
refuses one text with 400, and fails hard mid-job (the rerun resumes)."""
from __future__ import annotations

import base64
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pyarrow.parquet as pq
import pytest
import serve_support as S
from embed_support import (
    home_fixture,  # noqa: F401 - the fixtures (home, tiny)
    run_embed,
    short_texts,
    write_jsonl,
)

from lumen_core.bulk import remote

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIM = 8
START_TIMEOUT_S = 120.0


def vectors(path) -> np.ndarray:
    col = pq.read_table(path).column("embedding").combine_chunks()
    return col.values.to_numpy().reshape(-1, col.type.list_size)


@pytest.fixture
def lumen_serve(home, tmp_path):
    """``lumen serve`` in a subprocess with text_embed alone; yields its URL."""
    port = S.free_port()
    cfg = {"server": {}, "tasks": [{"name": "text_embed", "backend": "text_embedding",
                                    "model_id": "all-minilm-l6-v2", "model_version": "1"}]}
    (tmp_path / "serve.toml").write_text(S.to_toml(cfg))
    p = subprocess.Popen([sys.executable, "-m", "lumen_core.cli", "serve", "--config",
                          str(tmp_path / "serve.toml"), "--http-port", str(port),
                          "--grpc-port", "0"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert p.poll() is None, p.stderr.read().decode() if p.stderr else ""
            assert time.monotonic() < deadline, "lumen serve did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        p.terminate()
        p.wait(30)


def test_url_rows_equal_the_in_process_run(lumen_serve, tmp_path, capsys):
    texts = short_texts(60)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"t{i}", "text": t}
                                              for i, t in enumerate(texts)])
    rc, err = run_embed(capsys, src, "-o", tmp_path / "remote.parquet", "--id-field", "id",
                        "--url", lumen_serve, "--batch-size", 7, "--concurrency", 3,
                        "--row-group-size", 25)
    assert rc == 0, err
    assert "done: 60 rows" in err
    rc, err = run_embed(capsys, src, "-o", tmp_path / "local.parquet", "--id-field", "id",
                        "--row-group-size", 25)
    assert rc == 0, err
    got, want = vectors(tmp_path / "remote.parquet"), vectors(tmp_path / "local.parquet")
    assert pq.read_table(tmp_path / "remote.parquet").column("id").to_pylist() == \
        [f"t{i}" for i in range(60)]
    assert (got * want).sum(1).min() >= 0.9999


class FakeOpenAI:
    """A ``/v1/embeddings`` server: the first ``busy`` requests get 429 (Retry-After 1), the
    next one 503 without it; a text ``BAD`` is refused with 400; after ``fail_after`` good
    answers every request gets 500.  The vector of a text is its length, then its first
    characters' code points (DIM values)."""

    def __init__(self, busy: int = 2, fail_after: int | None = None, port: int = 0):
        self.busy = busy
        self.fail_after = fail_after
        self.answered = 0
        self.statuses: list = []
        self.times: list = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, headers, reply = fake.answer(body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def vector(text: str) -> np.ndarray:
        return np.array([len(text)] + [ord(c) for c in text[:DIM - 1].ljust(DIM - 1)],
                        np.float32)

    def answer(self, body: dict) -> tuple:
        with self.lock:
            self.times.append(time.monotonic())
            n = len(self.statuses)
            if n < self.busy:
                status, headers = 429, {"Retry-After": "1"}
            elif n == self.busy:
                status, headers = 503, {}
            elif "BAD" in body["input"]:
                status, headers = 400, {}
            elif self.fail_after is not None and self.answered >= self.fail_after:
                status, headers = 500, {}
            else:
                status, headers = 200, {}
                self.answered += 1
            self.statuses.append(status)
        if status != 200:
            return status, headers, {"error": {"message": f"fake says {status}",
                                               "type": "x", "code": status}}
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(self.vector(t).tobytes()).decode()}
                for i, t in enumerate(body["input"])]
        return 200, {}, {"object": "list", "data": data, "model": body["model"],
                         "usage": {"prompt_tokens": 3 * len(data), "total_tokens": 0}}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_backoff_honours_retry_after_and_bad_texts_are_isolated(tmp_path, capsys):
    fake = FakeOpenAI(busy=2)
    try:
        texts = [f"text number {i}" for i in range(30)]
        texts[17] = "BAD"
        src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
        rc, err = run_embed(capsys, src, "-o", tmp_path / "o.parquet", "--url", fake.url,
                            "--batch-size", 8, "--concurrency", 1)
    finally:
        fake.close()
    assert rc == 0, err
    # the probe waited out two 429s (1 s each, as Retry-After said) and a 503
    assert fake.statuses[:3] == [429, 429, 503]
    assert fake.times[1] - fake.times[0] >= 0.95 and fake.times[2] - fake.times[1] >= 0.95
    assert "in.jsonl:18: skipped: HTTP 400: fake says 400" in err
    t = pq.read_table(tmp_path / "o.parquet")
    keep = [i for i in range(30) if i != 17]
    assert t.column("row").to_pylist() == keep
    np.testing.assert_array_equal(vectors(tmp_path / "o.parquet"),
                                  np.stack([FakeOpenAI.vector(texts[i]) for i in keep]))


def test_a_server_failing_mid_job_leaves_a_job_the_rerun_finishes(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(remote, "RETRY_STATUSES", (429, 503))  # 500: fail at once
    texts = [f"row {i}" for i in range(50)]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "o.parquet"
    args = [src, "-o", out, "--batch-size", 5, "--concurrency", 1, "--row-group-size", 10]
    fake = FakeOpenAI(busy=0, fail_after=1 + 4)  # the probe, then two row groups
    try:
        rc, err = run_embed(capsys, *args, "--url", fake.url)
    finally:
        fake.close()
    assert rc == 2 and "HTTP 500" in err
    assert not out.exists()
    port = fake.httpd.server_address[1]
    work = pathlib.Path(str(out) + ".lumen-embed")
    assert sorted(p.name for p in work.glob("part-*")) == ["part-000000.parquet",
                                                           "part-000001.parquet"]
    fake = FakeOpenAI(busy=0, port=port)  # the same server, back
    try:
        rc, err = run_embed(capsys, *args, "--url", fake.url)
    finally:
        fake.close()
    assert rc == 0, err
    assert "resuming: 2 row groups (20 rows)" in err
    np.testing.assert_array_equal(vectors(out), np.stack([FakeOpenAI.vector(t) for t in texts]))


def test_an_unreachable_server_is_said_at_once(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    t0 = time.monotonic()
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.parquet", "--url",
                        f"http://127.0.0.1:{S.free_port()}")
    assert rc == 2 and "cannot reach" in err
    assert time.monotonic() - t0 < 30


def test_retry_after_reads_seconds_and_dates():
    assert remote.retry_after("3") == 3.0
    assert remote.retry_after(None) is None and remote.retry_after("soon") is None
    assert remote.retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0

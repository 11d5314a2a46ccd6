"""The remote embedder of a bulk job (``lumen embed --url``): batches of texts to a running
``lumen serve`` or any server speaking OpenAI's ``POST /v1/embeddings``.

Same interface as :class:`.local.LocalEmbedder` (``submit(texts) -> Pending``, ``dim``,
``close``), so the job, its resume and its output are the same.  A window's texts are sorted
by length (characters: no tokenizer here) and cut into requests of ``batch_size`` texts, sent
by ``concurrency`` threads, each over its own keep-alive connection (stdlib ``http.client``:
no extra dependency).  Vectors come back as base64 float32 (``encoding_format``).

Backoff: 429 and 503 are retried after the ``Retry-After`` the server sends (seconds or an
HTTP date), else after an exponential pause with jitter; so are connection failures (a server
restarting).  A job gives up after ``MAX_RETRY_S`` of retrying one request.  Any other 4xx is
the texts' fault: a request of several texts is split in halves until the bad text is alone,
and that text becomes a bad row with the server's message; the rest are embedded.
"""
from __future__ import annotations

import base64
import email.utils
import http.client
import json
import queue
import random
import threading
import time
import urllib.parse
from typing import Optional

import numpy as np

from .local import Pending, work_loop

EMBEDDINGS_PATH = "/v1/embeddings"
#: seconds one request may take (a batch of long texts on a busy server)
REQUEST_TIMEOUT_S = 300.0
#: first pause after a failure; doubled each time up to BACKOFF_MAX_S
BACKOFF_S = 0.5
BACKOFF_MAX_S = 30.0
#: a request retried this long in all fails the job (its row groups so far are saved)
MAX_RETRY_S = 600.0
#: the probe at start retries a busy server (429 / 503: still loading) this long
PROBE_RETRY_S = 120.0
#: statuses that mean "later", not "never"
RETRY_STATUSES = (429, 502, 503, 504)


class RemoteError(OSError):
    """The server could not be used (unreachable past MAX_RETRY_S, an answer of another shape)."""


class _TextsRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


class RemoteEmbedder:
    """See the module docstring.  ``dim`` is asked of the server with one text at start (it
    also checks the URL, the key and the task before any work)."""

    def __init__(self, url: str, task: str, api_key: Optional[str] = None,
                 dimensions: Optional[int] = None, prompt_name: Optional[str] = None,
                 truncate: bool = True, concurrency: int = 8, batch_size: int = 64,
                 max_retry_s: float = MAX_RETRY_S):
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http://HOST:PORT or https://..., got {url!r}")
        self.url = url
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._path = parts.path.rstrip("/") + EMBEDDINGS_PATH
        self.task = task
        self.batch_size = batch_size
        self.max_retry_s = max_retry_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._body: dict = {"model": task, "encoding_format": "base64"}
        if dimensions is not None:
            self._body["dimensions"] = dimensions
        if prompt_name is not None:
            self._body["prompt_name"] = prompt_name
        if not truncate:
            self._body["truncate"] = False
        self.retries = 0  # requests retried (429 / 503 / connection), for the tests and logs
        self._local = threading.local()
        self._queue: queue.Queue = queue.Queue()
        probe, _ = self._post(["lumen embed: probe"], probe=True)
        self.dim = int(probe.shape[1])
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name=f"lumen-embed-http-{i}")
                         for i in range(concurrency)]
        for t in self._threads:
            t.start()

    token_route = False

    # -- the job's interface -----------------------------------------------------------------
    def submit(self, texts: list) -> Pending:
        pending = Pending(len(texts), self.dim)
        order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
        batches = [order[s:s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        pending.expect(len(batches))
        for b in batches:
            self._queue.put((pending, b, [texts[i] for i in b]))
        return pending

    def close(self, timeout: Optional[float] = None) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout)

    # -- workers -------------------------------------------------------------------------------
    def _work(self) -> None:
        work_loop(self._queue, self._embed)

    def _embed(self, pending: Pending, idx: list, texts: list) -> None:
        try:
            vecs, tokens = self._post(texts)
        except _TextsRefused as exc:
            if len(texts) == 1:
                pending.errors[idx[0]] = f"HTTP {exc.status}: {exc.message}"
                return
            mid = len(texts) // 2
            self._embed(pending, idx[:mid], texts[:mid])
            self._embed(pending, idx[mid:], texts[mid:])
            return
        if vecs.shape != (len(texts), self.dim):
            raise RemoteError(f"{self.url} answered {vecs.shape[0]} vectors of "
                              f"{vecs.shape[1] if vecs.ndim == 2 else '?'} for {len(texts)} "
                              f"texts (expected dimension {self.dim})")
        pending.vectors[idx] = vecs
        pending.add_tokens(tokens)

    # -- HTTP ----------------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = (http.client.HTTPSConnection if self._scheme == "https"
                   else http.client.HTTPConnection)
            conn = cls(self._host, self._port, timeout=REQUEST_TIMEOUT_S)
            self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def _post(self, texts: list, probe: bool = False) -> tuple:
        """``(vectors [n, dim] float32, prompt tokens)`` of ``texts``, retried as the module
        docstring says; the ``probe`` at start is not retried when the server cannot be
        reached (a wrong URL is said at once) and retries 429 / 503 for ``PROBE_RETRY_S``."""
        body = json.dumps({**self._body, "input": texts}).encode()
        started = time.monotonic()
        attempt = 0
        while True:
            wait: Optional[float]
            try:
                conn = self._conn()
                conn.request("POST", self._path, body, self._headers)
                resp = conn.getresponse()
                data = resp.read()
                status = resp.status
                if status == 200:
                    return self._parse(data, len(texts))
                if status in RETRY_STATUSES:
                    wait = retry_after(resp.getheader("Retry-After"))
                    why = f"HTTP {status}"
                elif 400 <= status < 500 and status not in (401, 403, 404):
                    raise _TextsRefused(status, _message(data))  # the texts' fault
                else:  # auth, a wrong path, a server error: not the texts' fault
                    raise RemoteError(f"{self.url}{self._path}: HTTP {status}: "
                                      f"{_message(data)}")
            except (OSError, http.client.HTTPException) as exc:
                if isinstance(exc, RemoteError):
                    raise
                self._drop()
                if probe:
                    raise RemoteError(f"cannot reach the server at {self.url}: {exc}") from None
                wait, why = None, f"{type(exc).__name__}: {exc}"
            attempt += 1
            self.retries += 1
            if wait is None:
                wait = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1)) * (0.5 + random.random())
            budget = min(self.max_retry_s, PROBE_RETRY_S) if probe else self.max_retry_s
            if time.monotonic() - started + wait > budget:
                raise RemoteError(f"{self.url}: gave up after {attempt} tries over "
                                  f"{time.monotonic() - started:.0f} s (last: {why})")
            time.sleep(wait)

    def _parse(self, data: bytes, n: int) -> tuple:
        try:
            obj = json.loads(data)
            rows = sorted(obj["data"], key=lambda d: d["index"])
            vecs = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                    if isinstance(d["embedding"], str)
                    else np.asarray(d["embedding"], np.float32) for d in rows]
            tokens = int((obj.get("usage") or {}).get("prompt_tokens") or 0)
        except (ValueError, KeyError, TypeError) as exc:
            raise RemoteError(f"{self.url}{self._path} answered something other than an "
                              f"embeddings list ({exc})") from None
        if len(vecs) != n:
            raise RemoteError(f"{self.url}: {len(vecs)} embeddings for {n} texts")
        return np.stack(vecs).astype(np.float32, copy=False), tokens


def _message(data: bytes) -> str:
    """The error message of a JSON error body (Lumen's and OpenAI's shape), else the text."""
    try:
        err = json.loads(data).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return data[:200].decode("utf-8", "replace")

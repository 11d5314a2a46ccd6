"""Helpers for the server tests: a LumenServer on a background thread, test task configs,
metrics scraping, and the prepared default models in a temporary LUMEN_HOME (once per session).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import httpx
import numpy as np
import onnx_models as M
from prometheus_client.parser import text_string_to_metric_families

from lumen_core.runtime import Runtime
from lumen_core.serve.server import LumenServer

D_IN, D_OUT = 16, 8
#: the slow task holds a lone request in its queue this long (a batch never fills)
SLOW_DELAY_US = 2_000_000
SLOW_QUEUE_SIZE = 2
#: seconds a test polls for a condition on the server before failing
WAIT_S = 10.0
#: small payload limit so 413 is cheap to provoke
MAX_PAYLOAD = 4096


def tensor_meta(shape: tuple, dtype: str = "fp32", layout: str = "NC") -> dict:
    return {"lumen.input.kind": "tensor", "lumen.tensor.dtype": dtype,
            "lumen.tensor.shape": "[" + ",".join(map(str, shape)) + "]",
            "lumen.tensor.layout": layout, "lumen.preprocess.id": "none"}


def guard_server(tmp: pathlib.Path, wait_delay_us: int, **server: Any) -> "ServerThread":
    """The hostile-client suites' server: :func:`onnx_config`'s fast tasks under ``server``'s
    limits, plus ``wait`` (``mlp`` whose lone request sits in its queue ``wait_delay_us``: a
    request that is still running when a client misbehaves)."""
    from lumen_core.runtime import Runtime

    cfg = onnx_config(tmp, slow=False, **server)
    cfg["tasks"].append(dict(cfg["tasks"][0], name="wait",
                             batching={"max_queue_delay_us": wait_delay_us,
                                       "max_batch_size": 8}))
    return ServerThread(Runtime.from_dict(cfg))


def onnx_config(tmp: pathlib.Path, slow: bool = True, **server: Any) -> dict:
    """Three generic tasks on generated models: ``mlp`` (no queue delay), ``slow`` (a lone
    request waits SLOW_DELAY_US, queue of SLOW_QUEUE_SIZE; its warm-up waits that long too, so
    ``slow=False`` leaves it out) and ``nan`` (sqrt: NaN for x < 0)."""
    mlp = M.mlp(tmp / "mlp.onnx", d_in=D_IN, d_out=D_OUT)
    nan = M.nan_for_negative(tmp / "nan.onnx", d=4)
    common = {"backend": "onnx", "intra_op_threads": 1}
    cfg = {
        "server": {"max_payload_bytes": MAX_PAYLOAD, **server},
        "tasks": [
            {"name": "mlp", "model": mlp, **common, "batching": {"max_queue_delay_us": 0}},
            {"name": "slow", "model": mlp, **common,
             "batching": {"max_queue_delay_us": SLOW_DELAY_US, "max_batch_size": 64,
                          "max_queue_size": SLOW_QUEUE_SIZE}},
            {"name": "nan", "model": nan, **common, "batching": {"max_queue_delay_us": 0}},
        ],
    }
    if not slow:
        cfg["tasks"] = [t for t in cfg["tasks"] if t["name"] != "slow"]
    return cfg


def mlp_input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, D_IN)).astype(np.float32)


class ServerThread:
    """A started LumenServer (HTTP + gRPC on free loopback ports) on its own event loop."""

    def __init__(self, runtime: Runtime, grpc: bool = True, grace_s: float = 5.0,
                 **server_kwargs: Any):
        self.runtime = runtime
        self.loop = asyncio.new_event_loop()
        self.server = LumenServer(runtime, host="127.0.0.1", http_port=0,
                                  grpc_port=0 if grpc else None, grace_s=grace_s, **server_kwargs)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self.server.start())
        scheme = "https" if self.server.tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.http_port}"
        self.grpc_target = f"127.0.0.1:{self.server.grpc_port}"

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def _stop() -> None:
            await self.server.shutdown()

        if self.loop.is_closed():  # stopped already
            return
        try:
            self.call(_stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():  # an unclosed loop is a ResourceWarning
                self.loop.close()


def raw_connect(srv: "ServerThread") -> socket.socket:
    """A plain TCP connection to ``srv``'s HTTP port (for what a client library would not
    send: half requests, trickled bodies, pipelining)."""
    return socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=WAIT_S)


def read_until_closed(s: socket.socket) -> bytes:
    """Everything until the server closes (a reset after a refused upload counts as closed,
    and so does the socket's timeout)."""
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    except (ConnectionResetError, socket.timeout):
        return out


def scrape(url: str) -> dict:
    """``{(sample name, frozenset(labels.items())): value}`` from /metrics, via the official
    parser (so the exposition must be valid)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels`` (other labels, e.g. ``version``,
    summed over)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


_PREPARED: dict = {}


def prepared_home(tmp_path_factory: Any) -> Optional[pathlib.Path]:
    """A LUMEN_HOME with the default models prepared, built once per test session (``None``
    is never returned: preparation errors fail the test that asked)."""
    if "home" not in _PREPARED:
        from lumen_core import models

        # LUMEN_TEST_HOME: a developer's store reused across test sessions (prepare skips what
        # is up to date there); unset (CI), a fresh temporary one
        reuse = os.environ.get("LUMEN_TEST_HOME")
        home = pathlib.Path(reuse) if reuse else tmp_path_factory.mktemp("lumen_home")
        models.prepare(home=home)
        _PREPARED["home"] = home
    return _PREPARED["home"]


@contextlib.contextmanager
def lumen_home_env(home: pathlib.Path) -> Iterator[None]:
    """LUMEN_HOME pointing at ``home`` for the block (default tasks resolve their models when
    the tables are built and again when the tasks load)."""
    old = os.environ.get("LUMEN_HOME")
    os.environ["LUMEN_HOME"] = str(home)
    try:
        yield
    finally:
        if old is None:
            del os.environ["LUMEN_HOME"]
        else:
            os.environ["LUMEN_HOME"] = old


def default_server(home: pathlib.Path, extra_tasks: Sequence[dict] = (),
                   server_kwargs: Optional[dict] = None, **server: Any) -> ServerThread:
    """A started server with the built-in default tasks on the models prepared under ``home``
    (plus ``extra_tasks`` tables); ``server_kwargs`` go to LumenServer."""
    from lumen_core.tasks import default_task_tables

    with lumen_home_env(home):
        cfg = {"server": server, "tasks": default_task_tables() + list(extra_tasks)}
        return ServerThread(Runtime.from_dict(cfg), **(server_kwargs or {}))


def self_signed_cert(directory: pathlib.Path) -> tuple:
    """(cert.pem, key.pem) for CN/SAN localhost + 127.0.0.1, made with the openssl CLI."""
    import subprocess

    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def to_toml(cfg: dict) -> str:
    """A config dict (as ``Runtime.from_dict`` takes) as TOML text, for ``lumen serve --config``."""
    def val(v):
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")

    out = ["[server]"] + [f"{k} = {val(v)}" for k, v in cfg["server"].items()]
    for t in cfg["tasks"]:
        out.append("\n[[tasks]]")
        out += [f"{k} = {val(v)}" for k, v in t.items() if not isinstance(v, dict)]
        for k, v in t.items():
            if isinstance(v, dict):
                out.append(f"[tasks.{k}]")
                out += [f"{kk} = {val(vv)}" for kk, vv in v.items()]
    return "\n".join(out) + "\n"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server this test starts elsewhere: Ray's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

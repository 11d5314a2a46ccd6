"""One process serving one runtime over HTTP (uvicorn) and gRPC, with a graceful stop.

Start-up order: claim both ports (HTTP bound, gRPC's tried; a busy one is one error line naming
every busy port and its flag, before any model loads), load + warm the runtime, install the
metrics observer (so warm-up requests are not counted), start HTTP and gRPC, then log one
``ready`` line.  Shutdown (SIGTERM / SIGINT /
:meth:`LumenServer.shutdown`) runs the other way round and never drops admitted work:

1. mark HTTP and gRPC as draining: new inference calls get 503 / UNAVAILABLE, ``/readyz``
   turns 503 so a load balancer stops sending;
2. uvicorn closes its listening sockets (new connections are refused), closes idle keep-alive
   connections, and waits for in-flight HTTP requests to finish; gRPC does the same;
3. the runtime drains its batchers and releases its sessions.

uvicorn's own signal handling is replaced by ours (``_Uvicorn.capture_signals``) because one
signal must stop both transports and the runtime, in that order.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import uvicorn

from .. import __version__
from .auth import ApiKeys
from .door_protocol import protocol_class
from .grpc import GrpcServer
from .http import HttpApp
from .limits import HttpLimits
from .logs import guard_uvicorn_logs
from .metrics import PrometheusObserver
from .shm import is_loopback

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import ServedRuntime

log = logging.getLogger("lumen.serve")

#: seconds in-flight requests get to finish after SIGTERM before connections are cut
SHUTDOWN_GRACE_S = 30.0
#: seconds an idle keep-alive HTTP connection stays open (uvicorn's default is 5)
KEEP_ALIVE_S = 30
#: the listen backlog; a load test opens many connections at once
BACKLOG = 2048


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers (LumenServer installs one for everything)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        return None


#: how to move each port, for the one error line a busy port gives
PORT_HINTS = {
    "HTTP": "move it with --http-port P ([server] http_port; 0 picks a free one)",
    "gRPC": "a second server needs its own gRPC port as well as its own HTTP port: move it "
            "with --grpc-port P ([server] grpc_port), or turn gRPC off with --grpc-port 0",
}


def port_error(what: str, host: str, port: int, exc: OSError) -> OSError:
    """One line naming the port that cannot be bound, why, and how to move it (no
    ``[Errno 98]`` prefix: the sentence says it)."""
    why = ("is already in use (another lumen serve, or another program?)"
           if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror or exc})")
    return OSError(f"{what} port {host}:{port} {why}; {PORT_HINTS[what]}")


def bind_socket(host: str, port: int, what: str = "HTTP") -> socket.socket:
    """A listening TCP socket (port 0 picks a free one; the caller reads the real port).

    A port that cannot be bound is one ``OSError`` line naming host:port and the flag.

    The socket is made with ``IPPROTO_TCP`` named: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on accepted sockets whose protocol says TCP, and without it every
    reply on a keep-alive connection (head and body written apart) waited ~40 ms for the
    client's delayed ACK (uvloop sets it either way)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise port_error(what, host, port, exc) from None
    sock.setblocking(False)
    return sock


def read_tls(server_cfg: Any, cert: Optional[str] = None, key: Optional[str] = None) -> Optional[tuple]:
    """(cert path, key path, cert PEM, key PEM) from the flags or ``[server] tls_*``; None for
    plain HTTP / insecure gRPC.  A missing or unreadable file is one OSError line."""
    cert = cert or server_cfg.tls_cert_file
    key = key or server_cfg.tls_key_file
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("TLS needs both a certificate and a key: --tls-cert and --tls-key "
                         "([server] tls_cert_file, tls_key_file)")
    out = [cert, key]
    for what, path in (("certificate", cert), ("key", key)):
        try:
            with open(path, "rb") as fh:
                out.append(fh.read())
        except OSError as exc:
            raise OSError(f"TLS {what} {path!r}: {exc.strerror or exc}") from None
    return tuple(out)


class LumenServer:
    """HTTP + gRPC front of a :class:`~lumen_core.runtime.Runtime`.

    ``http_port`` / ``grpc_port`` of 0 bind free ports (read them back from the attributes
    after :meth:`start`); ``grpc_port=None`` disables gRPC.

    Every HTTP request runs under its correlation id (:mod:`.logs`: the ``X-Correlation-Id``
    header, else a new one, echoed in the reply); ``access_log`` adds one ``lumen.access``
    line per request.  Log formatting is the caller's (``lumen serve`` calls
    :func:`.logs.configure`); uvicorn's own lines go through the standard loggers too.
    """

    def __init__(self, runtime: ServedRuntime, host: Optional[str] = None, http_port: Optional[int] = None,
                 grpc_port: Optional[int] = -1, grace_s: float = SHUTDOWN_GRACE_S,
                 log_level: str = "warning", api_keys: Iterable[str] = (),
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 access_log: bool = False, watch_s: Optional[float] = None):
        server_cfg = runtime.config.server
        self.keys = ApiKeys.from_config(server_cfg, api_keys)
        guard_uvicorn_logs()  # no key or query string in uvicorn's lines, at any level
        self.tls = read_tls(server_cfg, tls_cert, tls_key)
        self.limits = HttpLimits.from_config(server_cfg)
        self.version = __version__
        self.runtime = runtime
        self.host = host if host is not None else server_cfg.host
        self.http_port = http_port if http_port is not None else server_cfg.http_port
        if grpc_port == -1:
            grpc_port = server_cfg.grpc_port or None
        self.grpc_port = grpc_port
        self.grace_s = grace_s
        self.observer = PrometheusObserver(runtime)
        # the access log is RequestContext's (one line with the task, sizes and correlation id)
        self.http = HttpApp(runtime, self.observer, keys=self.keys, access_log=False,
                            version=self.version)
        self.access_log = access_log
        self.grpc: Optional[GrpcServer] = None
        self._uvicorn: Optional[_Uvicorn] = None
        self._serve_task: Optional[asyncio.Task] = None
        self._log_level = log_level
        self._stopping: Optional[asyncio.Task] = None
        self.stopped = asyncio.Event()
        #: ``--watch``: seconds between looks at the config and model files (None: off)
        self.watch_s = watch_s

    async def start(self) -> None:
        rt = self.runtime
        # both ports first: a busy one fails in milliseconds, before the models load, and
        # before gRPC's own bind could print its C-core log line above ours
        sock = self._claim_ports()
        try:
            await rt.start()
        except BaseException:
            sock.close()
            raise
        try:
            await self._start_front(sock)
            if self.watch_s is not None:
                rt.watch(self.watch_s)
        except BaseException:
            # a port that cannot be bound must not leave the runtime or gRPC running
            if self.grpc is not None:
                await self.grpc.stop(0)
            await rt.stop()
            raise

    def _claim_ports(self) -> socket.socket:
        """Bind the HTTP socket (kept for uvicorn) and try the gRPC port (a throwaway bind:
        gRPC binds its own later); one OSError line naming every busy port and its flag."""
        busy: list = []
        sock = None
        try:
            sock = bind_socket(self.host, self.http_port)
        except OSError as exc:
            busy.append(exc)
        if self.grpc_port:  # None: gRPC off; 0: a free port, never busy
            try:
                bind_socket(self.host, self.grpc_port, "gRPC").close()
            except OSError as exc:
                busy.append(exc)
        if busy:
            if sock is not None:
                sock.close()
            raise OSError("; and ".join(str(e) for e in busy))
        assert sock is not None
        return sock

    async def _start_front(self, sock: socket.socket) -> None:
        rt = self.runtime
        rt.observer = self.observer
        max_payload = rt.config.server.max_payload_bytes
        # gRPC can still lose its port between the check and its bind (another process):
        # then that is the error, and the HTTP socket is closed
        busy: list = []
        if self.grpc_port is not None:
            self.grpc = GrpcServer(rt, self.observer, self.host, self.grpc_port, max_payload,
                                   keys=self.keys, tls=self.tls[2:] if self.tls else None)
            try:
                await self.grpc.start()
            except OSError as exc:
                busy.append(exc)
            self.grpc_port = self.grpc.port
        if busy:
            sock.close()
            raise busy[0]
        self.http_port = sock.getsockname()[1]
        limits = self.limits
        forwarded = rt.config.server.forwarded_allow_ips
        tls = ({"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]}
               if self.tls is not None else {})
        # log_config=None: uvicorn installs no handlers or formats of its own, so its lines
        # reach the root logger (and --log-format) like everyone else's
        config = uvicorn.Config(self.http.with_context(self.access_log),
                                log_level=self._log_level, access_log=False, log_config=None,
                                lifespan="off", timeout_keep_alive=KEEP_ALIVE_S,
                                # uvicorn annotates int; it waits a float too
                                timeout_graceful_shutdown=self.grace_s,  # type: ignore[arg-type]
                                backlog=BACKLOG,
                                server_header=False, date_header=False,
                                http=protocol_class(limits, self.http),
                                h11_max_incomplete_event_size=limits.max_header_bytes,
                                # a WebSocket message is bounded as a request body is
                                ws_max_size=max_payload,
                                # X-Forwarded-For believed only from the configured proxies
                                # (uvicorn's default believes 127.0.0.1: any local client)
                                proxy_headers=bool(forwarded),
                                forwarded_allow_ips=list(forwarded) or None, **tls)
        self._uvicorn = _Uvicorn(config)
        self._serve_task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the start-up error
                raise RuntimeError("the HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        scheme = "https" if self.tls is not None else "http"
        grpc_txt = (f", grpc{'+tls' if self.tls else ''} {self.host}:{self.grpc_port}"
                    if self.grpc is not None else "")
        auth_txt = f"; {len(self.keys)} API key(s) required" if self.keys.enabled else ""
        log.info("lumen ready: tasks %s on %s://%s:%d%s%s (lumen-core %s)",
                 ", ".join(rt.task_names()), scheme, self.host, self.http_port, grpc_txt, auth_txt,
                 self.version)
        if not self.keys.enabled and not is_loopback(self.host):
            log.warning("no API keys on %s, which is not a loopback address: anyone who can "
                        "reach it can run inference and use the admin API (/v1/admin: load, "
                        "unload, traffic); set [server] api_keys and admin_api_keys (or "
                        "--api-key), or bind 127.0.0.1", self.host)

    def shutdown(self) -> "asyncio.Task":
        """Begin the graceful stop (idempotent); returns the task that performs it."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shutdown())
        return self._stopping

    async def _shutdown(self) -> None:
        log.info("lumen shutting down: draining in-flight requests")
        self.http.draining = True
        self.runtime.stop_loading()  # a model load in progress answers now, never held for
        grpc_stop = (asyncio.ensure_future(self.grpc.stop(self.grace_s))
                     if self.grpc is not None else None)
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._serve_task is not None:
                try:
                    await self._serve_task
                except Exception:  # the runtime must still drain and stop
                    log.exception("the HTTP server failed while stopping")
        if grpc_stop is not None:
            await grpc_stop
        await self.runtime.stop()
        self.stopped.set()
        log.info("lumen stopped")

    async def run(self) -> None:
        """Start, serve until SIGTERM / SIGINT, then stop gracefully."""
        loop = asyncio.get_running_loop()
        await self.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            await self.stopped.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    def reload(self) -> "asyncio.Task":
        """SIGHUP: re-read the config and model files without dropping a request
        (``Runtime.reload``); the outcome is logged and shown by ``/v1/admin/tasks``."""
        log.info("lumen: reloading the config and model files (SIGHUP)")

        async def run() -> None:
            try:
                await self.runtime.reload()
            except Exception:  # noqa: BLE001 - a failed reload must not stop the server
                log.exception("lumen: reload failed")
        return asyncio.ensure_future(run())

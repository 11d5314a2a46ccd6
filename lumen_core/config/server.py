"""``[server]``: the listener, connection limits, authentication, TLS and server-wide switches.

Each key is declared once, as a :func:`~.schema.setting` field of :class:`ServerConfig`; the
``DEFAULT_*`` constants other modules import are read back from those declarations.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass
from typing import Any, Optional

from .schema import Reader, default_of, read_settings, setting

#: endpoints that may be opened to callers without an API key (/healthz always is)
AUTH_OPTIONAL_ENDPOINTS = ("/readyz", "/metrics", "/v2/health/ready")
#: the most system shared-memory regions ``shm_max_regions`` may allow
MAX_SHM_REGIONS = 65536


def _string_list(r: Reader, name: str, items: list, choices: Optional[tuple] = None) -> list:
    for v in items:
        if not isinstance(v, str) or not v:
            raise r.err(name, f"must be an array of non-empty strings, got {v!r}")
        if choices is not None and v not in choices:
            raise r.err(name, f"entries must be among {', '.join(choices)}, got {v!r}")
    return items


def _api_keys(r: Reader, name: str, items: list, _values: dict) -> tuple:
    keys = _string_list(r, name, items)
    for i, k in enumerate(keys):
        if k != k.strip() or not k.isprintable() or not k.isascii():
            # a key is a header value: no whitespace at the ends, printable ASCII (never echoed)
            raise r.err(name, f"entry {i} must be printable ASCII without surrounding "
                              f"whitespace")
    return tuple(keys)


def _endpoints(r: Reader, name: str, items: list, _values: dict) -> tuple:
    return tuple(_string_list(r, name, items, AUTH_OPTIONAL_ENDPOINTS))


def _networks(r: Reader, name: str, items: list, _values: dict) -> tuple:
    """IP addresses or networks (``10.0.0.0/8``), or ``"*"`` for any."""
    for v in _string_list(r, name, items):
        if v == "*":
            continue
        try:
            ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise r.err(name, f"entries must be IP addresses, networks such as '10.0.0.0/8' or "
                              f"'*', got {v!r}") from None
    return tuple(items)


def _path(r: Reader, _name: str, path: str, _values: dict) -> str:
    """A relative path resolves against the config file's folder."""
    if path and r.base_dir and not os.path.isabs(path):
        path = os.path.join(r.base_dir, path)
    return path


@dataclass
class ServerConfig:
    """``[server]``: one field per key (the field's :func:`~.schema.setting` says it all)."""

    host: str = setting("127.0.0.1", "the address HTTP and gRPC listen on")
    http_port: int = setting(8000, "the HTTP port (0: any free port)", lo=0, hi=65535)
    grpc_port: int = setting(8001, "the gRPC port (0 disables gRPC)", lo=0, hi=65535)
    max_payload_bytes: int = setting(16 * 1024 * 1024, "the largest request body; past it: 413",
                                     lo=1)
    # connection limits (lumen_core/serve/limits.py enforces them)
    max_header_bytes: int = setting(32 * 1024, "request line + headers; past it: 431 and close",
                                    lo=1024)
    read_timeout_ms: int = setting(10_000, "headers must arrive within it (and body chunks keep "
                                           "coming): 408 / close", lo=1)
    max_connections: int = setting(1000, "open HTTP connections; past it: 503 + Retry-After "
                                         "(kept under ulimit -n)", lo=1)
    #: a request body must arrive within body_timeout_ms of its headers, extended by one
    #: second per body_min_rate bytes received (0: no extension); past it: 408 and close
    #: (Apache mod_reqtimeout's ``body=20,MinRate=500``)
    body_timeout_ms: int = setting(20_000, "a body must be in within it of its headers, plus "
                                           "1 s per body_min_rate bytes: 408 / close", lo=1)
    body_min_rate: int = setting(500, "bytes/s that extend the body deadline (0: a fixed "
                                      "deadline)", lo=0)
    api_keys: tuple = setting((), "Bearer keys; none: no authentication (also --api-key, "
                                  "api_key_file)", check=_api_keys, kind_doc="array of strings")
    api_key_file: str = setting("", "a file of API keys, one a line, # comments (read when the "
                                    "server starts)", check=_path, kind_doc="path")
    admin_api_keys: tuple = setting((), "keys of /v1/admin only (with any key set, inference "
                                        "keys get 403 there)", check=_api_keys,
                                    kind_doc="array of strings")
    model_root: str = setting("", "admin loads name model files under it (empty: the config "
                                  "file's folder)", check=_path, kind_doc="path")
    admin_max_model_bytes: int = setting(4 << 30, "the largest file an admin load may name "
                                                  "(bigger: 413)", lo=1)
    open_endpoints: tuple = setting((), "of " + ", ".join(AUTH_OPTIONAL_ENDPOINTS) + ": served "
                                        "without a key when keys are on (/healthz always is)",
                                    check=_endpoints, kind_doc="array of strings")
    forwarded_allow_ips: tuple = setting(
        (), "proxies (addresses, networks, \"*\") whose X-Forwarded-For / -Proto is believed; "
            "none by default, so a client cannot forge its address", check=_networks,
        kind_doc="array of strings")
    tls_cert_file: str = setting("", "with tls_key_file: HTTPS and gRPC over TLS (also "
                                     "--tls-cert)", check=_path, kind_doc="path")
    tls_key_file: str = setting("", "the TLS private key (also --tls-key)", check=_path,
                                kind_doc="path")
    system_shared_memory: bool = setting(False, "Triton's system shared-memory extension on "
                                                "/v2 (loopback clients only)")
    shm_max_regions: int = setting(256, "shm regions registered at once, over all keys (1 fd "
                                        "each; kept within ulimit -n / 4)", lo=1,
                                   hi=MAX_SHM_REGIONS)
    tracing: bool = setting(False, "OpenTelemetry spans per request and batch (also "
                                   "LUMEN_TRACING=1)")
    tei_task: str = setting("", "the embedding task of TEI's /embed, / and /info (empty: the "
                                "only one, else the first)")
    rerank_task: str = setting("", "the rerank task of /rerank and of /v1/rerank without "
                                   "\"model\" (empty: the first)")

    def __repr__(self) -> str:  # never print the keys
        secret = ("api_keys", "admin_api_keys")
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if f.name not in secret)
        return (f"ServerConfig({fields}, api_keys=<{len(self.api_keys)} keys>, "
                f"admin_api_keys=<{len(self.admin_api_keys)} keys>)")


def _default(name: str) -> Any:
    return default_of(ServerConfig, name)


DEFAULT_HOST: str = _default("host")
DEFAULT_HTTP_PORT: int = _default("http_port")
DEFAULT_GRPC_PORT: int = _default("grpc_port")
DEFAULT_MAX_PAYLOAD_BYTES: int = _default("max_payload_bytes")
DEFAULT_MAX_HEADER_BYTES: int = _default("max_header_bytes")
DEFAULT_READ_TIMEOUT_MS: int = _default("read_timeout_ms")
DEFAULT_MAX_CONNECTIONS: int = _default("max_connections")
DEFAULT_BODY_TIMEOUT_MS: int = _default("body_timeout_ms")
DEFAULT_BODY_MIN_RATE: int = _default("body_min_rate")
DEFAULT_SHM_MAX_REGIONS: int = _default("shm_max_regions")
DEFAULT_ADMIN_MAX_MODEL_BYTES: int = _default("admin_max_model_bytes")


def parse_server(r: Reader) -> ServerConfig:
    """``[server]`` (``r`` reads it): every declared key, then the rules between keys."""
    server = ServerConfig(**read_settings(r, ServerConfig))
    if set(server.admin_api_keys) & set(server.api_keys):
        raise r.err("admin_api_keys", "a key may not be both an inference key (api_keys) and "
                                      "an admin key; give the admin API keys of its own")
    if bool(server.tls_cert_file) != bool(server.tls_key_file):
        missing = "tls_key_file" if server.tls_cert_file else "tls_cert_file"
        raise r.err(missing, "TLS needs both tls_cert_file and tls_key_file")
    r.finish()
    return server

"""``lumen serve``: the runtime over HTTP and gRPC, or its replicas on Ray Serve."""
from __future__ import annotations

import argparse

from .common import (
    EXIT_OK,
    LOG_FORMATS,
    LOG_LEVELS,
    at_least_one,
    build_runtime,
    configure_logging,
    positive_float,
    run,
)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray:
        return _serve_ray(args)
    for flag, value in (("--replicas", args.replicas), ("--max-replicas", args.max_replicas),
                        ("--num-cpus", args.num_cpus), ("--ray-address", args.ray_address),
                        ("--ray-ingress", args.ray_ingress)):
        if value is not None:
            raise ValueError(f"{flag} is a Ray option: add --ray")
    from ..serve.server import LumenServer  # first: a missing [serve] extra is one message

    undo = configure_logging(args.log_level, args.access_log, args.log_format)
    try:
        rt = build_runtime(args.config)
        grpc_port = -1 if args.grpc_port is None else (args.grpc_port or None)
        server = LumenServer(rt, host=args.host, http_port=args.http_port, grpc_port=grpc_port,
                             log_level=args.log_level, api_keys=args.api_key,
                             tls_cert=args.tls_cert, tls_key=args.tls_key,
                             access_log=args.access_log,
                             watch_s=args.watch_interval if args.watch else None)
        run(server.run())
    finally:
        undo()
    return EXIT_OK


def _serve_ray(args: argparse.Namespace) -> int:
    """`lumen serve --ray`: the runtime's replicas on Ray Serve (integrations/ray.py)."""
    for flag, value in (("--grpc-port", args.grpc_port), ("--tls-cert", args.tls_cert),
                        ("--tls-key", args.tls_key)):
        if value is not None:
            raise ValueError(f"{flag} does not apply with --ray: Ray's proxy serves HTTP only "
                             f"(put TLS in front of it)")
    if args.api_key:
        raise ValueError("--api-key does not apply with --ray: set [server] api_keys in the "
                         "config (every replica reads it)")
    if args.watch:
        raise ValueError("--watch does not apply with --ray: a new config reaches the replicas "
                         "as the deployment's user_config (README, \"More than one machine\")")
    from ..integrations.ray import DEFAULT_NUM_CPUS, DEFAULT_REPLICAS, serve_forever

    replicas = args.replicas or DEFAULT_REPLICAS
    if args.max_replicas is not None and args.max_replicas < replicas:
        raise ValueError(f"--max-replicas ({args.max_replicas}) must be >= --replicas "
                         f"({replicas})")
    undo = configure_logging(args.log_level, args.access_log, args.log_format)
    try:
        return serve_forever(args.config, replicas,
                             args.num_cpus if args.num_cpus is not None else DEFAULT_NUM_CPUS,
                             args.max_replicas, args.host, args.http_port, args.ray_address,
                             ingress=args.ray_ingress)
    finally:
        undo()


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the tasks over HTTP (+ OpenAI embeddings) and gRPC",
                       description="Serve a runtime over HTTP and gRPC until SIGTERM/SIGINT, "
                                   "then drain in-flight requests and exit. Without --config: "
                                   "the built-in default tasks on the prepared models.")
    p.add_argument("--config", metavar="TOML", help="lumen.toml (default: built-in default tasks)")
    p.add_argument("--host", default=None, help="bind address (default: [server].host, 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=None, metavar="P",
                   help="HTTP port (default: [server].http_port, 8000; 0 picks a free one)")
    p.add_argument("--grpc-port", type=int, default=None, metavar="P",
                   help="gRPC port (default: [server].grpc_port, 8001; 0 disables gRPC)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (HTTP) / authorization metadata "
                        "(gRPC); repeatable, adds to [server].api_keys / api_key_file")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve HTTPS and gRPC over TLS with this certificate chain "
                        "(default: [server].tls_cert_file)")
    p.add_argument("--tls-key", default=None, metavar="PEM",
                   help="the certificate's private key (default: [server].tls_key_file)")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="log level (default: warning; the ready line is always logged)")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text lines, or one JSON object a line (ts, level, logger, message, "
                        "correlation_id, ...); default: text")
    p.add_argument("--access-log", action="store_true",
                   help="log one line per HTTP request: client, method, path, status, task, "
                        "response and request bytes, ms, correlation id")
    p.add_argument("--watch", action="store_true",
                   help="reload when the config file or a model file changes (content hash; a "
                        "file is loaded once it stopped changing); SIGHUP reloads on demand")
    p.add_argument("--watch-interval", type=float, default=1.0, metavar="S",
                   help="seconds between two looks at the files with --watch (default 1)")
    ray = p.add_argument_group("Ray Serve (more than one machine; the [ray] extra)")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: join $RAY_ADDRESS (or --ray-address), else "
                          "start a local Ray instance; Ray's proxy listens on --host/--http-port")
    ray.add_argument("--replicas", type=at_least_one, default=None, metavar="N",
                     help="Lumen replicas (default 1; with --max-replicas: the fewest)")
    ray.add_argument("--max-replicas", type=at_least_one, default=None, metavar="M",
                     help="autoscale between --replicas and M on ongoing requests")
    ray.add_argument("--num-cpus", type=positive_float, default=None, metavar="C",
                     help="CPUs per replica, fractions allowed (default 1); ONNX Runtime "
                          "threads per replica: max(1, floor(C))")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the Ray cluster to join, e.g. ray://head:10001 or head:6379 "
                          "(default: $RAY_ADDRESS, else a new local instance)")
    ray.add_argument("--ray-ingress", choices=("haproxy", "proxy"), default=None,
                     help="Ray Serve's ingress when this command starts Serve: haproxy (the "
                          "default; the Python proxy with a warning where Ray has no HAProxy "
                          "binary, and with --max-replicas: Ray does not autoscale behind "
                          "HAProxy) or proxy (Ray's Python proxy)")
    p.set_defaults(func=cmd_serve)

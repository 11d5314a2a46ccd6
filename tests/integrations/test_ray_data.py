"""``lumen_core.integrations.ray_data`` on a ``ray.cluster_utils.Cluster``: a head without
CPUs and two worker nodes; a Parquet dataset embedded by an actor pool (one runtime each),
one worker node removed while the job runs: every row is still written once, and the vectors
equal the single-machine ``lumen embed`` run's.  Compiled run only, like the other cluster
tests (test_ray.py's module docstring says why)."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
pytest.importorskip("pandas", reason="the [bulk] extra (pandas, for Ray Data) is not installed")

from lumen_core import cli, native  # noqa: E402
from lumen_core.integrations import ray_data as RD  # noqa: E402

#: rows and Parquet files of the dataset (a block each); short texts: quick on the real model
ROWS = 360
FILES = 12
#: seconds the test waits for the job
JOB_TIMEOUT_S = 120.0


def _texts() -> list:
    from lumen_core.corpus import make_corpus

    short = [t for t in make_corpus(4 * ROWS) if len(t.split()) <= 12]
    return [short[i % len(short)] for i in range(ROWS)]


def _vectors(table: pa.Table) -> np.ndarray:
    col = table.column("embedding").combine_chunks()
    return col.values.to_numpy().reshape(len(table), col.type.list_size)


def _actor_nodes() -> set:
    """Node ids of the pool's live actors."""
    from ray.util.state import list_actors

    return {a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if "MapWorker" in a.class_name}


# Ray 2.6x deprecates every remote argument it has no named parameter for, and
# scheduling_strategy has none: SPREAD puts one actor on each node, so the survivor has room to
# restart the lost node's actor (what this test is about)
@pytest.mark.filterwarnings("ignore:`ray_remote_args` is deprecated")
def test_a_node_lost_mid_job_loses_no_row(prepared_home, tmp_path, monkeypatch, capsys):
    if native.NO_EXTENSIONS:
        pytest.skip("the Ray cluster tests run once, in the compiled run")
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("LUMEN_HOME", str(prepared_home))
    texts = _texts()
    src = tmp_path / "in"
    src.mkdir()
    per = ROWS // FILES
    for f in range(FILES):
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(f * per, (f + 1) * per)],
                                 "text": texts[f * per:(f + 1) * per]}),
                       src / f"part-{f:02d}.parquet")
    # the single-machine run of the same rows
    single = tmp_path / "single.parquet"
    assert cli.main(["embed", *sorted(map(str, src.iterdir())), "-o", str(single),
                     "--id-field", "id", "-q"]) == 0
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": RD.actor_env()})
        ds = ray.data.read_parquet(str(src)).repartition(FILES)  # a block per batch
        out_dir = tmp_path / "out"
        # one CPU an actor, spread: one actor a node, and the survivor has room for the
        # lost node's actor when Ray restarts it
        job = RD.embed_dataset(ds, "text", actors=2, cpus_per_actor=1.0, batch_rows=per,
                               scheduling_strategy="SPREAD")
        errors: list = []

        def run() -> None:
            try:
                job.write_parquet(str(out_dir))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline and t.is_alive():
            if out_dir.is_dir() and any(n.endswith(".parquet") for n in os.listdir(out_dir)):
                break
            time.sleep(0.05)
        assert t.is_alive(), "the job ended before a node could be lost"
        hosts = _actor_nodes()
        victim = next(n for n in nodes if n.node_id in hosts)  # a node with an actor on it
        cluster.remove_node(victim)
        t.join(JOB_TIMEOUT_S)
        assert not t.is_alive() and not errors, errors
        done = len([n for n in os.listdir(out_dir) if n.endswith(".parquet")])
        assert done == FILES  # every block written once, after the loss too
        ray.shutdown()
        # the command line's path on the same cluster (one node left)
        cli_out = tmp_path / "cli"
        assert cli.main(["embed", "--ray", "--ray-address", cluster.address, str(src), "-o",
                         str(cli_out), "--id-field", "id", "--ray-actors", "1"]) == 0
        assert f"done: {ROWS:,} rows -> {cli_out}" in capsys.readouterr().err
    finally:
        ray.shutdown()
        cluster.shutdown()
    by_cli = pq.read_table(str(cli_out)).sort_by("id")
    got = pq.read_table(str(out_dir)).sort_by("id")
    want = pq.read_table(single).sort_by("id")
    assert got.column("id").to_pylist() == want.column("id").to_pylist()  # each row once
    a, b = _vectors(got), _vectors(want)
    assert (a * b).sum(1).min() >= 0.9999
    assert by_cli.column("id").equals(want.column("id"))
    assert (_vectors(by_cli) * b).sum(1).min() >= 0.9999

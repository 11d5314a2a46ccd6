"""Bulk embedding across machines on Ray Data: a Parquet dataset in, a Parquet dataset out.

``embed_dataset(ds, column=..., task=...)`` is ``ds.map_batches`` with an actor pool, each
actor (:class:`LumenEmbedder`) holding one started runtime of the task and embedding its
batches the way ``lumen embed`` does in process (``bulk.local.LocalEmbedder``: the task's own
preparation, batches sorted by length, the task's engines).  Rows whose text cannot be
embedded (null, empty, too long with ``truncate=False``) are left out, as ``lumen embed``
skips them.

Fault tolerance is Ray's: Ray Data starts pool actors with ``max_restarts=-1`` and
``max_task_retries=-1`` (unless ``ray_remote_args`` say otherwise), so when a node is lost its
actors are restarted where there is room and the batches they held run again on the actors
left; no row is lost or written twice (Ray Data writes a block's
output once its task succeeded).  Unlike the single-machine command there is no resume after
the driver itself dies: a Ray job is rerun whole.

``lumen embed --ray INPUT... -o FOLDER --id-field ID`` drives it from the command line
(:func:`cmd_ray`); Ray Data keeps no row numbers, so the rows carry their ``--id-field``.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional

#: rows of one map_batches batch (each actor embeds it as one window)
DEFAULT_BATCH_ROWS = 1024
#: environment variables the actors need from the driver (where the prepared models are)
PASS_ENV = ("LUMEN_HOME", "LUMEN_NO_EXTENSIONS", "PYTHONPATH")


class LumenEmbedder:
    """The actor of the pool: one runtime of ``task`` (``--config`` file or the built-in
    task), started once, embedding each batch (a ``pyarrow.Table``) it is given.  The output
    batch holds the input's columns except the text, plus ``embedding`` (fixed-size list of
    float32)."""

    def __init__(self, task: str = "text_embed", column: str = "text",
                 config: Optional[str] = None, dimensions: Optional[int] = None,
                 prompt_name: Optional[str] = None, truncate: bool = True,
                 instances: Optional[int] = None, threads: Optional[int] = None,
                 keep_text: bool = False):
        from ..bulk.local import LocalEmbedder, bulk_runtime

        self.column = column
        self.keep_text = keep_text
        self.rt = bulk_runtime(task, config, instances, threads)
        self.rt.start_background()
        self.embedder = LocalEmbedder(self.rt, task, dimensions, prompt_name, truncate)

    def __call__(self, batch: Any) -> Any:
        import numpy as np
        import pyarrow as pa

        from ..bulk.sources import text_or_reason

        texts = batch.column(self.column).to_pylist()
        good = [i for i, t in enumerate(texts) if text_or_reason(t)[1] is None]
        res = self.embedder.submit([texts[i] for i in good]).result()
        kept = [k for k in range(len(good)) if k not in res.errors]
        out = batch.take(pa.array([good[k] for k in kept], pa.int64()))
        if not self.keep_text:
            out = out.drop_columns([self.column])
        vecs = np.ascontiguousarray(res.vectors[kept], dtype=np.float32)
        emb = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1), pa.float32()),
                                                self.embedder.dim)
        return out.append_column("embedding", emb)

    def __del__(self) -> None:  # the actor going away: release the engines
        try:
            self.embedder.close(timeout=5)
            self.rt.stop_background()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def embed_dataset(ds: Any, column: str = "text", task: str = "text_embed",
                  config: Optional[str] = None, dimensions: Optional[int] = None,
                  prompt_name: Optional[str] = None, truncate: bool = True,
                  actors: int = 2, cpus_per_actor: float = 1.0,
                  batch_rows: int = DEFAULT_BATCH_ROWS, threads: Optional[int] = None,
                  keep_text: bool = False, **ray_remote_args: Any) -> Any:
    """``ds`` (a ``ray.data.Dataset`` with a text ``column``) with an ``embedding`` column (see
    the module docstring).  Each actor runs one engine session of ``threads`` (default: its
    CPUs) intra-op threads.  Lazy, like every Dataset transform."""
    if actors < 1:
        raise ValueError(f"actors must be >= 1, got {actors}")
    import ray.data

    threads = threads or max(1, int(cpus_per_actor))
    return ds.map_batches(
        LumenEmbedder, batch_size=batch_rows, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus_per_actor,
        fn_constructor_kwargs={"task": task, "column": column, "config": config,
                               "dimensions": dimensions, "prompt_name": prompt_name,
                               "truncate": truncate, "instances": 1, "threads": threads,
                               "keep_text": keep_text},
        **ray_remote_args)


def actor_env() -> dict:
    """The variables of :data:`PASS_ENV` this process has, for the actors' runtime_env."""
    return {k: os.environ[k] for k in PASS_ENV if k in os.environ}


def cmd_ray(args: argparse.Namespace, spec: Any) -> int:
    """``lumen embed --ray``: the Parquet INPUTs (files or folders) into the folder OUTPUT."""
    import ray

    if not spec.id_field:
        raise ValueError("--ray needs --id-field: Ray Data keeps no row numbers, so each row "
                         "carries its id into the output")
    if args.url:
        raise ValueError("--ray and --url exclude each other")
    for p in args.inputs:
        if p == "-" or not (os.path.isdir(p) or p.endswith((".parquet", ".pq"))):
            raise ValueError(f"{p}: --ray reads Parquet files or folders of them")
    if os.path.exists(args.output) and os.listdir(args.output) and not args.overwrite:
        raise ValueError(f"{args.output} exists and is not empty; pass --overwrite to replace it")
    if args.overwrite and os.path.isdir(args.output):
        import shutil

        shutil.rmtree(args.output)
    config = os.path.abspath(args.config) if args.config else None
    ray.init(address=args.ray_address, runtime_env={"env_vars": actor_env()},
             log_to_driver=False)
    try:
        t0 = time.monotonic()
        cols = [spec.field, spec.id_field, *spec.keep]
        actors = args.ray_actors or max(1, int(ray.cluster_resources().get("CPU", 1)
                                               // args.ray_cpus))
        # a block per actor and more (the reader may hand over one block for many files)
        ds = ray.data.read_parquet([os.path.abspath(p) for p in args.inputs]) \
            .select_columns(cols).repartition(4 * actors)
        out = embed_dataset(ds, spec.field, args.task, config, args.dimensions,
                            args.prompt_name, not args.no_truncate, actors, args.ray_cpus,
                            min(args.row_group_size, DEFAULT_BATCH_ROWS), args.threads)
        out.write_parquet(os.path.abspath(args.output))
        rows = _rows_in(args.output)
        dt = time.monotonic() - t0
        if not args.quiet:
            print(f"done: {rows:,} rows -> {args.output} ({actors} actors) in {dt:.1f} s: "
                  f"{rows / dt if dt else 0:,.1f} rows/s", flush=True, file=_stderr())
    finally:
        ray.shutdown()
    return 0


def _rows_in(folder: str) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(os.path.join(folder, n)).num_rows
               for n in os.listdir(folder) if n.endswith(".parquet"))


def _stderr() -> Any:
    import sys

    return sys.stderr

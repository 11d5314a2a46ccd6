"""``lumen embed INPUT... -o OUTPUT``: a bulk embedding job (``lumen_core.bulk``).

In process by default (the task's engines, batches formed by length, no HTTP), against a
running server with ``--url``, or on a Ray cluster with ``--ray``.  Resumable: rerun the same
command after any interruption and it continues from the last finished row group.
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from .common import API_KEY_HELP, EXIT_OK, at_least_one

#: exit status after Ctrl-C / SIGTERM (what a shell reports for SIGINT)
EXIT_INTERRUPTED = 130
DEFAULT_TASK = "text_embed"
DEFAULT_ROW_GROUP = 4096


def _csv_list(values: list) -> tuple:
    """``--keep a,b --keep c`` -> ``("a", "b", "c")``."""
    return tuple(v for item in values for v in item.split(",") if v)


def _spec(args: argparse.Namespace) -> Any:
    from ..bulk.sources import InputSpec

    keep = _csv_list(args.keep)
    reserved = {"embedding", args.id_field or "row"}
    clash = [k for k in keep if k in reserved]
    if clash:
        raise ValueError(f"--keep {', '.join(clash)}: the output already has that column")
    return InputSpec(args.field, args.id_field, keep, args.format)


def _job_state(args: argparse.Namespace, model: dict, inputs: Any, embedder: Any) -> dict:
    """What a rerun must match to resume: the arguments that change the output, the model,
    the inputs."""
    job = {"task": args.task, "field": args.field, "id_field": args.id_field,
           "keep": list(_csv_list(args.keep)), "format": args.format,
           "dimensions": args.dimensions, "prompt_name": args.prompt_name,
           "truncate": not args.no_truncate, "row_group_size": args.row_group_size,
           "on_bad_row": args.on_bad_row, "mode": "url" if args.url else "local"}
    # in process the batches decide the last bits of every vector: a resume forms the same
    batching = ({"max_rows": embedder.max_batch, "max_tokens": embedder.max_tokens}
                if hasattr(embedder, "max_tokens") else None)
    return {"job": job, "batching": batching, "model": model, "inputs": inputs.fingerprints}


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_embed(args: argparse.Namespace) -> int:
    from ..bulk import progress as P
    from ..bulk.sources import open_inputs

    spec = _spec(args)
    if args.ray:
        from ..integrations.ray_data import cmd_ray

        return cmd_ray(args, spec)
    inputs = open_inputs(args.inputs, spec)
    prog = P.Progress(mode="none" if args.quiet else args.progress)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    rt = None
    embedder: Any = None
    try:
        if args.url:
            from ..bulk.remote import RemoteEmbedder
            from .common import api_key

            embedder = RemoteEmbedder(args.url, args.task, api_key(args), args.dimensions,
                                      args.prompt_name, not args.no_truncate,
                                      args.concurrency, args.batch_size)
            model = {"url": args.url.rstrip("/"), "task": args.task}
            layout = f"{args.url} ({args.concurrency} concurrent batches of {args.batch_size})"
        else:
            from ..bulk.local import LocalEmbedder, bulk_runtime, model_fingerprint

            rt = bulk_runtime(args.task, args.config, args.instances, args.threads)
            rt.start_background()
            embedder = LocalEmbedder(rt, args.task, args.dimensions, args.prompt_name,
                                     not args.no_truncate, batch_tokens=args.batch_tokens)
            model = model_fingerprint(rt, args.task)
            tc = rt.tasks[args.task].config
            layout = (f"in process, {tc.instances} x {tc.intra_op_threads or 'auto'} threads, "
                      f"batches of <= {embedder.max_batch} rows and {embedder.max_tokens} "
                      f"tokens, {'bulk' if embedder.token_route else 'per-text'} tokenization")
        return _run(args, inputs, embedder, model, layout, prog)
    except KeyboardInterrupt:
        prog.finish()
        out = args.output + ".lumen-embed"
        print(f"lumen embed: interrupted; the finished row groups are kept in {out}: rerun the "
              f"same command to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        if embedder is not None:
            embedder.close(timeout=30)
        if rt is not None:
            rt.stop_background()


def _run(args: argparse.Namespace, inputs: Any, embedder: Any, model: dict, layout: str,
         prog: Any) -> int:
    from ..bulk.job import JobOptions, run_job
    from ..bulk.store import Store, output_schema

    store = Store(args.output, _job_state(args, model, inputs, embedder), args.overwrite)
    done = store.open()
    ct = inputs.column_types or {}
    import pyarrow as pa

    schema = output_schema(embedder.dim, args.id_field, ct.get(args.id_field, pa.string()),
                           inputs.spec.keep, ct)
    size = inputs.total_bytes
    what = f"{len(inputs.paths)} input{'s' * (len(inputs.paths) > 1)}" + (
        f" ({size / 1e6:,.1f} MB)" if size else "")
    prog.say(f"lumen embed: {what} -> {args.output}; task {args.task} "
             f"({model.get('model_id') or model.get('url')}), dim {embedder.dim}, {layout}, "
             f"row groups of {args.row_group_size:,} rows")
    if done:
        rows = sum(i["rows_in"] for i in done)
        prog.say(f"resuming: {len(done)} row groups ({rows:,} rows) already done in "
                 f"{store.work}")
    meta = {"task": args.task, "model": model, "dimensions": embedder.dim,
            "prompt_name": args.prompt_name, "truncate": not args.no_truncate}
    summary = run_job(inputs, embedder, store, schema, done,
                      JobOptions(args.row_group_size, args.on_bad_row), prog, meta)
    for line in summary.lines():
        prog.say(line)
    return EXIT_OK


def add_embed(sub: argparse._SubParsersAction) -> None:
    from ..bulk.progress import MODES
    from ..bulk.sources import FORMATS

    p = sub.add_parser(
        "embed", help="embed a corpus file into Parquet (resumable, with progress)",
        description="Embed every text of INPUT... (JSONL, CSV/TSV, Parquet, plain text, - for "
                    "stdin) into OUTPUT (.parquet: id or row number, embedding, --keep columns; "
                    ".npy: the vectors, their ids in OUTPUT's .ids.npy). In process at full speed, or against --url, or on "
                    "Ray (--ray). Rerun the same command after an interruption to continue.")
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT",
                   help="the output file (.parquet, or .npy with a sibling .ids.npy; a "
                        "folder with --ray)")
    p.add_argument("--task", default=DEFAULT_TASK,
                   help=f"the embedding task (default {DEFAULT_TASK}; any embedding task of "
                        f"--config, e.g. an imported model, or text_embed_int8)")
    p.add_argument("--config", metavar="TOML", help="lumen.toml (default: built-in tasks)")
    p.add_argument("--field", default="text",
                   help="the text: JSON field, CSV/TSV or Parquet column (default text)")
    p.add_argument("--id-field", default=None, metavar="FIELD",
                   help="the id column of the output (default: the row number, column 'row')")
    p.add_argument("--keep", action="append", default=[], metavar="COL[,COL]",
                   help="columns carried over into the output (repeatable)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="the input format (default: from the extension; stdin: JSONL when it "
                        "starts with '{', else text)")
    p.add_argument("--dimensions", type=at_least_one, default=None, metavar="D",
                   help="keep the first D components, then L2-normalise again")
    p.add_argument("--prompt-name", default=None, metavar="NAME",
                   help="the model's prompt to put before each text (models with prompts)")
    p.add_argument("--no-truncate", action="store_true",
                   help="a text over the model's token limit is a bad row instead of cut")
    p.add_argument("--on-bad-row", choices=("skip", "fail"), default="skip",
                   help="skip (and report) rows that cannot be embedded, or stop at the first")
    p.add_argument("--row-group-size", type=at_least_one, default=DEFAULT_ROW_GROUP,
                   metavar="ROWS", help=f"rows of one row group: the unit of resume and the "
                                        f"window sorted by length (default {DEFAULT_ROW_GROUP})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUTPUT and discard an unfinished job instead of resuming it")
    p.add_argument("--instances", type=at_least_one, default=None,
                   help="engine sessions (default: one per core, up to 8; --config: its own)")
    p.add_argument("--threads", type=at_least_one, default=None,
                   help="intra-op threads per session (default: cores / instances)")
    p.add_argument("--batch-tokens", type=at_least_one, default=None, metavar="N",
                   help="padded tokens of one batch (default: 512 on CPU, where smaller "
                        "batches cost less per text; the task's max_batch_tokens on a GPU)")
    p.add_argument("--progress", choices=MODES, default="auto",
                   help="bar (a terminal), lines (a log), none; default: bar on a terminal")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress and no summary")
    remote = p.add_argument_group("remote (--url)")
    remote.add_argument("--url", default=None,
                        help="send batches to a running lumen serve or any OpenAI "
                             "/v1/embeddings server (http://HOST:PORT) instead")
    remote.add_argument("--api-key", default=None, metavar="KEY", help=API_KEY_HELP)
    remote.add_argument("--concurrency", type=at_least_one, default=8,
                        help="batches in flight (default 8)")
    remote.add_argument("--batch-size", type=at_least_one, default=64,
                        help="texts per request (default 64)")
    ray = p.add_argument_group("Ray Data (--ray)")
    ray.add_argument("--ray", action="store_true",
                     help="embed a Parquet dataset into a Parquet dataset (OUTPUT: a folder) on "
                          "a Ray cluster, one runtime per actor")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the cluster (default: $RAY_ADDRESS, else a local Ray)")
    ray.add_argument("--ray-actors", type=at_least_one, default=None, metavar="N",
                     help="actors (runtimes) in the pool (default: one per node's CPUs / "
                          "--ray-cpus)")
    ray.add_argument("--ray-cpus", type=float, default=1.0, metavar="CPUS",
                     help="CPUs each actor reserves (default 1)")
    p.set_defaults(func=cmd_embed)

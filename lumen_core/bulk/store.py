"""The resumable output of a bulk job: part files beside a state file, assembled at the end.

Layout: next to ``OUTPUT`` a work folder ``OUTPUT.lumen-embed/`` holds ``state.json`` (what
the job is: its arguments, its model, its inputs' fingerprints) and one Parquet file per
finished row group, ``part-000000.parquet``, ``part-000001.parquet``, ...  A part is written
to a temporary name, flushed to disk and renamed, so a part file either exists whole or not
at all, whenever the process dies (Ctrl-C, SIGTERM, SIGKILL, the OOM killer, a power cut).
Its key-value metadata carries what the summary needs (input rows, bad rows, tokens, the
running hash of the rows read so far).

Row group ``k`` always holds the rows of input rows ``[k * R, (k + 1) * R)`` (``R`` =
``--row-group-size``) that were embedded, and the embedder forms the same batches from the same
rows (``local.py``), so a part computed again after a kill has the same bytes; at the end the
parts are copied, in order, one row group each, into ``OUTPUT`` (written to a temporary name
and renamed too), and the work folder is removed.  The output's bytes therefore do not depend
on where, or how often, the job was interrupted.

A rerun with a state whose job differs (other arguments, another model revision, an input
whose size, mtime or first / last MiB changed) is refused with :class:`JobMismatch`, saying
what differs; ``--overwrite`` discards the work folder (and an existing output) and starts
over.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

STATE_FILE = "state.json"
STATE_VERSION = 1
WORK_SUFFIX = ".lumen-embed"
PART_NAME = "part-{:06d}.parquet"
#: Parquet key-value metadata: a part's counters (parts only) and the job (the output)
PART_INFO_KEY = b"lumen.embed.part"
JOB_KEY = b"lumen.embed"
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".npy": "npy"}
#: the column of the vectors
EMBEDDING_COLUMN = "embedding"
#: the id column when there is no --id-field: the row's number in the input (from 0)
ROW_COLUMN = "row"
#: parts and output: snappy (vectors barely compress; ids and kept text do)
COMPRESSION = "snappy"


class JobMismatch(ValueError):
    """The work folder holds another job than the one asked for (``--overwrite`` starts over)."""


def output_format(path: str) -> str:
    """``parquet`` or ``npy``, from the output's extension."""
    fmt = OUTPUT_FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise ValueError(f"-o {path}: the output must end in .parquet or .npy")
    return fmt


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _differences(old: Any, new: Any, where: str = "") -> list:
    """Human lines naming what differs between two state sections."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += _differences(old.get(k), new.get(k), f"{where}.{k}" if where else k)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out += _differences(a, b, f"{where}[{i}]")
        return out
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


class Store:
    """The work folder of one output (see the module docstring).  ``state`` is the job as
    this run describes it: ``{"job": arguments, "model": ..., "inputs": [fingerprints]}``."""

    def __init__(self, output: str, state: dict, overwrite: bool = False):
        self.output = output
        self.format = output_format(output)
        self.work = output + WORK_SUFFIX
        self.state = {"version": STATE_VERSION, **state}
        self.overwrite = overwrite

    # -- opening ---------------------------------------------------------------------------
    def open(self) -> list:
        """Make the work folder ready; return the infos of the parts already complete (empty
        for a new job), in order.  Refuses (``JobMismatch``, ``ValueError``) an output that
        exists without a job in progress, or a job in progress that is not this one."""
        if self.overwrite:
            shutil.rmtree(self.work, ignore_errors=True)
            if os.path.exists(self.output):
                os.remove(self.output)
        parent = os.path.dirname(os.path.abspath(self.output))
        if not os.path.isdir(parent):
            raise ValueError(f"-o {self.output}: no such folder {parent}")
        state_path = os.path.join(self.work, STATE_FILE)
        if not os.path.exists(state_path):
            if os.path.exists(self.output):
                raise ValueError(f"{self.output} exists (a finished job); pass --overwrite to "
                                 f"replace it")
            shutil.rmtree(self.work, ignore_errors=True)  # a folder left before its state
            os.makedirs(self.work)
            self._write_atomic(state_path, json.dumps(self.state, indent=1, sort_keys=True)
                               .encode())
            return []
        with open(state_path, encoding="utf-8") as f:
            try:
                old = json.load(f)
            except ValueError:
                old = {}
        diffs = _differences(old, self.state)
        if diffs:
            done = len(self._complete_parts())
            what = ("the input changed" if any(d.startswith("inputs") for d in diffs) else
                    "the model changed" if any(d.startswith("model") for d in diffs) else
                    "the arguments differ")
            raise JobMismatch(
                f"{self.work} holds an unfinished job ({done} row groups done) that is not this "
                f"one: {what} ({'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}). "
                f"Rerun the job with its own arguments and input to finish it, or pass "
                f"--overwrite to discard it and start over")
        return self._complete_parts()

    def _complete_parts(self) -> list:
        """Infos of parts 0, 1, ... up to the first missing or unreadable one; anything after
        that (and temporary files) is removed: it is recomputed."""
        import pyarrow.parquet as pq

        infos = []
        names = sorted(os.listdir(self.work))
        k = 0
        while True:
            path = os.path.join(self.work, PART_NAME.format(k))
            if not os.path.exists(path):
                break
            try:
                meta = pq.read_metadata(path).metadata or {}
                infos.append(json.loads(meta[PART_INFO_KEY]))
            except (OSError, KeyError, ValueError):
                break
            k += 1
        keep = {PART_NAME.format(i) for i in range(k)} | {STATE_FILE}
        for name in names:
            if name not in keep:
                os.remove(os.path.join(self.work, name))
        return infos

    # -- writing ---------------------------------------------------------------------------
    def _write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    def write_part(self, k: int, table: Any, info: dict) -> None:
        """Write row group ``k`` (an Arrow table) with its ``info``, atomically."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = table.replace_schema_metadata({PART_INFO_KEY: json.dumps(info, sort_keys=True)})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **_writer_options(table.schema))
        self._write_atomic(os.path.join(self.work, PART_NAME.format(k)),
                           sink.getvalue().to_pybytes())

    def part_count(self) -> int:
        return sum(1 for n in os.listdir(self.work) if n.startswith("part-")
                   and n.endswith(".parquet"))

    def assemble(self, n_parts: int, schema: Any, job_meta: dict) -> int:
        """Copy parts ``0..n_parts-1`` into the output, one row group each, then remove the work
        folder.  Returns the rows written."""
        import pyarrow.parquet as pq

        tmp = f"{self.output}.tmp-{os.getpid()}"
        meta = {JOB_KEY: json.dumps(job_meta, sort_keys=True)}
        schema = schema.with_metadata(meta)
        rows = 0
        paths = [os.path.join(self.work, PART_NAME.format(k)) for k in range(n_parts)]
        try:
            if self.format == "parquet":
                with pq.ParquetWriter(tmp, schema, **_writer_options(schema)) as w:
                    for p in paths:
                        t = pq.read_table(p).replace_schema_metadata(meta)
                        if t.num_rows:
                            w.write_table(t, row_group_size=t.num_rows)
                            rows += t.num_rows
            else:
                rows = self._assemble_npy(tmp, paths, schema)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.output)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        _fsync_dir(os.path.dirname(os.path.abspath(self.output)))
        shutil.rmtree(self.work, ignore_errors=True)
        return rows

    def _assemble_npy(self, tmp: str, paths: list, schema: Any) -> int:
        import numpy as np
        import pyarrow.parquet as pq

        dim = schema.field(EMBEDDING_COLUMN).type.list_size
        rows = sum(pq.read_metadata(p).num_rows for p in paths)
        with open(tmp, "wb") as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
            for p in paths:
                col = pq.read_table(p, columns=[EMBEDDING_COLUMN]).column(EMBEDDING_COLUMN)
                for chunk in col.chunks:
                    values = chunk.values.to_numpy(zero_copy_only=False)
                    f.write(values.astype("<f4", copy=False).tobytes())
        return rows


def _writer_options(schema: Any) -> dict:
    """Parquet settings of parts and output alike: the vectors without dictionary or
    statistics (neither helps random floats), everything else with them."""
    other = [n for n in schema.names if n != EMBEDDING_COLUMN]
    return {"compression": COMPRESSION, "use_dictionary": other or False,
            "write_statistics": other or False}


def output_schema(dim: int, id_name: Optional[str], id_type: Any, keep: tuple,
                  keep_types: Optional[dict]) -> Any:
    """The Arrow schema of parts and output: the id (or row number), the vector as a
    fixed-size list of float32, the kept columns."""
    import pyarrow as pa

    fields = [pa.field(id_name or ROW_COLUMN, id_type if id_name else pa.int64()),
              pa.field(EMBEDDING_COLUMN, pa.list_(pa.float32(), dim))]
    for k in keep:
        fields.append(pa.field(k, (keep_types or {}).get(k, pa.string())))
    return pa.schema(fields)

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
rows (``local.py``), so a part computed again after a kill has the same bytes.  A Parquet
output is written as the job goes: each part, once saved, is also appended (one row group) to
``OUTPUT_TMP`` in the work folder, the parts of an earlier run copied in first, so the end of a
job only closes that file, flushes it and renames it to ``OUTPUT`` (rewriting every part after
the last batch left both cores idle for ~0.1 s per 4,096 rows); a ``.npy`` output, whose
header needs the row count, is assembled from the parts at the end.  Then the work folder is
removed.  The output's bytes therefore do not depend on where, or how often, the job was
interrupted.

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
#: the Parquet output while the job runs (in the work folder: a killed job leaves nothing
#: beside the output, and the next run removes it with the other leftovers)
OUTPUT_TMP = "output.tmp"
#: the ids of a ``.npy`` output while it is written (see :func:`ids_path`)
IDS_TMP = "ids.tmp"
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
        #: the streamed Parquet output (see the module docstring) and the parts it holds
        self._writer: Any = None
        self._appended = 0
        self._meta: dict = {}

    # -- opening ---------------------------------------------------------------------------
    def open(self) -> list:
        """Make the work folder ready; return the infos of the parts already complete (empty
        for a new job), in order.  Refuses (``JobMismatch``, ``ValueError``) an output that
        exists without a job in progress, or a job in progress that is not this one."""
        if self.overwrite:
            shutil.rmtree(self.work, ignore_errors=True)
            for path in (self.output, ids_path(self.output)):
                if path and os.path.exists(path):
                    os.remove(path)
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

    def append_output(self, k: int, table: Any, schema: Any, job_meta: dict) -> None:
        """Append part ``k`` (saved already; ``table`` is its rows) to the streamed Parquet
        output, after the parts before it (an earlier run's are read back from their files).
        A ``.npy`` output is left to :meth:`assemble`."""
        if self.format != "parquet":
            return
        self._catch_up(k, schema, job_meta)
        self._write_rows(table)
        self._appended = k + 1

    def _catch_up(self, n_parts: int, schema: Any, job_meta: dict) -> None:
        """Open the streamed output if needed and copy parts ``_appended..n_parts-1`` into it
        from their files."""
        import pyarrow.parquet as pq

        if self._writer is None:
            self._meta = {JOB_KEY: json.dumps(job_meta, sort_keys=True)}
            self._writer = pq.ParquetWriter(os.path.join(self.work, OUTPUT_TMP),
                                            schema.with_metadata(self._meta),
                                            **_writer_options(schema))
        while self._appended < n_parts:
            self._write_rows(pq.read_table(os.path.join(self.work,
                                                        PART_NAME.format(self._appended))))
            self._appended += 1

    def _write_rows(self, table: Any) -> None:
        if table.num_rows:
            table = table.replace_schema_metadata(self._meta)
            self._writer.write_table(table, row_group_size=table.num_rows)

    def assemble(self, n_parts: int, schema: Any, job_meta: dict) -> int:
        """Finish the output with parts ``0..n_parts-1`` (Parquet: the streamed file, closed
        and renamed; ``.npy``: written from the parts now), then remove the work folder.
        Returns the rows written."""
        import pyarrow.parquet as pq

        if self.format == "parquet":
            self._catch_up(n_parts, schema, job_meta)
            self._writer.close()
            self._writer = None
            tmp = os.path.join(self.work, OUTPUT_TMP)
            rows = int(pq.read_metadata(tmp).num_rows)
        else:
            tmp = os.path.join(self.work, OUTPUT_TMP)
            paths = [os.path.join(self.work, PART_NAME.format(k)) for k in range(n_parts)]
            rows = self._assemble_npy(tmp, paths, schema)
            ids_tmp = os.path.join(self.work, IDS_TMP)
            _write_ids_npy(ids_tmp, paths, schema.field(0).name, rows)
            with open(ids_tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(ids_tmp, ids_path(self.output))  # before the vectors: see ids_path
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.output)
        _fsync_dir(os.path.dirname(os.path.abspath(self.output)))
        shutil.rmtree(self.work, ignore_errors=True)
        return rows

    def abandon(self) -> None:
        """Close the streamed output without finishing it (an interrupted job: the next run
        removes the file and writes it again)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - the file is discarded anyway
                pass
            self._writer = None

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


def ids_path(output: str) -> str:
    """The ids beside a ``.npy`` output: ``VECS.npy`` -> ``VECS.ids.npy``, row ``i`` the id of
    vector ``i`` (the ``--id-field`` values, else the input row numbers: skipped rows leave
    gaps), so the vectors can be matched to their texts.  '' for a Parquet output (its id
    column is in the file).  Renamed into place before the vectors, so a finished output always
    has its ids."""
    base, ext = os.path.splitext(output)
    return base + ".ids.npy" if OUTPUT_FORMATS.get(ext.lower()) == "npy" else ""


def _write_ids_npy(path: str, parts: list, column: str, rows: int) -> None:
    """The id column of ``parts`` as one 1-D ``.npy`` (streamed: one part in memory at a
    time): int64 for integer ids and row numbers, float64 for floats, else fixed-width unicode
    (``<U`` of the longest id: a first pass finds it), so ``np.load`` needs no pickle."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    def column_of(p: str) -> Any:
        return pq.read_table(p, columns=[column]).column(column)

    typ = pq.read_schema(parts[0]).field(column).type if parts else pa.int64()
    if pa.types.is_integer(typ):
        descr = "<i8"
    elif pa.types.is_floating(typ):
        descr = "<f8"
    else:
        width = 1
        for p in parts:
            lengths = pc.utf8_length(pc.cast(column_of(p), pa.string()))
            width = max(width, int(pc.max(lengths).as_py() or 0))
        descr = f"<U{width}"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": descr, "fortran_order": False, "shape": (rows,)})
        for p in parts:
            col = column_of(p)
            if descr == "<i8" or descr == "<f8":
                values = col.to_numpy().astype(descr, copy=False)
            else:
                values = np.asarray(pc.cast(col, pa.string()).to_pylist(), dtype=descr)
            f.write(values.tobytes())


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

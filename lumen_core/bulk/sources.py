"""A bulk job's input: files (or stdin) read as one stream of rows in input order.

A row is ``(where, text, bad, rid, keep)``: ``where`` its place for the report
(``FILE:LINE``, or ``FILE:row N`` for Parquet), ``text`` the text to embed (None for a bad
row), ``bad`` why it cannot be embedded (None for a good row), ``rid`` the value of
``--id-field`` (None without one: the row number is the id), ``keep`` the ``--keep`` values.

Formats (by extension, ``--format`` overrides; stdin is sniffed: ``{`` first means JSONL):

- JSONL: one JSON object a line, the text in ``--field``; blank lines are not rows;
- CSV / TSV: a header line naming the columns, ``--field`` one of them;
- Parquet: ``--field`` a string column, read a record batch at a time;
- text: one text a line (UTF-8), a blank line is an empty (bad) row.

Everything streams: a reader holds one line (one record batch for Parquet) at a time, so the
memory of a job does not grow with its input.  Values of ``--id-field`` and ``--keep`` from
JSONL and CSV are written as strings (a JSON value that is not a string as its JSON text);
from Parquet they keep the column's type.

An input file is fingerprinted (:func:`fingerprint`: size, mtime and hashes of its first and
last MiB) so that a resumed job notices a changed input; what was already embedded is also
checked row by row against a running hash (the job's), which covers stdin too.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator, Optional, Sequence

FORMATS = ("jsonl", "csv", "tsv", "parquet", "text")
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
              ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet",
              ".txt": "text", ".text": "text"}
STDIN = "-"
#: bytes hashed at each end of an input file for its fingerprint
FINGERPRINT_BYTES = 1 << 20
#: rows of a Parquet record batch read at a time
PARQUET_BATCH_ROWS = 4096
#: the largest CSV field (a text) the reader takes
CSV_FIELD_LIMIT = (1 << 31) - 1


@dataclass(frozen=True)
class InputSpec:
    """Which columns to read: the text (``field``), the id (``id_field``, None: the row number)
    and the columns carried over (``keep``); ``fmt`` overrides the format of every input."""

    field: str = "text"
    id_field: Optional[str] = None
    keep: tuple = ()
    fmt: Optional[str] = None


def format_of(path: str, spec: InputSpec) -> str:
    """The format of input ``path`` (``--format``, else its extension; stdin is sniffed)."""
    if spec.fmt:
        return spec.fmt
    if path == STDIN:
        return "stdin"
    ext = os.path.splitext(path)[1].lower()
    if ext == ".gz":
        raise ValueError(f"{path}: compressed input is not read; decompress it to stdin "
                         f"(`zcat {path} | lumen embed - ...`)")
    return EXTENSIONS.get(ext, "text")


def fingerprint(path: str) -> dict:
    """What identifies an input file for resume: absolute path, size, mtime and SHA-256 of its
    first and last ``FINGERPRINT_BYTES`` (stdin: just ``-``; its rows are checked by hash)."""
    if path == STDIN:
        return {"path": STDIN}
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(FINGERPRINT_BYTES)).hexdigest()
        f.seek(max(0, st.st_size - FINGERPRINT_BYTES))
        tail = hashlib.sha256(f.read(FINGERPRINT_BYTES)).hexdigest()
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_sha256": head, "tail_sha256": tail}


def text_or_reason(value: Any) -> tuple:
    """``(text, None)`` for a usable text, else ``(None, why not)``."""
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        return None, f"not text ({kind})"
    if not value.strip():
        return None, "empty text"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None, "not valid UTF-8 text (unpaired surrogates)"
    return value, None


def _plain(value: Any) -> Optional[str]:
    """A JSON value as the string written for ``--id-field`` / ``--keep`` (None stays None)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


class _Counting(io.RawIOBase):
    """A binary file that counts the bytes read from it (the progress estimate)."""

    def __init__(self, f: BinaryIO, counter: "Inputs"):
        self._f = f
        self._counter = counter

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)  # type: ignore[attr-defined]
        if n:
            self._counter.bytes_read += n
        return n or 0


@dataclass
class Inputs:
    """The job's inputs as one row stream (:meth:`rows`), with what progress needs: the total
    size of the files (``total_bytes``, None when a stdin is among them), the bytes read so far
    and, for Parquet, the row counts known up front."""

    paths: Sequence[str]
    spec: InputSpec
    formats: list = field(default_factory=list)
    total_bytes: Optional[int] = 0
    bytes_read: int = 0
    #: per input its fingerprint (:func:`fingerprint`)
    fingerprints: list = field(default_factory=list)
    #: Arrow types of the id and keep columns when the first input is Parquet, else None
    column_types: Optional[dict] = None
    stdin: Optional[BinaryIO] = None

    def fraction(self) -> Optional[float]:
        """Share of the input read so far (None when it cannot be known: stdin)."""
        if not self.total_bytes:
            return None
        return min(1.0, self.bytes_read / self.total_bytes)

    def rows(self) -> Iterator[tuple]:
        for path, fmt in zip(self.paths, self.formats, strict=True):
            yield from self._rows_of(path, fmt)

    def _rows_of(self, path: str, fmt: str) -> Iterator[tuple]:
        if fmt == "parquet":
            yield from self._parquet(path)
            return
        if path == STDIN:
            f: BinaryIO = self.stdin or sys.stdin.buffer
            name = "<stdin>"
        else:
            name = path
            f = open(path, "rb")  # noqa: SIM115 - closed below
        try:
            counted = io.BufferedReader(_Counting(f, self))
            if fmt == "stdin":
                fmt = _sniff(counted)
            if fmt == "jsonl":
                yield from self._jsonl(counted, name)
            elif fmt in ("csv", "tsv"):
                yield from self._csv(counted, name, "\t" if fmt == "tsv" else ",")
            else:
                yield from self._text(counted, name)
        finally:
            if path != STDIN:
                f.close()

    def _jsonl(self, f: BinaryIO, name: str) -> Iterator[tuple]:
        spec = self.spec
        fld, idf, keep = spec.field, spec.id_field, spec.keep
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{name}:{ln}"
            try:
                obj = json.loads(line)
            except ValueError as exc:  # UnicodeDecodeError is a ValueError too
                yield where, None, f"not JSON ({exc})", None, ()
                continue
            if not isinstance(obj, dict):
                yield where, None, f"not a JSON object ({type(obj).__name__})", None, ()
                continue
            rid = None
            if idf is not None:
                rid = _plain(obj.get(idf))
                if rid is None:
                    yield where, None, f"no id (field {idf!r})", None, ()
                    continue
            kept = tuple(_plain(obj.get(k)) for k in keep)
            if fld not in obj:
                yield where, None, f"no field {fld!r}", rid, kept
                continue
            text, bad = text_or_reason(obj[fld])
            yield where, text, bad, rid, kept

    def _csv(self, f: BinaryIO, name: str, delimiter: str) -> Iterator[tuple]:
        csv.field_size_limit(CSV_FIELD_LIMIT)
        spec = self.spec
        text_io = io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape", newline="")
        reader = csv.reader(text_io, delimiter=delimiter)
        header = next(reader, None)
        if header is None:
            return
        if header and header[0].startswith("\ufeff"):
            header[0] = header[0][1:]
        wanted = [spec.field] + ([spec.id_field] if spec.id_field else []) + list(spec.keep)
        missing = [c for c in wanted if c not in header]
        if missing:
            raise ValueError(f"{name}: no column {', '.join(map(repr, missing))} in the header "
                             f"(columns: {', '.join(header)}); name the text column with --field")
        ti = header.index(spec.field)
        ii = header.index(spec.id_field) if spec.id_field else -1
        ki = [header.index(k) for k in spec.keep]
        width = len(header)
        for rec in reader:
            where = f"{name}:{reader.line_num}"
            if not rec:
                continue
            if len(rec) != width:
                yield where, None, f"{len(rec)} fields, the header has {width}", None, ()
                continue
            rid = rec[ii] if ii >= 0 else None
            text, bad = text_or_reason(rec[ti])
            yield where, text, bad, rid, tuple(rec[k] for k in ki)

    def _text(self, f: BinaryIO, name: str) -> Iterator[tuple]:
        for ln, line in enumerate(f, 1):
            where = f"{name}:{ln}"
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            try:
                s = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, None, f"not valid UTF-8 (byte {exc.start})", None, ()
                continue
            text, bad = text_or_reason(s)
            yield where, text, bad, None, ()

    def _parquet(self, path: str) -> Iterator[tuple]:
        import pyarrow.parquet as pq

        spec = self.spec
        pf = pq.ParquetFile(path)
        cols = [spec.field] + ([spec.id_field] if spec.id_field else []) + list(spec.keep)
        size = os.path.getsize(path)
        rows = max(1, pf.metadata.num_rows)
        base = self.bytes_read
        n = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=cols):
            texts = batch.column(0).to_pylist()
            ids = batch.column(1).to_pylist() if spec.id_field else None
            kept = [batch.column(c).to_pylist() for c in spec.keep]
            for j, value in enumerate(texts):
                where = f"{path}:row {n + j}"
                rid = ids[j] if ids is not None else None
                if ids is not None and rid is None:
                    yield where, None, f"no id (column {spec.id_field!r} is null)", None, ()
                    continue
                text, bad = text_or_reason(value)
                yield where, text, bad, rid, tuple(k[j] for k in kept)
            n += len(texts)
            self.bytes_read = base + size * n // rows


def _sniff(f: Any) -> str:
    """stdin's format: JSONL when its first non-blank byte is ``{``, else text."""
    head = f.peek(64)
    return "jsonl" if head.lstrip()[:1] == b"{" else "text"


def _parquet_columns(path: str, spec: InputSpec) -> dict:
    """Arrow types of the id and keep columns of a Parquet input; a missing or non-text
    ``--field`` column is refused here, before any work."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    names = schema.names
    wanted = [spec.field] + ([spec.id_field] if spec.id_field else []) + list(spec.keep)
    missing = [c for c in wanted if c not in names]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(map(repr, missing))} (columns: "
                         f"{', '.join(names)}); name the text column with --field")
    ttype = schema.field(spec.field).type
    if not (pa.types.is_string(ttype) or pa.types.is_large_string(ttype)
            or getattr(pa.types, "is_string_view", lambda t: False)(ttype)):
        raise ValueError(f"{path}: column {spec.field!r} is {ttype}, not text (string); name "
                         f"the text column with --field")
    return {c: schema.field(c).type for c in wanted[1:]}


def open_inputs(paths: Sequence[str], spec: InputSpec, stdin: Optional[BinaryIO] = None) -> Inputs:
    """The inputs ``paths`` (``-``: stdin, at most once) checked up front: each exists, has a
    known format, Parquet columns exist and hold text; fingerprinted for resume."""
    if not paths:
        raise ValueError("no input: name one or more files, or - for stdin")
    if list(paths).count(STDIN) > 1:
        raise ValueError("stdin (-) can be named once")
    if spec.fmt is not None and spec.fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {spec.fmt!r}")
    formats = [format_of(p, spec) for p in paths]
    total: Optional[int] = 0
    column_types: Optional[dict] = None
    for i, (p, fmt) in enumerate(zip(paths, formats, strict=True)):
        if p == STDIN:
            if fmt == "parquet":
                raise ValueError("Parquet cannot be read from stdin (it is read from its end); "
                                 "name the file")
            total = None
            continue
        if not os.path.isfile(p):
            raise ValueError(f"{p}: no such file")
        if total is not None:
            total += os.path.getsize(p)
        if fmt == "parquet":
            types = _parquet_columns(p, spec)
            if i == 0:
                column_types = types
            elif column_types is not None and types != column_types:
                raise ValueError(f"{p}: its id / keep columns have other types than "
                                 f"{paths[0]}'s ({types} vs {column_types})")
    return Inputs(list(paths), spec, formats, total, 0,
                  [fingerprint(p) for p in paths], column_types, stdin)

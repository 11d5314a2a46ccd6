"""The bulk job's store: the Parquet output written as parts are saved (no rewrite of every
part after the last batch), an earlier run's parts copied in first on resume, the same bytes
either way, and an interrupted run's unfinished output kept inside the work folder only."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lumen_core.bulk import store as ST

DIM = 4
STATE = {"job": {"rows": 3}, "model": {}, "inputs": []}


def _part(k: int, n: int) -> pa.Table:
    """Part ``k``: ``n`` rows with string ids and distinct vectors."""
    rng = np.random.default_rng(k)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    ids = pa.array([f"p{k}-{i}" for i in range(n)], pa.string())
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1), pa.float32()), DIM)
    return pa.Table.from_arrays([ids, emb], schema=_schema())


def _schema() -> pa.Schema:
    return ST.output_schema(DIM, "id", pa.string(), (), None)


def _save(store: ST.Store, k: int, table: pa.Table) -> None:
    store.write_part(k, table, {"rows_in": table.num_rows, "k": k})
    store.append_output(k, table, _schema(), {"job": 1})


def _new(path) -> ST.Store:
    store = ST.Store(str(path), STATE)
    store.open()
    return store


def _interrupted(path, parts: list) -> None:
    """A run that saved ``parts`` and was interrupted before its output was finished."""
    first = _new(path)
    for k, p in enumerate(parts):
        _save(first, k, p)
    first.abandon()


def test_streamed_output_equals_the_parts_in_order(tmp_path):
    parts = [_part(0, 5), _part(1, 0), _part(2, 7)]  # an empty part adds no row group
    store = _new(tmp_path / "o.parquet")
    _save(store, 0, parts[0])
    tmp = tmp_path / ("o.parquet" + ST.WORK_SUFFIX) / ST.OUTPUT_TMP
    assert tmp.exists() and not (tmp_path / "o.parquet").exists()  # written as it goes
    _save(store, 1, parts[1])
    _save(store, 2, parts[2])
    assert store.assemble(3, _schema(), {"job": 1}) == 12
    f = pq.ParquetFile(tmp_path / "o.parquet")
    assert f.metadata.num_row_groups == 2
    got = f.read()
    assert got.column("id").to_pylist() == sum((p.column("id").to_pylist() for p in parts), [])
    assert got.column("embedding").to_pylist() == sum(
        (p.column("embedding").to_pylist() for p in parts), [])
    assert f.schema_arrow.metadata[ST.JOB_KEY] == b'{"job": 1}'
    assert not (tmp_path / ("o.parquet" + ST.WORK_SUFFIX)).exists()


def test_a_resumed_run_copies_the_saved_parts_first_and_gives_the_same_bytes(tmp_path):
    parts = [_part(0, 5), _part(1, 3), _part(2, 6), _part(3, 2)]
    whole = _new(tmp_path / "whole.parquet")
    for k, p in enumerate(parts):
        _save(whole, k, p)
    whole.assemble(len(parts), _schema(), {"job": 1})

    _interrupted(tmp_path / "cut.parquet", parts[:2])
    # the unfinished output stays inside the work folder
    assert sorted(os.listdir(tmp_path)) == ["cut.parquet.lumen-embed", "whole.parquet"]
    work = tmp_path / ("cut.parquet" + ST.WORK_SUFFIX)
    assert (work / ST.OUTPUT_TMP).exists()

    again = ST.Store(str(tmp_path / "cut.parquet"), STATE)
    done = again.open()
    assert [d["k"] for d in done] == [0, 1]
    assert not (work / ST.OUTPUT_TMP).exists()  # a leftover: removed, written again
    _save(again, 2, parts[2])  # parts 0 and 1 are read back from their files first
    _save(again, 3, parts[3])
    again.assemble(len(parts), _schema(), {"job": 1})
    assert (tmp_path / "cut.parquet").read_bytes() == (tmp_path / "whole.parquet").read_bytes()


def test_a_run_with_nothing_left_to_embed_assembles_the_saved_parts(tmp_path):
    """Killed after its last part but before the output was renamed: the rerun only copies."""
    _interrupted(tmp_path / "o.parquet", [_part(0, 4), _part(1, 4)])
    again = ST.Store(str(tmp_path / "o.parquet"), STATE)
    assert len(again.open()) == 2
    assert again.assemble(2, _schema(), {"job": 1}) == 8
    got = pq.read_table(tmp_path / "o.parquet")
    assert got.column("id").to_pylist() == [f"p{k}-{i}" for k in range(2) for i in range(4)]


def test_npy_output_is_assembled_at_the_end_with_its_ids(tmp_path):
    parts = [_part(0, 3), _part(1, 2)]
    store = _new(tmp_path / "o.npy")
    for k, p in enumerate(parts):
        _save(store, k, p)
        assert not (tmp_path / ("o.npy" + ST.WORK_SUFFIX) / ST.OUTPUT_TMP).exists()
    assert store.assemble(2, _schema(), {"job": 1}) == 5
    arr = np.load(tmp_path / "o.npy")
    want = np.concatenate([np.asarray(p.column("embedding").to_pylist(), np.float32)
                           for p in parts])
    assert arr.dtype == np.float32 and np.array_equal(arr, want)
    ids = np.load(tmp_path / "o.ids.npy")
    assert ids.tolist() == ["p0-0", "p0-1", "p0-2", "p1-0", "p1-1"]


def test_npy_ids_keep_integer_ids_as_int64(tmp_path):
    schema = ST.output_schema(DIM, "key", pa.int32(), (), None)
    store = ST.Store(str(tmp_path / "v.npy"), STATE)
    store.open()
    for k, keys in enumerate(([7, 3, 9], [], [1])):
        vecs = np.zeros((len(keys), DIM), np.float32)
        t = pa.Table.from_arrays([pa.array(keys, pa.int32()), pa.FixedSizeListArray.from_arrays(
            pa.array(vecs.reshape(-1), pa.float32()), DIM)], schema=schema)
        store.write_part(k, t, {"k": k})
        store.append_output(k, t, schema, {})
    assert store.assemble(3, schema, {}) == 4
    ids = np.load(tmp_path / "v.ids.npy")
    assert ids.dtype == np.int64 and ids.tolist() == [7, 3, 9, 1]
    assert ST.ids_path(str(tmp_path / "v.parquet")) == ""

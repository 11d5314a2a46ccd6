"""``lumen embed`` in process: rows equal ``rt.infer`` in input order, every input format, ids
and kept columns, bad rows, options, ``.npy``, and the refusals of a job that is not the one
in progress.  (Resume after kills: test_embed_resume.py; --url: test_embed_remote.py.)"""
from __future__ import annotations

import csv
import io
import json
import random
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from embed_support import home_fixture, run_embed, short_texts, tiny_fixture, write_jsonl  # noqa: F401 - the fixtures (home, tiny)

import lumen_core as lc

#: rows of the equality test: the distinct texts repeated, shuffled, each with an id
ROWS = 2000


def reference(task: str, texts: list, meta: dict | None = None) -> dict:
    """``{text: vector}`` from ``rt.infer`` (the request path, one request per text)."""
    rt = lc.Runtime.default(only=task)
    with rt:
        reqs = []
        for t in texts:
            r = rt.text_request(task, t)
            if meta:
                r.meta = dict(meta)
            reqs.append(r)
        out = rt.infer_many_sync(reqs)
    return {t: r.outputs["embedding"].copy() for t, r in zip(texts, out, strict=True)}


def vectors(table: pa.Table) -> np.ndarray:
    col = table.column("embedding").combine_chunks()
    return col.values.to_numpy().reshape(len(table), col.type.list_size)


def corpus_rows(n: int, seed: int = 7) -> list:
    texts = short_texts()
    rng = random.Random(seed)
    return [{"id": f"doc-{i}", "text": rng.choice(texts)} for i in range(n)]


@pytest.mark.parametrize("task,n", [("text_embed", ROWS), ("text_embed_int8", 400)])
def test_rows_equal_rt_infer_in_input_order(home, tmp_path, capsys, task, n):
    rows = corpus_rows(n)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    rc, err = run_embed(capsys, src, "-o", out, "--task", task, "--id-field", "id",
                        "--row-group-size", 512)
    assert rc == 0, err
    t = pq.read_table(out)
    assert t.column("id").to_pylist() == [r["id"] for r in rows]
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    ref = reference(task, sorted({r["text"] for r in rows}))
    got = vectors(t)
    want = np.stack([ref[r["text"]] for r in rows])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, cos.min()
    assert pq.ParquetFile(out).metadata.num_row_groups == -(-n // 512)
    assert f"done: {n:,} rows" in err and "rows/s" in err and "tokens/s" in err
    assert not (tmp_path / "out.parquet.lumen-embed").exists()


def _write_all_formats(tmp_path, texts: list) -> dict:
    paths = {"jsonl": write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])}
    for name, delim in (("csv", ","), ("tsv", "\t")):
        p = tmp_path / f"a.{name}"
        with open(p, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, delimiter=delim)
            w.writerow(["n", "text"])
            w.writerows([i, t] for i, t in enumerate(texts))
        paths[name] = p
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet", row_group_size=37)
    paths["parquet"] = tmp_path / "a.parquet"
    (tmp_path / "a.txt").write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    paths["text"] = tmp_path / "a.txt"
    return paths


def test_every_input_format_embeds_the_same_rows(tiny, tmp_path, capsys, monkeypatch):
    texts = short_texts(60) * 5  # 300 rows, some with commas and quotes in CSV
    texts[3] = 'a "quoted", comma text'
    texts[4] = "ünïcödé text ✓"
    paths = _write_all_formats(tmp_path, texts)
    tables = {}
    for fmt, p in paths.items():
        out = tmp_path / f"{fmt}.parquet"
        rc, err = run_embed(capsys, p, "-o", out, "--config", tiny, "--task", "tiny",
                            "--row-group-size", 64)
        assert rc == 0, (fmt, err)
        tables[fmt] = pq.read_table(out)
    for source in ("jsonl", "text"):  # stdin, sniffed: JSONL, then plain text
        data = paths[source].read_bytes()
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        out = tmp_path / f"stdin-{source}.parquet"
        rc, err = run_embed(capsys, "-", "-o", out, "--config", tiny, "--task", "tiny",
                            "--row-group-size", 64)
        assert rc == 0, err
        tables[f"stdin-{source}"] = pq.read_table(out)
    first = tables["jsonl"]
    assert first.column("row").to_pylist() == list(range(300))
    for fmt, t in tables.items():
        assert t.equals(first), fmt


def test_ids_and_kept_columns_keep_their_parquet_types(tiny, tmp_path, capsys):
    texts = short_texts(50)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"doc": pa.array(range(1000, 1050), pa.int32()), "body": texts,
                             "lang": ["en"] * 50, "score": np.linspace(0, 1, 50)}), src)
    out = tmp_path / "out.parquet"
    rc, err = run_embed(capsys, src, "-o", out, "--config", tiny, "--task", "tiny",
                        "--field", "body", "--id-field", "doc", "--keep", "lang,score")
    assert rc == 0, err
    t = pq.read_table(out)
    assert t.schema.names == ["doc", "embedding", "lang", "score"]
    assert t.schema.field("doc").type == pa.int32()
    assert t.schema.field("score").type == pa.float64()
    assert t.column("doc").to_pylist() == list(range(1000, 1050))
    assert t.column("lang").to_pylist() == ["en"] * 50
    job = json.loads(pq.read_schema(out).metadata[b"lumen.embed"])
    assert job["task"] == "tiny" and job["dimensions"] == 384


def test_bad_rows_are_reported_with_their_lines_and_skipped(tiny, tmp_path, capsys):
    good = short_texts(20)
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(good)]
    bad = {3: json.dumps({"id": "e", "text": "   "}), 6: json.dumps({"id": "n", "text": 5}),
           9: json.dumps({"id": "m", "body": "x"}), 12: "{not json",
           15: json.dumps({"id": "l", "text": "word " * 400}), 18: json.dumps(["a"])}
    for pos, line in sorted(bad.items()):
        lines.insert(pos, line)
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.parquet"
    rc, err = run_embed(capsys, src, "-o", out, "--config", tiny, "--task", "tiny",
                        "--id-field", "id", "--no-truncate", "--row-group-size", 8)
    assert rc == 0, err
    for pos, why in ((4, "empty text"), (7, "not text (int)"), (10, "no field 'text'"),
                     (13, "not JSON"), (16, "too_large"), (19, "not a JSON object")):
        assert f"in.jsonl:{pos}: skipped: " in err and why in err.split(f"in.jsonl:{pos}: ")[1]
    t = pq.read_table(out)
    assert t.column("id").to_pylist() == [str(i) for i in range(20)]
    assert "6 bad rows skipped" in err


def test_on_bad_row_fail_stops_at_the_first_and_keeps_what_was_done(tiny, tmp_path, capsys):
    texts = short_texts(40)
    lines = [json.dumps({"text": t}) for t in texts]
    lines[25] = json.dumps({"text": ""})
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.parquet"
    rc, err = run_embed(capsys, src, "-o", out, "--config", tiny, "--task", "tiny",
                        "--on-bad-row", "fail", "--row-group-size", 10)
    assert rc == 2
    assert "in.jsonl:26: bad row: empty text" in err
    assert not out.exists()
    work = tmp_path / "out.parquet.lumen-embed"
    assert sorted(p.name for p in work.glob("part-*")) == ["part-000000.parquet",
                                                           "part-000001.parquet"]
    # the input fixed: a changed input is refused, --overwrite starts over
    lines[25] = json.dumps({"text": "fixed"})
    write_jsonl(src, lines)
    rc, err = run_embed(capsys, src, "-o", out, "--config", tiny, "--task", "tiny",
                        "--on-bad-row", "fail", "--row-group-size", 10)
    assert rc == 2 and "the input changed" in err and "--overwrite" in err
    rc, err = run_embed(capsys, src, "-o", out, "--config", tiny, "--task", "tiny",
                        "--on-bad-row", "fail", "--row-group-size", 10, "--overwrite")
    assert rc == 0, err
    assert pq.read_metadata(out).num_rows == 40


def test_other_arguments_are_refused_while_a_job_is_unfinished(tiny, tmp_path, capsys):
    lines = [json.dumps({"text": t}) for t in short_texts(30)] + ['{"text": ""}']
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.parquet"
    args = [src, "-o", out, "--config", tiny, "--task", "tiny", "--row-group-size", 10]
    rc, _ = run_embed(capsys, *args, "--on-bad-row", "fail")
    assert rc == 2
    rc, err = run_embed(capsys, *args, "--on-bad-row", "fail", "--dimensions", 8)
    assert rc == 2 and "the arguments differ" in err and "dimensions: None -> 8" in err
    rc, err = run_embed(capsys, *args, "--on-bad-row", "fail", "--batch-tokens", 64)
    assert rc == 2 and "batching.max_tokens: 512 -> 64" in err  # other batches, other bits
    rc, err = run_embed(capsys, *args, "--on-bad-row", "skip")  # finishes after the 3 parts
    assert rc == 2 and "on_bad_row" in err


def test_stdin_changed_in_what_was_embedded_is_refused(tiny, tmp_path, capsys, monkeypatch):
    texts = short_texts(30)
    data = "".join(t + "\n" for t in texts[:25]) + "\n" + "".join(t + "\n" for t in texts[25:])
    out = tmp_path / "out.parquet"
    args = ["-", "-o", out, "--config", tiny, "--task", "tiny", "--row-group-size", 10,
            "--on-bad-row", "fail"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data.encode())))
    rc, err = run_embed(capsys, *args)
    assert rc == 2 and "<stdin>:26: bad row: empty text" in err
    changed = data.replace(texts[2], "another text")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(changed.encode())))
    rc, err = run_embed(capsys, *args)
    assert rc == 2 and "rows 0..9 differ from those embedded before" in err


def test_a_finished_output_is_not_replaced_without_overwrite(tiny, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in short_texts(10)])
    out = tmp_path / "out.parquet"
    args = [src, "-o", out, "--config", tiny, "--task", "tiny"]
    assert run_embed(capsys, *args)[0] == 0
    rc, err = run_embed(capsys, *args)
    assert rc == 2 and "exists" in err and "--overwrite" in err
    assert run_embed(capsys, *args, "--overwrite")[0] == 0


def test_npy_output_holds_the_parquet_vectors(tiny, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in short_texts(70)])
    for out in ("o.parquet", "o.npy"):
        rc, err = run_embed(capsys, src, "-o", tmp_path / out, "--config", tiny, "--task",
                            "tiny", "--row-group-size", 16)
        assert rc == 0, err
    arr = np.load(tmp_path / "o.npy")
    assert arr.dtype == np.float32 and arr.shape == (70, 384)
    np.testing.assert_array_equal(arr, vectors(pq.read_table(tmp_path / "o.parquet")))
    ids = np.load(tmp_path / "o.ids.npy")  # the row numbers: no --id-field
    assert ids.dtype == np.int64 and ids.tolist() == list(range(70))


def test_npy_ids_name_the_vectors_around_skipped_rows(tiny, tmp_path, capsys):
    rows = [{"id": f"doc-{i:03d}", "text": t} for i, t in enumerate(short_texts(30))]
    rows[4]["text"] = ""  # a bad row: skipped, so the ids are what places the vectors
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    for out in ("o.parquet", "o.npy"):
        rc, err = run_embed(capsys, src, "-o", tmp_path / out, "--config", tiny, "--task",
                            "tiny", "--id-field", "id", "--row-group-size", 8)
        assert rc == 0, err
    ids = np.load(tmp_path / "o.ids.npy")  # fixed-width unicode: no pickle needed
    assert ids.dtype == np.dtype("<U7")
    assert ids.tolist() == [r["id"] for i, r in enumerate(rows) if i != 4]
    t = pq.read_table(tmp_path / "o.parquet")
    assert ids.tolist() == t.column("id").to_pylist()
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), vectors(t))
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.npy", "--config", tiny, "--task",
                        "tiny", "--id-field", "id", "--row-group-size", 8)
    assert rc == 2 and "exists" in err  # a finished job: --overwrite replaces both files
    (tmp_path / "o.ids.npy").write_bytes(b"stale")
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.npy", "--config", tiny, "--task",
                        "tiny", "--id-field", "id", "--row-group-size", 8, "--overwrite")
    assert rc == 0, err
    assert np.load(tmp_path / "o.ids.npy").tolist() == ids.tolist()


def test_dimensions_equal_rt_infer_with_the_same_option(home, tmp_path, capsys):
    texts = short_texts(12)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out.parquet"
    rc, err = run_embed(capsys, src, "-o", out, "--dimensions", 64)
    assert rc == 0, err
    got = vectors(pq.read_table(out))
    ref = reference("text_embed", texts, {"lumen.embedding.dimensions": "64"})
    assert got.shape == (12, 64)
    np.testing.assert_allclose(got, np.stack([ref[t] for t in texts]), atol=1e-5)


def test_usage_errors_say_what_to_do(tiny, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.csv", "--config", tiny, "--task", "tiny")
    assert rc == 2 and ".parquet or .npy" in err
    rc, err = run_embed(capsys, tmp_path / "missing.jsonl", "-o", tmp_path / "o.parquet")
    assert rc == 2 and "no such file" in err
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.parquet", "--config", tiny, "--task",
                        "tiny", "--prompt-name", "query")
    assert rc == 2 and "takes no prompt_name" in err
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.parquet", "--config", tiny, "--task",
                        "nope")
    assert rc == 2 and "unknown task 'nope'" in err
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    rc, err = run_embed(capsys, tmp_path / "n.parquet", "-o", tmp_path / "o.parquet")
    assert rc == 2 and "is int64, not text" in err
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.parquet", "--keep", "embedding")
    assert rc == 2 and "already has that column" in err


def test_prompt_name_reaches_the_model(tmp_path, capsys):
    """``--prompt-name`` on an imported sentence-transformers folder with prompts (its default
    is ``query``): ``passage`` gives the vectors of the texts written with the prefix by hand
    (under the empty ``document`` prompt), through the backend's own preparation."""
    import serve_support as S
    from st_fixtures import ST_MODELS

    cfg = {"server": {}, "tasks": [{"name": "tiny", "backend": "text_embedding",
                                    "model": str(ST_MODELS / "mpnet-mean-prompt"),
                                    "instances": 1, "intra_op_threads": 1}]}
    (tmp_path / "prompt.toml").write_text(S.to_toml(cfg))
    texts = short_texts(40)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    pre = write_jsonl(tmp_path / "pre.jsonl", [{"text": "passage: " + t} for t in texts])
    args = ["--config", tmp_path / "prompt.toml", "--task", "tiny", "--row-group-size", 16]
    rc, err = run_embed(capsys, src, "-o", tmp_path / "p.parquet", "--prompt-name", "passage",
                        *args)
    assert rc == 0, err
    assert "per-text tokenization" in err  # the backend's own preparation applies the prompt
    rc, err = run_embed(capsys, pre, "-o", tmp_path / "q.parquet", "--prompt-name", "document",
                        *args)
    assert rc == 0, err
    p, q = (np.stack(pq.read_table(tmp_path / f"{n}.parquet").column("embedding").to_pylist())
            for n in "pq")
    np.testing.assert_allclose(p, q, atol=1e-5)
    rc, err = run_embed(capsys, src, "-o", tmp_path / "x.parquet", "--prompt-name", "nope",
                        *args)
    assert rc == 2 and "unknown prompt_name 'nope'" in err and "passage" in err, err


def test_a_task_with_several_versions_runs_every_item_on_its_head(tiny, tmp_path):
    from lumen_core.bulk.local import LocalEmbedder, bulk_runtime

    cfg = tiny.read_text()
    model = cfg.split('model = "')[1].split('"')[0]
    two = cfg.replace(f'model = "{model}"\n', "") + (
        f'[[tasks.versions]]\nversion = "1"\nmodel = "{model}"\n'
        f'[[tasks.versions]]\nversion = "2"\nmodel = "{model}"\n'
        f'[tasks.traffic]\n"1" = 1\n"2" = 1\n')
    (tmp_path / "two.toml").write_text(two)
    rt = bulk_runtime("tiny", str(tmp_path / "two.toml"))
    rt.start_background()
    try:
        emb = LocalEmbedder(rt, "tiny")
        head = rt.tasks["tiny"].version
        assert emb.meta == {"lumen.model.version": head}  # pinned: prepared where it runs
        p = emb.submit(short_texts(50)).result(60)
        emb.close()
    finally:
        rt.stop_background()
    assert not p.errors and p.vectors.any(axis=1).all()


def test_pyarrow_is_warmed_once_while_the_first_window_runs(tiny, tmp_path, capsys, monkeypatch):
    """pyarrow's one-off start-up (its first pa.array imports pandas) is paid after the first
    window is queued -- the engines busy meanwhile -- not before it nor at the job's end."""
    from lumen_core.bulk import job as J
    from lumen_core.bulk import local as L

    events: list = []
    monkeypatch.setattr(J, "warm_arrow", lambda: events.append("warm"))
    submit = L.LocalEmbedder.submit
    monkeypatch.setattr(L.LocalEmbedder, "submit",
                        lambda self, texts: events.append(len(texts)) or submit(self, texts))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in short_texts(50)])
    rc, err = run_embed(capsys, src, "-o", tmp_path / "o.parquet", "--config", tiny, "--task",
                        "tiny", "--row-group-size", 16)
    assert rc == 0, err
    assert events == [16, "warm", 16, 16, 2]

"""The loop of a bulk job: rows in, row groups embedded, parts written, the output assembled.

Row group ``k`` is input rows ``[k * R, (k + 1) * R)``: its good rows go to the embedder as one
window (``submit``), its bad rows are reported (``FILE:LINE: why``) and skipped, or stop the
job with ``--on-bad-row fail``.  Up to ``max_in_flight`` windows are out at once, so the next
window is read and prepared while the engines run the current one, and the window before is
written meanwhile: windows are committed in order, each as one part file, appended to the
output as it goes (``store.py``).  The engines' queue never runs dry between windows, so both
cores stay busy to the end; what is left after the last batch is that window's commit and the
output's close.  Memory is bounded by those windows, whatever the size of the input.

A resumed job reads the rows of the parts already written again (reading is cheap next to
embedding) and checks them against the running hash stored with each part, so an input that
changed in what was already embedded is refused even when it comes from stdin.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .progress import Progress, Summary
from .store import JobMismatch, Store

#: rows a part's info keeps of its bad rows (the count is always exact)
BAD_ROWS_KEPT = 100
#: bad rows printed one by one in a run; after that only counted (the summary has the total)
BAD_ROWS_SHOWN = 20
#: seconds between checks of a window's progress while waiting for it
WAIT_TICK_S = 0.2


class BadRow(ValueError):
    """A bad row under ``--on-bad-row fail``."""


@dataclass
class JobOptions:
    row_group_size: int = 4096
    on_bad_row: str = "skip"
    max_in_flight: int = 2


@dataclass
class _Window:
    k: int
    rows: list
    good: list  # indices into rows of the texts sent, in order
    bad: list  # (where, reason) of rows refused while reading
    pending: Any
    digest: str


def _row_bytes(row: tuple) -> bytes:
    """What the running hash covers of a row: everything but its place."""
    return repr(row[1:]).encode("utf-8", "surrogatepass") + b"\x1e"


class Job:
    """One run of a job (see the module docstring); :meth:`run` returns its :class:`Summary`."""

    def __init__(self, inputs: Any, embedder: Any, store: Store, schema: Any, done: list,
                 opts: JobOptions, progress: Progress, job_meta: dict):
        self.inputs = inputs
        self.embedder = embedder
        self.store = store
        self.schema = schema
        self.done = done
        self.opts = opts
        self.progress = progress
        self.job_meta = job_meta
        self.summary = Summary(store.output)
        self._hash = hashlib.blake2b(digest_size=16)
        self._rows_read = 0
        self._committed_rows = 0
        self._shown = 0
        self._inflight: collections.deque = collections.deque()

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> Summary:
        s = self.summary
        rows = self.inputs.rows()
        self._skip_done(rows)
        s.resumed_rows = self._rows_read
        self._committed_rows = s.resumed_rows
        self.progress.start(s.resumed_rows)
        t0 = time.monotonic()
        k = len(self.done)
        size = self.opts.row_group_size
        try:
            while True:
                group = list(itertools.islice(rows, size))
                if not group:
                    break
                self._send(k, group)
                if k == len(self.done):  # the engines run the first window meanwhile
                    warm_arrow()
                k += 1
                while self._inflight and (len(self._inflight) >= self.opts.max_in_flight
                                          or self._inflight[0].pending.done()):
                    self._commit(self._inflight.popleft())
            while self._inflight:
                self._commit(self._inflight.popleft())
        finally:
            s.seconds = time.monotonic() - t0
        self.progress.update(self._committed_rows, self._committed_rows, True, force=True)
        self.progress.finish()
        s.rows_out = self.store.assemble(k, self.schema, self.job_meta)
        s.rows_in = self._rows_read
        return s

    def _skip_done(self, rows: Iterator) -> None:
        """Read the rows of the parts already written, checking each part's running hash."""
        size = self.opts.row_group_size
        for k, info in enumerate(self.done):
            n = 0
            for row in itertools.islice(rows, info["rows_in"]):
                self._hash.update(_row_bytes(row))
                n += 1
            self._rows_read += n
            if n != info["rows_in"] or self._hash.hexdigest() != info["hash"]:
                raise JobMismatch(
                    f"the input's rows {k * size}..{k * size + info['rows_in'] - 1} differ from "
                    f"those embedded before (row group {k} of {self.store.work}): the input "
                    f"changed. Restore it to finish the job, or pass --overwrite to start over")
            self._account(info)

    def _account(self, info: dict) -> None:
        s = self.summary
        s.bad += info["bad"]
        s.truncated += info["truncated"]

    def _send(self, k: int, group: list) -> None:
        good, bad, texts = [], [], []
        update = self._hash.update
        for j, row in enumerate(group):
            update(_row_bytes(row))
            if row[2] is not None:
                bad.append((row[0], row[2]))
            else:
                good.append(j)
                texts.append(row[1])
        self._rows_read += len(group)
        if bad and self.opts.on_bad_row == "fail":
            while self._inflight:  # what was embedded before it is kept
                self._commit(self._inflight.popleft())
            self._fail(*bad[0])
        pending = self.embedder.submit(texts)
        self._inflight.append(_Window(k, group, good, bad, pending, self._hash.hexdigest()))

    def _fail(self, where: str, why: str) -> None:
        raise BadRow(f"{where}: bad row: {why} (--on-bad-row fail; the row groups before it are "
                     f"saved: fix the input and pass --overwrite, or use --on-bad-row skip)")

    def _wait(self, w: _Window) -> Any:
        while not w.pending.done():
            try:
                return w.pending.result(WAIT_TICK_S)
            except TimeoutError:
                self._show_progress()
        return w.pending.result()

    def _show_progress(self, force: bool = False) -> None:
        done = self._committed_rows + sum(getattr(w.pending, "rows_done", 0)
                                          for w in self._inflight)
        frac = self.inputs.fraction()
        exact = frac is not None and frac >= 1.0
        total = None
        if frac:
            total = self._rows_read if exact else int(self._rows_read / frac)
        self.progress.update(done, total, exact, force)

    def _commit(self, w: _Window) -> None:
        res = self._wait(w)
        bad = list(w.bad)
        keep = []
        for t, j in enumerate(w.good):
            why = res.errors.get(t)
            if why is None:
                keep.append(t)
            else:
                bad.append((w.rows[j][0], why))
        if bad and self.opts.on_bad_row == "fail":
            self._fail(*bad[0])
        for where, why in bad:
            if self._shown < BAD_ROWS_SHOWN:
                self.progress.say(f"{where}: skipped: {why}")
            elif self._shown == BAD_ROWS_SHOWN:
                self.progress.say("(more bad rows: only counted from here on; the summary has "
                                  "the total)")
            self._shown += 1
        table = self._table(w, keep, res)
        info: dict = {"rows_in": len(w.rows), "rows_out": len(keep), "bad": len(bad),
                      "bad_rows": [list(b) for b in bad[:BAD_ROWS_KEPT]],
                      "tokens": int(res.tokens), "truncated": int(res.truncated),
                      "hash": w.digest}
        self.store.write_part(w.k, table, info)
        self.store.append_output(w.k, table, self.schema, self.job_meta)
        self._account(info)
        s = self.summary
        s.tokens += info["tokens"]
        s.embedded_now += len(keep)
        self._committed_rows += len(w.rows)
        self._show_progress()

    def _table(self, w: _Window, keep: list, res: Any) -> Any:
        import numpy as np
        import pyarrow as pa

        schema = self.schema
        rows = [w.rows[w.good[t]] for t in keep]
        start = w.k * self.opts.row_group_size
        if self.inputs.spec.id_field is None:  # the row's number in the input
            ids = pa.array([start + w.good[t] for t in keep], pa.int64())
        else:
            ids = pa.array([r[3] for r in rows], schema.field(0).type)
        vecs = np.ascontiguousarray(res.vectors[keep], dtype=np.float32)
        dim = schema.field(1).type.list_size
        emb = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1), pa.float32()), dim)
        cols = [ids, emb]
        for c in range(2, len(schema)):
            cols.append(pa.array([r[4][c - 2] for r in rows], schema.field(c).type))
        return pa.Table.from_arrays(cols, schema=schema)

    def interrupt(self) -> int:
        """After Ctrl-C / SIGTERM: commit the windows already finished; return the row groups
        saved in all."""
        while self._inflight and self._inflight[0].pending.done():
            try:
                self._commit(self._inflight.popleft())
            except Exception:  # noqa: BLE001 - interrupted anyway: keep what is saved
                break
        self._inflight.clear()
        self.store.abandon()
        return self.store.part_count()


def run_job(inputs: Any, embedder: Any, store: Store, schema: Any, done: list,
            opts: Optional[JobOptions] = None, progress: Optional[Progress] = None,
            job_meta: Optional[dict] = None) -> Summary:
    """Run (or resume: ``done`` = the parts already written) one job; see :class:`Job`."""
    job = Job(inputs, embedder, store, schema, done, opts or JobOptions(),
              progress or Progress(mode="none"), job_meta or {})
    try:
        return job.run()
    except KeyboardInterrupt:
        job.interrupt()
        raise
    except BaseException:
        store.abandon()
        raise


def warm_arrow() -> None:
    """Make pyarrow's first ``pa.array`` call now: it imports pandas (~0.2 s of CPU, measured
    on the 2-core box), and the first commit would otherwise pay it after the first window's
    last batch -- for a one-window job, with both cores idle at the very end."""
    import pyarrow as pa

    pa.array([0], pa.int64())

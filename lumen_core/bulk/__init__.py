"""Bulk embedding jobs (``lumen embed``): a corpus in, a Parquet (or ``.npy``) file out.

The parts, one concern each:

- :mod:`.sources`: the input files (JSONL, CSV/TSV, Parquet, plain text, stdin) read as one
  stream of rows in input order, each row a text or the reason it is bad, with its place
  (``FILE:LINE``) for the report;
- :mod:`.local`: the in-process embedder: the task's own preparation (the tokenizer's
  ``encode_batch``, GIL released), batches formed here by length inside a window
  (deterministic, so a rerun computes the same bytes), run on the task's engine instances
  by one thread each; no HTTP, no JSON, no dynamic batcher;
- :mod:`.remote`: the same interface over HTTP (``--url``): a running ``lumen serve`` or any
  OpenAI ``/v1/embeddings`` server, with concurrency and backoff on 429 / 503;
- :mod:`.store`: the resumable output: one Parquet part file per row group, written
  atomically beside a state file that fingerprints the job, assembled into the output at the
  end (the same bytes whether or not the job was interrupted);
- :mod:`.job`: the loop that ties them together, bad rows, the progress line and the summary
  (:mod:`.progress`).
"""
from __future__ import annotations

from .job import JobOptions, Summary, run_job
from .sources import FORMATS, InputSpec, open_inputs
from .store import JobMismatch, Store

__all__ = ["FORMATS", "InputSpec", "JobMismatch", "JobOptions", "Store", "Summary",
           "open_inputs", "run_job"]

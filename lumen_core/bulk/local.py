"""The in-process embedder of a bulk job: the task's own preparation and engines, batches
formed here.

Why not ``rt.infer_many``: the dynamic batcher forms batches from whatever is queued when an
engine frees up, so which texts share a batch (and how far each is padded) depends on timing;
ONNX Runtime's float sums depend on the padded length in the last bits (measured: about a
quarter of MiniLM's rows differ between a batch of 32 and the text alone).  A bulk job must
compute the same bytes when it is rerun after a kill, so it forms its batches itself, from the
window's texts alone: sorted by token count (then input position), cut at the task's
``max_batch_size`` and a budget of padded tokens (``CPU_BATCH_TOKENS`` on CPU, the task's
``max_batch_tokens`` elsewhere) -- the offline ideal of length-sorted batches --
and runs them on the task's engine instances (``Task.runners``: each a ``BatchRunner``, the
same assemble -> run -> postprocess the batcher's workers call), one thread each, while the
caller reads and prepares the next window.

Preparation: each text goes through ``Runtime.prepare`` (the request path's own validation
and preparation, not queued), so options (``dimensions``, ``truncate``, ``prompt_name``) act
exactly as on ``rt.infer``.  For a tokenizing backend the texts of a window are first
tokenized together with the backend's tokenizer (``encode_batch``: every core, GIL released)
and prepared as token ids (the tensor route), cut to ``max_seq_length`` the way the backend
cuts; the first window checks those ids against the backend's own raw preparation and falls
back to it for good if they differ (a backend that adds a prompt or reads text otherwise).
Texts longer than ``LONG_TEXT_CHARS`` and any ``prompt_name`` job take the raw route.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

import numpy as np

from ..batching.runner import run_split
from ..contract import KEY_EMBEDDING_DIMENSIONS, KEY_MODEL_VERSION, RESP_TRUNCATED
from ..errors import LumenError

log = logging.getLogger("lumen.embed")

OPT_TRUNCATE = "truncate"
OPT_PROMPT_NAME = "prompt_name"
#: texts longer than this (characters) take the backend's raw route: it tokenizes a long text
#: by prefix (text_embedding.LONG_TEXT_CHARS), so a huge text costs what its kept tokens cost
LONG_TEXT_CHARS = 2048
#: padded tokens of one batch on CPU.  Measured on the 2-core box (MiniLM, length-mixed
#: corpus, 2 x 1-thread sessions, texts per CPU-second): 256 tokens 83-84, 384 81-83, 512
#: 79-80, 1024 72-74, and the task's 8192 with 32 rows 43 -- a batch whose attention no
#: longer fits the caches costs more per text, whatever the padding; a GPU wants the task's
#: (larger) budget.  ``--batch-tokens`` sets it.
CPU_BATCH_TOKENS = 512
#: texts of the first window whose token ids are compared with the backend's own preparation
SELF_CHECK_TEXTS = 32


def reason(exc: BaseException) -> str:
    """One line for a bad row from a request's error."""
    if isinstance(exc, LumenError):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


class Pending:
    """One window's result as it fills: ``vectors`` in the window's order, ``errors`` (index
    -> why that text has no vector), ``tokens`` embedded and ``truncated`` texts."""

    def __init__(self, n: int, dim: int):
        self.n = n
        self.vectors = np.zeros((n, dim), np.float32)
        self.errors: dict = {}
        self.tokens = 0
        self.truncated = 0
        #: texts whose batch has run (the progress line counts them)
        self.rows_done = 0
        self._left = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._exc: Optional[BaseException] = None

    def expect(self, batches: int) -> None:
        with self._lock:
            self._left += batches
            if self._left == 0:
                self._done.set()

    def add_truncated(self) -> None:
        with self._lock:
            self.truncated += 1

    def add_tokens(self, n: int) -> None:
        with self._lock:
            self.tokens += n

    def batch_done(self, rows: int, exc: Optional[BaseException] = None) -> None:
        with self._lock:
            if exc is not None and self._exc is None:
                self._exc = exc
            self.rows_done += rows
            self._left -= 1
            if self._left <= 0:
                self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> "Pending":
        """Wait until every batch is in; raise what broke the window, if anything did."""
        if not self._done.wait(timeout):
            raise TimeoutError("the window is not finished")
        if self._exc is not None:
            raise self._exc
        return self


class LocalEmbedder:
    """Embeds windows of texts on a started runtime's task (see the module docstring).

    ``submit(texts)`` prepares the window in the caller's thread, queues its batches and
    returns a :class:`Pending`; batches run in submission order, so windows finish in order.
    """

    def __init__(self, rt: Any, task: str, dimensions: Optional[int] = None,
                 prompt_name: Optional[str] = None, truncate: bool = True,
                 token_route: bool = True, batch_tokens: Optional[int] = None):
        desc = rt.describe(task)  # TaskNotFound for an unknown task
        emb = desc.get("embedding")
        if not isinstance(emb, dict):
            raise ValueError(f"task {task!r} is not an embedding task ({desc.get('backend')} "
                             f"backend); the embedding tasks here: "
                             f"{', '.join(embedding_tasks(rt)) or 'none'}")
        full = int(emb["dim"])
        self.rt = rt
        self.task = task
        self.output = emb.get("output", "embedding")
        if dimensions is not None and not 1 <= dimensions <= full:
            raise ValueError(f"--dimensions must be in 1..{full} (the embedding size of "
                             f"{task!r}), got {dimensions}")
        self.dim = dimensions or full
        options = rt.request_options(task)
        meta: dict = {}
        if dimensions is not None and dimensions < full:
            meta[KEY_EMBEDDING_DIMENSIONS] = str(dimensions)
        if not truncate:
            meta[OPT_TRUNCATE] = "false"
        if prompt_name is not None:
            if OPT_PROMPT_NAME not in options:
                raise ValueError(f"task {task!r} takes no prompt_name (its model has no "
                                 f"prompts: the options it reads are "
                                 f"{', '.join(sorted(options)) or 'none'}); leave out "
                                 f"--prompt-name")
            meta[OPT_PROMPT_NAME] = prompt_name
        route = rt.tasks[task]
        if len(rt.versions(task)) > 1:  # several versions: every item on the head's engines
            meta[KEY_MODEL_VERSION] = route.version
        self.meta = meta
        self.truncate = truncate
        if meta:  # an option the task refuses fails the job now, not every row
            probe = rt.text_request(task, "probe")
            probe.meta = dict(meta)
            try:
                rt.prepare(probe)
            except LumenError as exc:
                raise ValueError(f"task {task!r} refuses the options: {exc.message}") from None
        self.runners = list(route.runners)
        self.max_batch = max(1, int(route.config.batching.max_batch_size))
        self.max_tokens = batch_tokens or default_batch_tokens(
            int(desc.get("max_batch_tokens") or 0), str(route.config.device))
        self.max_seq = int(desc.get("max_seq_length") or 0)
        tok = getattr(route.backend, "tokenizer", None)
        usable = (token_route and prompt_name is None and self.max_seq > 0
                  and hasattr(tok, "encode_batch"))
        self._tok = tok if usable else None
        self._suffix = _special_suffix(tok) if usable else 0
        self._checked = False
        self._queue: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._work, args=(r,), daemon=True,
                                          name=f"lumen-embed-{i}")
                         for i, r in enumerate(self.runners)]
        for t in self._threads:
            t.start()

    @property
    def token_route(self) -> bool:
        """Whether texts are tokenized here in bulk (else one by one by the backend)."""
        return self._tok is not None

    # -- preparation -----------------------------------------------------------------------
    def submit(self, texts: list) -> Pending:
        pending = Pending(len(texts), self.dim)
        items: list = [None] * len(texts)
        lengths = [0] * len(texts)
        raw = list(range(len(texts)))
        if self._tok is not None:
            raw = self._prepare_tokens(texts, items, lengths, pending)
        for i in raw:
            self._prepare_raw(i, texts[i], items, lengths, pending)
        order = sorted((i for i in range(len(texts)) if items[i] is not None),
                       key=lambda i: (lengths[i], i))
        batches = self._cut(order, lengths)
        pending.expect(len(batches))
        # the costliest batches first (padded slots): the window's last batches are then
        # small ones, so no engine idles long while another finishes a big one
        batches.sort(key=lambda b: -len(b) * lengths[b[-1]])
        for b in batches:
            pending.tokens += sum(lengths[i] for i in b)
            self._queue.put((pending, b, [items[i] for i in b]))
        return pending

    def _prepare_raw(self, i: int, text: str, items: list, lengths: list,
                     pending: Pending) -> None:
        req = self.rt.text_request(self.task, text)
        if self.meta:
            req.meta = dict(self.meta)
        try:
            item = self.rt.prepare(req)
        except LumenError as exc:
            pending.errors[i] = reason(exc)
            return
        items[i] = item
        lengths[i] = int(item.length)

    def _prepare_tokens(self, texts: list, items: list, lengths: list,
                        pending: Pending) -> list:
        """Tokenize the window's short texts together; return the indices left to the raw
        route (long texts, and everything if the self-check fails)."""
        short = [i for i, t in enumerate(texts) if len(t) <= LONG_TEXT_CHARS]
        rest = [i for i, t in enumerate(texts) if len(t) > LONG_TEXT_CHARS]
        tok = self._tok
        if not short or tok is None:
            return short + rest
        try:
            encs = tok.encode_batch([texts[i] for i in short])
        except Exception as exc:  # noqa: BLE001 - a text it refuses: the backend says why
            log.info("bulk tokenization failed (%s); this window takes the raw route", exc)
            return short + rest
        limit, ns = self.max_seq, self._suffix
        rt, task = self.rt, self.task
        cut_ids: list = []
        for i, enc in zip(short, encs, strict=True):
            ids = enc.ids
            n = len(ids)
            if n > limit:
                if not self.truncate:
                    pending.errors[i] = (
                        f"payload_too_large: the text is {n} tokens; task {task!r} takes at "
                        f"most {limit} (max_seq_length) and --no-truncate was given")
                    cut_ids.append(None)
                    continue
                ids = ids[:limit - ns] + ids[n - ns:]
                pending.truncated += 1
            cut_ids.append(ids)
        if not self._checked and not self._self_check(texts, short, cut_ids):
            for i in short:
                pending.errors.pop(i, None)
            pending.truncated = 0
            return short + rest
        for i, ids in zip(short, cut_ids, strict=True):
            if ids is None:
                continue
            req = rt.token_ids_request(task, ids)
            if self.meta:
                req.meta.update(self.meta)
            try:
                items[i] = rt.prepare(req)
            except LumenError as exc:
                pending.errors[i] = reason(exc)
                continue
            lengths[i] = len(ids)
        return rest

    def _self_check(self, texts: list, short: list, cut_ids: list) -> bool:
        """Compare the first texts' bulk token ids with the backend's own preparation; on a
        difference, the raw route from now on.  True when the bulk ids may be used."""
        self._checked = True
        for i, ids in list(zip(short, cut_ids, strict=True))[:SELF_CHECK_TEXTS]:
            if ids is None:
                continue
            req = self.rt.text_request(self.task, texts[i])
            if self.meta:
                req.meta = dict(self.meta)
            try:
                item = self.rt.prepare(req)
            except LumenError:
                continue
            got = np.asarray(item.tensors[0]).reshape(-1).tolist()
            if got != list(ids):
                log.warning("task %s prepares text otherwise than its tokenizer alone; "
                            "tokenizing one text at a time", self.task)
                self._tok = None
                return False
        return True

    def _cut(self, order: list, lengths: list) -> list:
        """Consecutive runs of the length-sorted order: at most ``max_batch`` rows and
        ``max_tokens`` padded slots each (a deterministic function of the window)."""
        batches: list = []
        cur: list = []
        cap, budget = self.max_batch, self.max_tokens
        for i in order:
            n = lengths[i]
            if cur and (len(cur) >= cap or (budget and (len(cur) + 1) * n > budget)):
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches

    # -- running ---------------------------------------------------------------------------
    def _work(self, runner: Any) -> None:
        execute = runner.execute
        work_loop(self._queue,
                  lambda pending, idx, items: self._fill(pending, idx, run_split(execute, items)))

    def _fill(self, pending: Pending, idx: list, results: Any) -> None:
        out = self.output
        if not isinstance(results, list):  # entries.Rows: the whole batch, one copy
            pending.vectors[idx] = results.arrays[out][:len(idx)]
            return
        for i, res in zip(idx, results, strict=True):
            if isinstance(res, BaseException):
                pending.errors[i] = reason(res)
                continue
            pending.vectors[i] = res[out]
            meta = getattr(res, "meta", None)
            if meta and meta.get(RESP_TRUNCATED) == "true":
                pending.add_truncated()

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop the threads once the batches queued so far have run (at most ``timeout``)."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout)


def default_batch_tokens(task_budget: int, device: str) -> int:
    """Padded tokens of one bulk batch: on CPU ``CPU_BATCH_TOKENS`` (or the task's smaller
    budget), elsewhere the task's own ``max_batch_tokens``."""
    if device.startswith("cpu"):
        return min(task_budget, CPU_BATCH_TOKENS) if task_budget else CPU_BATCH_TOKENS
    return task_budget


def work_loop(jobs: queue.Queue, run: Callable[[Pending, list, list], None]) -> None:
    """A worker thread of an embedder: ``run(pending, indices, payload)`` for each job of
    ``jobs`` until a None; a job's failure goes to its window (``Pending.result`` raises it),
    and every job counts its rows done either way."""
    while True:
        job = jobs.get()
        if job is None:
            return
        pending, idx, payload = job
        try:
            run(pending, idx, payload)
        except BaseException as exc:  # noqa: BLE001 - handed to the window's owner
            pending.batch_done(len(idx), exc)
            continue
        pending.batch_done(len(idx))


def _special_suffix(tok: Any) -> int:
    """Special tokens the tokenizer's post-processor puts after a text ([SEP]: 1), which a
    cut keeps at the end (the backend's rule)."""
    mask = tok.encode("a").special_tokens_mask
    return len(mask) - 1 - max(i for i, m in enumerate(mask) if not m)


def embedding_tasks(rt: Any) -> list:
    """The runtime's tasks that return an embedding (``describe()["embedding"]``)."""
    return [name for name, d in sorted(rt.describe().items())
            if isinstance(d.get("embedding"), dict)]


def bulk_runtime(task: str, config: Optional[str] = None, instances: Optional[int] = None,
                 threads: Optional[int] = None) -> Any:
    """A runtime of ``task`` alone (from ``config``, else the built-in default task), laid out
    for throughput: ``instances`` engine sessions of ``threads`` intra-op threads each.  Not
    started.  Without ``--config`` the default is one single-thread session per core up to
    ``MAX_DEFAULT_INSTANCES`` (bench/bench_embed.py measures the layouts)."""
    import dataclasses

    from ..config import load_config
    from ..errors import TaskNotFound
    from ..runtime import Runtime

    if config:
        cfg = load_config(config)
        tcs = [t for t in cfg.tasks if t.name == task]
        if not tcs:
            raise TaskNotFound(f"unknown task {task!r}; {config} has "
                               f"{', '.join(t.name for t in cfg.tasks) or 'no tasks'}", "task")
        tc = tcs[0]
        if instances:
            tc = dataclasses.replace(tc, instances=instances)
        if threads:
            tc = dataclasses.replace(tc, intra_op_threads=threads)
        return Runtime(dataclasses.replace(cfg, tasks=[tc]))
    from ..tasks import default_task_table

    table = dict(default_task_table(task))
    cores = usable_cores()
    table["instances"] = instances or min(cores, MAX_DEFAULT_INSTANCES)
    table["intra_op_threads"] = threads or max(1, cores // table["instances"])
    return Runtime.from_dict({"tasks": [table]}, source="<lumen embed>")


#: without --config: at most this many engine sessions (one per core up to it)
MAX_DEFAULT_INSTANCES = 8


def usable_cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def model_fingerprint(rt: Any, task: str) -> dict:
    """What identifies the model of ``task`` for resume: id, version and the model file's
    revision (a configured file: the lifecycle's SHA-256; a prepared model: its file's
    fingerprint)."""
    from .sources import fingerprint

    d = rt.describe(task)
    out = {"task": task, "model_id": d.get("model_id"), "model_version": d.get("model_version")}
    versions = rt.lifecycle(task).get("versions") or []
    rev = next((v.get("revision") for v in versions if v.get("revision")), "")
    if rev:
        out["revision"] = rev
        return out
    try:
        from ..models import MODEL_FILE, require_model

        path = require_model(str(d.get("model_id"))) / MODEL_FILE
        fp = fingerprint(str(path))
        out["revision"] = {k: fp[k] for k in ("size", "head_sha256", "tail_sha256")}
    except Exception:  # noqa: BLE001 - no prepared file to read: id and version only
        pass
    return out

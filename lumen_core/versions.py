"""Model versions of a task: the lifecycle of each version (load beside the old one, warm up,
take traffic atomically, drain the old one, unload it) behind ``rt.reload``,
``rt.set_traffic``, the admin API and ``--watch``.  The traffic split and the per-request
choice of a version are :mod:`lumen_core.routing`; model files on disk (states, revisions,
waiting for a writer, the admin loads' path check) are :mod:`lumen_core.watch`.

How it sits in the runtime: every loaded version is a :class:`~lumen_core.loading.Task` of its
own (own sessions, batcher, warm-up; the version is in its execution signature), and
``Runtime.tasks[name]`` holds the task's *head*: the version with the largest share of traffic.
A task that serves one version has ``head.router = None``, so the request path pays one
attribute test for versions.  With several, ``head.router`` is a
:class:`~lumen_core.routing.Router` built once per
change of the set or the split: a pin (``lumen.model.version``), a sticky key
(``lumen.route.key``) or a weighted draw picks the version.  Swaps replace ``Runtime.tasks[name]``
and the router in one step on the loop thread, so a request sees either the old set or the new.

Why Triton's failure modes cannot happen here: a new revision loads *beside* the serving one
and only a fully warmed one is installed; a failed load leaves the serving instance untouched
(its failure is recorded per version and shown by the admin API); the watcher compares file
states on every tick whatever happened before, so later changes are still picked up.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Protocol

from .config import LumenConfig, TaskConfig, load_config, parse_config, task_versions
from .errors import (
    ConfigError,
    InvalidArgument,
    LoadFailed,
    TaskNotFound,
    Unavailable,
)
from .routing import Router, check_traffic, head_version, version_key
from .version_records import (  # the records and their states are importable from here too
    DRAINING,
    FAILED,
    LOADING,  # noqa: F401 - re-exported: the admin states are importable from here
    READY,
    Instance,
    TaskVersions,
    config_labels,
    same_config,
    with_version,
)
from .watch import (
    STABLE_QUIET_S,
    WATCH_INTERVAL_S,
    FileWatch,
    Stopped,
    file_hash,
    file_state,
    stable_revision,
    wait_stable,
)

if TYPE_CHECKING:  # typing only (the runtime builds the Lifecycle: no import at run time)
    from .loading import Task
    from .tracing import Tracing

log = logging.getLogger("lumen.lifecycle")

#: seconds between two checks while a retired version drains
DRAIN_POLL_S = 0.005


class VersionHost(Protocol):
    """What the lifecycle needs of the runtime it manages (``runtime.Runtime`` is one): its
    config, its table of task heads, and building, warming and closing one task version.
    A Protocol, so that this module depends on the contract and not on ``runtime.py`` (which
    imports this one)."""

    config: LumenConfig

    @property
    def tasks(self) -> dict[str, Task]: ...

    @property
    def loop(self) -> Optional[asyncio.AbstractEventLoop]: ...

    @property
    def closing(self) -> bool: ...

    @property
    def tracing(self) -> Optional[Tracing]: ...

    def load_task(self, tc: TaskConfig) -> Task: ...

    async def warmup(self, task: Task) -> None: ...

    async def close_task(self, task: Task) -> None: ...


class Lifecycle:
    """The runtime's version manager (one per Runtime; its public face is the Runtime's
    ``reload``, ``apply_config``, ``set_traffic``, ``load_version``, ``unload_version``,
    ``lifecycle`` and ``watch``)."""

    def __init__(self, rt: VersionHost):
        self.rt = rt
        self.sets: dict = {}  # task name -> TaskVersions
        self.config_error: Optional[str] = None
        self._watch: Optional[asyncio.Task] = None
        self._files = FileWatch()
        #: seconds a changed file must stay unchanged before it is read (STABLE_QUIET_S)
        self.quiet_s = STABLE_QUIET_S
        self._config_state: Optional[tuple] = None
        #: sha256 of the config file's content as last read (None: not read since the start)
        self._config_hash: Optional[str] = None
        #: set by stop(): a worker thread reading a model file gives up (Stopped)
        self._stop = threading.Event()

    # -- loaded tasks ------------------------------------------------------------------------
    def forget(self) -> None:
        """The runtime closed every task: no version is loaded any more."""
        self.sets = {}

    def tasks(self) -> list:
        """Every loaded Task (serving and draining), each once."""
        out = []
        for tv in self.sets.values():
            out += [i.task for i in tv.serving.values()] + [i.task for i in tv.draining]
        return out

    def serving(self, name: str) -> list:
        tv = self.sets.get(name)
        return sorted(tv.serving, key=version_key) if tv is not None else []

    def describe(self, name: Optional[str] = None) -> dict:
        if name is not None:
            return self._set(name).describe()
        return {n: tv.describe() for n, tv in sorted(self.sets.items())}

    def _set(self, name: str) -> TaskVersions:
        tv = self.sets.get(name)
        if tv is None:
            raise TaskNotFound.unknown(name, self.sets)
        return tv

    # -- start -------------------------------------------------------------------------------
    async def start(self, configs: Iterable[TaskConfig]) -> None:
        """Load every version of every task; the first failure raises (nothing serves yet)."""
        self._stop.clear()
        for tc in configs:
            tv = self.sets[tc.name] = TaskVersions(tc.name, tc)
            for vtc in task_versions(tc):
                stat, rev = None, ""
                if vtc.model and file_state(vtc.model) is not None:
                    stat, rev = await self._revision(vtc.model, 0.0)
                await self._bring_up(tv, vtc, rev, stat, strict=True)
            self._install(tv)

    # -- reload ------------------------------------------------------------------------------
    async def reload(self, name: Optional[str] = None, read_config: bool = True) -> dict:
        """Re-read the config file (when the runtime came from one) and the model files;
        bring every task (or ``name``) to what they say.  ``read_config`` False: the model
        files only, against the running configs (versions loaded through the admin API
        included).  Returns the admin view."""
        if name is not None:
            self._set(name)
        cfg = await self._read_config() if read_config else None
        if cfg is not None:
            self._adopt_server(cfg)
            wanted = {tc.name: tc for tc in cfg.tasks}
        else:
            wanted = {n: tv.config for n, tv in self.sets.items()}
        names = [name] if name is not None else sorted(set(wanted) | set(self.sets))
        for n in names:
            await self.reconcile(n, wanted.get(n))
        return self.describe(name) if name is not None else self.describe()

    async def apply_config(self, cfg: Any) -> dict:
        """Apply a new config (a LumenConfig, a dict or a TOML path): tasks it adds load, tasks
        it drops drain and unload, changed ones reload.  A bad config raises ConfigError and
        changes nothing.  ``[server]`` settings need a restart and are kept."""
        if isinstance(cfg, str):
            cfg = load_config(cfg)
        elif isinstance(cfg, Mapping):
            cfg = parse_config(cfg)
        elif not isinstance(cfg, LumenConfig):
            raise TypeError(f"apply_config takes a LumenConfig, a dict or a path, not "
                            f"{type(cfg).__name__}")
        self._adopt_server(cfg)
        wanted = {tc.name: tc for tc in cfg.tasks}
        for n in sorted(set(wanted) | set(self.sets)):
            await self.reconcile(n, wanted.get(n))
        return self.describe()

    def _adopt_server(self, cfg: LumenConfig) -> None:
        rt = self.rt
        if cfg.server != rt.config.server:
            log.warning("lumen reload: [server] settings changed in %s; they take effect on "
                        "restart", cfg.source)
        rt.config.tasks = list(cfg.tasks)

    async def _read_config(self) -> Optional[LumenConfig]:
        src = self.rt.config.source
        if not src or src.startswith("<") or not os.path.isfile(src):
            return None
        def read() -> tuple:
            st = file_state(src)
            if st != self._config_state:  # changed since the last read: let the writer finish
                st = wait_stable(src, self.quiet_s)
            return st, file_hash(src), load_config(src)

        try:
            st, digest, cfg = await asyncio.to_thread(read)
        except ConfigError as exc:
            self.config_error = str(exc)
            log.error("lumen reload: %s; keeping the running config", exc)
            return None
        self.config_error = None
        self._config_state = st
        self._config_hash = digest
        return cfg

    def _config_changed(self) -> bool:
        """Whether the config file's content differs from what was last read (a touch, or an
        editor's save of the same text, is no change).  Runs on a worker thread."""
        try:
            return file_hash(self.rt.config.source) != self._config_hash
        except OSError:
            return True

    async def reconcile(self, name: str, tc: Optional[TaskConfig]) -> None:
        """Bring task ``name`` to ``tc`` (None: remove it)."""
        tv = self.sets.get(name)
        if tv is None:
            if tc is None:
                return
            tv = self.sets[name] = TaskVersions(name, tc)
        async with tv.lock:
            if tc is None:
                retired = list(tv.serving.values())
                tv.serving.clear()
                await self._swap(tv, retired)
                if not tv.serving and not tv.loading:
                    del self.sets[name]
                return
            wanted = task_versions(tc)
            labels = {v.model_version for v in wanted}
            tv.config = tc
            if tc.traffic != tv.config_traffic:  # the file's split changed: it wins
                tv.config_traffic = dict(tc.traffic)
                tv.traffic = dict(tc.traffic)
            replaced = []
            for vtc in wanted:
                old = await self._update(tv, vtc)
                if old is not None:
                    replaced.append(old)
            for v in [v for v in tv.serving if v not in labels]:
                replaced.append(tv.serving.pop(v))
            for v in [v for v in tv.failed if v not in labels]:
                del tv.failed[v]
            await self._swap(tv, replaced)
            if not tv.serving and name in self.sets and not tv.failed:
                del self.sets[name]

    async def _update(self, tv: TaskVersions, vtc: TaskConfig, force: bool = False) -> Any:
        """Load ``vtc`` beside what serves its version when it differs (config or file
        content); the replaced instance (to retire) or None."""
        cur = tv.serving.get(vtc.model_version)
        failed = tv.failed.get(vtc.model_version)
        stat = file_state(vtc.model) if vtc.model else None
        if not force:
            for known in (cur, failed):
                if known is not None and known.stat == stat and same_config(known.config, vtc):
                    return None  # nothing changed since it loaded (or since it failed)
        rev = ""
        if stat is not None:
            stat, rev = await self._revision(vtc.model, self.quiet_s)
        if not force:
            for known in (cur, failed):
                if known is not None and known.revision == rev \
                        and same_config(known.config, vtc):
                    known.stat = stat  # touched, same content
                    return None
        inst = await self._bring_up(tv, vtc, rev, stat)
        return cur if inst is not None else None

    async def _revision(self, path: str, quiet_s: float) -> tuple:
        """``stable_revision`` of ``path`` on a worker thread that gives up when the runtime
        stops (Unavailable then)."""
        try:
            return await asyncio.to_thread(stable_revision, path, quiet_s, self._stop)
        except Stopped:
            raise Unavailable(f"the runtime stopped while reading {path}") from None

    async def _bring_up(self, tv: TaskVersions, vtc: TaskConfig, rev: str,
                        stat: Optional[tuple], strict: bool = False) -> Optional[Instance]:
        """Load, start and warm one instance beside whatever serves; None when it failed."""
        rt = self.rt
        inst = Instance(vtc, rev, stat)
        tv.loading.append(inst)
        tv.event("loading", inst)
        try:
            if self._stop.is_set():
                raise Unavailable("the runtime is shutting down")
            task = await asyncio.to_thread(rt.load_task, vtc)
            try:
                task.batcher.start(rt.loop)
                await rt.warmup(task)
                if rt.closing:  # the runtime stopped meanwhile: nothing may serve now
                    raise RuntimeError("the runtime is shutting down")
            except BaseException:
                await rt.close_task(task)
                raise
        except Exception as exc:
            inst.state = FAILED
            inst.error = str(exc) or type(exc).__name__
            tv.failed[inst.version] = inst
            tv.failures[inst.version] = tv.failures.get(inst.version, 0) + 1
            tv.event("failed", inst)
            if strict:
                raise
            log.error("lumen: task %s version %s failed to load (%s); what was serving keeps "
                      "serving", tv.name, inst.version, inst.error)
            return None
        finally:
            tv.loading.remove(inst)
        inst.task = task
        inst.state = READY
        inst.since = time.time()
        tv.failed.pop(inst.version, None)
        tv.serving[inst.version] = inst
        tv.event("ready", inst)
        log.info("lumen: task %s version %s ready (revision %s)", tv.name, inst.version,
                 rev[:12] or "-")
        return inst

    # -- routing -----------------------------------------------------------------------------
    def _install(self, tv: TaskVersions) -> None:
        """Point the runtime at ``tv``'s serving versions and split, in one step."""
        rt = self.rt
        serving = {v: i.task for v, i in tv.serving.items()}
        old = rt.tasks.get(tv.name)
        if not serving:
            rt.tasks.pop(tv.name, None)
            if old is not None:
                old.router = None
            return
        split = tv.split()
        head = serving[head_version(split)]
        sequences = [i.task for i in tv.draining if i.task.backend.stateful]
        if len(serving) > 1 and head.backend.stateful:
            sequences += list(serving.values())
        router = (Router(tv.name, serving, split, sequences)
                  if len(serving) > 1 or sequences else None)
        head.router = router
        rt.tasks[tv.name] = head
        if old is not None and old is not head:
            old.router = None
        if rt.tracing is not None:
            rt.tracing.versions[tv.name] = head.version

    def set_traffic(self, name: str, weights: Mapping) -> dict:
        tv = self._set(name)
        tv.traffic = check_traffic(name, weights, tv.serving)
        self._install(tv)
        log.info("lumen: task %s traffic %s", name, tv.split())
        return tv.describe()

    async def load_version(self, name: str, version: str, model: Optional[str] = None) -> dict:
        """(Re)load ``version`` of task ``name`` from the config's model, or from ``model``."""
        tv = self._set(name)
        async with tv.lock:
            vtc = next((v for v in task_versions(tv.config) if v.model_version == version), None)
            if model is not None:
                base = vtc or task_versions(tv.config)[0]
                # its errors name the request that gave the path, not a config key
                vtc = dataclasses.replace(base, model=model, model_version=version,
                                          source=f"load of task {name!r} version {version!r}",
                                          key="request")
                tv.config = with_version(tv.config, version, model)
            if vtc is None:
                raise InvalidArgument(f"task {name!r} has no version {version!r} in its config "
                                      f"(versions: {', '.join(config_labels(tv.config))}); give its "
                                      f"model", "version")
            old = await self._update(tv, vtc, force=True)
            await self._swap(tv, [old] if old is not None else [])
            failed = tv.failed.get(version)  # forced, so set now exactly when this load failed
            if failed is not None:
                raise LoadFailed(f"task {name!r} version {version!r} failed to load: "
                                 f"{failed.error}; what was serving keeps serving. Fix the "
                                 f"model file (or give another) and load again; GET "
                                 f"/v1/admin/tasks/{name} shows the versions' states",
                                 "model" if model is not None else "version")
            return tv.describe()

    async def unload_version(self, name: str, version: str) -> dict:
        tv = self._set(name)
        async with tv.lock:
            if version not in tv.serving:
                raise InvalidArgument(f"task {name!r} has no loaded version {version!r} "
                                      f"(loaded: {', '.join(sorted(tv.serving, key=version_key))})",
                                      "version")
            if len(tv.serving) == 1:
                raise InvalidArgument(f"version {version!r} is the only loaded version of task "
                                      f"{name!r}; load another first (or remove the task from "
                                      f"the config)", "version")
            inst = tv.serving.pop(version)
            await self._swap(tv, [inst])
            return tv.describe()

    # -- retiring ----------------------------------------------------------------------------
    async def _swap(self, tv: TaskVersions, retired: list) -> None:
        """Install ``tv``'s serving versions, then drain and unload ``retired`` (out of the
        split already; a stateful one keeps its open sequences, so it is marked draining in
        the same step)."""
        for inst in retired:
            inst.state = DRAINING
            tv.draining.append(inst)
            tv.event("draining", inst)
        self._install(tv)
        if retired:
            await asyncio.gather(*(self._retire(tv, i) for i in retired))

    async def _retire(self, tv: TaskVersions, inst: Instance) -> None:
        """Let ``inst`` finish what it holds (requests routed to it still being prepared, its
        queued and running requests, a stateful task's open sequences), then unload it."""
        task = inst.task
        try:
            while task.holds:  # requests routed here, still preparing off the loop
                await asyncio.sleep(DRAIN_POLL_S)
            if task.backend.stateful:
                b = task.batcher
                while b.active_sequences or b.backlog:  # they end or idle out
                    await asyncio.sleep(DRAIN_POLL_S)
            await task.batcher.drain()
            await self.rt.close_task(task)
        finally:
            tv.draining.remove(inst)
            if task.backend.stateful:
                self._install(tv)
        tv.event("unloaded", inst)
        log.info("lumen: task %s version %s (revision %s) unloaded", tv.name, inst.version,
                 inst.revision[:12] or "-")

    # -- watching ----------------------------------------------------------------------------
    def watched_paths(self) -> list:
        src = self.rt.config.source
        paths = [src] if src and not src.startswith("<") and os.path.isfile(src) else []
        for tv in self.sets.values():
            paths += [v.model for v in task_versions(tv.config) if v.model]
        return list(dict.fromkeys(paths))

    def watch(self, interval_s: float = WATCH_INTERVAL_S) -> asyncio.Task:
        """Start watching the config file and every version's model file (idempotent)."""
        if self._watch is None or self._watch.done():
            self._files.reset(self.watched_paths())
            src = self.rt.config.source
            if self._config_hash is None and src in self._files.seen:
                self._config_hash = file_hash(src)  # the content the runtime started from
            self._watch = asyncio.ensure_future(self._watch_loop(interval_s))
        return self._watch

    def changed_paths(self) -> set:
        """Watched files whose state differs from the last look (a path new to the watch,
        e.g. the model of a version the admin API loaded, is recorded, not a change)."""
        return self._files.changed(self.watched_paths())

    async def _watch_loop(self, interval_s: float) -> None:
        """Reconcile on file changes only: a changed config file re-reads the config (which
        then wins over admin API changes); a changed model file reloads against the running
        configs, so a version loaded through the admin API stays until it is unloaded or the
        config file changes."""
        src = self.rt.config.source
        while True:
            await asyncio.sleep(interval_s)
            changed = self.changed_paths()
            if changed:
                try:
                    read = src in changed and await asyncio.to_thread(self._config_changed)
                    await self.reload(read_config=read)
                except Exception:  # noqa: BLE001 - the watcher must outlive any one reload
                    log.exception("lumen: reload after a file change failed")
                self._files.reset(self.watched_paths())

    def stop_loading(self) -> None:
        """Model-file reads in progress give up (Unavailable) and no new load starts: a
        shutdown never waits for a reload or an admin load reading a big file."""
        self._stop.set()

    async def stop(self) -> None:
        self.stop_loading()
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._watch = None

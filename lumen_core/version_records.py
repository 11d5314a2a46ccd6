"""The records of a task's model versions, kept by the lifecycle (:mod:`lumen_core.versions`):
one :class:`Instance` per load of a version (its source, state, Task once ready) and one
:class:`TaskVersions` per task (serving, loading, draining and failed instances, the requested
split, failure counts, the event log), with their admin view (``describe``), plus the config
comparisons a reload decides with.  Data only, apart from the lifecycle's logic: loading,
swapping and draining are ``versions.Lifecycle``'s.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from typing import Any, Optional

from .config import TaskConfig, VersionConfig, task_versions
from .routing import effective_split, head_version, version_key

#: states of a version instance (the admin API shows them)
LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
#: lifecycle events kept per task for the admin API
MAX_EVENTS = 64


class Instance:
    """One load of one version: what it was loaded from, its state, its Task once ready."""

    __slots__ = ("version", "config", "model", "revision", "stat", "state", "task", "error",
                 "since")

    def __init__(self, config: TaskConfig, revision: str, stat: Optional[tuple]):
        self.version = config.model_version
        self.config = config
        self.model = config.model
        self.revision = revision
        self.stat = stat
        self.state = LOADING
        self.task: Any = None
        self.error = ""
        self.since = time.time()

    def describe(self) -> dict:
        return {"version": self.version, "state": self.state, "model": self.model,
                "revision": self.revision, "error": self.error or None,
                "since": round(self.since, 3)}


class TaskVersions:
    """The versions of one task: serving, loading, draining and failed instances, the
    requested split, the failure counts and a short event log."""

    def __init__(self, name: str, config: TaskConfig):
        self.name = name
        self.config = config
        self.serving: dict = {}  # version -> Instance (ready)
        self.loading: list = []
        self.draining: list = []
        self.failed: dict = {}  # version -> its last failed Instance (until one loads)
        self.failures: dict = {}  # version -> failed loads so far
        self.traffic: dict = dict(config.traffic)  # requested weights
        self.config_traffic: dict = dict(config.traffic)
        self.lock = asyncio.Lock()
        self.events: deque = deque(maxlen=MAX_EVENTS)

    def event(self, what: str, inst: Instance) -> None:
        self.events.append({"t_ns": time.monotonic_ns(), "time": round(time.time(), 3),
                            "event": what, "version": inst.version, "revision": inst.revision,
                            "task": inst.task})

    def split(self) -> dict:
        return effective_split(self.traffic, self.serving)

    def describe(self) -> dict:
        split = self.split()
        insts = (list(self.serving.values()) + self.loading + self.draining
                 + [i for v, i in self.failed.items()])
        insts.sort(key=lambda i: (version_key(i.version), i.since))
        return {"name": self.name,
                "versions": [i.describe() for i in insts],
                "traffic": split,
                "default_version": head_version(split),
                "load_failures": dict(self.failures),
                "last_error": next((e["error"] for e in reversed(self._errors())), None),
                "events": [{k: v for k, v in e.items() if k not in ("task", "t_ns")}
                           for e in self.events]}

    def _errors(self) -> list:
        return [{"error": i.error} for i in sorted(self.failed.values(), key=lambda i: i.since)]


def same_config(a: TaskConfig, b: TaskConfig) -> bool:
    """Equal but for where they were declared (numpy constants compare by content)."""
    a = dataclasses.replace(a, source="", key="")
    b = dataclasses.replace(b, source="", key="")
    try:
        return bool(a == b)
    except ValueError:  # numpy arrays in sequence constants
        return repr(a) == repr(b)


def config_labels(tc: TaskConfig) -> list:
    """The version labels ``tc`` declares (an error message lists them)."""
    return [v.model_version for v in task_versions(tc)]


def with_version(tc: TaskConfig, version: str, model: str) -> TaskConfig:
    """``tc`` listing ``version`` with ``model`` (added or replaced)."""
    versions = list(tc.versions) or [VersionConfig(tc.model_version, tc.model)]
    versions = [v for v in versions if v.version != version] + [VersionConfig(version, model)]
    return dataclasses.replace(tc, versions=tuple(versions), model="")

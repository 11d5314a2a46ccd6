"""The whole file: ``[server]`` and ``[[tasks]]`` into a :class:`LumenConfig`, read from TOML.

Rules that join tables (a task named by ``[server] tei_task`` must exist, task names are
unique) live here; each table's own keys live with the table (``server.py``, ``tasks.py``).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..errors import ConfigError
from .schema import Reader
from .server import ServerConfig, parse_server
from .tasks import parse_task


@dataclass
class LumenConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    tasks: list = field(default_factory=list)
    source: str = "<dict>"


def parse_config(data: Mapping, source: str = "<dict>", base_dir: Optional[str] = None) -> LumenConfig:
    root = Reader(source, "", data, base_dir)
    server = parse_server(root.sub("server"))
    tables = root.get("tasks", list, [])
    tasks = []
    seen = set()
    for i, t in enumerate(tables):
        tc = parse_task(t, source, f"tasks[{i}]", base_dir)
        if tc.name in seen:
            raise ConfigError(source, f"tasks[{i}].name", f"duplicate task name {tc.name!r}")
        seen.add(tc.name)
        tasks.append(tc)
    for key in ("tei_task", "rerank_task"):  # the routes that serve one task name one
        named = getattr(server, key)
        if named and tasks and named not in seen:
            raise ConfigError(source, f"server.{key}",
                              f"names no configured task: {named!r} (tasks: "
                              f"{', '.join(sorted(seen))})")
    root.finish()
    return LumenConfig(server=server, tasks=tasks, source=source)


def model_root(cfg: LumenConfig) -> str:
    """The folder admin loads may name model files under: ``[server] model_root``, else the
    folder of the config file the runtime came from ("" when it came from no file: then an
    admin load may name no path)."""
    if cfg.server.model_root:
        return cfg.server.model_root
    src = cfg.source
    if src and not src.startswith("<") and os.path.isfile(src):
        return os.path.dirname(os.path.abspath(src))
    return ""


def read_toml(path: str) -> dict:
    """The TOML table of a config file; a missing file or bad syntax is a ConfigError."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, "<file>", "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "<syntax>", str(exc)) from None


def load_config(path: str) -> LumenConfig:
    return parse_config(read_toml(path), source=path,
                        base_dir=os.path.dirname(os.path.abspath(path)))

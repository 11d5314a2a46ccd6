"""What the ``lumen`` subcommands share: exit statuses, the runtime a command builds, the
event loop it runs on, logging, argument types and the HTTP client of ``--url``."""
from __future__ import annotations

import argparse
from typing import Callable, Optional

EXIT_OK = 0
EXIT_USAGE = 2
PROG = "lumen"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")  # lumen_core.serve.logs.LOG_FORMATS (kept import-free here)
#: `lumen infer --url` / `lumen bench`: the API key sent when --api-key is not given
API_KEY_ENV = "LUMEN_API_KEY"
API_KEY_HELP = (f"send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; the variable keeps "
                f"the key out of the process list)")
#: seconds `lumen infer --url` waits for the server
INFER_HTTP_TIMEOUT_S = 120.0


def configure_logging(level: str = "warning", access_log: bool = False,
                       log_format: str = "text") -> Callable[[], None]:
    """``level`` for everything in ``log_format`` (text or JSON lines, the request's
    correlation id on each line about one), plus the server's own lifecycle lines (one when
    ready) and the access log when asked for.  Returns the undo (lumen.serve.logs.configure)."""
    from ..serve.logs import configure

    return configure(level, log_format, access_log)


def build_runtime(config: Optional[str], only_task: Optional[str] = None):
    """The runtime of ``--config``, else the built-in default tasks; ``only_task`` keeps one."""
    from ..runtime import Runtime

    if not config:
        # `only_task` alone: the reason it cannot be served here is the error
        rt = Runtime.default(only=only_task)
    else:
        import dataclasses

        from ..config import load_config

        cfg = load_config(config)
        names = [t.name for t in cfg.tasks]
        if only_task is not None and only_task not in names:
            from ..errors import TaskNotFound

            raise TaskNotFound(f"unknown task {only_task!r}; {config} has "
                               f"{', '.join(names) or 'no tasks'}", "task")
        if only_task is not None:  # a config of that one task (the file's is left as it is)
            cfg = dataclasses.replace(cfg, tasks=[t for t in cfg.tasks if t.name == only_task])
        rt = Runtime(cfg)
    if not rt.config.tasks:
        raise ValueError("no tasks to serve: no default model is prepared. Run `lumen models "
                         "prepare` first, or pass --config lumen.toml")
    return rt


def run(coro) -> object:
    """Run on uvloop when it is installed (a faster event loop), else asyncio's."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def positive_float(text: str) -> float:
    """argparse type for CPU counts (a fraction is allowed, zero is not)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def at_least_one(text: str) -> int:
    """argparse type for counts that must be positive (0 clients or texts cannot run)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def api_key(args: argparse.Namespace) -> Optional[str]:
    """--api-key, else $LUMEN_API_KEY (None: send no key); a key that cannot be a header
    value is a ValueError."""
    import os

    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if key is not None and (not key.isprintable() or not key.isascii() or key != key.strip()):
        raise ValueError(f"the API key (--api-key / ${API_KEY_ENV}) must be printable ASCII "
                         f"without surrounding spaces")
    return key


def http(args: argparse.Namespace, path: str, data: Optional[bytes] = None,
          headers: Optional[dict] = None) -> bytes:
    """The body of ``--url`` + ``path`` (POST ``data`` when given, else GET), sent with the
    API key when there is one; Lumen's JSON error comes back as its LumenError, anything
    else as one OSError line naming the URL."""
    import json
    import urllib.error
    import urllib.request

    from ..errors import from_code

    url = f"{args.url.rstrip('/')}{path}"
    headers = {"Accept": "application/json", **(headers or {})}
    key = api_key(args)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=INFER_HTTP_TIMEOUT_S) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        try:
            err = json.loads(exc.read())["error"]
        except (ValueError, KeyError, TypeError):
            err = None
        if not (isinstance(err, dict) and isinstance(err.get("code"), str)):
            # not Lumen's error shape (a proxy, another server): say what came back
            raise OSError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        raise from_code(err.get("code", "internal"), err.get("message", ""), err.get("field")) from None
    except urllib.error.URLError as exc:  # connection refused, unknown host, TLS failure
        raise OSError(f"cannot reach the server at {args.url}: {exc.reason}") from None
    except (TimeoutError, ConnectionError) as exc:
        raise OSError(f"the server at {args.url} did not answer: {exc}") from None

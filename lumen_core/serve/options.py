"""The one rule for a request's plain (non-``lumen.*``) option keys, on every door that
carries them as free-form meta: the native HTTP route's query string and lumen.v1 gRPC's
``meta`` map (issue 38 row 9: HTTP refused an unknown key while gRPC ignored it).

A plain key that the task does not read is a 400 naming the options it does read, so a typo
such as ``normalise`` is never silently ignored; ``lumen.*`` keys are the request contract's,
checked where the request is parsed (``request.py``).
"""
from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from ..contract import RESERVED_PREFIX
from ..errors import InvalidArgument

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import RuntimeQueries

#: how alike an unknown key and a task's option must be to be suggested (difflib ratio)
OPTION_MATCH_CUTOFF = 0.75
#: the most characters of a client's key quoted back
MAX_KEY_ECHO = 200


def check_options(runtime: RuntimeQueries, task: str, keys: Iterable[str],
                  route_options: Optional[Mapping[str, Any]] = None) -> None:
    """Raise :func:`unknown_option` for the first plain key of ``keys`` that ``task`` does not
    read (``runtime.request_options``, plus ``route_options``: what the door itself reads,
    e.g. a whole audio file's options).  An unknown task passes: it answers 404 later."""
    plain = [k for k in keys if not k.startswith(RESERVED_PREFIX)]
    if not plain or not runtime.has_task(task):
        return
    known = {**runtime.request_options(task), **(route_options or {})}
    for key in plain:
        if key not in known:
            raise unknown_option(task, key, known)


def unknown_option(task: str, key: str, known: Any) -> InvalidArgument:
    """The 400 for a key ``task`` does not read: the closest option it does read (by spelling,
    or by the last part of a ``lumen.*`` name: ``dimensions`` -> ``lumen.embedding.dimensions``),
    then all of them."""
    by_tail = {name.rsplit(".", 1)[-1]: name for name in sorted(known)}
    close = difflib.get_close_matches(key, list(by_tail), n=1, cutoff=OPTION_MATCH_CUTOFF)
    hint = f" (did you mean {by_tail[close[0]]!r}?)" if close else ""
    options = ", ".join(sorted(known)) or "none"
    return InvalidArgument(f"task {task!r} has no option {key[:MAX_KEY_ECHO]!r}{hint}; its "
                           f"options are: {options}, and the lumen.* request keys of every "
                           f"task (GET /v1/tasks lists each task's request_options)",
                           key[:MAX_KEY_ECHO])


__all__ = ["OPTION_MATCH_CUTOFF", "check_options", "unknown_option"]

"""docs/configuration.md's settings tables, written from the declarations (``schema.py``).

The page holds one table per config table between marker lines
``<!-- settings:NAME -->`` and ``<!-- /settings:NAME -->``; this module writes what goes
between them, so the page says exactly what the parser takes.

    python -m lumen_core.config.docs            # print the tables
    python -m lumen_core.config.docs --write docs/configuration.md   # rewrite the page's tables
    python -m lumen_core.config.docs --check docs/configuration.md   # exit 1 if they drifted

``tests/test_config_schema.py`` runs the check.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Sequence

from .batching import BatchingConfig
from .schema import settings_table
from .sequence import SequenceConfig
from .server import ServerConfig
from .tasks import CacheConfig, TaskConfig

#: marker name -> the dataclass whose settings the table lists
TABLES = {"server": ServerConfig, "tasks": TaskConfig, "tasks.batching": BatchingConfig,
          "tasks.sequence": SequenceConfig, "tasks.cache": CacheConfig}


def _block(name: str) -> "re.Pattern[str]":
    return re.compile(rf"(<!-- settings:{re.escape(name)} -->\n)(.*?)(<!-- /settings:"
                      rf"{re.escape(name)} -->)", re.S)


def render(page: str, tables: Optional[dict] = None) -> str:
    """``page`` with every marked block's table replaced by the one the schema gives; a
    marker missing from the page is a ValueError (the page must list every table)."""
    for name, cls in (tables or TABLES).items():
        m = _block(name).search(page)
        if m is None:
            raise ValueError(f"the page has no <!-- settings:{name} --> block")
        page = page[:m.end(1)] + "\n" + settings_table(cls) + "\n" + page[m.start(3):]
    return page


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lumen_core.config.docs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", metavar="PAGE", help="rewrite PAGE's marked tables in place")
    ap.add_argument("--check", metavar="PAGE", help="exit 1 if PAGE's tables differ")
    args = ap.parse_args(argv)
    if not (args.write or args.check):
        for name, cls in TABLES.items():
            sys.stdout.write(f"[{name}]\n\n{settings_table(cls)}\n")
        return 0
    path = args.write or args.check
    with open(path, encoding="utf-8") as fh:
        page = fh.read()
    new = render(page)
    if args.check:
        if new != page:
            print(f"{path}: the settings tables differ from the schema; run "
                  f"python -m lumen_core.config.docs --write {path}", file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench``: run every benchmark's quick mode and write one JSON file (runner.py)."""
from bench.runner import main

raise SystemExit(main())

"""``python -m lumen_core.cli``: the ``lumen`` command."""
import sys

from . import main

sys.exit(main())

"""``python -m lumen_core.serve.proto``: regenerate the committed gRPC code."""
import sys

from . import generate

print(f"generated into {generate()}", file=sys.stderr)

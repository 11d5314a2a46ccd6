"""The tests' name for :mod:`lumen_core.toy_graphs` (the toy ONNX graphs moved there so that
``bench/`` shares them without importing from ``tests/``)."""
from lumen_core.toy_graphs import *  # noqa: F401,F403
from lumen_core.toy_graphs import _save  # noqa: F401

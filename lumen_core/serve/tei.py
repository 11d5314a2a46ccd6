"""Text Embeddings Inference's own routes, so a TEI client works unchanged: ``POST /embed``,
``POST /`` (what ``huggingface_hub.InferenceClient(base_url=...).feature_extraction`` sends:
the same body) and ``GET /info``.

TEI serves one model; these routes serve one task: ``[server] tei_task``, else the only
embedding task, else the first one loaded (config order).  ``/rerank`` is TEI's too; it lives
with the Cohere-style ``/v1/rerank`` in :mod:`.rerank`.  The embedding itself is
``/v1/embeddings``' (:meth:`.openai.OpenAiRoutes.embed_items`: one runtime request per input,
the same options), so the three routes give the same vectors.

``/embed`` body (TEI's): ``inputs`` (a string or a non-empty array of strings), ``normalize``,
``truncate``, ``prompt_name``, ``dimensions``, ``truncation_direction`` (``right`` only: the
model is cut at the end), ``encoding_format`` (``float`` only).  Reply: a list of vectors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract import KEY_EMBEDDING_DIMENSIONS
from ..errors import InvalidArgument, TaskNotFound
from .logs import note_task
from .openai import (
    MAX_EMBEDDING_INPUTS,
    embedding_dim,
    embeds,
    reply,
    reranks,
    tei_options,
    text_inputs,
)

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .http import HttpApp
    from .runtime_api import RuntimeQueries

#: the most inputs one /embed call may carry (as /v1/embeddings)
MAX_CLIENT_BATCH_SIZE = MAX_EMBEDDING_INPUTS
#: TEI's truncation directions; only the end of a text is ever cut here
TRUNCATION_DIRECTIONS = ("right", "Right")
#: what TEI calls the weights' type (ours are fp32 graphs, int8 ones say so in their name)
MODEL_DTYPE = "float32"


def first_task(runtime: RuntimeQueries, configured: str, fits: Any, what: str, route: str) -> str:
    """The task a one-model route serves: ``configured`` when set, else the only one that
    ``fits`` (by description), else the first in config order; 404 when none fits."""
    described = runtime.describe()
    if configured:
        if configured not in described:
            raise TaskNotFound(f"{route} serves the task [server] names ({configured!r}), which "
                               f"is not loaded", None)
        return configured
    order = {t.name: i for i, t in enumerate(runtime.config.tasks)}  # config order
    names = sorted((n for n, d in described.items() if fits(d)),
                   key=lambda n: order.get(n, len(order)))
    if not names:
        raise TaskNotFound(f"{route} needs {what} task and this server has none (tasks: "
                           f"{', '.join(sorted(described)) or 'none'})", None)
    return names[0]


class TeiRoutes:
    """``/embed``, ``/`` and ``/info`` of one :class:`~lumen_core.serve.http.HttpApp`."""

    def __init__(self, app: HttpApp):
        self.app = app
        self.runtime = app.runtime
        self.openai = app.openai

    def routes(self) -> list:
        ep = self.app.endpoint
        return [
            Route("/embed", ep("/embed", self.embed), methods=["POST"]),
            Route("/", ep("/", self.embed), methods=["POST"]),
            Route("/info", ep("/info", self.info), methods=["GET"]),
        ]

    def task(self) -> str:
        """The embedding task these routes serve."""
        return first_task(self.runtime, self.runtime.config.server.tei_task, embeds,
                          "an embedding", "/embed")

    async def embed(self, request: Request) -> Response:
        self.app.check_open()
        obj = await self.app.json_body(request, request.url.path)
        task = self.task()
        items, meta = parse_embed(obj)
        note_task(task)
        results = await self.openai.embed_items(request, task, items, meta, "inputs")
        return reply([self.openai.embedding_output(r).reshape(-1).tolist() for r in results])

    async def info(self, request: Request) -> Response:
        """TEI's ``/info`` for the task TEI's routes serve (or, on a server with rerank tasks
        only, for the rerank task)."""
        described = self.runtime.describe()
        try:
            task = self.task()
        except TaskNotFound:
            task = first_task(self.runtime, self.runtime.config.server.rerank_task, reranks,
                              "an embedding or rerank", "/info")
        d = described[task]
        model_type: dict
        if reranks(d):
            labels = int(d.get("rerank", {}).get("num_labels", 1))
            model_type = {"reranker": {"id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
                                       "label2id": {f"LABEL_{i}": i for i in range(labels)}}}
        else:
            pooling = (d.get("text_model") or {}).get("pooling") or "mean"
            model_type = {"embedding": {"pooling": pooling}}
        return reply({
            "model_id": d.get("model_id") or task, "model_sha": None, "model_dtype": MODEL_DTYPE,
            "model_type": model_type, "task": task,
            "max_concurrent_requests": self.runtime.config.server.max_connections,
            "max_input_length": d.get("max_seq_length"),
            "max_batch_tokens": d.get("max_batch_tokens"),
            "max_batch_requests": None, "max_client_batch_size": MAX_CLIENT_BATCH_SIZE,
            "auto_truncate": True, "tokenization_workers": None,
            "embedding_dim": embedding_dim(d), "prompts": d.get("prompts") or {},
            "default_prompt_name": d.get("default_prompt_name"),
            "version": self.app.version, "sha": None, "docker_label": None})


def parse_embed(obj: Any) -> tuple:
    """``(inputs, meta)`` of a TEI ``/embed`` body."""
    if not isinstance(obj, dict):
        raise InvalidArgument("the body must be a JSON object", "body")
    items = text_inputs(obj.get("inputs"), MAX_CLIENT_BATCH_SIZE)
    meta: dict = {}
    tei_options(obj, meta)
    dims: Optional[Any] = obj.get("dimensions")
    if dims is not None:
        if not isinstance(dims, int) or isinstance(dims, bool) or dims < 1:
            raise InvalidArgument(f"'dimensions' must be a positive integer, got {dims!r}",
                                  "dimensions")
        meta[KEY_EMBEDDING_DIMENSIONS] = str(dims)
    direction = obj.get("truncation_direction")
    if direction is not None and direction not in TRUNCATION_DIRECTIONS:
        raise InvalidArgument(f"'truncation_direction' must be \"right\" (a text is cut at its "
                              f"end), got {direction!r}", "truncation_direction")
    fmt = obj.get("encoding_format")
    if fmt is not None and fmt != "float":
        raise InvalidArgument(f"'encoding_format' must be \"float\" on /embed (base64 is "
                              f"/v1/embeddings'), got {fmt!r}", "encoding_format")
    return items, meta

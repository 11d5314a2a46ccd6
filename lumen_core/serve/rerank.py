"""The rerank routes: TEI's ``POST /rerank`` and Cohere's / Jina's ``POST /v1/rerank`` (also
``POST /rerank`` with a Cohere body is TEI's: the body decides nothing, the path does).

Both score each document against the query with a ``rerank`` task (``tasks/rerank.py``): one
runtime request per document, all of a call submitted together (``Runtime.infer_many``) so
that they batch together, and bounded like ``/v1/embeddings``: at most
``MAX_RERANK_DOCUMENTS`` documents a call, the body under ``[server] max_payload_bytes``.

- TEI: ``{"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"}``
  -> ``[{"index", "score"(, "text")}]`` sorted by score, highest first; ``score`` is the
  sigmoid of the model's logit unless ``raw_scores``.  The task: ``[server] rerank_task``, else
  the first rerank task.
- Cohere / Jina: ``{"model"?, "query", "documents": [str | {"text"}], "top_n"?,
  "return_documents"?}`` -> ``{"model", "results": [{"index", "relevance_score"(,
  "document": {"text"})}], "usage": {"total_tokens"}}``, the ``top_n`` best, highest first;
  ``relevance_score`` is the sigmoid.  ``model`` names a rerank task (default as TEI's).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import InvalidArgument, LumenError, TaskNotFound
from ..models.text_model import LOGITS
from ..request import InferRequest
from ..tasks.rerank import OPT_QUERY, OPT_TRUNCATE, TEXT_MIME
from .logs import note_task
from .openai import MAX_EMBEDDING_INPUTS, MAX_NAME_ECHO, check_text, reply, reranks
from .tei import TRUNCATION_DIRECTIONS, first_task

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .http import HttpApp

#: the most documents one call may score (as /v1/embeddings' inputs)
MAX_RERANK_DOCUMENTS = MAX_EMBEDDING_INPUTS


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x) without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class RerankRoutes:
    """``/rerank`` (TEI) and ``/v1/rerank`` (Cohere, Jina) of one
    :class:`~lumen_core.serve.http.HttpApp`."""

    def __init__(self, app: HttpApp):
        self.app = app
        self.runtime = app.runtime

    def routes(self) -> list:
        ep = self.app.endpoint
        return [
            Route("/rerank", ep("/rerank", self.tei), methods=["POST"]),
            Route("/v1/rerank", ep("/v1/rerank", self.cohere), methods=["POST"]),
        ]

    def _task(self, model: Any) -> str:
        """The rerank task: ``model`` when given (it must be one), else the configured one or
        the first."""
        rt = self.runtime
        if model is None:
            return first_task(rt, rt.config.server.rerank_task, reranks, "a rerank", "/rerank")
        names = sorted(n for n, d in rt.describe().items() if reranks(d))
        if not isinstance(model, str) or not rt.has_task(model):
            raise TaskNotFound(f"unknown model {str(model)[:MAX_NAME_ECHO]!r}; the rerank tasks "
                               f"are: {', '.join(names) or 'none on this server'}", "model")
        if model not in names:
            raise InvalidArgument(f"task {model!r} does not rerank; the rerank tasks are: "
                                  f"{', '.join(names) or 'none on this server'}", "model")
        return model

    async def _scores(self, request: Request, task: str, query: Any, docs: list, field: str,
                      truncate: Any) -> tuple:
        """``(logits, tokens)``: the first logit of each document against ``query``, and the
        tokens of every pair."""
        if not isinstance(query, str) or not query:
            raise InvalidArgument("'query' must be a non-empty string", "query")
        check_text(query, "query")
        if not docs:
            raise InvalidArgument(f"'{field}' must be a non-empty array", field)
        if len(docs) > MAX_RERANK_DOCUMENTS:
            raise InvalidArgument(f"'{field}' has {len(docs)} items; at most "
                                  f"{MAX_RERANK_DOCUMENTS} per call", field)
        meta = {OPT_QUERY: query}
        if truncate is not None:
            if not isinstance(truncate, bool):
                raise InvalidArgument(f"'truncate' must be true or false, got {truncate!r}",
                                      "truncate")
            meta[OPT_TRUNCATE] = "true" if truncate else "false"
        cid = request.headers.get("x-correlation-id", "")
        reqs = []
        for i, doc in enumerate(docs):
            check_text(doc, f"{field}[{i}]")
            reqs.append(InferRequest(task, doc, TEXT_MIME, dict(meta), f"{cid}-{i}" if cid else ""))
        note_task(task)
        results = await self.app.until_done_or_gone(request, self.runtime.infer_many(reqs))
        logits, tokens = [], 0
        for i, res in enumerate(results):
            if isinstance(res, LumenError):
                if res.field == "payload":
                    res.field = f"{field}[{i}]"
                    res.message = f"{field}[{i}]: {res.message}"
                raise res
            logits.append(float(res.outputs[LOGITS].reshape(-1)[0]))
            if res.stats is not None:
                tokens += res.stats.tokens
        return logits, tokens

    async def tei(self, request: Request) -> Response:
        self.app.check_open()
        obj = await self.app.json_body(request, "/rerank")
        if not isinstance(obj, dict):
            raise InvalidArgument("the body must be a JSON object", "body")
        texts = obj.get("texts")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise InvalidArgument("'texts' must be a non-empty array of strings", "texts")
        raw, with_text = obj.get("raw_scores", False), obj.get("return_text", False)
        for key, v in (("raw_scores", raw), ("return_text", with_text)):
            if not isinstance(v, bool):
                raise InvalidArgument(f"'{key}' must be true or false, got {v!r}", key)
        direction = obj.get("truncation_direction")
        if direction is not None and direction not in TRUNCATION_DIRECTIONS:
            raise InvalidArgument(f"'truncation_direction' must be \"right\", got {direction!r}",
                                  "truncation_direction")
        task = self._task(None)
        logits, _ = await self._scores(request, task, obj.get("query"), texts, "texts",
                                       obj.get("truncate"))
        out = []
        for i, x in enumerate(logits):
            entry: dict = {"index": i, "score": x if raw else sigmoid(x)}
            if with_text:
                entry["text"] = texts[i]
            out.append(entry)
        out.sort(key=lambda e: -e["score"])
        return reply(out)

    async def cohere(self, request: Request) -> Response:
        self.app.check_open()
        obj = await self.app.json_body(request, "/v1/rerank")
        if not isinstance(obj, dict):
            raise InvalidArgument("the body must be a JSON object", "body")
        task = self._task(obj.get("model"))
        docs = obj.get("documents")
        if not isinstance(docs, list):
            raise InvalidArgument("'documents' must be a non-empty array of strings (or of "
                                  "{\"text\": ...} objects)", "documents")
        texts = []
        for i, d in enumerate(docs):
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str):
                raise InvalidArgument(f"documents[{i}] must be a string or {{\"text\": "
                                      f"string}}", f"documents[{i}]")
            texts.append(text)
        top_n = obj.get("top_n")
        if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool)
                                  or top_n < 1):
            raise InvalidArgument(f"'top_n' must be a positive integer, got {top_n!r}", "top_n")
        with_docs = obj.get("return_documents", False)
        if not isinstance(with_docs, bool):
            raise InvalidArgument(f"'return_documents' must be true or false, got {with_docs!r}",
                                  "return_documents")
        logits, tokens = await self._scores(request, task, obj.get("query"), texts, "documents",
                                            obj.get("truncate"))
        order = sorted(range(len(logits)), key=lambda i: -logits[i])[:top_n]
        results = []
        for i in order:
            entry: dict = {"index": i, "relevance_score": sigmoid(logits[i])}
            if with_docs:
                entry["document"] = {"text": texts[i]}
            results.append(entry)
        return reply({"model": task, "results": results,
                      "usage": {"total_tokens": tokens}})

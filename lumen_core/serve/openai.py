"""The OpenAI- and TEI-compatible routes of the HTTP app: ``POST /v1/embeddings`` (OpenAI's
embeddings, with ``dimensions`` and the extensions ``embedding_type``, ``truncate`` and
``normalize``), ``POST /v1/tokenize`` (TEI's ``/tokenize``) and ``GET /v1/models``.

Like :class:`~lumen_core.serve.oip.OipRoutes` and :class:`~lumen_core.serve.admin.AdminRoutes`,
:class:`OpenAiRoutes` reuses its :class:`~lumen_core.serve.http.HttpApp`'s public helpers (the
endpoint wrapper with its API keys, error shape and metrics, the body reader, the disconnect
watch).  One runtime request per input item; ``model`` picks the embedding task.
"""
from __future__ import annotations

import re
import time
from typing import Any, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract import EMBEDDING_TYPES as EMBEDDING_TYPE_DTYPES
from ..contract import KEY_EMBEDDING_DIMENSIONS, KEY_EMBEDDING_TYPE
from ..errors import InvalidArgument, LumenError, TaskNotFound
from ..request import InferRequest
from . import codec
from .logs import note_task

JSON = "application/json"
#: the most inputs one /v1/embeddings call may carry (OpenAI's own limit)
MAX_EMBEDDING_INPUTS = 2048
#: the output /v1/embeddings returns when a task has several
EMBEDDING_OUTPUT = "embedding"
ENCODING_FORMATS = ("float", "base64")
#: ``embedding_type`` values of /v1/embeddings (``lumen.embedding.type`` on the native route)
EMBEDDING_TYPES = tuple(EMBEDDING_TYPE_DTYPES)
#: the boolean plain options of /v1/embeddings and /v1/tokenize, sent to the task as meta
OPT_TRUNCATE = "truncate"
OPT_NORMALIZE = "normalize"
#: the most characters of an unknown model name quoted back
MAX_NAME_ECHO = 200
#: a lone UTF-16 surrogate (JSON can carry one as \ud800): no encoding can represent it
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reply(obj: Any) -> Response:
    return Response(codec.dumps(obj), media_type=JSON)


class OpenAiRoutes:
    """``/v1/embeddings``, ``/v1/tokenize`` (each also without ``/v1``, as OpenAI and TEI
    clients call them) and ``/v1/models`` of one :class:`~lumen_core.serve.http.HttpApp`."""

    def __init__(self, app: Any):
        self.app = app
        self.runtime = app.runtime

    def routes(self) -> list:
        ep = self.app.endpoint
        return [
            Route("/v1/embeddings", ep("/v1/embeddings", self.embeddings), methods=["POST"]),
            Route("/embeddings", ep("/v1/embeddings", self.embeddings), methods=["POST"]),
            Route("/v1/tokenize", ep("/v1/tokenize", self.tokenize), methods=["POST"]),
            Route("/tokenize", ep("/v1/tokenize", self.tokenize), methods=["POST"]),
            Route("/v1/models", ep("/v1/models", self.models), methods=["GET"]),
        ]

    def _embedding_tasks(self) -> dict:
        """``{task: its description}`` of the tasks that produce embeddings."""
        return {name: d for name, d in self.runtime.describe().items() if embeds(d)}

    def _embedding_task(self, model: str) -> Optional[dict]:
        """The description of embedding task ``model``; None when no such task is loaded (the
        runtime answers that: 404, or 503 while it is not running); 400 for a task that does
        not embed, naming those that do."""
        rt = self.runtime
        if not rt.has_task(model):
            return None
        try:
            desc = rt.describe(model)
        except TaskNotFound:  # removed meanwhile
            return None
        if not embeds(desc):
            names = sorted(self._embedding_tasks())
            raise InvalidArgument(f"task {model!r} does not produce embeddings; the models that "
                                  f"embed are: {', '.join(names) or 'none on this server'}",
                                  "model")
        return desc

    async def embeddings(self, request: Request) -> Response:
        self.app.check_open()
        obj = await self.app.json_body(request, "/v1/embeddings")
        model, items, fmt, meta = self._parse_embeddings(obj)
        note_task(model)  # the access line names the task (the path does not)
        desc = self._embedding_task(model)
        if desc is not None and (KEY_EMBEDDING_DIMENSIONS in meta or KEY_EMBEDDING_TYPE in meta) \
                and not isinstance(desc.get("embedding"), dict):
            field = "dimensions" if KEY_EMBEDDING_DIMENSIONS in meta else "embedding_type"
            raise InvalidArgument(f"task {model!r} returns its embedding as the model gives it; "
                                  f"it takes no {field!r} (omit the field)", field)
        if desc is not None and KEY_EMBEDDING_DIMENSIONS in meta:
            dim = embedding_dim(desc)
            if dim is not None and not 1 <= obj["dimensions"] <= dim:
                raise InvalidArgument(f"'dimensions' must be in 1..{dim} (the embedding size of "
                                      f"{model!r}), got {obj['dimensions']}", "dimensions")
        cid = request.headers.get("x-correlation-id", "")
        truncate = meta.get(OPT_TRUNCATE) != "false"
        reqs = [self._embedding_request(model, item, f"{cid}-{i}" if cid else "",
                                        "input" if len(items) == 1 else f"input[{i}]", truncate)
                for i, item in enumerate(items)]
        if meta:
            for r in reqs:
                r.meta.update(meta)
        rt = self.runtime
        try:
            if len(reqs) == 1:
                try:
                    results = [await self.app.until_done_or_gone(request, rt.infer(reqs[0]))]
                except LumenError as exc:
                    if exc.field == "payload":  # the body's name for the text
                        exc.field = "input"
                    raise
            else:
                # each item is its own request (batched by the runtime) and has its own
                # outcome; the first error in index order answers the call, as one bad input
                # fails an OpenAI request, naming the item
                results = await self.app.until_done_or_gone(request, rt.infer_many(reqs))
                for i, res in enumerate(results):
                    if isinstance(res, LumenError):
                        if res.field == "payload":
                            res.field = f"input[{i}]"
                            res.message = f"input[{i}]: {res.message}"
                        raise res
        except TaskNotFound as exc:
            raise TaskNotFound(exc.message, "model") from None
        except InvalidArgument as exc:  # the task's name for an option -> the body's field
            if exc.field in _OPTION_FIELDS:
                raise InvalidArgument(exc.message, _OPTION_FIELDS[exc.field]) from None
            raise
        data = []
        tokens = 0
        for i, res in enumerate(results):
            vec = self._embedding_output(res)
            emb: Any = (codec.b64_tensor(vec) if fmt == "base64"
                        else vec.reshape(-1).tolist())
            data.append({"object": "embedding", "index": i, "embedding": emb})
            if res.stats is not None:
                tokens += res.stats.tokens
        return _reply({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _parse_embeddings(self, obj: Any) -> tuple:
        if not isinstance(obj, dict):
            raise InvalidArgument("the body must be a JSON object", "body")
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidArgument("'model' must name a task, e.g. \"text_embed\"", "model")
        fmt = obj.get("encoding_format")
        if fmt is None:  # absent or null: float (OpenAI's default); "", 0, false are errors
            fmt = "float"
        if not isinstance(fmt, str) or fmt not in ENCODING_FORMATS:
            raise InvalidArgument(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, "
                                  f"got {fmt!r}", "encoding_format")
        meta: dict = {}
        dims = obj.get("dimensions")
        if dims is not None:
            if not isinstance(dims, int) or isinstance(dims, bool):
                raise InvalidArgument(f"'dimensions' must be an integer from 1 to the model's "
                                      f"embedding size, got {dims!r}", "dimensions")
            meta[KEY_EMBEDDING_DIMENSIONS] = str(dims)
        etype = obj.get("embedding_type")
        if etype is not None and etype != "float":
            if etype not in EMBEDDING_TYPES:
                raise InvalidArgument(f"'embedding_type' must be one of "
                                      f"{', '.join(EMBEDDING_TYPES)}, got {etype!r}",
                                      "embedding_type")
            if fmt == "base64":
                # a base64 string reads as float32 to every OpenAI client (the official one
                # asks for base64 by default and decodes it so): integers would be misread
                raise InvalidArgument(f"embedding_type {etype!r} returns integers; send "
                                      f"\"encoding_format\": \"float\" with it (base64 is "
                                      f"float32 only, and the openai client asks for base64 "
                                      f"unless told otherwise)", "encoding_format")
            meta[KEY_EMBEDDING_TYPE] = etype
        for key in (OPT_TRUNCATE, OPT_NORMALIZE):  # TEI's /embed flags, extensions here
            flag = obj.get(key)
            if flag is not None:
                if not isinstance(flag, bool):
                    raise InvalidArgument(f"'{key}' must be true or false, got {flag!r}", key)
                meta[key] = "true" if flag else "false"
        inp = obj.get("input")
        if isinstance(inp, str):
            items: list = [inp]
        elif isinstance(inp, list) and inp and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in inp):
            items = [inp]  # one input given as token ids
        elif isinstance(inp, list) and inp:
            items = inp
        else:
            raise InvalidArgument("'input' must be a string, a non-empty array of strings, or "
                                  "token ids", "input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise InvalidArgument(f"'input' has {len(items)} items; at most "
                                  f"{MAX_EMBEDDING_INPUTS} per call", "input")
        return model, items, fmt, meta

    async def tokenize(self, request: Request) -> Response:
        """TEI's ``/tokenize``: ``{"inputs": str | [str], "model"?, "truncate"?}`` -> per text
        a list of ``{"id", "text", "special", "start", "stop"}`` (character offsets), cut as
        the task cuts what it embeds unless ``truncate`` is false.  ``model`` may be left out
        when one task tokenizes."""
        self.app.check_open()
        obj = await self.app.json_body(request, "/v1/tokenize")
        if not isinstance(obj, dict):
            raise InvalidArgument("the body must be a JSON object", "body")
        inp = obj.get("inputs", obj.get("input"))
        if isinstance(inp, str):
            texts = [inp]
        elif isinstance(inp, list) and inp and all(isinstance(t, str) for t in inp):
            texts = inp
        else:
            raise InvalidArgument("'inputs' must be a string or a non-empty array of strings",
                                  "inputs")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise InvalidArgument(f"'inputs' has {len(texts)} items; at most "
                                  f"{MAX_EMBEDDING_INPUTS} per call", "inputs")
        for i, text in enumerate(texts):
            bad = None if text.isascii() else _SURROGATE.search(text)
            if bad is not None:
                raise InvalidArgument(f"inputs[{i}] holds a lone UTF-16 surrogate "
                                      f"(U+{ord(bad.group()):04X}): not a valid Unicode string",
                                      "inputs")
        truncate = obj.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InvalidArgument(f"'truncate' must be true or false, got {truncate!r}", "truncate")
        rt = self.runtime
        tokenizers = sorted(n for n, d in rt.describe().items() if d.get("tokenizer"))
        model = obj.get("model")
        if model is None:
            if len(tokenizers) != 1:
                raise InvalidArgument(f"name the task in 'model': the tasks that tokenize are "
                                      f"{', '.join(tokenizers) or 'none on this server'}", "model")
            model = tokenizers[0]
        elif not isinstance(model, str) or not rt.has_task(model):
            raise TaskNotFound(f"unknown model {str(model)[:MAX_NAME_ECHO]!r}; the tasks that "
                               f"tokenize are {', '.join(tokenizers) or 'none'}", "model")
        elif model not in tokenizers:
            raise InvalidArgument(f"task {model!r} does not tokenize text; the tasks that do "
                                  f"are {', '.join(tokenizers) or 'none on this server'}", "model")
        return _reply(await rt.tokenize(model, texts, truncate))

    def _embedding_request(self, model: str, item: Any, cid: str, field: str,
                           truncate: bool = True) -> InferRequest:
        """A text goes as the ``str`` itself (no encode here, no decode in the task); token ids
        go through the tensor route under the preprocess id the task declares for them (the
        tokenizer contract stays the task's: the runtime builds that request)."""
        rt = self.runtime
        if isinstance(item, str):
            if not item.isascii():
                bad = _SURROGATE.search(item)
                if bad is not None:
                    raise InvalidArgument(f"{field} holds a lone UTF-16 surrogate "
                                          f"(U+{ord(bad.group()):04X}) at character {bad.start()}:"
                                          f" not a valid Unicode string", field)
            return rt.text_request(model, item, cid)
        if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in item):
            if not rt.has_task(model):
                # no contract to ask: infer answers it like any request for an unknown task
                # (404, or 503 while the runtime is not running)
                return rt.text_request(model, "", cid)
            return rt.token_ids_request(model, item, cid, field, truncate)
        raise InvalidArgument("each 'input' item must be a string or an array of token ids", "input")

    @staticmethod
    def _embedding_output(res: Any) -> np.ndarray:
        outs = res.outputs
        if EMBEDDING_OUTPUT in outs:
            return outs[EMBEDDING_OUTPUT]
        if len(outs) == 1:
            return next(iter(outs.values()))
        raise InvalidArgument(f"task {res.task!r} has no {EMBEDDING_OUTPUT!r} output "
                              f"(outputs: {', '.join(outs)}); use /v1/infer/{res.task}", "model")

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        described = self.runtime.describe()
        data = []
        for name in self.runtime.task_names():
            entry: dict = {"id": name, "object": "model", "created": created, "owned_by": "lumen"}
            d = described.get(name)
            if d is not None and embeds(d):
                entry["capabilities"] = ["embed"]
                dim = embedding_dim(d)
                if dim is not None:
                    entry["embedding_dim"] = dim
                card = d.get("model_card")
                if isinstance(card, dict):  # what the model is and measured (the task's card)
                    entry["description"] = card.get("summary", "")
                    entry["model_card"] = card
            else:
                entry["capabilities"] = []
            data.append(entry)
        return _reply({"object": "list", "data": data})


#: a task's option names (its error fields) -> the /v1/embeddings body fields that set them
_OPTION_FIELDS = {KEY_EMBEDDING_DIMENSIONS: "dimensions", KEY_EMBEDDING_TYPE: "embedding_type"}


def embeds(desc: dict) -> bool:
    """Whether a task (by its description) produces embeddings: it says so (``embedding``),
    or it has an ``embedding`` output."""
    if desc.get("embedding") or desc.get("output") == EMBEDDING_OUTPUT:
        return True
    outs = desc.get("outputs")
    return isinstance(outs, dict) and EMBEDDING_OUTPUT in outs


def embedding_dim(desc: dict) -> Optional[int]:
    """The embedding size a task declares, when it declares one."""
    emb = desc.get("embedding")
    if isinstance(emb, dict) and isinstance(emb.get("dim"), int):
        return emb["dim"]
    outs = desc.get("outputs")
    spec = outs.get(EMBEDDING_OUTPUT) if isinstance(outs, dict) else None
    if isinstance(spec, (list, tuple)) and len(spec) == 2 and isinstance(spec[1], list) \
            and len(spec[1]) == 1 and isinstance(spec[1][0], int):
        return spec[1][0]
    return None

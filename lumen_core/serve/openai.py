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
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract import EMBEDDING_TYPES as EMBEDDING_TYPE_DTYPES
from ..contract import KEY_EMBEDDING_DIMENSIONS, KEY_EMBEDDING_TYPE
from ..errors import InvalidArgument, LumenError, TaskNotFound
from ..request import InferRequest
from . import codec
from .door import EMBEDDINGS_ROUTE
from .logs import note_task

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .http import HttpApp

JSON = codec.JSON
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
#: the prompt a text model puts before the text (TEI's name; tasks/text_prompts.py)
OPT_PROMPT_NAME = "prompt_name"
#: the most characters of an unknown model name quoted back
MAX_NAME_ECHO = 200
#: a lone UTF-16 surrogate (JSON can carry one as \ud800): no encoding can represent it
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reply(obj: Any) -> Response:
    return Response(codec.dumps(obj), media_type=JSON)


class OpenAiRoutes:
    """``/v1/embeddings``, ``/v1/tokenize`` (each also without ``/v1``, as OpenAI and TEI
    clients call them) and ``/v1/models`` of one :class:`~lumen_core.serve.http.HttpApp`."""

    def __init__(self, app: HttpApp):
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
        """``POST /v1/embeddings``: the hot door's steps (door.py), from the Starlette app."""
        return await self.app.door.answer(request, EMBEDDINGS_ROUTE)

    # -- the halves the hot door runs (door.py), whoever carries the request ----------------
    def call_request(self, call: Any, body: bytes) -> Any:
        """The runtime request of a ``/v1/embeddings`` call (a :class:`.door.Call`), or the
        list of them when ``input`` has several items; what the reply needs is kept on
        ``call.state``."""
        obj = codec.loads(body, "the body", "body")
        model, items, fmt, meta = self._parse_embeddings(obj)
        note_task(model)  # the access line names the task (the path does not)
        reqs = self.embedding_requests(model, items, meta, "input", call.cid)
        call.state = (model, fmt, len(reqs))
        return reqs[0] if len(reqs) == 1 else reqs

    def call_reply(self, call: Any, results: list) -> bytes:
        """The ``/v1/embeddings`` reply body of ``results`` (one response per input item)."""
        model, fmt, _n = call.state
        data = []
        tokens = 0
        for i, res in enumerate(results):
            vec = self.embedding_output(res)
            emb: Any = (codec.b64_tensor(vec) if fmt == "base64"
                        else vec.reshape(-1).tolist())
            data.append({"object": "embedding", "index": i, "embedding": emb})
            if res.stats is not None:
                tokens += res.stats.tokens
        return codec.dumps({"object": "list", "data": data, "model": model,
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @staticmethod
    def call_results(results: list) -> list:
        """The responses of a call's several inputs (``infer_many``'s results), or the first
        item's error, named ``input[i]``."""
        return first_error(results, "input")

    @staticmethod
    def call_error(exc: LumenError) -> LumenError:
        """``exc`` of a ``/v1/embeddings`` call under the body's field names."""
        return embedding_error(exc, "input")

    async def embed_items(self, request: Request, model: str, items: list, meta: dict,
                          field: str) -> list:
        """The responses of embedding task ``model`` for ``items`` (texts or token-id lists),
        each its own runtime request with ``meta`` (TEI's ``/embed`` and ``/``); the first
        error in index order answers the call, naming ``field[i]``."""
        cid = request.headers.get("x-correlation-id", "")
        reqs = self.embedding_requests(model, items, meta, field, cid)
        rt = self.runtime
        try:
            if len(reqs) == 1:
                return [await self.app.until_done_or_gone(request, rt.infer(reqs[0]))]
            results = await self.app.until_done_or_gone(request, rt.infer_many(reqs))
        except LumenError as exc:
            raise embedding_error(exc, field) from None
        return first_error(results, field)

    def embedding_requests(self, model: str, items: list, meta: dict, field: str,
                           cid: str) -> list:
        """The runtime requests of embedding task ``model`` for ``items`` (texts or token-id
        lists), each with ``meta``; the per-call options checked against the task first."""
        desc = self._embedding_task(model)
        if desc is not None and (KEY_EMBEDDING_DIMENSIONS in meta or KEY_EMBEDDING_TYPE in meta) \
                and not isinstance(desc.get("embedding"), dict):
            key = "dimensions" if KEY_EMBEDDING_DIMENSIONS in meta else "embedding_type"
            raise InvalidArgument(f"task {model!r} returns its embedding as the model gives it; "
                                  f"it takes no {key!r} (omit the field)", key)
        if desc is not None and KEY_EMBEDDING_DIMENSIONS in meta:
            dim = embedding_dim(desc)
            asked = int(meta[KEY_EMBEDDING_DIMENSIONS])
            if dim is not None and not 1 <= asked <= dim:
                raise InvalidArgument(f"'dimensions' must be in 1..{dim} (the embedding size of "
                                      f"{model!r}), got {asked}", "dimensions")
        truncate = meta.get(OPT_TRUNCATE) != "false"
        reqs = [self._embedding_request(model, item, f"{cid}-{i}" if cid else "",
                                        field if len(items) == 1 else f"{field}[{i}]", truncate)
                for i, item in enumerate(items)]
        if meta:
            for r in reqs:
                r.meta.update(meta)
        return reqs

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
        tei_options(obj, meta)  # TEI's /embed flags and prompt_name, extensions here
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
        texts = text_inputs(obj.get("inputs", obj.get("input")), MAX_EMBEDDING_INPUTS)
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
            check_text(item, field)
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
    def embedding_output(res: Any) -> np.ndarray:
        """The embedding of one response: its ``embedding`` output, or its only output."""
        outs = res.outputs
        if EMBEDDING_OUTPUT in outs:
            return outs[EMBEDDING_OUTPUT]
        if len(outs) == 1:
            return next(iter(outs.values()))
        raise InvalidArgument(f"task {res.task!r} has no {EMBEDDING_OUTPUT!r} output "
                              f"(outputs: {', '.join(outs)}); use /v1/infer/{res.task}", "model")

    async def models(self, request: Request) -> Response:
        """Every task as an OpenAI model entry, with what it can do (``capabilities``:
        ``embed``, ``rerank``) and, for text models, the model it runs, its embedding size,
        sequence length and prompts."""
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
            elif d is not None and reranks(d):
                entry["capabilities"] = ["rerank"]
            else:
                entry["capabilities"] = []
            if d is not None:
                for key in ("model_id", "max_seq_length", "prompts", "default_prompt_name"):
                    if key in d:
                        entry[key] = d[key]
            data.append(entry)
        return _reply({"object": "list", "data": data})


#: a task's option names (its error fields) -> the /v1/embeddings body fields that set them
_OPTION_FIELDS = {KEY_EMBEDDING_DIMENSIONS: "dimensions", KEY_EMBEDDING_TYPE: "embedding_type"}


def first_error(results: list, field: str) -> list:
    """The results of ``infer_many`` for one call's items: each item is its own request with
    its own outcome, and the first error in index order answers the call (as one bad input
    fails an OpenAI request), naming the item."""
    for i, res in enumerate(results):
        if isinstance(res, LumenError):
            raise embedding_error(res, field, i)
    return results


def embedding_error(exc: LumenError, field: str, index: Optional[int] = None) -> LumenError:
    """A runtime error of an embedding call under the body's names: the text is ``field``
    (``field[index]`` for one item of several), the task is ``model``, a task option the
    field that set it."""
    if isinstance(exc, TaskNotFound):
        return TaskNotFound(exc.message, "model")
    if exc.field == "payload":  # the runtime's name for the text
        if index is None:
            exc.field = field
        else:
            exc.field = f"{field}[{index}]"
            exc.message = f"{field}[{index}]: {exc.message}"
        return exc
    if isinstance(exc, InvalidArgument) and exc.field in _OPTION_FIELDS:
        return InvalidArgument(exc.message, _OPTION_FIELDS[exc.field])
    return exc


def tei_options(obj: dict, meta: dict) -> None:
    """TEI's ``truncate`` / ``normalize`` flags and ``prompt_name`` of a JSON body, into the
    task's request ``meta`` (the task checks the prompt name against its model's)."""
    for key in (OPT_TRUNCATE, OPT_NORMALIZE):
        flag = obj.get(key)
        if flag is not None:
            if not isinstance(flag, bool):
                raise InvalidArgument(f"'{key}' must be true or false, got {flag!r}", key)
            meta[key] = "true" if flag else "false"
    prompt = obj.get(OPT_PROMPT_NAME)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidArgument(f"'{OPT_PROMPT_NAME}' must be a string naming one of the "
                                  f"model's prompts (GET /v1/models lists them), got "
                                  f"{type(prompt).__name__}", OPT_PROMPT_NAME)
        meta[OPT_PROMPT_NAME] = prompt


def text_inputs(inp: Any, most: int) -> list:
    """TEI's ``inputs`` (a string or a non-empty array of at most ``most`` strings) as a list,
    each a valid Unicode string; 400 naming ``inputs`` otherwise."""
    if isinstance(inp, str):
        texts = [inp]
    elif isinstance(inp, list) and inp and all(isinstance(t, str) for t in inp):
        texts = inp
    else:
        raise InvalidArgument("'inputs' must be a string or a non-empty array of strings",
                              "inputs")
    if len(texts) > most:
        raise InvalidArgument(f"'inputs' has {len(texts)} items; at most {most} per call",
                              "inputs")
    for i, text in enumerate(texts):
        check_text(text, "inputs" if len(texts) == 1 else f"inputs[{i}]")
    return texts


def check_text(text: str, field: str) -> None:
    """A lone UTF-16 surrogate (JSON can carry one) is no text: 400 naming ``field``."""
    if not text.isascii():
        bad = _SURROGATE.search(text)
        if bad is not None:
            raise InvalidArgument(f"{field} holds a lone UTF-16 surrogate "
                                  f"(U+{ord(bad.group()):04X}) at character {bad.start()}: "
                                  f"not a valid Unicode string", field)


def reply(obj: Any) -> Response:
    """A JSON response of ``obj`` (the routes classes' shared encoder)."""
    return _reply(obj)


def embeds(desc: dict) -> bool:
    """Whether a task (by its description) produces embeddings: it says so (``embedding``),
    or it has an ``embedding`` output."""
    if desc.get("embedding") or desc.get("output") == EMBEDDING_OUTPUT:
        return True
    outs = desc.get("outputs")
    return isinstance(outs, dict) and EMBEDDING_OUTPUT in outs


def reranks(desc: dict) -> bool:
    """Whether a task (by its description) scores (query, document) pairs: a ``rerank``
    backend says so (``rerank``)."""
    return isinstance(desc.get("rerank"), dict)


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

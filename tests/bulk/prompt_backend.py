"""A text_embedding backend with prompts, for the ``--prompt-name`` test: the built-in backend
does not read ``prompt_name`` yet (imported sentence-transformers models will), so this one
reads it the way such a model does -- a named prefix put before the text -- and lists it among
its request options."""
from __future__ import annotations

from lumen_core.errors import InvalidArgument
from lumen_core.tasks.text_embedding import TextEmbeddingBackend

PROMPTS = {"query": "query: ", "passage": "passage: "}


class PromptBackend(TextEmbeddingBackend):
    request_options = {**TextEmbeddingBackend.request_options,
                       "prompt_name": f"one of {', '.join(PROMPTS)}: its text before the input"}

    def prepare_raw(self, req, desc, payload, mime, params):
        name = (req.meta or {}).get("prompt_name")
        if name is not None:
            if name not in PROMPTS:
                raise InvalidArgument(f"unknown prompt_name {name!r}; the prompts are "
                                      f"{', '.join(PROMPTS)}", "prompt_name")
            text = payload if isinstance(payload, str) else str(payload, "utf-8")
            payload = PROMPTS[name] + text
        return super().prepare_raw(req, desc, payload, mime, params)

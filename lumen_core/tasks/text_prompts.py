"""A text model's prompts, applied as sentence-transformers applies them.

``SentenceTransformer.encode(texts, prompt_name=...)`` puts the prompt's text before each
input (``prompt + text``; the model's ``default_prompt_name`` when none is named), and its
``Transformer`` module lower-cases the whole string when the folder says ``do_lower_case``;
then it tokenizes.  :class:`Prompts` does the same to a request's text, the prompt chosen by the
request's ``prompt_name`` option (TEI's name; ``/v1/embeddings``' ``prompt_name`` field, the
native route's ``?prompt_name=``, ``/embed``'s field).  An unknown name is a 400 listing the
model's prompts.

The rules themselves (which prompt a name selects, prompt first, then lower-casing) are the
model side's (``models/text_tokenize.py``: ``choose_prompt``, ``model_text``), which the
importer's checks against sentence-transformers use too; this module adds the request side
(the option, the 400, the fast path).

Token ids sent on the tensor route are embedded as sent: a prompt applies to text only.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ..errors import InvalidArgument
from ..models.text_tokenize import UnknownPrompt, choose_prompt, model_text

#: the plain request option naming the prompt (TEI's name)
OPT_PROMPT_NAME = "prompt_name"
#: the most characters of an unknown prompt name quoted back
MAX_NAME_ECHO = 100


class Prompts:
    """``prompts`` (name -> prefix text), the default one, and lower-casing."""

    __slots__ = ("prompts", "default", "lower", "identity")

    def __init__(self, prompts: Mapping[str, str], default: Optional[str], lower: bool):
        self.prompts = dict(prompts)
        self.default = default
        self.lower = lower
        #: True when a request without options embeds its text unchanged (no default prompt,
        #: no lower-casing): the compiled fast path may tokenize it as it is (an attribute,
        #: not a property: the request path reads it per text)
        self.identity = not lower and not (default and self.prompts.get(default))

    def prefix(self, meta: Any, task: str) -> str:
        """The prompt text ``meta`` asks (``prompt_name``), else the default prompt's, else ""."""
        name = meta.get(OPT_PROMPT_NAME) if meta else None
        try:
            return choose_prompt(self.prompts, self.default, name)
        except UnknownPrompt:
            shown = name[:MAX_NAME_ECHO] if isinstance(name, str) else type(name).__name__
            listed = ", ".join(repr(n) for n in self.prompts) or "none (it takes no prompt_name)"
            raise InvalidArgument(f"unknown prompt_name {shown!r} for task {task!r}; the "
                                  f"model's prompts are: {listed}", OPT_PROMPT_NAME) from None

    def apply(self, text: str, meta: Any, task: str) -> str:
        """``text`` as the model reads it: the prompt first, lower-cased if the model says so."""
        return model_text(self.prefix(meta, task), text, self.lower)

    def encoder(self, encode: Callable[[str], Any]) -> Callable[[str], Any]:
        """``encode`` of a request without options (the fast path's): with the default
        prompt and lower-casing applied first when the model has them."""
        if self.identity:
            return encode
        prefix, lower = choose_prompt(self.prompts, self.default, None), self.lower
        return lambda text: encode(model_text(prefix, text, lower))

    def check_tensor(self, meta: Any, task: str) -> None:
        """Token ids are embedded as sent: naming a prompt with them is a 400 (the caller
        would believe it applied)."""
        if meta and meta.get(OPT_PROMPT_NAME) is not None:
            raise InvalidArgument(f"prompt_name applies to text; task {task!r} embeds token ids "
                                  f"as sent (put the prompt's tokens in the ids, or send text)",
                                  OPT_PROMPT_NAME)

    def describe(self) -> dict:
        return {"prompts": dict(self.prompts), "default_prompt_name": self.default}

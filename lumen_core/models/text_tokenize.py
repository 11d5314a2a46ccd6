"""Tokenising for an imported text model the way sentence-transformers does, into the graph's
two inputs (pure: the serving side and the tests share it).

- embed: ``text = prompt + text`` (the prompt chosen by name; the model's default prompt when
  none is named, as ``encode`` does), lower-cased first when ``do_lower_case``, truncated to
  ``max_seq_length`` tokens including the special tokens (the prepared ``tokenizer.json``
  carries that truncation and no padding);
- rerank: the pair (query, document) encoded together, truncated ``longest_first`` to
  ``max_seq_length``, as ``CrossEncoder.predict`` does: :class:`PairTemplate` (the special
  tokens of the tokenizer's pair encoding) and :func:`longest_first` (the Rust tokenizers'
  rule), which the ``rerank`` task uses too (it tokenizes a long document by prefix).

Rows are right-padded with ``pad_token_id``; the mask is 1 on real tokens.  This module is the
one home of these rules: the serving side (``tasks/text_prompts.py``, ``tasks/rerank.py``)
calls it, so a served vector is fed exactly as the importer's reference checks feed it.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str, max_length: int) -> Any:
    """``tokenizers.Tokenizer`` from ``path``, truncating to ``max_length`` (0: not at all),
    never padding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    if max_length:
        tok.enable_truncation(max_length)
    else:
        tok.no_truncation()
    tok.no_padding()
    return tok


class UnknownPrompt(ValueError):
    """A ``prompt_name`` the model does not have (``.name``; ``.known``: the model's)."""

    def __init__(self, name: Any, known: Sequence[str]):
        self.name, self.known = name, list(known)
        super().__init__(f"unknown prompt_name {name!r}; this model's prompts: "
                         f"{', '.join(sorted(self.known)) or 'none'}")


def choose_prompt(prompts: Mapping[str, str], default: Optional[str], name: Any) -> str:
    """The prefix ``name`` selects, as ``encode(prompt_name=...)`` does: the default prompt's
    when ``name`` is None ('' without one); UnknownPrompt for a name the model lacks."""
    if name is None:
        return prompts.get(default, "") if default else ""
    if not isinstance(name, str) or name not in prompts:
        raise UnknownPrompt(name, list(prompts))
    return str(prompts[name])


def prompt_prefix(text_model: Any, prompt_name: Optional[str]) -> str:
    """The prefix ``prompt_name`` selects for ``text_model`` (a ``TextModel``)."""
    return choose_prompt(text_model.prompts, text_model.default_prompt_name, prompt_name)


def model_text(prefix: str, text: str, lower: bool) -> str:
    """``text`` as the model reads it: the prompt first, all lower-cased when the folder says
    ``do_lower_case`` (sentence-transformers' ``Transformer`` lower-cases the whole string)."""
    text = prefix + text
    return text.lower() if lower else text


def longest_first(n_a: int, n_b: int, budget: int) -> tuple:
    """How many tokens of each side a pair keeps under ``budget`` (the tokens left after the
    special ones): the Rust ``tokenizers`` LongestFirst rule, which ``CrossEncoder`` runs.  The
    shorter side keeps what it has unless even half the budget is too little for it; the
    longer side gets the rest; both over half: halves, the odd token to the longer side."""
    if n_a + n_b <= budget:
        return n_a, n_b
    swap = n_a > n_b
    n1, n2 = (n_b, n_a) if swap else (n_a, n_b)  # n1: the shorter
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return (n2, n1) if swap else (n1, n2)


class PairTemplate:
    """The special tokens a tokenizer's pair encoding puts before the first text, between the
    two and after the second (``[CLS] a [SEP] b [SEP]``, ``<s> a </s></s> b </s>``), read by
    encoding a probe pair; ValueError when its post-processor does not join two texts."""

    __slots__ = ("pre", "mid", "post")

    def __init__(self, tok: Any):
        probe = tok.encode("a", "b")
        seq, ids = probe.sequence_ids, probe.ids
        first = [i for i, s in enumerate(seq) if s == 0]
        second = [i for i, s in enumerate(seq) if s == 1]
        if not first or not second or first[-1] > second[0]:
            raise ValueError("the tokenizer has no pair encoding (its post-processor does not "
                             "join two texts); a cross-encoder needs one")
        self.pre: list = ids[:first[0]]
        self.mid: list = ids[first[-1] + 1:second[0]]
        self.post: list = ids[second[-1] + 1:]

    @property
    def specials(self) -> int:
        return len(self.pre) + len(self.mid) + len(self.post)

    def join(self, a: Sequence[int], b: Sequence[int], max_length: int) -> tuple:
        """``(ids, cut)``: the pair's ids cut longest-first to ``max_length`` tokens including
        the special ones, and whether anything was cut."""
        n_a, n_b = longest_first(len(a), len(b), max_length - self.specials)
        ids = self.pre + list(a[:n_a]) + self.mid + list(b[:n_b]) + self.post
        return ids, n_a < len(a) or n_b < len(b)


def pad_batch(ids: Sequence[Sequence[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id lists into (input_ids, attention_mask), both int64 [N, max_len]."""
    length = max(len(x) for x in ids)
    input_ids = np.full((len(ids), length), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(ids), length), dtype=np.int64)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return input_ids, mask


def encode_texts(tokenizer_path: os.PathLike, texts: Sequence[str], text_model: Any,
                 prompt_name: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) of ``texts`` for an ``embed`` model (a ``TextModel``)."""
    prefix = prompt_prefix(text_model, prompt_name)
    texts = [model_text(prefix, t, text_model.do_lower_case) for t in texts]
    tok = load_tokenizer(str(tokenizer_path), text_model.max_seq_length)
    return pad_batch([e.ids for e in tok.encode_batch(texts)], text_model.pad_token_id)


def encode_pairs(tokenizer_path: os.PathLike, pairs: Sequence[tuple[str, str]],
                 text_model: Any) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) of (query, document) ``pairs`` for a ``rerank`` model."""
    lower = text_model.do_lower_case
    tok = load_tokenizer(str(tokenizer_path), 0)
    template = PairTemplate(tok)
    sides = tok.encode_batch([model_text("", t, lower) for pair in pairs for t in pair],
                             add_special_tokens=False)
    rows = [template.join(sides[2 * i].ids, sides[2 * i + 1].ids, text_model.max_seq_length)[0]
            for i in range(len(pairs))]
    return pad_batch(rows, text_model.pad_token_id)

"""Tokenising for an imported text model the way sentence-transformers does, into the graph's
two inputs (pure: the serving side and the tests share it).

- embed: ``text = prompt + text`` (the prompt chosen by name; the model's default prompt when
  none is named, as ``encode`` does), lower-cased first when ``do_lower_case``, truncated to
  ``max_seq_length`` tokens including the special tokens (the prepared ``tokenizer.json``
  carries that truncation and no padding);
- rerank: the pair (query, document) encoded together, truncated ``longest_first`` to
  ``max_seq_length``, as ``CrossEncoder.predict`` does.

Rows are right-padded with ``pad_token_id``; the mask is 1 on real tokens.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional, Sequence

import numpy as np


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str, max_length: int) -> Any:
    """``tokenizers.Tokenizer`` from ``path``, truncating to ``max_length``, never padding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.enable_truncation(max_length)
    tok.no_padding()
    return tok


def prompt_prefix(text_model: Any, prompt_name: Optional[str]) -> str:
    """The prefix ``prompt_name`` selects ('' for none); ValueError naming the model's prompts
    for an unknown name."""
    name = prompt_name if prompt_name is not None else text_model.default_prompt_name
    if name is None:
        return ""
    try:
        return str(text_model.prompts[name])
    except KeyError:
        known = ", ".join(sorted(text_model.prompts)) or "none"
        raise ValueError(f"unknown prompt_name {name!r}; this model's prompts: {known}") from None


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
    texts = [prefix + t for t in texts]
    if text_model.do_lower_case:
        texts = [t.lower() for t in texts]
    tok = load_tokenizer(str(tokenizer_path), text_model.max_seq_length)
    return pad_batch([e.ids for e in tok.encode_batch(texts)], text_model.pad_token_id)


def encode_pairs(tokenizer_path: os.PathLike, pairs: Sequence[tuple[str, str]],
                 text_model: Any) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) of (query, document) ``pairs`` for a ``rerank`` model."""
    pairs = [(q.lower(), d.lower()) if text_model.do_lower_case else (q, d) for q, d in pairs]
    tok = load_tokenizer(str(tokenizer_path), text_model.max_seq_length)
    return pad_batch([e.ids for e in tok.encode_batch(pairs)], text_model.pad_token_id)

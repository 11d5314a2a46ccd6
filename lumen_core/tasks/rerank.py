"""``rerank`` backend: relevance scores of (query, document) pairs from a cross-encoder.

The model is a prepared text model of kind ``"rerank"`` (``lumen models import`` of a
``*ForSequenceClassification`` folder, or ``model = "folder"``; :mod:`.text_source`): graph
inputs ``input_ids`` / ``attention_mask`` int64 ``[N, L]``, output ``logits`` fp32 ``[N, 1]``,
the raw score before the sigmoid.  Token type ids are derived inside the graph, so a pair is
one ragged row and pairs batch by length exactly like texts do (``RaggedInput``, length-aware
formation under ``max_batch_tokens``).

A request is one document: raw ``text/plain`` payload (the document) with the plain option
``query``; the HTTP routes (``POST /rerank``, ``POST /v1/rerank``: ``serve/rerank.py``) submit
the documents of one call together (``Runtime.infer_many``), so they batch together.  The
tensor route takes the pair's token ids as the tokenizer makes them (``[1, L]`` ``NL`` under
the tokenizer's preprocess id).

Encoding, as sentence-transformers' ``CrossEncoder`` does (its tokenizer called on the pair,
``truncation="longest_first"``, ``max_length``): the tokenizer's pair encoding (its post
processor's template: ``[CLS] q [SEP] d [SEP]``, ``<s> q </s></s> d </s>``, ...), both sides
cut by the Rust tokenizers' longest-first rule to ``max_seq_length``
tokens including the special ones.  A long document is tokenized by prefix (the rule only
needs its first ``max(budget, query tokens) + 1`` tokens), so a 16 MB document costs what a
page costs; a query is tokenized whole (at most ``MAX_QUERY_CHARS`` characters) and once per
call (a small cache keyed by the query text).  The pair template and the longest-first rule
are the model side's (``models/text_tokenize.py``: ``PairTemplate``, ``longest_first``), the
very code the importer's checks against ``CrossEncoder.predict`` run.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..config import Option
from ..engine.plan import ModelSpec, OutputSpec, PreparedModelRequest
from ..errors import ConfigError, InvalidArgument, PayloadTooLarge
from ..models.text_model import KIND_RERANK, LOGITS  # the graph's raw scores [N, num_labels]
from ..models.text_tokenize import PairTemplate, model_text
from ..request import new_infer_request
from .base import TaskBackend
from .charset import codec_for
from .embedding_output import flag_option
from .text_embedding import (  # the text path's bounds: documents are texts like any other
    INLINE_PREPARE_MAX_BYTES,
    LONG_TEXT_CHARS,
    MAX_BATCH_TOKENS_OPTION,
    MAX_SEQ_LENGTH_CAP,
    PREFIX_GROWTH,
    TOKENIZER_OPTION,
)
from .text_reduce import Reducer
from .text_source import load_source, preprocess_id, token_ids, token_plan

BACKEND_NAME = "rerank"
TEXT_MIME = "text/plain"
LAYOUT = "NL"
TOKEN_NP = np.dtype("<i8")
#: the plain request options (TEI's names where TEI has one)
OPT_QUERY = "query"
OPT_TRUNCATE = "truncate"
#: the longest query (characters): tokenized whole, on the event loop
MAX_QUERY_CHARS = 16384
#: queries whose token ids are kept (one call's documents share its query)
QUERY_CACHE_SIZE = 64


class RerankBackend(TaskBackend):
    raw_mimes = (TEXT_MIME,)
    accepts_text = True
    inline_prepare_max_bytes = INLINE_PREPARE_MAX_BYTES
    request_options = {
        OPT_QUERY: "the query the document (the payload) is scored against (required)",
        OPT_TRUNCATE: "false: a pair over max_seq_length tokens is a 413 instead of cut "
                      "(default true)",
    }
    options_schema = (
        TOKENIZER_OPTION,
        Option("max_seq_length", int, None,
               "tokens per pair, special tokens included; longer pairs are cut longest-first "
               "(default: the model's max_seq_length; at most its max_positions)", lo=3,
               hi=MAX_SEQ_LENGTH_CAP),
        MAX_BATCH_TOKENS_OPTION,
    )

    def __init__(self, config):
        super().__init__(config)
        self.tokenizer: Any = None
        self.max_seq_length = 0
        self.max_batch_tokens: int = self.options["max_batch_tokens"]
        self.model_id = ""
        self.preprocess_id = ""
        self.vocab_size = 0
        self.num_labels = 1
        self._signature: Any = None
        self._template: Any = None  # the pair encoding's special tokens
        self._budget = 0
        self._reducer: Optional[Reducer] = None
        self._queries: dict = {}
        self._lower = False
        self.text_model: dict = {}

    # -- lifecycle --------------------------------------------------------------------------
    def load(self) -> ModelSpec:
        cfg = self.config
        src, tok_path, self.max_seq_length = load_source(cfg, self.options, KIND_RERANK,
                                                         BACKEND_NAME)
        tm = src.text_model
        self._load_tokenizer(tok_path)
        self.model_id, self.num_labels = src.model_id, tm.num_labels
        self.text_model = {"kind": KIND_RERANK, "architecture": tm.architecture,
                           "do_lower_case": tm.do_lower_case, "num_labels": tm.num_labels,
                           **({"source": tm.source} if tm.source else {})}
        self._lower = tm.do_lower_case
        self.preprocess_id = pp = preprocess_id(tok_path, self.model_id)
        self._signature, self.contract, self.model = token_plan(
            cfg, src, self.model_id, pp, self.max_seq_length,
            [OutputSpec(LOGITS, np.dtype(np.float32), (tm.num_labels,))])
        return self.model

    def _load_tokenizer(self, path: str) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        tok.no_truncation()  # ours: longest_first over the two sides' ids
        tok.no_padding()
        try:
            self._template = PairTemplate(tok)
        except ValueError as exc:
            raise ConfigError(self.config.source, f"{self.config.key}.model",
                              f"the tokenizer {path}: {exc}") from None
        self._budget = self.max_seq_length - self._template.specials
        if self._budget < 2:
            raise ConfigError(self.config.source, f"{self.config.key}.options.max_seq_length",
                              f"must leave room for a query and a document token after the "
                              f"{self.max_seq_length - self._budget} special tokens of a pair")
        self.tokenizer = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._reducer = Reducer(tok)

    def batching_options(self) -> dict:
        return {"max_batch_tokens": self.max_batch_tokens}

    def warmup_requests(self) -> list:
        longest = np.full((1, self.max_seq_length), self._template.pre[0] if self._template.pre else 0,
                          dtype=TOKEN_NP)
        return [
            new_infer_request(self.name).for_raw_input(b"lumen warm-up document", TEXT_MIME)
            .with_meta(OPT_QUERY, "warm-up query").build(),
            new_infer_request(self.name).for_tensor_array(longest, LAYOUT,
                                                          self.preprocess_id).build(),
        ]

    def describe(self) -> dict:
        return {**super().describe(), "model_id": self.model_id,
                "max_seq_length": self.max_seq_length, "max_batch_tokens": self.max_batch_tokens,
                "outputs": {LOGITS: ["fp32", [self.num_labels]]},
                "rerank": {"output": LOGITS, "num_labels": self.num_labels,
                           "score": "sigmoid(logit); raw_scores: the logit"},
                "text_model": self.text_model, "tokenizer": self.preprocess_id}

    # -- request path -----------------------------------------------------------------------
    def prepare_raw(self, req, desc, payload: Any, mime: str, params: dict) -> PreparedModelRequest:
        if type(payload) is str:
            doc = payload
            off_loop = len(doc) > self.inline_prepare_max_bytes
        else:
            codec = codec_for(params.get("charset"))
            try:
                doc = str(payload, codec)
            except UnicodeError as exc:
                raise InvalidArgument(f"the document is not valid {codec} text ({exc}); send "
                                      f"{codec} or name the right charset", "payload") from None
            off_loop = payload.nbytes > self.inline_prepare_max_bytes
        meta = req.meta or {}
        query = meta.get(OPT_QUERY)
        if not isinstance(query, str) or not query:
            raise InvalidArgument(f"task {self.name!r} scores a document against a query: send "
                                  f"the query as the option {OPT_QUERY!r} (a non-empty string)",
                                  OPT_QUERY)
        if not doc:
            raise InvalidArgument("the document is empty; send at least one character",
                                  "payload")
        truncate = flag_option(meta, OPT_TRUNCATE) is not False
        try:
            ids, total = self.pair_ids(query, doc, off_loop)
        except TypeError:  # lone surrogates
            raise InvalidArgument("the query or document holds unpaired surrogate code points, "
                                  "which is not text", "payload") from None
        if total and not truncate:
            raise PayloadTooLarge(f"the pair is {total}+ tokens; task {self.name!r} takes at most "
                                  f"{self.max_seq_length} (max_seq_length) and truncate=false "
                                  f"was sent: shorten it or allow truncation", "payload")
        return PreparedModelRequest(self._signature, (np.array(ids, dtype=TOKEN_NP),), (),
                                    len(ids))

    def prepare_tensor(self, req, desc, payload: memoryview) -> PreparedModelRequest:
        ids, tensor = token_ids(payload, self.vocab_size, self.model_id)
        return PreparedModelRequest(self._signature, (tensor,), (), ids.shape[0])

    # -- pair encoding ----------------------------------------------------------------------
    def pair_ids(self, query: str, doc: str, off_loop: bool = False) -> tuple:
        """``(ids, n)``: the pair's token ids as CrossEncoder feeds them, and 0 when nothing
        was cut, else (a lower bound of) the uncut pair's token count."""
        q = self._query_ids(query)
        d = self._doc_ids(doc, max(self._budget, len(q)) + 1, off_loop)
        ids, cut = self._template.join(q, d, self.max_seq_length)
        return ids, (len(q) + len(d) + self._template.specials) if cut else 0

    def _prepped(self, text: str) -> str:
        return model_text("", text, self._lower)

    def _query_ids(self, query: str) -> list:
        ids = self._queries.get(query)
        if ids is None:
            if len(query) > MAX_QUERY_CHARS:
                raise PayloadTooLarge(f"the query is {len(query)} characters; at most "
                                      f"{MAX_QUERY_CHARS}", OPT_QUERY)
            ids = self.tokenizer.encode(self._prepped(query), add_special_tokens=False).ids
            if len(self._queries) >= QUERY_CACHE_SIZE:
                self._queries.pop(next(iter(self._queries)))
            self._queries[query] = ids
        return ids

    def _doc_ids(self, doc: str, need: int, off_loop: bool) -> list:
        """The document's ids (no special tokens): all of them, or a prefix's when that prefix
        has more than ``need`` tokens and provably the whole text's first ``need``."""
        tok = self.tokenizer
        if off_loop:
            def encode(s: str) -> Any:
                return tok.encode_batch([s], add_special_tokens=False)[0]
        else:
            def encode(s: str) -> Any:
                return tok.encode(s, add_special_tokens=False)
        doc = self._prepped(doc)
        n = len(doc)
        if n <= LONG_TEXT_CHARS:
            return encode(doc).ids
        reducer = self._reducer if self._reducer is not None and self._reducer.ok else None
        margin = reducer.cut_words if reducer is not None else 1
        p = LONG_TEXT_CHARS
        while p < n:
            enc = encode(reducer(doc[:p]) if reducer is not None else doc[:p])
            words = enc.word_ids
            if len(words) > need and words[need - 1] is not None and words[-1] is not None \
                    and words[need - 1] + margin <= words[-1]:
                return enc.ids
            p *= PREFIX_GROWTH
        return encode(reducer(doc) if reducer is not None else doc).ids

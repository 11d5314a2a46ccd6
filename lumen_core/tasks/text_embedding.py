"""``text_embedding`` backend (task ``text_embed``): sentence embeddings from a BERT-style ONNX model.

Raw route: ``text/plain`` (strict decoding, UTF-8 unless the mime's ``charset`` names another
Python codec) -> token ids with the model's ``tokenizers`` tokenizer, truncated to
``max_seq_length`` tokens including [CLS]/[SEP].  Tensor route: int64 ``[1, L]`` ``NL`` token
ids with preprocess id ``bert_wordpiece_uncased_v1``; the descriptor parser enforces the dtype,
layout and ``1 <= L <= max_seq_length``, this backend checks every id against the vocabulary
(an out-of-range id would make the model's Gather fail for the whole batch).  Both routes
produce the same :class:`PreparedModelRequest` (one int64 buffer, its length, one signature),
so raw and tensor requests for the same model batch together; the engine's ``RaggedInput``
pads them and fills the attention mask in one compiled pass, and the model itself mean-pools
over the mask and L2-normalises, so the output ``embedding`` fp32 ``[384]`` needs no
postprocessing beyond the finite check.  The prepared graphs also output ``pooled``, the mean
before L2 normalisation: it is always fetched (384 floats a row that ORT computes anyway;
binding it cost nothing measurable, see ``normalize`` below) and read only for the rows that
ask ``normalize=false``.

Where tokenization runs: on the event loop.  A typical text (5-200 words) tokenizes in less
time than a worker-thread hand-off plus the GIL ping-pong it causes (``bench/bench_handover.py``
measures the hand-over, ``bench/bench_text_embed.py`` the whole path), and the CPU it uses is
the same wherever it runs.  ``Tokenizer.encode`` holds the GIL, so a huge payload would
stall the loop: payloads above ``INLINE_PREPARE_MAX_BYTES`` go to a worker thread (the runtime
honours ``inline_prepare_max_bytes``) and use ``encode_batch``, which releases the GIL.  Long
texts are never tokenized in full when a prefix proves enough (see :meth:`_count_ids`).

Which model, and how to feed it: :mod:`.text_source` resolves the task's ``model_id`` (a
model in the store: the built-in MiniLM or one ``lumen models import`` made), ``model =
"folder"`` (a sentence-transformers folder, prepared once) or ``model = "file.onnx"``; the
prepared directory's ``"text_model"`` block (:mod:`lumen_core.models.text_model`) gives the
embedding size, ``max_seq_length``, lower-casing, pad id, prompts and normalisation.  The graph
I/O names (input / mask / outputs, token dtype) are those of :mod:`lumen_core.models.minilm`
for every text model.  A model's prompts are applied by :mod:`.text_prompts` (option
``prompt_name``); the compiled fast path applies the default prompt too.  The preprocess id of
the tensor route is the tokenizer's (``text_source.preprocess_id``): ``bert_wordpiece_uncased_v1``
for the MiniLM's vocabulary, ``tokenizer_<hash>_v1`` for another.

Batching: the backend asks the dynamic batcher for length-aware formation with a token budget
(``max_batch_tokens``), see ``lumen_core/batching/dynamic.py``.

Per-request options (none of them changes the execution signature, so such requests batch with
every other; they are applied to the item's own row in :meth:`postprocess`):

- ``lumen.embedding.dimensions`` D: keep the first D components, then L2-normalise again (TEI's
  and OpenAI's order); ``lumen.embedding.type``: ``float`` (fp32 ``[D]``), ``int8`` /
  ``uint8`` (``[D]``, scalar quantisation over the fixed ``EMBEDDING_QUANT_RANGE`` [-1, 1]:
  ``u = clip(floor((x + 1) * 255 / 2), 0, 255)``, int8 = u - 128, the formula
  sentence-transformers and infinity use, with fixed rather than calibrated ranges), ``binary``
  / ``ubinary`` (``[ceil(D / 8)]``: the bits x > 0 packed MSB first, zero-padded; binary = ubinary
  - 128 as int8).  See :func:`.embedding_output.shape_embedding`.
- ``truncate`` (a plain option, TEI's): ``true`` by default; ``false`` refuses a text longer
  than ``max_seq_length`` tokens with 413 naming both counts instead of cutting it.  A cut text
  is marked ``lumen.truncated=true`` (see :class:`.embedding_output.EmbeddingOutputs`).
  Options travel with the item as :class:`EmbedRequest`.
- ``normalize`` (TEI's): ``true`` by default; ``false`` returns the mean-pooled vector before
  L2 normalisation (the graph's ``pooled`` output, ``models/minilm.py``).  With ``dimensions``
  D it is cut to its first D components and *not* normalised again (TEI: truncation, then
  re-normalisation only when normalize is true).  ``embedding_type`` ``binary`` / ``ubinary``
  take its sign bits (the same bits as the normalised vector's); ``int8`` / ``uint8`` are
  refused with it (400): their fixed range [-1, 1] is meant for unit vectors and would clip
  a mean-pooled one (components reach beyond 1).  A configured ``model`` without a
  ``pooled`` output refuses ``normalize=false`` with 400.  The option is part of the response
  cache key like every option (``cache.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import native
from ..config import Option
from ..contract import (
    DTYPES,
    EMBEDDING_QUANT_RANGE,
    EMBEDDING_TYPES,
    KEY_EMBEDDING_DIMENSIONS,
    KEY_EMBEDDING_TYPE,
    RESP_TRUNCATED,
)
from ..engine.plan import ModelSpec, OutputSpec, PreparedModelRequest
from ..engine.session import read_io
from ..errors import (
    ConfigError,
    InvalidArgument,
    PayloadTooLarge,
)
from ..models import MINILM, MINILM_INT8, require_model
from ..models.minilm import (
    EMBEDDING_DIM,
    MAX_SEQ_LENGTH,
    OUTPUT,
    OUTPUT_DTYPE,
    POOLED,
    TOKEN_DTYPE,
)
from ..models.text_model import KIND_EMBED
from ..request import new_infer_request
from ..request_path.descriptor import embedding_options
from .base import TaskBackend, split_outputs
from .charset import DEFAULT_CHARSET, codec_for
from .embedding_output import (
    EmbeddingOutputs,
    EmbedOptions,
    EmbedRequest,
    flag_option,
    shape_embedding,
)
from .text_prompts import OPT_PROMPT_NAME, Prompts
from .text_reduce import Reducer
from .text_source import (
    BERT_UNCASED_PREPROCESS_ID,
    load_source,
    preprocess_id,
    token_ids,
    token_plan,
)

TASK_NAME = "text_embed"
#: the same embeddings from the int8 model (default runtime, when prepared)
INT8_TASK_NAME = "text_embed_int8"
BACKEND_NAME = "text_embedding"
#: the preprocess id of all-MiniLM-L6-v2's token ids (other tokenizers: text_source.py)
PREPROCESS_ID = BERT_UNCASED_PREPROCESS_ID
TEXT_MIME = "text/plain"
LAYOUT = "NL"
#: numpy dtype of token ids (the model's, little-endian as on the wire)
TOKEN_NP = DTYPES[TOKEN_DTYPE]
#: all-MiniLM-L6-v2's tokens per input (incl. [CLS]/[SEP]); another model's come from its
#: "text_model" block, and ``options.max_seq_length`` may lower either
DEFAULT_MAX_SEQ_LENGTH = MAX_SEQ_LENGTH
#: the largest ``options.max_seq_length`` any model may take (each model's own bound, its
#: ``max_positions``, is checked at load)
MAX_SEQ_LENGTH_CAP = 8192
#: token budget of one batch (rows x padded length), see batching/dynamic.py; 0 = length-blind
DEFAULT_MAX_BATCH_TOKENS = 8192
#: the largest ``options.max_batch_tokens`` (16 Mi tokens: 32 Ki rows of 512)
MAX_BATCH_TOKENS = 1 << 24
#: raw payloads above this many bytes are tokenized in a worker thread, not on the event loop
INLINE_PREPARE_MAX_BYTES = 4096
#: texts up to this many characters are tokenized whole; longer ones prefix-first
LONG_TEXT_CHARS = 2048
#: the prefix grows by this factor until it proves the truncated ids (or covers the text)
PREFIX_GROWTH = 4
#: ``tokenize`` with truncation off lists every token: at most this many in one call (413
#: past it, known from a prefix before the rest of the text is read)
MAX_TOKENIZE_TOKENS = 65536

#: plain (non-``lumen.*``) request options this backend reads (TEI's names)
OPT_TRUNCATE = "truncate"
OPT_NORMALIZE = "normalize"

#: the ``[tasks.options]`` every text task (this one, ``rerank``) takes alike
TOKENIZER_OPTION = Option("tokenizer", str, None, "path of the model's tokenizer.json; "
                                                  "default: the tokenizer.json beside the model")
MAX_BATCH_TOKENS_OPTION = Option(
    "max_batch_tokens", int, DEFAULT_MAX_BATCH_TOKENS,
    "token budget of one batch (rows x padded length); 0: length-blind batching",
    lo=0, hi=MAX_BATCH_TOKENS)


class TextEmbeddingBackend(TaskBackend):
    raw_mimes = (TEXT_MIME,)
    inline_prepare_max_bytes = INLINE_PREPARE_MAX_BYTES
    accepts_text = True
    #: the native names of /v1/embeddings' options (README, "Embeddings")
    request_options = {
        KEY_EMBEDDING_DIMENSIONS: "keep the first D components, then L2-normalise again "
                                  "(/v1/embeddings: dimensions)",
        KEY_EMBEDDING_TYPE: f"the element type returned: {', '.join(EMBEDDING_TYPES)} "
                            f"(/v1/embeddings: embedding_type)",
        OPT_NORMALIZE: "false: the mean-pooled vector before L2 normalisation (default true)",
        OPT_TRUNCATE: "false: a text over max_seq_length tokens is a 413 instead of cut "
                      "(default true)",
        OPT_PROMPT_NAME: "the model's prompt put before the text (default: the model's "
                         "default prompt, if any; GET /v1/tasks lists its prompts)",
    }
    options_schema = (
        TOKENIZER_OPTION,
        Option("max_seq_length", int, None,
               "tokens per input, [CLS] and [SEP] included; longer texts are truncated "
               "(default: the model's max_seq_length; at most its max_positions)", lo=2,
               hi=MAX_SEQ_LENGTH_CAP),
        MAX_BATCH_TOKENS_OPTION,
    )

    def __init__(self, config):
        super().__init__(config)
        self.tokenizer: Any = None
        self.max_seq_length: int = self.options["max_seq_length"] or DEFAULT_MAX_SEQ_LENGTH
        self.max_batch_tokens: int = self.options["max_batch_tokens"]
        self.vocab_size = 0
        self.model_id = ""
        self._signature: tuple = ()
        self._n_prefix = 1  # special tokens the post-processor puts before / after the text
        self._n_suffix = 1
        self._suffix_ids: tuple = ()  # the ids of those after the text ([SEP])
        self._reducer: Optional[Reducer] = None  # built at load (or the first long text)
        self.has_pooled = False  # the model outputs POOLED (normalize=false is served)
        self.model_card: Optional[dict] = None  # a prepared model's card (models.model_card)
        self.dim = EMBEDDING_DIM
        self.normalized = True  # the model's embedding is L2-normalised
        self.prompts = Prompts({}, None, False)
        self.preprocess_id = PREPROCESS_ID
        self.text_model: dict = {}

    # -- lifecycle --------------------------------------------------------------------------
    def load(self) -> ModelSpec:
        cfg = self.config
        src, tok_path, self.max_seq_length = load_source(cfg, self.options, KIND_EMBED,
                                                         BACKEND_NAME)
        tm = src.text_model
        self._load_tokenizer(tok_path)
        self.model_id = src.model_id
        self.dim, self.normalized = tm.dimension, tm.normalize
        self.prompts = Prompts(tm.prompts, tm.default_prompt_name, tm.do_lower_case)
        self.has_pooled = self._model_has_pooled(src)
        self.model_card = src.card
        self.text_model = {"architecture": tm.architecture, "pooling": tm.pooling,
                           "normalize": tm.normalize, "do_lower_case": tm.do_lower_case,
                           **({"source": tm.source} if tm.source else {})}
        self.preprocess_id = pp = preprocess_id(tok_path, self.model_id)
        self._signature, self.contract, self.model = token_plan(
            cfg, src, self.model_id, pp, self.max_seq_length,
            [OutputSpec(name, DTYPES[OUTPUT_DTYPE], (self.dim,))
             for name in ((OUTPUT, POOLED) if self.has_pooled else (OUTPUT,))])
        return self.model

    def _model_has_pooled(self, src) -> bool:
        """Whether the model has the pooled output (``normalize=false``): every prepared
        model at its current revision does (``require_model`` and the importer see to it); a
        configured file is read, and its ``embedding`` output's size, when fixed, is the
        embedding size."""
        if src.prepared:
            return True
        _, outputs = read_io(src.model_path)
        for name, _, dims in outputs:
            if name == OUTPUT and dims and isinstance(dims[-1], int):
                self.dim = dims[-1]
        return any(name == POOLED and dtype == OUTPUT_DTYPE and dims[-1:] == (self.dim,)
                   for name, dtype, dims in outputs)

    def _load_tokenizer(self, path: str) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        # Truncation is ours (see _count_ids): the library's also builds every overflow window.
        tok.no_truncation()
        tok.no_padding()
        probe = tok.encode("a")
        mask = probe.special_tokens_mask
        self._n_prefix = next(i for i, m in enumerate(mask) if not m)
        self._n_suffix = len(mask) - 1 - max(i for i, m in enumerate(mask) if not m)
        self._suffix_ids = tuple(probe.ids[len(mask) - self._n_suffix:])
        if self._n_prefix + self._n_suffix >= self.max_seq_length:
            raise ConfigError(self.config.source, f"{self.config.key}.options.max_seq_length",
                              f"must leave room for text after the tokenizer's "
                              f"{self._n_prefix + self._n_suffix} special tokens")
        self.tokenizer = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._reducer = Reducer(tok)  # at load, so that no request pays its probe

    def text_fast_path(self) -> "native.routes.TextPrep":
        """Plain text (no options, UTF-8, short, not truncated) prepared by the request path in
        C: the same ids and item :meth:`prepare_raw` makes for it."""
        mimes = frozenset({TEXT_MIME, f"{TEXT_MIME}; charset={DEFAULT_CHARSET}",
                           f"{TEXT_MIME};charset={DEFAULT_CHARSET}"})
        # a default prompt or lower-casing is applied by the encoder it is given
        return native.routes.TextPrep(self.prompts.encoder(self.tokenizer.encode),
                                         self._signature,
                                         self.max_seq_length,
                                         min(LONG_TEXT_CHARS, self.inline_prepare_max_bytes), mimes)

    def batching_options(self) -> dict:
        return {"max_batch_tokens": self.max_batch_tokens}

    def warmup_requests(self) -> list:
        """A raw text and a longest-possible tensor: both routes, the largest buffers."""
        longest = np.full((1, self.max_seq_length), self.tokenizer.token_to_id("[UNK]") or 100,
                          dtype=TOKEN_NP)
        return [
            new_infer_request(self.name).for_raw_input(b"lumen warm-up", TEXT_MIME).build(),
            new_infer_request(self.name).for_tensor_array(longest, LAYOUT,
                                                          self.preprocess_id).build(),
        ]

    def describe(self) -> dict:
        return {**super().describe(), "max_seq_length": self.max_seq_length,
                "max_batch_tokens": self.max_batch_tokens,
                "outputs": {OUTPUT: [OUTPUT_DTYPE, [self.dim]]},
                "embedding": {"output": OUTPUT, "dim": self.dim, "normalized": self.normalized,
                              "normalize_false": self.has_pooled,
                              "types": dict(EMBEDDING_TYPES),
                              "quant_range": list(EMBEDDING_QUANT_RANGE)},
                "tokenizer": self.preprocess_id, "model_id": self.model_id,
                "text_model": {"kind": KIND_EMBED, **self.text_model}, **self.prompts.describe(),
                **({"model_card": self.model_card} if self.model_card else {})}

    # -- options ----------------------------------------------------------------------------
    def _options(self, req, truncated: bool) -> Optional[EmbedOptions]:
        """The request's options (None: all defaults and nothing to report, the common case)."""
        meta = req.meta
        if not meta:
            return None if not truncated else EmbedOptions(0, "float", True)
        pooled = flag_option(meta, OPT_NORMALIZE) is False
        if pooled and not self.has_pooled:
            raise InvalidArgument(
                f"normalize=false is not available on task {self.name!r}: its model "
                f"({self.config.model}) has no {POOLED!r} output (the mean-pooled vector before "
                f"L2 normalisation, which the prepared MiniLM graphs have since lumen-core's "
                f"recipe revision 3: a file prepared earlier gets it from `lumen models "
                f"prepare`); omit normalize (or send true)", OPT_NORMALIZE)
        dims, etype = embedding_options(meta, self.dim)
        if (pooled or not self.normalized) and etype in ("int8", "uint8"):
            raise InvalidArgument(
                f"embedding_type {etype!r} quantises over the fixed range "
                f"[{EMBEDDING_QUANT_RANGE[0]:g}, {EMBEDDING_QUANT_RANGE[1]:g}] meant for unit vectors and would clip the "
                f"vector {'normalize=false returns' if pooled else 'this model returns (not unit length)'}"
                f"; send normalize=true with it, or "
                f"embedding_type float, binary or ubinary", OPT_NORMALIZE)
        if not dims and etype == "float" and not truncated and not pooled:
            return None
        return EmbedOptions(dims, etype, truncated, pooled)

    def postprocess(self, outputs: dict, items) -> list:
        pooled = outputs.get(POOLED)
        # the result has OUTPUT only; a pooled row replaces it where normalize=false asks
        res = split_outputs(outputs if pooled is None else {OUTPUT: outputs[OUTPUT]}, len(items))
        if all(getattr(item, "options", None) is None for item in items):
            return res  # the common case: every item's result is its row of the batch
        if not isinstance(res, list):
            res = [res.row(i) for i in range(len(items))]
        for i, item in enumerate(items):
            opts = getattr(item, "options", None)
            if opts is None or not isinstance(res[i], dict):
                continue
            out = res[i]
            # (a non-finite pooled row makes its normalised row non-finite: already withheld)
            vec = pooled[i] if opts.pooled and pooled is not None else out[OUTPUT]
            if opts.dims or opts.etype != "float":
                vec = shape_embedding(vec, opts.dims, opts.etype,
                                      not opts.pooled and self.normalized)
            out = {**out, OUTPUT: vec}
            res[i] = EmbeddingOutputs(out, {RESP_TRUNCATED: "true"}) if opts.truncated else out
        return res

    # -- tokenize ---------------------------------------------------------------------------
    def tokenize(self, texts: list, truncate: bool = True) -> list:
        """Per text, its tokens as the model sees them: ``{"id", "text", "special", "start",
        "stop"}`` (TEI's ``/tokenize`` shape; ``start`` / ``stop`` are character offsets into
        the text, 0 / 0 for special tokens), cut like :meth:`prepare_raw` cuts it unless
        ``truncate`` is False (then every token, at most ``MAX_TOKENIZE_TOKENS`` in a call).

        Bounded as the embedding path is (:meth:`_count_ids`): a long text is tokenized by
        prefix, each shortened by the reducer, until a prefix proves the answer; the reducer's
        rewrites are mapped back so offsets point into the text as sent."""
        limit = self.max_seq_length
        ns = self._n_suffix
        out = []
        budget = MAX_TOKENIZE_TOKENS
        over = PayloadTooLarge(f"with truncate=false every token is listed: at most "
                               f"{MAX_TOKENIZE_TOKENS} in one call (MAX_TOKENIZE_TOKENS); send "
                               f"fewer or shorter texts, or allow truncation", "inputs")
        for text in texts:
            if not truncate and budget < self._n_prefix + ns:
                raise over  # every text has its special tokens at least
            enc, back = self._encode_prefix(text, limit if truncate else budget)
            rows = list(zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True))
            if truncate and len(rows) > limit:
                rows = rows[:limit - ns] + rows[len(rows) - ns:]
            elif not truncate:
                budget -= len(rows)
                if budget < 0:
                    raise over
            if back is not None:
                rows = [(i, t, s, (a, b) if s else back(a, b)) for i, t, s, (a, b) in rows]
            out.append([{"id": i, "text": t, "special": bool(s), "start": a, "stop": b}
                        for i, t, s, (a, b) in rows])
        return out

    def _encode_prefix(self, text: str, limit: int) -> tuple:
        """``(encoding, back)`` of the shortest prefix of ``text`` (reduced) whose first
        ``limit - suffix`` tokens are those of the whole text, or of the whole text when it has
        at most ``limit`` tokens; ``back`` maps its offsets into ``text`` (None: no rewrite)."""
        tok = self.tokenizer
        n = len(text)
        if n <= LONG_TEXT_CHARS:
            return tok.encode(text), None
        if self._reducer is None:
            self._reducer = Reducer(tok)
        reducer = self._reducer if self._reducer.ok else None
        p = LONG_TEXT_CHARS
        while True:
            part = text[:p]
            reduced, back = reducer.mapped(part) if reducer is not None else (part, None)
            enc = tok.encode(reduced)
            if p >= n or (len(enc.ids) > limit and self._proves_cut(enc.word_ids, limit)):
                return enc, back
            p *= PREFIX_GROWTH

    def _proves_cut(self, words: list, limit: int) -> bool:
        """Whether a prefix's tokens (their word ids, more than ``limit``) are those of the
        whole text up to the cut: the last kept token's word is none of the prefix's last
        ``Reducer.cut_words`` words (the prefix's end can cut its last word, and an added
        token such as ``[UNK]`` cut in half falls apart into up to one word a character,
        each of which would have been one token of the whole text)."""
        ns = self._n_suffix
        kept_last = words[limit - 1 - ns]
        prefix_last = words[len(words) - 1 - ns]
        margin = self._reducer.cut_words if self._reducer is not None else 1
        return kept_last is not None and prefix_last is not None and \
            kept_last + margin <= prefix_last

    # -- request path -----------------------------------------------------------------------
    def prepare_raw(self, req, desc, payload: memoryview, mime: str,
                    params: dict) -> PreparedModelRequest:
        if type(payload) is str:  # in-process / JSON callers: already text
            text = payload
            off_loop = len(text) > self.inline_prepare_max_bytes
        else:
            codec = codec_for(params.get("charset"))
            try:
                text = str(payload, codec)
            except UnicodeDecodeError as exc:
                raise InvalidArgument(
                    f"payload is not valid {codec} text: bytes {exc.start}..{exc.end - 1} "
                    f"({exc.reason}); send {codec} or name the right charset in payload_mime",
                    "payload") from None
            except UnicodeError as exc:  # e.g. idna: the base class, no byte range
                raise InvalidArgument(f"payload is not valid {codec} text ({exc}); send {codec} "
                                      f"or name the right charset in payload_mime",
                                      "payload") from None
            off_loop = payload.nbytes > self.inline_prepare_max_bytes
        if not text:  # as TEI: an empty input is the caller's mistake, not [CLS][SEP]
            raise InvalidArgument(f"the text is empty; task {self.name!r} embeds text of at least "
                                  f"one character (send token ids [CLS, SEP] as a tensor for the "
                                  f"embedding of no text)", "payload")
        truncate = flag_option(req.meta, OPT_TRUNCATE) if req.meta else None
        if not self.prompts.identity or req.meta:
            text = self.prompts.apply(text, req.meta, self.name)
        try:
            ids, truncated = self._count_ids(text, off_loop, truncate is not False)
        except TypeError:  # tokenizers refuses str with lone surrogates (e.g. from utf-7)
            how = "is" if type(payload) is str else f"decodes ({codec}) to"
            raise InvalidArgument(f"payload {how} text with unpaired surrogate code points, "
                                  f"which is not text", "payload") from None
        if truncated and truncate is False:
            raise PayloadTooLarge(
                f"the text is {truncated} tokens ([CLS]/[SEP] included); task {self.name!r} takes "
                f"at most {self.max_seq_length} (max_seq_length) and truncate=false was sent: "
                f"shorten the text or allow truncation", "payload")
        arr = np.array(ids, dtype=TOKEN_NP)
        return EmbedRequest(self._signature, (arr,), len(ids), self._options(req, bool(truncated)))

    def prepare_tensor(self, req, desc, payload: memoryview) -> PreparedModelRequest:
        # dtype, layout, [1, L] with 1 <= L <= max_seq_length and the byte count are checked
        ids, tensor = token_ids(payload, self.vocab_size, self.model_id)
        flag_option(req.meta, OPT_TRUNCATE)  # checked; token ids are never cut (L is bounded above)
        self.prompts.check_tensor(req.meta, self.name)
        return EmbedRequest(self._signature, (tensor,), ids.shape[0], self._options(req, False))

    def fit_token_ids(self, ids: list, truncate: bool = True, field: str = "input") -> list:
        """Token ids sent in place of a text (``/v1/embeddings``), fitted to ``max_seq_length``
        as a text is (TEI treats ids so): cut when ``truncate``, keeping the special tokens
        after the text ([SEP]) when the ids end with them, as the text path keeps them; else
        a 413 naming the count and the limit, the text path's answer."""
        limit = self.max_seq_length
        n = len(ids)
        if n <= limit:
            return ids
        if not truncate:
            raise PayloadTooLarge(
                f"the input is {n} tokens (token ids); task {self.name!r} takes at most {limit} "
                f"(max_seq_length) and truncate=false was sent: send fewer ids or allow "
                f"truncation", field)
        ns = len(self._suffix_ids)
        if ns and tuple(ids[n - ns:]) == self._suffix_ids:
            return list(ids[:limit - ns]) + list(ids[n - ns:])
        return list(ids[:limit])

    def _token_ids(self, text: str, off_loop: bool) -> list:
        """WordPiece ids of ``text`` with [CLS]/[SEP], truncated (see :meth:`_count_ids`)."""
        return self._count_ids(text, off_loop)[0]

    def _count_ids(self, text: str, off_loop: bool, cut: bool = True) -> tuple:
        """``(ids, n)``: WordPiece ids of ``text`` with [CLS]/[SEP], truncated like
        ``enable_truncation``, and 0 when nothing was cut, else the text's token count (at
        least ``max_seq_length`` + 1; exact when ``cut`` is False, then the ids are not cut).

        A long text is first tokenized by prefix: the ids kept after truncation are exact when
        the last kept token's word is not the prefix's last word (only that word can be cut by
        the prefix boundary: BERT normalisation is per character and words end at whitespace or
        punctuation).  Otherwise the prefix grows; in the worst case the whole text is read.

        Every text longer than ``LONG_TEXT_CHARS`` (each prefix, and the whole text) is first
        shortened by :class:`.text_reduce.Reducer`, which provably keeps every id and so the count too:
        runs that can only be one [UNK] are cut to ``max_input_chars_per_word + 1`` solid
        characters, runs of whitespace and of vanishing characters to one character.  A text of
        one 16 MB "word", of accented letters (composed or not), of spaces or of control
        characters reaches the tokenizer as a few hundred characters; punctuation, CJK and
        ordinary words make at least one token per few characters, so a short prefix proves
        them.  The reduction reads the prefix once per step (regex scans, tens of ns a char).
        """
        tok = self.tokenizer
        encode = (lambda s: tok.encode_batch([s])[0]) if off_loop else tok.encode
        limit = self.max_seq_length
        ns = self._n_suffix
        n = len(text)
        reduce = None
        if n > LONG_TEXT_CHARS:
            if self._reducer is None:
                self._reducer = Reducer(tok)
            if self._reducer.ok:
                reduce = self._reducer
        done, head = 0, ""  # head: text[:done], reduced (every rewrite is context-free)

        def upto(p: int) -> str:
            nonlocal done, head
            head = reduce(head + text[done:p]) if reduce is not None else text[:p]
            done = p
            return head

        if n > LONG_TEXT_CHARS and cut:
            p = LONG_TEXT_CHARS
            while p < n:
                enc = encode(upto(p))  # the same ids (and words) as text[:p]
                ids = enc.ids
                if len(ids) > limit and self._proves_cut(enc.word_ids, limit):
                    return ids[:limit - ns] + ids[len(ids) - ns:], len(ids)
                p *= PREFIX_GROWTH
        ids = encode(upto(n) if n > LONG_TEXT_CHARS else text).ids
        n_ids = len(ids)
        if n_ids > limit:
            if cut:
                ids = ids[:limit - ns] + ids[n_ids - ns:]
            return ids, n_ids
        return ids, 0


#: engine instances of the built-in text_embed task (see default_task_table)
DEFAULT_INSTANCES = 2


def default_task_table() -> dict:
    """The built-in ``text_embed`` task on the prepared all-MiniLM-L6-v2; ModelMissingError
    (naming ``lumen models prepare``) when it is not prepared."""
    require_model(MINILM)
    # Two instances (threads per instance default to cores // instances): two single-thread
    # sessions beat one 2-thread session on the in-process corpus (bench/bench_text_embed.py;
    # runs in bench/HISTORY.md, "text_embed (in process)").
    return {"name": TASK_NAME, "backend": BACKEND_NAME, "model_id": MINILM,
            "model_version": "1", "instances": DEFAULT_INSTANCES}


def default_int8_task_table() -> dict:
    """The built-in ``text_embed_int8`` task on the prepared int8 all-MiniLM-L6-v2 (int8
    weights and per-row int8 activations, ``models/minilm_int8.py``); ModelMissingError when
    it is not prepared."""
    require_model(MINILM_INT8)
    return {"name": INT8_TASK_NAME, "backend": BACKEND_NAME, "model_id": MINILM_INT8,
            "model_version": "1", "instances": DEFAULT_INSTANCES}

"""``text_embedding`` backend (task ``text_embed``): sentence embeddings from a BERT-style ONNX model.

Raw route: ``text/plain`` (strict decoding, UTF-8 unless the mime's ``charset`` names another
Python codec) -> WordPiece ids with the model's ``tokenizers`` tokenizer, truncated to
``max_seq_length`` tokens including [CLS]/[SEP].  Tensor route: int64 ``[1, L]`` ``NL`` token
ids with preprocess id ``bert_wordpiece_uncased_v1``; the descriptor parser enforces the dtype,
layout and ``1 <= L <= max_seq_length``, this backend checks every id against the vocabulary
(an out-of-range id would make the model's Gather fail for the whole batch).  Both routes
produce the same :class:`PreparedModelRequest` (one int64 buffer, its length, one signature),
so raw and tensor requests for the same model batch together; the engine's ``RaggedInput``
pads them and fills the attention mask in one compiled pass, and the model itself mean-pools
over the mask and L2-normalises, so the output ``embedding`` fp32 ``[384]`` needs no
postprocessing beyond the finite check.

Where tokenization runs: on the event loop.  A typical text (5-200 words) tokenizes in about
10-500 us, less than a worker-thread hand-off plus the GIL ping-pong it causes, and the CPU it
uses is the same wherever it runs.  ``Tokenizer.encode`` holds the GIL, so a huge payload would
stall the loop: payloads above ``INLINE_PREPARE_MAX_BYTES`` go to a worker thread (the runtime
honours ``inline_prepare_max_bytes``) and use ``encode_batch``, which releases the GIL.  Long
texts are never tokenized in full when a prefix proves enough (see :meth:`_token_ids`).

The model's graph I/O (input / mask / output names, token dtype, embedding size, default and
largest sequence length) is defined once, in :mod:`lumen_core.models.minilm`; a configured
``model`` must have the same I/O.

Batching: the backend asks the dynamic batcher for length-aware formation with a token budget
(``max_batch_tokens``), see ``lumen_core/batching/dynamic.py``.
"""
from __future__ import annotations

import codecs
import os
from typing import Any, Optional

import numpy as np

from ..batching.signature import signature
from ..config import Option
from ..contract import DTYPES, TensorContract, TensorSpec
from ..engine.plan import ModelSpec, OutputSpec, PreparedModelRequest, RaggedInput
from ..errors import ConfigError, InvalidArgument, ModelMissingError, UnsupportedMediaType
from ..models import MINILM, MODEL_FILE, require_model
from ..models.minilm import (
    ATTENTION_MASK,
    EMBEDDING_DIM,
    INPUT_IDS,
    MAX_POSITIONS,
    MAX_SEQ_LENGTH,
    OUTPUT,
    OUTPUT_DTYPE,
    PAD_TOKEN_ID,
    TOKEN_DTYPE,
    TOKENIZER_FILE,
)
from ..request import new_infer_request
from .base import TaskBackend

TASK_NAME = "text_embed"
BACKEND_NAME = "text_embedding"
PREPROCESS_ID = "bert_wordpiece_uncased_v1"
TEXT_MIME = "text/plain"
DEFAULT_CHARSET = "utf-8"
LAYOUT = "NL"
#: numpy dtype of token ids (the model's, little-endian as on the wire)
TOKEN_NP = DTYPES[TOKEN_DTYPE]
#: tokens per input (incl. [CLS]/[SEP]) unless ``options.max_seq_length`` says otherwise
DEFAULT_MAX_SEQ_LENGTH = MAX_SEQ_LENGTH
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
#: a charset parameter longer than this is refused without a codec lookup
MAX_CHARSET_CHARS = 64
#: distinct charset spellings remembered (bounded: the parameter is caller-controlled)
CHARSET_CACHE_SIZE = 64

_charset_cache: dict = {}


def codec_for(charset: Optional[str]) -> str:
    """Python codec name for a mime ``charset``; UnsupportedMediaType when there is none.

    Only text encodings count: ``charset=base64`` names a codec, but not one that yields text.
    """
    if charset is None:
        return DEFAULT_CHARSET
    name = _charset_cache.get(charset)
    if name is not None:
        return name
    info = None
    if 0 < len(charset) <= MAX_CHARSET_CHARS:
        try:
            info = codecs.lookup(charset)
        except (LookupError, ValueError):  # ValueError: a NUL in the name
            info = None
    if info is not None:
        try:  # a codec that cannot decode at all (``undefined``) is no text encoding either
            info.decode(b"")
        except Exception:  # noqa: BLE001 - whatever it raises, it decodes nothing
            info = None
    if info is None or not getattr(info, "_is_text_encoding", True):
        shown = charset if len(charset) <= MAX_CHARSET_CHARS else charset[:MAX_CHARSET_CHARS] + "..."
        raise UnsupportedMediaType(
            f"unknown text charset {shown!r} in payload_mime; send UTF-8 (the default) or name a "
            f"text encoding such as utf-8, us-ascii, latin-1 or utf-16", "payload_mime")
    if len(_charset_cache) < CHARSET_CACHE_SIZE:
        _charset_cache[charset] = info.name
    return info.name


class TextEmbeddingBackend(TaskBackend):
    raw_mimes = (TEXT_MIME,)
    inline_prepare_max_bytes = INLINE_PREPARE_MAX_BYTES
    accepts_text = True
    options_schema = (
        Option("tokenizer", str, None, "path of the model's tokenizer.json; default: the "
                                       "tokenizer.json beside the model"),
        Option("max_seq_length", int, DEFAULT_MAX_SEQ_LENGTH,
               "tokens per input, [CLS] and [SEP] included; longer texts are truncated",
               lo=2, hi=MAX_POSITIONS),
        Option("max_batch_tokens", int, DEFAULT_MAX_BATCH_TOKENS,
               "token budget of one batch (rows x padded length); 0: length-blind batching",
               lo=0, hi=MAX_BATCH_TOKENS),
    )

    def __init__(self, config):
        super().__init__(config)
        self.tokenizer: Any = None
        self.max_seq_length: int = self.options["max_seq_length"]
        self.max_batch_tokens: int = self.options["max_batch_tokens"]
        self.vocab_size = 0
        self.model_id = ""
        self._signature: tuple = ()
        self._n_prefix = 1  # special tokens the post-processor puts before / after the text
        self._n_suffix = 1

    # -- lifecycle --------------------------------------------------------------------------
    def load(self) -> ModelSpec:
        cfg = self.config
        src, key = cfg.source, cfg.key
        model_path, tok_default = self._model_files()
        tok_path = self.options["tokenizer"] or tok_default
        if not os.path.isfile(tok_path):
            raise ConfigError(src, f"{key}.options.tokenizer",
                              f"must name the model's tokenizer.json; no such file: {tok_path!r}")
        self._load_tokenizer(tok_path)
        self.model_id = cfg.model_id or MINILM
        self._signature = signature(self.name, self.model_id, cfg.model_version, TOKEN_DTYPE,
                                    None, LAYOUT, PREPROCESS_ID)
        self.contract = TensorContract(
            specs=(TensorSpec(TOKEN_DTYPE, LAYOUT, frozenset({PREPROCESS_ID}),
                              ((1, 1), (1, self.max_seq_length))),),
            model_id=self.model_id, model_version=cfg.model_version,
            raw_preprocess_ids=frozenset({PREPROCESS_ID}))
        self.model = ModelSpec(
            model_path,
            [RaggedInput(INPUT_IDS, TOKEN_NP, pad_value=PAD_TOKEN_ID, mask_name=ATTENTION_MASK,
                         mask_dtype=TOKEN_NP)],
            [OutputSpec(OUTPUT, DTYPES[OUTPUT_DTYPE], (EMBEDDING_DIM,))])
        return self.model

    def _model_files(self) -> tuple:
        """(model.onnx, default tokenizer path): the configured file, else the prepared model."""
        cfg = self.config
        if cfg.model:
            if not os.path.isfile(cfg.model):
                raise ConfigError(cfg.source, f"{cfg.key}.model",
                                  f"no such file: {cfg.model} (leave it out to use the prepared "
                                  f"all-MiniLM-L6-v2 from `lumen models prepare`)")
            return cfg.model, os.path.join(os.path.dirname(cfg.model), TOKENIZER_FILE)
        directory = require_model(MINILM)  # names `lumen models prepare` if absent
        return str(directory / MODEL_FILE), str(directory / TOKENIZER_FILE)

    def _load_tokenizer(self, path: str) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        # Truncation is ours (see _token_ids): the library's also builds every overflow window.
        tok.no_truncation()
        tok.no_padding()
        probe = tok.encode("a")
        mask = probe.special_tokens_mask
        self._n_prefix = next(i for i, m in enumerate(mask) if not m)
        self._n_suffix = len(mask) - 1 - max(i for i, m in enumerate(mask) if not m)
        if self._n_prefix + self._n_suffix >= self.max_seq_length:
            raise ConfigError(self.config.source, f"{self.config.key}.options.max_seq_length",
                              f"must leave room for text after the tokenizer's "
                              f"{self._n_prefix + self._n_suffix} special tokens")
        self.tokenizer = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def batching_options(self) -> dict:
        return {"max_batch_tokens": self.max_batch_tokens}

    def warmup_requests(self) -> list:
        """A raw text and a longest-possible tensor: both routes, the largest buffers."""
        longest = np.full((1, self.max_seq_length), self.tokenizer.token_to_id("[UNK]") or 100,
                          dtype=TOKEN_NP)
        return [
            new_infer_request(self.name).for_raw_input(b"lumen warm-up", TEXT_MIME).build(),
            new_infer_request(self.name).for_tensor_array(longest, LAYOUT, PREPROCESS_ID).build(),
        ]

    def describe(self) -> dict:
        return {**super().describe(), "max_seq_length": self.max_seq_length,
                "max_batch_tokens": self.max_batch_tokens, "outputs": {OUTPUT: [OUTPUT_DTYPE, [EMBEDDING_DIM]]}}

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
        try:
            ids = self._token_ids(text, off_loop)
        except TypeError:  # tokenizers refuses str with lone surrogates (e.g. from utf-7)
            how = "is" if type(payload) is str else f"decodes ({codec}) to"
            raise InvalidArgument(f"payload {how} text with unpaired surrogate code points, "
                                  f"which is not text", "payload") from None
        arr = np.array(ids, dtype=TOKEN_NP)
        return PreparedModelRequest(self._signature, (arr,), (), len(ids))

    def prepare_tensor(self, req, desc, payload: memoryview) -> PreparedModelRequest:
        # dtype, layout, [1, L] with 1 <= L <= max_seq_length and the byte count are checked
        ids = np.frombuffer(payload, dtype=TOKEN_NP)
        # negative ids wrap to huge unsigned values: one reduction checks both bounds
        if int(ids.view("<u8").max()) >= self.vocab_size:
            pos = int(np.argmax(ids.view("<u8") >= self.vocab_size))
            raise InvalidArgument(
                f"token id {int(ids[pos])} at position {pos} is outside the vocabulary "
                f"[0, {self.vocab_size}) of {self.model_id}", "payload")
        # a writable buffer could change between this check and batch assembly: own a copy
        tensor = ids.copy() if not payload.readonly else payload
        return PreparedModelRequest(self._signature, (tensor,), (), ids.shape[0])

    def _token_ids(self, text: str, off_loop: bool) -> list:
        """WordPiece ids of ``text`` with [CLS]/[SEP], truncated like ``enable_truncation``.

        A long text is first tokenized by prefix: the ids kept after truncation are exact when
        the last kept token's word is not the prefix's last word (only that word can be cut by
        the prefix boundary: BERT normalisation is per character and words end at whitespace or
        punctuation).  Otherwise the prefix grows; in the worst case the whole text is read.
        """
        tok = self.tokenizer
        encode = (lambda s: tok.encode_batch([s])[0]) if off_loop else tok.encode
        limit = self.max_seq_length
        ns = self._n_suffix
        n = len(text)
        if n > LONG_TEXT_CHARS:
            p = LONG_TEXT_CHARS
            while p < n:
                enc = encode(text[:p])
                ids = enc.ids
                if len(ids) > limit:
                    words = enc.word_ids
                    kept_last = words[limit - 1 - ns]
                    prefix_last = words[len(ids) - 1 - ns]
                    if kept_last is not None and prefix_last is not None and kept_last < prefix_last:
                        return ids[:limit - ns] + ids[len(ids) - ns:]
                p *= PREFIX_GROWTH
        ids = encode(text).ids
        if len(ids) > limit:
            ids = ids[:limit - ns] + ids[len(ids) - ns:]
        return ids


#: engine instances of the built-in text_embed task (see default_task_table)
DEFAULT_INSTANCES = 2


def default_task_table() -> Optional[dict]:
    """The built-in ``text_embed`` task on the prepared all-MiniLM-L6-v2, or None when
    ``lumen models prepare`` has not been run (``Runtime.default()`` then leaves it out)."""
    try:
        require_model(MINILM)
    except ModelMissingError:
        return None
    # Two instances (threads per instance default to cores // instances): on the 2-core
    # reference box two single-thread sessions ran the in-process corpus at 1.11x the offline
    # best (sorted batches of 32, 2 threads) against 0.99x for one 2-thread session
    # (bench/README.md, "text_embed (in process)").
    return {"name": TASK_NAME, "backend": BACKEND_NAME, "model_id": MINILM,
            "model_version": "1", "instances": DEFAULT_INSTANCES}

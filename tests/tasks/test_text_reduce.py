"""Issue 12 item 6: long whitespace-free texts are shortened before tokenisation without
changing one id (``text_reduce.Reducer``), so 16 MB costs a bounded tokenizer call."""
from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lumen_core import models
from lumen_core.models import minilm
from lumen_core.tasks import text_embedding as te
from lumen_core.tasks import text_reduce

MB16 = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def tok_path(prepared_home):
    return str(models.model_dir(models.MINILM, prepared_home) / minilm.TOKENIZER_FILE)


class _Backend(te.TextEmbeddingBackend):
    """The tokenizer half of the backend (no ONNX session)."""

    def __init__(self, path, max_seq_length=te.DEFAULT_MAX_SEQ_LENGTH):  # noqa: D107
        self.max_seq_length = max_seq_length
        self._reducer = None
        self._n_prefix = self._n_suffix = 1
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()


class _Spy:
    """Delegates to the tokenizer and records how many characters each call was given."""

    def __init__(self, tok):
        self.tok = tok
        self.sizes: list = []

    def encode(self, s):
        self.sizes.append(len(s))
        return self.tok.encode(s)

    def encode_batch(self, batch):
        self.sizes.extend(len(s) for s in batch)
        return self.tok.encode_batch(batch)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def backend(tok_path):
    return _Backend(tok_path)


@pytest.fixture(scope="module")
def full(tok_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    tok.no_truncation()
    tok.no_padding()
    return tok


def _expected(full, text, limit=te.DEFAULT_MAX_SEQ_LENGTH):
    ids = full.encode(text).ids
    n = len(ids)
    return (ids[:limit - 1] + ids[-1:], n) if n > limit else (ids, 0)


def test_the_reducer_is_active_for_the_prepared_tokenizer(backend):
    r = text_reduce.Reducer(backend.tokenizer)
    assert r.ok
    assert r("a" * 5000) == "a" * 101
    assert r("é" * 5000) == "é" * 101
    assert r("  \t\n " * 1000) == " "
    assert r("x" + "\x01" * 1000 + "y") == "x\x01y"
    # scripts above U+3000 and astral symbols are solid too (issue 12 item 6: 16 MB of Hangul
    # took minutes): one long word of them is one [UNK] whatever its length
    for c in ("한", "ａ", "カ", "😀"):
        assert r(c * 5000) == c * 101
    # BERT's CJK ideographs are words of their own: never shortened
    assert r("中" * 5000) == "中" * 5000


_PIECES = st.sampled_from([
    "a", "Z", "é", "E\u0301", "\u0301", "ß", "İ", "ω", "Ж", "中", "東京", "!", ".", "[", "]",
    "[MASK]", "[UNK]", "[SEP", "MASK]", " ", "\t", "\n", "\u3000", "\u00a0", "\x00", "\x01",
    "\u200b", "\ufeff", "\ue000", "\u00ad", "1", "٣", "😀", "-", "'", "\u034f", "\u0345",
    "한", "ｶ", "ａ", "カ", "\U0001d400", "\U0001f1e6", "€", "\U0001faff",
])


@st.composite
def _texts(draw):
    parts = []
    for _ in range(draw(st.integers(1, 12))):
        piece = draw(_PIECES)
        reps = draw(st.sampled_from([1, 2, 3, 50, 99, 100, 101, 102, 250, 1200]))
        parts.append(piece * reps)
    return "".join(parts)


@settings(max_examples=80, deadline=None)
@given(text=_texts(), off_loop=st.booleans(), cut=st.booleans())
def test_results_equal_the_full_tokenisation(backend, full, text, off_loop, cut):
    text = text if len(text) > te.LONG_TEXT_CHARS else text * (te.LONG_TEXT_CHARS // len(text) + 1)
    exp_ids, exp_n = _expected(full, text)
    ids, n = backend._count_ids(text, off_loop, cut)
    if cut:  # the count of a cut text is the proving prefix's, above the limit
        assert ids == exp_ids and bool(n) == bool(exp_n)
        assert not n or n > te.DEFAULT_MAX_SEQ_LENGTH
    else:
        assert ids == full.encode(text).ids and n == exp_n
    assert full.encode(text_reduce.Reducer(backend.tokenizer)(text)).ids == full.encode(text).ids


@settings(max_examples=30, deadline=None)
@given(text=_texts(), limit=st.sampled_from([3, 8, 64, 512]))
def test_other_max_seq_lengths(tok_path, full, text, limit):
    b = _Backend(tok_path, limit)
    text = text * (te.LONG_TEXT_CHARS // len(text) + 1)
    ids, n = b._count_ids(text, False)
    exp_ids, exp_n = _expected(full, text, limit)
    assert ids == exp_ids and bool(n) == bool(exp_n)


def _punct(n):
    rng = random.Random(5)
    chars = "".join(chr(c) for c in range(33, 127) if not chr(c).isalnum())
    return "".join(rng.choices(chars, k=n))


@pytest.mark.parametrize("make", [
    lambda: "a" * MB16,
    lambda: "é" * (MB16 // 2),
    lambda: _punct(MB16),
    lambda: " " * MB16,
    lambda: "e\u0301" * (MB16 // 3),
    lambda: "\x01" * MB16,
    lambda: "한" * (MB16 // 3),
    lambda: "ａ" * (MB16 // 3),
    lambda: "😀" * (MB16 // 4),
    lambda: "カ한😀€ｶ" * (MB16 // 16),
], ids=["one-word", "e-acute", "punctuation", "spaces", "nfd", "controls", "hangul", "fullwidth",
        "emoji", "mixed-scripts"])
@pytest.mark.parametrize("off_loop", [False, True], ids=["encode", "encode_batch"])
def test_16mb_inputs_reach_the_tokenizer_bounded(tok_path, full, make, off_loop):
    b = _Backend(tok_path)
    spy = b.tokenizer = _Spy(b.tokenizer)
    text = make()
    ids, n = b._count_ids(text, off_loop)
    assert len(ids) <= te.DEFAULT_MAX_SEQ_LENGTH
    # bounded by what max_seq_length needs, not by the text: a few prefixes of a few KiB
    assert sum(spy.sizes) <= 64 * 1024, spy.sizes
    if n:  # cut: the first tokens are those of any long enough prefix
        assert ids == _expected(full, text[:40_000])[0]
    else:  # homogeneous runs: the same ids as a 40 KiB text of the same kind
        assert ids == full.encode(text[:40_000]).ids


# -- /v1/tokenize (issue 25 row 25): the same bounds, with character offsets into the text ----
def _rows(full, text, truncate, limit=te.DEFAULT_MAX_SEQ_LENGTH):
    """What ``tokenize`` must answer for ``text``: the full tokenization's rows (cut)."""
    enc = full.encode(text)
    rows = [{"id": i, "text": t, "special": bool(s), "start": a, "stop": b}
            for i, t, s, (a, b) in zip(enc.ids, enc.tokens, enc.special_tokens_mask,
                                       enc.offsets, strict=True)]
    if truncate and len(rows) > limit:
        rows = rows[:limit - 1] + rows[-1:]
    return rows


@settings(max_examples=80, deadline=None)
@given(text=_texts(), truncate=st.booleans())
# found by this test: a prefix whose end cut the added token "[UNK]" (a literal in the text)
# in half proved a cut that the whole text's "[UNK]" token straddles (Reducer.cut_words)
@example(text="a" * 205 + "[UNK]" * 99 + "中中中" + "a" * 102, truncate=True)
def test_tokenize_equals_the_full_tokenization_offsets_too(backend, full, text, truncate):
    text = text if len(text) > te.LONG_TEXT_CHARS else text * (te.LONG_TEXT_CHARS // len(text) + 1)
    assert backend.tokenize([text], truncate) == [_rows(full, text, truncate)]


@pytest.mark.parametrize("text", [
    "word " * 13_000, "a" * 70_000, " " * 70_000 + "tail", "x" + "\x01" * 70_000 + "y z",
    "é" * 30_000 + " after", "e\u0301" * 20_000, "中" * 70_000, "head " + "😀" * 20_000 + " end",
    "ab  " * 20_000, "a\u0301\u0301 " * 20_000,
], ids=["words", "one-word", "spaces", "controls", "e-acute", "nfd", "cjk", "emoji",
        "double-spaces", "marks"])
@pytest.mark.parametrize("truncate", [True, False])
def test_tokenize_of_long_degenerate_texts(backend, full, text, truncate):
    """Prefixes and the reducer, with offsets mapped back to the text: exact answers."""
    want = _rows(full, text, truncate)
    if not truncate and len(want) > te.MAX_TOKENIZE_TOKENS:
        with pytest.raises(te.PayloadTooLarge, match="MAX_TOKENIZE_TOKENS"):
            backend.tokenize([text], truncate)
    else:
        assert backend.tokenize([text], truncate) == [want]


MB4 = MB16 // 4


@pytest.mark.parametrize("make", [
    lambda: "word " * (MB4 // 5), lambda: "a" * MB4, lambda: " " * MB4,
    lambda: "e\u0301" * (MB4 // 3), lambda: _punct(MB4), lambda: "한" * (MB4 // 3),
], ids=["words", "one-word", "spaces", "nfd", "punctuation", "hangul"])
def test_tokenize_of_4mb_reaches_the_tokenizer_bounded(tok_path, make):
    """truncate=true costs what max_seq_length needs, as the embedding path does (4 MB of
    "word " took 6 s of CPU and 650 MB, one 8 MB word 2.26 GB); truncate=false is bounded by
    MAX_TOKENIZE_TOKENS, refused from a prefix once it is known to be over."""
    b = _Backend(tok_path)
    spy = b.tokenizer = _Spy(b.tokenizer)
    text = make()
    rows = b.tokenize([text], True)[0]
    assert len(rows) <= te.DEFAULT_MAX_SEQ_LENGTH
    assert all(0 <= r["start"] <= r["stop"] <= len(text) for r in rows)
    assert sum(spy.sizes) <= 64 * 1024, spy.sizes
    spy.sizes.clear()
    try:
        rows = b.tokenize([text], False)[0]
    except te.PayloadTooLarge as exc:
        assert "MAX_TOKENIZE_TOKENS" in exc.message
    else:
        assert len(rows) <= te.MAX_TOKENIZE_TOKENS
    assert sum(spy.sizes) <= 4 * te.MAX_TOKENIZE_TOKENS * 16, spy.sizes[-3:]


def test_one_giant_word_keeps_its_whole_span(tok_path):
    b = _Backend(tok_path)
    rows = b.tokenize(["a" * MB16 + " b"], True)[0]
    assert [(r["text"], r["start"], r["stop"]) for r in rows] == [
        ("[CLS]", 0, 0), ("[UNK]", 0, MB16), ("b", MB16 + 1, MB16 + 2), ("[SEP]", 0, 0)]

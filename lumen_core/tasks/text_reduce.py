"""Exact reduction of long texts for a WordPiece tokenizer: :class:`Reducer` shortens a text
without changing one of its token ids (so its token count is kept too), which lets the
``text_embedding`` backend tokenize a bounded prefix of any text made of words, spaces,
punctuation and CJK, whatever its length (``TextEmbeddingBackend._count_ids``); ``mapped``
gives the offsets back for ``/v1/tokenize``.
"""
from __future__ import annotations

import bisect
import json
import re
import unicodedata
from typing import Optional

#: candidates for "solid" characters: letters, digits and symbols of every plane (Latin, Greek,
#: Cyrillic, Indic, Hangul, kana, fullwidth forms, emoji, ...; BERT's CJK ideographs are split
#: into words of their own and fail the probe); each is verified against the tokenizer itself
#: before it is used (see :class:`Reducer`)
_SOLID_RANGE = (0x30, 0x20000)
#: (planes 2 and 3 are CJK ideographs, 4-13 unassigned, 14 tags, 15-16 private use: none solid
#: or none in a text worth shortening) letters, numbers, symbols and unassigned code points (the tokenizer's Unicode tables may be
#: newer than Python's: the probe, not the category, decides)
_SOLID_CATEGORIES = ("L", "N", "S", "Cn")
#: BERT's CJK ideograph blocks (each ideograph becomes a word of its own, never solid): left
#: out of the probe only to keep it quick, the probe would refuse them anyway
_CJK_BLOCKS = ((0x3400, 0x4DC0), (0x4E00, 0xA000), (0xF900, 0xFB00), (0x20000, 0x2A6E0),
               (0x2A700, 0x2B740), (0x2B740, 0x2B820), (0x2B820, 0x2CEB0), (0x2F800, 0x2FA20))
#: the longest runs of astral solid characters kept in the class (see _few_astral_ranges)
_MAX_ASTRAL_RANGES = 16
#: candidates probed in one normaliser call; a chunk that fails is probed one by one
_PROBE_CHUNK = 128
#: candidates for "vanishing" characters: C0/C1 controls, a few format characters, the BMP's
#: private use area (all removed by ``clean_text``, before NFD) and the combining diacritical
#: marks with a non-zero combining class (removed by accent stripping)
_VANISH_CANDIDATES = (
    [c for c in range(0x20) if chr(c) not in "\t\n\r"] + list(range(0x7F, 0xA0))
    + [0xAD, 0x200B, 0x200C, 0x200D, 0x200E, 0x200F, 0x2060, 0xFEFF] + list(range(0xE000, 0xF900))
    + [c for c in range(0x300, 0x370) if unicodedata.combining(chr(c))])
#: candidates for whitespace (each must normalise to one space)
_SPACE_CANDIDATES = [0x9, 0xA, 0xD, 0x20, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                     0x202F, 0x205F, 0x3000]


def _char_class(chars) -> str:
    """A regex character class (without brackets) matching exactly ``chars``."""
    cps = sorted({ord(c) for c in chars})
    parts = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        lo, hi = chr(cps[i]), chr(cps[j])
        parts.append(re.escape(lo) if i == j else f"{re.escape(lo)}-{re.escape(hi)}")
        i = j + 1
    return "".join(parts)


#: the probed solid characters per tokenizer configuration (see Reducer)
_SOLID_CACHE: dict = {}


def _few_astral_ranges(chars: list) -> list:
    """``chars`` less the astral characters outside long contiguous runs.  ``re`` tests a BMP
    character against a class in constant time (a bitmap) but walks the class's astral ranges
    one by one for every character the bitmap lacks: hundreds of small astral islands made a
    scan of plain words three times slower.  Leaving a character out of the solid class is
    always safe (its runs are just not shortened)."""
    bmp = [c for c in chars if ord(c) < 0x10000]
    runs: list = []
    for cp in sorted(ord(c) for c in chars if ord(c) >= 0x10000):
        if runs and runs[-1][1] == cp - 1:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp])
    runs = sorted(runs, key=lambda r: r[1] - r[0], reverse=True)[:_MAX_ASTRAL_RANGES]
    return bmp + [chr(cp) for lo, hi in runs for cp in range(lo, hi + 1)]


class Reducer:
    """Shortens a text without changing one of its WordPiece ids (so the token count is kept too).

    Three classes of characters are used, each verified against the loaded tokenizer (its
    normaliser and pre-tokenizer, one character at a time in a probe) rather than assumed:

    - *solid* S: normalises to one or more characters, none of them whitespace or punctuation
      and not split off like a CJK character (probe ``"a" + c + "a"`` is one pre-token of
      length >= 3);
    - *vanishing* T: normalises to nothing (probe ``"a" + c + "a"`` -> ``"aa"``): characters
      ``clean_text`` removes before NFD, and combining marks of non-zero combining class that
      accent stripping removes after it;
    - *space* W: normalises to exactly one space.

    BertNormalizer works per character (clean_text, CJK spacing, NFD + dropping nonspacing
    marks, per-character lowercase); the only interaction between characters is NFD's
    canonical reordering, which moves marks of non-zero class only within a run of such marks
    and never across a class-0 character.  BertPreTokenizer splits at whitespace and
    punctuation only.  Then, with every added token ([CLS], [MASK], ...) matched on the raw
    text, never normalised, without lstrip / rstrip / single_word, containing no T or W
    character and beginning and ending with a character outside S and T (BERT's all begin with
    ``[`` and end with ``]``) and at most ``K - 1`` long, these rewrites keep every id:

    1. a run of T characters -> its first one: the normalised text is the same (T characters
       vanish; removing marks of class != 0 from a run of such marks keeps the relative order of
       the rest, and removing ``clean_text``'s characters happens before NFD anyway).  One is
       kept so that no added token can be joined across the run.
    2. a run of two or more W / T characters (after 1, it holds a W) -> one space: a non-empty
       run of spaces between the same words either way.
    3. a run of S / T characters holding at least ``K = max_input_chars_per_word + 1`` S
       characters -> the run up to its K-th S character.  The run contains no word boundary, so
       it lies inside one word, whose normalised length is at least K before and after: that
       word is one [UNK] both times and every other word is untouched.

    No added-token match can touch a rewritten place: a match is at most ``K - 1`` long, and it
    would need its first or last character (outside S, T and W) inside the run it touches.
    The remaining prefix-first tokenisation in :meth:`TextEmbeddingBackend._count_ids` then
    reads a bounded prefix for every text made of these classes, punctuation, CJK and words.
    A character outside all three classes is left alone (correct, just not shortened).
    """

    def __init__(self, tok):
        self.ok = False
        #: the trailing words of a prefix that its end can change besides the last: an added
        #: token (``[UNK]``, ``[SEP]``, ...) cut in half is split into words of its own, and
        #: it spans at most one word per character (see ``TextEmbeddingBackend._proves_cut``)
        self.cut_words = max([len(t.content) for t in tok.get_added_tokens_decoder().values()]
                             + [1])
        try:
            cfg = json.loads(tok.to_str())
        except Exception:  # noqa: BLE001 - a tokenizer we cannot inspect is used unreduced
            return
        model = cfg.get("model") or {}
        if (model.get("type") != "WordPiece" or (cfg.get("normalizer") or {}).get("type")
                != "BertNormalizer" or (cfg.get("pre_tokenizer") or {}).get("type")
                != "BertPreTokenizer"):
            return
        k = int(model.get("max_input_chars_per_word", 100)) + 1
        norm = tok.normalizer.normalize_str
        pre = tok.pre_tokenizer.pre_tokenize_str
        # the probe reads ~130k code points (a few hundred ms): once per normaliser and
        # pre-tokenizer configuration in a process, not once per task or backend
        key = json.dumps([cfg.get("normalizer"), cfg.get("pre_tokenizer")], sort_keys=True)
        solid = _SOLID_CACHE.get(key)
        if solid is None:
            solid = _SOLID_CACHE[key] = self._solid(norm, pre)
        vanish = [chr(c) for c in _VANISH_CANDIDATES if norm("a" + chr(c) + "a") == "aa"]
        space = [chr(c) for c in _SPACE_CANDIDATES if norm(chr(c)) == " "]
        if not (solid and vanish and space):
            return
        inner = set(vanish) | set(space)
        edge = inner | set(solid)
        for added in cfg.get("added_tokens") or ():
            c = added.get("content") or ""
            if (not c or len(c) >= k or added.get("normalized") or added.get("lstrip")
                    or added.get("rstrip") or added.get("single_word")
                    or c[0] in edge or c[-1] in edge or any(ch in inner for ch in c)):
                return
        s, t, w = _char_class(solid), _char_class(vanish), _char_class(space)
        self._vanish_runs = re.compile(f"([{t}])[{t}]+")
        # after rule 1 no two T are adjacent, so a W / T run of two or more holds a W
        self._space_runs = re.compile(f"[{w}{t}]{{2,}}")
        # a match starts at an S not preceded by an S (the lookbehind, after the first
        # character so that the scan for a start stays a fast character-set scan) and keeps
        # its first K S characters; where it starts after a T it is still inside one run
        self._word_runs = re.compile(f"([{s}](?<![{s}].)(?:[{t}]*[{s}]){{{k - 1}}})[{s}{t}]+")
        self._vanish_tail = re.compile(f"[{t}]*\\Z")  # a run's trailing T (for offsets)
        self.ok = True

    @staticmethod
    def _solid(norm, pre) -> list:
        skip: set[int] = set()
        for lo, hi in ((0xD800, 0xE000), *_CJK_BLOCKS):
            skip.update(range(lo, hi))
        cats = _SOLID_CATEGORIES
        cands = [chr(c) for c in range(*_SOLID_RANGE) if c not in skip
                 and (unicodedata.category(chr(c))[0] in cats
                      or unicodedata.category(chr(c)) in cats)]
        out: list = []
        for i in range(0, len(cands), _PROBE_CHUNK):
            chunk = cands[i:i + _PROBE_CHUNK]
            # all at once when the whole chunk passes (the common case), else one at a time
            normed = norm(" ".join("a" + c + "a" for c in chunk))
            pieces = [p for p, _ in pre(normed)]
            if (len(pieces) == len(chunk) and normed == " ".join(pieces)
                    and all(len(p) >= 3 for p in pieces)):
                out.extend(chunk)
                continue
            for c in chunk:
                n = norm("a" + c + "a")
                p = pre(n)
                if len(p) == 1 and p[0][0] == n and len(n) >= 3:
                    out.append(c)
        return _few_astral_ranges(out)

    def __call__(self, text: str) -> str:
        # rule 3 first: it turns the costliest texts (one long word) into a few hundred
        # characters; every pattern starts with a character set (a fast scan) and consumes a
        # whole run from where it starts, so no run is rescanned from inside (rule 2's runs
        # of two or more hold a W once rule 1 has left no two T side by side)
        text = self._word_runs.sub(r"\1", text)
        text = self._vanish_runs.sub(r"\1", text)
        return self._space_runs.sub(" ", text)

    def mapped(self, text: str) -> tuple:
        """``(reduced text, back)``: the same rewrites as ``__call__``, and ``back(a, b)`` the
        character offsets in ``text`` of a token at ``a:b`` of the reduced text."""
        maps = []
        for pattern, keep, tail in ((self._word_runs, 1, self._vanish_tail),
                                    (self._vanish_runs, 1, None), (self._space_runs, 0, None)):
            text, spans = _rewrite(pattern, keep, tail, text)
            if spans:
                maps.append(_CharMap(spans))

        def char(p: int) -> int:
            for m in reversed(maps):
                p = m(p)
            return p

        def back(a: int, b: int) -> tuple:
            start = char(a)
            return start, (char(b - 1) + 1 if b > a else start)
        return text, back


def _rewrite(pattern: "re.Pattern", keep: int, tail: Optional["re.Pattern"], text: str) -> tuple:
    """``text`` with each match of ``pattern`` replaced by its group ``keep`` (0: one space),
    and the rewrites as ``(new start, new end, old start, old end, old last)``: ``old last``
    is where the kept part's last character stands for (``tail`` given: the match's last
    character before its trailing run of ``tail``, i.e. a cut word's last solid character)."""
    pieces: list = []
    spans: list = []
    last = shift = 0
    for m in pattern.finditer(text):
        a, b = m.span()
        kept = m.group(keep) if keep else " "
        # (tail is a `[...]*\Z`: it always matches, if only the empty string at b)
        end = tail.search(text, a, b).start() - 1 if tail is not None else a + len(kept) - 1  # type: ignore[union-attr]
        pieces += (text[last:a], kept)
        spans.append((a - shift, a - shift + len(kept), a, b, end))
        shift += (b - a) - len(kept)
        last = b
    if not spans:
        return text, spans
    pieces.append(text[last:])
    return "".join(pieces), spans


class _CharMap:
    """One rewrite pass, backwards: a character of the rewritten text -> the character of the
    text before that it stands for (a kept character is itself; the last one of a cut word is
    the word's last solid character, so a token ends where the word did)."""

    __slots__ = ("starts", "spans")

    def __init__(self, spans: list):
        self.spans = spans
        self.starts = [s[0] for s in spans]

    def __call__(self, p: int) -> int:
        i = bisect.bisect_right(self.starts, p) - 1
        if i < 0:
            return p
        new_start, new_end, old_start, old_end, old_last = self.spans[i]
        if p >= new_end:
            return old_end + (p - new_end)
        return old_last if p == new_end - 1 else old_start + (p - new_start)

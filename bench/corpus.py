"""Seeded, length-mixed English-ish text corpus for the text_embed benchmarks.

Shared by the in-process benchmark (``bench_text_embed.py``) and the HTTP load benchmark, so
both measure the same work.  The mix follows the issue: 50% short texts (5-20 words), 40%
medium (20-80), 10% long (80-200), drawn with a fixed seed and shuffled, so the order is
length-blind the way live traffic is.

Words come from a fixed vocabulary with a Zipf-like frequency so WordPiece token counts are
realistic: frequent function words are one token each, a tail of longer technical words splits
into several pieces, and a little punctuation, a few digits and capitalised sentence starts
appear.  Nothing depends on the global random state or the Python hash seed.

Run ``python bench/corpus.py`` to print the corpus statistics (and token counts when the model
is prepared).
"""
from __future__ import annotations

from typing import Optional, Sequence

# The generator lives in the package (``lumen bench`` ships with it); this module re-exports it
# so the benchmark scripts keep importing ``corpus`` and every tool sends the same texts.
from lumen_core.corpus import (  # noqa: F401
    DEFAULT_SEED,
    DEFAULT_SIZE,
    LENGTH_MIX,
    VOCABULARY,
    make_corpus,
)


def describe(texts: Sequence[str], tokenizer: Optional[object] = None) -> str:
    """One line of statistics: words (and WordPiece tokens, with a ``tokenizers.Tokenizer``)."""
    words = sorted(len(t.split()) for t in texts)
    line = (f"{len(texts)} texts, words min/median/mean/max "
            f"{words[0]}/{words[len(words) // 2]}/{sum(words) / len(words):.1f}/{words[-1]}")
    if tokenizer is not None:
        toks = sorted(len(e.ids) for e in tokenizer.encode_batch(list(texts)))  # type: ignore[attr-defined]
        line += (f"; tokens (incl. [CLS]/[SEP]) min/median/mean/max "
                 f"{toks[0]}/{toks[len(toks) // 2]}/{sum(toks) / len(toks):.1f}/{toks[-1]}")
    return line


if __name__ == "__main__":
    corpus = make_corpus()
    tok = None
    try:
        from lumen_core import models
        from lumen_core.models import minilm

        tok = minilm.load_tokenizer(models.require_model(models.MINILM) / minilm.TOKENIZER_FILE)
    except Exception as exc:  # noqa: BLE001 - statistics without tokens are still useful
        print(f"(no token counts: {exc})")
    print(describe(corpus, tok))
    for t in corpus[:3]:
        print("  ", t[:120])

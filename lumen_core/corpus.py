"""The seeded benchmark corpus: text-like strings of 5-200 words over a Zipf-weighted
vocabulary, the same for ``lumen bench``, the benchmarks in ``bench/`` and the int8 accuracy
check, so every figure is measured on the same texts."""
from __future__ import annotations

import random
from typing import Sequence

DEFAULT_SIZE = 2000
DEFAULT_SEED = 20240601
#: (share of texts, min words, max words) — inclusive bounds
LENGTH_MIX: tuple[tuple[float, int, int], ...] = ((0.5, 5, 20), (0.4, 20, 80), (0.1, 80, 200))
#: Zipf exponent of word frequencies (English is close to 1)
ZIPF_S = 1.05
#: chance that a sentence ends after a word (sentences of ~12 words on average)
SENTENCE_END_P = 0.08
#: chance of a comma after a word inside a sentence
COMMA_P = 0.05
#: chance that a word is replaced by a number
NUMBER_P = 0.02

# Ordered roughly by English frequency; the Zipf weights follow this order.
_COMMON = """
the of and to a in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no will
more can who out up about into than them some could time these two may other then do first
any now such like our over also new after only most made what where much many before must
through back years way well down should because each just those people how too little state
good very make world still own see men work long here get both between life being under never
day same another know while last might great old year off come since against go came right used
take three
""".split()

_DOMAIN = """
model request batch server runtime inference latency throughput queue worker thread memory
buffer tensor token sentence embedding vector network service client response error system
data search index document query result cache storage process signal audio image text file
user library version release update support performance language training learning feature
engineer team project product customer market price value report policy research question
answer energy water health school student market city river music story history science
""".split()

_RARE = """
quantization tokenizer transformer normalisation preprocessing deserialization interoperability
asynchronous concurrency backpressure orchestration observability heterogeneous photosynthesis
mitochondria cryptocurrency biodiversity infrastructure microservices containerization
vectorization parallelism throughput-oriented latency-sensitive kubernetes autoscaling
benchmarking idempotent checkpointing multilingual lexicographic hyperparameter regularization
backpropagation convolutional recurrent attention-based semiconductor thermodynamics
""".split()

VOCABULARY: tuple[str, ...] = tuple(_COMMON + _DOMAIN + _RARE)


def _weights(n: int) -> list[float]:
    return [1.0 / (rank + 1) ** ZIPF_S for rank in range(n)]


def _text(rng: random.Random, n_words: int, cum: Sequence[float]) -> str:
    words = rng.choices(VOCABULARY, cum_weights=cum, k=n_words)
    out: list[str] = []
    start = True
    for w in words:
        if rng.random() < NUMBER_P:
            w = str(rng.randrange(1, 100_000))
        if start:
            w = w[:1].upper() + w[1:]
            start = False
        r = rng.random()
        if r < SENTENCE_END_P:
            w += rng.choice(".!?") if rng.random() < 0.2 else "."
            start = True
        elif r < SENTENCE_END_P + COMMA_P:
            w += ","
        out.append(w)
    text = " ".join(out)
    return text if text.endswith((".", "!", "?")) else text + "."


def make_corpus(size: int = DEFAULT_SIZE, seed: int = DEFAULT_SEED) -> list[str]:
    """``size`` texts in the benchmark length mix (50% 5-20 words, 40% 20-80, 10% 80-200),
    shuffled so the order is length-blind like live traffic; deterministic for a ``seed``."""
    rng = random.Random(seed)
    cum: list[float] = []
    acc = 0.0
    for w in _weights(len(VOCABULARY)):
        acc += w
        cum.append(acc)
    counts = [int(round(share * size)) for share, _, _ in LENGTH_MIX]
    counts[0] += size - sum(counts)  # rounding remainder goes to the short bucket
    texts = [_text(rng, rng.randint(lo, hi), cum)
             for count, (_, lo, hi) in zip(counts, LENGTH_MIX, strict=True)
             for _ in range(count)]
    rng.shuffle(texts)
    return texts


# --------------------------------------------------------------------------- results

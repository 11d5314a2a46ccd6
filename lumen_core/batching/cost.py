"""A task's cost model, learnt online from the batches it runs (issue 30).

A batch's compute time is modelled as ``a + b * n + c * tokens``: ``n`` its size and
``tokens`` its padded token slots (``n * longest item``, for length-aware text batches; 0
elsewhere, where ``c`` stays 0).  The coefficients are fitted by exponentially weighted least
squares (recursive least squares with forgetting factor ``COST_FORGETTING``, kept in its direct
form: the weighted sums ``S = sum w x x^T`` and ``r = sum w x y`` and a 3x3 solve per batch),
so the model follows a cost curve that drifts (another process taking cores, a warmer cache)
and, unlike the covariance form, never winds up when every batch has the same size: a small
ridge on each diagonal keeps the solve defined in directions the batches do not explore (the
fit is then exact where the batches are, which is where predictions are asked for).

One update per finished batch, under the batcher's lock, in the worker thread that ran it;
never per request.  The model is owned by the batcher's latency guard
(``latency.LatencyGuard``), which copies what admission needs from it (``cost_fixed_ns`` /
``cost_item_ns``: a batch of ``n`` costs ``fixed + n * item``, the token term folded into the
per-item cost at the typical tokens per item) into its C fields when it learns
(``LatencyGuard.learn``), so the admission check is C arithmetic on plain fields.
"""
from __future__ import annotations

from typing import Any

#: weight of the past per batch: the model's memory is about ``1 / (1 - f)`` = 100 batches
COST_FORGETTING = 0.99
#: ridge on each diagonal of the normal equations, relative to that diagonal (Levenberg-
#: Marquardt style: scale-free, so token counts in the thousands and an intercept of 1 mix)
COST_RIDGE_REL = 1e-6
#: and absolute (keeps a feature no batch has shown, e.g. tokens of a dense task, at 0)
COST_RIDGE_ABS = 1e-9
#: batches learnt before predictions are trusted (admission refuses nothing before)
COST_MIN_SAMPLES = 8
#: weight of the newest batch in the running mean of tokens per item
TOKENS_EMA = 0.05

def _solve3(a00: float, a01: float, a02: float, a11: float, a12: float, a22: float,
            b0: float, b1: float, b2: float) -> tuple[float, float, float]:
    """``A x = b`` for a symmetric positive (semi)definite 3x3 ``A`` (its upper triangle), by
    an unrolled LDL^T; an unknown whose pivot vanishes (a direction no data spans) is 0."""
    d0 = a00
    l10 = a01 / d0 if d0 > 0.0 else 0.0
    l20 = a02 / d0 if d0 > 0.0 else 0.0
    d1 = a11 - l10 * l10 * d0
    l21 = (a12 - l20 * l10 * d0) / d1 if d1 > 0.0 else 0.0
    d2 = a22 - l20 * l20 * d0 - l21 * l21 * d1
    y0 = b0
    y1 = b1 - l10 * y0
    y2 = b2 - l20 * y0 - l21 * y1
    x2 = y2 / d2 if d2 > 0.0 else 0.0
    x1 = (y1 / d1 if d1 > 0.0 else 0.0) - l21 * x2
    x0 = (y0 / d0 if d0 > 0.0 else 0.0) - l10 * x1 - l20 * x2
    return x0, x1, x2


class CostModel:
    """``compute_us ~ a + b n + c tokens`` of one batcher (module docstring).

    ``s`` holds the upper triangle of the weighted ``sum x x^T`` (``s00 s01 s02 s11 s12
    s22``), ``r`` the weighted ``sum x y``, for ``x = (1, n, tokens)``; unrolled, a batch
    costs a few microseconds of the worker thread.
    """

    __slots__ = ("forgetting", "s", "r", "theta", "samples", "tokens_per_item", "last_error_us")

    def __init__(self, forgetting: float = COST_FORGETTING):
        self.forgetting = forgetting
        self.s = (0.0,) * 6
        self.r = (0.0,) * 3
        self.theta = (0.0, 0.0, 0.0)
        self.samples = 0
        self.tokens_per_item = 0.0
        self.last_error_us = 0.0  # the newest batch's prediction error before it was learnt

    def fresh(self) -> "CostModel":
        """A model that has learnt nothing, with this one's forgetting factor (a stale model
        starts over: ``latency.LatencyGuard.forget``)."""
        return CostModel(self.forgetting)

    def update(self, n: float, tokens: int, compute_us: float) -> None:
        """Learn one finished batch of ``n`` items (typical rows: may be fractional or larger
        than the batch, see ``LatencyGuard.learn``) and ``tokens`` padded token slots."""
        if n <= 0:
            return
        lam = self.forgetting
        x1 = float(n)
        x2 = float(tokens)
        y = float(compute_us)
        if self.samples:
            self.last_error_us = y - self.predict_us(n, tokens)
        s00, s01, s02, s11, s12, s22 = self.s
        r0, r1, r2 = self.r
        s = self.s = (lam * s00 + 1.0, lam * s01 + x1, lam * s02 + x2, lam * s11 + x1 * x1,
                      lam * s12 + x1 * x2, lam * s22 + x2 * x2)
        r = self.r = (lam * r0 + y, lam * r1 + x1 * y, lam * r2 + x2 * y)
        rel, ab = 1.0 + COST_RIDGE_REL, COST_RIDGE_ABS
        self.theta = _solve3(s[0] * rel + ab, s[1], s[2], s[3] * rel + ab, s[4],
                             s[5] * rel + ab, r[0], r[1], r[2])
        per = x2 / x1
        self.tokens_per_item = per if not self.samples else (
            self.tokens_per_item + TOKENS_EMA * (per - self.tokens_per_item))
        self.samples += 1

    def predict_us(self, n: float, tokens: int = 0) -> float:
        """Predicted compute time (us) of a batch of ``n`` items and ``tokens`` slots (>= 0)."""
        a, b, c = self.theta
        return max(0.0, a + b * n + c * tokens)

    def linear(self) -> tuple[float, float]:
        """``(fixed_us, item_us)``: a batch of ``n`` typical items costs ``fixed + n * item``
        (tokens at the running mean per item); both >= 0."""
        a, b, c = self.theta
        return max(0.0, a), max(0.0, b + c * self.tokens_per_item)

    @property
    def ready(self) -> bool:
        return self.samples >= COST_MIN_SAMPLES

    def snapshot(self) -> dict[str, Any]:
        """The model as ``rt.load()`` and ``/metrics`` show it (times in microseconds)."""
        a, b, c = self.theta
        fixed, item = self.linear()
        return {"samples": self.samples, "ready": self.ready, "intercept_us": a,
                "per_item_us": b, "per_token_us": c, "tokens_per_item": self.tokens_per_item,
                "batch_fixed_us": fixed, "batch_item_us": item,
                "last_error_us": self.last_error_us}


__all__ = ["COST_FORGETTING", "COST_MIN_SAMPLES", "CostModel"]

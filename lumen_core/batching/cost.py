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
never per request.  What admission needs from it (``scheduler.Admission.cost_fixed_ns`` /
``cost_item_ns``: a batch of ``n`` costs ``fixed + n * item``, the token term folded into the
per-item cost at the typical tokens per item) is written onto the admission by
``QueuePolicy.learn``, so the admission check is C arithmetic on plain fields.
"""
from __future__ import annotations

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

_N = 3  # features: 1, n, tokens


def _solve(a: list, b: list) -> list:
    """``a x = b`` for a small dense system (Gaussian elimination, partial pivoting); a
    singular column gives 0 for its unknown."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if m[piv][col] == 0.0:
            continue
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                row, top = m[r], m[col]
                for k in range(col, n + 1):
                    row[k] -= f * top[k]
    x = [0.0] * n
    for col in range(n - 1, -1, -1):
        p = m[col][col]
        if p == 0.0:
            continue
        x[col] = (m[col][n] - sum(m[col][k] * x[k] for k in range(col + 1, n))) / p
    return x


class CostModel:
    """``compute_us ~ a + b n + c tokens`` of one batcher (module docstring)."""

    __slots__ = ("forgetting", "s", "r", "theta", "samples", "tokens_per_item", "last_error_us")

    def __init__(self, forgetting: float = COST_FORGETTING):
        self.forgetting = forgetting
        self.s = [[0.0] * _N for _ in range(_N)]
        self.r = [0.0] * _N
        self.theta = (0.0, 0.0, 0.0)
        self.samples = 0
        self.tokens_per_item = 0.0
        self.last_error_us = 0.0  # the newest batch's prediction error before it was learnt

    def update(self, n: int, tokens: int, compute_us: float) -> None:
        """Learn one finished batch of ``n`` items and ``tokens`` padded token slots."""
        if n <= 0:
            return
        lam = self.forgetting
        x = (1.0, float(n), float(tokens))
        y = float(compute_us)
        if self.samples:
            self.last_error_us = y - self.predict_us(n, tokens)
        s, r = self.s, self.r
        for i in range(_N):
            r[i] = lam * r[i] + x[i] * y
            row = s[i]
            for j in range(_N):
                row[j] = lam * row[j] + x[i] * x[j]
        a = [[s[i][j] + ((COST_RIDGE_REL * s[i][i] + COST_RIDGE_ABS) if i == j else 0.0)
              for j in range(_N)] for i in range(_N)]
        self.theta = tuple(_solve(a, r))
        per = tokens / n
        self.tokens_per_item = per if not self.samples else (
            self.tokens_per_item + TOKENS_EMA * (per - self.tokens_per_item))
        self.samples += 1

    def predict_us(self, n: int, tokens: int = 0) -> float:
        """Predicted compute time (us) of a batch of ``n`` items and ``tokens`` slots (>= 0)."""
        a, b, c = self.theta
        return max(0.0, a + b * n + c * tokens)

    def linear(self) -> tuple:
        """``(fixed_us, item_us)``: a batch of ``n`` typical items costs ``fixed + n * item``
        (tokens at the running mean per item); both >= 0."""
        a, b, c = self.theta
        return max(0.0, a), max(0.0, b + c * self.tokens_per_item)

    @property
    def ready(self) -> bool:
        return self.samples >= COST_MIN_SAMPLES

    def snapshot(self) -> dict:
        """The model as ``rt.load()`` and ``/metrics`` show it (times in microseconds)."""
        a, b, c = self.theta
        fixed, item = self.linear()
        return {"samples": self.samples, "ready": self.ready, "intercept_us": a,
                "per_item_us": b, "per_token_us": c, "tokens_per_item": self.tokens_per_item,
                "batch_fixed_us": fixed, "batch_item_us": item,
                "last_error_us": self.last_error_us}


__all__ = ["COST_FORGETTING", "COST_MIN_SAMPLES", "CostModel"]

"""What a person sees of a long job: a progress line, bad rows as they are found, a summary.

On a terminal the line is redrawn in place (``\\r``) at most ``TTY_INTERVAL_S`` apart; into a
file or a pipe (a log, CI) it is a plain line every ``LINE_INTERVAL_S``.  Rows/s is the rate of
this run (rows embedded since it started); the total is known up front for Parquet and once
the input is read to its end, and estimated from the bytes read before that (``~``).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, TextIO

TTY_INTERVAL_S = 0.2
LINE_INTERVAL_S = 10.0
BAR_WIDTH = 24
MODES = ("auto", "bar", "lines", "none")


def plural(n: int, word: str) -> str:
    """``1 bad row`` / ``2 bad rows``."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``."""
    s = int(max(0, seconds) + 0.5)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass
class Summary:
    """The end of a job: rows read (this run and before it), written, bad, truncated; tokens
    and seconds of this run."""

    output: str
    rows_in: int = 0
    rows_out: int = 0
    resumed_rows: int = 0
    bad: int = 0
    truncated: int = 0
    tokens: int = 0
    seconds: float = 0.0
    embedded_now: int = 0

    def lines(self) -> list:
        rate = self.embedded_now / self.seconds if self.seconds > 0 else 0.0
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        out = [f"done: {plural(self.rows_out, 'row')} -> {self.output} ({self.rows_in:,} "
               f"read, {plural(self.bad, 'bad row')} skipped, "
               f"{plural(self.truncated, 'text')} truncated)"]
        resumed = (f" (resumed after {self.resumed_rows:,} rows)" if self.resumed_rows else "")
        out.append(f"this run: {self.embedded_now:,} rows in {clock(self.seconds)}{resumed}: "
                   f"{rate:,.1f} rows/s, {tps:,.0f} tokens/s")
        return out


class Progress:
    """The progress line (see the module docstring); ``mode`` ``auto`` picks ``bar`` on a
    terminal, else ``lines``."""

    def __init__(self, stream: Optional[TextIO] = None, mode: str = "auto",
                 interval_s: Optional[float] = None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "lines"
        self.mode = mode
        self.interval = interval_s if interval_s is not None else (
            TTY_INTERVAL_S if mode == "bar" else LINE_INTERVAL_S)
        self.t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False
        self.resumed = 0

    def start(self, resumed: int) -> None:
        self.t0 = time.monotonic()
        self._last = self.t0
        self.resumed = resumed

    def say(self, line: str) -> None:
        """A line of its own (a bad row, a note), above the bar on a terminal."""
        if self.mode == "none":
            return
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self._drawn = False
        self.stream.write(line + "\n")
        self.stream.flush()

    def update(self, done: int, total: Optional[int], exact: bool, force: bool = False) -> None:
        """``done`` rows of ``total`` (None: unknown; ``exact`` False: an estimate)."""
        if self.mode == "none":
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        elapsed = now - self.t0
        rate = (done - self.resumed) / elapsed if elapsed > 0 else 0.0
        text = self._text(done, total, exact, rate)
        if self.mode == "bar":
            self.stream.write("\r\x1b[K" + text)
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _text(self, done: int, total: Optional[int], exact: bool, rate: float) -> str:
        tilde = "" if exact else "~"
        if total:
            frac = min(1.0, done / total)
            eta = clock((total - done) / rate) if rate > 0 and total > done else "-"
            if self.mode == "bar":
                fill = int(frac * BAR_WIDTH)
                bar = "#" * fill + "." * (BAR_WIDTH - fill)
                return (f"embed [{bar}] {done:,}/{tilde}{total:,} rows {frac:6.1%} "
                        f"{rate:,.1f} rows/s ETA {eta}")
            return (f"embedded {done:,} of {tilde}{total:,} rows ({frac:.1%}), "
                    f"{rate:,.1f} rows/s, ETA {eta}")
        return f"embedded {done:,} rows, {rate:,.1f} rows/s"

    def finish(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


#: what the job asks of the input for the progress total: ``(rows read, fraction read)``
TotalSource = Callable[[], tuple]

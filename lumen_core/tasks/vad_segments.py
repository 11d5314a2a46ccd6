"""Speech segments from Silero VAD probabilities, with the ``silero-vad`` package's semantics.

A port (numpy / plain Python, no torch) of ``get_speech_timestamps_from_probs`` in
``silero_vad/utils_vad.py`` (what ``get_speech_timestamps`` runs after the model): hysteresis
between ``threshold`` and ``neg_threshold = max(threshold - 0.15, 0.01)``, a speech chunk ends
after ``min_silence_duration_ms`` below ``neg_threshold``, chunks of at most
``min_speech_duration_ms`` are dropped, chunks longer than ``max_speech_duration_s`` are split
at the longest silence inside them (over 98 ms) or cut, and every chunk is padded by
``speech_pad_ms`` each side (two chunks closer than twice the pad share the gap).

:class:`Segmenter` runs it *incrementally*, one probability per 512-sample chunk, and reports
a segment's start and end as soon as later audio can no longer change them (a start once the
chunk is sure to outlive ``min_speech_duration_ms``, an end once the pad or the next start is
settled), so a live stream's events equal the whole file's segments.  :func:`speech_segments`
is the offline form: the same machine over a whole array, then :meth:`Segmenter.finish`.

Options arrive per request as ``lumen.vad.*`` keys (:func:`segment_options`) over the task's
``[tasks.options]`` (:data:`OPTION_SCHEMA`, the vad backend's ``options_schema``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence, cast

import numpy as np

from ..config import Option
from ..contract import (
    KEY_VAD_EVENTS,
    KEY_VAD_MAX_SPEECH_DURATION_S,
    KEY_VAD_MIN_SILENCE_DURATION_MS,
    KEY_VAD_MIN_SPEECH_DURATION_MS,
    KEY_VAD_SPEECH_PAD_MS,
    KEY_VAD_THRESHOLD,
    RESERVED_PREFIX,
    VAD_KEYS,
)
from ..errors import InvalidArgument
from ..models.silero import CHUNK_SAMPLES, SAMPLE_RATE

#: silero-vad's fixed parameters of the max-speech split (not per request)
MIN_SILENCE_AT_MAX_SPEECH_MS = 98
USE_MAX_POSS_SIL_AT_MAX_SPEECH = True
#: neg_threshold = max(threshold - NEG_THRESHOLD_GAP, NEG_THRESHOLD_FLOOR)
NEG_THRESHOLD_GAP = 0.15
NEG_THRESHOLD_FLOOR = 0.01
#: bounds of the millisecond options (an hour; bounds the parse on hostile input)
MAX_OPTION_MS = 3_600_000
MAX_OPTION_CHARS = 32


@dataclass(frozen=True)
class SegmentOptions:
    threshold: float = 0.5
    min_speech_duration_ms: int = 250
    min_silence_duration_ms: int = 100
    speech_pad_ms: int = 30
    #: None: no limit (silero's ``float('inf')``)
    max_speech_duration_s: Optional[float] = None

    @property
    def neg_threshold(self) -> float:
        return max(self.threshold - NEG_THRESHOLD_GAP, NEG_THRESHOLD_FLOOR)

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS = SegmentOptions()

#: the vad backend's ``[tasks.options]`` (the task's defaults of the ``lumen.vad.*`` keys)
OPTION_SCHEMA = (
    Option("threshold", float, DEFAULTS.threshold,
           "the speech probability at or above which a chunk is speech", lo=0.0, hi=1.0),
    Option("min_speech_duration_ms", int, DEFAULTS.min_speech_duration_ms,
           "the shortest speech segment kept", lo=0, hi=MAX_OPTION_MS),
    Option("min_silence_duration_ms", int, DEFAULTS.min_silence_duration_ms,
           "the silence that ends a speech segment", lo=0, hi=MAX_OPTION_MS),
    Option("speech_pad_ms", int, DEFAULTS.speech_pad_ms,
           "the padding added to each side of a segment", lo=0, hi=MAX_OPTION_MS),
    Option("max_speech_duration_s", float, None,
           "the longest speech segment before it is split (absent: no limit)", lo=0.0),
)


#: the request keys of the vad task (its backend's ``request_options``): ``lumen.vad.<option>``
#: overrides that ``[tasks.options]`` default for one request or stream
REQUEST_OPTIONS = {
    **{f"{RESERVED_PREFIX}vad.{o.name}": f"{o.doc} (overrides [tasks.options] {o.name})"
       for o in OPTION_SCHEMA},
    KEY_VAD_EVENTS: "true on the first request of a gRPC InferStream sequence: its replies "
                    "carry the segment events each chunk settles",
}


def options_from_config(options: Mapping) -> SegmentOptions:
    """The task's defaults from its checked ``[tasks.options]`` (``read_options`` output)."""
    vals = {o.name: options.get(o.name, o.default) for o in OPTION_SCHEMA}
    if vals["max_speech_duration_s"] is not None:
        vals["max_speech_duration_s"] = float(vals["max_speech_duration_s"])
        if vals["max_speech_duration_s"] <= 0:
            raise ValueError("max_speech_duration_s must be > 0")
    vals["threshold"] = float(vals["threshold"])
    return SegmentOptions(**vals)


def has_vad_keys(meta: Optional[Mapping]) -> bool:
    return meta is not None and any(k in VAD_KEYS for k in meta)


def _bad(key: str, what: str, value: object) -> InvalidArgument:
    text = str(value)
    if len(text) > 40:
        text = text[:40] + "..."
    return InvalidArgument(f"{key} must be {what}, got {text!r}", key)


def _float(key: str, value: object, what: str) -> float:
    if not isinstance(value, str) or len(value) > MAX_OPTION_CHARS:
        raise _bad(key, what, value)
    try:
        v = float(value)
    except ValueError:
        raise _bad(key, what, value) from None
    if not math.isfinite(v):
        raise _bad(key, what, value)
    return v


def _ms(key: str, value: object) -> int:
    what = f"an integer number of milliseconds in 0..{MAX_OPTION_MS}"
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() \
            or len(value) > MAX_OPTION_CHARS:
        raise _bad(key, what, value)
    v = int(value)
    if v > MAX_OPTION_MS:
        raise _bad(key, what, value)
    return v


def segment_options(meta: Optional[Mapping], base: SegmentOptions = DEFAULTS) -> SegmentOptions:
    """``base`` (the task's defaults) overridden by the request's ``lumen.vad.*`` keys, each
    checked: ``InvalidArgument`` naming the key at fault."""
    if meta is None or not has_vad_keys(meta):
        return base
    ev = meta.get(KEY_VAD_EVENTS)
    if ev is not None and ev not in ("true", "false"):
        raise _bad(KEY_VAD_EVENTS, "true or false", ev)
    vals = base.to_dict()
    t = meta.get(KEY_VAD_THRESHOLD)
    if t is not None:
        vals["threshold"] = _float(KEY_VAD_THRESHOLD, t, "a number in 0..1")
        if not 0.0 <= vals["threshold"] <= 1.0:
            raise _bad(KEY_VAD_THRESHOLD, "a number in 0..1", t)
    for key, name in ((KEY_VAD_MIN_SPEECH_DURATION_MS, "min_speech_duration_ms"),
                      (KEY_VAD_MIN_SILENCE_DURATION_MS, "min_silence_duration_ms"),
                      (KEY_VAD_SPEECH_PAD_MS, "speech_pad_ms")):
        v = meta.get(key)
        if v is not None:
            vals[name] = _ms(key, v)
    m = meta.get(KEY_VAD_MAX_SPEECH_DURATION_S)
    if m is not None:
        what = "a number of seconds > 0, or 'inf' for no limit"
        if isinstance(m, str) and m.strip().lower() in ("inf", "infinity", "none"):
            vals["max_speech_duration_s"] = None
        else:
            v = _float(KEY_VAD_MAX_SPEECH_DURATION_S, m, what)
            if v <= 0:
                raise _bad(KEY_VAD_MAX_SPEECH_DURATION_S, what, m)
            vals["max_speech_duration_s"] = v
    return SegmentOptions(**vals)


def samples_to_ms(samples: float, sampling_rate: int = SAMPLE_RATE) -> float:
    """Milliseconds of ``samples`` (exact in binary at 16 kHz: 1/16 ms steps)."""
    return samples * 1000.0 / sampling_rate


class Segmenter:
    """Silero's segment state machine fed one probability per chunk.

    :meth:`push` takes the probability of the next 512-sample chunk and returns the events
    it settles, ``("start", sample)`` / ``("end", sample)`` in order; :meth:`finish` takes the
    stream's true length in samples (the last chunk may have been zero-padded) and returns the
    rest.  :attr:`segments` holds the finished ``(start, end)`` pairs in samples.
    """

    def __init__(self, options: SegmentOptions = DEFAULTS, sampling_rate: int = SAMPLE_RATE,
                 window: int = CHUNK_SAMPLES):
        self.options = options
        sr = sampling_rate
        self.window = window
        self.threshold = float(options.threshold)
        self.neg_threshold = options.neg_threshold
        self.min_speech = sr * options.min_speech_duration_ms / 1000
        self.pad = sr * options.speech_pad_ms / 1000
        max_s = math.inf if options.max_speech_duration_s is None else options.max_speech_duration_s
        self.max_speech = sr * max_s - window - 2 * self.pad
        self.min_silence = sr * options.min_silence_duration_ms / 1000
        self.min_silence_at_max = sr * MIN_SILENCE_AT_MAX_SPEECH_MS / 1000
        # the machine (names as in utils_vad.py)
        self.triggered = False
        self.temp_end = 0
        self.prev_end = self.next_start = 0
        self.possible_ends: list = []
        self.current_start: Optional[int] = None  # current_speech['start'] (None: {})
        self.n = 0  # chunks pushed
        self.raw: list = []  # [start, end] of each finished raw segment
        self.segments: list = []  # padded (start, end) of each segment whose end is settled
        self._starts: list = []  # padded starts sent
        self.finished = False

    # -- the machine ------------------------------------------------------------------------
    def _step(self, p: float) -> None:
        cur = self.window * self.n
        self.n += 1
        thr = self.threshold
        if p >= thr and self.temp_end:
            sil = cur - self.temp_end
            if sil > self.min_silence_at_max:
                self.possible_ends.append((self.temp_end, sil))
            self.temp_end = 0
            if self.next_start < self.prev_end:
                self.next_start = cur
        if p >= thr and not self.triggered:
            self.triggered = True
            self.current_start = cur
            return
        if self.triggered and cur - cast(int, self.current_start) > self.max_speech:
            if USE_MAX_POSS_SIL_AT_MAX_SPEECH and self.possible_ends:
                prev_end, dur = max(self.possible_ends, key=lambda x: x[1])
                self.raw.append([self.current_start, prev_end])
                self.current_start = None
                next_start = prev_end + dur
                if next_start < prev_end + cur:
                    self.current_start = next_start
                else:
                    self.triggered = False
                self.prev_end = self.next_start = self.temp_end = 0
                self.possible_ends = []
            elif self.prev_end:
                self.raw.append([self.current_start, self.prev_end])
                self.current_start = None
                if self.next_start < self.prev_end:
                    self.triggered = False
                else:
                    self.current_start = self.next_start
                self.prev_end = self.next_start = self.temp_end = 0
                self.possible_ends = []
            else:
                self.raw.append([self.current_start, cur])
                self.current_start = None
                self.prev_end = self.next_start = self.temp_end = 0
                self.triggered = False
                self.possible_ends = []
                return
        if p < self.neg_threshold and self.triggered:
            if not self.temp_end:
                self.temp_end = cur
            sil_now = cur - self.temp_end
            if not USE_MAX_POSS_SIL_AT_MAX_SPEECH and sil_now > self.min_silence_at_max:
                self.prev_end = self.temp_end
            if sil_now < self.min_silence:
                return
            if self.temp_end - cast(int, self.current_start) > self.min_speech:
                self.raw.append([self.current_start, self.temp_end])
            self.current_start = None
            self.prev_end = self.next_start = self.temp_end = 0
            self.triggered = False
            self.possible_ends = []

    # -- settling padded boundaries ---------------------------------------------------------
    def _confirmed_current(self) -> bool:
        """The open segment can no longer be dropped as shorter than min_speech."""
        if self.current_start is None:
            return False
        if self.finished:
            return False
        low_end = self.temp_end if self.temp_end else self.window * (self.n - 1) + 1
        return low_end - self.current_start > self.min_speech

    def _padded_start(self, k: int, starts: list) -> int:
        s = starts[k]
        if k == 0:
            return int(max(0, s - self.pad))
        sil = s - self.raw[k - 1][1]
        if sil < 2 * self.pad:
            return int(max(0, s - sil // 2))
        return int(max(0, s - self.pad))

    def _padded_end(self, k: int, starts: list, length: Optional[int]) -> Optional[int]:
        e = self.raw[k][1]
        if k + 1 < len(starts):
            sil = starts[k + 1] - e
            if sil < 2 * self.pad:
                return int(e + sil // 2)
            val = e + self.pad
        elif length is not None:  # finished: the last segment
            return int(min(length, e + self.pad))
        else:
            next_min = (self.current_start if self.current_start is not None
                        else self.window * self.n)
            if next_min - e < 2 * self.pad:
                return None
            val = e + self.pad
        if length is not None:
            return int(min(length, val))
        # the stream holds at least this many samples (its last chunk may be short)
        known = self.window * (self.n - 1) + 1 if self.n else 0
        return int(val) if val <= known else None

    def _settle(self, length: Optional[int] = None) -> list:
        starts = [s for s, _ in self.raw]
        if self._confirmed_current():
            starts.append(self.current_start)
        events = []
        while len(self._starts) < len(starts):
            k = len(self._starts)
            s = self._padded_start(k, starts)
            self._starts.append(s)
            events.append(("start", s))
            # a settled start may settle the previous end (the ends loop runs below)
        while len(self.segments) < len(self.raw):
            k = len(self.segments)
            if k >= len(self._starts):
                break
            e = self._padded_end(k, starts, length)
            if e is None:
                break
            self.segments.append((self._starts[k], e))
            events.append(("end", e))
        if len(events) > 1:  # starts first in the loop above; report in time order
            events.sort(key=lambda ev: (ev[1], ev[0] == "start"))
        return events

    def push(self, prob: float) -> list:
        if self.finished:
            raise RuntimeError("push after finish")
        self._step(float(prob))
        return self._settle()

    def push_many(self, probs: Sequence[float]) -> list:
        events = []
        for p in np.asarray(probs, dtype=np.float64).tolist():
            self._step(p)
            events += self._settle()
        return events

    def finish(self, length_samples: Optional[int] = None) -> list:
        """End of stream; ``length_samples`` defaults to every pushed chunk in full."""
        if self.finished:
            return []
        length = self.window * self.n if length_samples is None else int(length_samples)
        if self.current_start is not None and length - self.current_start > self.min_speech:
            self.raw.append([self.current_start, length])
        self.current_start = None
        self.finished = True
        return self._settle(length)


def speech_segments(probs: Sequence[float], length_samples: Optional[int] = None,
                    options: SegmentOptions = DEFAULTS) -> list:
    """``[(start, end), ...]`` in samples: silero's ``get_speech_timestamps_from_probs``."""
    seg = Segmenter(options)
    seg.push_many(probs)
    seg.finish(length_samples)
    return list(seg.segments)


def segments_json(segments: Sequence[tuple], sampling_rate: int = SAMPLE_RATE) -> list:
    return [{"start_ms": samples_to_ms(s, sampling_rate), "end_ms": samples_to_ms(e, sampling_rate)}
            for s, e in segments]

"""Speech segments (lumen_core/tasks/vad_segments.py) against silero-vad's own post-process.

The reference is the package's ``get_speech_timestamps_from_probs``, taken from
``silero_vad/utils_vad.py`` by source (the module imports torch, which never enters this
install; the function itself is plain Python).  Hand-computed cases pin the semantics even
without the package.
"""
from __future__ import annotations

import ast
import importlib.util
import math
import pathlib

import numpy as np
import pytest

import lumen_core as lc
from lumen_core import config as C
from lumen_core.tasks import vad_segments as vs


def reference_function():
    spec = importlib.util.find_spec("silero_vad")
    # the install always has it (`make install` adds it --no-deps): its absence is a failure
    assert spec is not None and spec.submodule_search_locations, \
        "silero-vad is not installed: pip install --no-deps silero-vad==6.2.3"
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "utils_vad.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "get_speech_timestamps_from_probs")
    ns: dict = {"List": list, "make_visualization": None}
    exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    return ns["get_speech_timestamps_from_probs"]


def ref_segments(ref, probs, length, opts: vs.SegmentOptions):
    m = opts.max_speech_duration_s
    out = ref([float(p) for p in probs], threshold=opts.threshold,
              min_speech_duration_ms=opts.min_speech_duration_ms,
              min_silence_duration_ms=opts.min_silence_duration_ms,
              speech_pad_ms=opts.speech_pad_ms,
              max_speech_duration_s=math.inf if m is None else m,
              audio_length_samples=length)
    return [(d["start"], d["end"]) for d in out]


def streamed(probs, length, opts):
    seg = vs.Segmenter(opts)
    events, before_finish = [], 0
    for p in probs:
        events += seg.push(p)
    before_finish = len(events)
    events += seg.finish(length)
    return seg.segments, events, before_finish


# --------------------------------------------------------------------------- hand-computed
def test_one_segment_by_hand():
    # chunks 2..11 speech (10 x 512 samples), then silence: raw [1024, 6144], padded by 480
    probs = [0.0, 0.0] + [0.9] * 10 + [0.0] * 10
    assert vs.speech_segments(probs) == [(544, 6624)]
    assert vs.segments_json([(544, 6624)]) == [{"start_ms": 34.0, "end_ms": 414.0}]


def test_short_speech_is_dropped_and_hysteresis_holds():
    # 7 chunks = 3584 samples <= 4000 (250 ms): dropped
    assert vs.speech_segments([0.0] + [0.9] * 7 + [0.0] * 10) == []
    # 0.4 is above neg_threshold 0.35: still speech, so one segment of 1..20
    probs = [0.0] + [0.9] * 5 + [0.4] * 10 + [0.9] * 5 + [0.0] * 10
    assert vs.speech_segments(probs) == [(512 - 480, 21 * 512 + 480)]


def test_close_segments_share_the_gap_and_the_end_is_capped_by_the_length():
    opts = vs.SegmentOptions(min_silence_duration_ms=0, speech_pad_ms=100)  # pad 1600
    probs = [0.9] * 10 + [0.0] * 2 + [0.9] * 10
    # raw [0, 5120] and [6144, 11264 -> length 11000]; gap 1024 < 3200: split at the middle
    assert vs.speech_segments(probs, 11000, opts) == [(0, 5632), (5632, 11000)]


def test_speech_at_the_end_runs_to_the_length():
    assert vs.speech_segments([0.0] * 3 + [0.9] * 20, 23 * 512 - 100) == [(1056, 23 * 512 - 100)]


def test_max_speech_duration_cuts():
    opts = vs.SegmentOptions(max_speech_duration_s=1.0)
    segs = vs.speech_segments([0.9] * 100, options=opts)
    assert len(segs) > 1
    assert all(e - s <= 16000 for s, e in segs)


# --------------------------------------------------------------------------- the reference
def test_equals_silero_on_random_probabilities():
    ref = reference_function()
    rng = np.random.default_rng(7)
    for _ in range(600):
        n = int(rng.integers(1, 250))
        blocks = np.repeat(rng.random(n // 4 + 1), int(rng.integers(1, 12)))[:n]
        probs = np.clip(blocks + rng.normal(0, 0.1, len(blocks)), 0, 1).astype(np.float32)
        length = len(probs) * 512 - int(rng.integers(0, 512))
        opts = vs.SegmentOptions(
            threshold=float(rng.choice([0.3, 0.5, 0.7])),
            min_speech_duration_ms=int(rng.choice([0, 100, 250])),
            min_silence_duration_ms=int(rng.choice([0, 20, 100, 300])),
            speech_pad_ms=int(rng.choice([0, 7, 30, 100])),
            max_speech_duration_s=[None, 0.2, 1.0, 2.5][int(rng.integers(0, 4))])
        want = ref_segments(ref, probs, length, opts)
        got, events, _ = streamed(probs, length, opts)
        assert got == want, opts
        # events: start/end alternate, in time order, and pair up into the segments
        assert [k for k, _ in events] == ["start", "end"] * len(want)
        assert list(zip([s for k, s in events if k == "start"],
                        [s for k, s in events if k == "end"], strict=True)) == want


def test_equals_silero_on_the_fixture_probabilities(fixtures_dir):
    ref = reference_function()
    data = np.load(fixtures_dir / "silero_vad_reference.npz")
    for probs, audio in zip(data["probs"], data["audio"], strict=True):
        for opts in (vs.DEFAULTS, vs.SegmentOptions(threshold=0.3, min_speech_duration_ms=0)):
            want = ref_segments(ref, probs, len(audio), opts)
            assert vs.speech_segments(probs, len(audio), opts) == want


def test_live_events_are_not_held_back_to_the_end():
    # long speech / silence alternation: every segment but the last is settled while streaming
    probs = ([0.0] * 20 + [0.9] * 30) * 5 + [0.0] * 20
    segs, events, before = streamed(probs, None, vs.DEFAULTS)
    assert len(segs) == 5 and before == len(events)


# --------------------------------------------------------------------------- options
def test_request_options_override_and_are_checked():
    o = vs.segment_options({"lumen.vad.threshold": "0.6", "lumen.vad.speech_pad_ms": "0",
                            "lumen.vad.max_speech_duration_s": "2.5"})
    assert (o.threshold, o.speech_pad_ms, o.max_speech_duration_s) == (0.6, 0, 2.5)
    assert o.neg_threshold == pytest.approx(0.45)
    assert vs.segment_options({"lumen.vad.max_speech_duration_s": "inf"},
                              o).max_speech_duration_s is None
    assert vs.segment_options({}, o) is o
    for key, value in (("lumen.vad.threshold", "1.5"), ("lumen.vad.threshold", "nan"),
                       ("lumen.vad.threshold", "x"), ("lumen.vad.speech_pad_ms", "-1"),
                       ("lumen.vad.min_speech_duration_ms", "1.5"),
                       ("lumen.vad.min_silence_duration_ms", "9" * 40),
                       ("lumen.vad.max_speech_duration_s", "0")):
        with pytest.raises(lc.InvalidArgument) as ei:
            vs.segment_options({key: value})
        assert ei.value.field == key


def test_the_keys_are_reserved_and_pass_the_parser(descriptor):
    meta = {"lumen.vad.threshold": "0.6", "lumen.sequence.id": "s"}
    assert descriptor.parse_meta(meta, 1024).kind == "raw"
    with pytest.raises(lc.InvalidArgument):
        descriptor.parse_meta({"lumen.vad.thresold": "0.6"}, 1024)


def task(options: dict) -> C.TaskConfig:
    return C.TaskConfig(name="vad", backend="vad", options=options)


def test_task_options_schema_and_float_kind():
    got = C.read_options(task({"threshold": 0.6, "speech_pad_ms": 10}), vs.OPTION_SCHEMA)
    assert got["threshold"] == 0.6 and got["speech_pad_ms"] == 10
    assert C.read_options(task({"threshold": 1}), vs.OPTION_SCHEMA)["threshold"] == 1.0
    for bad in ({"threshold": 1.5}, {"threshold": True}, {"threshold": "0.5"},
                {"speech_pad_ms": -1}, {"max_speech_duration_s": -1.0}):
        with pytest.raises(lc.ConfigError):
            C.read_options(task(bad), vs.OPTION_SCHEMA)
    opts = vs.options_from_config(C.read_options(task({"threshold": 0.4}), vs.OPTION_SCHEMA))
    assert opts == vs.SegmentOptions(threshold=0.4)

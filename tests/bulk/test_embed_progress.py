"""The progress line (a bar redrawn in place on a terminal, plain lines elsewhere), the summary,
and ``Runtime.prepare`` (a request prepared as ``infer`` would, not queued)."""
from __future__ import annotations

import io

import pytest
from embed_support import home_fixture  # noqa: F401 - the fixtures (home, tiny)

import lumen_core as lc
from lumen_core.bulk.progress import Progress, Summary, clock


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_bar_redrawn_and_notes_above_it():
    out = Tty()
    p = Progress(out, interval_s=0)
    assert p.mode == "bar"
    p.start(0)
    p.update(50, 200, False)
    p.say("in.jsonl:3: skipped: empty text")
    p.update(200, 200, True)
    p.finish()
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 3  # two draws, one clear before the note
    assert "[######" in text and "50/~200 rows" in text and "200/200 rows" in text
    assert "in.jsonl:3: skipped: empty text\n" in text and text.endswith("\n")


def test_a_pipe_gets_plain_lines_at_the_interval():
    out = io.StringIO()
    p = Progress(out, interval_s=3600)
    assert p.mode == "lines"
    p.start(100)
    p.update(150, None, False)  # within the interval: nothing
    p.update(150, None, False, force=True)
    assert out.getvalue().count("\n") == 1 and "embedded 150 rows" in out.getvalue()
    assert "\r" not in out.getvalue()


def test_summary_and_clock():
    s = Summary("o.parquet", rows_in=11, rows_out=10, bad=1, truncated=2, tokens=500,
                seconds=5.0, embedded_now=10)
    a, b = s.lines()
    assert "10 rows -> o.parquet (11 read, 1 bad row skipped, 2 texts truncated)" in a
    assert "2.0 rows/s, 100 tokens/s" in b
    assert clock(3725) == "1:02:05" and clock(65) == "1:05"


def test_runtime_prepare_validates_like_infer_and_queues_nothing(home):
    rt = lc.Runtime.default(only="text_embed")
    with rt:
        item = rt.prepare(rt.text_request("text_embed", "hello world"))
        assert item.length == 4  # [CLS] hello world [SEP]
        assert rt.load()["text_embed"]["pending"] == 0
        with pytest.raises(lc.InvalidArgument):
            rt.prepare(rt.text_request("text_embed", ""))
        with pytest.raises(lc.TaskNotFound):
            rt.prepare(rt.text_request("nope", "a"))

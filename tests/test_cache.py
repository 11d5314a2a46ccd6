"""ResponseCache (lumen_core/cache.py) on its own: keys, LRU by bytes, TTL on an injected clock,
coalescing of identical concurrent misses (many callers), errors never cached, cancellation."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lumen_core.cache import COALESCED, ENTRY_OVERHEAD_BYTES, HIT, MISS, ResponseCache
from lumen_core.contract import (
    KEY_EMBEDDING_DIMENSIONS,
    KEY_EMBEDDING_TYPE,
    KEY_PRIORITY,
    KEY_TIMEOUT_MS,
    RESP_CACHE,
)
from lumen_core.errors import DeadlineExceeded, InvalidArgument
from lumen_core.request import InferRequest, InferResponse, ResponseStats

MIME = "text/plain"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def req(text: str = "hello", meta: dict | None = None) -> InferRequest:
    return InferRequest("t", text, MIME, dict(meta or {}), "cid")


class Computer:
    """A compute function that counts its calls; ``gate`` holds every call until set."""

    def __init__(self, value: float = 1.0, error: Exception | None = None, gate: bool = False):
        self.calls = 0
        self.value = value
        self.error = error
        self.gate = asyncio.Event() if gate else None

    def __call__(self, r: InferRequest):
        async def run() -> InferResponse:
            self.calls += 1
            if self.gate is not None:
                await self.gate.wait()
            if self.error is not None:
                raise self.error
            out = {"y": np.full(4, self.value + self.calls, np.float32)}
            return InferResponse(r.correlation_id, r.task, out, None, ResponseStats(3, 5, 7, 11))
        return run


def fetch(cache: ResponseCache, r: InferRequest, comp: Computer, version: str = "1", **kw):
    return cache.fetch(cache.key(version, r.payload_mime, r.meta, r.payload), r, comp(r), **kw)


def run(coro):
    return asyncio.run(coro)


def test_key_separates_versions_options_and_payloads_not_scheduling():
    c = ResponseCache("t", 1 << 20)
    k = c.key("1", MIME, {}, "hello")
    assert c.key("1", MIME, {}, "hello") == k
    assert c.key("2", MIME, {}, "hello") != k  # model version
    assert c.key("1", MIME, {}, "hello!") != k  # payload
    assert c.key("1", MIME, {}, b"hello") != k  # str vs bytes
    assert c.key("1", MIME + "; charset=latin-1", {}, "hello") != k  # mime
    for opt in ({KEY_EMBEDDING_DIMENSIONS: "8"}, {KEY_EMBEDDING_TYPE: "int8"},
                {"truncate": "false"}, {"normalize": "true"}):
        assert c.key("1", MIME, opt, "hello") != k, opt
    assert c.key("1", MIME, {KEY_EMBEDDING_DIMENSIONS: "8"}, "x") != \
        c.key("1", MIME, {KEY_EMBEDDING_DIMENSIONS: "16"}, "x")
    # an in-process caller's values keep their type: False == 0 in Python, but {"normalize": 0}
    # is refused (400) where {"normalize": False} is served, so one must never hit the other
    assert c.key("1", MIME, {"normalize": 0}, "x") != c.key("1", MIME, {"normalize": False}, "x")
    assert c.key("1", MIME, {"truncate": 1}, "x") != c.key("1", MIME, {"truncate": True}, "x")
    assert c.key("1", MIME, {"normalize": False}, "x") == c.key("1", MIME, {"normalize": False}, "x")
    # meta order does not matter; priority and deadline change no response
    assert c.key("1", MIME, {"a": "1", "b": "2"}, "x") == c.key("1", MIME, {"b": "2", "a": "1"}, "x")
    assert c.key("1", MIME, {KEY_PRIORITY: "1", KEY_TIMEOUT_MS: "50"}, "hello") == k


def test_hit_after_miss_and_meta():
    async def main():
        c = ResponseCache("t", 1 << 20)
        comp = Computer()
        first = await fetch(c, req(), comp)
        second = await fetch(c, req(), comp)
        assert comp.calls == 1
        assert first.meta[RESP_CACHE] == MISS and second.meta[RESP_CACHE] == HIT
        assert first.stats.batch_size == 3  # the computation's own figures
        assert second.stats.batch_size == 0 and second.stats.tokens == 11
        np.testing.assert_array_equal(first.outputs["y"], second.outputs["y"])
        assert not second.outputs["y"].flags.writeable  # nobody can change a stored entry
        assert c.stats()["hits"] == 1 and c.stats()["misses"] == 1
        assert second.correlation_id == "cid"
    run(main())


def test_many_concurrent_identical_misses_coalesce():
    async def main():
        c = ResponseCache("t", 1 << 20)
        comps = {t: Computer(gate=True) for t in ("a", "b")}
        calls = [fetch(c, req(t), comps[t]) for _ in range(50) for t in ("a", "b")]
        tasks = [asyncio.ensure_future(x) for x in calls]
        await asyncio.sleep(0)
        for comp in comps.values():
            comp.gate.set()
        res = await asyncio.gather(*tasks)
        assert comps["a"].calls == 1 and comps["b"].calls == 1
        states = [r.meta[RESP_CACHE] for r in res]
        assert states.count(MISS) == 2 and states.count(COALESCED) == 98
        for r in res[::2]:
            np.testing.assert_array_equal(r.outputs["y"], res[0].outputs["y"])
        st = c.stats()
        assert (st["misses"], st["coalesced"], st["entries"]) == (2, 98, 2)
        after = await fetch(c, req("a"), comps["a"])
        assert after.meta[RESP_CACHE] == HIT and comps["a"].calls == 1
    run(main())


def test_failed_computation_fails_every_waiter_and_is_not_cached():
    async def main():
        c = ResponseCache("t", 1 << 20)
        boom = InvalidArgument("bad input", "payload")
        comp = Computer(error=boom, gate=True)
        tasks = [asyncio.ensure_future(fetch(c, req(), comp)) for _ in range(20)]
        await asyncio.sleep(0)
        comp.gate.set()
        res = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is boom for r in res)  # the same error, once computed
        assert comp.calls == 1 and len(c) == 0
        comp.error = None
        ok = await fetch(c, req(), comp)
        assert ok.meta[RESP_CACHE] == MISS and comp.calls == 2  # computed again
    run(main())


def test_ttl_expiry_on_injected_clock():
    async def main():
        clock = Clock()
        c = ResponseCache("t", 1 << 20, ttl_s=10.0, clock=clock)
        comp = Computer()
        await fetch(c, req(), comp)
        clock.t += 9.999
        assert (await fetch(c, req(), comp)).meta[RESP_CACHE] == HIT
        clock.t += 0.001  # exactly ttl_s old: never served
        again = await fetch(c, req(), comp)
        assert again.meta[RESP_CACHE] == MISS and comp.calls == 2
        assert c.stats()["expired"] == 1
        clock.t += 1e6
        never = ResponseCache("t", 1 << 20, ttl_s=0.0, clock=clock)  # 0: no expiry
        await fetch(never, req(), comp)
        clock.t += 1e9
        assert (await fetch(never, req(), comp)).meta[RESP_CACHE] == HIT
    run(main())


def test_versions_never_share_entries():
    async def main():
        c = ResponseCache("t", 1 << 20)
        v1, v2 = Computer(value=10.0), Computer(value=20.0)
        a = await fetch(c, req(), v1, version="1")
        b = await fetch(c, req(), v2, version="2")
        assert b.meta[RESP_CACHE] == MISS and v2.calls == 1
        assert not np.array_equal(a.outputs["y"], b.outputs["y"])
        again = await fetch(c, req(), v1, version="1")
        np.testing.assert_array_equal(again.outputs["y"], a.outputs["y"])
        assert again.meta[RESP_CACHE] == HIT
    run(main())


def test_eviction_by_bytes_is_lru():
    async def main():
        probe = ResponseCache("t", 1 << 20)
        await fetch(probe, req("a"), Computer())
        one = probe.bytes  # bytes of one entry (same size for every text here)
        assert one >= 16 + ENTRY_OVERHEAD_BYTES
        c = ResponseCache("t", 2 * one + one // 2)  # room for two
        comp = Computer()
        await fetch(c, req("a"), comp)
        await fetch(c, req("b"), comp)
        await fetch(c, req("a"), comp)  # a is now the most recently used
        await fetch(c, req("c"), comp)  # evicts b
        assert c.stats()["evictions"] == 1 and c.bytes <= c.max_bytes and len(c) == 2
        calls = comp.calls
        assert (await fetch(c, req("a"), comp)).meta[RESP_CACHE] == HIT
        assert (await fetch(c, req("b"), comp)).meta[RESP_CACHE] == MISS
        assert comp.calls == calls + 1
        tiny = ResponseCache("t", one - 1)  # an entry bigger than the cache is never stored
        r = await fetch(tiny, req("a"), comp)
        assert r.meta[RESP_CACHE] == MISS and len(tiny) == 0 and tiny.bytes == 0
        assert tiny.stats()["evictions"] == 0
    run(main())


def test_stored_arrays_are_private_copies():
    async def main():
        c = ResponseCache("t", 1 << 20)
        batch = np.arange(32 * 4, dtype=np.float32).reshape(32, 4)

        async def compute():
            return InferResponse("", "t", {"y": batch[3]}, None, ResponseStats(32, 0, 0, 0))
        r = req()
        await c.fetch(c.key("1", MIME, {}, "hello"), r, compute)
        batch[3] = -1  # the batch buffer is reused: the cache must not see it
        hit = await c.fetch(c.key("1", MIME, {}, "hello"), r, compute)
        np.testing.assert_array_equal(hit.outputs["y"], np.arange(12, 16, dtype=np.float32))
        assert c.bytes < batch.nbytes + ENTRY_OVERHEAD_BYTES  # one row counted, not the batch
    run(main())


def test_a_waiter_leaving_does_not_cancel_the_shared_computation():
    async def main():
        c = ResponseCache("t", 1 << 20)
        comp = Computer(gate=True)
        leader = asyncio.ensure_future(fetch(c, req(), comp))
        follower = asyncio.ensure_future(fetch(c, req(), comp))
        await asyncio.sleep(0)
        leader.cancel()
        await asyncio.sleep(0)
        comp.gate.set()
        res = await follower
        assert res.meta[RESP_CACHE] == COALESCED and comp.calls == 1 and len(c) == 1
        with pytest.raises(asyncio.CancelledError):
            await leader

        # every waiter gone: the computation is cancelled and nothing is stored
        comp2 = Computer(gate=True)
        t = [asyncio.ensure_future(fetch(c, req("other"), comp2)) for _ in range(3)]
        await asyncio.sleep(0)
        for x in t:
            x.cancel()
        await asyncio.gather(*t, return_exceptions=True)
        await asyncio.sleep(0)
        assert len(c) == 1 and not c._flights
        comp2.gate.set()
        r = await fetch(c, req("other"), comp2)
        assert r.meta[RESP_CACHE] == MISS and comp2.calls == 2
    run(main())


def test_a_coalesced_waiter_keeps_its_own_deadline():
    async def main():
        c = ResponseCache("t", 1 << 20)
        comp = Computer(gate=True)
        leader = asyncio.ensure_future(fetch(c, req(), comp))
        await asyncio.sleep(0)
        with pytest.raises(DeadlineExceeded):
            await fetch(c, req(), comp, timeout_ms=1)
        comp.gate.set()
        assert (await leader).meta[RESP_CACHE] == MISS
    run(main())

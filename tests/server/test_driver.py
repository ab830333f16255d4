"""EngineDriver with a stand-in engine (no device): commands are applied between steps, the
thread sleeps when idle, the queue bound answers at once, refusals and engine failures reach
the request's queue, stop cancels what is left."""

import asyncio
import collections
import re
import threading
import time

import numpy as np
import pytest
from prometheus_client import generate_latest

from fo_jax.engine.engine import RequestOutput
from fo_jax.server.app import ServerMetrics
from fo_jax.server.driver import (
    Accepted,
    EngineDriver,
    Failed,
    NotAccepting,
    QueueFull,
    Refused,
    offload_totals,
)


class FakeEngine:
    """One token per step per running request (a step takes `step_s`); `seats` seats;
    `fail_at` raises in step(); `gate` holds the first add_request until set."""

    def __init__(self, seats=1, fail_at=None, gate=None, step_s=0.0):
        self.seats, self.fail_at, self.gate, self.step_s = seats, fail_at, gate, step_s
        self.requests, self.waiting, self.running = {}, [], []
        self.steps, self.counters, self.stats = 0, {"steps": 0}, None
        self.added = []  # (request_id, seed, steps run before it was added)

    def add_request(self, prompt, *, request_id, max_tokens, seed=0, **_):
        if self.gate is not None:  # hold the engine thread in its first add
            assert self.gate.wait(5)
        if not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        if prompt[0] == 2**63:  # an error add_request did not foresee
            raise OverflowError("Python int too large to convert to C long")
        self.added.append((request_id, seed, self.steps))
        self.requests[request_id] = dict(max=max_tokens, tokens=[], reason=None, n=len(prompt))
        self.waiting.append(request_id)

    def _out(self, rid, new):
        r = self.requests[rid]
        return RequestOutput(rid, new, list(r["tokens"]), None, r["reason"] is not None,
                             r["reason"], r["n"], None)

    def step(self):
        time.sleep(self.step_s)
        self.steps += 1
        self.counters["steps"] += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("device lost")
        while self.waiting and len(self.running) < self.seats:
            self.running.append(self.waiting.pop(0))
        outs = []
        for rid in list(self.running):
            r = self.requests[rid]
            r["tokens"].append(7)
            if len(r["tokens"]) >= r["max"]:
                r["reason"] = "length"
                self.running.remove(rid)
            outs.append(self._out(rid, [7]))
        return outs

    def cancel(self, rid):
        r = self.requests[rid]
        if r["reason"] is not None:
            return False
        r["reason"] = "cancelled"
        for lst in (self.waiting, self.running):
            if rid in lst:
                lst.remove(rid)
        return True

    def release(self, rid):
        out = self._out(rid, [])
        del self.requests[rid]
        return out

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def num_waiting(self):
        return len(self.waiting)

    def num_running(self):
        return len(self.running)


async def _drain(handle, timeout=5.0):
    items = []
    while True:
        item = await asyncio.wait_for(handle.queue.get(), timeout)
        items.append(item)
        if isinstance(item, (Refused, Failed)) or getattr(item, "finished", False):
            return items


def test_requests_run_and_the_idle_thread_sleeps():
    engine = FakeEngine(seats=1)
    driver = EngineDriver(engine, max_queue=4)
    driver.start()

    async def main():
        loop = asyncio.get_running_loop()
        a = driver.submit([1, 2], loop=loop, max_tokens=3)
        b = driver.submit([1], loop=loop, max_tokens=2)
        bad = driver.submit([], loop=loop, max_tokens=2)
        return await asyncio.gather(_drain(a), _drain(b), _drain(bad))

    a, b, bad = asyncio.run(main())
    assert isinstance(a[0], Accepted) and [o.token_ids for o in a[1:]][-1] == [7, 7, 7]
    assert a[-1].finish_reason == "length" and b[-1].token_ids == [7, 7]
    assert bad == [Refused("prompt must be a non-empty list of token ids")]
    steps = engine.steps
    time.sleep(0.2)
    assert engine.steps == steps  # idle: no stepping
    assert engine.requests == {}  # finished requests were released
    assert driver.stop(timeout=5) and not driver.alive
    with pytest.raises(NotAccepting):
        asyncio.run(_submit(driver))


async def _submit(driver, **kwargs):
    return driver.submit([1], loop=asyncio.get_running_loop(), max_tokens=50, **kwargs)


def test_queue_bound_counts_free_seats():
    """Requests that a free seat will take do not wait: with 2 free seats and max_queue=1 a
    burst of 3 is accepted and the 4th refused at once, in the caller (the engine thread is
    held in its first add, so all four are still pending); max_queue=0 still serves."""
    gate = threading.Event()
    driver = EngineDriver(FakeEngine(seats=2, gate=gate), max_queue=1)
    driver.start()

    async def burst():
        loop = asyncio.get_running_loop()
        handles = [driver.submit([1], loop=loop, max_tokens=2) for _ in range(3)]
        with pytest.raises(QueueFull, match=r"^1 requests already wait for a seat "
                                            r"\(--max-queue 1\): retry later$"):
            driver.submit([1], loop=loop, max_tokens=2)
        gate.set()
        return await asyncio.gather(*(_drain(h) for h in handles))

    try:
        assert [items[-1].finish_reason for items in asyncio.run(burst())] == ["length"] * 3
    finally:
        gate.set()
        assert driver.stop(timeout=5)
    driver = EngineDriver(FakeEngine(seats=1), max_queue=0)  # nothing waits: one seat serves

    async def alone():
        return await _drain(await _submit(driver))

    driver.start()
    try:
        assert asyncio.run(alone())[-1].finish_reason == "length"
    finally:
        assert driver.stop(timeout=5)


def test_queue_bound_cancel_and_stop():
    engine = FakeEngine(seats=1)
    driver = EngineDriver(engine, max_queue=1)
    driver.start()

    async def full():
        loop = asyncio.get_running_loop()
        h = driver.submit([1], loop=loop, max_tokens=10**6)
        assert isinstance(await h.queue.get(), Accepted)
        await h.queue.get()  # it runs: the seat is taken
        driver.submit([1], loop=loop, max_tokens=1)  # it waits
        with pytest.raises(QueueFull, match="--max-queue 1"):
            driver.submit([1], loop=loop, max_tokens=1)
        driver.cancel(h.request_id)

    asyncio.run(full())
    assert driver.stop(timeout=5)
    engine = FakeEngine(seats=1)
    driver = EngineDriver(engine, max_queue=2)
    driver.start()

    async def main():
        loop = asyncio.get_running_loop()
        h = driver.submit([1], loop=loop, max_tokens=10**6)
        assert isinstance(await h.queue.get(), Accepted)
        await h.queue.get()  # it runs
        driver.cancel(h.request_id)
        driver.cancel("never-known")  # ignored
        while True:
            out = await asyncio.wait_for(h.queue.get(), 5)
            if out.finished:
                return out

    assert asyncio.run(main()).finish_reason == "cancelled"
    assert engine.requests == {}

    async def left_running():
        h = driver.submit([1], loop=asyncio.get_running_loop(), max_tokens=10**6)
        await h.queue.get()
        assert await asyncio.to_thread(driver.stop, 0.1)  # in flight after 0.1 s: cancelled
        return await _drain(h)

    assert asyncio.run(left_running())[-1].finish_reason == "cancelled"


def test_an_error_of_one_request_does_not_end_the_engine_thread():
    """An exception add_request raises for one request (not a ValueError: a refusal) fails
    that request alone; the requests before and after it run."""
    engine = FakeEngine(seats=1)
    driver = EngineDriver(engine, max_queue=4)
    driver.start()

    async def main():
        loop = asyncio.get_running_loop()
        a = driver.submit([1], loop=loop, max_tokens=3)
        bad = driver.submit([2**63], loop=loop, max_tokens=3)
        b = driver.submit([1], loop=loop, max_tokens=2)
        return await asyncio.gather(_drain(a), _drain(bad), _drain(b))

    a, bad, b = asyncio.run(main())
    assert bad == [Failed("request failed: OverflowError: Python int too large to convert to "
                          "C long", engine=False)]
    assert a[-1].finish_reason == b[-1].finish_reason == "length"
    assert driver.alive and driver.accepting and driver.failure is None
    assert driver.stop(timeout=5)


def test_engine_failure_reaches_every_request():
    failed = threading.Event()
    driver = EngineDriver(FakeEngine(seats=1, fail_at=3), max_queue=4, on_failure=failed.set)
    driver.start()

    async def main():
        h = driver.submit([1], loop=asyncio.get_running_loop(), max_tokens=10)
        return await _drain(h)

    items = asyncio.run(main())
    assert items[-1] == Failed("engine failure: RuntimeError: device lost")
    assert failed.wait(5)  # the server shuts down: the process exits non-zero
    driver._thread.join(5)
    assert not driver.alive and not driver.accepting
    with pytest.raises(NotAccepting, match="device lost"):
        asyncio.run(_submit(driver))


def test_offload_statistics_reach_metrics():
    """engine.stats (LoopStats sums) -> the snapshot (every stats_every steps, when idle) ->
    /metrics counters."""
    Stats = collections.namedtuple("Stats", "hits tail_hits misses union h2d_bytes d2h_bytes")
    gbw = np.ones((2, 3, 1), np.int32)
    stats = Stats(gbw * 5, gbw, gbw * 2, np.ones((2, 3), np.int32),
                  np.full((3,), 1024.0, np.float32), np.full((3,), 64.0, np.float32))
    assert offload_totals(None) == {}
    totals = offload_totals(stats)
    assert totals == {"hits": 30.0, "tail_hits": 6.0, "misses": 12.0, "union": 6.0,
                      "h2d_bytes": 3072.0, "d2h_bytes": 192.0}
    engine = FakeEngine(seats=1)
    engine.stats = stats
    engine.pool_occupancy = lambda: {"free": 5, "held": 2, "cached": 1, "total": 8}
    driver = EngineDriver(engine, max_queue=1)
    metrics = ServerMetrics(driver)
    driver.start()
    try:
        deadline = time.monotonic() + 5
        while not driver.snapshot.offload and time.monotonic() < deadline:
            time.sleep(0.01)  # published when the thread goes idle
        text = generate_latest(metrics.registry).decode()
    finally:
        driver.stop(timeout=5)
    assert 'fojax_offload_rows_total{kind="misses"} 12.0' in text
    assert 'fojax_offload_bytes_total{direction="h2d"} 3072.0' in text
    assert 'fojax_engine_events_total{counter="steps"} 0.0' in text
    assert "fojax_requests_running 0.0" in text
    assert 'fojax_pool_pages{state="cached"} 1.0' in text
    assert 'fojax_pool_pages{state="total"} 8.0' in text


def test_a_request_submitted_as_shutdown_begins_is_cancelled_with_the_rest():
    """A submit that passed the accepting check while `begin_shutdown(0)` ran reaches the
    engine before the drain's cancel-all, so it is cancelled with the rest instead of running
    to its end (the patched put lets shutdown begin between the check and the put)."""
    driver = EngineDriver(FakeEngine(seats=1, step_s=0.001), max_queue=4)
    put = driver._commands.put

    def late_put(item, *args, **kwargs):
        if item[0] == "add":
            shutdown = threading.Thread(target=driver.begin_shutdown, args=(0.0,))
            shutdown.start()
            shutdown.join(0.3)  # returns at once unless the submit holds the driver's lock
            time.sleep(0.1)     # the drain timer (0 s) has put its cancel-all by now
        put(item, *args, **kwargs)

    driver._commands.put = late_put
    driver.start()

    async def main():
        h = driver.submit([1], loop=asyncio.get_running_loop(), max_tokens=2000)
        return await asyncio.wait_for(_drain(h), 20)  # "length" after 2000 steps of 1 ms

    try:
        items = asyncio.run(main())
    finally:
        driver.stop(timeout=5)
    assert isinstance(items[0], Accepted) and items[-1].finish_reason == "cancelled"


class FakePrefixEngine(FakeEngine):
    """A FakeEngine with a prefix cache of prefill chunks of 2 tokens (what the driver reads:
    `prefix` set, `chunk`)."""
    prefix = object()
    chunk = 2


def _choices(driver, prompt, n, **kwargs):
    return driver.submit_choices(prompt, loop=asyncio.get_running_loop(),
                                 choices=[dict(kwargs, seed=10 + i) for i in range(n)])


@pytest.mark.parametrize("engine_class, prompt, later", [
    (FakeEngine, [1, 2, 3], False),        # no prefix cache: all at once
    (FakePrefixEngine, [1, 2], False),     # no whole chunk to share (the last token is never)
    (FakePrefixEngine, [1, 2, 3], True),   # the rest wait for the first one's prefill
])
def test_choices_of_one_prompt_share_its_prefill_through_the_prefix_cache(engine_class, prompt,
                                                                           later):
    """submit_choices: n requests of one prompt. With a prefix cache that can share it (a
    whole prefill chunk before its last token), the first is added at once and the others
    once it has sampled its first token (its prompt's chunks are cached by then: they prefill
    the rest only); else all at once. Every choice hears Accepted at once and runs to its
    end."""
    engine = engine_class(seats=3)
    driver = EngineDriver(engine, max_queue=4)
    driver.start()

    async def main():
        handles = _choices(driver, prompt, 3, max_tokens=2)
        return handles, await asyncio.gather(*(_drain(h) for h in handles))

    try:
        handles, items = asyncio.run(main())
    finally:
        assert driver.stop(timeout=5)
    assert all(isinstance(i[0], Accepted) and i[-1].finish_reason == "length" for i in items)
    assert [(rid, seed) for rid, seed, _ in engine.added] == \
        [(h.request_id, 10 + i) for i, h in enumerate(handles)]
    assert [steps for *_, steps in engine.added] == ([0, 1, 1] if later else [0, 0, 0])
    assert driver.in_flight() == 0


def test_choices_are_bounded_as_one_and_a_waiting_choice_can_be_cancelled():
    gate = threading.Event()
    engine = FakePrefixEngine(seats=1, gate=gate)
    driver = EngineDriver(engine, max_queue=2)
    driver.start()

    async def main():
        with pytest.raises(ValueError, match=re.escape(
                "n=4 choices can never be queued at once: this server has 1 seats and "
                "--max-queue 2 (at most 3 choices per request)")):
            _choices(driver, [1, 2, 3], 4, max_tokens=1)
        handles = _choices(driver, [1, 2, 3], 3, max_tokens=50)  # the first add is held
        with pytest.raises(QueueFull, match=r"--max-queue 2"):  # all or none
            _choices(driver, [1, 2, 3], 1, max_tokens=1)
        driver.cancel(handles[2].request_id)  # applied before the first has a token
        gate.set()
        return handles, await asyncio.gather(*(_drain(h) for h in handles))

    try:
        handles, items = asyncio.run(main())
    finally:
        gate.set()
        assert driver.stop(timeout=5)
    assert [i[-1].finish_reason for i in items] == ["length", "length", "cancelled"]
    assert isinstance(items[2][0], Accepted) and items[2][-1].token_ids == []
    assert [rid for rid, *_ in engine.added] == [h.request_id for h in handles[:2]]
    assert driver.in_flight() == 0

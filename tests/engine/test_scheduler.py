"""The scheduler alone (fo_jax.engine.scheduler), without a model: the queue order, the pages
a request needs, what can never fit (messages pinned), reservation by pages and device bytes,
and what `make_room` drops or preempts when a decoding request's pages run short. The engine
runs these same decisions (tests/engine/test_engine.py checks them end to end, bit for bit)."""

import re
import types

import numpy as np
import pytest

from fo_jax.engine.admission import MemoryCosts, RequestRefused
from fo_jax.engine.pages import PagePool, RequestPages
from fo_jax.engine.requests import RequestState
from fo_jax.engine.scheduler import Room, Scheduler
from fo_jax.engine.settings import (CacheSettings, EngineSettings, SchedulerSettings,
                                    SpeculativeSettings)
from fo_jax.offload.config import OffloadConfig

# Round figures: a seat costs 100 device bytes, a page 10, a prompt page 5 while prefilling.
COSTS = MemoryCosts(page_size=4, hot_slots=8, num_buffers=2, max_context=64,
                    seat_device_bytes=100, page_device_bytes=10, page_host_bytes=1000,
                    page_prefill_bytes=5)
CAPACITY = 32


def _scheduler(*, seats=2, pages=8, costs=COSTS, **scheduler):
    """A Scheduler over a stand-in paged KV store: a real page pool and costs, no arrays."""
    offload = OffloadConfig(hot_slots=64, page_size=4, capacity=CAPACITY)
    settings = EngineSettings(cache=CacheSettings(seats=seats, offload=offload),
                              scheduler=SchedulerSettings(**scheduler),
                              speculative=SpeculativeSettings())
    kv = types.SimpleNamespace(seats=seats, capacity=CAPACITY, pool=PagePool(pages, 4),
                               costs=costs, max_pages=CAPACITY // 4)
    return Scheduler(settings, kv)


def _request(sched, name, prompt_len, max_tokens=8, **fields):
    req = RequestState(name, np.arange(prompt_len, dtype=np.int32), max_tokens, 0.0, 1.0, 0,
                       (), (), 0.0, order=next(sched.arrivals), **fields)
    sched.waiting.append(req)
    return req


def _seat(sched, req, b, *, decoding=True):
    """Seat `req` in seat b, as the engine's admission does."""
    sched.waiting.remove(req)
    req.seat, req.admitted = b, next(sched.admissions)
    req.prefilled = len(req.prompt) if decoding else 0
    sched.occupants[b] = req


def test_the_queue_order():
    sched = _scheduler(order="shortest", max_wait_steps=3)
    long, short, preempted = (_request(sched, "long", 20), _request(sched, "short", 4),
                              _request(sched, "preempted", 30, preempted=True))
    assert [r.request_id for r in sched.queue(0)] == ["preempted", "short", "long"]
    # "long" has waited 3 steps: it goes ahead of every request that has not.
    late = _request(sched, "late", 2, queued_at=2)
    assert [r.request_id for r in sched.queue(3)] == ["preempted", "long", "short", "late"]
    fifo = _scheduler()
    for name, n in (("a", 20), ("b", 4), ("c", 8)):
        _request(fifo, name, n)
    assert [r.request_id for r in fifo.queue(0)] == ["a", "b", "c"]
    del long, short, preempted, late


def test_tokens_needed_by_reservation():
    full, prompt = _scheduler(), _scheduler(reserve="prompt", decode_steps_per_call=4)
    req = _request(full, "r", 10, max_tokens=30)
    assert full.tokens_needed(req) == CAPACITY  # prompt + max_tokens, at most a seat
    assert prompt.tokens_needed(req) == 10 + 4  # the prompt and one call
    req.tokens = [1, 2, 3]  # two of them stored (the last is not fed yet)
    assert prompt.tokens_needed(req) == 10 + 2 + 4
    drafts = _scheduler(reserve="prompt", decode_steps_per_call=4)
    drafts.call_tokens = 4 * (2 + 1)  # D = 2 drafts: a call stores up to N (D + 1) tokens
    assert drafts.tokens_needed(req) == 10 + 2 + 12


def test_what_can_never_fit_is_refused_with_the_figures():
    sched = _scheduler(pages=4, device_bytes=150)
    with pytest.raises(ValueError, match=re.escape(
            "prompt of 10 tokens + max_tokens=8 needs 5 pages of 4 tokens, but the pool holds "
            "4: lower max_tokens or raise num_pages")):
        sched.check_fits_alone(10, 8)
    # 2 pages: seat 100 + prefill buffers 5 (one prompt page) + 2 x 10 = 125 <= 150.
    sched.check_fits_alone(3, 5)
    # 4 pages: 100 + 2 x 5 + 4 x 10 = 150: fits exactly; one byte less does not.
    sched.check_fits_alone(8, 8)
    sched.device_bytes = 149
    with pytest.raises(RequestRefused, match=re.escape(
            "prompt of 8 tokens + max_tokens=8 can never fit device_bytes=149: alone it needs "
            "150 bytes of device memory (seat hot cache 100 + prefill buffers 10 + indexer-key "
            "pages 40 for 4 pages of 4 tokens); shorten the prompt or max_tokens, or raise "
            "device_bytes")):
        sched.check_fits_alone(8, 8)


def test_reservation_by_pages_and_device_bytes():
    sched = _scheduler(pages=6, device_bytes=300)
    first = _request(sched, "first", 8, max_tokens=8)  # 4 pages
    pages = sched.reserve_pages(first)
    assert pages is not None and sched.kv.pool.num_held == 4
    first.pages = pages
    _seat(sched, first, 0, decoding=False)
    second = _request(sched, "second", 8, max_tokens=8)
    assert sched.reserve_pages(second) is None  # 4 more pages: the pool has 2
    assert sched.kv.pool.num_held == 4  # nothing held for it
    small = _request(sched, "small", 4, max_tokens=4)  # 2 pages
    # Device bytes: 100 + 10 + 4 x 10 (first, prefilling) + 2 x 10 (its pages, held) + its
    # seat 100 + prefill 5 = 275 <= 300.
    assert sched.device_bytes_used() == 100 + 10 + 40
    assert sched.reserve_pages(small) is not None
    assert sched.device_bytes_used() == 100 + 10 + 60
    sched.device_bytes = 274
    assert sched.reserve_pages(_request(sched, "again", 1, max_tokens=1)) is None


def test_kept_pages_are_dropped_only_when_no_seat_is_occupied():
    sched = _scheduler()
    head = _request(sched, "head", 8)
    old, young = _request(sched, "old", 4, admitted=1), _request(sched, "young", 4, admitted=5)
    for req in (old, young):
        req.pages = RequestPages(sched.kv.pool, sched.kv.max_pages)
    assert sched.kept_to_drop(head) is young  # the youngest first
    running = _request(sched, "running", 4)
    _seat(sched, running, 0)
    assert sched.kept_to_drop(head) is None  # a running request will free its pages


def _decoding(sched, name, b, *, prompt_len=4, pages=None):
    req = _request(sched, name, prompt_len, max_tokens=20)
    req.pages = RequestPages(sched.kv.pool, sched.kv.max_pages)
    req.pages.grow(prompt_len + 1 if pages is None else pages * 4)
    _seat(sched, req, b)
    req.tokens = [7]
    return req


def test_make_room_grows_drops_kept_pages_then_preempts_the_youngest():
    sched = _scheduler(pages=4, reserve="prompt")
    old = _decoding(sched, "old", 0)  # 2 pages: prompt 4 + 1 call
    young = _decoding(sched, "young", 1)  # 2 pages
    assert sched.make_room(old) == Room("ready")
    old.tokens = [7, 8, 9, 10]  # 4 + 3 stored + 1: 8 tokens, still 2 pages
    assert sched.make_room(old) == Room("ready")
    old.tokens.append(11)  # 9 tokens: a third page, and the pool has none
    kept = _request(sched, "kept", 4, preempted=True, admitted=9)
    kept.pages = RequestPages(sched.kv.pool, sched.kv.max_pages)
    assert sched.make_room(old) == Room("drop_kept", kept)
    kept.pages = None  # what the engine's drop does
    assert sched.make_room(old) == Room("preempt", young, False)  # pages short: dropped
    young.pages.release()
    sched.occupants[1] = None
    assert sched.make_room(old) == Room("grown") and old.pages.pages_needed(9) == 0
    assert sched.kv.pool.num_held == 3


def test_make_room_keeps_the_victims_pages_when_only_device_bytes_are_short():
    sched = _scheduler(pages=8, reserve="prompt")
    old, young = _decoding(sched, "old", 0), _decoding(sched, "young", 1)
    old.tokens = [7] * 5  # a third page
    # Used: 2 seats (200) + 4 pages (40); the third page makes 250: one byte short.
    sched.device_bytes = 249
    assert sched.make_room(old) == Room("preempt", young, True)
    # Alone in the seats with kept pages waiting: those go first.
    sched.occupants[1], young.pages = None, young.pages
    young.preempted = True
    sched.waiting.append(young)
    sched.device_bytes = 100 + 10 * 4 + 9  # old's seat + 2 + 2 pages held, + 9: short
    assert sched.make_room(old) == Room("drop_kept", young)
    # The pool on the device: bytes short are pages short, kept pages dropped first too.
    device = _scheduler(pages=8, reserve="prompt", costs=MemoryCosts(
        **{**COSTS.__dict__, "pool_memory": "device"}))
    a, b = _decoding(device, "a", 0), _decoding(device, "b", 1)
    a.tokens = [7] * 5
    device.device_bytes = device.device_bytes_used() + 1009  # the new page's 1010 short by 1
    assert device.make_room(a) == Room("preempt", b, True)  # b's seat (100) covers 1 byte
    device.device_bytes = device.device_bytes_used() + 1010 - 101  # 101 short: b's 100 do not
    assert device.make_room(a) == Room("preempt", b, False)

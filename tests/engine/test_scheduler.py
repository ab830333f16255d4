"""The scheduler alone (fo_jax.engine.scheduler), without a model: the queue order, the pages
a request needs, what can never fit (messages pinned), admission by seats, pages and device
bytes (admit, wait, refuse; no overtaking, shortest first), reservation, preempted requests
keeping their pages and resuming first, what `make_room` drops or preempts when a decoding
request's pages run short, and a random schedule with the prefix cache that never finds the
pool short. The engine runs these same decisions (tests/engine/test_engine.py checks them end
to end, bit for bit)."""

import dataclasses
import re
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fo_jax.engine.costs import MemoryCosts
from fo_jax.engine.pages import PagePool, PrefixCache, RequestPages
from fo_jax.engine.prefix import PagedPrefix
from fo_jax.engine.requests import RequestState
from fo_jax.engine.scheduler import RequestRefused, Room, Scheduler, pack_sizes
from fo_jax.engine.settings import (CacheSettings, EngineSettings, SchedulerSettings,
                                    SpeculativeSettings)
from fo_jax.offload.config import OffloadConfig

# Round figures: a seat costs 100 device bytes, a page 10, a prompt page 5 while prefilling.
COSTS = MemoryCosts(page_size=4, hot_slots=8, num_buffers=2, max_context=64,
                    seat_device_bytes=100, page_device_bytes=10, page_host_bytes=1000,
                    page_prefill_bytes=5)
CAPACITY = 32


def _scheduler(*, seats=2, pages=8, costs=COSTS, prefix=False, **scheduler):
    """A Scheduler over a stand-in paged KV store: a real page pool and costs (and, with
    `prefix`, prefix reuse of whole chunks of 4 tokens), no arrays."""
    offload = OffloadConfig(hot_slots=64, page_size=4, capacity=CAPACITY)
    settings_ = EngineSettings(cache=CacheSettings(seats=seats, offload=offload),
                               scheduler=SchedulerSettings(**scheduler),
                               speculative=SpeculativeSettings())
    pool = PagePool(pages, 4)
    kv = types.SimpleNamespace(seats=seats, capacity=CAPACITY, pool=pool, costs=costs,
                               max_pages=CAPACITY // 4,
                               prefix=PagedPrefix(PrefixCache(pool), chunk=4) if prefix else None)
    return Scheduler(settings_, kv)


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


def _leave(sched, req):
    """What the engine does when a request finishes: its seat freed, its pages released."""
    sched.occupants[req.seat] = None
    req.seat = None
    req.pages.release()
    req.pages = None


def _preempt(sched, req, *, keep_pages):
    """What the engine's preemption does to the host records (`Engine._preempt`)."""
    sched.occupants[req.seat] = None
    req.seat, req.preempted = None, True
    sched.waiting.append(req)
    if not keep_pages:
        sched.drop_kept(req)


def test_admit_wait_and_refuse_by_pages_and_device_bytes():
    """A request is seated when a seat is free and its pages and device bytes fit, waits
    (nothing held) when they do not yet, and is refused with the figures when it never can."""
    sched = _scheduler(seats=3, pages=7, device_bytes=300)
    a = _request(sched, "a", 6, max_tokens=6)  # 12 tokens: 3 pages; prompt: 2 pages
    assert sched.admit(0) == ([a], []) and a.seat == 0
    # device: seat 100 + prefill buffers 2 x 5 + 3 pages x 10 = 140.
    assert sched.device_bytes_used() == 140 and sched.kv.pool.num_held == 3
    b = _request(sched, "b", 12, max_tokens=4)  # 4 pages; prompt 3: 100 + 15 + 40 = 155
    assert sched.admit(0) == ([b], [])  # 295 <= 300; the pool's 7 pages all held
    c = _request(sched, "c", 20, max_tokens=1)  # 6 pages: the pool has none left
    assert sched.admit(0) == ([], []) and sched.waiting == [c]
    assert sched.kv.pool.num_held == 7 and sched.device_bytes_used() == 295
    with pytest.raises(ValueError, match=re.escape(
            "prompt of 20 tokens + max_tokens=12 needs 8 pages of 4 tokens, but the pool "
            "holds 7: lower max_tokens or raise num_pages")):
        sched.check_fits_alone(20, 12)
    sched.device_bytes = 139  # a alone needs 140
    with pytest.raises(RequestRefused, match=re.escape(
            "alone it needs 140 bytes of device memory")):
        sched.check_fits_alone(6, 6)


def test_a_device_pool_charges_kv_pages_to_the_device_budget():
    """With the page pool in device memory a page held costs its indexer keys + its KV rows
    (10 + 1,000 B) of the device budget: a request waits, or is refused, on those bytes."""
    costs = dataclasses.replace(COSTS, pool_memory="device")
    sched = _scheduler(pages=8, device_bytes=3500, costs=costs)
    a = _request(sched, "a", 6, max_tokens=2)  # 2 pages; prompt 2 pages
    assert sched.admit(0) == ([a], [])
    assert sched.device_bytes_used() == 100 + 2 * 5 + 2 * 1010
    a.prefilled = len(a.prompt)  # its prefill buffers go
    assert sched.device_bytes_used() == 100 + 2 * 1010
    big = _request(sched, "big", 8, max_tokens=4)  # 3 pages: 100 + 10 + 3,030 > 1,380 free
    sched.check_fits_alone(8, 4)  # it fits alone: it waits
    assert sched.admit(0) == ([], []) and sched.kv.pool.num_held == 2
    with pytest.raises(RequestRefused, match=re.escape(
            "prompt of 8 tokens + max_tokens=8 can never fit device_bytes=3,500: alone it "
            "needs 4,150 bytes of device memory (seat hot cache 100 + prefill buffers 10 + KV "
            "and indexer-key pages 4,040 for 4 pages of 4 tokens, the pool in device memory)")):
        sched.check_fits_alone(8, 8)
    _leave(sched, a)
    assert sched.device_bytes_used() == 0
    assert sched.admit(0) == ([big], [])


def test_fifo_does_not_overtake_and_shortest_first_does():
    jobs = [("long", 20, 4), ("short", 2, 2), ("mid", 8, 1)]  # 6, 1 and 3 pages
    fifo = _scheduler(seats=3, pages=6)
    reqs = {name: _request(fifo, name, p, max_tokens=m) for name, p, m in jobs}
    assert fifo.admit(0) == ([reqs["long"]], [])  # all 6 pages: short waits behind it
    assert [r.request_id for r in fifo.queue(0)] == ["short", "mid"]
    _leave(fifo, reqs["long"])
    assert fifo.admit(1) == ([reqs["short"], reqs["mid"]], [])

    shortest = _scheduler(seats=3, pages=6, order="shortest")
    reqs = {name: _request(shortest, name, p, max_tokens=m) for name, p, m in jobs}
    assert [r.request_id for r in shortest.queue(0)] == ["short", "mid", "long"]
    assert shortest.admit(0) == ([reqs["short"], reqs["mid"]], [])
    assert shortest.waiting == [reqs["long"]]  # 4 pages held: long waits


def test_admission_maps_the_cached_prefix_in_whole_chunks():
    """With prefix reuse (chunks of one page here) a request maps the longest cached prefix
    of whole chunks of its prompt but the last token (its logits sample the first token), and
    its prefill starts there."""
    sched = _scheduler(seats=3, pages=12, prefix=True)
    a = _request(sched, "a", 10, max_tokens=2)  # tokens 0..9
    assert sched.admit(0) == ([a], []) and a.cached_tokens == 0
    a.prefilled = 10
    sched.kv.prefix.insert(None, [(a, 0)])  # its two full pages, cached
    b = _request(sched, "b", 9, max_tokens=2)  # 0..8: 8 tokens before its last, both pages
    c = _request(sched, "c", 8, max_tokens=2)  # 0..7: 7 tokens before its last, one page
    assert sched.admit(0) == ([b, c], [])
    assert (b.cached_tokens, c.cached_tokens) == (8, 4)
    assert b.pages.pages[:2].tolist() == a.pages.pages[:2].tolist()
    assert c.pages.pages[:1].tolist() == a.pages.pages[:1].tolist()
    assert b.prefix_held == [] and b.mtp_blocks is None  # paged: the pages hold the prefix
    assert sched.kv.pool.refcount(int(a.pages.pages[0])) == 3
    sched.kv.prefix.check()


def test_seats_limit_admission():
    sched = _scheduler(seats=1)
    a, b = _request(sched, "a", 1, max_tokens=1), _request(sched, "b", 1, max_tokens=1)
    assert sched.admit(0) == ([a], [])
    assert sched.free_seats() == [] and sched.admit(0) == ([], [])
    _leave(sched, a)
    assert sched.admit(0) == ([b], [])


def test_preempted_requests_keep_their_pages_and_resume_first():
    """Only device bytes short: the youngest running request is preempted keeping its pages
    (its seat's bytes and prefill buffers freed, its pages still counted) and resumes before
    any new request, its prefill buffers back while it still prefills."""
    sched = _scheduler(seats=2, pages=8, reserve="prompt", decode_steps_per_call=1)
    a, b = _request(sched, "a", 4, max_tokens=8), _request(sched, "b", 4, max_tokens=8)
    assert sched.admit(0) == ([a, b], [])  # the prompt and one call: 2 pages each
    a.prefilled, a.tokens = 4, [7] * 5  # decoding: 4 + 4 stored + 1 call = 9 tokens
    # a: 100 + 2 pages x 10 = 120; b prefilling: 100 + 5 + 20 = 125; a's third page: 10.
    assert sched.device_bytes_used() == 120 + 125
    sched.device_bytes = 120 + 125 + 10 - 1
    assert sched.make_room(a) == Room("preempt", b, True)  # the youngest, pages kept
    _preempt(sched, b, keep_pages=True)
    assert sched.device_bytes_used() == 120 + 20
    c = _request(sched, "c", 4, max_tokens=1)
    assert [r.request_id for r in sched.queue(0)] == ["b", "c"]
    assert sched.make_room(a) == Room("grown") and a.pages.num_pages == 3
    sched.device_bytes = 10**6
    assert sched.admit(0) == ([], [b])  # one seat: b first, with the pages it kept
    assert b.pages.num_pages == 2 and sched.device_bytes_used() == 130 + 125
    assert sched.waiting == [c]


def test_growth_with_prompt_reservation_preempts_the_youngest_when_the_pool_is_short():
    sched = _scheduler(pages=5, reserve="prompt", decode_steps_per_call=1)
    a = _request(sched, "a", 4, max_tokens=12)  # 16 tokens: 4 pages; at admission 5: 2
    assert sched.admit(0) == ([a], []) and a.pages.num_pages == 2
    a.prefilled, a.tokens = 4, [7] * 4  # 4 + 3 stored + 1 call = 8 tokens: still 2 pages
    assert sched.make_room(a) == Room("ready")
    a.tokens.append(7)  # 9 tokens: a third page
    assert sched.make_room(a) == Room("grown") and a.pages.num_pages == 3
    b = _request(sched, "b", 4, max_tokens=1)  # 5 tokens: 2 pages, the pool's last
    assert sched.admit(0) == ([b], []) and sched.kv.pool.num_available == 0
    a.tokens.extend([7] * 7)  # 16 tokens: a fourth page, and the pool has none
    assert sched.make_room(a) == Room("preempt", b, False)  # pages short: dropped
    _preempt(sched, b, keep_pages=False)
    assert b.pages is None and b.prefilled == 0
    assert sched.make_room(a) == Room("grown") and a.pages.num_pages == 4


# -- A random schedule: admission, the pool and the prefix cache together ----------------------

SHARED = [1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0]
EVENTS = st.lists(st.tuples(st.sampled_from(["submit", "step", "preempt", "cancel"]),
                            st.integers(0, 2**16)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(events=EVENTS, order=st.sampled_from(["fifo", "shortest"]))
def test_random_schedule_never_short_of_pages(events, order):
    """Requests (prompts over two tokens, so prefixes are shared) arrive, are admitted
    (mapping the prefix cache), prefill, decode a token per step, are preempted (keeping or
    dropping their pages), resumed, cancelled or finish. With reserve="full" an admitted
    request never finds its pages short (`make_room` says "ready"), the device bytes stay
    within the budget, and at the end every page is free or cached-unreferenced."""
    sched = _scheduler(seats=3, pages=8, order=order, prefix=True, device_bytes=400)
    pool, prefix = sched.kv.pool, sched.kv.prefix
    known = {}
    for n, (event, seed) in enumerate(events):
        if event == "submit":
            length = 1 + seed % 15
            # Half the prompts start with one shared text: their full pages are shared.
            prompt = SHARED[:length] if seed & 256 else [(seed >> k) & 1 for k in range(length)]
            max_tokens = 1 + (seed >> 4) % 9
            try:
                sched.check_fits_alone(length, max_tokens)
            except ValueError:
                assert -(-min(length + max_tokens, CAPACITY) // 4) > 8
                continue
            req = RequestState(str(n), np.asarray(prompt, np.int32), max_tokens, 0.0, 1.0, 0,
                               (), (), 0.0, order=next(sched.arrivals), queued_at=n)
            sched.waiting.append(req)
            known[req.request_id] = req
        elif event == "preempt" and any(r is not None for r in sched.occupants):
            victim = max((r for r in sched.occupants if r is not None), key=lambda r: r.admitted)
            _preempt(sched, victim, keep_pages=bool(seed & 1))
        elif event == "cancel" and known:
            req = known.pop(sorted(known)[seed % len(known)])
            if req in sched.waiting:
                sched.waiting.remove(req)
            if req.seat is not None:
                sched.occupants[req.seat] = None
            if req.pages is not None:
                req.pages.release()
        new, kept = sched.admit(n)
        for req in new:
            req.prefilled = req.cached_tokens  # what the engine does
        for req in [r for r in sched.occupants if r is not None]:
            if req.prefilled < len(req.prompt):  # its prefill, in one chunk
                before, req.prefilled = req.prefilled, len(req.prompt)
                prefix.insert(None, [(req, before)])
            elif len(req.tokens) == req.max_tokens:  # finished
                _leave(sched, req)
                del known[req.request_id]
            else:
                assert sched.make_room(req) == Room("ready")
                req.tokens.append(0)
            if req.pages is not None:
                assert req.pages.num_pages * 4 >= req.stored_tokens()
        assert sched.device_bytes_used() <= sched.device_bytes
        pool.check()
        prefix.check()
    for req in known.values():
        if req.pages is not None:
            req.pages.release()
    assert pool.num_held == 0
    assert pool.num_free + pool.num_cached == pool.num_pages
    pool.check()
    prefix.check()


def test_prefilling_requests_are_packed_by_history_bucket_in_powers_of_two():
    # 5 = 4 + 1 (no padding row), never more than prefill_batch, a power of two at most.
    assert pack_sizes(5, 8) == [4, 1] and pack_sizes(20, 8) == [8, 8, 4]
    assert pack_sizes(7, 6) == [4, 2, 1] and pack_sizes(3, 1) == [1, 1, 1]
    assert pack_sizes(0, 8) == []
    sched = _scheduler(seats=6, pages=48, prefill_batch=4)
    sched.kv.history_pages = lambda prefilled: -(-prefilled // 4)  # pages of history
    reqs = [_request(sched, f"r{b}", 12) for b in range(6)]
    for b, (req, prefilled) in enumerate(zip(reqs, [0, 4, 0, 12, 0, 4])):
        _seat(sched, req, b, decoding=False)
        req.prefilled = prefilled
    # r3 is done prefilling; buckets 0 (r0, r2, r4) and 1 (r1, r5), each in seat order.
    packs = [[r.request_id for r in pack] for pack in sched.prefill_packs()]
    assert packs == [["r0", "r2"], ["r4"], ["r1", "r5"]]

"""Admission by memory (fo_jax.engine.admission): the costs equal the planner's, admit / wait /
refuse with their messages pinned, the queue orders, preemption (victim rule, pages kept,
resume first), growth under reserve="prompt"; and a random schedule of the ledger together with
the page pool and prefix cache: an admitted request never finds the pool short, and everything
returns to zero."""

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fo_jax.config import get_config
from fo_jax.engine.admission import (Admission, Decision, MemoryCosts, Request, RequestRefused,
                                     Verdict)
from fo_jax.engine.pages import PagePool, PrefixCache, RequestPages
from fo_jax.offload.config import min_hot_slots
from fo_jax.plan import plan_capacity

# Round figures, so the arithmetic of each test reads at a glance.
COSTS = MemoryCosts(page_size=4, hot_slots=8, num_buffers=2, max_context=64,
                    seat_device_bytes=100, page_device_bytes=10, page_host_bytes=1000,
                    page_prefill_bytes=5)


def _admission(**kwargs):
    settings_ = dict(device_budget_bytes=300, host_budget_bytes=7000, max_seats=2)
    settings_.update(kwargs)
    return Admission(COSTS, **settings_)


# Bytes of one KV row of the tiny model (D = 32, R = 8) in each format: bf16 (D + R) * 2;
# fp8_ds_mla D + 4 (one scale: blocks of min(128, D)) + 2 R.
ROW_BYTES = {"bf16": 40 * 2, "fp8_ds_mla": 32 + 4 + 2 * 8}


@pytest.mark.parametrize("kv_format", list(ROW_BYTES))
def test_costs_are_the_planners(kv_format):
    config = get_config("tiny").replace(kv_format=kv_format)
    row = ROW_BYTES[kv_format]
    hot_slots, page, buffers = min_hot_slots(config), 16, 2
    costs = MemoryCosts.from_config(config, page_size=page, hot_slots=hot_slots,
                                    num_buffers=buffers)
    # tiny: L = 4, a row of `row` bytes, G = 2, N = 16 bfloat16 keys; C = 64.
    assert costs.seat_device_bytes == 64 * 4 * row + 2 * 16 * 4 * row + 4 * 2 * 64
    assert costs.page_device_bytes == 16 * 2 * 16 * 2 + 4 * 2 * 16
    assert costs.page_host_bytes == 16 * 4 * row
    assert costs.page_prefill_bytes == 2 * 16 * row
    for context in (16, 256, 1024):
        plan = plan_capacity(config, context, hot_slots=hot_slots, tail_block=page,
                             num_buffers=buffers, budget_gb=1.0)
        pages = costs.pages(context)
        assert (costs.seat_device_bytes + pages * costs.page_device_bytes
                == plan.offload_device_bytes)
        assert pages * costs.page_host_bytes == plan.host_bytes_per_request
        assert pages * costs.page_prefill_bytes == plan.prefill_offload_kv_bytes
    with pytest.raises(ValueError, match=re.escape(
            "hot_slots=8 < index_topk * max_ways = 16 * 4 = 64")):
        MemoryCosts.from_config(config, page_size=16, hot_slots=8)
    with pytest.raises(ValueError, match=re.escape("page_size must be an int >= 1, got 0")):
        MemoryCosts.from_config(config, page_size=0, hot_slots=64)


def test_a_device_pool_charges_kv_pages_to_the_device():
    """With the page pool in device memory a page held costs its indexer keys + its KV rows
    of the device budget (10 + 1,000 B) and nothing of the host budget."""
    costs = dataclasses.replace(COSTS, pool_memory="device")
    admission = Admission(costs, device_budget_bytes=3500, host_budget_bytes=0, max_seats=2)
    a = Request("a", prompt_len=6, max_new_tokens=2)  # 2 pages; prompt 2 pages
    assert admission.need(a) == (100 + 2 * 5 + 2 * 1010, 0)
    admission.submit(a)
    assert admission.schedule() == [a]
    admission.finish_prefill("a")
    assert admission.used_device_bytes == 100 + 2 * 1010 and admission.used_host_bytes == 0
    big = Request("big", prompt_len=8, max_new_tokens=4)  # 3 pages: 100 + 10 + 3,030
    assert admission.decide(big) == Decision(Verdict.WAIT, 3140, 0, (
        "request 'big' waits: it needs 3,140 B of device memory (1,380 B free) and 0 B of host "
        "memory (0 B free), and a seat (1 of 2 free)"))
    huge = Request("huge", prompt_len=8, max_new_tokens=8)  # 4 pages: 100 + 10 + 4,040
    with pytest.raises(RequestRefused, match=re.escape(
            "request 'huge' can never fit: 16 tokens (4 pages of 4) need 4,150 B of device "
            "memory (seat 100 B + prefill buffers 10 B + KV and indexer-key pages 4,040 B) "
            "against a budget of 3,500 B")):
        admission.submit(huge)
    admission.finish("a")
    assert (admission.used_device_bytes, admission.used_host_bytes) == (0, 0)
    with pytest.raises(ValueError, match=re.escape(
            "pool_memory='hbm' must be one of ('pinned_host', 'device') (where the KV page pool "
            "lives)")):
        dataclasses.replace(COSTS, pool_memory="hbm")


def test_admit_wait_refuse():
    admission = _admission()
    a = Request("a", prompt_len=6, max_new_tokens=6)  # 12 tokens: 3 pages; prompt: 2 pages
    # device: seat 100 + prefill 2 * 5 + 3 pages * 10 = 140; host: 3 * 1000.
    assert admission.need(a) == (140, 3000)
    assert admission.decide(a) == Decision(Verdict.ADMIT, 140, 3000, "")
    admission.submit(a)
    assert admission.schedule() == [a]
    assert (admission.used_device_bytes, admission.used_host_bytes) == (140, 3000)
    b = Request("b", prompt_len=12, max_new_tokens=4)  # 4 pages; prompt 3: 100 + 15 + 40 = 155
    assert admission.decide(b) == Decision(Verdict.ADMIT, 155, 4000, "")  # exactly fits
    # 5 pages, prompt 5 pages: device 100 + 25 + 50 = 175 > 160 free; host 5000 > 4000 free.
    c = Request("c", prompt_len=20, max_new_tokens=0)
    assert admission.decide(c) == Decision(Verdict.WAIT, 175, 5000, (
        "request 'c' waits: it needs 175 B of device memory (160 B free) and 5,000 B of host "
        "memory (4,000 B free), and a seat (1 of 2 free)"))
    big = Request("big", prompt_len=20, max_new_tokens=12)  # 8 pages: host 8000 > 7000
    refused = (
        "request 'big' can never fit: 32 tokens (8 pages of 4) need 205 B of device memory "
        "(seat 100 B + prefill buffers 25 B + indexer-key pages 80 B) against a budget of "
        "300 B, and 8,000 B of host memory (KV pages) against a budget of 7,000 B; shorten the "
        "prompt or max_new_tokens, or raise the budgets")
    assert admission.decide(big) == Decision(Verdict.REFUSE, 0, 0, refused)
    with pytest.raises(RequestRefused, match=re.escape(refused)):
        admission.submit(big)
    long = Request("long", prompt_len=60, max_new_tokens=5)
    with pytest.raises(RequestRefused, match=re.escape(
            "request 'long' can never fit: prompt_len=60 + max_new_tokens=5 = 65 tokens exceed "
            "the model's max_seq_len=64")):
        admission.submit(long)
    assert admission.waiting == ()
    # Device-bound refusal.
    tight = _admission(device_budget_bytes=139)
    assert tight.decide(a).verdict is Verdict.REFUSE
    assert "need 140 B of device memory" in tight.decide(a).reason


def test_fifo_does_not_overtake_and_shortest_first_does():
    requests = [Request("long", 20, 4), Request("short", 2, 2), Request("mid", 8, 0)]
    fifo = _admission(max_seats=3, host_budget_bytes=6000)
    for request in requests:
        fifo.submit(request)
    first = fifo.schedule()  # long: 6 pages, host 6000: all of it; short must wait behind it
    assert [r.request_id for r in first] == ["long"]
    assert fifo.waiting == ("short", "mid")
    fifo.finish("long")
    assert [r.request_id for r in fifo.schedule()] == ["short", "mid"]

    shortest = _admission(max_seats=3, host_budget_bytes=6000, order="shortest")
    for request in requests:
        shortest.submit(request)
    assert shortest.waiting == ("short", "mid", "long")
    assert [r.request_id for r in shortest.schedule()] == ["short", "mid"]
    assert shortest.waiting == ("long",)  # 3000 host bytes used: long waits


def test_seats_limit_admission():
    admission = _admission(max_seats=1)
    admission.submit(Request("a", 1, 1))
    admission.submit(Request("b", 1, 1))
    assert [r.request_id for r in admission.schedule()] == ["a"]
    assert admission.free_seats == 0
    assert admission.schedule() == []
    admission.finish("a")
    assert [r.request_id for r in admission.schedule()] == ["b"]


def test_preemption_keeps_pages_and_resumes_first():
    admission = _admission(max_seats=2)
    a, b, c = Request("a", 4, 4), Request("b", 4, 4), Request("c", 4, 0)
    for request in (a, b):
        admission.submit(request)
    admission.schedule()
    admission.finish_prefill("a")  # a: 100 + 2 pages * 10 = 120; b prefilling: 100 + 5 + 20
    assert admission.used_device_bytes == 120 + 125
    assert admission.running == ("a", "b")
    assert admission.victim() == "b"  # admitted last
    admission.submit(c)
    assert admission.preempt() == "b"
    # b's seat and prefill buffers are released, its pages stay charged.
    assert admission.used_device_bytes == 120 + 20
    assert admission.used_host_bytes == 4000
    assert admission.waiting == ("b", "c")
    # b resumes before c; it had not finished its prefill: it gets its buffers back.
    assert [r.request_id for r in admission.schedule()] == ["b"]
    assert admission.used_device_bytes == 120 + 125
    assert admission.victim() == "b"
    admission.finish("a")
    assert admission.running == ("b",)
    assert [r.request_id for r in admission.schedule()] == ["c"]
    assert admission.victim() == "c"
    for request_id in ("b", "c"):
        admission.finish(request_id)
    assert (admission.used_device_bytes, admission.used_host_bytes) == (0, 0)


def test_grow_with_prompt_reservation():
    admission = _admission(reserve="prompt", host_budget_bytes=5000)
    a = Request("a", 4, 12)  # 16 tokens: 4 pages; at admission 5 tokens: 2 pages
    admission.submit(a)
    admission.schedule()
    assert admission.pages_charged("a") == 2
    assert admission.grow("a", 8) is True  # still 2 pages
    assert admission.grow("a", 9) is True and admission.pages_charged("a") == 3
    admission.submit(Request("b", 4, 0))  # 1 page
    admission.schedule()
    assert admission.used_host_bytes == 4000
    assert admission.grow("a", 16) is True  # 4 pages: host 5000, the whole budget
    assert admission.grow("b", 4) is True
    admission.finish("b")
    with pytest.raises(ValueError, match=re.escape(
            "grow of request 'a' to 17 tokens, beyond prompt_len + max_new_tokens = 16")):
        admission.grow("a", 17)
    # Short of pages: grow says no and changes nothing.
    squeezed = _admission(reserve="prompt", host_budget_bytes=4000)
    squeezed.submit(Request("x", 4, 12))
    squeezed.submit(Request("y", 4, 4))
    squeezed.schedule()
    assert squeezed.used_host_bytes == 4000
    assert squeezed.grow("x", 9) is False
    assert squeezed.pages_charged("x") == 2 and squeezed.used_host_bytes == 4000
    assert squeezed.victim() == "y"


def test_ledger_errors_are_pinned():
    admission = _admission()
    a = Request("a", 1, 1)
    admission.submit(a)
    with pytest.raises(ValueError, match=re.escape(
            "request id 'a' is already queued or running")):
        admission.submit(a)
    with pytest.raises(ValueError, match=re.escape(
            "grow of request 'a', which is not running (queued or preempted)")):
        admission.grow("a", 1)
    with pytest.raises(ValueError, match=re.escape(
            "unknown request id 'zz': not queued or running")):
        admission.finish("zz")
    with pytest.raises(ValueError, match=re.escape("preempt with no running request")):
        admission.preempt()
    admission.schedule()
    admission.finish_prefill("a")
    with pytest.raises(ValueError, match=re.escape("finish_prefill of request 'a' twice")):
        admission.finish_prefill("a")
    with pytest.raises(ValueError, match=re.escape("request must be a Request, got tuple")):
        admission.submit(("b", 1, 1))
    with pytest.raises(ValueError, match=re.escape("prompt_len must be an int >= 1, got 0")):
        Request("b", 0, 1)
    with pytest.raises(ValueError, match=re.escape("max_new_tokens must be an int >= 0, got -1")):
        Request("b", 1, -1)
    with pytest.raises(ValueError, match=re.escape(
            "order='lifo' must be one of ('fifo', 'shortest')")):
        _admission(order="lifo")
    with pytest.raises(ValueError, match=re.escape(
            "reserve='all' must be one of ('full', 'prompt')")):
        _admission(reserve="all")
    with pytest.raises(ValueError, match=re.escape("max_seats must be an int >= 1, got 0")):
        _admission(max_seats=0)
    with pytest.raises(ValueError, match=re.escape("costs must be a MemoryCosts, got dict")):
        Admission({}, device_budget_bytes=1, host_budget_bytes=1, max_seats=1)


# -- A random schedule: the ledger and the pool together ----------------------------------------

PAGE = COSTS.page_size
SHARED = [1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0]
EVENTS = st.lists(st.tuples(st.sampled_from(["submit", "step", "preempt", "cancel"]),
                            st.integers(0, 2**16)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(events=EVENTS, order=st.sampled_from(["fifo", "shortest"]))
def test_random_schedule_never_short_of_pages(events, order):
    """Requests (prompts over two tokens, so prefixes are shared) arrive, are admitted by the
    ledger, prefill (matching the prefix cache), decode a token per step, are preempted,
    resumed, cancelled or finish. With reserve="full" and a pool of `num_pool_pages` pages, an
    admitted request never finds the pool short; the ledger stays within the budgets; at the
    end every page is free or cached-unreferenced and the ledger is zero."""
    admission = _admission(max_seats=3, device_budget_bytes=10**6, host_budget_bytes=8_000,
                           order=order)
    pool = PagePool(admission.num_pool_pages, PAGE)
    cache = PrefixCache(pool)
    prompts, max_new = {}, {}  # id -> prompt tokens; id -> max_new_tokens
    state = {}  # id -> [RequestPages, tokens generated]
    for n, (event, seed) in enumerate(events):
        if event == "submit":
            length = 1 + seed % 15
            # Half the prompts start with one shared text: their full pages are shared.
            prompt = (SHARED[:length] if seed & 256 else
                      [(seed >> k) & 1 for k in range(length)])
            request = Request(n, length, (seed >> 4) % 9)
            try:
                admission.submit(request)
            except RequestRefused:
                assert request.context > 8 * PAGE  # more pages than the host budget buys
                continue
            prompts[n] = prompt
            max_new[n] = request.max_new_tokens
        elif event == "preempt" and admission.running:
            admission.preempt()
        elif event == "cancel" and prompts:
            victim = sorted(prompts)[seed % len(prompts)]
            admission.finish(victim)
            if victim in state:
                state.pop(victim)[0].release()
            del prompts[victim]
        for request in admission.schedule():
            rid = request.request_id
            if rid in state:  # resumed: same pages
                continue
            prompt = prompts[rid]
            pages, cached = cache.match(prompt[:-1])
            pages_of = RequestPages(pool, COSTS.max_context // PAGE, prefix_pages=pages,
                                    prefix_tokens=cached)
            pages_of.grow(len(prompt))  # never PoolExhausted: the ledger reserved it
            cache.insert(prompt, pages_of.pages)
            admission.finish_prefill(rid)
            state[rid] = [pages_of, 0]
        for rid in admission.running:  # one decode step of every running request
            pages_of, generated = state[rid]
            request_len = len(prompts[rid])
            if generated == max_new[rid]:
                admission.finish(rid)
                pages_of.release()
                del state[rid], prompts[rid]
                continue
            assert admission.grow(rid, request_len + generated + 1)
            pages_of.grow(request_len + generated + 1)
            state[rid][1] += 1
        assert admission.used_device_bytes <= admission.device_budget_bytes
        assert admission.used_host_bytes <= admission.host_budget_bytes
        assert pool.num_held <= admission.used_host_bytes // COSTS.page_host_bytes
        pool.check()
        cache.check()
    for rid in list(prompts):
        admission.finish(rid)
        if rid in state:
            state.pop(rid)[0].release()
    assert (admission.used_device_bytes, admission.used_host_bytes) == (0, 0)
    assert admission.free_seats == admission.max_seats and admission.waiting == ()
    assert pool.num_held == 0
    assert pool.num_free + pool.num_cached == pool.num_pages
    pool.check()
    cache.check()

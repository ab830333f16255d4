"""The paged KV on the device: the offloaded engine with its page pool in device memory
(`OffloadConfig(host_memory_kind="device")`). Its KV pages count as device bytes: admission
and `add_request` refusals count them, preemption under a device budget drops pages rather
than keep them unless freeing the victim's seat is enough, and every request's tokens equal
its solo resident run bit for bit with no page leaked and the budget never passed."""

import functools
import re

import jax
import numpy as np
import pytest

from fo_jax.config import get_config
from fo_jax.engine.costs import MemoryCosts
from fo_jax.engine.engine import Engine
from fo_jax.engine.metrics import page_bytes
from fo_jax.engine.scheduler import RequestRefused
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

# The shapes of tests/engine/test_engine.py: two layers, top-4, seats of 32 tokens, pages of 4.
# Device bytes (Z=4, C=8, 2 prefill buffers): seat 2,592 B, prefill buffers 640 B per prompt
# page, indexer keys 144 B per page, KV 640 B per page: a page held in the device pool 784 B.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
CAPACITY, SEATS, PAGES = 32, 3, 8
SEAT, PREFILL, PAGE = 2592, 640, 784


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _engine(memory="device", **kwargs):
    offload = None if memory is None else OffloadConfig(
        hot_slots=8, page_size=4, capacity=CAPACITY, host_memory_kind=memory)
    if offload is not None:
        kwargs.setdefault("num_pages", PAGES)
    return Engine(_params(), CONFIG, seats=SEATS, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=2, prefill_chunk=8, query_block=None, **kwargs)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


@functools.cache
def _solo(prompt, max_tokens, temperature=0.0, seed=0):
    engine = _engine(None)
    rid = engine.add_request(list(prompt), max_tokens=max_tokens, temperature=temperature,
                             seed=seed)
    return tuple(engine.run()[rid].token_ids)


def test_the_costs_count_kv_pages_on_the_device():
    host = MemoryCosts.from_config(CONFIG, page_size=4, hot_slots=8, num_buffers=2)
    device = MemoryCosts.from_config(CONFIG, page_size=4, hot_slots=8, num_buffers=2,
                                     pool_memory="device")
    assert (host.seat_device_bytes, host.page_device_bytes, host.page_host_bytes,
            host.page_prefill_bytes) == (SEAT, 144, 640, PREFILL)
    assert host.held_page_device_bytes == 144 and host.held_page_host_bytes == 640
    assert device.held_page_device_bytes == PAGE and device.held_page_host_bytes == 0
    assert device.device_need(9, 4) == (SEAT, 3 * PREFILL, 4 * PAGE)
    assert device.device_need(9, 4, prefilling=False) == (SEAT, 0, 4 * PAGE)
    with pytest.raises(ValueError, match=re.escape(
            "pool_memory='hbm' must be one of ('pinned_host', 'device') (where the KV page "
            "pool lives)")):
        MemoryCosts.from_config(CONFIG, page_size=4, hot_slots=8, num_buffers=2,
                                pool_memory="hbm")


def test_kv_pages_count_against_device_bytes():
    """Two requests of 1 prompt token + 7 (2 pages each): 4,800 B each while prefilling with
    the pool on the device (3,520 B with it on the host, where only indexer keys count).
    8,000 B admits one at a time; 4,000 B refuses the request, with the figures."""
    engine = _engine(device_bytes=8000)
    prompts = [_prompt(1, 1), _prompt(2, 1)]
    ids = [engine.add_request(p, max_tokens=7) for p in prompts]
    engine.step()
    assert engine.num_running() == 1 and engine.waiting_ids() == [ids[1]]
    assert engine.device_bytes_used() == SEAT + 2 * PAGE
    while engine.has_unfinished():
        engine.step()
        assert engine.device_bytes_used() <= 8000
    outputs = engine.run()
    for rid, prompt in zip(ids, prompts):
        assert tuple(outputs[rid].token_ids) == _solo(tuple(prompt), 7)
    assert engine.pool_occupancy()["held"] == 0 and engine.device_bytes_used() == 0
    assert page_bytes(engine) == {"device_kv": 640, "device_index_keys": 144}  # metrics' names
    engine = _engine(device_bytes=4000)
    with pytest.raises(RequestRefused, match=re.escape(
            "prompt of 1 tokens + max_tokens=7 can never fit device_bytes=4,000: alone it needs "
            "4,800 bytes of device memory (seat hot cache 2,592 + prefill buffers 640 + KV and "
            "indexer-key pages 1,568 for 2 pages of 4 tokens, the pool in device memory); "
            "shorten the prompt or max_tokens, or raise device_bytes")):
        engine.add_request(_prompt(1, 1), max_tokens=7)
    assert engine.num_waiting() == 0


@pytest.mark.parametrize("old_tokens", [8, 20])
def test_preemption_in_a_device_pool(old_tokens):
    """reserve="prompt", 8,000 B: two decoding seats (5,184 B) leave room for 3 pages of 784 B.
    When the older request's growth passes the budget, freeing the younger one's seat covers
    the page: it is preempted keeping its pages. old_tokens=8: the older one ends and the
    younger one resumes from its kept pages (no recompute). old_tokens=20: the older one grows
    again while the younger waits: its kept pages are dropped first (device bytes held by
    nobody decoding, as pool pages would be) and it resumes by prefilling and replaying.
    Either way both get their solo tokens, the budget is never passed, no page leaks."""
    engine = _engine(device_bytes=8000, reserve="prompt")
    old = engine.add_request(_prompt(1, 1), max_tokens=old_tokens)
    young = engine.add_request(_prompt(2, 1), max_tokens=12, temperature=0.9, seed=3)
    while engine.has_unfinished():
        engine.step()
        engine.pool.check()
        assert engine.device_bytes_used() <= 8000
    counters = engine.counters
    assert counters["preemptions"] >= 1 and counters["preemptions_kept_pages"] >= 1
    if old_tokens == 8:
        assert counters["resumed_without_recompute"] >= 1 and counters["replayed_tokens"] == 0
    else:
        assert counters["replayed_tokens"] > 0
    outputs = engine.run()
    assert tuple(outputs[old].token_ids) == _solo(tuple(_prompt(1, 1)), old_tokens)
    assert tuple(outputs[young].token_ids) == _solo(tuple(_prompt(2, 1)), 12, 0.9, 3)
    assert engine.pool_occupancy()["held"] == 0 and engine.device_bytes_used() == 0


@pytest.mark.parametrize("budget, overlap", [(9000, True), (12000, False)])
def test_a_schedule_with_prefix_cache_and_preemption(budget, overlap):
    """Five requests (three share a one-chunk system prompt) arriving over the first steps,
    reserve="prompt", the prefix cache on: requests wait, share pages and are preempted
    (9,000 B: device bytes short, pages kept and resumed; 12,000 B: pool pages short, pages
    dropped and replayed); every request's tokens equal its solo resident run bit for bit,
    the budget holds after every step, and no page is held at the end (cached ones mapped by
    none). The 12,000 B arrivals are timed to the steps of an engine without overlap (with
    it, a finished request's seat frees one step later and the pool never runs short)."""
    system = _prompt(99, 8)
    specs = [(system + _prompt(1, 3), 9, 0.0, 0, 0), (_prompt(2, 5), 12, 0.9, 1, 0),
             (system + _prompt(3, 1), 6, 0.0, 0, 1), (_prompt(4, 2), 10, 0.0, 0, 2),
             (system + _prompt(5, 4), 5, 0.9, 2, 3)]
    engine = _engine(device_bytes=budget, reserve="prompt", prefix_cache=True, overlap=overlap)
    ids, step = {}, 0
    while len(ids) < len(specs) or engine.has_unfinished():
        for i, (prompt, max_tokens, temperature, seed, at) in enumerate(specs):
            if at == step:
                ids[i] = engine.add_request(prompt, max_tokens=max_tokens,
                                            temperature=temperature, seed=seed)
        engine.step()
        engine.pool.check()
        assert engine.device_bytes_used() <= budget
        step += 1
        assert step < 100
    assert engine.counters["preemptions"] >= 1 and engine.counters["prefix_hit_tokens"] > 0
    if budget == 9000:
        assert engine.counters["resumed_without_recompute"] >= 1
    else:
        assert engine.counters["replayed_tokens"] > 0
    outputs = engine.run()
    for i, (prompt, max_tokens, temperature, seed, _) in enumerate(specs):
        assert tuple(outputs[ids[i]].token_ids) == _solo(tuple(prompt), max_tokens,
                                                          temperature, seed), i
    occupancy = engine.pool_occupancy()
    assert occupancy["held"] == 0 and engine.device_bytes_used() == 0
    assert occupancy["free"] + occupancy["cached"] == occupancy["total"]
    engine.prefix.check()

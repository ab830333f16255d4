"""Prefix reuse on the resident path (fo_jax.engine.resident_prefix) and in AutoEngine: a
request served from cached blocks gets the KV rows, indexer keys and tokens of its run from
scratch bit for bit, prefills only the rest, and the store stays within its budget (least
recently released blocks evicted first) without leaking a block."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fo_jax.config import get_config
from fo_jax.engine.auto import AutoEngine
from fo_jax.engine.engine import Engine
from fo_jax.engine.metrics import MetricsLog
from fo_jax.engine.resident_prefix import block_bytes
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

# The shapes of tests/engine/test_engine.py (its programs are compiled once for both files).
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
CAPACITY, SEATS, CHUNK = 32, 3, 8
BLOCK = block_bytes(CONFIG, CHUNK)  # one block: a prefill chunk of every layer's rows


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _engine(prefix_cache=True, **kwargs):
    return Engine(_params(), CONFIG, seats=SEATS, capacity=CAPACITY, decode_steps_per_call=2,
                  prefill_chunk=CHUNK, query_block=None, prefix_cache=prefix_cache, **kwargs)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


@functools.cache
def _solo(prompt, max_tokens, temperature=0.0, seed=0):
    """The request alone on a resident engine of the same seats, no prefix cache."""
    engine = _engine(prefix_cache=False)
    rid = engine.add_request(list(prompt), max_tokens=max_tokens, temperature=temperature,
                             seed=seed)
    out = engine.run()[rid]
    return tuple(out.token_ids), out.finish_reason


SYSTEM = _prompt(99, 16)  # two prefill chunks: two blocks


def _check(engine):
    store = engine.prefix.store
    store.check()  # pool and cache agree, nothing held between steps, arrays of every block
    occ = store.occupancy()
    assert occ["cached"] + occ["free"] == occ["total"]
    assert occ["cached_bytes"] <= occ["total_bytes"]


def test_staggered_shared_prefix_requests_equal_their_solo_runs():
    """Four requests starting with the same 16-token system prompt arrive while others
    prefill and decode (one sampled): each later one copies the two cached blocks into its
    seat and prefills only the rest; every request's tokens equal its solo run's."""
    engine = _engine()
    engine.metrics = MetricsLog(engine, every=4)
    specs = [(SYSTEM + _prompt(1, 5), 6, 0.0, 0), (SYSTEM + _prompt(2, 7), 5, 0.0, 0),
             (SYSTEM + _prompt(3, 3), 6, 0.9, 4), (_prompt(4, 6) + SYSTEM, 4, 0.0, 0)]
    arrivals = [0, 2, 3, 3]
    ids, step = {}, 0
    while len(ids) < len(specs) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step:
                prompt, max_tokens, temperature, seed = specs[i]
                ids[i] = engine.add_request(prompt, max_tokens=max_tokens,
                                            temperature=temperature, seed=seed)
        engine.step()
        _check(engine)
        step += 1
    outputs = engine.run()
    for i, (prompt, max_tokens, temperature, seed) in enumerate(specs):
        got = outputs[ids[i]]
        assert (tuple(got.token_ids), got.finish_reason) == _solo(
            tuple(prompt), max_tokens, temperature, seed), i
    # Requests 1 and 2 reuse the system prompt's two blocks; 3 has it at another offset.
    assert engine.counters["prefix_hit_tokens"] == 2 * 16
    assert engine.counters["prefill_tokens"] == sum(len(s[0]) for s in specs) - 2 * 16
    assert engine.prefix.store.cache.num_hit_tokens == 2 * 16
    engine.metrics.flush()  # the metrics report the reuse as the offloaded path's do
    assert engine.metrics.last["totals"]["prefix_hit_tokens"] == 2 * 16
    assert "fojax_prefix_cache_hit_tokens_total 32.0" in engine.metrics.prometheus_text()


@pytest.mark.parametrize("memory", ["device", "pinned_host"])
def test_reused_rows_are_bitwise_those_prefilled_from_scratch(memory):
    """After a request served from the cache, its seat's KV rows and indexer keys (prompt and
    decoded tokens) equal those of the same request on an engine without the cache."""
    prompt = SYSTEM + _prompt(2, 7)
    rows = []
    for cache in (False, True):
        engine = _engine(prefix_cache=cache,
                         **({"prefix_cache_memory": memory} if cache else {}))
        if cache:
            engine.add_request(SYSTEM + _prompt(1, 3), max_tokens=2)
            engine.run()
            before = engine.counters["prefill_tokens"]
        rid = engine.add_request(prompt, max_tokens=5)
        out = engine.run()[rid]
        length = len(prompt) + len(out.token_ids) - 1
        rows.append((np.asarray(engine.state.kv[:, 0, :length]),
                     np.asarray(engine.state.index_keys[:, 0, :length]), out.token_ids))
    assert engine.counters["prefix_hit_tokens"] == 16
    assert engine.counters["prefill_tokens"] - before == len(prompt) - 16
    (kv0, keys0, tokens0), (kv1, keys1, tokens1) = rows
    assert tokens0 == tokens1
    np.testing.assert_array_equal(kv0, kv1)
    np.testing.assert_array_equal(keys0, keys1)
    if memory == "pinned_host":
        slot = next(iter(engine.prefix.store.cache._hash_of))
        assert engine.prefix.store._kv[slot].sharding.memory_kind == "pinned_host"


def test_least_recently_released_blocks_are_evicted_under_the_budget():
    """A store of two blocks: a 25-token prompt stores its first two blocks only (no room for
    the third); a second prompt's block evicts the first prompt's deepest block (released
    last page first), so the first prompt's prefix is then found for one block, the second's
    for its block; tokens equal the solo runs throughout."""
    engine = _engine(prefix_cache_bytes=2 * BLOCK + BLOCK // 2)
    assert engine.prefix.store.num_blocks == 2
    a, b = SYSTEM + _prompt(5, 9), _prompt(6, 8) + _prompt(7, 3)
    served = []

    def serve(prompt):
        hit = engine.counters["prefix_hit_tokens"]
        rid = engine.add_request(prompt, max_tokens=3)
        out = engine.run()[rid]
        _check(engine)
        assert tuple(out.token_ids) == _solo(tuple(prompt), 3)[0]
        served.append(engine.counters["prefix_hit_tokens"] - hit)

    serve(a)  # blocks a0, a1 stored (a2: no room)
    assert engine.prefix.store.occupancy()["cached"] == 2
    serve(b)  # b0 evicts a1, the deepest block of a
    assert engine.prefix.store.occupancy()["evicted"] == 1
    serve(a[:17] + _prompt(8, 2))  # a0 found, a1 gone: 8 tokens; stores a1 again (evicts b0)
    serve(b[:9])  # b0 was evicted with the last insertion: nothing found
    assert served == [0, 0, 8, 0]
    assert engine.prefix.store.occupancy()["total_bytes"] <= 2 * BLOCK + BLOCK // 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefix_cache=False, prefix_cache_bytes=10**6),
     "prefix_cache_bytes and prefix_cache_memory need prefix_cache=True"),
    (dict(prefix_cache_memory="hbm"),
     r"prefix_cache_memory='hbm' must be one of \('device', 'pinned_host'\)"),
    (dict(prefix_cache_bytes=BLOCK - 1),
     f"prefix_cache_bytes={BLOCK - 1} holds no block of 8 tokens \\({BLOCK} bytes: KV rows of "
     "2 layers and indexer keys of 1 group\\): raise it, or lower prefill_chunk"),
    (dict(prefix_cache_bytes=0), "prefix_cache_bytes=0 must be an int >= 1"),
    (dict(prefill_chunk=32), "prefix_cache on the resident path reuses whole prefill chunks, "
                             "but prefill_chunk=32 leaves none before the last token of a "
                             "prompt in a seat of 32 tokens: lower prefill_chunk"),
    (dict(offload=OffloadConfig(hot_slots=8, page_size=4, capacity=CAPACITY),
          prefix_cache_bytes=10**6),
     "prefix_cache_bytes and prefix_cache_memory size the resident path's prefix store; "
     "offloaded, the prefix cache keeps pages of the pool: size it with num_pages or "
     "host_pool_bytes"),
])
def test_bad_settings_are_refused(kwargs, message):
    args = dict(seats=2, capacity=CAPACITY, prefill_chunk=CHUNK, prefix_cache=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Engine(_params(), CONFIG, **args)


def test_the_default_budget_holds_one_seat_of_blocks():
    engine = _engine()
    assert engine.prefix.store.num_blocks == CAPACITY // CHUNK
    assert engine.prefix.store.memory == "device"
    assert _engine(prefix_cache=False).prefix is None


# Random schedules: requests sharing prefixes arrive, are cancelled, and evict each other's
# blocks from a store of 3 blocks.
REQUEST = st.tuples(st.sampled_from([0, 1, 2]), st.integers(0, 10**6), st.integers(1, 9),
                    st.integers(1, 8), st.sampled_from([0.0, 0.9]), st.integers(0, 3))
PREFIXES = ([], SYSTEM, SYSTEM[:8] + _prompt(98, 8))


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests=st.lists(REQUEST, min_size=2, max_size=5),
       arrivals=st.lists(st.integers(0, 4), min_size=5, max_size=5),
       cancels=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 4)), max_size=1))
def test_random_schedules_with_shared_prefixes(requests, arrivals, cancels):
    engine = _engine(prefix_cache_bytes=3 * BLOCK)
    prompts = [PREFIXES[kind] + _prompt(seed, length) for kind, seed, length, *_ in requests]
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    ids, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            *_, max_tokens, temperature, seed = requests[i]
            ids[i] = engine.add_request(prompts[i], max_tokens=max_tokens,
                                        temperature=temperature, seed=seed)
        for when, i in cancels:
            if when == step and i % len(requests) in ids:
                engine.cancel(ids[i % len(requests)])
        engine.step()
        _check(engine)
        step += 1
        assert step < 100
    outputs = engine.run()
    for i, rid in ids.items():
        *_, max_tokens, temperature, seed = requests[i]
        want, reason = _solo(tuple(prompts[i]), max_tokens, temperature, seed)
        got = outputs[rid]
        if got.finish_reason == "cancelled":
            assert tuple(got.token_ids) == want[:len(got.token_ids)]
        else:
            assert (tuple(got.token_ids), got.finish_reason) == (want, reason), rid


# AutoEngine: both tiers reuse prefixes.
SHORT = 16
OFFLOAD = OffloadConfig(hot_slots=8, page_size=4, capacity=CAPACITY, policy="ring")


@functools.cache
def _long_solo(prompt, max_tokens):
    engine = Engine(_params(), CONFIG, seats=1, capacity=CAPACITY, decode_steps_per_call=2,
                    prefill_chunk=CHUNK, query_block=None)
    rid = engine.add_request(list(prompt), max_tokens=max_tokens)
    return tuple(engine.run()[rid].token_ids)


def test_auto_engine_reuses_prefixes_on_both_tiers():
    """Short prompts sharing one chunk run resident, long ones sharing two chunks run
    offloaded (a prompt longer than a resident seat); the later ones of each reuse the
    earlier's prefix on their tier; every request's tokens equal its solo resident run's.
    (The seats of tests/engine/test_auto.py: one per tier.)"""
    engine = AutoEngine(_params(), CONFIG, resident_seats=1, resident_capacity=SHORT,
                        offload=OFFLOAD, offload_seats=1, prefix_cache=True,
                        decode_steps_per_call=2, prefill_chunk=CHUNK, query_block=None)
    short = [SYSTEM[:8] + _prompt(i, 3) for i in (10, 11)]
    long = [SYSTEM + _prompt(i, 5) for i in (12, 13)]
    ids = [engine.add_request(p, max_tokens=3) for p in (short[0], long[0])]
    engine.step()
    engine.step()
    ids += [engine.add_request(p, max_tokens=3) for p in (short[1], long[1])]
    tiers = {}
    while engine.has_unfinished():
        engine.step()
        for rid in ids:
            tiers.setdefault(rid, set()).add(engine.tier_of(rid))
    outputs = engine.run()
    assert [tiers[r] - {"waiting"} for r in ids] == [{"resident"}, {"offloaded"}] * 2
    for rid, prompt in zip(ids, (short[0], long[0], short[1], long[1])):
        assert tuple(outputs[rid].token_ids) == _long_solo(tuple(prompt), 3), rid
    assert engine.resident.counters["prefix_hit_tokens"] == 8
    assert engine.offloaded.counters["prefix_hit_tokens"] == 16
    assert engine.all_counters()["prefix_hit_tokens"] == 24
    engine.resident.prefix.store.check()
    assert engine.pool_occupancy()["held"] == 0


def test_auto_engine_prefix_settings():
    with pytest.raises(ValueError, match="prefill_chunk=6 to be a multiple of page_size=4"):
        AutoEngine(_params(), CONFIG, resident_seats=1, resident_capacity=SHORT,
                   offload=OFFLOAD, offload_seats=1, prefix_cache=True, prefill_chunk=6)
    engine = AutoEngine(_params(), CONFIG, resident_seats=1, resident_capacity=SHORT,
                        offload=OFFLOAD, offload_seats=1, prefix_cache=True,
                        prefix_cache_bytes=BLOCK, prefill_chunk=CHUNK)
    assert engine.resident.prefix.store.num_blocks == 1 and engine.offloaded.prefix is not None

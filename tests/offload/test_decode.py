"""The offloaded decode step against the resident one: bit for bit, with invariants each step."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.offload import decode as offload_decode
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants, occupied_slots
from fo_jax.offload.state import DecodeState, device_bytes_formula

NAN = float("nan")
TINY = get_config("tiny")


def _setup(*, batch, ways, k, hot, page, lengths, policy, shared, steps, seed=0, **changes):
    layers = changes.get("num_layers", TINY.num_layers)
    config = TINY.replace(index_topk=k, max_ways=ways,
                          indexer_layers=(0, 2) if shared else tuple(range(layers)), **changes)
    capacity = -(-(max(lengths) + steps * ways) // page) * page
    offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity, policy=policy)
    params = init_params(config, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, (batch, max(lengths)), dtype=np.int32)
    state = resident.ResidentState.create(config, batch=batch, capacity=capacity, fill=NAN)
    _, state = resident.prefill(params, state, prompt, np.asarray(lengths), config=config)
    decode = DecodeState.from_resident(state.kv, state.index_keys, state.lengths,
                                       config=config, offload=offload, fill=NAN)
    return config, offload, params, state, decode, rng


def _run(config, offload, params, res, dec, rng, *, steps, check_every=1):
    batch, ways = res.batch, config.max_ways
    full = None
    for step in range(steps):
        tokens = rng.integers(0, config.vocab_size, (batch, ways), dtype=np.int32)
        want, res = resident.decode_step(params, res, tokens, config=config)
        got, dec, stats = offload_decode.decode_step(params, dec, tokens, config=config,
                                                     offload=offload)
        chex.assert_trees_all_equal(got, want)
        if step % check_every == 0 or step == steps - 1:
            check_invariants(dec, config=config, offload=offload, resident_kv=res.kv,
                             selected=stats.selected, poisoned=True)
            occupied = occupied_slots(dec)
            if full is not None:
                # Once the cache is full it stays full: evictions pair one-to-one with misses.
                np.testing.assert_array_equal(occupied[full], offload.hot_slots)
            full = occupied == offload.hot_slots
        # Every selected token is accounted for exactly once.
        sel = np.asarray(stats.selected >= 0).sum(-1)
        np.testing.assert_array_equal(
            np.asarray(stats.hits + stats.tail_hits + stats.misses), sel)
    return res, dec


@st.composite
def scenarios(draw):
    ways = draw(st.integers(1, 4))
    k = draw(st.sampled_from([4, 8, 16]))
    hot = draw(st.integers(k * ways, 8 * k))
    page = draw(st.sampled_from([p for p in (4, 8, 16) if ways <= p <= hot]))
    batch = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["short", "equal", "long"]))
    base = {"short": max(1, k - 3), "equal": k, "long": 6 * k}[kind]
    lengths = [max(1, base - draw(st.integers(0, 3))) for _ in range(batch)]
    return dict(batch=batch, ways=ways, k=k, hot=hot, page=page, lengths=lengths,
                policy=draw(st.sampled_from(["ring", "lru", "random", "clock"])),
                shared=draw(st.booleans()))


@settings(max_examples=3)
@given(scenarios())
def test_offloaded_decode_is_bitwise_resident(scenario):
    # Random W, k, C, page size, batch, history lengths, policy and indexer sharing. Three
    # layers: shared indexers give groups of unequal sizes (layers 0-1 and 2), unshared ones
    # three groups. Each group is its own block of the compiled programs (the layers of a group
    # are a loop): three layers compile a quarter less than the tiny model's four.
    steps = 50
    setup = _setup(steps=steps, num_layers=3, **scenario)
    _run(*setup, steps=steps, check_every=5)


@pytest.mark.parametrize("policy", ["ring", "lru", "random", "clock"])
def test_each_policy_long_context_with_misses(policy):
    steps = 24
    config, offload, params, res, dec, rng = _setup(
        batch=2, ways=2, k=8, hot=16, page=8, lengths=[90, 71], policy=policy, shared=True,
        steps=steps)
    res, dec = _run(config, offload, params, res, dec, rng, steps=steps)
    assert int(dec.step) == steps + 1


def test_offloaded_decode_with_moe_layers_is_bitwise_resident():
    # Layer 0 dense, layers 1-3 MoE (8 experts in 4 groups, top-2 of 2 groups, a shared
    # expert): the MLP never touches the KV, so offloading stays exact.
    steps = 6
    setup = _setup(batch=2, ways=2, k=8, hot=16, page=8, lengths=[40, 29], policy="lru",
                   shared=True, steps=steps, n_routed_experts=8, num_experts_per_tok=2,
                   moe_hidden=16, n_shared_experts=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, first_k_dense_replace=1)
    config, _, params = setup[:3]
    assert config.moe and "dense_mlp" in params and "moe" in params
    _run(*setup, steps=steps)


@pytest.mark.parametrize("access", ["gather", "slices", "ffi"])
def test_fp8_cache_offloaded_decode_is_bitwise_resident(access):
    # kv_format="fp8_ds_mla": both paths store uint8 rows (D e4m3 bytes, a float32 scale, R
    # bfloat16: 52 bytes at the tiny widths), quantized by the same write and dequantized only
    # after the gather. Through each host access (the misses' copies move bytes): offloaded
    # equals resident bit for bit, the hot rows equal the host rows byte for byte, empty
    # slots hold the poison bytes 0xFF (request 0 has fewer tokens than slots).
    steps = 6
    config, offload, params, res, dec, rng = _setup(
        batch=2, ways=2, k=4, hot=12, page=4, lengths=[9, 30], policy="lru", shared=False,
        steps=steps, num_layers=2, kv_format="fp8_ds_mla")
    offload = dataclasses.replace(offload, host_access=access)
    dec = DecodeState.from_resident(res.kv, res.index_keys, res.lengths, config=config,
                                    offload=offload, fill=NAN)
    assert res.kv.dtype == dec.hot.dtype == dec.host.kv.dtype == jnp.uint8
    assert dec.host.kv.shape[-1] == config.kv_row_width == 52
    misses, empty = 0, 0
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (2, 2), dtype=np.int32)
        want, res = resident.decode_step(params, res, tokens, config=config)
        got, dec, stats = offload_decode.decode_step(params, dec, tokens, config=config,
                                                     offload=offload)
        chex.assert_trees_all_equal(got, want)
        check_invariants(dec, config=config, offload=offload, resident_kv=res.kv,
                         selected=stats.selected, poisoned=True, finite=True)
        misses += int(np.sum(stats.union))
        empty += int(np.sum(np.asarray(dec.slots.slot_to_token) < 0))
        assert int(stats.d2h_bytes[0]) == config.num_layers * 2 * 52
    assert misses > 0 and empty > 0  # rows were copied; empty (poisoned) slots were checked


# Scenarios several tests set up (the same shapes: the prefill and steps compile once).
ONE = dict(batch=1, ways=1, k=4, hot=8, page=4, lengths=[20], policy="ring", shared=True,
           steps=6)
TWO = dict(batch=2, ways=2, k=4, hot=8, page=4, lengths=[10, 7], policy="ring", shared=True,
           steps=1)


def test_stats_count_misses_and_bytes():
    # ONE's shapes (20 tokens of history, C = 8: the first step misses): its programs are
    # compiled once for the tests of this module that use it.
    config, offload, params, res, dec, rng = _setup(**ONE)
    tokens = np.array([[3]], np.int32)
    _, dec, stats = offload_decode.decode_step(params, dec, tokens, config=config,
                                               offload=offload)
    row = config.kv_width * config.jnp_kv_dtype.itemsize
    layers = np.array([hi - lo for lo, hi in config.group_bounds])
    union = np.asarray(stats.union)[:, 0]
    assert union.min() > 0  # every group copied rows
    assert int(stats.h2d_bytes[0]) == int((union * layers).sum() * row)
    assert int(stats.d2h_bytes[0]) == config.num_layers * row
    assert stats.selected.shape == (config.num_groups, 1, 1, config.index_topk)


@pytest.mark.parametrize("policy", ["lru", "clock"])
def test_device_bytes_match_the_formula(policy):
    config = TINY
    offload = OffloadConfig(hot_slots=64, page_size=8, capacity=256, policy=policy)
    state = DecodeState.create(config, offload, batch=3)
    formula = device_bytes_formula(config, offload, batch=3)
    assert state.device_bytes() == formula["total"]
    assert formula["kv"] == config.num_layers * 3 * (64 + 16) * config.kv_width * 2
    res = resident.ResidentState.create(config, batch=3, capacity=256)
    # With C + 2Z < S the offloaded device state is smaller than the resident one.
    assert state.device_bytes() < res.device_bytes()
    assert state.host.kv.sharding.memory_kind == "pinned_host"


def test_one_trace_across_steps():
    config, offload, params, res, dec, rng = _setup(**ONE)
    # The step's own pure function, counted: a second trace raises.
    counted = chex.assert_max_traces(offload_decode.decode_jit.__wrapped__, n=1)
    step = jax.jit(counted, static_argnames=("config", "offload"), donate_argnames=("state",))
    for _ in range(6):  # crosses a tail-block boundary (page 4) and keeps one trace
        tokens = jnp.asarray(rng.integers(0, 256, (1, 1), dtype=np.int32))
        _, dec, _ = step(params, dec, tokens, config=config, offload=offload)
    assert int(dec.lengths[0]) == 26


def test_handed_over_state_is_placed_like_a_step_output():
    # A step's outputs are committed arrays; a state built from uncommitted ones hit another
    # entry of the jit cache, so the second step compiled the whole program again.
    config, offload, params, res, dec, rng = _setup(**ONE)
    before = [(x.committed, x.sharding) for x in jax.tree.leaves(dec)]
    _, after, _ = offload_decode.decode_step(params, dec, np.zeros((1, 1), np.int32),
                                             config=config, offload=offload)
    assert before == [(x.committed, x.sharding) for x in jax.tree.leaves(after)]


@pytest.mark.parametrize("change,message", [
    (dict(hot_slots=15, page_size=5, capacity=255), r"hot_slots=15 < index_topk \* max_ways = 16 \* 1 = 16"),
    (dict(page_size=32, hot_slots=16), r"tail block of page_size=32 tokens is larger than"),
    (dict(capacity=100), r"capacity=100 must be a multiple of page_size=16"),
    (dict(policy="fifo"), r"unknown eviction policy 'fifo'; choose one of \('ring', 'lru', "
                          r"'random', 'clock'\)"),
    (dict(capacity=2**31 - 16), r"overflow int32"),
])
def test_impossible_configs_are_rejected(change, message):
    config = TINY.replace(max_ways=1)
    base = dict(hot_slots=16, page_size=16, capacity=256)
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**{**base, **change}).validate_for(config)


def test_page_smaller_than_ways_is_rejected():
    with pytest.raises(ValueError, match=r"page_size=2 < max_ways=4"):
        OffloadConfig(hot_slots=64, page_size=2, capacity=64).validate_for(TINY)


def test_bad_inputs_raise_before_the_state_changes():
    config, offload, params, res, dec, rng = _setup(**TWO)
    before = jax.tree_util.tree_map(np.asarray, dec)
    with pytest.raises(ValueError, match=r"token id 256 at \[1, 0\] is outside the vocabulary"):
        offload_decode.decode_step(params, dec, np.array([[1, 2], [256, 3]]), config=config,
                                   offload=offload)
    with pytest.raises(ValueError, match=r"W=3 query tokens per request"):
        offload_decode.decode_step(params, dec, np.zeros((2, 3), np.int32), config=config,
                                   offload=offload)
    with pytest.raises(ValueError, match=r"tokens have batch 1 but the state holds 2"):
        offload_decode.decode_step(params, dec, np.zeros((1, 2), np.int32), config=config,
                                   offload=offload)
    # Host capacity: fill up to the last page, then one step too many is refused.
    small = OffloadConfig(hot_slots=8, page_size=4, capacity=12, policy="ring")
    full = DecodeState.from_resident(res.kv[:, :, :12], res.index_keys[:, :, :12],
                                     np.array([10, 7]), config=config, offload=small)
    with pytest.raises(ValueError, match=r"request 0 would hold 14 tokens, beyond the host pages' capacity of 12"):
        _, full, _ = offload_decode.decode_step(params, full, np.zeros((2, 2), np.int32),
                                                config=config, offload=small)
        offload_decode.decode_step(params, full, np.zeros((2, 2), np.int32), config=config,
                                   offload=small)
    chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, dec), before)


def test_a_state_stepped_with_other_settings_is_refused():
    config, offload, params, res, dec, rng = _setup(**ONE)
    other = OffloadConfig(hot_slots=12, page_size=4, capacity=offload.capacity)
    with pytest.raises(ValueError, match=r"state.hot has shape \(4, 1, 16, 40\), expected "
                                         r"\(4, 1, 20, 40\)"):
        offload_decode.decode_step(params, dec, np.zeros((1, 1), np.int32), config=config,
                                   offload=other)
    lru = OffloadConfig(hot_slots=8, page_size=4, capacity=offload.capacity, policy="lru")
    with pytest.raises(ValueError, match=r"state.policy.last_used has shape"):
        offload_decode.decode_step(params, dec, np.zeros((1, 1), np.int32), config=config,
                                   offload=lru)
    clock = OffloadConfig(hot_slots=8, page_size=4, capacity=offload.capacity, policy="clock")
    with pytest.raises(ValueError, match=r"state.policy.ref has shape \(2, 1, 0\), expected "
                                         r"\(2, 1, 8\)"):
        offload_decode.decode_step(params, dec, np.zeros((1, 1), np.int32), config=config,
                                   offload=clock)
    assert int(dec.lengths[0]) == 20  # untouched


def test_handoff_validates_its_inputs():
    config, offload, params, res, dec, rng = _setup(**TWO)
    with pytest.raises(ValueError, match=r"must be 2 counts in \[0, "):
        DecodeState.from_resident(res.kv, res.index_keys, np.array([10, -1]), config=config,
                                  offload=offload)
    with pytest.raises(ValueError, match=r"kv float32 / index_keys bfloat16 must be the "
                                         r"config's bfloat16 / bfloat16 \(kv_format='bf16', "
                                         r"kv_dtype='bfloat16'\)"):
        DecodeState.from_resident(res.kv.astype(jnp.float32), res.index_keys, res.lengths,
                                  config=config, offload=offload)
    # fp8_ds_mla: bfloat16 rows are not the uint8 rows the config stores.
    with pytest.raises(ValueError, match=r"kv bfloat16 / index_keys bfloat16 must be the "
                                         r"config's uint8 / bfloat16 \(kv_format='fp8_ds_mla'"):
        DecodeState.from_resident(jnp.zeros(res.kv.shape[:-1] + (52,), jnp.bfloat16),
                                  res.index_keys, res.lengths,
                                  config=config.replace(kv_format="fp8_ds_mla"),
                                  offload=offload)

"""Performance invariants of the compiled offloaded decode step and prefill (fo_jax.hlo_checks).

Small distinctive shapes, so that no intermediate shares a state array's shape and dtype:
B = 3, L = 2, G = 2, C = 36, Z = 4, S = 96 (P = 24), D + R = 40, N = 16, k = 8 (W K = 8 or 32);
the pools hold F = B P = 72 pages (the identity table), or F = 77 under a permuted table.
The per-request counters (lengths, step, the ring hands [G, B], the PRNG key) are O(B) and
share their shapes with the step's statistics: they are not checked.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import hlo_checks
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload import seat_prefill
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState

BATCH, HOT, PAGE, CAPACITY, K = 3, 36, 4, 96, 8
COUNTERS = ("lengths", "step", "policy.hand", "policy.key")


def _config(ways):
    return get_config("tiny").replace(index_topk=K, max_ways=ways, num_layers=2,
                                      indexer_layers=(0, 1))


@functools.cache
def _params(ways):
    config = _config(ways)
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


@functools.cache
def _compiled_decode(policy, ways, hot=HOT, capacity=CAPACITY, batch=BATCH, access="gather",
                     spare=None):
    """(compiled decode step as `decode_step` runs it, its state, config, offload); with
    `spare`, pools of B P + spare pages under a permuted page table."""
    config = _config(ways)
    offload = OffloadConfig(hot_slots=hot, page_size=PAGE, capacity=capacity, policy=policy,
                            host_access=access)
    if spare is None:
        state = DecodeState.create(config, offload, batch=batch)
    else:
        frames = batch * offload.num_pages + spare
        table = np.random.default_rng(0).permutation(frames)[:batch * offload.num_pages]
        state = DecodeState.create(config, offload, batch=batch, num_frames=frames,
                                   table=table.astype(np.int32).reshape(batch, -1))
    tokens = np.zeros((batch, ways), np.int32)
    compiled = hlo_checks.compile_call(offload_decode, "decode_jit", offload_decode.decode_step,
                                       _params(ways), state, tokens, config=config,
                                       offload=offload,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    return compiled, state, config, offload


@pytest.mark.parametrize("ways", [1, 4])
@pytest.mark.parametrize("policy", ["ring", "lru", "random", "clock"])
def test_decode_step_updates_its_state_in_place(policy, ways):
    compiled, state, _, _ = _compiled_decode(policy, ways)
    # No copy (or other full-shape write) of host pages, hot cache, indexer keys, slot maps or
    # policy state: the bug this caught was three s32[G,B,C] copies of slot_to_token per step.
    hlo_checks.assert_no_state_copies(compiled, state, ignore=COUNTERS)
    hlo_checks.assert_donation_aliased(compiled, state, ignore=COUNTERS)
    if policy == "lru":
        # LRU's top-k over the C slots is its intended O(C) term (one per group).
        assert len(hlo_checks.sorts_over(compiled, HOT)) == _config(ways).num_groups
    else:
        hlo_checks.assert_no_sort_over(compiled, HOT, what="C")


@pytest.mark.parametrize("batch,access", [(1, "gather"), (BATCH, "slices")])
def test_decode_step_in_place_at_batch_1_and_under_slices(batch, access):
    # Batch 1 (what `fo-jax generate` runs) once made the write-through scatter copy the whole
    # host pages twice per step; the "slices" host access must keep every update in place too.
    compiled, state, _, _ = _compiled_decode("ring", 1, batch=batch, access=access)
    hlo_checks.assert_no_state_copies(compiled, state, ignore=COUNTERS)
    hlo_checks.assert_donation_aliased(compiled, state, ignore=COUNTERS)
    hlo_checks.assert_no_sort_over(compiled, HOT, what="C")


@pytest.mark.parametrize("access", ["gather", "slices", "ffi"])
def test_decode_step_over_a_larger_pool_keeps_pools_and_table_in_place(access):
    # Pools [L, F=77, Z, D+R] (host) and [G, F, Z, N] (indexer keys) under a permuted table
    # [B, P] int32: the step reads and writes both pools through the table and must copy or
    # rewrite neither pool nor the table (all three are checked state leaves).
    compiled, state, config, _ = _compiled_decode("ring", 4, access=access, spare=5)
    assert state.host.kv.shape == (config.num_layers, 77, PAGE, config.kv_width)
    assert state.index_keys.shape == (config.num_groups, 77, PAGE, config.index_head_dim)
    hlo_checks.assert_no_state_copies(compiled, state, ignore=COUNTERS)
    hlo_checks.assert_donation_aliased(compiled, state, ignore=COUNTERS)
    hlo_checks.assert_no_sort_over(compiled, HOT, what="C")


def test_decode_temporaries_do_not_grow_with_c_or_s():
    ways = 4
    base, state, config, _ = _compiled_decode("ring", ways)
    more_slots, *_ = _compiled_decode("ring", ways, hot=2 * HOT)
    longer, *_ = _compiled_decode("ring", ways, capacity=2 * CAPACITY)
    hlo_checks.assert_no_sort_over(more_slots, 2 * HOT, what="C")
    # Flat in C: less than one request's [C] int32 map row of growth (a copy of one
    # [G, B, C] map adds G B (C2 - C1) 4 bytes: 864 here, 896 measured before the fix).
    assert hlo_checks.temp_bytes(more_slots) - hlo_checks.temp_bytes(base) < BATCH * HOT * 4
    # In S, only the indexer's work grows: one group's keys in float32 [B, S, N] and its
    # per-head and weighted scores [B, W, H + 1, S] float32, per added token:
    # B (N + W (H + 1)) 4 = 3 (16 + 4 * 5) 4 = 432 bytes (384 measured: keys + per-head scores).
    per_token = BATCH * (config.index_head_dim + ways * (config.index_n_heads + 1)) * 4
    grown = hlo_checks.temp_bytes(longer) - hlo_checks.temp_bytes(base)
    assert grown <= per_token * CAPACITY, (grown, per_token * CAPACITY)


@pytest.mark.skipif(jax.default_backend() != "tpu",
                    reason="Pallas kernels compile only on a TPU; in interpret mode (CPU) the "
                    "kernels' HLO passes the whole hot cache through the interpreter's host "
                    "callbacks and takes ~17 s to compile, which says nothing about the kernels")
@pytest.mark.parametrize("policy", ["ring", "lru"])
def test_pallas_decode_step_updates_its_state_in_place(policy):
    config = _config(4)
    offload = OffloadConfig(hot_slots=HOT, page_size=PAGE, capacity=CAPACITY, policy=policy)
    state = DecodeState.create(config, offload, batch=BATCH)
    compiled = hlo_checks.compile_call(
        offload_decode, "decode_jit", offload_decode.decode_step, _params(4), state,
        np.zeros((BATCH, 4), np.int32), config=config, offload=offload, implementation="pallas",
        compiler_options=hlo_checks.FAST_COMPILE)
    hlo_checks.assert_no_state_copies(compiled, state, ignore=COUNTERS)
    hlo_checks.assert_donation_aliased(compiled, state, ignore=COUNTERS)
    if policy == "ring":
        hlo_checks.assert_no_sort_over(compiled, HOT, what="C")


@pytest.mark.parametrize("spare", [None, 5], ids=["identity", "permuted"])
def test_prefill_updates_buffers_and_host_pages_in_place(spare):
    # L = 4 layers (a host pool bf16[4,72,4,40], or [4,77,4,40] under a permuted table) through
    # n = 3 layer buffers (bf16[3,3,96,40]), a chunk of 8 tokens after 8 of history: the
    # program `prefill` runs. Neither pool nor the table is copied.
    config = get_config("tiny").replace(index_topk=K)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    frames, table = None, None
    if spare is not None:
        pages = CAPACITY // PAGE
        frames = BATCH * pages + spare
        table = np.random.default_rng(0).permutation(frames)[:BATCH * pages]
        table = table.astype(np.int32).reshape(BATCH, pages)
    state = offload_prefill.PrefillState.create(config, batch=BATCH, capacity=CAPACITY,
                                                page_size=PAGE, num_frames=frames, table=table)
    state = dataclasses.replace(state, lengths=jnp.full((BATCH,), 8, jnp.int32))
    compiled = hlo_checks.compile_call(offload_prefill, "prefill_jit", offload_prefill.prefill,
                                       params, state, np.zeros((BATCH, 8), np.int32),
                                       config=config, num_buffers=3,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    buffers = jax.ShapeDtypeStruct((3, BATCH, CAPACITY, config.kv_width), config.jnp_kv_dtype)
    checked = {"state": state, "buffers": buffers}
    # The buffers are made by the program: their one initialization is allowed, no copy.
    hlo_checks.assert_no_state_copies(compiled, checked, ignore=("state.lengths",),
                                      created=("buffers",))
    hlo_checks.assert_donation_aliased(compiled, state, ignore=("lengths",))


def test_prefill_seat_updates_the_pools_and_the_resident_cache_in_place():
    # One seat's chunk (`prefill_seat`, the engine's prefill): offloaded, the shared pools
    # (a permuted table over a larger pool) and the table are neither copied nor rewritten,
    # only the seat's layer buffers [3, 1, S, D+R] are made; resident, the whole cache
    # [L, B, S, D+R] and indexer keys are updated in place (the seat's rows sliced out and
    # written back). Both donate the state.
    from fo_jax import resident

    config = get_config("tiny").replace(index_topk=K)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    pages = CAPACITY // PAGE
    frames = BATCH * pages + 5
    table = np.random.default_rng(0).permutation(frames)[:BATCH * pages]
    state = offload_prefill.PrefillState.create(
        config, batch=BATCH, capacity=CAPACITY, page_size=PAGE, num_frames=frames,
        table=table.astype(np.int32).reshape(BATCH, pages))
    state = dataclasses.replace(state, lengths=jnp.full((BATCH,), 8, jnp.int32))
    compiled = hlo_checks.compile_call(seat_prefill, "_seat_jit", seat_prefill.prefill_seat,
                                       params, state, 1, np.zeros((1, 8), np.int32),
                                       config=config, num_buffers=3,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    buffers = jax.ShapeDtypeStruct((3, 1, CAPACITY, config.kv_width), config.jnp_kv_dtype)
    hlo_checks.assert_no_state_copies(compiled, {"state": state, "buffers": buffers},
                                      ignore=("state.lengths",), created=("buffers",))
    hlo_checks.assert_donation_aliased(compiled, state, ignore=("lengths",))
    rs = resident.ResidentState.create(config, batch=BATCH, capacity=CAPACITY)
    compiled = hlo_checks.compile_call(resident, "_seat_jit", resident.prefill_seat, params, rs,
                                       1, np.zeros((1, 8), np.int32), config=config,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    hlo_checks.assert_no_state_copies(compiled, rs, ignore=("lengths",))
    hlo_checks.assert_donation_aliased(compiled, rs, ignore=("lengths",))


def test_prefill_seats_updates_the_pools_and_the_resident_cache_in_place():
    # A pack of two seats' chunks (`prefill_seats`): as one seat's, the shared pools and the
    # table are neither copied nor rewritten, only the pack's layer buffers [3, 2, S, D+R] are
    # made; resident, the cache and indexer keys are updated in place (the seats' rows
    # gathered and scattered back). Both donate the state.
    from fo_jax import resident

    config = get_config("tiny").replace(index_topk=K)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    state = offload_prefill.PrefillState.create(config, batch=BATCH, capacity=CAPACITY,
                                                page_size=PAGE)
    state = dataclasses.replace(state, lengths=jnp.full((BATCH,), 8, jnp.int32))
    compiled = hlo_checks.compile_call(seat_prefill, "_seats_jit", seat_prefill.prefill_seats,
                                       params, state, [2, 0], np.zeros((2, 8), np.int32),
                                       config=config, num_buffers=3,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    buffers = jax.ShapeDtypeStruct((3, 2, CAPACITY, config.kv_width), config.jnp_kv_dtype)
    hlo_checks.assert_no_state_copies(compiled, {"state": state, "buffers": buffers},
                                      ignore=("state.lengths",), created=("buffers",))
    hlo_checks.assert_donation_aliased(compiled, state, ignore=("lengths",))
    rs = resident.ResidentState.create(config, batch=BATCH, capacity=CAPACITY)
    compiled = hlo_checks.compile_call(resident, "_seats_jit", resident.prefill_seats, params,
                                       rs, [2, 0], np.zeros((2, 8), np.int32), config=config,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    hlo_checks.assert_no_state_copies(compiled, rs, ignore=("lengths",))
    hlo_checks.assert_donation_aliased(compiled, rs, ignore=("lengths",))

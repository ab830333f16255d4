"""Pools and page tables of the offloaded state (fo_jax/offload/state.py).

Host KV [L, F, Z, D+R] and indexer keys [G, F, Z, N] are pools of F pages shared by the batch,
addressed by one page table [B, P]. A random permutation table over a larger pool (spare pages,
the requests' pages interleaved) must give bitwise the logits, host rows and indexer keys per
token of the identity table (and of the resident path); changing a table's contents never
recompiles; bad tables are refused before anything runs. The prefill's twin tests are in
tests/offload/test_prefill.py (`test_permuted_page_table_over_a_larger_pool`, the handoff).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.offload import decode as offload_decode
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload.prefill import PrefillState, prefill
from fo_jax.offload.state import DecodeState, assign_pages, identity_table, read_back

NAN = float("nan")
BATCH, PAGE, HOT, SPARE = 2, 4, 16, 5
LENGTHS = [30, 21]
STEPS = 3


def _config(ways):
    return get_config("tiny").replace(num_layers=2, indexer_layers=(0,), index_topk=4,
                                      max_ways=ways)


def _permuted(batch, pages, frames, seed=0):
    """[B, P] int32: the pages of all requests at random places of a pool of `frames` pages
    (so pages of different requests interleave, and frames - B P pages stay spare)."""
    ids = np.random.default_rng(seed).permutation(frames)[:batch * pages]
    return ids.astype(np.int32).reshape(batch, pages)


@pytest.mark.parametrize("ways", [1, 4])
@pytest.mark.parametrize("policy", ["ring", "lru", "random", "clock"])
def test_a_permuted_table_over_a_larger_pool_decodes_bitwise(policy, ways):
    config = _config(ways)
    capacity = -(-(max(LENGTHS) + STEPS * ways) // PAGE) * PAGE
    offload = OffloadConfig(hot_slots=HOT, page_size=PAGE, capacity=capacity, policy=policy)
    frames = BATCH * offload.num_pages + SPARE
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(1)
    res = resident.ResidentState.create(config, batch=BATCH, capacity=capacity, fill=NAN)
    prompt = rng.integers(0, config.vocab_size, (BATCH, max(LENGTHS)), dtype=np.int32)
    _, res = resident.prefill(params, res, prompt, np.asarray(LENGTHS), config=config)
    build = lambda table: DecodeState.from_resident(  # noqa: E731
        res.kv, res.index_keys, res.lengths, config=config, offload=offload, fill=NAN,
        num_frames=frames, table=table)
    # The identity table over the same pool size: the same shapes, hence the same program.
    ident, perm = build(None), build(_permuted(BATCH, offload.num_pages, frames))
    misses = 0
    for _ in range(STEPS):
        tokens = rng.integers(0, config.vocab_size, (BATCH, ways), dtype=np.int32)
        want, res = resident.decode_step(params, res, tokens, config=config)
        got_i, ident, _ = offload_decode.decode_step(params, ident, tokens, config=config,
                                                     offload=offload)
        got_p, perm, stats = offload_decode.decode_step(params, perm, tokens, config=config,
                                                        offload=offload)
        chex.assert_trees_all_equal(np.asarray(got_p), np.asarray(got_i))
        chex.assert_trees_all_equal(np.asarray(got_p), np.asarray(want))
        misses += int(np.sum(stats.union))
    assert misses > 0  # rows did come from the host pool, through the table
    # The same host rows and indexer keys per token, read through each table.
    chex.assert_trees_all_equal(perm.token_rows(), ident.token_rows())
    chex.assert_trees_all_equal(perm.token_index_keys(), ident.token_index_keys())
    chex.assert_trees_all_equal(perm.token_rows(), np.asarray(res.kv))
    # The spare pages were never written (they still hold the fill).
    spare = np.setdiff1d(np.arange(frames), np.asarray(perm.table))
    assert np.isnan(read_back(perm.host.kv)[:, spare].astype(np.float32)).all()
    assert np.isnan(np.asarray(perm.index_keys[:, spare]).astype(np.float32)).all()
    check_invariants(perm, config=config, offload=offload, resident_kv=res.kv,
                     selected=stats.selected, poisoned=True)


def test_changing_the_table_never_recompiles():
    # A serving loop's pattern: a pool of F pages, seats given pages by `assign_pages`, a seat
    # re-assigned (a new request joining) between steps: one trace of the step throughout.
    config = _config(1)
    offload = OffloadConfig(hot_slots=HOT, page_size=PAGE, capacity=16)
    frames = 11  # pages: 2 seats x 4, and 3 spare
    params = init_params(config, jax.random.key(0))
    empty = np.full((BATCH, offload.num_pages), -1, np.int32)
    state = DecodeState.create(config, offload, batch=BATCH, num_frames=frames, table=empty)
    counted = chex.assert_max_traces(offload_decode.decode_jit.__wrapped__, n=1)
    step = jax.jit(counted, static_argnames=("config", "offload"), donate_argnames=("state",))
    assign = jax.jit(assign_pages, donate_argnums=0)
    state = assign(state, 0, jnp.asarray([7, 2, 9, 0], jnp.int32))
    state = assign(state, 1, jnp.asarray([4, 10, 1, 6], jnp.int32))
    tokens = jnp.ones((BATCH, 1), jnp.int32)
    for _ in range(3):
        _, state, _ = step(params, state, tokens, config=config, offload=offload)
    # Seat 1 leaves; a new request takes pages 3, 5, 8 (the spares) and page 1 of the old one.
    state = assign(state, 1, jnp.asarray([3, 5, 8, 1], jnp.int32))
    state = dataclasses.replace(state, lengths=state.lengths.at[1].set(0))
    for _ in range(2):
        _, state, _ = step(params, state, tokens, config=config, offload=offload)
    np.testing.assert_array_equal(np.asarray(state.table), [[7, 2, 9, 0], [3, 5, 8, 1]])
    np.testing.assert_array_equal(np.asarray(state.lengths), [5, 2])
    assert state.host.kv.shape == (config.num_layers, frames, PAGE, config.kv_width)


def test_writes_to_pages_not_held_are_dropped():
    # A seat without pages (table row -1) takes tokens: nothing lands anywhere in the pools.
    config = _config(1)
    offload = OffloadConfig(hot_slots=HOT, page_size=PAGE, capacity=16)
    table = np.array([[0, 1, 2, 3], [-1, -1, -1, -1]], np.int32)
    state = DecodeState.create(config, offload, batch=BATCH, num_frames=6, table=table,
                               fill=NAN)
    params = init_params(config, jax.random.key(0))
    _, state, _ = offload_decode.decode_step(params, state, jnp.ones((BATCH, 1), jnp.int32),
                                             config=config, offload=offload, check=False)
    kv = read_back(state.host.kv).astype(np.float32)
    keys = np.asarray(state.index_keys).astype(np.float32)
    assert np.isfinite(kv[:, 0, 0]).all() and np.isfinite(keys[:, 0, 0]).all()  # seat 0
    kv[:, 0, 0], keys[:, 0, 0] = NAN, NAN
    assert np.isnan(kv).all() and np.isnan(keys).all()  # nothing else was written


# Bad tables ----------------------------------------------------------------------------------


@pytest.mark.parametrize("table,frames,message", [
    (np.zeros((2, 3), np.int32), 8,
     r"page table has shape \(2, 3\), expected \[B, P\] = \(2, 4\) \(P = capacity / page_size"),
    (identity_table(2, 4).astype(np.int64), 8,
     r"page table has dtype int64, expected int32"),
    (np.array([[0, 1, 2, 3], [4, 5, 9, 7]], np.int32), 9,
     r"page table entry \[1, 2\] = 9 is outside \[-1, 9\): ids name pages of a pool of F=9"),
    (np.array([[0, 1, 2, 3], [3, 5, 6, -1]], np.int32), 8,
     r"pool page 3 is named by page table entries \[\[0, 3\], \[1, 0\]\]: writes would "
     r"collide"),
    (None, 7, r"the identity page table needs num_frames >= B P = 8, got 7: pass a table"),
], ids=["shape", "dtype", "id_past_pool", "shared_page", "pool_too_small"])
def test_bad_tables_are_refused(table, frames, message):
    config = _config(1)
    offload = OffloadConfig(hot_slots=HOT, page_size=PAGE, capacity=16)
    with pytest.raises(ValueError, match=message):
        DecodeState.create(config, offload, batch=BATCH, num_frames=frames, table=table)
    with pytest.raises(ValueError, match=message):
        PrefillState.create(config, batch=BATCH, capacity=16, page_size=PAGE,
                            num_frames=frames, table=table)


def test_a_table_broken_after_construction_is_refused_before_the_step_runs():
    config = _config(1)
    offload = OffloadConfig(hot_slots=HOT, page_size=PAGE, capacity=16)
    params = init_params(config, jax.random.key(0))
    state = DecodeState.create(config, offload, batch=BATCH, num_frames=9)
    shared = assign_pages(state, 1, jnp.asarray([8, 0, -1, -1], jnp.int32))  # page 0 twice
    with pytest.raises(ValueError, match=r"pool page 0 is named by page table entries "
                                         r"\[\[0, 0\], \[1, 1\]\]"):
        offload_decode.decode_step(params, shared, jnp.ones((BATCH, 1), jnp.int32),
                                   config=config, offload=offload)
    # The next token of seat 1 (position 0) would land in a page it does not hold.
    unheld = assign_pages(state, 1, jnp.asarray([-1, 8, -1, -1], jnp.int32))
    with pytest.raises(ValueError, match=r"request 1 holds \(or is about to hold\) 1 tokens "
                                         r"but page 0 of its page table is -1 \(not held\)"):
        offload_decode.decode_step(params, unheld, jnp.ones((BATCH, 1), jnp.int32),
                                   config=config, offload=offload)
    with pytest.raises(ValueError, match=r"pages has shape \(3,\), expected \(4,\)"):
        assign_pages(state, 0, jnp.asarray([1, 2, 3], jnp.int32))
    prefill_state = PrefillState.create(config, batch=BATCH, capacity=16, page_size=PAGE,
                                        num_frames=9)
    broken = assign_pages(prefill_state, 0, jnp.asarray([1, 2, 3, 4], jnp.int32))
    with pytest.raises(ValueError, match=r"pool page 4 is named by page table entries "
                                         r"\[\[0, 3\], \[1, 0\]\]"):
        prefill(params, broken, jnp.ones((BATCH, 4), jnp.int32), config=config, num_buffers=2)
    for s in (state, shared, unheld, broken):
        assert not s.host.kv.is_deleted()  # refused before anything ran or was donated


def test_a_full_prefix_page_may_be_shared_a_page_being_written_may_not():
    """Two requests may name the same pool page where both hold it full (a shared prefix:
    steps write at positions >= length only); a shared page one of them still writes into is
    refused, by the checked step and by the invariants."""
    from fo_jax.offload.invariants import check_invariants
    from fo_jax.offload.state import check_table

    table = np.asarray([[0, 1, -1, -1], [0, 2, -1, -1]], np.int32)  # page 0 shared
    check_table(table, batch=2, num_pages=4, num_frames=3, lengths=[5, 4], page_size=PAGE)
    with pytest.raises(ValueError, match=r"pool page 0 is named by page table entries "
                                         r"\[\[0, 0\], \[1, 0\]\]: writes would collide"):
        check_table(table, batch=2, num_pages=4, num_frames=3, lengths=[5, 3], page_size=PAGE)
    with pytest.raises(ValueError, match="pool page 0 is named"):
        check_table(table, batch=2, num_pages=4, num_frames=3)  # no lengths: strict
    # A decode state whose two requests share their first (full) page steps and checks out.
    config = _config(1)
    offload = OffloadConfig(hot_slots=HOT, page_size=PAGE, capacity=16)
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((config.num_layers, 1, PAGE, config.kv_width)),
                     config.jnp_kv_dtype)
    kv = jnp.concatenate([kv, kv], axis=1)  # the same first page in both requests
    keys = jnp.asarray(rng.standard_normal((config.num_groups, 1, PAGE, config.index_head_dim)),
                       config.jnp_kv_dtype)
    keys = jnp.concatenate([keys, keys], axis=1)
    state = DecodeState.from_resident(kv, keys, [PAGE, PAGE], config=config, offload=offload,
                                      num_frames=5, table=np.asarray([[0, 1, -1, -1],
                                                                      [2, 3, -1, -1]], np.int32))
    state = assign_pages(state, 1, jnp.asarray([0, 3, -1, -1], jnp.int32))  # share page 0
    logits, state, _ = offload_decode.decode_step(params, state, jnp.ones((2, 1), jnp.int32),
                                                  config=config, offload=offload)
    check_invariants(state, config=config, offload=offload)
    np.testing.assert_array_equal(np.asarray(logits[0]), np.asarray(logits[1]))

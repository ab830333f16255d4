"""Offloaded prefill (fo_jax/offload/prefill.py): bit for bit the resident prefill, schedules,
what moves between memories, device memory, and the handoff to the offloaded decode step.

Every comparison with the resident path is exact (`chex.assert_trees_all_equal`), on states
poisoned with NaN (unwritten rows) and buffers poisoned with NaN past the loaded history.
Logits are compared on real tokens only (padding logits are unspecified).
"""

from __future__ import annotations

import dataclasses
import functools
import re

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
from fo_jax.offload.prefill import (
    PrefillSchedule,
    PrefillState,
    history_pages_for,
    layer_bytes,
    lower_prefill,
    prefill,
    to_decode_state,
)
from fo_jax.offload.seat_prefill import prefill_seat, prefill_seats
from fo_jax.offload.state import DecodeState, HostPages, to_memory_kind, tokens_to_pool

NAN = float("nan")
TINY = get_config("tiny")
# Six layers in two groups of 3: every buffer count of the grid (3, 4, 6) fits; two groups (a
# group boundary) compile faster than three (groups are unrolled, layers of a group are a loop).
CONFIG = TINY.replace(num_layers=6, indexer_layers=(0, 3), index_topk=8)
# (distance, num_buffers) pairs of the grid {1, 2, 3} x {3, 4, 6} that are valid: d <= n - 2.
VALID = [(1, 3), (1, 4), (2, 4), (1, 6), (2, 6), (3, 6)]


@functools.cache
def _base_params():
    # Twelve layers and three indexers: every config below takes a prefix of them (one init).
    return init_params(TINY.replace(num_layers=12, indexer_layers=(0, 4, 8)), jax.random.key(0))


def _params_for(config):
    """Parameters of `config` (a tiny variant of <= 12 layers, <= 3 groups), without init
    cost."""
    base = _base_params()
    return {**base,
            "layers": jax.tree.map(lambda a: a[:config.num_layers], base["layers"]),
            "indexer": jax.tree.map(lambda a: a[:config.num_groups], base["indexer"])}


@pytest.fixture(scope="module")
def params():
    return _params_for(CONFIG)


def _tokens(rng, shape, config=CONFIG):
    return rng.integers(0, config.vocab_size, shape, dtype=np.int32)


def _run_both(params, config, chunks, *, batch, capacity, page_size, dense, runs, start=0,
              query_block=256):
    """Resident prefill over `chunks` [(tokens, num_new)], then offloaded prefill per run kwargs.

    The offloaded runs start from the resident state after the first `start` chunks (its KV
    copied into host pages), so a test can reach a history without compiling the chunks that
    built it. Asserts, after every offloaded chunk, logits of real tokens, host pages vs the
    resident KV, indexer keys and lengths bit for bit equal.
    """
    rs = resident.ResidentState.create(config, batch=batch, capacity=capacity, fill=NAN)
    expected = []
    for tokens, num_new in chunks:
        expected.append(jax.device_get(rs))  # the state before the chunk (host copy)
        logits, rs = resident.prefill(params, rs, tokens, num_new, config=config, dense=dense,
                                      query_block=query_block)
        expected[-1] = (expected[-1], np.asarray(logits), jax.device_get(rs))
    for kwargs in runs:
        kwargs = dict(kwargs)
        table, frames = _pool_table(kwargs.pop("pool", "identity"), batch, capacity // page_size)
        before = expected[start][0]
        ps = _prefill_state_from(before, config, table, frames, page_size)
        for (tokens, num_new), (_, want_logits, want) in zip(chunks[start:], expected[start:]):
            logits, ps = prefill(params, ps, tokens, num_new, config=config, dense=dense,
                                 poison=True, query_block=query_block, **kwargs)
            assert ps.host.kv.sharding.memory_kind == "pinned_host"
            logits = np.asarray(logits)
            for b, n in enumerate(num_new):
                chex.assert_trees_all_equal(logits[b, :n], want_logits[b, :n])
            # Every request's host rows and indexer keys, read through the page table.
            chex.assert_trees_all_equal(ps.token_rows(), want.kv)
            chex.assert_trees_all_equal(ps.token_index_keys(), want.index_keys)
            chex.assert_trees_all_equal(np.asarray(ps.lengths), want.lengths)
            if table is None:  # the identity table: the pool is the resident KV, reshaped
                chex.assert_trees_all_equal(np.asarray(ps.host.kv).reshape(
                    want.kv.shape[0], -1, want.kv.shape[-1]),
                    want.kv.reshape(want.kv.shape[0], -1, want.kv.shape[-1]))


def _pool_table(kind, batch, pages):
    """(table or None, F): the identity table (None: the default), or the requests' pages
    interleaved at random over a pool with 5 spare pages."""
    if kind == "identity":
        return None, None
    frames = batch * pages + 5
    table = np.random.default_rng(11).permutation(frames)[:batch * pages]
    return table.astype(np.int32).reshape(batch, pages), frames


def _prefill_state_from(before, config, table, frames, page_size):
    """A PrefillState holding the resident state `before` in pools laid out by `table`."""
    batch, capacity = before.kv.shape[1:3]
    empty = PrefillState.create(config, batch=batch, capacity=capacity, page_size=page_size,
                                fill=NAN, num_frames=frames, table=table)
    pool = tokens_to_pool(jnp.asarray(before.kv), empty.table, empty.num_frames, NAN)
    keys = tokens_to_pool(jnp.asarray(before.index_keys), empty.table, empty.num_frames, NAN)
    return dataclasses.replace(empty, host=HostPages(kv=to_memory_kind(pool, "pinned_host")),
                               index_keys=keys, lengths=jnp.asarray(before.lengths))


# Bit for bit --------------------------------------------------------------------------------


def test_every_valid_distance_and_buffer_count(params):
    # A new batch (nothing to load), then a chunk on top of ragged histories (11 and 6 tokens:
    # a partial page is loaded whole) with ragged num_new.
    rng = np.random.default_rng(0)
    chunks = [(_tokens(rng, (2, 11)), [11, 6]), (_tokens(rng, (2, 9)), [9, 4])]
    runs = [dict(distance=d, num_buffers=n) for d, n in VALID]
    # The first chunk (a new batch: nothing loaded) runs offloaded for one pair only.
    _run_both(params, CONFIG, chunks, batch=2, capacity=32, page_size=4, dense=False,
              runs=runs[:1])
    _run_both(params, CONFIG, chunks, batch=2, capacity=32, page_size=4, dense=False,
              runs=runs[1:], start=1)


def test_dense_mode(params):
    rng = np.random.default_rng(1)
    chunks = [(_tokens(rng, (1, 13)), [13]), (_tokens(rng, (1, 6)), [5])]
    _run_both(params, CONFIG, chunks, batch=1, capacity=32, page_size=8, dense=True,
              runs=[dict(distance=2, num_buffers=4)])


@pytest.mark.parametrize("dense", [False, True])
def test_query_blocks(params, dense):
    # Blocks of 4 queries (chunks of 11 and 9: the last block overlaps) in both paths, keys in
    # blocks of 4 too: still bit for bit.
    rng = np.random.default_rng(4)
    chunks = [(_tokens(rng, (2, 11)), [11, 7]), (_tokens(rng, (2, 9)), [9, 5])]
    _run_both(params, CONFIG, chunks, batch=2, capacity=32, page_size=4, dense=dense,
              runs=[dict(distance=1, num_buffers=3)], query_block=4)


def test_explicit_map_out_of_order(params):
    # 4 buffers; layer 0 loads 1 and 3, layer 1 loads 2, layer 2 loads 4, layer 3 loads 5:
    # layer 4 reuses buffer 1 (layer 1 done), layer 5 buffer 2 (layer 2 done at layer 3).
    rng = np.random.default_rng(2)
    chunks = [(_tokens(rng, (1, 7)), [7]), (_tokens(rng, (1, 5)), [5])]
    onload = {0: (1, 3), 1: 2, 2: 4, 3: 5}
    _run_both(params, CONFIG, chunks, batch=1, capacity=16, page_size=4, dense=False,
              runs=[dict(onload_layer_map=onload, num_buffers=4)])


@st.composite
def _cases(draw):
    num_layers = draw(st.sampled_from([6, 7]))
    extra = draw(st.lists(st.integers(1, num_layers - 1), max_size=2, unique=True))
    config = TINY.replace(num_layers=num_layers, indexer_layers=tuple(sorted({0, *extra})),
                          index_topk=draw(st.sampled_from([4, 8, 16])))
    batch = draw(st.integers(1, 2))
    page_size = draw(st.sampled_from([4, 8]))
    capacity = 48
    # Two chunks (the second loads history); request 0 always has new tokens, others may not.
    # One width for both: the resident prefill compiles once per example (the offloaded one
    # twice: without and with history); the histories stay ragged through num_new.
    chunks, width = [], draw(st.integers(2, 13))
    for _ in range(2):
        num_new = [draw(st.integers(1, width))] + draw(
            st.lists(st.integers(0, width), min_size=batch - 1, max_size=batch - 1))
        chunks.append((width, num_new))
    distance, num_buffers = draw(st.sampled_from(VALID))
    dense = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return config, batch, page_size, capacity, chunks, distance, num_buffers, dense, seed


@settings(max_examples=4)
@given(_cases())
def test_random_configs_and_chunkings(case):
    config, batch, page_size, capacity, widths, distance, num_buffers, dense, seed = case
    rng = np.random.default_rng(seed)
    params = _params_for(config)
    chunks = [(_tokens(rng, (batch, width), config), num_new) for width, num_new in widths]
    _run_both(params, config, chunks, batch=batch, capacity=capacity, page_size=page_size,
              dense=dense, runs=[dict(distance=distance, num_buffers=num_buffers)])


# What moves between memories -------------------------------------------------------------------


def _moves(jaxpr, out):
    """(destination, shape) of every device_put in a jaxpr, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            out += [(str(eqn.params["devices"][0]).split(".")[-1], v.aval.shape)
                    for v in eqn.invars]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _moves(sub.jaxpr, out)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _moves(sub, out)
    return out


def test_loads_only_pages_before_the_chunk(params):
    # lengths [10, 3] with pages of 4: ceil(10 / 4) = 3 pages of both requests per load; a new
    # batch loads nothing. Write-backs move the chunk's B x T rows and their indices, only them.
    assert history_pages_for(np.array([10, 3]), 4, 8) == 3
    assert history_pages_for(np.array([0, 0]), 4, 8) == 0
    assert history_pages_for(np.array([32, 1]), 4, 8) == 8
    state = PrefillState.create(CONFIG, batch=2, capacity=32, page_size=4)
    tokens = jnp.zeros((2, 5), jnp.int32)

    def moves(history_pages):
        def run(p, s):
            return prefill(p, s, tokens, config=CONFIG, history_pages=history_pages,
                           check=False)
        return _moves(jax.make_jaxpr(run)(params, state).jaxpr, [])

    width = CONFIG.kv_width
    new = moves(0)
    assert {shape for kind, shape in new if kind == "Device"} == set()
    assert {shape for kind, shape in new if kind == "Host"} == {(2, 5), (2, 5, width)}
    chunked = moves(3)
    # 3 pages of 4 rows per request, moved as the rows they hold
    assert {shape for kind, shape in chunked if kind == "Device"} == {(2, 3 * 4, width)}


# Schedules and errors ----------------------------------------------------------------------------


def test_schedule_tables():
    schedule = PrefillSchedule.create(6, 4, distance=2)
    assert schedule.onload_layer_map == ((1, 2), (3,), (4,), (5,), (), ())
    loads, buffers = schedule.tables()
    np.testing.assert_array_equal(loads, [[1, 2], [3, -1], [4, -1], [5, -1], [-1, -1],
                                          [-1, -1]])
    # Layer j >= 1 in buffer 1 + (j - 1) % 3.
    np.testing.assert_array_equal(buffers, [[1, 2], [3, -1], [1, -1], [2, -1], [-1, -1],
                                            [-1, -1]])
    assert PrefillSchedule.create(1, 1).onload_layer_map == ((),)


SCHEDULE_ERRORS = {
    "buffer_not_written_back": (
        dict(num_buffers=3, onload_layer_map={0: (1, 3), 1: 2, 2: 4, 3: 5}),
        r"onload_layer_map\[0\] loads layer 3: with num_buffers=3 layer 3 goes to buffer 1, "
        r"whose previous layer 1 is not yet computed and written back"),
    "needs_more_buffers": (
        dict(num_buffers=3, onload_layer_map={0: (1, 2, 3), 3: 4, 4: 5}),
        r"loads layer 3: .* buffer 1, .* the map needs 4 buffers at layer 0 .* layers "
        r"\[1, 2, 3\] loaded ahead\), more than num_buffers=3"),
    "loads_twice": (
        dict(num_buffers=4, onload_layer_map={0: (1, 2), 1: (2, 3), 2: 4, 3: 5}),
        r"loads layer 2 twice \(at layers 0 and 1\)"),
    "never_loads": (
        dict(num_buffers=4, onload_layer_map={0: 1, 1: 2, 2: 3, 3: 4}),
        r"never loads layers \[5\]"),
    "loads_layer_0": (
        dict(num_buffers=4, onload_layer_map={0: (0, 1), 1: 2, 2: 3, 3: 4, 4: 5}),
        r"loads 0: expected a layer in \[1, 6\)"),
    "distance_too_far": (
        dict(num_buffers=4, distance=3),
        r"distance=3 must be an int in \[1, 2\] with num_buffers=4"),
    "distance_and_map": (
        dict(num_buffers=4, distance=1, onload_layer_map={0: 1, 1: 2, 2: 3, 3: 4, 4: 5}),
        r"either distance or onload_layer_map"),
    "too_many_buffers": (
        dict(num_buffers=7), r"num_buffers=7 must be an int in \[2, 6\] \(num_layers=6\)"),
    "too_few_buffers": (
        dict(num_buffers=1), r"num_buffers=1 must be an int in \[2, 6\] \(num_layers=6\)"),
}


@pytest.mark.parametrize("name", list(SCHEDULE_ERRORS))
def test_invalid_schedules_raise_before_anything_runs(params, name):
    kwargs, message = SCHEDULE_ERRORS[name]
    state = PrefillState.create(CONFIG, batch=1, capacity=16, page_size=4)
    with pytest.raises(ValueError, match=message):
        prefill(params, state, jnp.zeros((1, 4), jnp.int32), config=CONFIG, **kwargs)
    assert not state.host.kv.is_deleted()  # nothing was traced, run or donated


def test_invalid_inputs(params):
    state = PrefillState.create(CONFIG, batch=1, capacity=16, page_size=4)
    with pytest.raises(ValueError, match=r"token id 256 at \[0, 1\] is outside"):
        prefill(params, state, jnp.array([[1, 256]]), config=CONFIG)
    with pytest.raises(ValueError, match=r"would hold 17 tokens, beyond the state's capacity"):
        prefill(params, state, jnp.zeros((1, 17), jnp.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"tokens have batch 2 but the state holds 1"):
        prefill(params, state, jnp.zeros((2, 3), jnp.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"capacity=18 must be a multiple of page_size=4"):
        PrefillState.create(CONFIG, batch=1, capacity=18, page_size=4)
    assert not state.host.kv.is_deleted()


# Device memory --------------------------------------------------------------------------------


def test_compiled_prefill_holds_num_buffers_layers():
    # The compiled program's own allocations (temp) against the resident program on the same
    # shapes: host pages and the resident KV are arguments (the CPU counts host-kind arguments
    # like any other), so temp(offload) - temp(resident) is the layer buffers. Both are the
    # programs `prefill` runs (state donated), not wrapped in an outer jit (which drops the
    # donation and copies the host pages).
    # 12 layers in two groups (compiles faster than more) of a 4096-token batch; 64 pages of
    # history loaded per layer.
    config = TINY.replace(num_layers=12, indexer_layers=(0, 6), max_seq_len=4096)
    params = _params_for(config)
    batch, capacity, page = 1, 4096, 16
    tokens = jnp.zeros((batch, 16), jnp.int32)
    one_layer = layer_bytes(config, batch=batch, capacity=capacity)

    rs = resident.ResidentState.create(config, batch=batch, capacity=capacity)
    res_mem = resident.lower_prefill(params, rs, tokens, config=config,
                                     check=False).compile().memory_analysis()
    assert res_mem.argument_size_in_bytes >= config.num_layers * one_layer  # the whole KV

    state = PrefillState.create(config, batch=batch, capacity=capacity, page_size=page)
    for num_buffers in (2, 4):
        mem = lower_prefill(params, state, tokens, config=config, num_buffers=num_buffers,
                            history_pages=64, check=False).compile().memory_analysis()
        extra = (mem.temp_size_in_bytes - res_mem.temp_size_in_bytes) / one_layer
        assert num_buffers <= extra <= num_buffers + 0.25, (num_buffers, extra)
        assert extra < config.num_layers / 2


def test_compiled_prefill_temporaries_flat_in_prompt_length():
    # As tests/test_resident.py: capacity S = 1024 (layer buffers of S rows, the same at both
    # T); temporaries at T = 256 and T = 1024 with blocks of 128 queries grow by no more than
    # the per-token activations (all queries at once, measured on this config: 8.8 MB at
    # T = 256, 34.3 MB at T = 1024; blocked: 2.8 MB, 3.7 MB).
    config = TINY.replace(index_topk=64, max_seq_len=1024)
    c = config
    per_token = 4 * (4 * c.dim + c.q_lora_rank
                     + c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
                     + c.num_heads * c.kv_width + c.kv_width
                     + c.index_n_heads * (c.index_head_dim + 1) + 2 * c.index_topk)
    params = _params_for(config)
    temp = {}
    for num_t in (256, 1024):
        state = PrefillState.create(config, batch=1, capacity=1024, page_size=16)
        lowered = lower_prefill(params, state, jnp.zeros((1, num_t), jnp.int32), config=config,
                                history_pages=0, query_block=128, check=False)
        temp[num_t] = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp[1024] - temp[256] <= (1024 - 256) * per_token, temp


def _copies_of(hlo: str, shape: tuple, dtype: str) -> list[str]:
    """Instructions of optimized HLO text that copy a whole array of `shape` and `dtype`."""
    result = re.escape(f"{dtype}[{','.join(map(str, shape))}]")
    pattern = re.compile(rf"^\s*(ROOT )?%\S+ = {result}\{{[^}}]*\}} (copy|copy-start)\(")
    return [line.strip()[:160] for line in hlo.splitlines() if pattern.match(line)]


@pytest.mark.parametrize("dense,query_block", [(False, 256), (True, 256), (False, 2)])
def test_compiled_prefill_updates_buffers_and_pages_in_place(params, dense, query_block):
    # Distinctive shapes: n = 4 buffers of [B=3, S=72, D+R=40], a host pool [L=6, F=27, 8, 40].
    # Loading a layer's history writes its rows into the buffer in place: no copy of the
    # [n, B, S, D+R] buffers (a lax.cond over them made two per load) or of the host pages.
    state = PrefillState.create(CONFIG, batch=3, capacity=72, page_size=8)
    tokens = jnp.zeros((3, 5), jnp.int32)
    hlo = lower_prefill(params, state, tokens, config=CONFIG, num_buffers=4, distance=2,
                        history_pages=5, dense=dense, query_block=query_block,
                        check=False).compile().as_text()
    dtype = "bf16" if CONFIG.jnp_kv_dtype == jnp.bfloat16 else "f32"
    buffers = (4, 3, 72, CONFIG.kv_width)
    host = (CONFIG.num_layers, 27, 8, CONFIG.kv_width)
    assert re.search(re.escape(f"{dtype}[{','.join(map(str, buffers))}]"), hlo)  # shapes right
    assert _copies_of(hlo, buffers, dtype) == []
    assert _copies_of(hlo, host, dtype) == []
    assert not state.host.kv.is_deleted()  # lowering donates nothing


# Handoff to the offloaded decode path ------------------------------------------------------------


def test_handoff_to_decode_state_and_decode_steps():
    config = TINY  # top-k 16, max_ways 4: 64 hot slots
    params = _params_for(config)
    offload = OffloadConfig(hot_slots=64, page_size=8, capacity=128)
    rng = np.random.default_rng(3)
    batch = 2
    # 100 and 87 tokens in two chunks: tokens before the hot window live only in host pages,
    # so decode steps miss and copy from the pages the prefill wrote. Chunks of one width: the
    # resident prefill compiles once.
    chunks = [(_tokens(rng, (batch, 50), config), [50, 50]),
              (_tokens(rng, (batch, 50), config), [50, 37])]
    rs = resident.ResidentState.create(config, batch=batch, capacity=128, fill=NAN)
    ps = PrefillState.create(config, batch=batch, capacity=128, page_size=8, fill=NAN)
    for tokens, num_new in chunks:
        _, rs = resident.prefill(params, rs, tokens, num_new, config=config)
        _, ps = prefill(params, ps, tokens, num_new, config=config, distance=2, num_buffers=4)

    handed = to_decode_state(ps, config=config, offload=offload, fill=NAN)
    want = DecodeState.from_resident(rs.kv, rs.index_keys, rs.lengths, config=config,
                                     offload=offload, fill=NAN)
    chex.assert_trees_all_equal(jax.device_get(handed), jax.device_get(want))
    assert handed.host.kv.sharding.memory_kind == "pinned_host"
    # Committed like a step's outputs (else the second step compiles the program again).
    assert all(x.committed for x in jax.tree.leaves(handed))

    misses = 0
    for step in range(3):
        tokens = _tokens(rng, (batch, 2), config)
        want_logits, rs = resident.decode_step(params, rs, tokens, config=config)
        logits, handed, stats = offload_decode.decode_step(params, handed, tokens,
                                                           config=config, offload=offload)
        chex.assert_trees_all_equal(np.asarray(logits), np.asarray(want_logits))
        misses += int(np.sum(stats.union))
    assert misses > 0  # the steps did read rows the prefill wrote to host pages


def test_permuted_page_table_over_a_larger_pool(params):
    # The requests' pages interleaved at random over a pool with spare pages: the same logits,
    # and the same rows and keys per token (read through the table) as the resident prefill,
    # chunk on chunk (the second chunk loads history), under both host accesses.
    rng = np.random.default_rng(5)
    chunks = [(_tokens(rng, (2, 11)), [11, 6]), (_tokens(rng, (2, 9)), [9, 4])]
    _run_both(params, CONFIG, chunks, batch=2, capacity=32, page_size=4, dense=False,
              runs=[dict(distance=1, num_buffers=3, pool="permuted"),
                    dict(distance=1, num_buffers=3, pool="permuted", host_access="slices")])


@pytest.mark.parametrize("kv_format,access", [("bf16", None), ("fp8_ds_mla", "ffi")])
def test_handoff_with_a_permuted_table_and_decode_steps(kv_format, access):
    # Prefill into a permuted pool, hand off, decode: logits bitwise the resident path's; the
    # handed state equals DecodeState.from_resident with the same pool size and table. In the
    # fp8_ds_mla format every pool, buffer, hot and tail row is uint8 (52 bytes here): the
    # second chunk loads history bytes, the handoff gathers them, the steps miss on them,
    # all through the FFI copies (the GPU default; the decode tests run gather and slices).
    config = TINY.replace(num_layers=2, indexer_layers=(0,), index_topk=8, max_ways=2,
                          kv_format=kv_format)
    params = _params_for(config)
    offload = OffloadConfig(hot_slots=16, page_size=8, capacity=64, host_access=access)
    rng = np.random.default_rng(6)
    table, frames = _pool_table("permuted", 2, 8)
    chunks = [(_tokens(rng, (2, 25), config), [25, 25]),  # 50 and 43 tokens, one width
              (_tokens(rng, (2, 25), config), [25, 18])]
    rs = resident.ResidentState.create(config, batch=2, capacity=64, fill=NAN)
    ps = PrefillState.create(config, batch=2, capacity=64, page_size=8, fill=NAN,
                             num_frames=frames, table=table)
    for tokens, num_new in chunks:
        _, rs = resident.prefill(params, rs, tokens, num_new, config=config)
        _, ps = prefill(params, ps, tokens, num_new, config=config, num_buffers=2,
                        poison=True, host_access=access)
    assert ps.host.kv.dtype == config.kv_row_dtype
    handed = to_decode_state(ps, config=config, offload=offload, fill=NAN)
    want = DecodeState.from_resident(rs.kv, rs.index_keys, rs.lengths, config=config,
                                     offload=offload, fill=NAN, num_frames=frames, table=table)
    chex.assert_trees_all_equal(jax.device_get(handed), jax.device_get(want))
    misses = 0
    for _ in range(3):
        tokens = _tokens(rng, (2, 2), config)
        want_logits, rs = resident.decode_step(params, rs, tokens, config=config)
        logits, handed, stats = offload_decode.decode_step(params, handed, tokens,
                                                           config=config, offload=offload)
        chex.assert_trees_all_equal(np.asarray(logits), np.asarray(want_logits))
        misses += int(np.sum(stats.union))
    assert misses > 0
    chex.assert_trees_all_equal(handed.token_rows()[:, :, :56], np.asarray(rs.kv)[:, :, :56])


def test_handoff_needs_matching_pages():
    state = PrefillState.create(TINY, batch=1, capacity=64, page_size=8)
    offload = OffloadConfig(hot_slots=64, page_size=16, capacity=64)
    with pytest.raises(ValueError, match=r"page_size=16, capacity=64 must equal the prefill "
                                         r"state's page_size=8, capacity=64"):
        to_decode_state(state, config=TINY, offload=offload)


# One seat at a time -------------------------------------------------------------------------


def test_prefill_seat_is_the_resident_seat_prefill_with_its_own_history(params):
    # Seats prefilled one at a time over a pool of interleaved pages (a permuted table: the
    # identity table is its special case, run by the tests above), each chunk loading only
    # its own request's history (a short one next to a long one): logits, host rows and
    # indexer keys bit for bit those of `resident.prefill_seat`, and every other seat's rows,
    # keys and length untouched, after every call; the buffers are poisoned past the history.
    batch, capacity, page = 3, 32, 4
    rng = np.random.default_rng(7)
    toks = _tokens(rng, (batch, 24))
    plan = [(0, 0, 8), (2, 0, 3), (0, 8, 8), (1, 0, 5), (0, 16, 8), (2, 3, 2), (1, 5, 8)]
    table, frames = _pool_table("permuted", batch, capacity // page)
    ps = PrefillState.create(CONFIG, batch=batch, capacity=capacity, page_size=page, fill=NAN,
                             num_frames=frames, table=table)
    rs = resident.ResidentState.create(CONFIG, batch=batch, capacity=capacity, fill=NAN)
    for b, lo, n in plan:
        chunk = np.zeros((1, 8), np.int32)
        chunk[0, :n] = toks[b, lo:lo + n]
        own = -(-lo // page)  # the pages of this request's history, whatever the others hold
        before = (ps.token_rows(), ps.token_index_keys(), np.asarray(ps.lengths))
        logits, ps = prefill_seat(params, ps, b, chunk, [n], config=CONFIG, num_buffers=3,
                                  history_pages=own, poison=True)
        want, rs = resident.prefill_seat(params, rs, b, chunk, [n], config=CONFIG)
        chex.assert_trees_all_equal(np.asarray(logits)[:, :n], np.asarray(want)[:, :n])
        rows, keys, lengths = ps.token_rows(), ps.token_index_keys(), np.asarray(ps.lengths)
        chex.assert_trees_all_equal(rows, np.asarray(rs.kv))
        chex.assert_trees_all_equal(keys, np.asarray(rs.index_keys))
        chex.assert_trees_all_equal(lengths, np.asarray(rs.lengths))
        others = np.arange(batch) != b
        chex.assert_trees_all_equal(rows[:, others], before[0][:, others])
        chex.assert_trees_all_equal(keys[:, others], before[1][:, others])
        chex.assert_trees_all_equal(lengths[others], before[2][others])
    np.testing.assert_array_equal(ps.lengths, [24, 13, 5])


def test_prefill_seat_equals_the_batched_prefill_on_its_row(params):
    # One request's chunk alone equals its row of the batched program (same history, here the
    # longest: the batch loads the same pages) on this model, bit for bit.
    rng = np.random.default_rng(8)
    first, second = _tokens(rng, (2, 8)), _tokens(rng, (2, 8))
    batched = PrefillState.create(CONFIG, batch=2, capacity=32, page_size=4, fill=NAN)
    _, batched = prefill(params, batched, first, config=CONFIG, num_buffers=3)
    seat = PrefillState.create(CONFIG, batch=2, capacity=32, page_size=4, fill=NAN)
    for b in (1, 0):
        _, seat = prefill_seat(params, seat, b, first[b:b + 1], config=CONFIG, num_buffers=3)
    want, batched = prefill(params, batched, second, [8, 0], config=CONFIG, num_buffers=3)
    got, seat = prefill_seat(params, seat, 0, second[:1], config=CONFIG, num_buffers=3)
    chex.assert_trees_all_equal(np.asarray(got)[0], np.asarray(want)[0])
    chex.assert_trees_all_equal(seat.token_rows(), batched.token_rows())
    chex.assert_trees_all_equal(seat.token_index_keys(), batched.token_index_keys())


def test_prefill_seat_compiles_once_for_every_seat(params, monkeypatch):
    # The seat is traced: one program per (chunk, history pages), whichever seat (a chunk
    # width no other test uses, so the first call traces).
    from fo_jax.offload import seat_prefill

    traces = []
    body = seat_prefill.prefill_forward

    def counted(*args, **kwargs):
        traces.append(1)
        return body(*args, **kwargs)

    monkeypatch.setattr(seat_prefill, "prefill_forward", counted)
    state = PrefillState.create(CONFIG, batch=3, capacity=16, page_size=4)
    tokens = jnp.zeros((1, 3), jnp.int32)
    for b in (0, 2, 1, 2):
        _, state = prefill_seat(params, state, b, tokens, config=CONFIG, num_buffers=3,
                                history_pages=2)
    assert len(traces) == 1
    np.testing.assert_array_equal(state.lengths, [3, 3, 6])


def test_bad_prefill_seat_inputs(params):
    state = PrefillState.create(CONFIG, batch=2, capacity=16, page_size=4)
    _, state = prefill_seat(params, state, 1, jnp.zeros((1, 8), jnp.int32), config=CONFIG,
                            num_buffers=3)
    with pytest.raises(ValueError, match=r"seat=2 must be an int in \[0, 2\)"):
        prefill_seat(params, state, 2, jnp.zeros((1, 4), jnp.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"tokens have batch 2 but the state holds 1"):
        prefill_seat(params, state, 0, jnp.zeros((2, 4), jnp.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"history_pages=1 does not cover the longest history "
                                         r"\(8 tokens\)"):
        prefill_seat(params, state, 1, jnp.zeros((1, 4), jnp.int32), config=CONFIG,
                     history_pages=1)
    with pytest.raises(ValueError, match=r"would hold 20 tokens, beyond the state's capacity"):
        prefill_seat(params, state, 1, jnp.zeros((1, 12), jnp.int32), config=CONFIG)
    assert not state.host.kv.is_deleted()


# A pack of seats in one program -------------------------------------------------------------


def test_prefill_seats_rows_are_each_request_alone_with_its_own_history(params):
    # Packs over a pool of interleaved pages, with distinct histories in one pack (3, 0 and 8
    # tokens: the pack loads the longest one's pages per row, each row reads only its own
    # table row): every row's logits, hidden states, host rows, indexer keys and length equal,
    # bit for bit, the same request's offloaded `prefill_seat` run alone with its own history
    # pages, and `resident.prefill_seat`; the seats of no pack are untouched. Buffers are
    # poisoned past the history. (Row-independent matmuls: `fo_jax.offload.seat_prefill`.)
    batch, capacity, page = 4, 32, 4
    rng = np.random.default_rng(9)
    toks = _tokens(rng, (batch, 24))
    packs = [([2, 0], [8, 3], 0), ([0, 1, 2], [8, 5, 6], 2), ([1], [4], 2)]
    table, frames = _pool_table("permuted", batch, capacity // page)

    def offloaded():
        return PrefillState.create(CONFIG, batch=batch, capacity=capacity, page_size=page,
                                   fill=NAN, num_frames=frames, table=table)

    ps, alone = offloaded(), offloaded()
    rs = resident.ResidentState.create(CONFIG, batch=batch, capacity=capacity, fill=NAN)
    done = np.zeros(batch, np.int64)
    for seats, counts, pages in packs:
        chunk = np.zeros((len(seats), 8), np.int32)
        for i, (b, n) in enumerate(zip(seats, counts)):
            chunk[i, :n] = toks[b, done[b]:done[b] + n]
        before = (ps.token_rows(), ps.token_index_keys(), np.asarray(ps.lengths))
        logits, ps, hidden = prefill_seats(params, ps, seats, chunk, counts, config=CONFIG,
                                           num_buffers=3, history_pages=pages, poison=True,
                                           return_hidden=True)
        for i, (b, n) in enumerate(zip(seats, counts)):
            own = -(-int(done[b]) // page)
            want, alone, want_hidden = prefill_seat(
                params, alone, b, chunk[i:i + 1], [n], config=CONFIG, num_buffers=3,
                history_pages=own, poison=True, return_hidden=True)
            res, rs = resident.prefill_seat(params, rs, b, chunk[i:i + 1], [n], config=CONFIG)
            chex.assert_trees_all_equal(np.asarray(logits)[i, :n], np.asarray(want)[0, :n])
            chex.assert_trees_all_equal(np.asarray(logits)[i, :n], np.asarray(res)[0, :n])
            chex.assert_trees_all_equal(np.asarray(hidden)[i, :n],
                                        np.asarray(want_hidden)[0, :n])
            done[b] += n
        rows, keys, lengths = ps.token_rows(), ps.token_index_keys(), np.asarray(ps.lengths)
        chex.assert_trees_all_equal(rows, alone.token_rows())
        chex.assert_trees_all_equal(keys, alone.token_index_keys())
        chex.assert_trees_all_equal(lengths, np.asarray(alone.lengths))
        chex.assert_trees_all_equal(rows, np.asarray(rs.kv))
        chex.assert_trees_all_equal(keys, np.asarray(rs.index_keys))
        others = ~np.isin(np.arange(batch), seats)
        chex.assert_trees_all_equal(rows[:, others], before[0][:, others])
        chex.assert_trees_all_equal(keys[:, others], before[1][:, others])
        chex.assert_trees_all_equal(lengths[others], before[2][others])
    np.testing.assert_array_equal(ps.lengths, [11, 9, 14, 0])


def test_prefill_seats_padding_row_writes_nothing(params):
    # A traced seat out of range (a padding row) reads a clamped seat's table row but writes
    # nothing there: its count is 0 (every row it would write dropped) and the lengths'
    # scatter drops it; the real row is its `prefill_seat`, every other seat still NaN.
    from fo_jax.offload import seat_prefill
    from fo_jax.offload.prefill import prefill_arguments

    chunk = _tokens(np.random.default_rng(10), (2, 8))
    ps, alone = (PrefillState.create(CONFIG, batch=3, capacity=32, page_size=4, fill=NAN)
                 for _ in range(2))
    view = dataclasses.replace(ps, table=ps.table[:2], lengths=ps.lengths[:2])
    _, static = prefill_arguments(params, view, chunk, None, config=CONFIG, num_buffers=3,
                                  distance=None, onload_layer_map=None, dense=False,
                                  history_pages=0, poison=True, check=False, host_access=None,
                                  query_block=resident.QUERY_BLOCK)
    logits, ps = seat_prefill._seats_jit(params, ps, jnp.asarray([1, 3], jnp.int32),
                                         jnp.asarray(chunk), jnp.asarray([8, 8], jnp.int32),
                                         **static, return_hidden=False)
    want, alone = prefill_seat(params, alone, 1, chunk[:1], config=CONFIG, num_buffers=3,
                               history_pages=0, poison=True)
    chex.assert_trees_all_equal(np.asarray(logits)[0], np.asarray(want)[0])
    chex.assert_trees_all_equal(ps.token_rows(), alone.token_rows())
    chex.assert_trees_all_equal(ps.token_index_keys(), alone.token_index_keys())
    np.testing.assert_array_equal(ps.lengths, [0, 8, 0])
    assert np.isnan(ps.token_rows()[:, [0, 2]].astype(np.float32)).all()


def test_bad_prefill_seats_inputs(params):
    state = PrefillState.create(CONFIG, batch=3, capacity=16, page_size=4)
    _, state = prefill_seats(params, state, [1, 0], jnp.zeros((2, 8), jnp.int32), [8, 3],
                             config=CONFIG, num_buffers=3)
    with pytest.raises(ValueError, match=r"seats=\[0, 3\] holds 3: every seat must be an int "
                                         r"in \[0, 3\)"):
        prefill_seats(params, state, [0, 3], jnp.zeros((2, 4), jnp.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"seats=\[1, 1\] names a seat twice"):
        prefill_seats(params, state, [1, 1], jnp.zeros((2, 4), jnp.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"history_pages=1 does not cover the longest history "
                                         r"\(8 tokens\)"):
        prefill_seats(params, state, [0, 1], jnp.zeros((2, 4), jnp.int32), config=CONFIG,
                      history_pages=1)
    assert not state.host.kv.is_deleted()

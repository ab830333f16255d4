"""Resident reference inference: prefill, decode, chunking, the dense limit, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params

NAN = float("nan")
CONFIG = get_config("tiny")
# Different programs (shapes T vs W) may sum in a different order: compare those with a
# tolerance; same-shape programs are compared bit for bit elsewhere.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0))


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, shape, dtype=np.int32)


def _state(batch=2, capacity=96, config=CONFIG):
    return resident.ResidentState.create(config, batch=batch, capacity=capacity, fill=NAN)


def test_decode_at_last_position_equals_prefill(params):
    toks = _tokens(0, (2, 40))
    full, _ = resident.prefill(params, _state(), toks, config=CONFIG)
    _, st = resident.prefill(params, _state(), toks[:, :39], config=CONFIG)
    last, _ = resident.decode_step(params, st, toks[:, 39:], config=CONFIG)
    np.testing.assert_allclose(last[:, 0], full[:, 39], **TOL)
    # Multi-token step: W = 3 ways equal the last three prefill positions.
    _, st = resident.prefill(params, _state(), toks[:, :37], config=CONFIG)
    ways, _ = resident.decode_step(params, st, toks[:, 37:], config=CONFIG)
    np.testing.assert_allclose(ways, full[:, 37:], **TOL)


def test_chunked_prefill_equals_one_shot(params):
    toks = _tokens(1, (2, 50))
    full, st_full = resident.prefill(params, _state(), toks, config=CONFIG)
    st = _state()
    parts = []
    for lo, hi in [(0, 7), (7, 30), (30, 50)]:
        out, st = resident.prefill(params, st, toks[:, lo:hi], config=CONFIG)
        parts.append(out)
    np.testing.assert_allclose(jnp.concatenate(parts, 1), full, **TOL)
    np.testing.assert_allclose(np.asarray(st.kv[:, :, :50], np.float32),
                               np.asarray(st_full.kv[:, :, :50], np.float32), rtol=2e-2)
    np.testing.assert_array_equal(st.lengths, [50, 50])


def test_ragged_batch_matches_single_requests(params):
    toks = _tokens(2, (2, 30))
    ragged, st = resident.prefill(params, _state(), toks, np.array([30, 18]), config=CONFIG)
    np.testing.assert_array_equal(st.lengths, [30, 18])
    alone, _ = resident.prefill(params, _state(batch=1), toks[1:, :18], config=CONFIG)
    np.testing.assert_allclose(ragged[1, :18], alone[0], **TOL)
    assert np.isfinite(np.asarray(ragged[1, :18])).all()
    # Padding rows were never written: still NaN.
    assert np.isnan(np.asarray(st.kv[:, 1, 18:], np.float32)).all()


def test_topk_at_least_context_equals_dense(params):
    toks = _tokens(3, (2, 40))
    # A float32 KV: with the bf16 cache, a float32 difference that crosses a bf16 rounding
    # boundary in one stored row is a whole bf16 ulp (~4e-3) at one position, which says nothing
    # about the sparse/dense equivalence this test is about.
    f32 = CONFIG.replace(kv_dtype="float32")
    wide = f32.replace(index_topk=96)
    sparse, _ = resident.prefill(params, _state(config=wide), toks, config=wide)
    dense, _ = resident.prefill(params, _state(config=f32), toks, config=f32, dense=True)
    # Same set of tokens, different reduction widths (K = 96 vs S = 96 with masking): float32
    # rounding differences of ~1e-5 relative, amplified through 4 layers.
    np.testing.assert_allclose(sparse, dense, rtol=1e-4, atol=1e-4)
    # With a small top-k the model is genuinely sparse: outputs differ.
    small, _ = resident.prefill(params, _state(config=f32), toks, config=f32)
    assert not np.allclose(small[:, 20:], dense[:, 20:], rtol=1e-3)


def test_one_trace_across_decode_steps(params):
    _, st = resident.prefill(params, _state(), _tokens(4, (2, 20)), config=CONFIG)
    counted = chex.assert_max_traces(resident.forward_jit.__wrapped__, n=1)
    step = jax.jit(counted, static_argnames=("config", "dense"), donate_argnames=("state",))
    for i in range(5):
        toks = jnp.asarray(_tokens(10 + i, (2, 2)))
        _, st = step(params, st, toks, jnp.full((2,), 2, jnp.int32), config=CONFIG, dense=False)
    np.testing.assert_array_equal(st.lengths, [30, 30])


@pytest.mark.parametrize("tokens,message", [
    (np.array([[1, 256]]).repeat(2, 0), r"token id 256 at \[0, 1\] is outside the vocabulary"),
    (np.array([[-1]]).repeat(2, 0), r"token id -1 at \[0, 0\]"),
    (np.zeros((2, 5), np.int32), r"decode_step got W=5 query tokens per request, but config "
                                 r"'tiny' allows at most max_ways=4"),
    (np.zeros((3, 1), np.int32), r"tokens have batch 3 but the state holds 2 requests"),
    (np.zeros((2,), np.int32), r"tokens must be \[batch, T\], got shape \(2,\)"),
    (np.zeros((2, 1), np.float32), r"tokens must be integers, got dtype float32"),
])
def test_bad_decode_inputs_raise_before_state_changes(params, tokens, message):
    _, st = resident.prefill(params, _state(), _tokens(5, (2, 10)), config=CONFIG)
    before = jax.tree_util.tree_map(np.asarray, st)
    with pytest.raises(ValueError, match=message):
        resident.decode_step(params, st, tokens, config=CONFIG)
    chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, st), before)


def test_context_beyond_capacity_and_max_seq_len(params):
    st = _state(capacity=16)
    with pytest.raises(ValueError, match=r"request 0 would hold 17 tokens, beyond the state's "
                                         r"capacity of 16"):
        resident.prefill(params, st, _tokens(6, (2, 17)), config=CONFIG)
    np.testing.assert_array_equal(st.lengths, [0, 0])  # untouched, still usable
    with pytest.raises(ValueError, match=r"capacity=2000 must be in \[1, max_seq_len=1024\]"):
        resident.ResidentState.create(CONFIG, batch=1, capacity=2000)
    with pytest.raises(ValueError, match=r"num_new has shape \(3,\), expected \(2,\)"):
        resident.prefill(params, st, _tokens(7, (2, 4)), np.array([1, 2, 3]), config=CONFIG)


# Query blocks ---------------------------------------------------------------------------------


def test_query_blocks_match_all_queries_at_once(params):
    # Blocks of 7 and 16 queries (the last block overlaps the one before; keys in blocks of the
    # same size, S = 96 not a multiple of 7) against all queries at once, on a history and
    # ragged num_new. Every query's result depends on that query alone, but not bit for bit:
    # XLA's CPU dot kernels round differently for other batch sizes (measured: sparse_attention
    # of 7 or 16 queries vs 45 differ in the last bits; 32 agree). Resident and offloaded
    # prefill block alike and stay bitwise equal (tests/offload/test_prefill.py).
    toks = _tokens(8, (2, 45))
    got = {}
    for block in (None, 7, 16):
        st = _state()
        _, st = resident.prefill(params, st, toks[:, :13], [13, 9], config=CONFIG,
                                 query_block=block)
        logits, st = resident.prefill(params, st, toks[:, 13:], [32, 20], config=CONFIG,
                                      query_block=block)
        got[block] = (np.asarray(logits), jax.device_get(st))
    for block in (7, 16):
        for b, n in enumerate([32, 20]):
            np.testing.assert_allclose(got[block][0][b, :n], got[None][0][b, :n], **TOL)
        for name in ("kv", "index_keys"):
            np.testing.assert_allclose(np.asarray(getattr(got[block][1], name), np.float32),
                                       np.asarray(getattr(got[None][1], name), np.float32),
                                       rtol=2e-2, atol=2e-2)


def test_query_block_must_be_positive(params):
    st = _state()
    with pytest.raises(ValueError, match=r"query_block=0 must be an int >= 1 \(queries per "
                                         r"block\), or None for all queries at once"):
        resident.prefill(params, st, _tokens(9, (2, 4)), config=CONFIG, query_block=0)
    np.testing.assert_array_equal(st.lengths, [0, 0])


def activation_bytes_per_token(config) -> int:
    """Upper bound of what a prefill legitimately holds per query token (float32 everywhere):
    hidden states, projections, the absorbed query, the new KV row, the indexer's query and
    the selected token ids + mask. Nothing of size K * (D + R), I * S or S."""
    c = config
    floats = (4 * c.dim + c.q_lora_rank + c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
              + c.num_heads * c.kv_width + c.kv_width
              + c.index_n_heads * (c.index_head_dim + 1) + 2 * c.index_topk)
    return 4 * floats


def test_prefill_temporaries_flat_in_prompt_length():
    # One request, capacity S = 1024 (the KV, an argument, is the same at both T): the
    # compiled prefill's temporaries at T = 256 and T = 1024 with blocks of 128 queries grow by
    # no more than the per-token activations. All queries at once (query_block=None) hold
    # the gathered rows [T, K, D+R] and the indexer's per-head dots [T, I, S] (measured on
    # this config: temp 8.5 MB at T = 256, 33.9 MB at T = 1024; blocked: 2.5 MB, 3.3 MB).
    config = CONFIG.replace(index_topk=64)
    params = init_params(config, jax.random.key(0))
    capacity, per_token = 1024, activation_bytes_per_token(config)
    assert per_token < config.index_topk * config.kv_width * 4 / 3  # the test can tell
    temp = {}
    for num_t in (256, 1024):
        st = resident.ResidentState.create(config, batch=1, capacity=capacity)
        lowered = resident.lower_prefill(params, st, jnp.zeros((1, num_t), jnp.int32),
                                         config=config, check=False, query_block=128)
        temp[num_t] = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp[1024] - temp[256] <= (1024 - 256) * per_token, temp


def test_over_query_blocks_one_block_is_no_loop():
    # A block >= T (the decode step, W <= 4) runs fn once, with no loop in the program; smaller
    # blocks loop (the last block overlaps: 7 queries in blocks of 3 start at 0, 3, 4).
    from fo_jax.model.forward import over_query_blocks

    x = jnp.arange(2 * 7 * 3, dtype=jnp.float32).reshape(2, 7, 3)

    def fn(a, b):
        return {"sum": a + b, "first": a[..., 0]}

    for block, looped in ((7, False), (256, False), (None, False), (3, True)):
        jaxpr = str(jax.make_jaxpr(lambda a: over_query_blocks(fn, block, a, 2 * a))(x))
        assert ("while" in jaxpr or "scan" in jaxpr) == looped, block
        got = over_query_blocks(fn, block, x, 2 * x)
        np.testing.assert_array_equal(got["sum"], 3 * x)
        np.testing.assert_array_equal(got["first"], x[..., 0])


# One seat at a time ------------------------------------------------------------------------------


def test_prefill_seat_is_the_request_alone_and_leaves_the_other_seats(params):
    # Seats prefilled one at a time, in any order, over two ragged chunks: each request's
    # logits and rows equal its solo batch-1 prefill's bit for bit, and the batched program's
    # on the same row; the seats not prefilled are never written (still NaN) nor grown.
    batch, capacity = 4, 32
    toks = _tokens(20, (batch, 16))
    new = [(8, 8), (8, 3), (5, 0), (8, 8)]  # tokens per chunk of each seat
    st = _state(batch, capacity)
    ref = _state(batch, capacity)
    solo = [_state(1, capacity) for _ in range(batch)]
    for c in range(2):
        counts = np.array([n[c] for n in new])
        chunk = toks[:, 8 * c:8 * c + 8]
        ref_logits, ref = resident.prefill(params, ref, chunk, counts, config=CONFIG)
        for b in np.random.default_rng(c).permutation(batch):
            if not counts[b]:
                continue
            before = jax.device_get(st)
            logits, st = resident.prefill_seat(params, st, int(b), chunk[b:b + 1],
                                               counts[b:b + 1], config=CONFIG)
            want, solo[b] = resident.prefill(params, solo[b], chunk[b:b + 1], counts[b:b + 1],
                                             config=CONFIG)
            n = counts[b]
            chex.assert_trees_all_equal(np.asarray(logits)[:, :n], np.asarray(want)[:, :n])
            chex.assert_trees_all_equal(np.asarray(logits)[0, :n],
                                        np.asarray(ref_logits)[b, :n])
            after = jax.device_get(st)
            chex.assert_trees_all_equal(after.kv[:, b], np.asarray(solo[b].kv)[:, 0])
            chex.assert_trees_all_equal(after.index_keys[:, b],
                                        np.asarray(solo[b].index_keys)[:, 0])
            others = np.arange(batch) != b  # every other seat exactly as before
            chex.assert_trees_all_equal(after.kv[:, others], before.kv[:, others])
            chex.assert_trees_all_equal(after.index_keys[:, others],
                                        before.index_keys[:, others])
            chex.assert_trees_all_equal(after.lengths[others], before.lengths[others])
            assert after.lengths[b] == before.lengths[b] + n
    chex.assert_trees_all_equal(np.asarray(st.lengths), np.asarray(ref.lengths))
    chex.assert_trees_all_equal(np.asarray(st.kv), np.asarray(ref.kv))
    assert np.isnan(np.asarray(st.kv[:, 2, 5:], np.float32)).all()


def test_prefill_seat_compiles_once_for_every_seat(params):
    # The seat is an argument of the program, not a static: one trace serves every seat.
    st = _state(3, 32)
    counted = chex.assert_max_traces(resident._seat_jit.__wrapped__, n=1)
    step = jax.jit(counted, static_argnames=resident._STATIC, donate_argnames=("state",))
    for b in (0, 2, 1, 2):
        _, st = step(params, st, jnp.asarray(b, jnp.int32), jnp.asarray(_tokens(b, (1, 4))),
                     jnp.asarray([4], jnp.int32), config=CONFIG, dense=False, query_block=None)
    np.testing.assert_array_equal(st.lengths, [4, 4, 8])


@pytest.mark.parametrize("seat,tokens,message", [
    (3, np.zeros((1, 4), np.int32), r"seat=3 must be an int in \[0, 3\)"),
    (-1, np.zeros((1, 4), np.int32), r"seat=-1 must be an int in \[0, 3\)"),
    (1.0, np.zeros((1, 4), np.int32), r"seat=1.0 must be an int in \[0, 3\)"),
    (1, np.zeros((3, 4), np.int32), r"tokens have batch 3 but the state holds 1 requests"),
    (1, np.full((1, 4), 256), r"token id 256 at \[0, 0\] is outside the vocabulary"),
    (1, np.zeros((1, 40), np.int32), r"request 0 would hold 40 tokens, beyond the state's "
                                     r"capacity of 32"),
])
def test_bad_prefill_seat_inputs_raise_before_state_changes(params, seat, tokens, message):
    st = _state(3, 32)
    before = jax.tree_util.tree_map(np.asarray, st)
    with pytest.raises(ValueError, match=message):
        resident.prefill_seat(params, st, seat, tokens, config=CONFIG)
    chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, st), before)


# A pack of seats in one program -------------------------------------------------------------


def test_prefill_seats_rows_are_each_request_alone_and_leave_the_other_seats(params):
    # Packs of requests with distinct histories (0, 3, 5, 8 tokens before the chunk), ragged
    # counts (a row of 0 included) and in any seat order: every row's logits, hidden states,
    # KV rows, indexer keys and length equal, bit for bit, the same request's `prefill_seat`
    # run alone (on a state of its own), whose results the engine had with one program per
    # request; the seats of no pack are never written (still NaN) nor grown. The pack makes the
    # matmuls' M depend on P: this equality holds where they compute rows independently (true
    # of XLA:CPU; on an accelerator a property to check, the engine's prefill_batch=1).
    batch, capacity = 5, 32
    toks = _tokens(21, (batch, 24))
    packs = [([3, 0, 1], [8, 3, 5]),          # P = 3 over empty histories
             ([0, 4, 1, 3], [8, 8, 2, 0]),    # P = 4: histories 3, 0, 5, 8 (a row of 0)
             ([4], [6])]                      # P = 1: the `prefill_seat` case
    st = _state(batch, capacity)
    alone = _state(batch, capacity)
    done = np.zeros(batch, np.int64)
    for seats, counts in packs:
        chunk = np.zeros((len(seats), 8), np.int32)
        for i, (b, n) in enumerate(zip(seats, counts)):
            chunk[i, :n] = toks[b, done[b]:done[b] + n]
        before = jax.device_get(st)
        logits, st, hidden = resident.prefill_seats(params, st, seats, chunk, counts,
                                                    config=CONFIG, return_hidden=True)
        for i, (b, n) in enumerate(zip(seats, counts)):
            if not n:
                continue
            want, alone, want_hidden = resident.prefill_seat(
                params, alone, b, chunk[i:i + 1], [n], config=CONFIG, return_hidden=True)
            chex.assert_trees_all_equal(np.asarray(logits)[i, :n], np.asarray(want)[0, :n])
            chex.assert_trees_all_equal(np.asarray(hidden)[i, :n],
                                        np.asarray(want_hidden)[0, :n])
            done[b] += n
        after, ref = jax.device_get(st), jax.device_get(alone)
        chex.assert_trees_all_equal(after.kv, ref.kv)
        chex.assert_trees_all_equal(after.index_keys, ref.index_keys)
        chex.assert_trees_all_equal(after.lengths, ref.lengths)
        others = ~np.isin(np.arange(batch), seats)  # every seat of no pack exactly as before
        chex.assert_trees_all_equal(after.kv[:, others], before.kv[:, others])
        chex.assert_trees_all_equal(after.index_keys[:, others], before.index_keys[:, others])
        chex.assert_trees_all_equal(after.lengths[others], before.lengths[others])
    np.testing.assert_array_equal(st.lengths, [11, 7, 0, 8, 14])
    assert np.isnan(np.asarray(st.kv[:, 2], np.float32)).all()


def test_prefill_seats_padding_row_writes_nothing(params):
    # A traced seat out of range (a padding row) computes over a clamped seat's rows but writes
    # nothing: its count is 0 and every scatter drops it; the real row is its `prefill_seat`.
    st, alone = _state(3, 32), _state(3, 32)
    chunk = jnp.asarray(_tokens(22, (2, 4)))
    logits, st = resident._seats_jit(params, st, jnp.asarray([1, 3], jnp.int32), chunk,
                                     jnp.asarray([4, 4], jnp.int32), config=CONFIG,
                                     dense=False, query_block=resident.QUERY_BLOCK)
    want, alone = resident.prefill_seat(params, alone, 1, chunk[:1], config=CONFIG)
    chex.assert_trees_all_equal(np.asarray(logits)[0], np.asarray(want)[0])
    chex.assert_trees_all_equal(jax.device_get(st), jax.device_get(alone))


@pytest.mark.parametrize("seats,tokens,message", [
    ([0, 3], np.zeros((2, 4), np.int32), r"seats=\[0, 3\] holds 3: every seat must be an int "
                                         r"in \[0, 3\)"),
    ([2, 2], np.zeros((2, 4), np.int32), r"seats=\[2, 2\] names a seat twice"),
    ([], np.zeros((0, 4), np.int32), r"seats=\[\] must be a non-empty list of ints"),
    ([0.0], np.zeros((1, 4), np.int32), r"seats=\[0.0\] must be a non-empty list of ints"),
    ([0, 1], np.zeros((3, 4), np.int32), r"tokens have batch 3 but the state holds 2 requests"),
])
def test_bad_prefill_seats_inputs_raise_before_state_changes(params, seats, tokens, message):
    st = _state(3, 32)
    before = jax.tree_util.tree_map(np.asarray, st)
    with pytest.raises(ValueError, match=message):
        resident.prefill_seats(params, st, seats, tokens, config=CONFIG)
    chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, st), before)

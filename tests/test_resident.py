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
    counted = chex.assert_max_traces(resident._forward_jit.__wrapped__, n=1)
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

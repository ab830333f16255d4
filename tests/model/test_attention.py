"""Sparse attention over a set equals dense attention masked to that set; NaN never leaks."""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from fo_jax.model.attention import dense_attention, sparse_attention
from fo_jax.model.indexer import select_topk


def _inputs(seed, b=2, t=3, h=2, d=8, r=4, s=20):
    keys = jax.random.split(jax.random.key(seed), 3)
    q_lat = jax.random.normal(keys[0], (b, t, h, d))
    q_pe = jax.random.normal(keys[1], (b, t, h, r))
    cache = jax.random.normal(keys[2], (b, s, d + r)).astype(jnp.bfloat16)
    return q_lat, q_pe, cache


def test_sparse_equals_dense_masked_to_the_set():
    q_lat, q_pe, cache = _inputs(0)
    b, t, s = 2, 3, cache.shape[1]
    scores = jax.random.normal(jax.random.key(9), (b, t, s))
    visible = jnp.array([[5, 12, 20], [1, 7, 20]])
    tokens, mask = select_topk(scores, visible, 6)
    rows = cache[jnp.arange(b)[:, None, None], jnp.where(mask, tokens, 0)]
    sparse = sparse_attention(q_lat, q_pe, rows, mask, scale=0.3)
    chosen = jnp.zeros((b, t, s), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
        jnp.where(mask, tokens, s)].set(True, mode="drop")
    dense = dense_attention(q_lat, q_pe, cache, chosen, scale=0.3)
    np.testing.assert_allclose(sparse, dense, rtol=2e-5, atol=2e-6)


def test_masked_rows_never_reach_the_output():
    q_lat, q_pe, cache = _inputs(1)
    b, t = 2, 3
    rows = jnp.broadcast_to(cache[:, None, :5], (b, t, 5, cache.shape[-1]))
    mask = jnp.array([True, True, False, True, False])[None, None].repeat(b, 0).repeat(t, 1)
    poisoned = jnp.where(mask[..., None], rows, jnp.nan)
    clean = sparse_attention(q_lat, q_pe, rows, mask, scale=0.5)
    dirty = sparse_attention(q_lat, q_pe, poisoned, mask, scale=0.5)
    np.testing.assert_array_equal(clean, dirty)
    assert np.isfinite(dirty).all()


def test_query_with_no_selected_token_outputs_zero():
    q_lat, q_pe, cache = _inputs(2)
    rows = jnp.full((2, 3, 4, cache.shape[-1]), jnp.nan, jnp.bfloat16)
    out = sparse_attention(q_lat, q_pe, rows, jnp.zeros((2, 3, 4), bool), scale=1.0)
    np.testing.assert_array_equal(out, 0.0)


def test_same_rows_same_order_is_bitwise():
    q_lat, q_pe, cache = _inputs(3)
    rows = jnp.broadcast_to(cache[:, None, :7], (2, 3, 7, cache.shape[-1]))
    mask = jnp.ones((2, 3, 7), bool)
    a = jax.jit(sparse_attention, static_argnames="scale")(q_lat, q_pe, rows, mask, scale=0.2)
    b = sparse_attention(q_lat, q_pe, jnp.array(rows), mask, scale=0.2)
    np.testing.assert_array_equal(a, b)


def test_shape_annotations_are_checked_in_tests():
    # The tests' import hook makes jaxtyping check the axis letters: a mask whose K differs
    # from the rows' K is caught at the call, before any math runs.
    q_lat, q_pe, cache = _inputs(4)
    rows = jnp.zeros((2, 3, 5, cache.shape[-1]))
    with pytest.raises(jaxtyping.TypeCheckError):
        sparse_attention(q_lat, q_pe, rows, jnp.ones((2, 3, 4), bool), scale=1.0)

"""The lightning indexer and the selection rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax.config import get_config
from fo_jax.model.dsa import init_params, layer_slice
from fo_jax.model.indexer import (indexer_keys, indexer_queries, indexer_scores, select_topk)
from fo_jax.model.layers import (fp8_simulate, hadamard_matrix, hadamard_rotate, rope,
                                 rope_inv_freq)


def test_indexer_score_by_hand():
    # Two heads of width 2, three keys:
    #   q_h0 = [1, 2], q_h1 = [-1, 1]; weights w = [0.5, 2]
    #   k0 = [1, 0], k1 = [0, 1], k2 = [-1, -1]
    # head 0 dots: k0 1, k1 2, k2 -3 -> relu 1, 2, 0
    # head 1 dots: k0 -1, k1 1, k2 0 -> relu 0, 1, 0
    # score = 0.5 * [1, 2, 0] + 2 * [0, 1, 0] = [0.5, 3.0, 0.0]
    q = jnp.array([[[[1.0, 2.0], [-1.0, 1.0]]]])  # [B=1, T=1, I=2, N=2]
    w = jnp.array([[[0.5, 2.0]]])  # [1, 1, 2]
    keys = jnp.array([[[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]])  # [1, S=3, 2]
    np.testing.assert_array_equal(indexer_scores(q, w, keys), [[[0.5, 3.0, 0.0]]])


def test_tie_rule_lower_index_wins_and_canonical_order():
    scores = jnp.array([[[1.0, 3.0, 3.0, 2.0, 3.0]]])
    tokens, mask = select_topk(scores, jnp.array([[5]]), 2)
    np.testing.assert_array_equal(tokens, [[[1, 2]]])  # 1, 2, 4 tie: the two lowest win
    tokens, _ = select_topk(scores, jnp.array([[5]]), 4)
    np.testing.assert_array_equal(tokens, [[[1, 2, 3, 4]]])  # ascending, not by score
    assert mask.all()


def test_causal_prefix_and_padding():
    scores = jnp.array([[[9.0, 1.0, 5.0, 7.0], [9.0, 1.0, 5.0, 7.0]]])
    tokens, mask = select_topk(scores, jnp.array([[2, 4]]), 3)
    # Query 0 sees tokens 0 and 1 only: padded with -1 at the end.
    np.testing.assert_array_equal(tokens, [[[0, 1, -1], [0, 2, 3]]])
    np.testing.assert_array_equal(mask, [[[True, True, False], [True, True, True]]])


def test_k_larger_than_context():
    tokens, mask = select_topk(jnp.zeros((1, 1, 3)), jnp.array([[3]]), 5)
    np.testing.assert_array_equal(tokens, [[[0, 1, 2, -1, -1]]])


def test_hadamard_is_orthogonal():
    h = hadamard_matrix(16) / 4.0
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    x = jax.random.normal(jax.random.key(0), (3, 16))
    np.testing.assert_allclose(jnp.linalg.norm(hadamard_rotate(x), axis=-1),
                               jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)


def test_rope_identity_at_zero_and_norm_preserving():
    x = jax.random.normal(jax.random.key(1), (1, 3, 8))
    inv_freq = rope_inv_freq(8, 1e4)
    for interleaved in (True, False):
        np.testing.assert_allclose(rope(x, jnp.zeros((1, 3), jnp.int32), inv_freq,
                                        interleaved=interleaved), x, atol=1e-6)
        y = rope(x, jnp.array([[1, 5, 100]]), inv_freq, interleaved=interleaved)
        np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1),
                                   rtol=1e-5)
    # The two layouts differ: pairs (0, 1) vs halves (0, 4).
    a = rope(x, jnp.array([[1, 5, 100]]), inv_freq, interleaved=True)
    b = rope(x, jnp.array([[1, 5, 100]]), inv_freq, interleaved=False)
    assert not np.allclose(a, b)


def test_fp8_simulation_uses_power_of_two_scales():
    x = jnp.array([[448.0, 1.0, -3.0, 0.1] * 32, [0.0] * 128])
    y = fp8_simulate(x)
    np.testing.assert_array_equal(y[1], 0.0)  # an all-zero block stays zero
    # amax 448 -> scale 1: values exactly representable in e4m3 stay exact.
    np.testing.assert_array_equal(y[0, :3], [448.0, 1.0, -3.0])
    assert abs(float(y[0, 3]) - 0.1) < 0.01
    doubled = fp8_simulate(x * 2.0)  # power-of-two scale: scaling by 2 commutes exactly
    np.testing.assert_array_equal(doubled, y * 2.0)


def test_indexer_pipeline_shapes_and_fp8_option():
    config = get_config("tiny")
    params = init_params(config, jax.random.key(0))
    ip = layer_slice(params["indexer"], 0)
    h = jax.random.normal(jax.random.key(2), (2, 3, config.dim))
    qr = jax.random.normal(jax.random.key(3), (2, 3, config.q_lora_rank))
    pos = jnp.array([[0, 1, 2], [5, 6, 7]])
    k = indexer_keys(ip, h, pos, config=config)
    q, w = indexer_queries(ip, qr, h, pos, config=config)
    assert k.shape == (2, 3, config.index_head_dim)
    assert q.shape == (2, 3, config.index_n_heads, config.index_head_dim)
    assert w.shape == (2, 3, config.index_n_heads)
    fp8 = config.replace(index_fp8=True)
    k8 = indexer_keys(ip, h, pos, config=fp8)
    assert not np.array_equal(k8, k)
    np.testing.assert_allclose(k8, k, rtol=0.07, atol=0.02)

"""Linear layers over FP8 weights with block scales (fo_jax.model.linear)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax.model.linear import (Fp8Weight, act_quant, dequantize, linear, ragged_linear,
                                 resolve_fp8_implementation)


def _weight(shape=(40, 24), block=(16, 8), seed=1, scale_fmt=None):
    w = jax.random.normal(jax.random.key(seed), shape) * 0.2
    return Fp8Weight.quantize(w, block, scale_fmt)


def _reference(x, w: Fp8Weight):
    """Step 2 of the module docstring, one in-block at a time, in numpy float64."""
    x_q, x_s = (np.asarray(a, np.float64) for a in act_quant(x, w.block[0], w.scale_fmt))
    q, s = np.asarray(w.q, np.float64), np.asarray(w.scale_inv, np.float64)
    (num_i, num_o), (bi, bo) = w.shape, w.block
    out = np.zeros(x.shape[:-1] + (num_o,))
    for k in range(-(-num_i // bi)):
        part = x_q[..., k * bi:(k + 1) * bi] @ q[k * bi:(k + 1) * bi]
        out += part * x_s[..., k:k + 1] * np.repeat(s[k], bo)[:num_o]
    return out


def test_act_quant_by_hand():
    # Block [1, -2, 0.5, 4]: amax 4, s = 4 / 448; x / s = [112, -224, 56, 448], all e4m3
    # values. Block [0, 0]: amax floored at 1e-4, s = 1e-4 / 448, zeros stay zeros (ragged:
    # 6 values in blocks of 4).
    x = jnp.array([[1.0, -2.0, 0.5, 4.0, 0.0, 0.0]])
    q, s = act_quant(x, 4)
    np.testing.assert_allclose(np.asarray(s), [[4 / 448, 1e-4 / 448]], rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q, np.float32), [[112, -224, 56, 448, 0, 0]])
    # ue8m0: s = 2^ceil(log2(4 / 448)) = 2^-6, x / s = [64, -128, 32, 256].
    q, s = act_quant(x, 4, "ue8m0")
    assert float(s[0, 0]) == 2.0 ** -6
    np.testing.assert_array_equal(np.asarray(q, np.float32)[0, :4], [64, -128, 32, 256])
    # 300 rounds to the e4m3 grid (steps of 32 between 256 and 448): 288.
    q, _ = act_quant(jnp.array([[300.0, 448.0]]), 2)
    np.testing.assert_array_equal(np.asarray(q, np.float32), [[288, 448]])


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("implementation", ["dequantize", "fp8_dot"])
def test_linear_matches_the_blockwise_reference(implementation, scale_fmt):
    # Ragged in both axes: 40 inputs in blocks of 16, 24 outputs in blocks of 8 (3 whole).
    w = _weight(scale_fmt=scale_fmt)
    x = jax.random.normal(jax.random.key(2), (3, 5, 40))
    got = linear(x, w, implementation=implementation)
    assert got.shape == (3, 5, 24) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), _reference(x, w), rtol=1e-5, atol=1e-5)


def test_fp8_linear_is_the_dequantized_product_up_to_activation_rounding():
    w = _weight(shape=(256, 64), block=(128, 128))
    x = jax.random.normal(jax.random.key(3), (64, 256))
    exact = np.asarray(x) @ np.asarray(dequantize(w))
    got = np.asarray(linear(x, w))
    # e4m3 keeps 3 mantissa bits: each activation is off by at most 2^-4 of itself.
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 1e-3 < rel < 2 ** -4, rel
    # bfloat16 activations: the output is in their dtype.
    assert linear(x.astype(jnp.bfloat16), w).dtype == jnp.bfloat16


def test_plain_weights_are_a_plain_matmul():
    x = jax.random.normal(jax.random.key(4), (2, 8))
    w = jax.random.normal(jax.random.key(5), (8, 3))
    np.testing.assert_array_equal(np.asarray(linear(x, w)), np.asarray(jnp.matmul(x, w)))
    assert dequantize(w) is w


def test_quantize_and_dequantize_by_hand():
    # One block of [[0.5, -1], [2, 448 * 2]]: scale 896 / 448 = 2, q = w / 2.
    w = Fp8Weight.quantize(jnp.array([[0.5, -1.0], [2.0, 896.0]]), (128, 128))
    np.testing.assert_array_equal(np.asarray(w.scale_inv), [[2.0]])
    np.testing.assert_array_equal(np.asarray(w.q, np.float32), [[0.25, -0.5], [1.0, 448.0]])
    np.testing.assert_array_equal(np.asarray(dequantize(w)), [[0.5, -1.0], [2.0, 896.0]])
    assert dequantize(w, jnp.bfloat16).dtype == jnp.bfloat16
    assert w.nbytes == 4 * 1 + 1 * 4 and w.dtype == jnp.float8_e4m3fn


def test_stacks_slice_and_scan_like_arrays():
    w = _weight(shape=(3, 4, 40, 24))
    assert w.shape == (3, 4, 40, 24) and w.scale_inv.shape == (3, 4, 3, 3)
    one = w[1, 2]
    np.testing.assert_array_equal(np.asarray(dequantize(one)), np.asarray(dequantize(w))[1, 2])
    sliced = jax.tree_util.tree_map(lambda a: a[1], w)
    assert isinstance(sliced, Fp8Weight) and sliced.shape == (4, 40, 24)
    x = jax.random.normal(jax.random.key(6), (2, 40))
    got = jax.jit(lambda w, e: linear(x, w[1][e]))(w, jnp.int32(3))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(linear(x, w[1, 3])))


def test_ragged_linear_is_linear_per_group():
    w = _weight(shape=(3, 40, 24))
    x = jax.random.normal(jax.random.key(7), (7, 40))
    sizes = jnp.array([2, 0, 5], jnp.int32)
    got = np.asarray(ragged_linear(x, w, sizes))
    want = np.concatenate([np.asarray(linear(x[:2], w[0])), np.asarray(linear(x[2:], w[2]))])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    plain = dequantize(w)
    np.testing.assert_array_equal(np.asarray(ragged_linear(x, plain, sizes)),
                                  np.asarray(jax.lax.ragged_dot(x, plain, sizes)))


def test_bad_inputs_are_refused():
    w = _weight()
    with pytest.raises(ValueError, match="in blocks of \\(16, 8\\) needs scale_inv of shape "
                                         "\\(3, 3\\), got \\(3, 2\\)"):
        Fp8Weight(w.q, w.scale_inv[:, :2], w.block)
    with pytest.raises(ValueError, match="scale_fmt='e5m2' is not one of \\(None, 'ue8m0'\\)"):
        Fp8Weight(w.q, w.scale_inv, w.block, "e5m2")
    with pytest.raises(IndexError, match="indexes its leading 0 axes only, got 1 indices"):
        w[0]
    with pytest.raises(ValueError, match="implementation='cublas' is not one of "
                                         "\\('fp8_dot', 'dequantize'\\)"):
        resolve_fp8_implementation("cublas")
    with pytest.raises(ValueError, match="must be one matrix \\[I, O\\]"):
        linear(jnp.ones((2, 40)), _weight(shape=(2, 40, 24)))
    assert resolve_fp8_implementation(None) == (
        "fp8_dot" if jax.default_backend() == "gpu" else "dequantize")


def test_random_fp8_params_and_the_moe_over_them():
    from fo_jax.config import get_config
    from fo_jax.model.dsa import (FP8_PARAMS, init_fp8_params, init_params, param_bytes,
                                  quantize_params)
    from fo_jax.model.moe import moe_mlp, moe_mlp_reference

    config = get_config("tiny").replace(n_routed_experts=4, num_experts_per_tok=2,
                                        moe_hidden=16, first_k_dense_replace=1)
    drawn = init_fp8_params(config, jax.random.key(0), (16, 16))
    quantized = quantize_params(init_params(config, jax.random.key(0)), (16, 16))
    for params in (drawn, quantized):
        leaves = jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]
        for path, leaf in leaves:
            keys = tuple(k.key for k in path)
            assert isinstance(leaf, Fp8Weight) == (keys[-2:] in FP8_PARAMS), keys
        assert sum(leaf.nbytes for _, leaf in leaves) == param_bytes(config, fp8_block=(16, 16))
    # normal(0, fan_in^-0.5) before rounding: the experts' w1 [.., E = 64, M] has std 1/8.
    assert abs(float(jnp.std(dequantize(drawn["moe"]["w1"]))) - 64 ** -0.5) < 0.01
    # The MoE over FP8 experts (tiles, one expert's FP8 weights per tile) is the dense-mask
    # reference over the same weights, up to float32 rounding.
    layer = jax.tree_util.tree_map(lambda a: a[0], drawn["moe"])
    h = jax.random.normal(jax.random.key(1), (2, 5, config.dim))
    np.testing.assert_allclose(np.asarray(moe_mlp(h, layer, config=config)),
                               np.asarray(moe_mlp_reference(h, layer, config=config)),
                               rtol=1e-5, atol=1e-5)

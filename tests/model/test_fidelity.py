"""Numerics that must match the published models: indexer RoPE layout, YaRN, float32 heads.

Every expected value is worked out by hand in a comment (references: DeepSeek-V3.2's
`inference/model.py`: `precompute_freqs_cis`, `apply_rotary_emb`, `MLA.__init__`, `Indexer`,
`Transformer.head`; Hugging Face `transformers`' `modeling_glm_moe_dsa` for GLM-5's indexer).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.attention import attention_inputs, rope_frequencies, softmax_scale
from fo_jax.model.dsa import param_shapes
from fo_jax.model.indexer import indexer_queries
from fo_jax.model.layers import hadamard_rotate, matmul_f32, rope, rope_inv_freq

TINY = get_config("tiny")
# A tiny model with DeepSeek-V3.2's RoPE: R = 64, theta 1e4, YaRN factor 40 over 4096 positions.
YARN = TINY.replace(qk_rope_head_dim=64, index_head_dim=64, max_seq_len=8192, rope_factor=40.0,
                    rope_original_seq_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
                    kv_dtype="float32")


def _zeros(shapes):
    return jax.tree.map(lambda shape: np.zeros(shape, np.float32), shapes,
                        is_leaf=lambda s: isinstance(s, tuple))


def _jax(tree, dtype=jnp.float32):
    return {k: jnp.asarray(v, dtype) for k, v in tree.items()}


# --- RoPE layouts --------------------------------------------------------------------------------

# x = [1, 2, 3, 4] at position 1, theta = 100, width 4: inv_freq = [100^0, 100^(-2/4)] = [1, 0.1].
# cos 1 = 0.5403023, sin 1 = 0.8414710, cos 0.1 = 0.9950042, sin 0.1 = 0.0998334.
# Interleaved: pairs (x0, x1) at frequency 1, (x2, x3) at 0.1:
#   [1 cos1 - 2 sin1, 1 sin1 + 2 cos1, 3 cos.1 - 4 sin.1, 3 sin.1 + 4 cos.1]
#   = [-1.1426397, 1.9220756, 2.5856788, 4.2795169]
# Halves: pairs (x0, x2) at frequency 1, (x1, x3) at 0.1:
#   [1 cos1 - 3 sin1, 2 cos.1 - 4 sin.1, 1 sin1 + 3 cos1, 2 sin.1 + 4 cos.1]
#   = [-1.9841106, 1.5906747, 2.4623779, 4.1796835]
INTERLEAVED = [-1.1426397, 1.9220756, 2.5856788, 4.2795169]
HALVES = [-1.9841106, 1.5906747, 2.4623779, 4.1796835]


def test_rope_layouts_by_hand():
    x = jnp.array([[[1.0, 2.0, 3.0, 4.0]]])  # [B=1, T=1, R=4]
    pos = jnp.array([[1]])
    np.testing.assert_allclose(rope_inv_freq(4, 100.0), [1.0, 0.1], rtol=1e-7)
    inv_freq = rope_inv_freq(4, 100.0)
    np.testing.assert_allclose(rope(x, pos, inv_freq, interleaved=True)[0, 0], INTERLEAVED,
                               rtol=1e-6)
    np.testing.assert_allclose(rope(x, pos, inv_freq, interleaved=False)[0, 0], HALVES,
                               rtol=1e-6)


@pytest.mark.parametrize("interleave,expected", [(True, INTERLEAVED), (False, HALVES)],
                         ids=["glm5_interleaved", "deepseek_halves"])
def test_indexer_query_rope_follows_the_config_layout(interleave, expected):
    # Indexer head 0 reads [1, 2, 3, 4, 0, ...] (qr = e_0, wq_b row 0); R = 4, theta = 100, at
    # position 1: its first 4 dims are the hand values above. indexer_queries returns them after
    # the Hadamard rotation, which is its own inverse (H H / N = I), so rotate once more to read.
    config = TINY.replace(qk_rope_head_dim=4, rope_theta=100.0, index_rope_interleave=interleave)
    ip = _zeros(param_shapes(config)["indexer"])
    ip = {k: v[0] for k, v in ip.items()}
    ip["wq_b"][0, :4] = [1.0, 2.0, 3.0, 4.0]
    ip = _jax(ip)
    qr = np.zeros((1, 1, config.q_lora_rank), np.float32)
    qr[0, 0, 0] = 1.0
    h = np.zeros((1, 1, config.dim), np.float32)
    q, _ = indexer_queries(ip, jnp.asarray(qr), jnp.asarray(h), jnp.array([[1]]), config=config)
    roped = hadamard_rotate(q)[0, 0, 0]
    np.testing.assert_allclose(roped[:4], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(roped[4:], 0.0, atol=1e-6)


def test_presets_set_the_published_layouts():
    assert get_config("glm5").index_rope_interleave
    assert get_config("glm52").index_rope_interleave
    assert not get_config("deepseek_v32").index_rope_interleave
    assert not TINY.index_rope_interleave and not get_config("small").index_rope_interleave


# --- YaRN ----------------------------------------------------------------------------------------

def test_yarn_frequencies_by_hand():
    # width 64, theta 1e4, original 4096, beta_fast 32, beta_slow 1, factor 40:
    #   dim(r) = 64 ln(4096 / (2 pi r)) / (2 ln 1e4)
    #   dim(32) = 64 ln(20.372) / 18.4207 = 64 * 3.01416 / 18.4207 = 10.47 -> floor 10
    #   dim(1)  = 64 ln(651.90) / 18.4207 = 64 * 6.47989 / 18.4207 = 22.51 -> ceil 23
    #   ramp_i = clip((i - 10) / 13, 0, 1); f'_i = f_i (1 - ramp_i) + f_i / 40 * ramp_i
    # i = 16: f = 1e4^(-32/64) = 0.01, ramp = 6/13: 0.01 * (7/13 + 6/13/40) = 0.01 * 0.55 = 0.0055
    # i <= 10 keep f_i (i = 10: 1e4^(-20/64) = 0.0562341); i >= 23 are f_i / 40
    # (i = 31: 1e4^(-62/64) / 40 = 1.3335e-4 / 40 = 3.3338e-6).
    f = rope_inv_freq(64, 1e4, factor=40.0, original_seq_len=4096, beta_fast=32.0,
                      beta_slow=1.0)
    assert f.shape == (32,) and f.dtype == np.float32
    np.testing.assert_allclose(f[[0, 10, 16, 31]], [1.0, 0.0562341, 0.0055, 3.3338e-6],
                               rtol=2e-5)
    plain = rope_inv_freq(64, 1e4)
    np.testing.assert_array_equal(f[:11], plain[:11])  # ramp 0: exactly the plain frequency
    np.testing.assert_allclose(f[23:], plain[23:] / 40, rtol=1e-6)


def test_yarn_softmax_scale_by_hand():
    # mscale = 0.1 * 1.0 * ln(40) + 1 = 0.1 * 3.6888795 + 1 = 1.3688879; squared 1.8738542.
    # DeepSeek-V3.2: (128 + 64)^-0.5 = 0.0721688; * 1.8738542 = 0.1352338.
    ds = get_config("deepseek_v32")
    assert ds.yarn_active
    assert softmax_scale(ds) == pytest.approx(0.1352338, rel=1e-6)
    assert softmax_scale(ds.replace(rope_factor=1.0)) == pytest.approx(192 ** -0.5, rel=1e-12)
    plain = YARN.replace(rope_factor=1.0)
    assert softmax_scale(YARN) / softmax_scale(plain) == pytest.approx(1.8738542, rel=1e-6)


def test_yarn_is_a_no_op_within_the_original_context():
    # The reference rescales only when max_seq_len > original_seq_len: at 4096 positions the
    # DeepSeek preset is plain RoPE with the plain (128 + 64)^-0.5 scale, bit for bit.
    short = get_config("deepseek_v32").replace(max_seq_len=4096)
    assert not short.yarn_active
    assert softmax_scale(short) == 192 ** -0.5
    np.testing.assert_array_equal(rope_frequencies(short), rope_inv_freq(64, 1e4))
    assert not TINY.yarn_active and not get_config("small").yarn_active
    assert softmax_scale(TINY) == TINY.qk_head_dim ** -0.5


def test_mla_and_indexer_share_the_yarn_frequencies():
    # Frequency pair 16 turns by 0.0055 rad at position 1 (above): cos 0.0055 = 0.99998488,
    # sin 0.0055 = 0.00549997 (plain RoPE would turn it by 0.01 rad: sin = 0.00999983).
    turned = [math.cos(0.0055), math.sin(0.0055)]
    np.testing.assert_allclose(rope_frequencies(YARN)[16], 0.0055, rtol=1e-6)
    pos = jnp.array([[1]])
    d, r, heads, nope = (YARN.kv_lora_rank, YARN.qk_rope_head_dim, YARN.num_heads,
                         YARN.qk_nope_head_dim)
    # MLA, interleaved: the rope dims (2*16, 2*16 + 1) of k_pe and of head 0's q_pe carry pair 16.
    lp = {k: v[0] for k, v in _zeros(param_shapes(YARN)["layers"]).items()}
    lp["wkv_a"][0, d + 32] = 1.0
    lp["wq_b"][0, nope + 32] = 1.0  # head 0's q_pe dim 32
    lp = _jax(lp)
    h = np.zeros((1, 1, YARN.dim), np.float32)
    h[0, 0, 0] = 1.0
    qr = np.zeros((1, 1, YARN.q_lora_rank), np.float32)
    qr[0, 0, 0] = 1.0
    _, q_pe, kv_new = attention_inputs(lp, jnp.asarray(h), jnp.asarray(qr), pos, config=YARN)
    np.testing.assert_allclose(kv_new[0, 0, d + 32:d + 34], turned, rtol=1e-5)
    np.testing.assert_allclose(q_pe[0, 0, 0, 32:34], turned, rtol=1e-5)
    assert q_pe.shape == (1, 1, heads, r)
    # Indexer, halves: dim 16 pairs with dim 16 + 32 = 48 at frequency 16.
    ip = {k: v[0] for k, v in _zeros(param_shapes(YARN)["indexer"]).items()}
    ip["wq_b"][0, 16] = 1.0
    ip = _jax(ip)
    q, _ = indexer_queries(ip, jnp.asarray(qr), jnp.asarray(h), pos, config=YARN)
    roped = np.asarray(hadamard_rotate(q)[0, 0, 0])  # two float32 rotations: ~1e-7 error
    np.testing.assert_allclose(roped[[16, 48]], turned, rtol=0, atol=1e-6)


@pytest.mark.parametrize("change,message", [
    (dict(rope_factor=0.5), r"rope_factor=0.5 must be >= 1 \(1.0 turns YaRN off\)"),
    (dict(rope_beta_fast=1.0), r"YaRN needs rope_beta_fast > rope_beta_slow > 0, got "
                               r"rope_beta_fast=1.0, rope_beta_slow=1.0"),
    (dict(rope_original_seq_len=0), r"rope_original_seq_len must be a positive int, got 0"),
    (dict(rope_theta=1.0), r"rope_theta=1.0 must be > 1"),
])
def test_bad_rope_settings_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        TINY.replace(**change)


# --- float32 heads -------------------------------------------------------------------------------

# bf16 keeps 8 significant bits: 1 + 2^-9 = 1.001953125 rounds to 1.0 in bf16 but is exact in
# float32. Inputs [1, 1] against weights [1, 2^-9]: float32 gives 1.001953125, bf16 gives 1.0.
EXACT = 1.0 + 2.0 ** -9


def test_matmul_f32_keeps_what_bf16_rounds_away():
    x = jnp.array([[1.0, 1.0]], jnp.bfloat16)
    w = jnp.array([[1.0], [2.0 ** -9]], jnp.bfloat16)
    assert float(jnp.matmul(x, w)[0, 0]) == 1.0  # the bf16 matmul loses the 2^-9
    out = matmul_f32(x, w)
    assert out.dtype == jnp.float32
    assert float(out[0, 0]) == EXACT


def test_indexer_head_weights_run_in_float32():
    # w = (h W_w) * I^-0.5 * N^-0.5 with h = [1, 1, 0, ...], W_w[:, 0] = [1, 2^-9, 0, ...]:
    # tiny has I = 4, N = 16: 1.001953125 * 0.5 * 0.25 = 0.125244140625 (bf16 would give 0.125).
    config = TINY.replace(dtype="bfloat16")
    ip = {k: v[0] for k, v in _zeros(param_shapes(config)["indexer"]).items()}
    ip["weights_proj"][0, 0], ip["weights_proj"][1, 0] = 1.0, 2.0 ** -9
    ip = _jax(ip, jnp.bfloat16)
    h = np.zeros((1, 1, config.dim), np.float32)
    h[0, 0, :2] = 1.0
    qr = jnp.zeros((1, 1, config.q_lora_rank), jnp.bfloat16)
    _, w = indexer_queries(ip, qr, jnp.asarray(h, jnp.bfloat16), jnp.array([[0]]), config=config)
    assert w.dtype == jnp.float32
    assert float(w[0, 0, 0]) == 0.125244140625
    np.testing.assert_array_equal(w[0, 0, 1:], 0.0)


def test_output_head_runs_in_float32():
    # A bf16 model whose layers add nothing (every weight 0) and whose embedding row of token 0
    # is all ones: the final RMSNorm gives 1 / sqrt(1 + 1e-6) = 0.9999995 -> 1.0 in bf16, so the
    # head sees x = [1, 1, ..., 1]. Head column 0 = [1, 2^-9, 0, ...]: logit 1.001953125 in
    # float32 (the reference's float32 head), 1.0 with a bf16 matmul; other columns 0.
    config = TINY.replace(dtype="bfloat16")
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), _zeros(param_shapes(config)))
    params["embed"] = params["embed"].at[0].set(1.0)
    params["norm"] = jnp.ones_like(params["norm"])
    params["head"] = params["head"].at[0, 0].set(1.0).at[1, 0].set(2.0 ** -9)
    state = resident.ResidentState.create(config, batch=1, capacity=8)
    logits, _ = resident.prefill(params, state, np.zeros((1, 2), np.int32), config=config)
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits[0, :, 0], [EXACT, EXACT])
    np.testing.assert_array_equal(logits[0, :, 1:], 0.0)

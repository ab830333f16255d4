"""Elementwise and small building blocks of the DSA model: norms, RoPE, Hadamard, FP8, MLP.

Pure functions over arrays; float32 math unless stated.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.model.linear import FP8_E4M3_MAX, linear

F32 = jnp.float32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(F32)).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (the indexer's key norm), float32 math."""
    xf = x.astype(F32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    out = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (out * weight.astype(F32) + bias.astype(F32)).astype(x.dtype)


def rope_inv_freq(width: int, theta: float, *, factor: float = 1.0,
                  original_seq_len: int | None = None, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> np.ndarray:
    """RoPE inverse frequencies [width / 2] float32, optionally YaRN-rescaled.

    Plain RoPE: f_i = theta^(-2i / width). YaRN (the DeepSeek reference's `precompute_freqs_cis`,
    applied when `factor > 1`; the caller decides whether the context exceeds the original):
    frequency i keeps f_i for the fast dims, becomes f_i / factor for the slow dims, and is
    blended linearly in between:

      dim(r) = width * ln(original_seq_len / (2 pi r)) / (2 ln theta)   (dims doing r turns)
      lo = max(floor(dim(beta_fast)), 0),  hi = min(ceil(dim(beta_slow)), width - 1)
      ramp_i = clip((i - lo) / (hi - lo), 0, 1)      (hi - lo := 0.001 when equal)
      f'_i = f_i / factor * ramp_i + f_i * (1 - ramp_i)

    float32 arithmetic as in the reference. Touches width / 2 values (host numpy, trace time).
    """
    if width % 2:
        raise ValueError(f"rope_inv_freq: {width=} must be even (RoPE pairs)")
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, width, 2, dtype=np.float32) / width)))
    freqs = freqs.astype(np.float32)
    if factor == 1.0:
        return freqs
    if original_seq_len is None:
        raise ValueError("rope_inv_freq: YaRN (factor != 1) needs original_seq_len")

    def turns_dim(rotations):
        return width * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(turns_dim(beta_fast)), 0)
    hi = min(math.ceil(turns_dim(beta_slow)), width - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(width // 2, dtype=np.float32) - lo) / np.float32(hi - lo), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    return (freqs / np.float32(factor) * (1 - keep) + freqs * keep).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *,
         interleaved: bool) -> jax.Array:
    """Rotary embedding of the last axis of `x` (width R, even) at integer `positions`.

    x: [..., T, heads..., R] is broadcast against positions [..., T] through `x.ndim - 1 -
    positions.ndim` trailing head axes; inv_freq: [R / 2] (see `rope_inv_freq`), pair i turns by
    position * inv_freq[i]. `interleaved=True` rotates pairs (2i, 2i+1) (MLA in the DeepSeek
    reference; GLM-5's indexer); `False` rotates halves (i, i + R/2) (DeepSeek-V3.2's indexer).
    """
    width = x.shape[-1]
    inv_freq = np.asarray(inv_freq, np.float32)
    if inv_freq.shape != (width // 2,):
        raise ValueError(f"rope: inv_freq has shape {inv_freq.shape}, expected ({width // 2},) "
                         f"for a rotary width of {width}")
    angles = positions.astype(F32)[..., None] * jnp.asarray(inv_freq)  # [..., T, R/2]
    extra = x.ndim - 1 - positions.ndim
    angles = angles.reshape(angles.shape[:-1] + (1,) * extra + angles.shape[-1:])
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(F32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        out = out.reshape(xf.shape)
    else:
        x1, x2 = xf[..., : width // 2], xf[..., width // 2 :]
        out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def matmul_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in float32: [..., E] @ [E, O] -> [..., O] float32, whatever the operand dtypes.

    The DeepSeek reference runs the output head and the indexer's `weights_proj` in float32 on
    bf16-valued inputs and weights. The product of two 16-bit floats is exact in float32, so
    asking for float32 accumulation (`preferred_element_type`, full `precision`) computes that
    same float32 matmul without materialising a float32 copy of the weight (the head is [E, V]).
    """
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix (entries +-1), n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix needs a power of two, got {n=}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """x @ Hadamard(N) * N^-0.5 over the last axis (an orthogonal rotation), float32."""
    n = x.shape[-1]
    return jnp.matmul(x.astype(F32), jnp.asarray(hadamard_matrix(n))) * (n ** -0.5)


def fp8_simulate(x: jax.Array, block: int = 128) -> jax.Array:
    """Round x to float8 e4m3 with one power-of-two scale per `block` values of the last axis.

    scale = 2^ceil(log2(amax / 448)) per block (1 where the block is all zeros); the result is
    dequantised back to float32, so it carries exactly the FP8 rounding error.
    """
    width = x.shape[-1]
    block = min(block, width)
    if width % block:
        raise ValueError(f"fp8_simulate: last axis {width=} must be a multiple of {block=}")
    xf = x.astype(F32).reshape(x.shape[:-1] + (width // block, block))
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    exponent = jnp.ceil(jnp.log2(jnp.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)))
    scale = jnp.exp2(exponent)
    q = (xf / scale).astype(jnp.float8_e4m3fn).astype(F32) * scale
    return q.reshape(x.shape)


def swiglu_mlp(x: jax.Array, w1, w2, w3) -> jax.Array:
    """w2(silu(x w1) * (x w3)): the dense DeepSeek MLP (and a shared expert); the weights plain
    arrays or `Fp8Weight`s (`fo_jax.model.linear.linear`).

    As the reference, the gated product is formed in float32 and cast back to x's dtype before
    w2 (a no-op for float32 models).
    """
    act = jax.nn.silu(linear(x, w1).astype(F32)) * linear(x, w3).astype(F32)
    return linear(act.astype(x.dtype), w2)

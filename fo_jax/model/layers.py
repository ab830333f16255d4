"""Elementwise and small building blocks of the DSA model: norms, RoPE, Hadamard, FP8, MLP.

Pure functions over arrays; float32 math unless stated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
FP8_E4M3_MAX = 448.0


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


def rope(x: jax.Array, positions: jax.Array, theta: float, *, interleaved: bool) -> jax.Array:
    """Rotary embedding of the last axis of `x` (width R, even) at integer `positions`.

    x: [..., T, heads..., R] is broadcast against positions [..., T] through `x.ndim - 1 -
    positions.ndim` trailing head axes. `interleaved=True` rotates pairs (2i, 2i+1) (MLA in the
    DeepSeek reference); `False` rotates halves (i, i + R/2) (the DSA indexer).
    """
    width = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, width, 2, dtype=np.float32) / width))
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


def swiglu_mlp(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array) -> jax.Array:
    """w2(silu(x w1) * (x w3)): the dense DeepSeek MLP."""
    return jnp.matmul(jax.nn.silu(jnp.matmul(x, w1)) * jnp.matmul(x, w3), w2)

"""MLA attention in absorbed form: projections, the compressed KV row, sparse and dense attention.

The cache holds, per token and layer, one row of D + R values: the RMS-normed latent c_kv (D)
followed by the RoPE key k_pe (R, interleaved pairs, frequencies from `rope_frequencies`). Queries are absorbed into the latent space:

  q_lat[h] = W_UK[h] q_nope[h]                           [H, D]
  score[h, s] = (q_lat[h] . c_kv[s] + q_pe[h] . k_pe[s]) * (qk_nope + R)^-0.5  (* mscale^2
                under YaRN: `softmax_scale`)
  p = softmax_s(score) in float32
  out[h] = W_UV[h] (sum_s p[h, s] c_kv[s]);  y = W_o concat_h out[h]

`sparse_attention` combines the K gathered rows in the order given (the canonical order of
`select_topk`); it is the one attention every path uses, so paths that gather the same rows are
bitwise equal.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.model.kv_format import load_kv_rows, store_kv_rows
from fo_jax.model.layers import F32, rms_norm, rope, rope_inv_freq
from fo_jax.model.linear import dequantize, linear
from fo_jax.typing import Array, Bool, Float, Shaped


def query_lowrank(lp: dict, h: jax.Array, *, config) -> jax.Array:
    """qr = q_norm(h W_qa): [B, T, E] -> [B, T, q_lora_rank] (the indexer reads it too)."""
    return rms_norm(linear(h, lp["wq_a"]), lp["q_norm"], config.norm_eps)


def attention_inputs(lp: dict, h: jax.Array, qr: jax.Array, positions: jax.Array, *, config):
    """Absorbed queries and the new tokens' KV rows.

    Args:
      lp: one layer's parameters.
      h: [B, T, E] normed input; qr: [B, T, q_lora_rank]; positions: [B, T].
    Returns:
      q_lat [B, T, H, D] f32, q_pe [B, T, H, R] f32, kv_new [B, T, D + R] as the cache stores
      it (`store_kv_rows`: kv_dtype values, or [B, T, Y] uint8 fp8_ds_mla rows).
    """
    heads, nope, r = config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    d, v = config.kv_lora_rank, config.v_head_dim
    q = linear(qr, lp["wq_b"]).reshape(h.shape[:-1] + (heads, nope + r))
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    inv_freq = rope_frequencies(config)
    q_pe = rope(q_pe, positions, inv_freq, interleaved=True)
    w_kv_b = dequantize(lp["wkv_b"], config.jnp_dtype).reshape(d, heads, nope + v)
    q_lat = jnp.einsum("bthn,dhn->bthd", q_nope.astype(F32), w_kv_b[..., :nope].astype(F32))
    kv = linear(h, lp["wkv_a"])
    c_kv = rms_norm(kv[..., :d], lp["kv_norm"], config.norm_eps)
    k_pe = rope(kv[..., d:], positions, inv_freq, interleaved=True)
    kv_new = store_kv_rows(jnp.concatenate([c_kv, k_pe], axis=-1), config=config)
    return q_lat, q_pe.astype(F32), kv_new


def sparse_attention(q_lat: Float[Array, "B T H D"], q_pe: Float[Array, "B T H R"],
                     rows: Shaped[Array, "B T K DR"], mask: Bool[Array, "B T K"], *,
                     scale: float) -> Float[Array, "B T H D"]:
    """Attention of each query over its own K gathered rows, in the given order.

    Args:
      q_lat: [B, T, H, D] f32; q_pe: [B, T, H, R] f32.
      rows: [B, T, K, D + R] (any float dtype), or [B, T, K, Y] uint8 fp8_ds_mla rows,
        dequantized here (only these K per query); rows where mask is False may hold anything,
        NaN included: they are zeroed before use.
      mask: [B, T, K] bool.
    Returns:
      [B, T, H, D] float32 latent outputs (0 for a query with no selected token).
    """
    d = q_lat.shape[-1]
    rows = jnp.where(mask[..., None], load_kv_rows(rows, kv_lora_rank=d), 0.0)
    c_kv, k_pe = rows[..., :d], rows[..., d:]
    logits = jnp.einsum("bthd,btkd->bthk", q_lat, c_kv)
    logits = (logits + jnp.einsum("bthr,btkr->bthk", q_pe, k_pe)) * scale
    return _softmax_combine(logits, mask[:, :, None, :], c_kv, "bthk,btkd->bthd")


def dense_attention(q_lat: Float[Array, "B T H D"], q_pe: Float[Array, "B T H R"],
                    cache: Shaped[Array, "B S DR"], mask: Bool[Array, "B T S"], *,
                    scale: float) -> Float[Array, "B T H D"]:
    """Attention of each query over all S cached rows, restricted by mask [B, T, S].

    cache: [B, S, D + R] (or [B, S, Y] uint8 fp8_ds_mla rows: dense attention reads every
    row, so all are dequantized). The reference `sparse_attention` is checked against (masked
    to exactly the selected set) and the dense model (top-k >= context) is built on.
    """
    d = q_lat.shape[-1]
    rows = load_kv_rows(cache, kv_lora_rank=d)
    # Rows outside every mask (e.g. NaN-poisoned, unwritten) must not reach the output.
    used = jnp.any(mask, axis=1)  # [B, S]
    rows = jnp.where(used[..., None], rows, 0.0)
    c_kv, k_pe = rows[..., :d], rows[..., d:]
    logits = jnp.einsum("bthd,bsd->bths", q_lat, c_kv)
    logits = (logits + jnp.einsum("bthr,bsr->bths", q_pe, k_pe)) * scale
    return _softmax_combine(logits, mask[:, :, None, :], c_kv, "bths,bsd->bthd")


def attention_output(lp: dict, out_lat: jax.Array, *, config) -> jax.Array:
    """Up-project the latent outputs with W_UV and mix heads with W_o: [B, T, H, D] -> [B, T, E]."""
    heads, nope, d, v = (config.num_heads, config.qk_nope_head_dim, config.kv_lora_rank,
                         config.v_head_dim)
    w_uv = dequantize(lp["wkv_b"], config.jnp_dtype).reshape(d, heads, nope + v)[..., nope:]
    out = jnp.einsum("bthd,dhv->bthv", out_lat, w_uv.astype(F32))
    out = out.reshape(out.shape[:-2] + (heads * v,)).astype(config.jnp_dtype)
    return linear(out, lp["wo"])


def softmax_scale(config) -> float:
    """(qk_nope + R)^-0.5, times mscale^2 under YaRN (the reference's `MLA.__init__`):

      mscale = 0.1 * rope_mscale * ln(rope_factor) + 1     (1.3689 for factor 40, squared 1.8739)

    The indexer's scale is not touched (it has none of its own beyond `indexer_queries`' w).
    """
    scale = config.qk_head_dim ** -0.5
    if config.yarn_active:
        mscale = 0.1 * config.rope_mscale * math.log(config.rope_factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def rope_frequencies(config) -> np.ndarray:
    """[R/2] float32 inverse frequencies of the model's RoPE, YaRN-rescaled when
    `config.yarn_active`; MLA (q_pe, k_pe) and the indexer share them, as the reference's one
    `freqs_cis` table."""
    if not config.yarn_active:
        return rope_inv_freq(config.qk_rope_head_dim, config.rope_theta)
    return rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, factor=config.rope_factor,
                         original_seq_len=config.rope_original_seq_len,
                         beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow)


def _softmax_combine(logits, mask, values, combine: str):
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(mask, jnp.exp(logits - peak), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    return jnp.einsum(combine, probs, values)

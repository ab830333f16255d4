"""The lightning indexer of DeepSeek-V3.2 and the top-k selection rule of fo_jax.

Per indexer layer (DeepSeek-V3.2):
  q_I = W_qb_I qr                      (qr: the attention's normed query low-rank state)
  k_I = LayerNorm(W_k x)               (one key per token, cached on device)
  RoPE on the first R dims of q_I and k_I with the model's frequencies (YaRN included), in
    halves (DeepSeek-V3.2) or interleaved pairs (GLM-5: `config.index_rope_interleave`);
  both rotated by Hadamard * N^-0.5;
  w = W_w x * I^-0.5 * N^-0.5          (W_w x in float32, as the reference)
  score[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s])

Selection rule (one rule, used by every path in the project):
  * exact top-k of the float32 scores over the causal prefix (token s visible to the query at
    position p iff s <= p); ties go to the lower token index (what `jax.lax.top_k` does);
  * fewer than k visible tokens: the missing entries are token -1;
  * canonical order: the selected tokens sorted by ascending token index, -1 padding last.
    Attention combines rows in this order, so any implementation that attends to the same set
    is bitwise equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fo_jax.model.attention import rope_frequencies
from fo_jax.model.layers import F32, fp8_simulate, hadamard_rotate, layer_norm, matmul_f32, rope
from fo_jax.model.linear import linear
from fo_jax.typing import Array, Bool, Float, Int


def indexer_keys(ip: dict, h: jax.Array, positions: jax.Array, *, config) -> jax.Array:
    """Indexer keys of new tokens: [B, T, E] normed hidden -> [B, T, N] float32.

    Touches T tokens only.
    """
    k = linear(h, ip["wk"]).astype(F32)
    k = layer_norm(k, ip["k_norm_w"], ip["k_norm_b"], 1e-6)
    k = _rope_first(k, positions, config)
    k = hadamard_rotate(k)
    if config.index_fp8:
        k = fp8_simulate(k)
    return k


def indexer_queries(ip: dict, qr: jax.Array, h: jax.Array, positions: jax.Array, *, config):
    """Indexer queries and head weights of the new tokens.

    Args:
      qr: [B, T, q_lora_rank] the attention's normed query low-rank state.
      h: [B, T, E] the layer's normed input.
    Returns:
      q: [B, T, I, N] float32 (rotated, optionally FP8-rounded); w: [B, T, I] float32.
    """
    heads, width = config.index_n_heads, config.index_head_dim
    q = linear(qr, ip["wq_b"]).astype(F32)
    q = q.reshape(q.shape[:-1] + (heads, width))
    q = _rope_first(q, positions, config)
    q = hadamard_rotate(q)
    if config.index_fp8:
        q = fp8_simulate(q)
    w = matmul_f32(h, ip["weights_proj"]) * (heads ** -0.5) * (width ** -0.5)
    return q, w


def indexer_scores(q: Float[Array, "B T I N"], w: Float[Array, "B T I"],
                   keys: Float[Array, "B S N"]) -> Float[Array, "B T S"]:
    """score[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h] . keys[b, s]), float32.

    q: [B, T, I, N]; w: [B, T, I]; keys: [B, S, N]. Touches all S keys (the indexer's job).
    """
    dots = jnp.einsum("btin,bsn->btis", q, keys.astype(F32))
    return jnp.einsum("btis,bti->bts", jax.nn.relu(dots), w)


def select_topk(scores: Float[Array, "B T S"], visible: Int[Array, "B T"],
                k: int) -> tuple[Int[Array, "B T K"], Bool[Array, "B T K"]]:
    """The project's selection rule: exact top-k over the causal prefix, canonical order.

    Args:
      scores: [B, T, S] float32.
      visible: [B, T] int32: query t may select tokens 0 .. visible - 1.
      k: K.
    Returns:
      tokens: [B, T, K] int32, ascending, -1 padding last.
      mask: [B, T, K] bool, tokens >= 0.
    Touches S per query (the top-k itself), then sorts K.
    """
    num_tokens = scores.shape[-1]
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    allowed = positions[None, None, :] < visible[..., None]
    masked = jnp.where(allowed, scores, -jnp.inf)
    if k > num_tokens:
        pad = jnp.full(masked.shape[:-1] + (k - num_tokens,), -jnp.inf, masked.dtype)
        masked = jnp.concatenate([masked, pad], axis=-1)
    _, top = jax.lax.top_k(masked, k)  # ties: lower index first
    # A selected index is real iff it is visible (fewer visible tokens than k leave padding).
    real = top < jnp.minimum(visible, num_tokens)[..., None]
    big = jnp.iinfo(jnp.int32).max
    tokens = jnp.sort(jnp.where(real, top, big), axis=-1)
    mask = tokens != big
    return jnp.where(mask, tokens, -1).astype(jnp.int32), mask


def _rope_first(x: jax.Array, positions: jax.Array, config) -> jax.Array:
    """RoPE on the first R dims of the last axis, in the layout `config.index_rope_interleave`."""
    r = config.qk_rope_head_dim
    rotated = rope(x[..., :r], positions, rope_frequencies(config),
                   interleaved=config.index_rope_interleave)
    return jnp.concatenate([rotated, x[..., r:]], axis=-1)

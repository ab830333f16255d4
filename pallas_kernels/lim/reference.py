"""Pure-jnp oracle of LIM: score every visible token, take the top-k, look up their slots.

Per request and per way, float32 throughout, no tiling and no packing: the kernel in `kernel.py`
must select the same tokens and slots and match these scores within a dtype tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _one_way(q, w, keys, token_to_slot, visible, *, k):
    """LIM of one way of one request.

    Args:
      q: [I, N] float32 indexer queries of the way.
      w: [I] float32 head weights of the way.
      keys: [S, N] indexer keys of every token of the request.
      token_to_slot: [S] int32 hot-cache slot of each token, -1 if not resident.
      visible: [] int32: the way may select tokens 0 .. visible - 1.
      k: how many tokens to select.

    Returns:
      token [K], slot [K], score [K] in ascending token order, padding (-1, -1, -inf) last.
    """
    s = keys.shape[0]
    logits = jnp.einsum(
        "in,sn->is", q, keys.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )  # [I, S]
    score = jnp.sum(w[:, None] * jnp.maximum(logits, 0.0), axis=0)  # [S]
    positions = jnp.arange(s, dtype=jnp.int32)
    score = jnp.where(positions < visible, score, -jnp.inf)
    top_score, top_token = jax.lax.top_k(score, k)  # ties: lower token index first
    keep = top_token < visible
    token = jnp.where(keep, top_token, -1)
    slot = jnp.where(keep, token_to_slot[top_token], -1)
    top_score = jnp.where(keep, top_score, -jnp.inf)
    order = jnp.argsort(jnp.where(keep, token, s), stable=True)  # canonical: ascending, pad last
    return token[order], slot[order], top_score[order]


def lim_reference(q_index, weights, index_keys, token_to_slot, visible, *, k, group=None,
                  page_table=None):
    """Top-k tokens of every way under the DSA lightning indexer, with their hot-cache slots.

    score[b, w, s] = sum_i weights[b, w, i] * relu(q_index[b, w, i] . float32(index_keys[b, s]))
    for s < visible[b, w], -inf otherwise. The selection is `jax.lax.top_k` of those scores
    (ties: lower token index wins), restricted to visible tokens and padded with
    (token -1, slot -1, score -inf), then sorted by ascending token index, padding last.

    Args:
      q_index: [B, W, I, N] float32 indexer queries (rotated).
      weights: [B, W, I] float32 head weights (scaled).
      index_keys: [B, S, N] bfloat16 or float32 indexer keys of all token positions; with
        `group`, [G, B, S, N]: every indexer group's keys.
      token_to_slot: [B, S] int32 hot-cache slot of each token, -1 if not resident; with
        `group`, [G, B, S].
      visible: [B, W] int32: way w of request b may select tokens 0 .. visible[b, w] - 1.
      k: tokens selected per way (K), at most S.
      group: None, or an int32 scalar (may be traced): LIM over `index_keys[group]` and
        `token_to_slot[group]`, the index clamped to [0, G) like `lax.dynamic_index_in_dim`.
      page_table: None, or [B, P] int32: `index_keys` is then a pool [F, Z, N] (or
        [G, F, Z, N] with a group) and token t of request b has key
        index_keys[page_table[b, t // Z], t % Z] (pages not held, -1, read pool page 0).

    Returns:
      token [B, W, K] int32, slot [B, W, K] int32 (-1: miss or padding), score [B, W, K] float32.
    """
    if page_table is not None:  # the per-request keys [(G,) B, P Z, N], through the table
        b, p = page_table.shape
        pages = index_keys[..., jnp.maximum(page_table, 0), :, :]
        index_keys = pages.reshape(*index_keys.shape[:-3], b, p * index_keys.shape[-2],
                                   index_keys.shape[-1])
    if group is not None:
        index_keys = jax.lax.dynamic_index_in_dim(index_keys, group, axis=0, keepdims=False)
        token_to_slot = jax.lax.dynamic_index_in_dim(token_to_slot, group, axis=0, keepdims=False)
    per_way = jax.vmap(lambda q, w, keys, slots, vis: _one_way(q, w, keys, slots, vis, k=k),
                       in_axes=(0, 0, None, None, 0))
    per_request = jax.vmap(per_way, in_axes=(0, 0, 0, 0, 0))
    return per_request(
        q_index.astype(jnp.float32),
        weights.astype(jnp.float32),
        index_keys,
        token_to_slot.astype(jnp.int32),
        visible.astype(jnp.int32),
    )

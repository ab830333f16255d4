"""The layer loop of the DSA model, shared by every inference path.

`forward` runs embeddings -> for each indexer group: the group's indexer and top-k selection,
then a `jax.lax.fori_loop` over the group's layers (two loops where a group holds both dense-MLP
and MoE layers: the MLP kind is static per loop) -> final norm and head. Where the KV lives is
the business of a *backend* (the resident path keeps the whole cache on device; the offload
path keeps a hot cache and reads misses from host memory). A backend implements:

    write_index_keys(carry, g, keys[B, T, N], write_pos[B, T]) -> carry
    index_keys(carry, g) -> [B, S, N]
    select(carry, g, q[B, T, I, N], w[B, T, I], visible[B, T], k)
        -> (tokens[B, T, K], mask[B, T, K], slots[B, T, K] or None)
    plan_group(carry, g, tokens, mask, slots) -> (carry, plan)
    attend(carry, l, g, plan, q_lat, q_pe, kv_new[B, T, D+R], write_pos) -> (carry, out[B, T, H, D])

`carry` is the backend's pytree state (threaded through the loops). Every backend must call the
same `sparse_attention` (or the same kernel) on rows gathered in the selection's canonical order:
the math after the gather is shared, so paths differ only in where rows come from.
`xla_select` is the XLA selection (scores, then `select_topk`); `slots` is what a fused
selection (LIM) looked up on the way, None otherwise.

Query blocks: with `query_block=Q` the selection runs over blocks of Q queries
(`over_query_blocks`), so its temporaries (indexer scores [B, Q, S], per-head dots) are bounded
by the block, not by T; backends block their gather + attention the same way. Every query's
result depends on that query alone, so blocking changes values only by rounding (XLA's CPU dot
kernels may round differently for another number of queries); paths that block alike (the
resident and the offloaded prefill) stay bitwise equal. A block >= T is one block (the decode
step: no loop at all).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from fo_jax.model.attention import attention_inputs, attention_output, query_lowrank
from fo_jax.model.dsa import layer_slice
from fo_jax.model.indexer import indexer_keys, indexer_queries, indexer_scores, select_topk
from fo_jax.model.layers import matmul_f32, rms_norm, swiglu_mlp
from fo_jax.model.moe import moe_mlp


@runtime_checkable
class Backend(Protocol):
    def write_index_keys(self, carry, g: int, keys, write_pos): ...
    def index_keys(self, carry, g: int): ...
    def select(self, carry, g: int, q, w, visible, k: int): ...
    def plan_group(self, carry, g: int, tokens, mask, slots) -> tuple[Any, Any]: ...
    def attend(self, carry, l, g: int, plan, q_lat, q_pe, kv_new, write_pos): ...


def forward(params: dict, tokens: jax.Array, positions: jax.Array, write_pos: jax.Array,
            backend: Backend, carry, *, config, dense: bool = False,
            query_block: int | None = None, return_hidden: bool = False):
    """Logits of T new tokens per request, and the backend's updated carry.

    Args:
      params: the model's parameter dict.
      tokens: [B, T] int32; positions: [B, T] int32 absolute positions of the new tokens.
      write_pos: [B, T] int32: where each new token's KV goes (its position, or an out-of-range
        index for padding entries, which every backend drops).
      backend, carry: see the module docstring.
      dense: attend to the whole causal prefix instead of the top-k (the dense model); the
        indexer keys are still computed and stored.
      query_block: run the selection over blocks of this many queries (None: all T at once);
        the backend blocks its attention with its own setting (the same one, in fo_jax).
      return_hidden: also return the last hidden state [B, T, E] (the residual stream after
        the last layer, before the final norm: what a multi-token-prediction layer reads).
        The logits are the same either way (the same operations run).
    Returns:
      logits [B, T, V] float32, carry; with return_hidden: logits, carry, hidden [B, T, E].
    """
    x, carry = forward_layers(params, params["embed"][tokens], positions, write_pos, backend,
                              carry, config=config, dense=dense, query_block=query_block)
    logits = matmul_f32(rms_norm(x, params["norm"], config.norm_eps),
                        params["head"])  # float32 head, as the reference
    if return_hidden:
        return logits, carry, x
    return logits, carry


def forward_layers(params: dict, x: jax.Array, positions: jax.Array, write_pos: jax.Array,
                   backend: Backend, carry, *, config, dense: bool = False,
                   query_block: int | None = None):
    """The layer loop of `forward` on input activations x [B, T, E]: (x after the last layer
    [B, T, E], carry). `params` needs the stacks ("layers", "indexer", "moe" / "dense_mlp"),
    not embed / norm / head; the MTP block (`fo_jax.model.mtp`) runs its one layer with it."""
    layers = params["layers"]
    for g, (lo, hi) in enumerate(config.group_bounds):
        first = layer_slice(layers, lo)
        ip = layer_slice(params["indexer"], g)
        h = rms_norm(x, first["attn_norm"], config.norm_eps)
        carry = backend.write_index_keys(carry, g, indexer_keys(ip, h, positions, config=config),
                                         write_pos)
        if dense:
            plan = None
        else:
            qr = query_lowrank(first, h, config=config)
            q_i, w_i = indexer_queries(ip, qr, h, positions, config=config)
            selected, mask, slots = over_query_blocks(
                lambda q, w, visible, g=g, carry=carry: backend.select(
                    carry, g, q, w, visible, config.index_topk),
                query_block, q_i, w_i, positions + 1)
            carry, plan = backend.plan_group(carry, g, selected, mask, slots)

        def body(l, state, g=g, plan=plan, is_moe=False):
            x, carry = state
            lp = layer_slice(layers, l)
            h = rms_norm(x, lp["attn_norm"], config.norm_eps)
            qr = query_lowrank(lp, h, config=config)
            q_lat, q_pe, kv_new = attention_inputs(lp, h, qr, positions, config=config)
            carry, out_lat = backend.attend(carry, l, g, plan, q_lat, q_pe, kv_new, write_pos)
            x = x + attention_output(lp, out_lat, config=config)
            h = rms_norm(x, lp["ffn_norm"], config.norm_eps)
            x = x + feed_forward(params, l, h, config=config, is_moe=is_moe)
            return x, carry

        # Dense-MLP layers and MoE layers of the group run as two loops (one of them empty
        # unless the group straddles first_k_dense_replace).
        for start, end, is_moe in config.mlp_ranges(lo, hi):
            x, carry = jax.lax.fori_loop(start, end, functools.partial(body, is_moe=is_moe),
                                         (x, carry))
    return x, carry


def feed_forward(params: dict, l, h: jax.Array, *, config, is_moe: bool) -> jax.Array:
    """The MLP of layer l (an int or a traced index) on h [B, T, E]: the dense SwiGLU, or with
    `is_moe` (l >= first_k_dense_replace) the MoE of `fo_jax.model.moe`."""
    if is_moe:
        return moe_mlp(h, layer_slice(params["moe"], l - config.num_dense_layers), config=config)
    stack = params["dense_mlp"] if config.moe else params["layers"]
    mp = layer_slice({name: stack[name] for name in ("w1", "w2", "w3")}, l)
    return swiglu_mlp(h, mp["w1"], mp["w2"], mp["w3"])


def xla_select(keys, q, w, visible, k: int, *, key_block: int | None = None):
    """The XLA selection: indexer scores over all S keys [B, S, N], then `select_topk`.

    key_block: compute the scores over blocks of this many keys (`indexer_scores_blocked`), so
    the per-head dots [B, T, I, key_block] stay bounded; None (or >= S): all keys at once.
    """
    if key_block is None or key_block >= keys.shape[1]:
        scores = indexer_scores(q, w, keys)
    else:
        scores = indexer_scores_blocked(q, w, keys, key_block)
    tokens, mask = select_topk(scores, visible, k)
    return tokens, mask, None


def over_query_blocks(fn, block: int | None, *xs):
    """fn(*xs) computed over blocks of `block` queries; the results joined on the query axis.

    Args:
      fn: maps arrays [B, Q, ...] (Q queries) to a pytree of arrays [B, Q, ...] (None leaves
        allowed); each query's results must depend on that query's inputs alone.
      block: Q; None or >= T: fn(*xs) itself (one block, no loop).
      xs: arrays [B, T, ...].
    Returns:
      fn's pytree with arrays [B, T, ...].
    A `fori_loop` over ceil(T / Q) blocks: block i reads queries [start, start + Q) with
    start = min(i Q, T - Q) (the last block overlaps the one before and overwrites its results
    for those queries) and writes its results in place into the [B, T, ...] outputs.
    Temporaries of fn are those of Q queries.
    """
    num_t = xs[0].shape[1]
    if block is None or block >= num_t:
        return fn(*xs)
    if block < 1:
        raise ValueError(f"query_block={block} must be >= 1 (or None: all queries at once)")

    def piece(start):
        return [jax.lax.dynamic_slice_in_dim(x, start, block, axis=1) for x in xs]

    shapes = jax.eval_shape(lambda *a: fn(*a), *piece(0))
    out = jax.tree_util.tree_map(
        lambda a: jnp.zeros((a.shape[0], num_t) + a.shape[2:], a.dtype), shapes)

    def body(i, out):
        start = jnp.minimum(i * block, num_t - block)
        got = fn(*piece(start))
        return jax.tree_util.tree_map(
            lambda o, v: jax.lax.dynamic_update_slice_in_dim(o, v, start, axis=1), out, got)

    return jax.lax.fori_loop(0, -(-num_t // block), body, out)


def indexer_scores_blocked(q, w, keys, key_block: int):
    """`indexer_scores` over blocks of `key_block` keys: [B, T, S].

    Temporaries: the per-head dots of one key block, [B, T, I, key_block], instead of
    [B, T, I, S]. Blocks as in `over_query_blocks` (the last one overlaps).
    """
    num_s = keys.shape[1]
    batch, num_t = q.shape[:2]
    out = jnp.zeros((batch, num_t, num_s), jnp.float32)

    def body(i, out):
        start = jnp.minimum(i * key_block, num_s - key_block)
        part = jax.lax.dynamic_slice_in_dim(keys, start, key_block, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(out, indexer_scores(q, w, part), start,
                                                   axis=2)

    return jax.lax.fori_loop(0, -(-num_s // key_block), body, out)

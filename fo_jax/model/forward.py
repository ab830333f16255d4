"""The layer loop of the DSA model, shared by every inference path.

`forward` runs embeddings -> for each indexer group: the group's indexer and top-k selection,
then a `jax.lax.fori_loop` over the group's layers -> final norm and head. Where the KV lives is
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
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from fo_jax.model.attention import attention_inputs, attention_output, query_lowrank
from fo_jax.model.dsa import layer_slice
from fo_jax.model.indexer import indexer_keys, indexer_queries, indexer_scores, select_topk
from fo_jax.model.layers import matmul_f32, rms_norm, swiglu_mlp


@runtime_checkable
class Backend(Protocol):
    def write_index_keys(self, carry, g: int, keys, write_pos): ...
    def index_keys(self, carry, g: int): ...
    def select(self, carry, g: int, q, w, visible, k: int): ...
    def plan_group(self, carry, g: int, tokens, mask, slots) -> tuple[Any, Any]: ...
    def attend(self, carry, l, g: int, plan, q_lat, q_pe, kv_new, write_pos): ...


def forward(params: dict, tokens: jax.Array, positions: jax.Array, write_pos: jax.Array,
            backend: Backend, carry, *, config, dense: bool = False):
    """Logits of T new tokens per request, and the backend's updated carry.

    Args:
      params: the model's parameter dict.
      tokens: [B, T] int32; positions: [B, T] int32 absolute positions of the new tokens.
      write_pos: [B, T] int32: where each new token's KV goes (its position, or an out-of-range
        index for padding entries, which every backend drops).
      backend, carry: see the module docstring.
      dense: attend to the whole causal prefix instead of the top-k (the dense model); the
        indexer keys are still computed and stored.
    Returns:
      logits [B, T, V] float32, carry.
    """
    x = params["embed"][tokens]
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
            selected, mask, slots = backend.select(carry, g, q_i, w_i, positions + 1,
                                                   config.index_topk)
            carry, plan = backend.plan_group(carry, g, selected, mask, slots)

        def body(l, state, g=g, plan=plan):
            x, carry = state
            lp = layer_slice(layers, l)
            h = rms_norm(x, lp["attn_norm"], config.norm_eps)
            qr = query_lowrank(lp, h, config=config)
            q_lat, q_pe, kv_new = attention_inputs(lp, h, qr, positions, config=config)
            carry, out_lat = backend.attend(carry, l, g, plan, q_lat, q_pe, kv_new, write_pos)
            x = x + attention_output(lp, out_lat, config=config)
            h = rms_norm(x, lp["ffn_norm"], config.norm_eps)
            x = x + swiglu_mlp(h, lp["w1"], lp["w2"], lp["w3"])
            return x, carry

        x, carry = jax.lax.fori_loop(lo, hi, body, (x, carry))
    x = rms_norm(x, params["norm"], config.norm_eps)
    logits = matmul_f32(x, params["head"])  # float32 head, as the reference
    return logits, carry


def xla_select(keys, q, w, visible, k: int):
    """The XLA selection: indexer scores over all S keys [B, S, N], then `select_topk`."""
    tokens, mask = select_topk(indexer_scores(q, w, keys), visible, k)
    return tokens, mask, None

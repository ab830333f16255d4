"""The notation of fo_jax: axis letters, and the array aliases built from them.

Every shape comment, docstring and einsum string in the project uses these letters:

    B  batch (requests)              W  ways: query positions per request per decode step
    T  new tokens in a chunk         S  token positions (context capacity)
    C  hot-cache slots per layer     K  top-k (tokens each query attends to)
    L  layers                        G  indexer groups (layers sharing one indexer)
    H  attention heads               I  indexer heads
    D  latent width (kv_lora_rank)   R  RoPE width (qk_rope_head_dim)
    E  model width (dim)             V  vocabulary
    N  indexer head width            P  host pages (token blocks) per request
    Z  tokens per page / tail block (b in the design notes)
    M  miss capacity per step (K * W)
    F  pages in a pool (host KV [L, F, Z, D+R], indexer keys [G, F, Z, N]), addressed by a
       page table [B, P] of int32 page ids (-1: not held)

A KV row is `D + R` wide (576 at real size): the RMS-normed latent followed by the RoPE key.
Under `kv_format="fp8_ds_mla"` the cache stores it as Y = D + 4 D / min(128, D) + 2 R uint8
bytes (656 at real size; fo_jax.model.kv_format), so the last axis of stored KV arrays (written
`D + R` in their shape comments) is Y there.
"""

from __future__ import annotations

from typing import TypeAlias

import jax
from jaxtyping import Array, Bool, Float, Int, Shaped, UInt8

PRNGKey: TypeAlias = jax.Array

Tokens: TypeAlias = Int[Array, "B T"]
Logits: TypeAlias = Float[Array, "B T V"]
Lengths: TypeAlias = Int[Array, "B"]
KVRows: TypeAlias = Float[Array, "B W K D+R"]
KVCache: TypeAlias = Float[Array, "L B S D+R"]
IndexKeys: TypeAlias = Float[Array, "G B S N"]
Selection: TypeAlias = Int[Array, "B W K"]
SelectionMask: TypeAlias = Bool[Array, "B W K"]

__all__ = [
    "Array",
    "Bool",
    "Float",
    "Int",
    "IndexKeys",
    "KVCache",
    "KVRows",
    "Lengths",
    "Logits",
    "PRNGKey",
    "Selection",
    "SelectionMask",
    "Shaped",
    "Tokens",
    "UInt8",
]

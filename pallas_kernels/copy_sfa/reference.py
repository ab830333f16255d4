"""The CopySFA contract, its checks, and the pure-jnp reference.

Contract (shared by the Pallas kernel and the XLA path), for one layer:

  q_lat      [B, W, H, D]    float32  queries absorbed into the latent space
  q_pe       [B, W, H, R]    float32  RoPE part of the queries
  hot        [B, C2, D+R]    bf16/f32 the layer's hot cache (C slots + 2 tail blocks = C2 rows)
  host       [B, S, D+R]     same     the layer's authoritative rows of every token (host memory)
  read_slot  [B, W, K]       int32    row of the UPDATED hot cache for each selected token, in
                                      canonical order (ascending token), -1 padding at the end
  miss_token [B, M]          int32    host row of each miss; entries >= num_miss[b] are padding
  miss_slot  [B, M]          int32    victim slot of each miss; same padding
  num_miss   [B]             int32    number of valid (miss_token, miss_slot) pairs

  hot_updated = hot with hot_updated[b, miss_slot[b, i]] = host[b, miss_token[b, i]]
                for i < num_miss[b]
  rows        = hot_updated[b, read_slot[b, w]]                      (as float32)
  s[h, k]     = (q_lat[h] . rows[k, :D] + q_pe[h] . rows[k, D:]) * scale, -inf where padding
  out[h]      = sum_k softmax_k(s[h])[k] * rows[k, :D]; 0 for a way whose entries are all padding

Stacked form (`layer` given; what a decode step over stacked layers passes):

  hot        [L, B, C2, D+R]          every layer's hot cache
  host       [L, B, S, D+R]           every layer's host rows
  layer      []              int32    the layer to attend over (may be traced); clamped to
                                      [0, L) like `lax.dynamic_index_in_dim`

  out, hot_updated[layer] = the per-layer contract on (hot[layer], host[layer]); every other
  layer of hot_updated is hot's, bit for bit. The kernel touches only layer `layer` and writes
  it in place, so no layer is sliced out or copied back.

Paged form (`page_table` given; what a decode step over a shared page pool passes):

  host       [F, Z, D+R] (or [L, F, Z, D+R] with a layer)   a pool of F pages of Z rows
  page_table [B, P]          int32    pool page of each request's page (-1: not held)

  host row of token t of request b = host[page_table[b, t // Z], t % Z]; the per-request
  contract above holds with host[b] = those rows (S = P Z). Every valid miss lies in a held page.

Rows at padding entries are never read (they may hold NaN). Two checks guard the contract:
`static_validate_inputs` (shapes, dtypes: trace time, ValueError) and `check_copy_sfa_inputs`
(values: ids in range, victims distinct; on concrete arrays, for tests and debug runs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def static_validate_inputs(
    q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss, *, scale, layer=None,
    page_table=None,
) -> None:
    """Trace-time checks of shapes and dtypes; raises ValueError saying what was expected."""
    if page_table is not None:
        b = q_lat.shape[0] if q_lat.ndim else None
        if page_table.ndim != 2 or page_table.shape[0] != b or page_table.dtype != jnp.int32:
            raise ValueError(
                f"page_table must be [B={b}, P] int32, got {page_table.shape=} "
                f"{page_table.dtype=}"
            )
        paged = 4 if layer is not None else 3
        if host.ndim != paged:
            raise ValueError(
                f"with a page_table, host must be a pool [{'L, ' if layer is not None else ''}F, "
                f"Z, D+R], got {host.shape=}"
            )
        # The per-request view the checks below expect: [(L,) B, P Z, D+R].
        lead = host.shape[:-3]
        host = jax.ShapeDtypeStruct(
            (*lead, b, page_table.shape[1] * host.shape[-2], host.shape[-1]), host.dtype
        )
    if q_lat.ndim != 4:
        raise ValueError(f"q_lat must be [B, W, H, D], got {q_lat.shape=}")
    b, w, h, d = q_lat.shape
    if q_pe.ndim != 4 or q_pe.shape[:3] != (b, w, h):
        raise ValueError(f"q_pe must be [B={b}, W={w}, H={h}, R], got {q_pe.shape=}")
    r = q_pe.shape[3]
    if layer is None:
        hot_shape, host_shape, lead = hot.shape, host.shape, ""
    else:
        _check_layer(layer)
        if hot.ndim != 4 or host.ndim != 4 or host.shape[0] != hot.shape[0]:
            raise ValueError(
                f"with a layer, hot must be [L, B={b}, C2, D+R={d + r}] and host [L, B={b}, S, "
                f"D+R={d + r}] with the same L, got {hot.shape=} and {host.shape=}"
            )
        hot_shape, host_shape, lead = hot.shape[1:], host.shape[1:], f"L={hot.shape[0]}, "
    if len(hot_shape) != 3 or hot_shape[0] != b or hot_shape[2] != d + r:
        raise ValueError(f"hot must be [{lead}B={b}, C2, D+R={d + r}], got {hot.shape=}")
    if len(host_shape) != 3 or host_shape[0] != b or host_shape[2] != d + r:
        raise ValueError(f"host must be [{lead}B={b}, S, D+R={d + r}], got {host.shape=}")
    if read_slot.ndim != 3 or read_slot.shape[:2] != (b, w):
        raise ValueError(f"read_slot must be [B={b}, W={w}, K], got {read_slot.shape=}")
    if miss_token.ndim != 2 or miss_token.shape[0] != b:
        raise ValueError(f"miss_token must be [B={b}, M], got {miss_token.shape=}")
    if miss_slot.shape != miss_token.shape:
        raise ValueError(f"{miss_slot.shape=} must equal {miss_token.shape=}")
    if num_miss.shape != (b,):
        raise ValueError(f"num_miss must be [B={b}], got {num_miss.shape=}")
    for name, array in (("q_lat", q_lat), ("q_pe", q_pe)):
        if array.dtype != jnp.float32:
            raise ValueError(f"{name}.dtype={array.dtype} must be float32")
    if hot.dtype not in KV_DTYPES:
        raise ValueError(f"hot.dtype={hot.dtype} must be bfloat16 or float32")
    if host.dtype != hot.dtype:
        raise ValueError(f"host.dtype={host.dtype} must equal hot.dtype={hot.dtype}")
    for name, array in (
        ("read_slot", read_slot),
        ("miss_token", miss_token),
        ("miss_slot", miss_slot),
        ("num_miss", num_miss),
    ):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={array.dtype} must be int32")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"{scale=} must be a Python float (it is baked into the kernel)")


def _check_layer(layer) -> None:
    if isinstance(layer, bool) or not (
        jnp.ndim(layer) == 0 and jnp.issubdtype(jnp.result_type(layer), jnp.integer)
    ):
        raise ValueError(
            f"layer must be an integer scalar (int32, may be traced), got {layer!r} of shape "
            f"{jnp.shape(layer)}"
        )


def check_copy_sfa_inputs(
    read_slot, miss_token, miss_slot, num_miss, *, num_slots, num_tokens, layer=None,
    num_layers=None,
):
    """Value checks on concrete arrays; raises ValueError naming the first bad entry.

    Not jittable (it reads the values). Checks: 0 <= num_miss <= M; valid miss tokens in
    [0, num_tokens) and victim slots in [0, num_slots), victims pairwise distinct (two misses in
    one slot would make `hot_updated` ambiguous); read slots in [-1, num_slots) with the -1
    padding only at the end of each way (canonical order); with a `layer`, 0 <= layer <
    num_layers (the kernel would clamp it, and silently attend over another layer).
    """
    if layer is not None and not 0 <= int(layer) < num_layers:
        raise ValueError(f"layer={int(layer)} must be in [0, {num_layers=})")
    read_slot, miss_token, miss_slot, num_miss = (
        np.asarray(a) for a in (read_slot, miss_token, miss_slot, num_miss)
    )
    m = miss_token.shape[1]
    for b, n in enumerate(num_miss.tolist()):
        if not 0 <= n <= m:
            raise ValueError(f"num_miss[{b}]={n} must be in [0, M={m}]")
        tokens, slots = miss_token[b, :n], miss_slot[b, :n]
        if n and not (0 <= tokens.min() and tokens.max() < num_tokens):
            raise ValueError(
                f"miss_token[{b}, :{n}] must be in [0, {num_tokens=}), got "
                f"[{tokens.min()}, {tokens.max()}]"
            )
        if n and not (0 <= slots.min() and slots.max() < num_slots):
            raise ValueError(
                f"miss_slot[{b}, :{n}] must be in [0, {num_slots=}), got "
                f"[{slots.min()}, {slots.max()}]"
            )
        if len(np.unique(slots)) != n:
            raise ValueError(f"miss_slot[{b}, :{n}] must be distinct, got {slots.tolist()}")
    if read_slot.size and not (-1 <= read_slot.min() and read_slot.max() < num_slots):
        raise ValueError(
            f"read_slot must be in [-1, {num_slots=}), got [{read_slot.min()}, {read_slot.max()}]"
        )
    padding = read_slot < 0
    late = padding[..., :-1] & ~padding[..., 1:]  # a real entry right after a padding one
    if late.any():
        b, w, k = np.argwhere(late)[0].tolist()
        raise ValueError(f"read_slot[{b}, {w}] has an entry after the -1 padding at k={k + 1}")


def _install_misses(hot, host, miss_token, miss_slot, num_miss):
    """One sequence: hot [C2, D+R] with the first num_miss host rows written to their victims."""
    c2 = hot.shape[0]
    valid = jnp.arange(miss_token.shape[0]) < num_miss
    rows = host[jnp.where(valid, miss_token, 0)]
    return hot.at[jnp.where(valid, miss_slot, c2)].set(rows, mode="drop")  # c2 is dropped


def _attend(q_lat, q_pe, rows, read_slot, *, scale):
    """One sequence: q_lat [W, H, D], q_pe [W, H, R], rows [W, K, D+R] float32 -> [W, H, D]."""
    d = q_lat.shape[-1]
    valid = (read_slot >= 0)[:, None, :]  # [W, 1, K]
    rows = jnp.where((read_slot >= 0)[:, :, None], rows, 0.0)  # padding rows may be NaN
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("whd,wkd->whk", q_lat, rows[..., :d], precision=hi)
    s = (s + jnp.einsum("whr,wkr->whk", q_pe, rows[..., d:], precision=hi)) * scale
    s = jnp.where(valid, s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)  # an all-padding way: every s is -inf
    e = jnp.exp(s - s_max)  # exactly 0 at padding
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)  # all-padding way: p = 0, out = 0
    return jnp.einsum("whk,wkd->whd", p, rows[..., :d], precision=hi)


def _copy_sfa_one_sequence(
    q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss, *, scale
):
    hot_updated = _install_misses(hot, host, miss_token, miss_slot, num_miss)
    rows = hot_updated[jnp.maximum(read_slot, 0)].astype(jnp.float32)  # [W, K, D+R]
    return _attend(q_lat, q_pe, rows, read_slot, scale=scale), hot_updated


def copy_sfa_reference(
    q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss, *, scale, layer=None,
    page_table=None,
):
    """Sparse MLA attention over hot-cache rows after installing the misses (see module doc).

    With `page_table` [B, P], `host` is a page pool ([F, Z, D+R], or [L, F, Z, D+R] with a
    layer) read through the table (pages not held read pool page 0; no valid miss is there).

    Returns:
      out: [B, W, H, D] float32.
      hot_updated: `hot` with each valid miss written into its victim slot: [B, C2, D+R], or,
        with a `layer`, the whole [L, B, C2, D+R] stack with only layer `layer` written.
    """
    static_validate_inputs(
        q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss, scale=scale,
        layer=layer, page_table=page_table,
    )
    if page_table is not None:  # the per-request rows, through the table
        b, p = page_table.shape
        pages = host[..., jnp.maximum(page_table, 0), :, :]  # [(L,) B, P, Z, D+R]
        host = pages.reshape(*host.shape[:-3], b, p * host.shape[-2], host.shape[-1])
    if layer is not None:
        hot_l = jax.lax.dynamic_index_in_dim(hot, layer, axis=0, keepdims=False)
        host_l = jax.lax.dynamic_index_in_dim(host, layer, axis=0, keepdims=False)
        out, hot_l = copy_sfa_reference(
            q_lat, q_pe, hot_l, host_l, read_slot, miss_token, miss_slot, num_miss, scale=scale
        )
        return out, jax.lax.dynamic_update_index_in_dim(hot, hot_l, layer, axis=0)
    one = functools.partial(_copy_sfa_one_sequence, scale=float(scale))
    return jax.vmap(one)(q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss)

"""LIM (lightning-indexer-manage): indexer scores of all tokens fused with the hot-cache lookup.

    scores, payload = lim_scores(q_index, weights, index_keys, token_to_slot, visible, ...)
    tokens, slots, top = lim_select(scores, payload, k=k)   # lax.top_k, in XLA
    tokens, slots, top = lim(...)                           # both: lim_reference's results

`lim_scores` is the Pallas TPU kernel: for every way and token, the float32 indexer score (-inf
exactly where s >= visible[b, w]) and an int32 payload: the token's hot-cache slot if it is
resident (>= 0), `MISS` (-1) if it is visible and not resident, `HIDDEN` (-2) if the way may not
see it. `lim_select` takes the top-k by score alone (the payload rides along and never enters
the ordering, so the selection is `lax.top_k` of the float32 scores, bit for bit; the token
indices are top_k's own int32 indices) and returns it in canonical order (ascending token,
padding last). `lim_reference` (reference.py) is the pure-jnp oracle.

Forms: per request (`index_keys` [B, S, N], `token_to_slot` [B, S]); stacked groups (`group`:
[G, B, S, N] and [G, B, S], only group `group` is read); paged keys (`page_table` [B, P] int32:
`index_keys` a pool [F, Z, N] or [G, F, Z, N], key of token t of request b at
index_keys[page_table[b, t // Z], t % Z]). `index_keys` may be a host-memory-kind array (the
tile DMAs then read host memory); in interpret mode it must be device-kind, and
`keys_memory_space=Space.Host` models the host DMA.

Contracts: S <= `MAX_TOKENS` and slots <= `MAX_SLOTS` (2**31 - 1); the slot map and visibility
are int32. Static violations raise ValueError at trace time; value checks (slot ids in range,
none below -1) are `check_lim_inputs`.

Design (tiling, the payload's bit budget, why the group and page table are scalar-prefetched,
memory spaces): docs/design/kernels.md.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.lim.block_sizes import BlockSizes

Space = jax.memory.Space

MISS = -1  # payload of a visible token that is not resident
HIDDEN = -2  # payload of a token the way may not see (s >= visible)
MAX_TOKENS = 2**31 - 1  # lax.top_k returns int32 token indices
MAX_SLOTS = 2**31 - 1  # the slot takes the non-negative half of the int32 payload


def _check_token_budget(s: int) -> None:
    if s > MAX_TOKENS:
        raise ValueError(
            f"{s=} tokens overflow the LIM payload budget: token indices are the int32 indices "
            f"returned by lax.top_k, 31 bits, so S must be <= {MAX_TOKENS}"
        )


def _check_group(group) -> None:
    if isinstance(group, bool) or not (
        jnp.ndim(group) == 0 and jnp.issubdtype(jnp.result_type(group), jnp.integer)
    ):
        raise ValueError(
            f"group must be an integer scalar (int32, may be traced), got {group!r} of shape "
            f"{jnp.shape(group)}"
        )


def _check_shapes(
    q_index, weights, index_keys, token_to_slot, visible, *, k, group=None, page_table=None
) -> tuple[int, ...]:
    """Static checks of the LIM inputs; returns (B, W, I, N, S)."""
    if q_index.ndim != 4:
        raise ValueError(f"q_index must be [B, W, I, N], got {q_index.shape=}")
    b, w, i, n = q_index.shape
    if page_table is not None:
        if page_table.ndim != 2 or page_table.shape[0] != b or page_table.dtype != jnp.int32:
            raise ValueError(
                f"page_table must be [B={b}, P] int32, got {page_table.shape=} "
                f"{page_table.dtype=}"
            )
        pool_rank, lead = (4, "G, ") if group is not None else (3, "")
        if index_keys.ndim != pool_rank:
            raise ValueError(
                f"with a page_table, index_keys must be a pool [{lead}F, Z, N={n}], got "
                f"{index_keys.shape=}"
            )
        # The per-request view the checks below expect: [(G,) B, P Z, N].
        index_keys = jax.ShapeDtypeStruct(
            (*index_keys.shape[:-3], b, page_table.shape[1] * index_keys.shape[-2],
             index_keys.shape[-1]), index_keys.dtype)
    keys_shape, slots_shape, lead = index_keys.shape, token_to_slot.shape, ""
    if group is not None:
        _check_group(group)
        if (index_keys.ndim != 4 or token_to_slot.ndim != 3
                or token_to_slot.shape[0] != index_keys.shape[0]):
            raise ValueError(
                f"with a group, index_keys must be [G, B={b}, S, N={n}] and token_to_slot "
                f"[G, B={b}, S] with the same G, got {index_keys.shape=} and "
                f"{token_to_slot.shape=}"
            )
        keys_shape, slots_shape = keys_shape[1:], slots_shape[1:]
        lead = f"G={index_keys.shape[0]}, "
    if len(keys_shape) != 3 or keys_shape[0] != b or keys_shape[2] != n:
        raise ValueError(f"index_keys must be [{lead}B={b}, S, N={n}], got {index_keys.shape=}")
    s = keys_shape[1]
    _check_token_budget(s)
    expected = {"weights": (b, w, i), "token_to_slot": (b, s), "visible": (b, w)}
    for name, shape in (("weights", weights.shape), ("token_to_slot", slots_shape),
                        ("visible", visible.shape)):
        if shape != expected[name]:
            raise ValueError(f"{name} must have shape {lead}{expected[name]}, got {shape}")
    for name, array in (("q_index", q_index), ("weights", weights)):
        if array.dtype != jnp.float32:
            raise ValueError(f"{name}.dtype={array.dtype} must be float32")
    if index_keys.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"{index_keys.dtype=} must be bfloat16 or float32")
    for name, array in (("token_to_slot", token_to_slot), ("visible", visible)):
        if array.dtype != jnp.int32:
            raise ValueError(
                f"{name}.dtype={array.dtype} must be int32: the LIM payload is 32 bits, slots take "
                f"its 31 non-negative bits (C <= {MAX_SLOTS})"
            )
    if not 1 <= k <= s:
        raise ValueError(f"{k=} must be in [1, {s=}]")
    return b, w, i, n, s


def check_lim_inputs(token_to_slot, visible, *, num_slots: int, group=None) -> None:
    """Value checks (host side, concrete arrays): slots in [-1, num_slots), visible >= 0, and
    with a `group`, 0 <= group < G = token_to_slot.shape[0] (the kernel would clamp it and
    silently read another group).

    Not run by `lim` itself (it would need the values on the host); tests and debug paths call it.
    """
    if not 0 < num_slots <= MAX_SLOTS:
        raise ValueError(f"{num_slots=} overflows the LIM payload: must be in [1, {MAX_SLOTS}]")
    if group is not None and not 0 <= int(group) < token_to_slot.shape[0]:
        raise ValueError(f"group={int(group)} must be in [0, G={token_to_slot.shape[0]})")
    slots = jax.device_get(token_to_slot)
    lo, hi = int(slots.min()), int(slots.max())
    if lo < MISS or hi >= num_slots:
        raise ValueError(
            f"token_to_slot values must be in [{MISS}, {num_slots}), got [{lo}, {hi}]"
        )
    vis = jax.device_get(visible)
    if int(vis.min()) < 0:
        raise ValueError(f"visible must be >= 0, got min {int(vis.min())}")


def _lim_kernel(
    # Scalar prefetch
    visible_max_ref,  # [B] int32 in SMEM: tokens visible to some way of request b
    group_ref,  # [1] int32 in SMEM: the group of keys and slots (unused when they are per-group)
    table_ref,  # [B, P] int32 in SMEM: pool page of each page of a request (paged keys only)
    # Inputs
    q_ref,  # [1, W * I, N] float32: queries of request b, ways major, heads minor
    weights_ref,  # [1, W * I, 1] float32
    visible_ref,  # [1, W, 1] int32
    keys_hbm_ref,  # [G, B, S, N] or [B, S, N] (paged: [G, F, Z, N] or [F, Z, N]) bfloat16 /
    #                float32 in device (HBM) or host memory
    slots_hbm_ref,  # [G, B, S] or [B, S] int32 in device memory
    # Outputs
    scores_ref,  # [1, W, block_s] float32
    payload_ref,  # [1, W, block_s] int32
    # Scratch
    keys_buf,  # [2, block_s, N] VMEM double buffer of key tiles
    slots_buf,  # [2, 1, block_s] int32 VMEM double buffer of slot tiles
    sems,  # [2, 2] DMA semaphores: [buffer, (keys, slots)]
    *,
    block_s: int,
    num_ways: int,
    num_heads: int,
    stacked: bool,
    page: int | None,
):
    b = pl.program_id(0)
    tile = pl.program_id(1)
    at = (group_ref[0],) if stacked else ()  # leading index of the keys / slots DMAs
    num_tiles = pl.num_programs(1)
    visible_max = visible_max_ref[b]

    def needed(t):  # tiles are visible as a prefix: skip the DMA and the matmul past it
        return t * block_s < visible_max

    def key_copies(t, buf, start):
        if page is None:  # per-request keys: one DMA of the tile
            return (pltpu.make_async_copy(
                keys_hbm_ref.at[(*at, b, pl.ds(start, block_s), slice(None))],
                keys_buf.at[buf],
                sems.at[buf, 0],
            ),)
        if block_s <= page:  # the tile lies in one page: one DMA from its pool page
            frame = table_ref[b, start // page]
            return (pltpu.make_async_copy(
                keys_hbm_ref.at[(*at, frame, pl.ds(start % page, block_s), slice(None))],
                keys_buf.at[buf],
                sems.at[buf, 0],
            ),)
        # block_s // page whole pages: one DMA per page, from the page table.
        first = t * (block_s // page)
        return tuple(
            pltpu.make_async_copy(
                keys_hbm_ref.at[(*at, table_ref[b, first + j], slice(None), slice(None))],
                keys_buf.at[buf, pl.ds(j * page, page)],
                sems.at[buf, 0],
            )
            for j in range(block_s // page)
        )

    def copies(t, buf):
        start = pl.multiple_of(t * block_s, block_s)
        return (
            *key_copies(t, buf, start),
            pltpu.make_async_copy(
                slots_hbm_ref.at[(*at, pl.ds(b, 1), pl.ds(start, block_s))],
                slots_buf.at[buf],
                sems.at[buf, 1],
            ),
        )

    # Each request primes its own first tile, so requests stay independent ("parallel" axis).
    @pl.when(jnp.logical_and(tile == 0, needed(0)))
    def _():
        for copy in copies(0, 0):
            copy.start()

    # Prefetch tile + 1 into the other buffer before computing this one. That buffer was last
    # read by the previous grid step, which is ordered before this start.
    @pl.when(jnp.logical_and(tile + 1 < num_tiles, needed(tile + 1)))
    def _():
        for copy in copies(tile + 1, (tile + 1) % 2):
            copy.start()

    @pl.when(needed(tile))
    def _():
        buf = tile % 2
        for copy in copies(tile, buf):
            copy.wait()
        keys = keys_buf[buf].astype(jnp.float32)  # [block_s, N]
        logits = lax.dot_general(
            q_ref[0], keys, (((1,), (1,)), ((), ())),
            precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        )  # [W * I, block_s]
        weighted = jnp.maximum(logits, 0.0) * weights_ref[0]  # [W * I, block_s]
        scores = jnp.sum(weighted.reshape(num_ways, num_heads, block_s), axis=1)  # [W, block_s]
        token = tile * block_s + lax.broadcasted_iota(jnp.int32, (num_ways, block_s), 1)
        shown = token < visible_ref[0]  # [W, block_s]
        slots = jnp.broadcast_to(slots_buf[buf], (num_ways, block_s))
        scores_ref[0] = jnp.where(shown, scores, -jnp.inf)
        payload_ref[0] = jnp.where(shown, slots, HIDDEN)

    @pl.when(jnp.logical_not(needed(tile)))
    def _():
        scores_ref[0] = jnp.full((num_ways, block_s), -jnp.inf, jnp.float32)
        payload_ref[0] = jnp.full((num_ways, block_s), HIDDEN, jnp.int32)


def _keys_memory_space(index_keys, keys_memory_space, interpret):
    """The kernel-side memory space of the keys: `pl.ANY` (device memory) or host memory."""
    actual = jax.typeof(index_keys).memory_space
    actual = Space.Host if actual == Space.Host else Space.Device
    requested = actual if keys_memory_space is None else keys_memory_space
    if requested not in (Space.Device, Space.Host):
        raise ValueError(f"{keys_memory_space=} must be None, {Space.Device} or {Space.Host}")
    if interpret and actual == Space.Host:
        raise NotImplementedError(
            "TPU interpret mode cannot take a host-memory-kind index_keys (jax bug in 0.10.2 and "
            "0.12: a jit with an interpret-mode kernel and a non-default memory kind fails with "
            "'safe_zip() argument 1 has length ...'); keep the array in device memory kind and "
            f"pass keys_memory_space={Space.Host} to model the host DMA"
        )
    if not interpret and requested != actual:
        raise ValueError(
            f"{keys_memory_space=} must match the memory kind of index_keys ({actual}) on the "
            "Mosaic TPU backend; only interpret mode may read a device-kind array as host memory"
        )
    return Space.Host if requested == Space.Host else pl.ANY


@functools.partial(
    jax.jit, static_argnames=("block_sizes", "keys_memory_space", "interpret")
)
def lim_scores(
    q_index, weights, index_keys, token_to_slot, visible, *, group=None, page_table=None,
    block_sizes: BlockSizes | None = None, keys_memory_space: Space | None = None,
    interpret=False,
):
    """The LIM kernel: per-way indexer scores of every token and the slot payload.

    Args:
      q_index: [B, W, I, N] float32 indexer queries (rotated).
      weights: [B, W, I] float32 head weights (scaled).
      index_keys: [B, S, N] (or [G, B, S, N] with `group`) bfloat16 or float32 indexer keys,
        device or host memory.
      token_to_slot: [B, S] (or [G, B, S] with `group`) int32 hot-cache slot of each token, -1
        if not resident.
      visible: [B, W] int32: way w of request b may select tokens 0 .. visible[b, w] - 1.
      group: None for per-group keys and slots; an int32 scalar (may be traced) for stacked
        ones: only group `group` is read. Clamped to [0, G) like `lax.dynamic_index_in_dim`.
      page_table: None for per-request keys; [B, P] int32 for a key pool `index_keys`
        ([F, Z, N], or [G, F, Z, N] with a group): token t of request b is key
        index_keys[page_table[b, t // Z], t % Z] (S = P Z). The table reaches the kernel by
        scalar prefetch; a tile is one DMA per page (block_s a multiple of Z) or one DMA
        inside a page (Z a multiple of block_s). Pages not held (-1) read pool page 0: no
        visible token is there.
      block_sizes: tiling of S; `BlockSizes.get_default(s=S, interpret=...)` if None.
      keys_memory_space: where the kernel DMAs the keys from: None follows the memory kind of
        `index_keys`; `Space.Host` on a device-kind array is for interpret mode only (it models
        the host DMA on a CPU, where the memory-kind bug forbids a real host array).
      interpret: False, True or `pltpu.InterpretParams(...)` to run on CPU.

    Returns:
      scores [B, W, S] float32 (-inf where not visible) and payload [B, W, S] int32
      (slot, MISS = -1 or HIDDEN = -2; see the module docstring).
    """
    b, w, i, n, s = _check_shapes(
        q_index, weights, index_keys, token_to_slot, visible, k=1, group=group,
        page_table=page_table,
    )
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(s=s, interpret=bool(interpret))
    block_sizes.validate(s=s, interpret=bool(interpret))
    block_s = block_sizes.block_s
    page = None if page_table is None else index_keys.shape[-2]
    if page is not None and block_s % page and page % block_s:
        raise ValueError(
            f"{block_s=} and the key pool's page size {page} must divide one another (a tile "
            "is whole pages or part of one page)"
        )
    table = (jnp.zeros((b, 1), jnp.int32) if page_table is None
             else jnp.maximum(page_table, 0))
    keys_space = _keys_memory_space(index_keys, keys_memory_space, interpret)
    visible = jnp.clip(visible, 0, s)
    visible_max = jnp.max(visible, axis=1)  # [B]
    stacked = group is not None
    if stacked:  # [1] int32 for SMEM, clamped like lax.dynamic_index_in_dim: DMAs stay in bounds
        group = jnp.clip(jnp.asarray(group, jnp.int32), 0, index_keys.shape[0] - 1).reshape(1)
    else:
        group = jnp.zeros((1,), jnp.int32)
    kernel = functools.partial(
        _lim_kernel, block_s=block_s, num_ways=w, num_heads=i, stacked=stacked, page=page
    )
    out_spec = pl.BlockSpec((1, w, block_s), lambda bi, ti, *_: (bi, 0, ti))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,  # visible_max, group, page table
            grid=(b, s // block_s),
            in_specs=[
                pl.BlockSpec((1, w * i, n), lambda bi, ti, *_: (bi, 0, 0)),
                pl.BlockSpec((1, w * i, 1), lambda bi, ti, *_: (bi, 0, 0)),
                pl.BlockSpec((1, w, 1), lambda bi, ti, *_: (bi, 0, 0)),
                pl.BlockSpec(memory_space=keys_space),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=[out_spec, out_spec],
            scratch_shapes=[
                pltpu.VMEM((2, block_s, n), index_keys.dtype),
                pltpu.VMEM((2, 1, block_s), jnp.int32),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, w, s), jnp.float32),
            jax.ShapeDtypeStruct((b, w, s), jnp.int32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name=f"lim_{block_s=}",
    )(
        visible_max,
        group,
        table,
        q_index.reshape(b, w * i, n),
        weights.reshape(b, w * i, 1),
        visible.reshape(b, w, 1),
        index_keys,
        token_to_slot,
    )


@functools.partial(jax.jit, static_argnames=("k",))
def lim_select(scores, payload, *, k):
    """Exact `lax.top_k` of the kernel's scores; the payload rides along; canonical order.

    Args:
      scores: [B, W, S] float32 from `lim_scores` (-inf where not visible).
      payload: [B, W, S] int32 from `lim_scores`.
      k: tokens selected per way (K), at most S.

    Returns:
      token [B, W, K] int32, slot [B, W, K] int32, score [B, W, K] float32: ascending token
      index, padding (-1, -1, -inf) last; slot -1 for a miss or padding.
    """
    s = scores.shape[-1]
    _check_token_budget(s)
    if scores.shape != payload.shape:
        raise ValueError(f"{scores.shape=} must equal {payload.shape=}")
    if scores.dtype != jnp.float32 or payload.dtype != jnp.int32:
        raise ValueError(f"{scores.dtype=} must be float32 and {payload.dtype=} must be int32")
    if not 1 <= k <= s:
        raise ValueError(f"{k=} must be in [1, {s=}]")
    top_score, top_token = lax.top_k(scores, k)  # [B, W, K]; ties: lower token index first
    top_payload = jnp.take_along_axis(payload, top_token, axis=-1)
    shown = top_payload != HIDDEN
    key = jnp.where(shown, top_token, jnp.iinfo(jnp.int32).max)  # padding sorts last
    slot = jnp.where(shown, top_payload, MISS)
    score = jnp.where(shown, top_score, -jnp.inf)
    key, slot, score = lax.sort((key, slot, score), dimension=-1, num_keys=1)
    token = jnp.where(key == jnp.iinfo(jnp.int32).max, -1, key)
    return token, slot, score


@functools.partial(
    jax.jit, static_argnames=("k", "block_sizes", "keys_memory_space", "interpret")
)
def lim(
    q_index, weights, index_keys, token_to_slot, visible, *, k, group=None, page_table=None,
    block_sizes: BlockSizes | None = None, keys_memory_space: Space | None = None,
    interpret=False,
):
    """LIM: the kernel's scores and payload, then the exact top-k selection in XLA.

    Same arguments and results as `lim_reference` (plus `block_sizes`, `keys_memory_space` and
    `interpret`, see `lim_scores`).
    """
    _check_shapes(q_index, weights, index_keys, token_to_slot, visible, k=k, group=group,
                  page_table=page_table)
    scores, payload = lim_scores(
        q_index, weights, index_keys, token_to_slot, visible, group=group,
        page_table=page_table,
        block_sizes=block_sizes, keys_memory_space=keys_memory_space, interpret=interpret,
    )
    return lim_select(scores, payload, k=k)

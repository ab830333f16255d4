"""The two host copies as jax calls, with their pure-jnp references.

    rows = gather_items(pool, index, item_rows=1)      # [R, item_rows, W], device memory
    pool = scatter_items(pool, rows, index, item_rows=1)  # the pool, aliased, updated in place

pool [L, F, Z, W] (any dtype, `pinned_host` or device memory) is read as L layers of N = F Z
rows; index [R, 2] int32 (device memory) names item i's (layer, first row); an item is
`item_rows` consecutive rows (1: a token's row; Z: a page). Entries whose item is not inside one
layer (padding: -1) are skipped: the gather returns zeros for them, the scatter writes nothing.
The valid entries of one scatter must name distinct rows.

Each is one XLA custom call (an FFI target, `fo_jax.offload.ffi.library`): on a GPU it reads or
writes the pinned host pool directly (one warp per row, the row list read on the device), so no
XLA op other than the call itself touches host memory and XLA's host offloader has nothing to
turn into host compute. The scatter aliases the pool operand to its result
(`input_output_aliases`): with the pool donated by the caller nothing is copied, and the result
keeps the pool's memory space. `*_reference` give the same bits with jnp ops (tests compare).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.offload.ffi.library import ensure_registered

GATHER = "fo_jax_host_gather"
SCATTER = "fo_jax_host_scatter"
BULK = "fo_jax_host_read_bulk"


def _like_pool(pool) -> jax.ShapeDtypeStruct:
    """The scatter's result type: the pool's shape, dtype and memory space.

    `jax.ShapeDtypeStruct.like(pool)` loses the host memory space inside `shard_map` (the
    manual mesh's sharding it copies carries no memory kind and wins), and the result would be
    typed as device memory: a pool-sized device buffer aliased to a host one. The private
    `_memory_space` argument (the same in jax 0.11.2 and 0.12) is the only way to say it.
    """
    return jax.ShapeDtypeStruct(pool.shape, pool.dtype,
                                _memory_space=jax.typeof(pool).memory_space)


def _check(pool, index, item_rows: int) -> None:
    if pool.ndim != 4:
        raise ValueError(f"pool must be [L, F, Z, W], got shape {pool.shape}")
    if index.ndim != 2 or index.shape[1] != 2 or index.dtype != jnp.int32:
        raise ValueError(f"index must be [R, 2] int32 (layer, row), got {index.shape} "
                         f"{index.dtype}")
    if not 1 <= item_rows <= pool.shape[1] * pool.shape[2]:
        raise ValueError(f"item_rows={item_rows} must be in [1, F Z="
                         f"{pool.shape[1] * pool.shape[2]}]")


def gather_items(pool, index, *, item_rows: int = 1):
    """[R, item_rows, W] device rows: item i = pool rows index[i, 1] .. + item_rows of layer
    index[i, 0] (zeros for a skipped entry)."""
    _check(pool, index, item_rows)
    ensure_registered()
    out = jax.ShapeDtypeStruct((index.shape[0], item_rows, pool.shape[3]), pool.dtype)
    return jax.ffi.ffi_call(GATHER, out)(pool, index, item_rows=np.int64(item_rows))


def scatter_items(pool, rows, index, *, item_rows: int = 1):
    """The pool with item i (rows[i], [item_rows, W]) written at index[i] (skipped entries
    write nothing). The pool operand is aliased to the result: donate it."""
    _check(pool, index, item_rows)
    want = (index.shape[0], item_rows, pool.shape[3])
    if rows.shape != want or rows.dtype != pool.dtype:
        raise ValueError(f"rows must be {want} {pool.dtype} (R, item_rows, W), got "
                         f"{rows.shape} {rows.dtype}")
    ensure_registered()
    return jax.ffi.ffi_call(SCATTER, _like_pool(pool), input_output_aliases={0: 0})(
        pool, rows, index, item_rows=np.int64(item_rows))


def read_bulk(pool, *, layer: int, row: int, rows: int):
    """[rows, W] device rows pool[layer, row : row + rows] (the pool seen as [L, F Z, W]) in
    one contiguous copy: the copy engine on a GPU. For benchmarks: the baseline of the same
    bytes that `gather_items` is measured against; `gather_items` with one item of `rows`
    rows gives the same bits."""
    if pool.ndim != 4:
        raise ValueError(f"pool must be [L, F, Z, W], got shape {pool.shape}")
    if not (0 <= layer < pool.shape[0] and 0 <= row and rows >= 1
            and row + rows <= pool.shape[1] * pool.shape[2]):
        raise ValueError(f"rows {row}..{row + rows} of layer {layer} are not inside the pool "
                         f"{pool.shape} seen as [L, F Z, W]")
    ensure_registered()
    out = jax.ShapeDtypeStruct((rows, pool.shape[3]), pool.dtype)
    return jax.ffi.ffi_call(BULK, out)(pool, layer=np.int64(layer), row=np.int64(row))


def _item_rows(pool, index, item_rows: int):
    """(layer, row) [R, item_rows] of every row of every item, and whether the entry is valid."""
    num_l, rows_per_layer = pool.shape[0], pool.shape[1] * pool.shape[2]
    layer, row = index[:, 0], index[:, 1]
    valid = (layer >= 0) & (layer < num_l) & (row >= 0) & (row <= rows_per_layer - item_rows)
    rows = row[:, None] + jnp.arange(item_rows, dtype=jnp.int32)[None]
    return layer, rows, valid


def gather_items_reference(pool, index, *, item_rows: int = 1):
    """`gather_items` in jnp: per item, its rows of the pool seen as [L, N, W]; zeros where
    the entry is skipped."""
    _check(pool, index, item_rows)
    flat = pool.reshape(pool.shape[0], -1, pool.shape[3])
    layer, rows, valid = _item_rows(pool, index, item_rows)
    got = flat[jnp.where(valid, layer, 0)[:, None], jnp.where(valid[:, None], rows, 0)]
    return jnp.where(valid[:, None, None], got, jnp.zeros((), pool.dtype))


def scatter_items_reference(pool, rows, index, *, item_rows: int = 1):
    """`scatter_items` in jnp: skipped entries are dropped (written out of bounds)."""
    _check(pool, index, item_rows)
    flat = pool.reshape(pool.shape[0], -1, pool.shape[3])
    layer, at, valid = _item_rows(pool, index, item_rows)
    at = jnp.where(valid[:, None], at, flat.shape[1])  # out of bounds: dropped
    flat = flat.at[layer[:, None], at].set(rows, mode="drop")
    return flat.reshape(pool.shape)


__all__ = ["gather_items", "gather_items_reference", "read_bulk", "scatter_items",
           "scatter_items_reference"]

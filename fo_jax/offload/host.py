"""Every read and write of host memory, in one place, behind one setting.

Host pages are one pool `[L, F, Z, D+R]` in `pinned_host` memory that requests share: token t
of request b, layer l, lives at [l, table[b, t // Z], t % Z] through the page table [B, P]
(int32 on the device, -1 for pages not held). Four accesses move KV rows between the pool and
the device:

  host_gather_rows  decode: one layer's missed rows, host -> device (also the prefill -> decode
                    handoff's hot rows, `fo_jax.offload.prefill.to_decode_state`)
  host_write_rows   decode: the step's new rows of every layer, device -> host (write-through)
  load_history      prefill: one layer's first pages of every request, host -> device
  write_back_rows   prefill: the chunk's new rows of one layer, device -> host

Each moves its rows in one of three ways (`fo_jax.offload.config.HOST_ACCESS`: "ffi", fo_jax's
own copy custom calls, `fo_jax.offload.ffi`; "gather", one gather / scatter on the host array;
"slices", one dynamic slice per row), chosen by `OffloadConfig.host_access` for decode and the
handoff and by `prefill(..., host_access=...)` for the prefill; None resolves by backend
(`fo_jax.offload.config.default_host_access`). Contract: all three give the same bits
(tests/offload/test_host.py runs every function, the decode step and the prefill under each);
writes to pages not held (-1) are dropped; every access runs inside `jit` (eager indexing of a
host array fails). Memory kinds: `memory_kind`, `in_host_memory`, `to_host`, `to_device`.

What each setting compiles to, what it costs on an H200, and what is known about host memory on
accelerators: docs/design/offloaded-decode.md ("Host memory access").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fo_jax.offload.config import HOST_ACCESS
from fo_jax.offload.ffi import gather_items, scatter_items

# Moves ----------------------------------------------------------------------------------------


def memory_kind(x) -> str | None:
    """The memory kind of `x` ("pinned_host" or "device"), for concrete arrays and tracers of
    an outer jit / scan / while_loop alike (a tracer has no `.sharding`); None if unknown."""
    if not isinstance(x, jax.core.Tracer):
        return getattr(x.sharding, "memory_kind", None)
    space = getattr(jax.typeof(x), "memory_space", None)
    if space == jax.memory.Space.Host:
        return "pinned_host"
    if space == jax.memory.Space.Device:
        return "device"
    return None


def in_host_memory(x) -> bool:
    """Whether `x` lives in host memory (concrete arrays and tracers alike)."""
    return memory_kind(x) not in (None, "device")


def to_host(x, on_host: bool):
    """`x` moved to host memory when the pages live there (`on_host`), else `x` itself."""
    return jax.device_put(x, jax.memory.Space.Host) if on_host else x


def to_device(x, on_host: bool):
    """`x` moved to device memory when it came from host pages (`on_host`), else `x` itself."""
    return jax.device_put(x, jax.memory.Space.Device) if on_host else x


def check_host_access(access: str) -> None:
    """Raise ValueError unless `access` is one of HOST_ACCESS."""
    if access not in HOST_ACCESS:
        raise ValueError(f"host_access={access!r}; choose one of {HOST_ACCESS}")


# Page tables ----------------------------------------------------------------------------------
#
# Host pages are a pool [L, F, Z, D+R]; a request's token t lives in pool page table[b, t // Z]
# at offset t % Z (table [B, P] int32 on the device, -1 for pages not held). Every function below
# reads and writes through the table: reads of a page not held (only padding entries, never a
# stored token) read page 0 and are never used; writes to it are dropped.


def _frame(table, b, token, page: int):
    """Pool page of `token` of request(s) b ([...] ints), -1 where the page is not held."""
    table = jnp.asarray(table)
    pages = table.shape[1]
    p = jnp.clip(token // page, 0, pages - 1)
    frame = table[b, p]
    return jnp.where((token >= 0) & (token < pages * page), frame, -1)


# "gather" helpers -----------------------------------------------------------------------------

_ROWS = jax.lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0, 1),
                                       start_index_map=(0, 1))
# Writes index the pool [L, F, Z, D+R] itself with (layer, pool page, offset): a scatter
# through a flat view once made XLA give the pages another layout at B = 1, two whole copies per
# step.
_WRITE = jax.lax.ScatterDimensionNumbers(update_window_dims=(3,),
                                         inserted_window_dims=(0, 1, 2),
                                         scatter_dims_to_operand_dims=(0, 1, 2))


def _host_index(host_kv, table, layer, tokens):
    """[B, n, 2] (layer, pool page * Z + offset) indices into host_kv viewed as [L, F Z, D+R].

    Two int32 coordinates instead of one flat row index: L and F Z each fit int32 at real
    sizes, their product may not. Pages not held read pool row 0 (never used).
    """
    page = host_kv.shape[2]
    batch = tokens.shape[0]
    frame = _frame(table, jnp.arange(batch, dtype=jnp.int32)[:, None], tokens, page)
    rows = jnp.maximum(frame, 0) * page + tokens % page
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), tokens.shape)
    return jnp.stack([layers, rows.astype(jnp.int32)], axis=-1)


# "slices" helpers -----------------------------------------------------------------------------


def _read_row(host_kv, table, layer, b, token, on_host: bool):
    """[1, 1, D+R] device copy of row `token` of request b, layer `layer`: one dynamic slice of
    the host pool at (layer, table[b, token // Z], token % Z), moved to the device (the pattern
    XLA turns into a DMA of just that row)."""
    page = host_kv.shape[2]
    frame = jnp.maximum(_frame(table, b, token, page), 0)
    start = (jnp.asarray(layer, jnp.int32), frame, token % page, jnp.int32(0))
    row = jax.lax.dynamic_slice(host_kv, start, (1, 1, 1, host_kv.shape[3]))
    return to_device(row, on_host).reshape(1, 1, host_kv.shape[3])


def _write_slices(host_kv, table, first_layer, rows, positions, on_host: bool):
    """Rows [n, B, T, D+R] into layers first_layer .. first_layer + n - 1 at positions [B, T].

    One trip per written row: n x (entries with 0 <= position < S in a held page); the others
    are dropped. Each trip moves one device row to host memory and writes it with a dynamic
    update slice whose operand, update and result all live in host memory.
    """
    num_n, batch, num_t, width = rows.shape
    page = host_kv.shape[2]
    positions = positions.astype(jnp.int32)
    frames = _frame(table, jnp.arange(batch, dtype=jnp.int32)[:, None], positions, page)
    valid = (frames >= 0).reshape(-1)
    order = jnp.argsort(~valid, stable=True).astype(jnp.int32)  # valid entries first
    count = jnp.sum(valid, dtype=jnp.int32)
    first_layer = jnp.asarray(first_layer, jnp.int32)
    rows = rows.astype(host_kv.dtype)

    def body(i, host):
        entry = order[i % count]
        layer, b, t = i // count, entry // num_t, entry % num_t
        pos = positions[b, t]
        row = jax.lax.dynamic_slice(rows, (layer, b, t, jnp.int32(0)), (1, 1, 1, width))
        row = to_host(row.reshape(1, 1, 1, width), on_host)
        return jax.lax.dynamic_update_slice(
            host, row, (first_layer + layer, frames[b, t], pos % page, jnp.int32(0)))

    return jax.lax.fori_loop(0, num_n * count, body, host_kv)


# "ffi" helpers --------------------------------------------------------------------------------


def _item_index(table, layer, tokens, valid, page: int):
    """[..., 2] int32 (layer, pool row) of each token's row for `fo_jax.offload.ffi`, (-1, -1)
    where `valid` is false or the token's page is not held (the copy skips those entries).
    `table` [B, P]; `tokens` and `valid` [B, ...]; `layer` [] or tokens' shape."""
    batch = tokens.shape[0]
    b = jnp.arange(batch, dtype=jnp.int32).reshape((batch,) + (1,) * (tokens.ndim - 1))
    frame = _frame(table, b, tokens, page)
    valid = valid & (frame >= 0)
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), tokens.shape)
    index = jnp.stack([layers, frame * page + tokens % page], axis=-1).astype(jnp.int32)
    return jnp.where(valid[..., None], index, -1)


# Decode: miss gather, write-through ------------------------------------------------------------


def host_gather_rows(host_kv, table, layer, tokens, count, *, chunk: int, on_host: bool,
                     access: str = "gather"):
    """Rows of `tokens` of one layer, from the host pool to the device, through the table.

    Args:
      host_kv: [L, F, Z, D+R] host pool; table: [B, P] int32 page table; layer: [] int;
      tokens: [B, M] (-1 padding last); count: [B] real entries per request; chunk: rows per
      gather ("gather" only); on_host: whether host_kv lives in host memory; access: "gather"
      or "slices".
    Returns:
      [B, M, D+R] device rows (entries past `count` are unspecified).
    "gather" moves ceil(max(count) / chunk) * chunk rows per request, not M: a while loop whose
    trip count is the number of chunks actually needed, each chunk one gather on the host array
    with host-side indices, then one move of just those rows to the device. "slices" moves
    sum(count) rows: one trip per real entry, one dynamic slice of one host row each. The table
    lookups are B M reads of the [B, P] table on the device.
    """
    check_host_access(access)
    batch, size = tokens.shape
    num_l, frames, page, width = host_kv.shape
    if access == "ffi":
        tokens = tokens.astype(jnp.int32)
        live = jnp.arange(size, dtype=jnp.int32)[None, :] < count.astype(jnp.int32)[:, None]
        index = _item_index(table, layer, tokens, live & (tokens >= 0), page)
        return gather_items(host_kv, index.reshape(batch * size, 2)).reshape(batch, size, width)
    if access == "slices":
        count = jnp.clip(count.astype(jnp.int32), 0, size)
        ends = jnp.cumsum(count)
        tokens = jnp.maximum(tokens.astype(jnp.int32), 0)

        def body(i, out):
            b = jnp.sum(ends <= i, dtype=jnp.int32)  # entry i belongs to request b
            m = i - (ends[b] - count[b])
            row = _read_row(host_kv, table, layer, b, tokens[b, m], on_host)
            return jax.lax.dynamic_update_slice(out, row, (b, m, jnp.int32(0)))

        out = jnp.zeros((batch, size, width), host_kv.dtype)
        return jax.lax.fori_loop(0, ends[-1], body, out)
    rows_kv = host_kv.reshape(num_l, frames * page, width)
    padded = -(-size // chunk) * chunk
    tokens = jnp.pad(jnp.maximum(tokens, 0), ((0, 0), (0, padded - size)))
    index = _host_index(host_kv, table, layer, tokens)  # [B, padded, 2]
    out = jnp.zeros((batch, padded, width), host_kv.dtype)
    trips = (jnp.max(count) + chunk - 1) // chunk

    def body(i, out):
        idx = jax.lax.dynamic_slice_in_dim(index, i * chunk, chunk, axis=1)
        got = jax.lax.gather(rows_kv, to_host(idx, on_host), _ROWS,
                             slice_sizes=(1, 1, width),
                             mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
        return jax.lax.dynamic_update_slice_in_dim(out, to_device(got, on_host), i * chunk,
                                                   axis=1)

    out = jax.lax.fori_loop(0, trips, body, out)
    return out[:, :size]


def host_write_rows(host_kv, table, rows_kv, positions, *, on_host: bool,
                    access: str = "gather"):
    """Write new rows [L, B, T, D+R] at token positions [B, T] into the host pool (only them),
    through the page table [B, P].

    A position past capacity (only possible with unchecked inputs) or in a page not held (-1)
    is dropped, never written out of bounds. "gather": one scatter of L B T rows; "slices": one
    dynamic update slice per row, L x (positions in held pages) trips.
    """
    check_host_access(access)
    if access == "slices":
        return _write_slices(host_kv, table, 0, rows_kv, positions, on_host)
    num_l, num_frames, page, _ = host_kv.shape
    if access == "ffi":
        base = _item_index(table, 0, positions.astype(jnp.int32),
                           jnp.ones(positions.shape, bool), page)  # [B, T, 2]
        layers = jnp.arange(num_l, dtype=jnp.int32)[:, None, None]
        index = jnp.stack([jnp.where(base[..., 0] >= 0, layers, -1),
                           jnp.broadcast_to(base[..., 1], (num_l,) + base.shape[:2])], axis=-1)
        rows = rows_kv.astype(host_kv.dtype).reshape(-1, 1, rows_kv.shape[3])
        return scatter_items(host_kv, rows, index.reshape(-1, 2))
    batch = positions.shape[0]
    shape = (num_l,) + positions.shape  # [L, B, T]
    positions = positions.astype(jnp.int32)
    frames = _frame(table, jnp.arange(batch, dtype=jnp.int32)[:, None], positions, page)
    frames = jnp.where(frames >= 0, frames, num_frames)  # dropped
    index = jnp.stack([
        jnp.broadcast_to(jnp.arange(num_l, dtype=jnp.int32)[:, None, None], shape),
        jnp.broadcast_to(frames, shape),
        jnp.broadcast_to(positions % page, shape),
    ], axis=-1)  # [L, B, T, 3]
    return jax.lax.scatter(host_kv, to_host(index, on_host),
                           to_host(rows_kv.astype(host_kv.dtype), on_host), _WRITE,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


# Prefill: history load, write-back -------------------------------------------------------------


def load_history(host_kv, table, layer, *, history_pages: int, on_host: bool,
                 access: str = "gather"):
    """Layer `layer`'s first `history_pages` pages of every request, as device rows.

    Args:
      host_kv: [L, F, Z, D+R] host pool; table: [B, P] page table; layer: [] int (may be
        traced).
    Returns:
      [B, history_pages * Z, D+R] device rows (the caller writes them into its layer buffer);
      pages not held read pool page 0 (they hold no stored token).
    Whole pages move: B x history_pages pages of [Z, D+R]. "gather": one gather of their
    B history_pages Z rows on the host pool with host-side indices, then one move to the
    device; "slices": one dynamic slice of one page per trip (B history_pages trips), each
    moved to the device.
    """
    check_host_access(access)
    _, _, page, width = host_kv.shape
    batch = table.shape[0]
    frames = jnp.maximum(jnp.asarray(table)[:, :history_pages], 0)  # [B, history_pages]
    layer = jnp.asarray(layer, jnp.int32)
    if access == "ffi":  # one item per page: Z consecutive pool rows
        index = jnp.stack([jnp.broadcast_to(layer, frames.shape), frames * page], axis=-1)
        got = gather_items(host_kv, index.reshape(-1, 2).astype(jnp.int32), item_rows=page)
        return got.reshape(batch, history_pages * page, width)
    if access == "slices":
        def body(i, out):
            b, p = i // history_pages, i % history_pages
            got = jax.lax.dynamic_slice(host_kv, (layer, frames[b, p], jnp.int32(0),
                                                  jnp.int32(0)), (1, 1, page, width))
            return jax.lax.dynamic_update_slice(out, to_device(got, on_host),
                                                (b, p, jnp.int32(0), jnp.int32(0)))

        out = jnp.zeros((batch, history_pages, page, width), host_kv.dtype)
        out = jax.lax.fori_loop(0, batch * history_pages, body, out)
        return out.reshape(batch, history_pages * page, width)
    # One gather of rows of the pool seen as [L, F Z, D+R], giving [B, hp Z, D+R] as it is
    # (the decode miss gather's pattern). A gather of whole pages ([B, hp, Z, D+R]) reshaped
    # after its move to the device did not compile on an H200 (jax 0.11.2): XLA folded the
    # reshape into a bitcast from host to device memory ("Bitcast cannot have different memory
    # spaces"). Rows run at 0.41x a bulk device_put there
    # (experiments/accelerator/load_history_variants.py).
    num_l, num_f = host_kv.shape[:2]
    rows_kv = host_kv.reshape(num_l, num_f * page, width)
    offsets = jnp.arange(history_pages * page, dtype=jnp.int32)
    rows = frames[:, offsets // page] * page + offsets % page  # [B, hp Z] pool rows
    index = jnp.stack([jnp.broadcast_to(layer, rows.shape), rows], axis=-1)
    got = jax.lax.gather(rows_kv, to_host(index, on_host), _ROWS, slice_sizes=(1, 1, width),
                         mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    # The barrier keeps the caller's reshapes and selects of these rows (the prefill's
    # `rows[None]`) from being folded into the move, as the same bitcast across memory spaces.
    return jax.lax.optimization_barrier(to_device(got, on_host))


def write_back_rows(host_kv, table, layer, rows, write_pos, *, on_host: bool,
                    access: str = "gather"):
    """Write one layer's new rows [B, T, D+R] at positions [B, T] into the host pool (only
    them), through the page table.

    Positions >= S (padding entries) and positions in pages not held are dropped. "gather": a
    scatter with (layer, pool page, offset) indices moved to host memory with the rows (no flat
    row index: L F Z overflows int32 at real sizes); "slices": one dynamic update slice per row
    written.
    """
    check_host_access(access)
    if access == "slices":
        return _write_slices(host_kv, table, layer, rows[None], write_pos, on_host)
    num_frames, page = host_kv.shape[1], host_kv.shape[2]
    if access == "ffi":
        write_pos = write_pos.astype(jnp.int32)
        index = _item_index(table, layer, write_pos, jnp.ones(write_pos.shape, bool), page)
        return scatter_items(host_kv, rows.astype(host_kv.dtype).reshape(-1, 1, rows.shape[-1]),
                             index.reshape(-1, 2))
    batch = write_pos.shape[0]
    write_pos = write_pos.astype(jnp.int32)
    frames = _frame(table, jnp.arange(batch, dtype=jnp.int32)[:, None], write_pos, page)
    frames = jnp.where(frames >= 0, frames, num_frames)  # dropped
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), write_pos.shape)
    return host_kv.at[to_host(layers, on_host), to_host(frames, on_host),
                      to_host(write_pos % page, on_host)].set(
        to_host(rows.astype(host_kv.dtype), on_host), mode="drop")


__all__ = [
    "HOST_ACCESS",
    "check_host_access",
    "host_gather_rows",
    "host_write_rows",
    "in_host_memory",
    "load_history",
    "to_device",
    "to_host",
    "write_back_rows",
]


def host_rows_at(host_kv, table, layer, batch_idx, tokens, on_host: bool):
    """host_kv[layer, table[b, t // Z], t % Z] for index arrays of one shape: [..., D + R]
    device rows (pages not held read pool page 0).

    For the debug checks (fo_jax.offload.checks), which compare device rows with their host
    rows: one gather on host memory with host-side indices, then a move of just those rows to
    the device. Deliberately not the decode step's own miss loop, so a bug there cannot cancel
    itself out. Touches as many rows as there are indices.
    """
    z = host_kv.shape[2]
    frames = jnp.maximum(_frame(table, batch_idx, tokens, z), 0)
    idx = to_host((layer, frames, tokens % z), on_host)
    return to_device(host_kv[idx], on_host)

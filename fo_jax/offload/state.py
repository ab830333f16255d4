"""State pytrees of the offloaded decode path.

    DecodeState
      host: HostPages          kv [L, F, Z, D+R] in host memory: the authoritative KV, a pool
                               of F pages of Z tokens
      table: [B, P] int32      device: the page table, page p of request b is pool page
                               table[b, p] (-1: not held)
      hot: [L, B, C + 2Z, D+R] device rows: C hot slots, then two tail blocks of Z tokens
      index_keys: [G, F, Z, N] device: every stored token's indexer key (needed every step),
                               a pool addressed by the same table
      slots: CacheSlots        token_to_slot [G, B, S], slot_to_token [G, B, C] (int32, -1 = none)
      policy: PolicyState      the eviction policy's per-slot state
      lengths: [B] int32, step: [] int32

Pools and tables: token t of request b, layer l lives at host.kv[l, table[b, t // Z], t % Z] and
its group-g indexer key at index_keys[g, table[b, t // Z], t % Z]; a page id names the same Z
tokens in both pools, so device memory follows the pages held, not B x S. The table is the only
per-request view of the pools: a scheduler assigns pages (`assign_pages`) and requests come and
go without recompiling (the compiled step sees pools and tables only). Pages a request does not
hold are -1: no token < length lives there (fo_jax.offload.invariants asserts it) and writes to
them are dropped. `DecodeState.create` / `from_resident` build the identity table by default
(F = B P, table[b, p] = b P + p). Hot caches stay one region of C + 2Z rows per batch seat.

The batch axis is axis 1 of every per-request array (axis 0 of `lengths` and `table`), so it can
be sharded over a data-parallel mesh axis. Layers sharing an indexer (a group) share one plan,
hence the slot maps are per group and the rows per layer.

Tokens of the two tail blocks: a token at position p with p >= tail_start = (n // Z) * Z (n the
length before the step) lives in tail block (p // Z) % 2 at offset p % Z, is served from there,
and has no hot slot. When a block fills, its tokens become ordinary tokens: host-resident,
entering the hot cache on a miss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.model.kv_format import kv_fill
from fo_jax.offload.config import OffloadConfig


def default_device() -> jax.Device:
    """The device new state goes to: this thread's `jax.default_device` when it is set to
    one of this process's devices (a data-parallel rank builds and steps its engine under
    it), else this process's first device (in a multi-process run jax.devices()[0] is
    process 0's, which no other process can read or write)."""
    device = jax.config.jax_default_device
    if isinstance(device, jax.Device) and device.process_index == jax.process_index():
        return device
    return jax.local_devices()[0]


def host_sharding(kind: str):
    """A single-device sharding in memory kind `kind` (`pinned_host` or `device`), on
    `default_device()`."""
    return jax.sharding.SingleDeviceSharding(default_device(), memory_kind=kind)


def to_memory_kind(x: jax.Array, kind: str) -> jax.Array:
    return jax.device_put(x, host_sharding(kind))


def read_back(x: jax.Array) -> np.ndarray:
    """A numpy copy of `x` that keeps no reference to x's buffer (debug reads of a live state).

    `np.asarray` of a host-memory array (`pinned_host`) is a zero-copy view, which holds an
    external reference to the buffer: on GPU the next step that donates the state then fails
    with "Donation requested for buffer with external reference" (seen on an H200, jax
    0.11.2, `fo-jax generate --offload --check`). A host-memory array is therefore copied
    through device memory first (O(x.size) device bytes while the copy lives: debug reads
    only); a device array is copied to the host as `np.asarray` does.
    """
    kind = getattr(x.sharding, "memory_kind", None)
    if kind is not None and kind != "device":
        x = jax.device_put(x, x.sharding.with_memory_kind("device"))
    return np.array(x, copy=True)


def committed(tree):
    """`tree` with every uncommitted leaf committed to the default device.

    A jitted step returns committed arrays; a state built from uncommitted ones (plain
    `jnp` results) would hit another entry of the step's jit cache, so the second step would
    compile the whole program again. Moves nothing: the leaves are already on that device
    (`default_device()`: jnp's default, in a multi-process run and under
    `jax.default_device` too).
    """
    device = default_device()
    return jax.tree.map(lambda x: x if isinstance(x, jax.core.Tracer) or x.committed
                        else jax.device_put(x, device), tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostPages:
    """The authoritative KV of every layer, a pool of pages of Z tokens.

    Attributes:
      kv: [L, F, Z, D + R] kv_dtype (or [L, F, Z, Y] uint8 fp8_ds_mla rows), in `pinned_host`
        memory (or `device` memory under Pallas interpret mode): token t of request b, layer l is kv[l, table[b, t // Z], t % Z]
        for the state's page table [B, P].
    """

    kv: jax.Array

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]

    @property
    def num_frames(self) -> int:
        return self.kv.shape[1]


# Page tables -----------------------------------------------------------------------------------


def identity_table(batch: int, num_pages: int) -> np.ndarray:
    """[B, P] int32: request b holds pool pages b P .. b P + P - 1 (the default layout)."""
    return np.arange(batch * num_pages, dtype=np.int32).reshape(batch, num_pages)


def check_table(table, *, batch: int, num_pages: int, num_frames: int,
                values: bool = True, lengths=None, page_size: int | None = None) -> None:
    """Raise ValueError unless `table` is a valid page table for a pool of `num_frames` pages.

    Static: shape [B, P] and dtype int32. With `values` (and a concrete table; O(B P), one
    read of the table): every entry in [-1, F), and no pool page named twice (two seats, or two
    pages of one seat, writing the same pool page would collide), except, given the requests'
    `lengths` and `page_size`, a page that every entry naming it holds full (all Z tokens
    below its request's length): a shared prefix, which no step writes (writes go to
    positions >= length).
    """
    shape = tuple(getattr(table, "shape", ()))
    if shape != (batch, num_pages):
        raise ValueError(f"page table has shape {shape}, expected [B, P] = "
                         f"({batch}, {num_pages}) (P = capacity / page_size pages per request)")
    if getattr(table, "dtype", None) != np.int32:
        raise ValueError(f"page table has dtype {getattr(table, 'dtype', None)}, expected int32 "
                         "(pool page ids, -1 for pages not held)")
    if not values or isinstance(table, jax.core.Tracer):
        return
    ids = np.asarray(table)
    bad = np.argwhere((ids < -1) | (ids >= num_frames))
    if bad.size:
        b, p = bad[0]
        raise ValueError(f"page table entry [{b}, {p}] = {ids[b, p]} is outside [-1, "
                         f"{num_frames}): ids name pages of a pool of F={num_frames} pages "
                         "(-1 for a page not held)")
    page = shared_page_conflict(ids, lengths, page_size)
    if page is not None:
        where = np.argwhere(ids == page).tolist()
        raise ValueError(f"pool page {page} is named by page table entries {where}: writes "
                         "would collide; give every held page to one seat and page only (a "
                         "page may be shared only where every request naming it holds it full:"
                         " a shared prefix)")


def shared_page_conflict(ids: np.ndarray, lengths=None, page_size: int | None = None):
    """The first pool page named by two page-table entries [B, P] where a write could land
    (without `lengths`: any page named twice), or None. O(B P)."""
    held = ids[ids >= 0]
    unique, counts = np.unique(held, return_counts=True)
    shared = unique[counts > 1]
    if shared.size == 0:
        return None
    if lengths is None or page_size is None:
        return int(shared[0])
    full = (np.arange(ids.shape[1])[None, :] + 1) * page_size <= np.asarray(lengths)[:, None]
    writable = ids[(ids >= 0) & ~full]  # pages some step may write
    clash = np.intersect1d(shared, writable)
    return int(clash[0]) if clash.size else None


def check_table_covers(table, lengths, page_size: int) -> None:
    """Raise ValueError unless every stored token (t < lengths[b]) lies in a held page (concrete
    values only; O(B P))."""
    ids, n = np.asarray(table), np.asarray(lengths)
    need = -(-n // page_size)  # pages holding tokens < length
    missing = np.argwhere((np.arange(ids.shape[1])[None, :] < need[:, None]) & (ids < 0))
    if missing.size:
        b, p = missing[0]
        raise ValueError(f"request {b} holds (or is about to hold) {int(n[b])} tokens but "
                         f"page {p} of its page table is -1 (not held): assign it a pool page "
                         "first (`assign_pages`)")


def pool_to_tokens(pool, table, fill=0.0):
    """[X, B, P Z, Y] per-request view of a pool [X, F, Z, Y] through table [B, P].

    Pages not held (-1) read as `fill`. Touches B P Z rows of every leading index: debug reads,
    the handoff, and the selection (which reads every key of a request anyway).
    """
    batch, pages = table.shape
    x, _, z, y = pool.shape
    got = pool[:, jnp.maximum(table, 0)]  # [X, B, P, Z, Y]
    got = jnp.where((table >= 0)[None, :, :, None, None], got,
                    jnp.asarray(kv_fill(fill, pool.dtype), pool.dtype))
    return got.reshape(x, batch, pages * z, y)


def tokens_to_pool(rows, table, num_frames: int, fill=0.0):
    """The pool [X, F, Z, Y] holding per-request rows [X, B, P Z, Y] at table [B, P].

    Pages not held by any request hold `fill`; rows of a page not held (-1) are dropped.
    (`fill` is a float; uint8 fp8_ds_mla rows get its bytes, `kv_fill`.)
    """
    x, batch, s, y = rows.shape
    pages = table.shape[1]
    z = s // pages
    pool = jnp.full((x, num_frames, z, y), kv_fill(fill, rows.dtype), rows.dtype)
    target = jnp.where(table >= 0, table, num_frames)
    return pool.at[:, target].set(rows.reshape(x, batch, pages, z, y), mode="drop")


def read_pool_keys(pool, table, g):
    """Group g's indexer keys of every request, [B, S, N], read from the key pool [G, F, Z, N]
    through the page table [B, P]: one gather of B P pages (O(B S N), the keys the selection
    reads anyway). Pages not held read pool page 0: they hold no visible token (tokens >=
    length are masked by the selection)."""
    batch, pages = table.shape
    got = pool[g, jnp.maximum(table, 0)]  # [B, P, Z, N]
    return got.reshape(batch, pages * pool.shape[2], pool.shape[3])


def write_pool_keys(pool, table, g, keys, write_pos):
    """The key pool [G, F, Z, N] with keys [B, T, N] of group g written at positions [B, T]
    through the table; positions >= S or in pages not held are dropped. Touches B T rows."""
    num_frames, page = pool.shape[1], pool.shape[2]
    batch, pages = table.shape
    write_pos = write_pos.astype(jnp.int32)
    inside = (write_pos >= 0) & (write_pos < pages * page)
    frames = table[jnp.arange(batch)[:, None], jnp.clip(write_pos // page, 0, pages - 1)]
    frames = jnp.where(inside & (frames >= 0), frames, num_frames)
    return pool.at[g, frames, write_pos % page].set(keys.astype(pool.dtype), mode="drop")


def assign_pages(state, seat, pages):
    """`state` with seat `seat`'s page-table row set to `pages` ([P] int32, -1 for pages not
    held): a seat joining (or growing) with pages from an allocator. Pure and jit-able; the
    pools keep their shapes and contents and nothing recompiles (the table is an array).

    Works for DecodeState and PrefillState. Only the table changes: the caller owns what else
    a new request needs (its length, its hot maps). The pages must not be held by another seat
    (`check_table` refuses a table that shares one when the next step is checked).
    """
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != (state.table.shape[1],):
        raise ValueError(f"pages has shape {pages.shape}, expected ({state.table.shape[1]},) "
                         "(one pool page id per page of a request, -1 for pages not held)")
    return dataclasses.replace(state, table=state.table.at[seat].set(pages))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheSlots:
    """The hot cache's maps, one pair per indexer group.

    Attributes:
      token_to_slot: [G, B, S] int32: hot slot of each token, -1 if not resident.
      slot_to_token: [G, B, C] int32: token in each slot, -1 if empty.
    """

    token_to_slot: jax.Array
    slot_to_token: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyState:
    """The eviction policies' state, per group and request.

    Attributes:
      stamp: [G, B, C] int32: the last step at which the slot's token was selected (a slot is
        protected from eviction in the step whose number it carries; no clearing needed).
      hand: [G, B] int32: the ring and clock policies' pointer.
      last_used: [G, B, C] int32 for "lru" (last step of use, -1 empty), [G, B, 0] otherwise.
      ref: [G, B, C] int8 for "clock" (reference bits: 1 = used since the hand last passed),
        [G, B, 0] otherwise.
      key: PRNG key data [2] uint32 for "random".
    """

    stamp: jax.Array
    hand: jax.Array
    last_used: jax.Array
    ref: jax.Array
    key: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the offloaded decode step reads and writes (see the module docstring).

    Attributes:
      host: HostPages, kv [L, F, Z, D + R].
      table: [B, P] int32 page table into both pools (-1: page not held).
      hot: [L, B, C + 2Z, D + R] kv_dtype device rows ([.., Y] uint8 in fp8_ds_mla).
      index_keys: [G, F, Z, N] kv_dtype, the indexer-key pool.
      slots: CacheSlots.
      policy: PolicyState.
      lengths: [B] int32 tokens stored per request.
      step: [] int32, the number of the next step (starts at 1).
    """

    host: HostPages
    table: jax.Array
    hot: jax.Array
    index_keys: jax.Array
    slots: CacheSlots
    policy: PolicyState
    lengths: jax.Array
    step: jax.Array

    @property
    def batch(self) -> int:
        return self.hot.shape[1]

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.host.page_size

    @property
    def num_frames(self) -> int:
        return self.host.num_frames

    def device_bytes(self) -> int:
        """Bytes of the device-resident part (everything but host pages)."""
        leaves = jax.tree_util.tree_leaves(dataclasses.replace(self, host=None))
        return sum(x.size * x.dtype.itemsize for x in leaves)

    def host_bytes(self) -> int:
        return self.host.kv.size * self.host.kv.dtype.itemsize

    def token_rows(self) -> np.ndarray:
        """[L, B, S, D + R] numpy: every request's host rows read through the table (debug
        reads, O(L B S); pages not held read as NaN, bytes 0xFF in fp8_ds_mla)."""
        host = jnp.asarray(read_back(self.host.kv))
        return np.asarray(pool_to_tokens(host, self.table, jnp.nan))

    def token_index_keys(self) -> np.ndarray:
        """[G, B, S, N] numpy: every request's indexer keys read through the table (debug
        reads; pages not held read as NaN)."""
        return np.asarray(pool_to_tokens(self.index_keys, self.table, jnp.nan))

    # Construction ------------------------------------------------------------------------

    @classmethod
    def from_resident(cls, kv, index_keys, lengths, *, config: ModelConfig,
                      offload: OffloadConfig, fill: float = 0.0, num_frames: int | None = None,
                      table=None) -> "DecodeState":
        """Hand a prefilled batch over to the offloaded decode path.

        Args:
          kv: [L, B, S', D + R] the resident KV (S' <= offload.capacity), as the config's
            kv_format stores it (`ModelConfig.kv_row_width`, `kv_row_dtype`).
          index_keys: [G, B, S', N]; lengths: [B].
          fill: value of rows that hold no token (tests use NaN so a stray read shows).
          num_frames: F, pages in the pools; default B P.
          table: [B, P] int32 page table (`check_table`), default the identity table
            (needs F >= B P); every stored token must lie in a held page.

        The host pages receive every token; the tail blocks receive the tokens of the current,
        partly filled block; the hot cache of every layer receives the most recent
        min(C, tail_start) tokens before the tail (slots 0, 1, ... in token order), which are
        the tokens a decode step is most likely to select first. This is the one O(S) step.
        """
        offload.validate_for(config)
        num_l, batch, s_in, width = kv.shape
        cap, z = offload.capacity, offload.page_size
        if s_in > cap:
            raise ValueError(f"the prefilled KV has {s_in} positions but offload capacity is "
                             f"{cap}; raise OffloadConfig.capacity")
        want_kv = (config.num_layers, batch, s_in, config.kv_row_width)
        want_keys = (config.num_groups, batch, s_in, config.index_head_dim)
        if tuple(kv.shape) != want_kv or tuple(index_keys.shape) != want_keys:
            raise ValueError(f"kv {tuple(kv.shape)} / index_keys {tuple(index_keys.shape)} do "
                             f"not match config {config.name!r}: expected {want_kv} / "
                             f"{want_keys}")
        if kv.dtype != config.kv_row_dtype or index_keys.dtype != config.jnp_kv_dtype:
            raise ValueError(f"kv {kv.dtype} / index_keys {index_keys.dtype} must be the "
                             f"config's {config.kv_row_dtype} / {config.jnp_kv_dtype} "
                             f"(kv_format={config.kv_format!r}, kv_dtype={config.kv_dtype!r}): "
                             "build them with the config the state is for")
        lengths_np = np.asarray(lengths).astype(np.int32)
        if lengths_np.shape != (batch,) or np.any(lengths_np < 0) or np.any(lengths_np > s_in):
            raise ValueError(f"lengths {lengths_np.tolist()} must be {batch} counts in "
                             f"[0, {s_in}] (the prefilled positions)")
        table, num_frames = make_table(table, num_frames, batch=batch,
                                       num_pages=offload.num_pages)
        check_table_covers(table, lengths_np, z)
        kv_fill_value = kv_fill(fill, kv.dtype)
        kv = jnp.pad(kv, ((0, 0), (0, 0), (0, cap - s_in), (0, 0)),
                     constant_values=kv_fill_value)
        index_keys = jnp.pad(index_keys, ((0, 0), (0, 0), (0, cap - s_in), (0, 0)),
                             constant_values=fill)
        # Rows past each request's length hold `fill` (nothing is stored there yet).
        positions = jnp.arange(cap)
        stored = positions[None, :] < jnp.asarray(lengths_np)[:, None]  # [B, S]
        kv = jnp.where(stored[None, :, :, None], kv, jnp.asarray(kv_fill_value, kv.dtype))
        index_keys = jnp.where(stored[None, :, :, None], index_keys,
                               jnp.asarray(fill, index_keys.dtype))
        pages = tokens_to_pool(kv, table, num_frames, fill)
        host = HostPages(kv=to_memory_kind(pages, offload.host_memory_kind))
        key_pool = tokens_to_pool(index_keys, table, num_frames, fill)

        row_tok, slots, policy = initial_layout(config, offload, lengths_np)
        # Device rows: row r of request b holds token row_tok[b, r], or `fill`.
        gathered = kv[:, jnp.arange(batch)[:, None], jnp.asarray(np.maximum(row_tok, 0))]
        hot = jnp.where(jnp.asarray(row_tok >= 0)[None, :, :, None], gathered,
                        jnp.asarray(kv_fill_value, kv.dtype))
        return committed(cls(host=host, table=jnp.asarray(table), hot=hot, index_keys=key_pool,
                             slots=slots, policy=policy, lengths=jnp.asarray(lengths_np),
                             step=jnp.asarray(1, jnp.int32)))

    @classmethod
    def create(cls, config: ModelConfig, offload: OffloadConfig, *, batch: int,
               fill: float = 0.0, num_frames: int | None = None, table=None) -> "DecodeState":
        """An empty state (no tokens yet) for `batch` requests: pools of `num_frames` pages
        (default B P) and the page table `table` (default the identity table; see
        `from_resident`). A serving engine builds it once with its pool size and a table of
        -1 rows, then `assign_pages` as requests join."""
        kv = jnp.zeros((config.num_layers, batch, 1, config.kv_row_width), config.kv_row_dtype)
        keys = jnp.zeros((config.num_groups, batch, 1, config.index_head_dim),
                         config.jnp_kv_dtype)
        return cls.from_resident(kv, keys, np.zeros(batch, np.int32), config=config,
                                 offload=offload, fill=fill, num_frames=num_frames, table=table)


def make_table(table, num_frames, *, batch: int, num_pages: int):
    """(table [B, P] int32 numpy array, F) from the constructors' arguments, validated.

    Default F = B P; default table the identity (which needs F >= B P). The table comes back
    in numpy so the constructors' value checks work under `jax.eval_shape` too.
    """
    if num_frames is None:
        num_frames = batch * num_pages
    if not isinstance(num_frames, (int, np.integer)) or num_frames < 1:
        raise ValueError(f"num_frames={num_frames!r} must be a positive int (pages in the pool)")
    num_frames = int(num_frames)
    if table is None:
        if num_frames < batch * num_pages:
            raise ValueError(f"the identity page table needs num_frames >= B P = "
                             f"{batch * num_pages}, got {num_frames}: pass a table")
        table = identity_table(batch, num_pages)
    table = np.asarray(table)
    check_table(table, batch=batch, num_pages=num_pages, num_frames=num_frames)
    return table.astype(np.int32), num_frames


def rollback(state: DecodeState, num_drop) -> DecodeState:
    """Forget the last num_drop[b] tokens of each request: the rejected drafts of the last
    decode step (at most the W <= Z tokens it appended). Pure and jit-able; O(B) work (never
    O(C) or O(S)): only `lengths` changes, because nothing else needs to.

    What the dropped tokens left, and why it is invisible (n the length before the step,
    n' = the new length, n <= n' <= n + W, W <= Z by `OffloadConfig.validate_for`):
      * host pages and indexer keys at positions >= n': garbage no one reads. Selections see
        positions < n' or the next step's own new positions, whose rows and keys that step
        writes (to host pages, tail rows and indexer keys) before any query reads them.
      * slot maps: every hot slot holds a token < (n // Z) * Z (tokens from there on are tail
        tokens, never installed), so no slot points at a dropped token, and no tail token of
        n' holds a slot: the maps' invariants hold for n'.
      * tail blocks: a dropped token's row is that of a token 2Z before or after it, which is
        outside the tail blocks of n' (it starts at (n' // Z) * Z > n' - Z); the tail tokens
        of n' keep their rows.
      * hot rows: the step's misses (tokens < n selected by any way, rejected ones included)
        are copies of their host rows, as the invariants require.
      * policy state (stamps, hand, lru times, key) and `step`: a cache's bookkeeping; they
        may differ from a run that never fed the drafts, and they change which rows are hits,
        never what a step reads.
    So every stored position (host pages, indexer keys) equals that of a run that never fed
    the dropped tokens, the invariants of fo_jax.offload.invariants hold, and every later
    logit is unchanged.
    num_drop: [B] ints in [0, lengths[b]] (clipped into it).
    """
    num_drop = jnp.clip(jnp.asarray(num_drop, jnp.int32), 0, state.lengths)
    return dataclasses.replace(state, lengths=state.lengths - num_drop)


def initial_layout(config: ModelConfig, offload: OffloadConfig, lengths: np.ndarray):
    """Where a prefilled batch's tokens go at the handoff to decode.

    The tail blocks take the tokens of each request's current, partly filled block; hot slots
    0, 1, ... take the most recent min(C, tail_start) tokens before the tail, in token order
    (the tokens a decode step is most likely to select first); every group starts with the same
    maps; the ring / clock hand points at the first empty slot; lru stamps the filled slots 0;
    clock's reference bits start clear.

    Returns:
      row_tok: [B, C + 2Z] int32 numpy: the token of every device row, -1 for none.
      slots: CacheSlots; policy: PolicyState.
    """
    batch, cap = len(lengths), offload.capacity
    z, c, groups = offload.page_size, offload.hot_slots, config.num_groups
    tail_start = (lengths // z) * z
    count = np.minimum(tail_start, c)  # tokens given a hot slot
    slot_ids = np.arange(c)
    slot_tok = np.where(slot_ids[None, :] < count[:, None],
                        (tail_start - count)[:, None] + slot_ids[None, :], -1).astype(np.int32)
    row_tok = np.full((batch, offload.rows), -1, np.int32)
    row_tok[:, :c] = slot_tok
    tok_slot = np.full((batch, cap), -1, np.int32)
    for b in range(batch):
        lo, hi = int(tail_start[b]), int(lengths[b])
        start = c + ((lo // z) % 2) * z
        row_tok[b, start:start + hi - lo] = np.arange(lo, hi)
        n = int(count[b])
        tok_slot[b, slot_tok[b, :n]] = np.arange(n)
    slots = CacheSlots(
        token_to_slot=jnp.asarray(np.broadcast_to(tok_slot, (groups,) + tok_slot.shape)),
        slot_to_token=jnp.asarray(np.broadcast_to(slot_tok, (groups,) + slot_tok.shape)),
    )
    last_used = (np.where(slot_tok >= 0, 0, -1).astype(np.int32) if offload.policy == "lru"
                 else np.zeros((batch, 0), np.int32))
    policy = PolicyState(
        stamp=jnp.full((groups, batch, c), -1, jnp.int32),
        hand=jnp.asarray(np.broadcast_to(count % c, (groups, batch)).astype(np.int32)),
        last_used=jnp.asarray(np.broadcast_to(last_used, (groups,) + last_used.shape)),
        ref=jnp.zeros((groups, batch, c if offload.policy == "clock" else 0), jnp.int8),
        key=jax.random.key_data(jax.random.key(offload.seed)),
    )
    return row_tok, slots, policy


def device_bytes_formula(config: ModelConfig, offload: OffloadConfig, batch: int) -> dict:
    """Device bytes of a DecodeState by the design's formula.

    KV: (C + 2Z) rows of `kv_row_bytes` per layer and request; indexer keys of all S tokens
    per group (a pool of F = B P pages of Z, the default); the page table [B, P] int32; maps:
    token_to_slot [G, S] + slot_to_token [G, C] int32; policy: stamp [G, C] (+ last_used
    [G, C] for lru) + hand [G] int32 (+ ref [G, C] int8 for clock); lengths, step, key.
    """
    kvb = config.jnp_kv_dtype.itemsize  # indexer keys
    c, z, s = offload.hot_slots, offload.page_size, offload.capacity
    g = config.num_groups
    lru = c if offload.policy == "lru" else 0
    clock = c if offload.policy == "clock" else 0
    parts = {
        "kv": config.num_layers * batch * (c + 2 * z) * config.kv_row_bytes,
        "index_keys": g * batch * s * config.index_head_dim * kvb,
        "table": 4 * batch * (s // z),
        "maps": 4 * g * batch * (s + c),
        "policy": 4 * g * batch * (c + lru + 1) + g * batch * clock + 8,
        "scalars": 4 * batch + 4,
    }
    parts["total"] = sum(parts.values())
    return parts

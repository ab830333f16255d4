"""The seats' KV behind one interface: resident rows (`ResidentKV`) or a shared page pool
(`PagedKV`), with prefix reuse and a seat's rows read out and written in.

    kv = make_kv_store(config, settings)            # ResidentKV or PagedKV
    hit = kv.prefix.match(prompt)                   # prefix reuse (`fo_jax.engine.prefix`)
    kv.set_seats({b: (length, row)})                # a request starts in seat b
    logits, hidden = kv.prefill(params, [b, c], tokens, num_new, prefilled=[p, q])  # a pack
    out = kv.read_seat(b, length=n, row=row, rows=r)   # its rows, to move it elsewhere
    pages = kv.write_seat(b, moved, reserve_tokens=t)  # and in again, on another engine

`state` is the batch state the compiled programs take (`ResidentState`, or the paged
`DecodeState`), `step_fn` its decode step, `prefix` its prefix reuse (`PrefixReuse`, or None
without prefix_cache). Resident: fixed seats of `capacity` rows; prefix reuse copies rows from a
store of whole prefill chunks (`ResidentPrefix`). Paged: the seats share one pool of
`num_pages` pages (`pool`, with the page tables in the state), `costs` the planner's bytes per
seat and page (admission by device bytes), prefix reuse maps cached pages (`PagedPrefix`).
Every write is to the seats it names: a seat's rows never depend on the others'.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax import resident
from fo_jax.config import ModelConfig
from fo_jax.engine.costs import MemoryCosts
from fo_jax.decode_loop import OffloadedStep, ResidentStep
from fo_jax.engine.mtp_prefix import mtp_block_bytes
from fo_jax.engine.pages import NO_PAGE, PagePool, PoolExhausted, PrefixCache, RequestPages
from fo_jax.engine.prefix import PagedPrefix, ResidentPrefix
from fo_jax.engine.resident_prefix import ResidentPrefixStore
from fo_jax.engine.settings import EngineSettings
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload import seat_prefill
from fo_jax.offload.host import in_host_memory, load_history, write_back_rows
from fo_jax.offload.state import DecodeState, committed, read_pool_keys, write_pool_keys


class SeatRows(NamedTuple):
    """A seat's rows read out (`KVStore.read_seat`): kv [L, S, D+R], index_keys [G, S, N] (the
    first `length` are its tokens)."""

    kv: jax.Array
    index_keys: jax.Array
    length: int


class KVStore:
    """What both ways of holding the KV share (see the module doc). Attributes: `state`,
    `step_fn`, `seats`, `capacity`, `max_pages` (P, the page-table row width; 1 resident),
    `prefix` (prefix reuse, or None), `pool` and `costs` (paged; None resident)."""

    paged = False
    pool = prefix = costs = None
    max_pages = 1

    def __init__(self, config: ModelConfig, settings: EngineSettings):
        self.config, self.offload = config, settings.cache.offload
        self.seats, self.capacity = int(settings.cache.seats), int(settings.cache.capacity)
        self.chunk = int(settings.scheduler.prefill_chunk)
        self.query_block = settings.programs.query_block
        self.num_buffers = settings.programs.num_buffers

    def set_seats(self, seats: dict) -> None:
        """Set seat b's length (and page-table row, paged) to seats[b] = (length, row)."""
        mask = np.zeros((self.seats,), bool)
        lengths = np.zeros((self.seats,), np.int32)
        rows = np.full((self.seats, self.max_pages), NO_PAGE, np.int32)
        for b, (length, row) in seats.items():
            mask[b], lengths[b] = True, length
            if row is not None:
                rows[b] = row
        new_lengths = set_lengths(self.state.lengths, jnp.asarray(mask), jnp.asarray(lengths))
        if self.pool is None:
            self.state = dataclasses.replace(self.state, lengths=new_lengths)
        else:
            self.state = dataclasses.replace(
                self.state, lengths=new_lengths,
                table=masked_rows(self.state.table, jnp.asarray(mask), jnp.asarray(rows)))

    def join(self, mask: np.ndarray) -> None:
        """The seats of `mask` [B] start decoding from the rows they hold (paged: their hot rows,
        maps and policy state are built, `join_seats`; resident: nothing to build)."""

    def history_pages(self, prefilled: int) -> int:
        """The history pages a prefill chunk after `prefilled` tokens loads per layer (a static
        of its program: its bucket): requests of one bucket can share a prefill program.
        Resident: 0 for all (every seat's rows are read whole)."""
        return 0

    def prefill(self, params, seats, tokens: np.ndarray, num_new: np.ndarray, *,
                prefilled, hidden: bool = False):
        """One prefill chunk of each of the P seats `seats` in one program: tokens [P,
        prefill_chunk] (row i's first num_new[i] real), after their `prefilled` [P] tokens
        (one `history_pages` bucket); each row over its own seat (`prefill_seats`; P = 1:
        `prefill_seat`; the other seats are not touched). Returns (logits [P, chunk, V], the
        hidden states [P, chunk, E] with `hidden`, else None)."""
        raise NotImplementedError


class ResidentKV(KVStore):
    """Fixed seats of `capacity` contiguous rows on the device; prefix reuse copies rows from
    a prefix store (`ResidentPrefixStore`)."""

    def __init__(self, config: ModelConfig, settings: EngineSettings):
        super().__init__(config, settings)
        cache, programs = settings.cache, settings.programs
        if cache.prefix_cache:
            mtp = settings.speculative.drafter == "mtp"
            self.prefix = ResidentPrefix(ResidentPrefixStore.for_engine(
                config, prefill_chunk=self.chunk, capacity=self.capacity,
                size=cache.prefix_cache_bytes, memory=cache.prefix_cache_memory,
                mtp=mtp), chunk=self.chunk, mtp=mtp)
        self.state = committed(resident.ResidentState.create(config, batch=self.seats,
                                                             capacity=self.capacity))
        self.step_fn = ResidentStep(config, programs.implementation or "xla",
                                    programs.interpret)

    def prefill(self, params, seats, tokens: np.ndarray, num_new: np.ndarray, *,
                prefilled, hidden: bool = False):
        if len(seats) == 1:
            run, seats = resident.prefill_seat, int(seats[0])
        else:
            run, seats = resident.prefill_seats, np.asarray(seats, np.int32)
        logits, self.state, *h = run(
            params, self.state, seats, tokens, num_new, config=self.config, check=False,
            query_block=self.query_block, return_hidden=hidden)
        return logits, h[0] if hidden else None

    def read_seat(self, b: int, **_) -> SeatRows:
        """Seat b's rows, S = the capacity: O(L S (D+R) + G S N) device copy."""
        kv, keys, length = _seat_rows(self.state.kv, self.state.index_keys,
                                      self.state.lengths, jnp.asarray(b, jnp.int32))
        return SeatRows(kv, keys, int(length))

    def write_seat(self, b: int, rows: SeatRows, **_) -> None:
        """Seat b holds `rows` (its first `length` rows written, its length set): O(L S)."""
        kv, keys = _write_resident_seat(self.state.kv, self.state.index_keys, rows.kv,
                                        rows.index_keys, jnp.asarray(b, jnp.int32))
        self.state = dataclasses.replace(self.state, kv=kv, index_keys=keys)
        self.set_seats({b: (rows.length, None)})


def pool_pages(host_pool_bytes: int, costs: MemoryCosts, config: ModelConfig, *,
               mtp_rows: bool = False) -> int:
    """The pages a pool of `host_pool_bytes` bytes of host KV holds: the planner's bytes of
    one page (every layer, `MemoryCosts.page_host_bytes`; + its MTP rows with `mtp_rows`,
    `MTPPrefixStore`). ValueError when not even one fits."""
    page_bytes = costs.page_host_bytes
    if mtp_rows:
        page_bytes += mtp_block_bytes(config, costs.page_size)
    num_pages = int(host_pool_bytes) // page_bytes
    if num_pages < 1:
        mtp_layer = " and the MTP layer" if mtp_rows else ""
        raise ValueError(f"host_pool_bytes={host_pool_bytes} holds no page of "
                         f"{costs.page_size} tokens ({page_bytes} bytes over "
                         f"{config.num_layers} layers{mtp_layer}): raise it")
    return num_pages


class PagedKV(KVStore):
    """The seats share one pool of pages (host KV and indexer keys) through page tables; the
    pool lives in host memory (offloaded) or on the device (`host_memory_kind="device"`)."""

    paged = True

    def __init__(self, config: ModelConfig, settings: EngineSettings):
        super().__init__(config, settings)
        cache, programs, offload = settings.cache, settings.programs, settings.cache.offload
        prefix_cache, num_pages = cache.prefix_cache, cache.num_pages
        mtp_rows = prefix_cache and settings.speculative.drafter == "mtp"
        z = offload.page_size
        self.max_pages = self.capacity // z
        num_buffers = programs.num_buffers
        self.costs = MemoryCosts.from_config(
            config, page_size=z, hot_slots=offload.hot_slots,
            num_buffers=min(4, config.num_layers) if num_buffers is None else num_buffers,
            pool_memory=offload.host_memory_kind)
        if cache.host_pool_bytes is not None:
            num_pages = pool_pages(cache.host_pool_bytes, self.costs, config, mtp_rows=mtp_rows)
        num_pages = self.seats * self.max_pages if num_pages is None else num_pages
        self.pool = PagePool(int(num_pages), z)
        if prefix_cache:
            self.prefix = PagedPrefix(PrefixCache(self.pool), chunk=self.chunk,
                                      mtp_memory=offload.host_memory_kind if mtp_rows else None)
        self.state = DecodeState.create(
            config, offload, batch=self.seats, num_frames=self.pool.num_pages,
            table=np.full((self.seats, self.max_pages), NO_PAGE, np.int32))
        self.step_fn = OffloadedStep(config, offload, programs.implementation or "xla",
                                     programs.interpret)

    def history_pages(self, prefilled: int) -> int:
        """Pages of history loaded per layer: the request's own, power-of-two bucketed (one
        program per bucket)."""
        oc = self.offload
        return min(_next_power_of_two(-(-int(prefilled) // oc.page_size)),
                   oc.capacity // oc.page_size)

    def prefill(self, params, seats, tokens: np.ndarray, num_new: np.ndarray, *,
                prefilled, hidden: bool = False):
        # Each row loads the pack's bucket of its own history (one bucket per pack).
        oc, st = self.offload, self.state
        pages = max(self.history_pages(p) for p in prefilled)
        if len(seats) == 1:
            run, seats = seat_prefill.prefill_seat, int(seats[0])
        else:
            run, seats = seat_prefill.prefill_seats, np.asarray(seats, np.int32)
        view = offload_prefill.PrefillState(host=st.host, table=st.table,
                                            index_keys=st.index_keys, lengths=st.lengths)
        logits, view, *h = run(
            params, view, seats, tokens, num_new, config=self.config,
            num_buffers=self.num_buffers, history_pages=pages, check=False,
            host_access=oc.host_access, query_block=self.query_block, return_hidden=hidden)
        self.state = dataclasses.replace(st, host=view.host, table=view.table,
                                         index_keys=view.index_keys, lengths=view.lengths)
        return logits, h[0] if hidden else None

    def set_rows(self, rows: dict) -> None:
        """Set seat b's page-table row to rows[b] (pages appended; lengths unchanged)."""
        mask = np.zeros((self.seats,), bool)
        table = np.full((self.seats, self.max_pages), NO_PAGE, np.int32)
        for b, row in rows.items():
            mask[b], table[b] = True, row
        self.state = dataclasses.replace(
            self.state, table=masked_rows(self.state.table, jnp.asarray(mask),
                                          jnp.asarray(table)))

    def join(self, mask: np.ndarray) -> None:
        self.state = offload_prefill.join_seats(self.state, mask, config=self.config,
                                                offload=self.offload)

    def read_seat(self, b: int, *, length: int, row: np.ndarray, rows: int | None) -> SeatRows:
        """A request's first ceil(rows / Z) pages read through its page-table row `row`, from
        the host pool and the indexer-key pool (S = that many pages' tokens; `rows`, at least
        its `length` stored tokens, the rows of the seat it goes to): O(L S (D+R)) host to
        device + O(G S N) device rows."""
        if rows is None or not length <= rows <= self.capacity:
            raise ValueError(f"export_seat of an offloaded request of {length} stored "
                             f"tokens needs rows in [{length}, {self.capacity}] (the rows "
                             f"its new seat takes), got {rows!r}")
        pages = -(-int(rows) // self.offload.page_size)
        kv, keys = _page_rows(self.state.host.kv, self.state.index_keys,
                              jnp.asarray(row[:pages]), access=self.offload.host_access)
        return SeatRows(kv, keys, length)

    def write_seat(self, b: int, rows: SeatRows, *, reserve_tokens: int) -> RequestPages | None:
        """Seat b holds `rows`: pages for `reserve_tokens` tokens reserved, its first `length`
        rows and indexer keys written into them through its page-table row (O(L length)
        rows), its length and row set, its hot rows, maps and policy state built from them
        (`join_seats`: O(L seats (C + 2Z))). Its pages; None (nothing changed) when the pool
        cannot give them yet."""
        pages = RequestPages(self.pool, self.max_pages)
        try:
            pages.grow(reserve_tokens)
        except PoolExhausted:
            pages.release()
            return None
        row = pages.table_row()
        host, index_keys = _write_seat_rows(
            self.state.host.kv, self.state.index_keys, rows.kv, rows.index_keys,
            jnp.asarray(row), jnp.asarray(rows.length, jnp.int32))
        self.state = dataclasses.replace(self.state, host=dataclasses.replace(self.state.host,
                                                                              kv=host),
                                         index_keys=index_keys)
        self.set_seats({b: (rows.length, row)})
        mask = np.zeros((self.seats,), bool)
        mask[b] = True
        self.join(mask)
        return pages


def make_kv_store(config: ModelConfig, settings: EngineSettings) -> KVStore:
    """`PagedKV` with an OffloadConfig in the settings, else `ResidentKV`."""
    if settings.cache.paged:
        return PagedKV(config, settings)
    return ResidentKV(config, settings)


def _next_power_of_two(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


@jax.jit
def set_lengths(lengths, mask, values):
    """lengths [B] with the seats of `mask` set to `values` (a request starts there)."""
    return jnp.where(mask, values, lengths)


@jax.jit
def masked_rows(table, mask, rows):
    """The rows [B, ...] of `table` of the seats of `mask` set to `rows` (a page table [B, P],
    the drafters' histories [B, S])."""
    return jnp.where(mask[:, None], rows, table)


@jax.jit
def _seat_rows(kv, index_keys, lengths, seat):
    """Seat `seat`'s rows: kv [L, B, S, D+R] -> [L, S, D+R], index_keys [G, B, S, N] ->
    [G, S, N], and its length. O(L S) rows copied."""
    return (jax.lax.dynamic_index_in_dim(kv, seat, 1, keepdims=False),
            jax.lax.dynamic_index_in_dim(index_keys, seat, 1, keepdims=False), lengths[seat])


@functools.partial(jax.jit, static_argnames=("access",))
def _page_rows(host_kv, key_pool, row, *, access: str):
    """One request's rows read through its first pages row [p]: host_kv [L, F, Z, D+R] ->
    [L, p Z, D+R] on the device (`load_history`: whole pages, host to device), key_pool [G, F,
    Z, N] -> [G, p Z, N]. O(L p Z) rows moved."""
    on_host = in_host_memory(host_kv)
    table = row[None]
    kv = jnp.stack([load_history(host_kv, table, layer, history_pages=row.shape[0],
                                 on_host=on_host, access=access)[0]
                    for layer in range(host_kv.shape[0])])
    keys = jnp.stack([read_pool_keys(key_pool, table, g)[0] for g in range(key_pool.shape[0])])
    return kv, keys


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_resident_seat(kv, index_keys, seat_kv, seat_keys, seat):
    """Seat `seat` of a resident state with its first min(S, S') rows from seat_kv [L, S',
    D+R] and seat_keys [G, S', N] (kv [L, B, S, D+R], index_keys [G, B, S, N]; the rows past
    the request's length are never read). O(L S) rows written; the state is donated."""
    width = min(kv.shape[2], seat_kv.shape[1])
    zero = jnp.zeros((), jnp.int32)

    def put(old, new):
        rows = new[:, None, :width].astype(old.dtype)
        return jax.lax.dynamic_update_slice(old, rows, (zero, seat, zero, zero))

    return put(kv, seat_kv), put(index_keys, seat_keys)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_seat_rows(host_kv, key_pool, kv, keys, row, length):
    """Write one request's first `length` rows into the pools through its page-table row
    [P]: kv [L, S, D+R] into host_kv [L, F, Z, D+R], keys [G, S, N] into key_pool [G, F, Z, N]
    (positions >= length, or in pages not held, are dropped). O(L S) rows written; the pools
    are donated (updated in place)."""
    on_host = in_host_memory(host_kv)
    positions = jnp.arange(kv.shape[1], dtype=jnp.int32)
    write_pos = jnp.where(positions < length, positions, -1)[None]  # [1, S]; -1: dropped
    table = row[None]
    for layer in range(kv.shape[0]):
        host_kv = write_back_rows(host_kv, table, layer, kv[layer][None], write_pos,
                                  on_host=on_host)
    for g in range(keys.shape[0]):
        key_pool = write_pool_keys(key_pool, table, g, keys[g][None], write_pos)
    return host_kv, key_pool


__all__ = ["KVStore", "PagedKV", "ResidentKV", "SeatRows", "make_kv_store", "masked_rows",
           "set_lengths"]

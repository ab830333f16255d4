"""The MTP layer's rows of cached prompt prefixes, for MTP drafts with the prefix cache.

    store = MTPPrefixStore(cache, chunk=256, memory="pinned_host")   # beside the main cache
    n, blocks = store.lookup(prompt, chunks=m)     # at admission: m chunks the main cache found
    mtp_seats = store.write(mtp_seats, b, blocks)  # rows [0, n chunk) of seat b, its length
    ...                                            # prefill (and feed) the rest of the prompt
    store.insert(mtp_seats, [(b, prompt, before, prefilled, first_token)])  # after the feed

`MTPPrefixStore` keeps, per cached prefill chunk of the main prefix cache, the MTP layer's rows
of that chunk ([1, T, D+R] KV + [1, T, N] keys, T = chunk) and the token after it, in `memory`
"device" or "pinned_host"; `mtp_block_bytes` gives a block's bytes. A request mapping a cached
prefix gets its MTP rows copied from here, since it runs no prefill there to feed the layer.

Contracts: the copied rows equal those the request's own prefill would compute, bit for bit. A
block lives exactly as long as the main cache holds its chunk's last page (one block per
chunk, the latest wins), so the store is bounded by the main cache. Costs: `lookup` and
`insert` O(prompt) hashing; `write` one program of O(n T) rows; a drop O(1). Why the rows
depend on the next token, and the budget: docs/design/engine.md, "Prefix reuse on the
resident path".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.engine.pages import PrefixCache

MEMORIES = ("device", "pinned_host")


def mtp_block_bytes(config: ModelConfig, tokens: int) -> int:
    """Bytes of the MTP layer's rows of `tokens` tokens: KV rows [T, D+R] (`kv_row_bytes`
    each, the config's kv_format) + indexer keys [T, N] of its one layer and group, in the KV
    dtype."""
    per_token = config.kv_row_bytes + config.index_head_dim * config.jnp_kv_dtype.itemsize
    return int(tokens) * per_token


class MTPPrefixStore:
    """The MTP rows of the prefill chunks the main prefix cache holds (see the module doc).

    Args:
      cache: the main prefix cache (offloaded: the page pool's; resident: the prefix store's);
        its page size must divide `chunk`. The store drops a block when the cache drops the
        chunk's last page.
      chunk: T, the prefill chunk (a mapped prefix is whole chunks).
      memory: "device" or "pinned_host", where the blocks live.
    Raises:
      ValueError: bad settings, or a cache that already has a store.
    """

    def __init__(self, cache: PrefixCache, *, chunk: int, memory: str = "device"):
        if memory not in MEMORIES:
            raise ValueError(f"memory={memory!r} must be one of {MEMORIES} (where the MTP rows "
                             "of cached chunks live)")
        if chunk < 1 or chunk % cache.page_size:
            raise ValueError(f"chunk={chunk} must be a positive multiple of the prefix cache's "
                             f"page of {cache.page_size} tokens: a reused prefix ends where a "
                             "prefill chunk ends")
        if cache.on_drop is not None:
            raise ValueError("this PrefixCache already has a store of MTP rows: one per cache")
        self.cache, self.chunk, self.memory = cache, int(chunk), memory
        self._pages_per_chunk = self.chunk // cache.page_size
        self._blocks: dict[bytes, tuple] = {}  # chain hash -> (next token, kv, keys)
        self.blocks_written = 0  # blocks copied into the store (new or replaced)
        cache.on_drop = self._drop

    @property
    def num_blocks(self) -> int:
        """Blocks stored. O(1)."""
        return len(self._blocks)

    def check(self) -> None:
        """Raises AssertionError unless every block's chunk is held by the main cache.
        O(blocks): tests and debug only."""
        for h in self._blocks:
            assert self.cache.holds(h), "an MTP block whose chunk the main cache dropped"

    def _chunk_hashes(self, tokens: np.ndarray, chunks: int) -> list[bytes]:
        """The chain hashes of the first `chunks` whole chunks of `tokens` (each the main
        cache's hash of the chunk's last page). O(chunks T) hashing."""
        hashes = self.cache.hashes(tokens[:chunks * self.chunk])
        return hashes[self._pages_per_chunk - 1::self._pages_per_chunk]

    def _drop(self, h: bytes) -> None:
        self._blocks.pop(h, None)

    # Admission -----------------------------------------------------------------------------

    def lookup(self, prompt, *, chunks: int) -> tuple[int, list]:
        """The longest run of leading chunks of `prompt`, at most `chunks` (those the main
        cache mapped), whose MTP blocks are stored with the prompt's own next tokens: (n, its
        n blocks for `write`). O(prompt) hashing + O(n)."""
        prompt = np.asarray(prompt)
        if chunks * self.chunk >= len(prompt):
            raise ValueError(f"{chunks} chunks of {self.chunk} tokens leave no next token in a "
                             f"prompt of {len(prompt)}: map whole chunks of prompt[:-1]")
        blocks = []
        for i, h in enumerate(self._chunk_hashes(prompt, chunks)):
            block = self._blocks.get(h)
            if block is None or block[0] != int(prompt[(i + 1) * self.chunk]):
                break
            blocks.append(block[1:])
        return len(blocks), blocks

    def write(self, mtp_seats, seat: int, blocks: Sequence):
        """`mtp_seats` (an `MTPSeats`, donated) with seat `seat`'s rows [0, n T) set to the n
        `blocks` (from `lookup`) and its length to n T. One program, O(n T) rows."""
        kv = tuple(k for k, _ in blocks)
        keys = tuple(k for _, k in blocks)
        if self.memory != "device" and blocks:
            kv, keys = jax.device_put((kv, keys), _sharding(mtp_seats.state.kv, "device"))
        return _write_blocks(mtp_seats, kv, keys, np.int32(seat))

    # After a prefill -----------------------------------------------------------------------

    def insert(self, mtp_seats, prefilled: Sequence[tuple]) -> int:
        """Store the MTP rows of the chunks each (seat, prompt, before, after, first token)
        completed: the seat's prompt had `before` tokens prefilled before the last prefill
        program and `after` now, its MTP rows [0, after) final (fed, written from the store,
        or restored); `first token` is its first sampled token (None before its prompt is
        complete). A chunk is stored when the main cache holds it and the store does not
        already hold it with the same next token (a block with another is replaced). One
        program of O(M T) rows for M blocks. Returns M."""
        t = self.chunk
        seats, starts, targets = [], [], []
        for seat, prompt, before, after, first in prefilled:
            prompt = np.asarray(prompt)
            lo, hi = before // t, after // t
            if lo == hi:
                continue
            hashes = self._chunk_hashes(prompt, hi)
            for i in range(lo, hi):
                end = (i + 1) * t
                nxt = int(prompt[end]) if end < len(prompt) else first
                if nxt is None or not self.cache.holds(hashes[i]):
                    continue
                held = self._blocks.get(hashes[i])
                if held is not None and held[0] == nxt:
                    continue
                seats.append(seat)
                starts.append(i * t)
                targets.append((hashes[i], int(nxt)))
        if not targets:
            return 0
        st = mtp_seats.state
        kv, keys = read_blocks(st.kv, st.index_keys, np.asarray(seats, np.int32),
                                np.asarray(starts, np.int32), block=t)
        if self.memory != "device":
            kv, keys = jax.device_put((kv, keys), _sharding(st.kv, self.memory))
        for (h, nxt), k, ik in zip(targets, kv, keys):
            self._blocks[h] = (nxt, k, ik)
        self.blocks_written += len(targets)
        return len(targets)


def _sharding(like, memory_kind: str):
    """A single-device sharding on `like`'s device in `memory_kind` memory."""
    device = next(iter(like.devices()))
    return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_blocks(mtp_seats, kv_blocks, key_blocks, seat):
    """mtp_seats (donated: updated in place) with rows [0, n T) of seat `seat` set to the n
    blocks kv_blocks [1, T, D+R] and key_blocks [1, T, N], in order, and its length n T
    (n = 0: length 0, an empty MTP state). O(n T) rows written."""
    st = mtp_seats.state
    if not kv_blocks:
        return dataclasses.replace(mtp_seats, state=dataclasses.replace(
            st, lengths=st.lengths.at[seat].set(0)))
    zero = jnp.zeros((), jnp.int32)
    rows = jnp.concatenate(kv_blocks, axis=1)[:, None]
    keys = jnp.concatenate(key_blocks, axis=1)[:, None]
    state = dataclasses.replace(
        st,
        kv=jax.lax.dynamic_update_slice(st.kv, rows.astype(st.kv.dtype),
                                        (zero, seat, zero, zero)),
        index_keys=jax.lax.dynamic_update_slice(st.index_keys,
                                                keys.astype(st.index_keys.dtype),
                                                (zero, seat, zero, zero)),
        lengths=st.lengths.at[seat].set(rows.shape[2]))
    return dataclasses.replace(mtp_seats, state=state)


@functools.partial(jax.jit, static_argnames=("block",))
def read_blocks(kv, index_keys, seats, starts, *, block: int):
    """The blocks of rows [starts[i], starts[i] + T) of seats[i], i < M, of kv [L, B, S, D+R]
    and index_keys [G, B, S, N] (L = G = 1 for the MTP layer's state; the model's layers and
    groups for a resident state, `fo_jax.engine.resident_prefix`): M arrays [L, T, D+R] and M
    arrays [G, T, N]. O((L + G) M T) rows copied."""
    zero = jnp.zeros((), jnp.int32)
    out_kv, out_keys = [], []
    for i in range(seats.shape[0]):
        at = (zero, seats[i], starts[i], zero)
        out_kv.append(jax.lax.dynamic_slice(
            kv, at, (kv.shape[0], 1, block, kv.shape[3]))[:, 0])
        out_keys.append(jax.lax.dynamic_slice(
            index_keys, at, (index_keys.shape[0], 1, block, index_keys.shape[3]))[:, 0])
    return tuple(out_kv), tuple(out_keys)


__all__ = ["MEMORIES", "MTPPrefixStore", "mtp_block_bytes"]

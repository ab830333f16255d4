"""Prefix reuse on the resident path: the KV rows of earlier prompts' whole blocks, copied into
a new request's seat instead of prefilled again.

    store = ResidentPrefixStore(config, block_tokens=256, num_blocks=64)
    slots, cached = store.lookup(prompt, chunk=256)      # at admission, seat b
    state = store.write(state, b, slots)                 # rows [0, cached) of seat b
    ...                                                  # prefill the prompt from `cached`
    store.insert(state, [(b, prompt[:prefilled], before)])   # after each prefill program

`ResidentPrefixStore` (`for_engine` sizes it for an engine) keeps blocks of T = `block_tokens`
tokens (KV rows [L, T, D+R] and indexer keys [G, T, N]) under the chain hash of
`fo_jax.engine.pages`, in `memory` "device" or "pinned_host", with least recently released
first eviction; `block_bytes` gives a block's bytes. With MTP drafts an
`fo_jax.engine.mtp_prefix.MTPPrefixStore` keeps the MTP layer's rows beside each block.

Contracts: `lookup` matches prompt[:-1] and rounds down to a multiple of `chunk` (which T must
divide), so a request reusing a prefix has the KV, logits and tokens of its run from scratch,
bit for bit. At most `num_blocks` blocks are ever referenced; insertion never lacks room.
Costs: `lookup` and `insert` O(prompt) hashing; `write` one program of O(L n T) rows for n
blocks (at most S / T programs). Why a copy, the two memories and the costs in full:
docs/design/engine.md, "Prefix reuse on the resident path".
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.engine.mtp_prefix import MEMORIES, mtp_block_bytes, read_blocks
from fo_jax.engine.pages import PagePool, PrefixCache


def block_bytes(config: ModelConfig, block_tokens: int, *, mtp: bool = False) -> int:
    """Bytes of one block of T tokens: KV rows of every layer [L, T, D+R] + indexer keys of
    every group [G, T, N] (`ModelConfig.bytes_per_token`: the rows in the config's kv_format,
    the keys in the KV dtype); with `mtp`, + the MTP layer's rows of the same
    tokens ([T, D+R] + [T, N], `fo_jax.engine.mtp_prefix.mtp_block_bytes`)."""
    extra = mtp_block_bytes(config, block_tokens) if mtp else 0
    return int(block_tokens) * config.bytes_per_token + extra


class ResidentPrefixStore:
    """Whole blocks of earlier prompts' KV rows and indexer keys (see the module doc).

    Args:
      config: the model (the blocks' shapes).
      block_tokens: T, tokens per block; a reused prefix is whole blocks.
      num_blocks: blocks the store holds at most (the least recently released are evicted).
      memory: "device" or "pinned_host", where the blocks live.
      mtp: a block also holds the MTP layer's rows of its chunk (MTP drafts: an
        `fo_jax.engine.mtp_prefix.MTPPrefixStore` on this store's cache keeps them): they
        count in `block_bytes`.
    Raises:
      ValueError: bad settings.
    """

    def __init__(self, config: ModelConfig, *, block_tokens: int, num_blocks: int,
                 memory: str = "device", mtp: bool = False):
        for name, value in (("block_tokens", block_tokens), ("num_blocks", num_blocks)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if memory not in MEMORIES:
            raise ValueError(f"prefix_cache_memory={memory!r} must be one of {MEMORIES}")
        self.config, self.memory = config, memory
        self.block_tokens, self.num_blocks = int(block_tokens), int(num_blocks)
        self.block_bytes = block_bytes(config, self.block_tokens, mtp=mtp)
        self.pool = PagePool(self.num_blocks, self.block_tokens)
        self.cache = PrefixCache(self.pool)
        self._kv: list = [None] * self.num_blocks  # slot -> [L, T, D+R]
        self._keys: list = [None] * self.num_blocks  # slot -> [G, T, N]
        self.blocks_written = 0  # blocks copied into the store (insertions)

    @classmethod
    def for_engine(cls, config: ModelConfig, *, prefill_chunk: int, capacity: int,
                   size: int | None, memory: str = "device",
                   mtp: bool = False) -> "ResidentPrefixStore":
        """The store of a resident `Engine(prefix_cache=True, prefix_cache_bytes=size,
        prefix_cache_memory=memory)`: blocks of one prefill chunk (a reused prefix is whole
        chunks anyway: a finer block would be of use only with the rest of its chunk, and the
        offloaded cache's rule, prefill_chunk a multiple of the block, holds by construction),
        as many as `size` bytes hold (default: one seat's, capacity // prefill_chunk). `mtp`
        (MTP drafts): a block's bytes count the MTP layer's rows of its chunk too.

        Raises:
          ValueError: a bad memory or size, or a chunk that leaves no whole chunk before the
            last token of a prompt that fits a seat.
        """
        if memory not in MEMORIES:
            raise ValueError(f"prefix_cache_memory={memory!r} must be one of {MEMORIES}")
        if prefill_chunk >= capacity:
            raise ValueError(f"prefix_cache on the resident path reuses whole prefill chunks, "
                             f"but prefill_chunk={prefill_chunk} leaves none before the last "
                             f"token of a prompt in a seat of {capacity} tokens: lower "
                             "prefill_chunk")
        per_block = block_bytes(config, prefill_chunk, mtp=mtp)
        if size is None:
            blocks = capacity // prefill_chunk
        else:
            if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
                raise ValueError(f"prefix_cache_bytes={size!r} must be an int >= 1 (bytes of "
                                 "cached prefix rows), or None")
            blocks = int(size) // per_block
            if blocks < 1:
                groups = config.num_groups
                raise ValueError(
                    f"prefix_cache_bytes={size} holds no block of {prefill_chunk} tokens "
                    f"({per_block} bytes: KV rows of {config.num_layers} layers and indexer "
                    f"keys of {groups} group{'s' if groups > 1 else ''}"
                    f"{', and the MTP layer' if mtp else ''}): raise it, or lower "
                    "prefill_chunk")
        return cls(config, block_tokens=prefill_chunk, num_blocks=blocks, memory=memory,
                   mtp=mtp)

    def occupancy(self) -> dict:
        """Blocks cached (evictable), held (being copied), free and total; bytes cached and
        total; blocks evicted so far. O(1)."""
        p = self.pool
        return {"cached": p.num_cached, "held": p.num_held, "free": p.num_free,
                "total": p.num_pages, "cached_bytes": p.num_cached * self.block_bytes,
                "total_bytes": p.num_pages * self.block_bytes,
                "evicted": self.cache.num_evicted}

    def check(self) -> None:
        """Raises AssertionError unless the store is consistent: its pool and cache agree,
        no block is held between calls, and every cached block has its arrays. O(blocks):
        tests and debug only."""
        self.pool.check()
        self.cache.check()
        assert self.pool.num_held == 0, f"{self.pool.num_held} blocks held between calls"
        for slot in self.cache._hash_of:
            assert self._kv[slot] is not None and self._keys[slot] is not None, slot

    # Admission -----------------------------------------------------------------------------

    def lookup(self, prompt, *, chunk: int) -> tuple[list[int], int]:
        """The longest cached prefix of whole blocks of prompt[:-1], rounded down to a multiple
        of `chunk` tokens: (its block slots, held for the caller until `write`, and its tokens).
        Counted in the cache's hit-rate figures. O(prompt) hashing + O(blocks matched).

        Raises:
          ValueError: `chunk` is not a multiple of the block.
        """
        if chunk % self.block_tokens:
            raise ValueError(f"prefill_chunk={chunk} must be a multiple of the prefix block "
                             f"of {self.block_tokens} tokens: a reused prefix must end where a "
                             "prefill chunk ends")
        slots, tokens = self.cache.match(np.asarray(prompt)[:-1])
        keep = tokens // chunk * chunk // self.block_tokens
        self.pool.decref(slots[keep:][::-1].tolist())
        return slots[:keep].tolist(), keep * self.block_tokens

    def write(self, state, seat: int, slots: Sequence[int]):
        """`state` (a `ResidentState`, donated) with rows [0, n T) of seat `seat` set to the n
        blocks `slots` (from `lookup`), which are released. One program, O(L n T) rows."""
        if not slots:
            return state
        kv = tuple(self._kv[s] for s in slots)
        keys = tuple(self._keys[s] for s in slots)
        if self.memory != "device":
            kv, keys = jax.device_put((kv, keys), _sharding(state.kv, "device"))
        new_kv, new_keys = _write_blocks(state.kv, state.index_keys, kv, keys, np.int32(seat))
        self.pool.decref(list(slots)[::-1])
        return dataclasses.replace(state, kv=new_kv, index_keys=new_keys)

    # After a prefill -----------------------------------------------------------------------

    def insert(self, state, prefilled: Sequence[tuple[int, np.ndarray, int]]) -> int:
        """Store the full blocks of each (seat, tokens, before): `tokens` are the first tokens
        of the seat's prompt whose rows are final (prefilled, or copied from the store), of
        which `before` were before the last prefill program; a request that completed no block
        since is skipped. Blocks already cached are found (not copied again); the new ones
        are allocated (evicting the least recently released), registered, and copied out of
        the seats by one program. Returns the blocks newly stored. O(tokens) hashing per
        request + one program of O(L M T) rows for M new blocks."""
        z = self.block_tokens
        held, seats, starts, targets = [], [], [], []
        for seat, tokens, before in prefilled:
            tokens = np.asarray(tokens)
            full = len(tokens) // z
            if full == before // z:
                continue
            matched, _ = self.cache.match(tokens[:full * z], count=False)
            m = len(matched)
            new = self.pool.allocate(min(full - m, self.pool.num_available))
            pages = matched.tolist() + new.tolist()
            if len(new):
                # Registered before their rows are copied (below, in this call): the next
                # request of the call finds them instead of copying the same block again.
                self.cache.insert(tokens[:len(pages) * z], pages)
            for j, slot in enumerate(new.tolist()):
                seats.append(seat)
                starts.append((m + j) * z)
                targets.append(slot)
            held.append(pages)
        if targets:
            kv, keys = read_blocks(state.kv, state.index_keys, np.asarray(seats, np.int32),
                                    np.asarray(starts, np.int32), block=z)
            if self.memory != "device":
                kv, keys = jax.device_put((kv, keys), _sharding(state.kv, self.memory))
            for slot, k, ik in zip(targets, kv, keys):
                self._kv[slot], self._keys[slot] = k, ik
            self.blocks_written += len(targets)
        for pages in held:
            self.pool.decref(pages[::-1])  # deepest blocks first in the eviction order
        return len(targets)


def _sharding(like, memory_kind: str):
    """A single-device sharding on `like`'s device in `memory_kind` memory."""
    device = next(iter(like.devices()))
    return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_blocks(kv, index_keys, kv_blocks, key_blocks, seat):
    """kv [L, B, S, D+R] and index_keys [G, B, S, N] (donated: updated in place) with rows
    [0, n T) of seat `seat` set to the n blocks kv_blocks [L, T, D+R] and key_blocks [G, T, N],
    in order. O(L n T) rows written."""
    zero = jnp.zeros((), jnp.int32)
    rows = jnp.concatenate(kv_blocks, axis=1)[:, None]
    keys = jnp.concatenate(key_blocks, axis=1)[:, None]
    return (jax.lax.dynamic_update_slice(kv, rows.astype(kv.dtype), (zero, seat, zero, zero)),
            jax.lax.dynamic_update_slice(index_keys, keys.astype(index_keys.dtype),
                                         (zero, seat, zero, zero)))


__all__ = ["MEMORIES", "ResidentPrefixStore", "block_bytes"]

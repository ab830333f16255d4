"""Prefix reuse: one object per engine that finds a new request's longest cached prefix of whole
prefill chunks (not prefilled again) and stores what each prefill chunk completes.

    prefix = kv.prefix                                  # a KV store's; None without prefix_cache
    hit = prefix.match(req.prompt, mtp=True)            # at admission: PrefixHit
    state = prefix.write(state, seat, hit.held)         # resident: rows copied into the seat
    prefix.insert(state, [(req, before)])               # after each prefill chunk
    prefix.insert_mtp(mtp_seats, [(req, before)])       # after the chunk's MTP feed

Two ways, one interface. Paged (`PagedPrefix`): the pool's full pages of earlier prompts under
their chain hash (`fo_jax.engine.pages.PrefixCache`), mapped by the new request's pages
(`write` has nothing to copy). Resident (`ResidentPrefix`): the seats' KV is apart, so whole
chunks of earlier prompts' rows are kept in a store (`store`, a `ResidentPrefixStore` of
`fo_jax.engine.resident_prefix`) and copied into the seat. With MTP drafts, the MTP layer's rows
of each cached chunk are kept beside it (`mtp`, an `fo_jax.engine.mtp_prefix.MTPPrefixStore` on
the same cache), since a mapped prefix runs no prefill to feed the MTP layer.

Contracts: a match is whole prefill chunks of prompt[:-1] (the last token is always computed:
its logits sample the first token), so the rest of the prompt is cut into the same chunks at the
same offsets as from scratch and the request's KV, logits and tokens are those of its run from
scratch, bit for bit; with MTP drafts it is cut further to the chunks whose MTP rows are stored
with the prompt's own next tokens. What `match` returns is referenced for the caller (paged: the
request's pages take the references; resident: `write` drops them). Costs: `match` and
`insert` O(prompt) hashing; `write` one program of O(L prefix) rows (resident). The rules:
docs/design/engine.md, "Prefix reuse on the resident path" and "MTP drafts".
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from fo_jax.engine.mtp_prefix import MTPPrefixStore
from fo_jax.engine.pages import PrefixCache
from fo_jax.engine.requests import RequestState
from fo_jax.engine.resident_prefix import ResidentPrefixStore


class PrefixHit(NamedTuple):
    """A request's cached prefix (`PrefixReuse.match`).

    Attributes:
      held: what holds it, referenced for the caller: the pool's pages (paged) or the store's
        block slots (resident, for `write`).
      tokens: its tokens (whole prefill chunks; 0: none).
      mtp_blocks: with MTP drafts, its chunks' MTP rows (`MTPPrefixStore.lookup`); else None.
    """

    held: list
    tokens: int
    mtp_blocks: list | None = None


class PrefixReuse:
    """What both ways share (see the module doc).

    Attributes:
      cache: the chain-hash cache (`PrefixCache`: on the page pool, or on the store's blocks).
      chunk: the prefill chunk: a reused prefix is whole chunks.
      mtp: with MTP drafts, the MTP rows of the cached chunks (`MTPPrefixStore`); else None.
    """

    store: ResidentPrefixStore | None = None

    def __init__(self, cache: PrefixCache, *, chunk: int, mtp_memory: str | None = None):
        self.cache, self.chunk = cache, int(chunk)
        self.mtp = (None if mtp_memory is None
                    else MTPPrefixStore(cache, chunk=self.chunk, memory=mtp_memory))

    def match(self, prompt: np.ndarray, *, mtp: bool = True) -> PrefixHit:
        """The longest cached prefix of whole prefill chunks of prompt[:-1]; with MTP drafts
        and `mtp` (False for a request that takes back its own saved MTP state), cut to the
        chunks whose MTP rows are stored with the prompt's own next tokens. What is cut off is
        released. O(prompt) hashing."""
        held, tokens = self._match(prompt)
        if self.mtp is None or not mtp or not tokens:
            return PrefixHit(held, tokens)
        n, blocks = self.mtp.lookup(prompt, chunks=tokens // self.chunk)
        keep = n * self.chunk // self.cache.page_size
        self._release(held[keep:])
        return PrefixHit(held[:keep], n * self.chunk, blocks)

    def write(self, state, seat: int, held: Sequence):
        """`state` with the cached prefix `held` (`match`) in seat `seat` (resident: rows
        copied; paged: the request's pages map them, nothing to copy)."""
        return state

    def insert(self, state, prefilled: Sequence[tuple[RequestState, int]]) -> None:
        """After a prefill chunk: store what each (request, tokens prefilled before the
        chunk) completed (its rows up to `req.prefilled` are final)."""
        raise NotImplementedError

    def insert_mtp(self, mtp_seats, prefilled: Sequence[tuple[RequestState, int]]) -> None:
        """With MTP drafts, after the chunk's feed: store the MTP rows of the chunks each
        (request, tokens prefilled before the chunk) completed (`MTPPrefixStore.insert`)."""
        if self.mtp is not None:
            self.mtp.insert(mtp_seats, [
                (r.seat, r.prompt, before, r.prefilled, r.tokens[0] if r.tokens else None)
                for r, before in prefilled])

    def check(self) -> None:
        """Raises AssertionError unless the cache (and the store, and the MTP rows) are
        consistent. Tests and debug only."""
        self.cache.check()
        if self.mtp is not None:
            self.mtp.check()

    def _match(self, prompt: np.ndarray) -> tuple[list, int]:
        raise NotImplementedError

    def _release(self, held: list) -> None:
        raise NotImplementedError


class PagedPrefix(PrefixReuse):
    """Prefix reuse over a page pool: full pages of earlier prompts, mapped (`PrefixCache`)."""

    def _match(self, prompt: np.ndarray) -> tuple[list, int]:
        matched, cached = self.cache.match(prompt[:-1])
        cached = cached // self.chunk * self.chunk
        keep = cached // self.cache.page_size
        self.cache.pool.decref(matched[keep:].tolist())
        return matched[:keep].tolist(), cached

    def _release(self, held: list) -> None:
        self.cache.pool.decref(list(held))

    def insert(self, state, prefilled: Sequence[tuple[RequestState, int]]) -> None:
        # Pages of prefilled tokens are final: a request admitted from now on may map them.
        for req, _ in prefilled:
            self.cache.insert(req.prompt[:req.prefilled], req.pages.pages)


class ResidentPrefix(PrefixReuse):
    """Prefix reuse on resident seats: whole chunks of rows copied into the seat from a
    `ResidentPrefixStore` (`store`)."""

    def __init__(self, store: ResidentPrefixStore, *, chunk: int, mtp: bool = False):
        self.store = store
        super().__init__(store.cache, chunk=chunk, mtp_memory=store.memory if mtp else None)

    def _match(self, prompt: np.ndarray) -> tuple[list, int]:
        return self.store.lookup(prompt, chunk=self.chunk)

    def _release(self, held: list) -> None:
        self.store.pool.decref(list(held)[::-1])

    def write(self, state, seat: int, held: Sequence):
        return self.store.write(state, seat, held)

    def insert(self, state, prefilled: Sequence[tuple[RequestState, int]]) -> None:
        self.store.insert(state, [(r.seat, r.prompt[:r.prefilled], before)
                                  for r, before in prefilled])

    def check(self) -> None:
        self.store.check()
        super().check()


__all__ = ["PagedPrefix", "PrefixHit", "PrefixReuse", "ResidentPrefix"]

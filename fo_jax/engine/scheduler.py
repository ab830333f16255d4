"""Who runs when: the waiting queue, the seats' occupants, admission by pages and device bytes,
and what to preempt or drop when a running request's pages run short.

    scheduler = Scheduler(settings, kv)       # settings: EngineSettings; kv: its KV store
    new, kept = scheduler.admit(step)          # seated in queue order while they fit
    room = scheduler.make_room(req)            # before a decode call (reserve="prompt")

The scheduler decides and keeps the host records; the engine acts on the device (prefills the
seated requests, rejoins those that kept their pages, preempts the victim), so every rule here
is a function of the host records (`RequestState`), the pool's counts, the prefix cache's
hashes and the planner's bytes (`MemoryCosts`), testable without a model. The rules and why the
engine always progresses: docs/design/engine.md ("Reservation and preemption", "Progress").
Resident (no page pool), nothing is reserved or preempted: every request that takes a seat
fits it.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from fo_jax.engine.kv_store import KVStore
from fo_jax.engine.pages import PoolExhausted, RequestPages
from fo_jax.engine.requests import RequestState
from fo_jax.engine.settings import EngineSettings


class RequestRefused(ValueError):
    """A request that can never run with these budgets (the message gives the figures)."""


class Room(NamedTuple):
    """What `Scheduler.make_room` decided for a decoding request's next call.

    Attributes:
      action: "ready" (its pages hold the call already), "grown" (its pages grew for the
        call), "drop_kept" (drop the pages `other`, a waiting request, kept, then ask again)
        or "preempt" (preempt `other`, a running request, keeping its pages if `keep`, then
        ask again; `other` may be the request itself).
      other: the request to drop or preempt; None for "ready" and "grown".
      keep: "preempt" only: whether the victim keeps its pages.
    """

    action: str
    other: RequestState | None = None
    keep: bool = False


class Scheduler:
    """The queue and the seats of one engine (see the module doc).

    Attributes:
      occupants: [seats] the request in each seat (None: free).
      waiting: the waiting requests (new, and preempted ones with or without kept pages).
    """

    def __init__(self, settings: EngineSettings, kv: KVStore):
        sched = settings.scheduler
        self.kv = kv
        self.capacity = kv.capacity
        self.order, self.reserve = sched.order, sched.reserve
        self.max_wait_steps = sched.max_wait_steps
        self.device_bytes = None if sched.device_bytes is None else int(sched.device_bytes)
        self.prefill_batch = int(sched.prefill_batch)
        self.call_tokens = int(sched.decode_steps_per_call) * (
            int(settings.speculative.num_drafts) + 1)  # the most one decode call stores
        # Overlap: the ids of the requests of the decode call in flight (their host records
        # lag that call's tokens: `tokens_needed` counts them).
        self.unread: set[str] = set()
        self.occupants: list[RequestState | None] = [None] * kv.seats
        self.waiting: list[RequestState] = []
        self.arrivals = itertools.count()
        self.admissions = itertools.count()

    # Sizes -----------------------------------------------------------------------------------

    def reserved_tokens(self, prompt_len: int, max_tokens: int) -> int:
        """The most tokens a request's pages ever hold: prompt + output, at most a seat
        (reserve="full" reserves them all at admission: a running request never waits for a
        page)."""
        return min(prompt_len + max_tokens, self.capacity)

    def tokens_needed(self, req: RequestState) -> int:
        """Tokens the request's pages must hold before its next decode call (or, admitted,
        through its prefill, its replay and its first decode call): with reserve="prompt",
        the tokens stored (prompt + fed tokens: every sampled token but the last) + one
        call's tokens (two calls' for a request of the call in flight, `unread`: the host
        has not seen the tokens it stores); with reserve="full", all it may ever hold."""
        full = self.reserved_tokens(len(req.prompt), req.max_tokens)
        if self.reserve == "full":
            return full
        calls = 2 if req.request_id in self.unread else 1
        return min(len(req.prompt) + max(len(req.tokens) - 1, 0) + calls * self.call_tokens,
                   full)

    def seat_bytes(self, req: RequestState) -> int:
        """Device bytes seat-bound to a running request: its seat (hot cache, tails, slot
        map), + its prefill buffers while prefilling; what preempting it frees besides its
        pages. O(1)."""
        seat, prefill, _ = self.kv.costs.device_need(
            len(req.prompt), 0, prefilling=req.prefilled < len(req.prompt))
        return seat + prefill

    def device_bytes_used(self) -> int | None:
        """Device bytes of request state by the planner's arithmetic (`MemoryCosts`): hot
        cache of every occupied seat + prefill buffers of the prefilling ones + every page
        held (a shared page once; cached pages mapped by none are evictable: not counted): its
        indexer keys, and its KV rows too when the pool is on the device
        (`MemoryCosts.held_page_device_bytes`). None on the resident path. O(seats)."""
        costs = self.kv.costs
        if costs is None:
            return None
        used = self.kv.pool.num_held * costs.held_page_device_bytes
        return used + sum(self.seat_bytes(r) for r in self.occupants if r is not None)

    def check_fits_alone(self, prompt_len: int, max_tokens: int) -> None:
        """Raise unless a request of `prompt_len` prompt tokens and `max_tokens` could run
        alone: its pages for prompt + max_tokens within the pool (ValueError) and, with
        `device_bytes`, its seat, prefill buffers and pages within the budget
        (RequestRefused), the figures named. Nothing to check resident. O(1)."""
        pool, costs = self.kv.pool, self.kv.costs
        if pool is None:
            return
        need = -(-self.reserved_tokens(prompt_len, max_tokens) // pool.page_size)
        if need > pool.num_pages:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_tokens={max_tokens} needs {need} "
                f"pages of {pool.page_size} tokens, but the pool holds "
                f"{pool.num_pages}: lower max_tokens or raise num_pages")
        if self.device_bytes is not None:
            seat, prefill, pages = costs.device_need(prompt_len, need)
            if seat + prefill + pages > self.device_bytes:
                raise RequestRefused(
                    f"prompt of {prompt_len} tokens + max_tokens={max_tokens} can never "
                    f"fit device_bytes={self.device_bytes:,}: alone it needs "
                    f"{seat + prefill + pages:,} bytes of device memory (seat hot cache "
                    f"{seat:,} + prefill buffers {prefill:,} + {costs.page_label} "
                    f"{pages:,} for {need} pages of {pool.page_size} tokens"
                    f"{', the pool in device memory' if costs.pool_on_device else ''})"
                    "; shorten the prompt or max_tokens, or raise device_bytes")

    # Admission -------------------------------------------------------------------------------

    def queue(self, now: int) -> list[RequestState]:
        """The waiting requests in admission order at engine step `now`: preempted ones first
        (in arrival order: the oldest resumes first), then new ones by `order`; with
        "shortest", those that waited `max_wait_steps` steps go first, in arrival order.
        O(Q log Q)."""
        if self.order == "fifo":
            return sorted(self.waiting, key=lambda r: (not r.preempted, r.order))
        wait = self.max_wait_steps

        def aged(r: RequestState) -> bool:
            return r.preempted or (wait is not None and now - r.queued_at >= wait)

        return sorted(self.waiting, key=lambda r: (
            not r.preempted, not aged(r), 0 if aged(r) else len(r.prompt) + r.max_tokens,
            r.order))

    def reserve_pages(self, req: RequestState, prefix_pages=(),
                      cached: int = 0) -> RequestPages | None:
        """Pages for a request taking a seat: its cached prefix `prefix_pages` (`cached`
        tokens, mapped: the caller's references pass to them) + fresh ones for
        `tokens_needed`, if the pool can give them and its device bytes (seat + prefill
        buffers) fit `device_bytes`; None, with nothing held, when they do not."""
        pages = RequestPages(self.kv.pool, self.kv.max_pages, prefix_pages=list(prefix_pages),
                             prefix_tokens=cached)
        try:
            pages.grow(self.tokens_needed(req))
        except PoolExhausted:
            pages.release()
            return None
        if self.device_bytes is not None:
            seat, prefill, _ = self.kv.costs.device_need(len(req.prompt), 0)
            if self.device_bytes_used() + seat + prefill > self.device_bytes:
                pages.release()  # its pages are counted in the pool's held pages
                return None
        return pages

    def fits_kept(self, req: RequestState) -> bool:
        """A request preempted with its pages kept: grow them for its next decode call (or,
        prefilling, they already hold its prompt) if the pool can give its new pages and
        those the running requests need for the coming call (`tokens_needed`), and its seat
        (+ prefill buffers while prefilling) + all these pages fit `device_bytes`; False,
        nothing changed, when they do not. Counting the running requests' growth keeps the
        call it resumes for from preempting it again at once. O(seats + pages)."""
        tokens = self.tokens_needed(req)
        need = req.pages.pages_needed(tokens) + sum(
            r.pages.pages_needed(self.tokens_needed(r)) for r in self.occupants
            if r is not None and r.prefilled == len(r.prompt))
        if need > self.kv.pool.num_available:
            return False
        if self.device_bytes is not None:
            seat, prefill, _ = self.kv.costs.device_need(len(req.prompt), 0)
            if req.prefilled == len(req.prompt):
                prefill = 0
            if (self.device_bytes_used() + seat + prefill
                    + need * self.kv.costs.held_page_device_bytes > self.device_bytes):
                return False
        req.pages.grow(tokens)
        return True

    def kept_to_drop(self, req: RequestState) -> RequestState | None:
        """When `req`, the head of the queue, does not fit: the waiting request whose kept
        pages to drop (the youngest), only while no seat is occupied (nothing else would ever
        free them; `req` fits alone); else None (it waits). O(queue)."""
        others = [r for r in self.waiting if r.pages is not None and r is not req]
        if any(r is not None for r in self.occupants) or not others:
            return None
        return max(others, key=lambda r: r.admitted)

    def admit(self, now: int) -> tuple[list[RequestState], list[RequestState]]:
        """Seat waiting requests in queue order (`queue`, at engine step `now`) while a seat is
        free and the head of the queue fits (`take`); the first that does not blocks the ones
        behind it (no overtaking). Returns (new: seated without kept pages, their cached
        prefix matched, `cached_tokens`; kept: preempted ones that took back their kept pages,
        in queue order). O(seats + prompt + pages) per seated request, O(Q log Q) for the
        queue."""
        free = self.free_seats()
        new, kept = [], []
        for req in self.queue(now) if free else []:
            if not free:
                break
            had_pages = req.pages is not None  # preempted with its pages kept
            if not self.take(req):
                break
            self.waiting.remove(req)
            b = free.pop(0)
            req.seat, req.preempted = b, False
            req.admitted = next(self.admissions)
            self.occupants[b] = req
            (kept if had_pages else new).append(req)
        return new, kept

    def take(self, req: RequestState) -> bool:
        """Whether `req` can take a seat now: its kept pages grown (`fits_kept`), or its
        cached prefix matched (prefix reuse: `PrefixReuse.match`, `cached_tokens`, and the
        blocks to copy resident, `prefix_held`) and its pages reserved (`reserve_pages`).
        When it cannot and no seat is occupied, the pages other waiting requests kept are
        dropped, youngest first, until it fits (`kept_to_drop`): it fits alone (`add_request`
        refused any request that does not), and with no request running nothing else would
        ever free them. O(queue + pages) per drop."""
        while True:
            if req.pages is not None:
                if self.fits_kept(req):
                    return True
            elif self._reserve(req):
                return True
            other = self.kept_to_drop(req)
            if other is None:
                return False
            self.drop_kept(other)

    def _reserve(self, req: RequestState) -> bool:
        """Match the request's cached prefix and reserve its pages (paged); False, with
        nothing held, when they do not fit."""
        prefix, held, cached = self.kv.prefix, [], 0
        req.mtp_blocks = None
        if prefix is not None:  # a request taking back its saved MTP state needs no MTP rows
            held, cached, req.mtp_blocks = prefix.match(req.prompt,
                                                        mtp=req.mtp_saved is None)
        if self.kv.pool is not None:
            pages = self.reserve_pages(req, held, cached)
            if pages is None:
                return False
            req.pages, held = pages, []  # the pages hold the prefix's references now
        req.cached_tokens, req.prefix_held = cached, held
        return True

    def drop_kept(self, req: RequestState) -> None:
        """Drop a preempted request's pages: it will prefill its prompt again and replay its
        tokens. Its full prompt pages the prefix cache registered stay cached (mapped again
        on resume unless evicted meanwhile); the others go back to the pool. O(pages)."""
        req.pages.release()
        req.pages = None
        req.prefilled = req.cached_tokens = 0
        if not req.tokens:  # it prefills again from the start: so does its MTP state
            req.mtp_saved = None

    # Growth and preemption (reserve="prompt") --------------------------------------------------

    def decoding_by_age(self) -> list[RequestState]:
        """The decoding requests, oldest (admitted or resumed first) first. O(seats log)."""
        return sorted((r for r in self.occupants
                       if r is not None and r.prefilled == len(r.prompt)),
                      key=lambda r: r.admitted)

    def make_room(self, req: RequestState) -> Room:
        """Grow the decoding request's pages for its next call, or say what must go first:
        pool pages short (after evicting unreferenced prefix-cache pages, least recently
        released first, as any allocation does): drop the pages a waiting preempted request
        kept (youngest first), else preempt the youngest running request dropping its pages;
        only `device_bytes` short: preempt the youngest running request keeping its pages
        (its seat's bytes are freed), or, when the request is alone in the seats, drop the
        pages a waiting request kept (youngest first); with the pool on the device (bytes
        short are pages short): drop the kept pages first, then preempt the youngest running
        request, keeping its pages only when its seat's bytes cover the shortfall. O(seats +
        queue)."""
        pool, costs = self.kv.pool, self.kv.costs
        need = req.pages.pages_needed(self.tokens_needed(req))
        if need == 0:
            return Room("ready")
        pool_ok = need <= pool.num_available
        short = (0 if self.device_bytes is None else self.device_bytes_used()
                 + need * costs.held_page_device_bytes - self.device_bytes)
        if pool_ok and short <= 0:
            req.pages.grow(self.tokens_needed(req))
            return Room("grown")
        running = [r for r in self.occupants if r is not None]
        kept = [r for r in self.waiting if r.pages is not None]
        victim = max(running, key=lambda r: r.admitted)
        # With the pool on the device, bytes short are pages short: kept pages hold device
        # bytes nobody decodes with, so they go first too.
        if kept and (not pool_ok or costs.pool_on_device or len(running) == 1):
            return Room("drop_kept", max(kept, key=lambda r: r.admitted))
        # Keep the victim's pages when they do not stand in the way: the pool has the pages
        # and, with it on the device, freeing the victim's seat covers the bytes.
        keep = pool_ok and (not costs.pool_on_device or self.seat_bytes(victim) >= short)
        return Room("preempt", victim, keep)

    def prefill_packs(self) -> list[list[RequestState]]:
        """The prefilling requests, in packs that share a prefill program (`KVStore.prefill`):
        by history bucket (`KVStore.history_pages`: offloaded, each request loads its own
        bucket of history, never a longer request's), each bucket's requests in seat order split
        into packs of powers of two up to `prefill_batch` (`pack_sizes`), so no row is padding
        and few programs compile. O(seats)."""
        buckets: dict[int, list[RequestState]] = {}
        for req in self.occupants:
            if req is not None and req.prefilled < len(req.prompt):
                buckets.setdefault(self.kv.history_pages(req.prefilled), []).append(req)
        packs = []
        for group in buckets.values():
            start = 0
            for size in pack_sizes(len(group), self.prefill_batch):
                packs.append(group[start:start + size])
                start += size
        return packs

    def free_seats(self) -> list[int]:
        """The free seats, in order. O(seats)."""
        return [b for b, r in enumerate(self.occupants) if r is None]


def pack_sizes(count: int, most: int) -> list[int]:
    """`count` requests as packs of powers of two of at most `most` each, largest first
    (5 with most=8: [4, 1]; 20: [8, 8, 4]; most=6: the largest power 4): one program per pack
    size, none with a padding row."""
    largest = 1 << (int(most).bit_length() - 1)
    sizes = []
    while count:
        size = min(largest, 1 << (count.bit_length() - 1))
        sizes.append(size)
        count -= size
    return sizes


__all__ = ["RequestRefused", "Room", "Scheduler", "pack_sizes"]

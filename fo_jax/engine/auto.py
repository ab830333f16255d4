"""Automatic offload: requests run resident while their KV fits a short seat, and move to
offloaded decoding only when memory requires it (and back when a short seat frees).

    engine = AutoEngine(params, config, resident_seats=4, resident_capacity=512,
                        offload=OffloadConfig(hot_slots=64, page_size=16, capacity=8192),
                        offload_seats=16)
    rid = engine.add_request(prompt_ids, max_tokens=64)      # the `Engine` request API
    outputs = engine.run()

`AutoEngine` holds two `fo_jax.engine.Engine` tiers with the same settings: a resident engine
of `resident_seats` x `resident_capacity` tokens and an offloaded one of `offload_seats` x
`offload.capacity`. Each `step()` moves resident requests whose next decode call could fill
their seat to the offloaded tier (parking them while it is full), places waiting requests
(resident first), moves offloaded requests back into resident seats the queue left free, and
steps both engines. A request moves at most twice. `tier_of`, `counters` ("placed_resident",
"placed_offloaded", "migrations", "parked", "moved_back") and `all_counters` report it.

Contracts: the moves are lossless: a request's tokens equal those of the same engine serving
it alone and, without drafts, its solo resident run's, bit for bit (tests/engine/test_auto.py).
Costs: O(seats) host work per step (O(seats log seats) to order moves back); a move copies one
seat's rows once. How placement, moves and prefix reuse work: docs/design/engine.md,
"Automatic offload".
"""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Sequence

from fo_jax.config import ModelConfig
from fo_jax.engine.engine import Engine
from fo_jax.engine.requests import RequestOutput, RequestState, claim_request_id
from fo_jax.engine.runner import SeatExport
from fo_jax.offload.config import OffloadConfig


OFFLOADED_ONLY = ("num_pages", "host_pool_bytes")  # the offloaded tier's pool
RESIDENT_ONLY = ("prefix_cache_bytes", "prefix_cache_memory")  # the resident prefix store


class AutoEngine:
    """A resident tier of short seats and an offloaded tier of long ones (see the module doc).

    Args:
      params, config: the model.
      resident_seats: seats of the resident tier (their whole KV on the device).
      resident_capacity: tokens per resident seat (prompt + output held there).
      offload: OffloadConfig of the offloaded tier; its `capacity` (tokens per seat) bounds a
        request (prompt + output) and must be >= resident_capacity.
      offload_seats: seats of the offloaded tier.
      engine_kwargs: `Engine`'s keywords. num_pages and host_pool_bytes (the pool) go to the
        offloaded tier only; prefix_cache_bytes and prefix_cache_memory (the prefix store) to
        the resident tier only (the offloaded tier's cache lives in its pool); every other
        (prefix_cache, decode_steps_per_call, prefill_chunk, tokenizer, max_stop_ids,
        query_block, implementation, ...) to both. With prefix_cache both tiers reuse the
        prompt prefixes of earlier requests on their tier: the resident tier copies cached
        blocks into the seat, the offloaded tier maps cached pages (needs prefill_chunk a
        multiple of offload.page_size). Both tiers run without overlap (overlap=True is
        refused: the moves need exact lengths).
    Raises:
      ValueError: bad settings, before anything is allocated.
    """

    def __init__(self, params, config: ModelConfig, *, resident_seats: int,
                 resident_capacity: int, offload: OffloadConfig, offload_seats: int,
                 **engine_kwargs: Any):
        if not isinstance(offload, OffloadConfig):
            raise ValueError(f"offload must be an OffloadConfig (the long tier), got "
                             f"{type(offload).__name__}")
        if (not isinstance(resident_capacity, numbers.Integral)
                or not 1 <= resident_capacity <= offload.capacity):
            raise ValueError(f"resident_capacity={resident_capacity!r} must be an int in "
                             f"[1, offload.capacity={offload.capacity}]: a request outgrowing "
                             "its resident seat moves to a longer offloaded one")
        for name in ("capacity", "seats", "offload"):
            if name in engine_kwargs:
                raise ValueError(f"{name} is not an AutoEngine setting (give resident_seats, "
                                 "resident_capacity, offload and offload_seats)")
        if engine_kwargs.get("overlap"):
            raise ValueError("AutoEngine runs its tiers with overlap=False: it moves requests "
                             "between them by their exact lengths every step, which a decode "
                             "call in flight would leave unknown")
        engine_kwargs["overlap"] = False
        self.config = config
        tier = {name: engine_kwargs.pop(name) for name in OFFLOADED_ONLY + RESIDENT_ONLY
                if name in engine_kwargs}
        self.resident = Engine(params, config, seats=resident_seats, capacity=resident_capacity,
                               **{k: v for k, v in tier.items() if k in RESIDENT_ONLY},
                               **engine_kwargs)
        self.offloaded = Engine(params, config, seats=offload_seats, offload=offload,
                                **{k: v for k, v in tier.items() if k in OFFLOADED_ONLY},
                                **engine_kwargs)
        self.n_steps = self.resident.n_steps
        # The most tokens one decode call stores per request: N steps of D + 1 ways.
        self.call_tokens = self.n_steps * (self.resident.num_drafts + 1)
        self._waiting: list[RequestState] = []
        self._parked: list[SeatExport] = []
        self._tier: dict[str, str] = {}  # id -> its place (see `tier_of`)
        self._finished: dict[str, RequestState] = {}  # cancelled before reaching an engine
        self._ids = itertools.count()
        self.counters = {"placed_resident": 0, "placed_offloaded": 0, "migrations": 0,
                         "parked": 0, "moved_back": 0, "requests_cancelled": 0}

    # Requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                    **sampling: Any) -> str:
        """Queue a request (the arguments of `Engine.add_request`); returns its id. It is
        checked against the offloaded tier (a seat of offload.capacity tokens, the pool), so a
        refused request leaves the engine as it was."""
        request_id = claim_request_id(request_id, self._ids, self._tier)
        rid = self.offloaded.add_request(prompt, request_id=request_id, **sampling)
        self._waiting.append(self.offloaded.withdraw(rid))
        self._tier[rid] = "waiting"
        return rid

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its seat (either tier); False if it had finished."""
        tier = self._where(request_id)
        if tier in ("resident", "offloaded"):
            return getattr(self, tier).cancel(request_id)
        if tier == "done":
            return False
        if tier == "waiting":
            req = next(r for r in self._waiting if r.request_id == request_id)
            self._waiting.remove(req)
        else:  # parked: its rows are dropped with it
            moved = next(m for m in self._parked if m.request.request_id == request_id)
            self._parked.remove(moved)
            req = moved.request
        req.finish_reason = "cancelled"
        self._finished[request_id] = req
        self._tier[request_id] = "done"
        self.counters["requests_cancelled"] += 1
        return True

    def release(self, request_id: str) -> RequestOutput:
        """Forget a finished request (its id can be used again); returns its final output."""
        tier = self._where(request_id)
        if tier == "done":
            out = self._finished.pop(request_id).output([])
        elif tier in ("resident", "offloaded"):
            out = getattr(self, tier).release(request_id)
        else:
            raise ValueError(f"request {request_id!r} has not finished: cancel it first")
        del self._tier[request_id]
        return out

    def _where(self, request_id: str) -> str:
        tier = self._tier.get(request_id)
        if tier is None:
            raise KeyError(f"no request {request_id!r}")
        return tier

    def tier_of(self, request_id: str) -> str:
        """Where a request is: "waiting", "resident", "offloaded", "parked" (moving to the
        offloaded tier) or "done" (cancelled before it reached a tier)."""
        return self._where(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._parked or self.resident.has_unfinished()
                    or self.offloaded.has_unfinished())

    def num_waiting(self) -> int:
        return (len(self._waiting) + len(self._parked) + self.resident.num_waiting()
                + self.offloaded.num_waiting())

    def num_running(self) -> int:
        return self.resident.num_running() + self.offloaded.num_running()

    def pool_occupancy(self) -> dict:
        """The offloaded tier's pool pages (`Engine.pool_occupancy`)."""
        return self.offloaded.pool_occupancy()

    def all_counters(self) -> dict:
        """The tiers' counters summed, with this engine's own (placements, migrations)."""
        out = dict(self.counters)
        for name, value in self.resident.counters.items():
            out[name] = out.get(name, 0) + value + self.offloaded.counters.get(name, 0)
        return out

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; the final output of each request."""
        while self.has_unfinished():
            self.step()
        out = {rid: r.output([]) for rid, r in self._finished.items()}
        for engine in (self.resident, self.offloaded):
            out.update({rid: r.output([]) for rid, r in engine.requests().items()})
        return out

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Migrate, place, step both tiers (docs/design/engine.md, "Automatic offload"); the
        outputs of the requests that moved."""
        self._migrate()
        self._unpark()
        self._place()
        if self._move_back() and self._waiting:
            self._place()  # the offloaded seats the moves freed
        outputs = []
        for name in ("resident", "offloaded"):
            engine = getattr(self, name)
            if engine.has_unfinished():
                outputs += engine.step()
        return outputs

    def _fits_resident(self, req: RequestState) -> bool:
        """A resident seat can take the request (placed, or moved back from the offloaded
        tier): its length leaves room for its next decode call (`call_tokens`: N steps of D + 1
        ways), or its whole output fits there (it never has to move). Its length: the prompt
        (waiting), else prompt + tokens sampled - 1 (the last token is not fed yet). O(1)."""
        cap, n = self.resident.capacity, len(req.prompt)
        length = n + max(len(req.tokens) - 1, 0)
        return length + self.call_tokens < cap or n + req.max_tokens - 1 <= cap

    def _must_move(self, req: RequestState) -> bool:
        """A resident request whose next decode call could fill its seat before it is done
        (the negation of `_fits_resident` for a decoding request: one moved back by it is not
        moved out before a decode call). O(1)."""
        return not self._fits_resident(req)

    def _migrate(self) -> None:
        """Resident requests about to outgrow their seat leave it (parked until seated)."""
        for req in self.resident.running_requests():
            if (req.finish_reason is not None or not req.tokens
                    or not self._must_move(req)):
                continue
            self._parked.append(self.resident.export_seat(req.request_id))
            self._tier[req.request_id] = "parked"
            self.counters["parked"] += 1

    def _unpark(self) -> None:
        """Seat parked requests on the offloaded tier, in order, while seats and pages last."""
        while self._parked and self._free_offloaded() > 0:
            moved = self._parked[0]
            if not self.offloaded.import_seat(moved):
                break
            self._parked.pop(0)
            self._tier[moved.request.request_id] = "offloaded"
            self.counters["migrations"] += 1

    def _free_resident(self) -> int:
        """Resident seats neither occupied, nor promised to a request queued there, nor held
        by a parked request's rows."""
        return (self.resident.seats - self.resident.num_running()
                - self.resident.num_waiting() - len(self._parked))

    def _move_back(self) -> int:
        """Offloaded requests that a resident seat can take (`_fits_resident`) move to the
        resident seats `_place` left free: exported from the offloaded engine (its rows read
        from its host pages, its pages released), imported into a resident seat. The ones
        with the most tokens to decode there go first (fewest left to the offloaded tier).
        Returns how many moved. O(seats log seats) on the host; O(L S_r) rows per move."""
        free = self._free_resident()
        if free <= 0 or not self.offloaded.num_running():
            return 0
        room = self.resident.capacity
        ready = [r for r in self.offloaded.running_requests()
                 if r.prefilled == len(r.prompt) and r.tokens
                 and r.finish_reason is None and self._fits_resident(r)]
        ready.sort(key=lambda r: -min(r.max_tokens - len(r.tokens),
                                      room - len(r.prompt) - len(r.tokens)))
        for req in ready[:free]:
            moved = self.offloaded.export_seat(req.request_id, rows=room)
            if not self.resident.import_seat(moved):  # a free seat was counted
                raise AssertionError(f"no free resident seat for {req.request_id!r}")
            self._tier[req.request_id] = "resident"
            self.counters["moved_back"] += 1
        return min(free, len(ready))

    def _free_offloaded(self) -> int:
        return self.offloaded.seats - self.offloaded.num_running() - self.offloaded.num_waiting()

    def _place(self) -> None:
        """Waiting requests in order: a free resident seat if it fits there, else a free
        offloaded seat; one that can go nowhere yet stays (later ones may still go)."""
        free_resident = self._free_resident()
        free_offloaded = 0 if self._parked else self._free_offloaded()
        for req in list(self._waiting):
            if free_resident > 0 and self._fits_resident(req):
                tier, free_resident = "resident", free_resident - 1
            elif free_offloaded > 0:
                tier, free_offloaded = "offloaded", free_offloaded - 1
            else:
                continue
            self._waiting.remove(req)
            getattr(self, tier).enqueue(req)
            self._tier[req.request_id] = tier
            self.counters[f"placed_{tier}"] += 1


__all__ = ["AutoEngine"]

"""Continuous batching: requests join and leave a fixed set of seats while others decode.

    engine = Engine(params, config, seats=8, capacity=4096, offload=OffloadConfig(...))
    rid = engine.add_request(prompt_ids, max_tokens=64, temperature=0.0, stop_token_ids=[eos])
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput per request that moved
            print(out.request_id, out.new_token_ids, out.finished, out.finish_reason)

The engine owns one batch state of `seats` requests, sized once (requests come and go without
recompiling): resident (`offload=None`: fixed seats of `capacity` rows), or paged (an
`OffloadConfig`: the seats share one pool of pages, in host or device memory). Each `step()`
admits waiting requests into free seats in queue order (by the pool's pages and the device
budget, preempting the youngest request when pages run short with reserve="prompt"), runs one
prefill chunk for every prefilling seat, then `decode_steps_per_call` decode steps of the
running seats in one program (`fo_jax.decode_loop.decode_loop`), and frees the seats of
finished requests.

Contracts:
  * a request's tokens never depend on what else is in the batch: every program has the same
    shapes whoever sits in the other seats, every row is computed from its own state alone,
    and each request samples with its own key, so its tokens equal those of the same engine
    serving it alone, bit for bit, and, paged, those of the resident engine (preempted,
    resumed, prefix-sharing and moved requests included; tests/engine/test_engine.py);
  * `add_request` checks everything before it queues: a refused request leaves the engine as
    it was; bad settings are refused before anything is allocated (`fo_jax.engine.settings`);
  * the engine always progresses: the oldest running request always gets its pages, and new
    requests never overtake preempted ones.

The rules (admission, reservation and preemption, resuming, drafts, MTP drafts,
log-probabilities, the three ways to hold the KV) and why they hold: docs/design/engine.md,
"The engine in detail".
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.decode_loop import Seats
from fo_jax.engine.kv_store import SeatRows, make_kv_store
from fo_jax.engine.metrics import MetricsLog
from fo_jax.engine.requests import (FINISH_REASONS, RequestLimits, RequestOutput,
                                    RequestState, TokenLogprobs, check_prompt, check_sampling,
                                    claim_request_id, logprob_rows)
from fo_jax.engine.runner import DecodeRunner, SeatExport
from fo_jax.engine.scheduler import Scheduler
from fo_jax.engine.settings import MAX_LOGPROBS, EngineSettings


class Engine:
    """Continuous batching over `seats` seats of `capacity` tokens each (module doc; the rules:
    docs/design/engine.md).

        Engine(params, config, EngineSettings(cache=CacheSettings(seats=8, capacity=4096)))
        Engine(params, config, seats=8, capacity=4096)      # the same, flat keywords

    Its parts, each usable alone: `kv` the seats' KV and prefix reuse (`fo_jax.engine.kv_store`:
    `kv.state`, `kv.pool`, `kv.costs`, `kv.prefix`), `scheduler` the queue, admission and
    preemption (`fo_jax.engine.scheduler`), `runner` the decode loop's device state and programs
    (`fo_jax.engine.runner`). `state`, `pool` and `prefix` are the KV store's.

    Args:
      params, config: the model.
      settings: an `EngineSettings` (`fo_jax.engine.settings`: every setting grouped by
        concern, each documented there), or None to build it from `kwargs`.
      tokenizer: anything with `decode(ids) -> str`; needed for text stop strings and `text`.
      mtp: drafter="mtp": the MTP parameters (`load_checkpoint(..., mtp=True)` or
        `fo_jax.model.mtp.init_mtp_params`) of a config with num_nextn_predict_layers >= 1.
      kwargs: without `settings`, the settings as flat keywords (`EngineSettings.create`: seats,
        capacity, offload, prefix_cache, reserve, device_bytes, decode_steps_per_call,
        overlap, num_drafts, ...).
    Raises:
      ValueError: bad settings, before anything is allocated.
    """

    def __init__(self, params, config: ModelConfig, settings: EngineSettings | None = None, *,
                 tokenizer=None, mtp: dict | None = None, **kwargs):
        if settings is None:
            settings = EngineSettings.create(**kwargs)
        elif kwargs:
            raise TypeError(f"Engine(params, config, settings) takes no other settings, got "
                            f"{sorted(kwargs)}: put them in the EngineSettings")
        settings = settings.for_model(config, mtp=mtp)
        self.settings, self.params, self.config, self.mtp = settings, params, config, mtp
        cache, sched, spec = settings.cache, settings.scheduler, settings.speculative
        self.offload, self.seats = cache.offload, int(cache.seats)
        self.capacity = int(cache.capacity)
        self.n_steps, self.chunk = int(sched.decode_steps_per_call), int(sched.prefill_chunk)
        self.num_drafts, self.drafter = int(spec.num_drafts), spec.drafter
        self.tokenizer, self.max_logprobs = tokenizer, int(settings.requests.max_logprobs)
        self.kv = self._make_kv_store(config, settings)  # the seats' KV: resident or paged
        self.pool, self.prefix = self.kv.pool, self.kv.prefix  # None resident; None: no reuse
        # The running seats' device state and the decode programs over it (`DecodeRunner`):
        # each seat's last token, key, count and done flag, sampling settings, and with drafts
        # the n-gram histories or the MTP layer's state.
        self.runner = self._make_runner(params, config, settings, mtp)
        self.scheduler = self._make_scheduler(settings)  # the queue and the seats' occupants
        self._occupant = self.scheduler.occupants  # the same lists, read and set here
        self._waiting = self.scheduler.waiting
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._limits = RequestLimits(  # what `add_request` checks a request against
            vocab=config.vocab_size, capacity=self.capacity,
            max_stop_ids=int(settings.requests.max_stop_ids), max_logprobs=self.max_logprobs,
            num_drafts=self.num_drafts, tokenizer=tokenizer is not None)
        self.stats = None  # offload statistics summed over decode calls, on the device
        self.counters = {"steps": 0, "prefill_calls": 0, "decode_calls": 0,
                         "prefill_tokens": 0, "decode_tokens": 0, "prefix_hit_tokens": 0,
                         "requests_finished": 0, "requests_cancelled": 0,
                         "preemptions": 0, "preemptions_kept_pages": 0,
                         "resumed_without_recompute": 0, "replayed_tokens": 0,
                         "decode_steps": 0, "draft_accepted": 0, "draft_proposed": 0}
        # Wall seconds of `step`: waiting for the prefill / decode programs (until their
        # results are ready) and in total; and the device's busy and idle time as the host
        # sees it (`fo_jax.engine.overlap.DeviceClock`: idle, it waited for the host).
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "step_s": 0.0,
                        "device_busy_s": 0.0, "device_idle_s": 0.0}
        log = settings.metrics
        self.metrics = None if log.path is None else MetricsLog(self, path=log.path,
                                                                every=log.every)

    # The parts (a subclass builds its own: `fo_jax.engine.sharded.ShardedEngine`) ---------

    def _make_kv_store(self, config: ModelConfig, settings: EngineSettings):
        return make_kv_store(config, settings)

    def _make_runner(self, params, config: ModelConfig, settings: EngineSettings, mtp):
        return DecodeRunner(params, config, settings, self.kv, mtp=mtp)

    def _make_scheduler(self, settings: EngineSettings) -> Scheduler:
        return Scheduler(settings, self.kv)

    @property
    def state(self):
        """The batch state the programs take (the KV store's: `ResidentState`, or the paged
        `DecodeState`)."""
        return self.kv.state

    @state.setter
    def state(self, value) -> None:
        self.kv.state = value

    @property
    def _seats(self) -> Seats:
        return self.runner.seats

    # Requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], *, max_tokens: int = 16,
                    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                    stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                    request_id: str | None = None, logprobs: int | None = None) -> str:
        """Queue a request; returns its id. Everything is checked here, before the request
        is queued: a refused request leaves the engine as it was (ValueError). Token ids are
        ints in [0, vocab) (not bools, not floats), `seed` an int64, at most
        `MAX_STOP_STRINGS` stop strings of at most `MAX_STOP_CHARS` characters each
        (`fo_jax.engine.requests.check_prompt`, `check_sampling`; the pool and device bytes:
        `Scheduler.check_fits_alone`).

        logprobs: None, or k in [0, max_logprobs]: each output token comes with its
        log-probability and the k most likely tokens' (`RequestOutput.logprobs`: of the raw
        model distribution, before temperature and top_p; computed on the device from the
        logits the token is sampled from, the tokens unchanged bit for bit). Not with drafts
        (num_drafts > 0): refused."""
        limits = self._limits
        prompt_np = check_prompt(prompt, max_tokens, limits)
        self.scheduler.check_fits_alone(int(prompt_np.size), max_tokens)
        stop_ids, stop = check_sampling(temperature=temperature, top_p=top_p, seed=seed,
                                        stop_token_ids=stop_token_ids, stop=stop,
                                        logprobs=logprobs, limits=limits)
        request_id = claim_request_id(request_id, self._ids, self._requests)
        req = RequestState(request_id, prompt_np.astype(np.int32), int(max_tokens),
                       float(temperature), float(top_p), int(seed), stop_ids, stop,
                       time.perf_counter(), text="" if self.tokenizer is not None else None,
                       order=next(self.scheduler.arrivals), queued_at=self.counters["steps"],
                       top_logprobs=None if logprobs is None else int(logprobs),
                       logprobs=None if logprobs is None else [])
        self._requests[request_id] = req
        self._waiting.append(req)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its seat; False if it had already finished.

        Raises KeyError for an id the engine does not know (never added, or already
        released with `release`)."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        if req.finish_reason is not None:
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        req.finish_reason = "cancelled"
        self.counters["requests_cancelled"] += 1
        self._free(req)
        return True

    def release(self, request_id: str) -> RequestOutput:
        """Forget a finished request (its id can be used again); returns its final output."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        if req.finish_reason is None:
            raise ValueError(f"request {request_id!r} has not finished: cancel it first")
        del self._requests[request_id]
        return req.output([])

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._occupant)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_ids(self) -> list[str]:
        """Ids of the waiting requests in the order admission considers them (preempted
        ones first, then by `order`). O(Q log Q)."""
        return [r.request_id for r in self.scheduler.queue(self.counters["steps"])]

    def pool_occupancy(self) -> dict | None:
        """Pages of the shared pools: free, held (mapped by requests), cached (kept by the
        prefix cache, mapped by none) and total; None on the resident path. O(1)."""
        if self.pool is None:
            return None
        return {"free": self.pool.num_free, "held": self.pool.num_held,
                "cached": self.pool.num_cached, "total": self.pool.num_pages}

    def seat_request_ids(self) -> list[str | None]:
        """The id of each seat's request (None: a free seat): per-seat figures (the offload
        statistics are [.., seats, ..]) belong to these requests. O(seats)."""
        return [None if r is None else r.request_id for r in self._occupant]

    def decoding_seats(self) -> np.ndarray:
        """[seats] bool: seats whose request has its decode state (prompt complete)."""
        return np.asarray([r is not None and r.prefilled >= len(r.prompt)
                           for r in self._occupant])

    def prefilling_seats(self) -> np.ndarray:
        """[seats] bool: seats whose request is still prefilling (their decode rows, maps and
        policy state are set when the prompt is complete: see `join_seats`)."""
        return np.asarray([r is not None and r.prefilled < len(r.prompt)
                           for r in self._occupant])

    def num_running(self) -> int:
        return sum(r is not None for r in self._occupant)

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; the final output of each request."""
        while self.has_unfinished():
            self.step()
        return {rid: req.output([]) for rid, req in self._requests.items()}

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, prefill one chunk, decode `decode_steps_per_call` steps (see the module
        doc); the outputs of the requests that moved. With overlap, the decode call is
        dispatched and the previous one read back: the outputs are those of the previous
        call (and of this step's prefill), and a call stays in flight between steps
        (docs/design/engine.md, "Overlap")."""
        start = time.perf_counter()
        moved, self.runner.carried = self.runner.carried, {}
        if self.runner.in_flight is not None and not self.runner.in_flight.live():
            # every request of the call in flight was cancelled since: read it back now
            self._read_back(self.runner.take_in_flight(), moved)
        if self.runner.in_flight is None and not self.num_running():
            self.runner.clock.rest(start)  # the device waited for requests, not for us
        self._admit()
        self._prefill(moved)
        self._grow_pages(moved)
        self._decode(moved)
        self.counters["steps"] += 1
        self.timings["step_s"] += time.perf_counter() - start
        outputs = [self._requests[rid].output(new) for rid, new in moved.items()
                   if rid in self._requests]
        if self.metrics is not None:  # host figures; device counters read every N steps
            self.metrics.on_step(outputs)
        return outputs

    def synchronize(self) -> None:
        """Read back the decode call in flight (overlap), if any: every request's host
        record is then exact (its tokens, whether it finished), as before any operation that
        needs a seat's exact state (preemption, `export_seat`). Its tokens are returned by the
        next `step`. O(seats) host work after waiting for the call."""
        call = self.runner.take_in_flight()
        if call is not None:
            self._read_back(call, self.runner.carried)

    def device_bytes_used(self) -> int | None:
        """Device bytes of request state by the planner's arithmetic (`MemoryCosts`; None on
        the resident path): `Scheduler.device_bytes_used`. O(seats)."""
        return self.scheduler.device_bytes_used()

    def _admit(self) -> None:
        """Seat waiting requests (`Scheduler.admit`: queue order, pages and device bytes,
        prefix reuse matched, kept pages dropped when nothing else would free them). A new
        one's prefill starts after its cached prefix (resident: its rows copied into the seat,
        `PrefixReuse.write`: one program, O(L prefix) rows); one preempted with its pages kept
        is not prefilled again and, once decoding, joins at once (`_rejoin`); one whose pages
        were dropped prefills its prompt again (cached chunks mapped) and replays its tokens
        at its join. O(seats + prompt + pages) per admitted request."""
        new, kept = self.scheduler.admit(self.counters["steps"])
        for req in new:
            if self.prefix is not None:
                self.state = self.prefix.write(self.state, req.seat, req.prefix_held)
            req.prefilled, req.prefix_held = req.cached_tokens, None
            self.counters["prefix_hit_tokens"] += req.cached_tokens
        started = new + kept
        if started:
            self.kv.set_seats({r.seat: (r.stored_tokens(),
                                        None if r.pages is None else r.pages.table_row())
                               for r in started})
            self._start_mtp(started)
        if kept:
            self.counters["resumed_without_recompute"] += len(kept)
            self._rejoin([r for r in kept if r.prefilled == len(r.prompt)])

    def _start_mtp(self, started: list[RequestState]) -> None:
        """MTP drafts: each admitted request's MTP state (`DecodeRunner.start_mtp`)."""
        self.runner.start_mtp(started, None if self.prefix is None else self.prefix.mtp)

    def _rejoin(self, resumed: list[RequestState]) -> None:
        """Seat decoding requests that kept their pages, without recompute: their host pages
        hold every stored token (the decode writes each step's rows through to them), so
        `join_seats` rebuilds their hot rows, tails, maps and policy state from the pages for
        their length, and their last token, PRNG key and tokens generated are restored: the
        decode goes on as if never interrupted. O(L seats (C + 2Z)) device work, once."""
        if not resumed:
            return
        mask = np.zeros((self.seats,), bool)
        for req in resumed:
            mask[req.seat] = True
            self.runner.set_sampling(req.seat, req)
        self.kv.join(mask)
        self.runner.restore({r.seat: (r.tokens[-1], len(r.tokens), r.key_data)
                             for r in resumed})
        self.runner.set_history(resumed)  # with drafts: what the drafter looks up
        for req in resumed:
            req.key_data = None

    def _grow_pages(self, moved) -> None:
        """reserve="prompt": before the decode call, give every decoding request the pages
        the call may write (`Scheduler.tokens_needed`), oldest request first. When they cannot be
        had, do what `Scheduler.make_room` says must go first (drop kept pages, or preempt the
        youngest running request with or without its pages) and try again; the rule and why it
        always progresses: docs/design/engine.md, "Progress". A request that is itself the
        youngest is preempted. With overlap, a request of the call in flight grows for that
        call's tokens too (`Scheduler.unread`), and before a preemption or a drop the call in
        flight is read back (the victim's exact state; requests it finished free their pages)
        and the decision taken again. O(seats + queue + pages allocated) per preemption or drop."""
        if self.pool is None or self.scheduler.reserve == "full":
            return
        rows = {}
        for req in self.scheduler.decoding_by_age():
            while req.seat is not None:
                room = self.scheduler.make_room(req)
                if room.action == "grown":
                    rows[req.seat] = req.pages.table_row()
                if room.action in ("ready", "grown"):
                    break
                if self.runner.in_flight is not None:  # overlap: read the call in flight
                    # back first (a preemption needs the victim's exact state), then decide
                    # again with the host records exact (its finished requests' pages freed,
                    # one call's growth asked, not two)
                    self._read_back(self.runner.take_in_flight(), moved)
                    rows = {b: row for b, row in rows.items() if self._occupant[b] is not None}
                    continue
                if room.action == "drop_kept":
                    self.scheduler.drop_kept(room.other)
                    continue
                rows.pop(room.other.seat, None)
                self._preempt(room.other, keep_pages=room.keep)
        if rows:
            self.kv.set_rows(rows)

    def _preempt(self, req: RequestState, *, keep_pages: bool = False) -> None:
        """Take a running request's seat; it waits at the head of the queue (`Scheduler.queue`)
        with its sampled tokens (and, once it sampled, its PRNG key) kept. keep_pages: its
        pages stay held (its host KV and indexer keys: every token it stored, the decode
        writes through to the host pages), so it resumes where it stopped (`_rejoin`, or its
        prefill goes on); else they are dropped (`Scheduler.drop_kept`). O(pages + seats)."""
        if req.prefilled == len(req.prompt):  # joined: its seat holds its key (a request
            # resumed but not joined yet keeps the key it saved)
            req.key_data = self.runner.key_data(req.seat)
        if self.runner.mtp_seats is not None and (keep_pages or req.tokens):
            req.mtp_saved = self.runner.save_mtp(req.seat)  # restored by `_start_mtp`
        self._vacate(req.seat)
        req.seat = None
        req.preempted = True
        self._waiting.append(req)
        self.counters["preemptions"] += 1
        if keep_pages:
            self.counters["preemptions_kept_pages"] += 1
        else:
            self.scheduler.drop_kept(req)

    def _prefill(self, moved) -> None:
        """One prefill chunk of each prefilling request, packed: up to `prefill_batch`
        requests of one history bucket per [P, prefill_chunk] program, each row over its own
        seat and history (`Scheduler.prefill_packs`, `KVStore.prefill`): the work grows with
        the requests prefilling, not with the seats, and each row is computed from its own
        request alone (so its KV and logits are those of its solo run, bit for bit, given
        row-independent matmuls: `SchedulerSettings.prefill_batch`). Then the prefix cache
        stores what the chunk completed, the completed prompts join (`_join`) and, with MTP
        drafts, the chunk's pairs feed their MTP state."""
        packs = self.scheduler.prefill_packs()
        requests = sorted((r for pack in packs for r in pack), key=lambda r: r.seat)
        if not requests:
            return
        chunk, want_hidden = self.chunk, self.runner.mtp_seats is not None
        # MTP drafts: the requests whose MTP state takes this chunk's pairs (`feed_mtp`); a
        # resumed request that sampled before has its MTP state back already (`_start_mtp`).
        feed = [req for req in requests if not req.tokens] if want_hidden else []
        # Per request: (tokens prefilled before the chunk, tokens in it); the last prompt
        # position's logits [V] of those the chunk completes; hidden states [1, chunk, E].
        before, last, hidden = {}, {}, {}
        start = time.perf_counter()
        work = self.runner.clock.begin(start)
        for pack in packs:
            tokens = np.zeros((len(pack), chunk), np.int32)
            for i, req in enumerate(pack):
                part = req.prompt[req.prefilled:req.prefilled + chunk]
                tokens[i, :len(part)] = part
                before[req.request_id] = (req.prefilled, len(part))
            counts = np.asarray([before[r.request_id][1] for r in pack], np.int32)
            logits, h = self.kv.prefill(self.params, [r.seat for r in pack], tokens, counts,
                                        prefilled=[r.prefilled for r in pack],
                                        hidden=want_hidden)
            for i, (req, n) in enumerate(zip(pack, counts)):
                hidden[req.seat] = None if h is None else h[i:i + 1]
                if req.prefilled + n == len(req.prompt):
                    last[req.seat] = logits[i, n - 1]
        jax.block_until_ready(logits)  # the last program of a chain through the state
        ready = time.perf_counter()
        self.timings["prefill_s"] += ready - start
        self.runner.clock.end(work, ready, self.timings)
        self.counters["prefill_calls"] += len(packs)
        self.counters["prefill_tokens"] += sum(n for _, n in before.values())
        for req in requests:
            req.prefilled += before[req.request_id][1]
        done = [(r, before[r.request_id][0]) for r in requests]  # (request, tokens before)
        if self.prefix is not None:  # what the chunk completed is final: reusable from now on
            self.prefix.insert(self.state, done)
        joined = [r for r in requests if r.prefilled == len(r.prompt)]
        if joined:
            self._join(joined, last, moved)
        if feed:  # after the join: a prompt's last pair takes its first sampled token
            self.runner.feed_mtp([(r, before[r.request_id]) for r in feed], hidden)
        if self.prefix is not None:  # the MTP rows of the chunks completed (final now)
            self.prefix.insert_mtp(self.runner.mtp_seats, done)

    def _join(self, joined: list[RequestState], last, moved) -> None:
        """Start each request whose prompt is complete: a new one samples its first token
        from its last prompt position's logits (last {seat: [V]}); a resumed one (preempted
        after sampling) takes back its PRNG key and its last token and replays its other
        tokens (`_replay`)."""
        mask = np.zeros((self.seats,), bool)
        for req in joined:
            mask[req.seat] = True
            self.runner.set_sampling(req.seat, req)
        self.kv.join(mask)
        new = [r for r in joined if not r.tokens]
        resumed = [r for r in joined if r.tokens]  # preempted after sampling, pages dropped
        want = any(r.top_logprobs is not None for r in new)
        first_np, lp_np, keys = self.runner.first_tokens(
            last, new, resumed, logprobs=self.max_logprobs if want else None)
        now = time.perf_counter()
        rows = {}
        for req in new:
            b = req.seat
            t = int(first_np[b])
            req.first_token_at = now
            lp = None
            if req.top_logprobs is not None:
                lp = logprob_rows(lp_np[0][b:b + 1], lp_np[1][b:b + 1], req.top_logprobs)
            finished = self._record(req, [t], moved, length=len(req.prompt), logprobs=lp)
            rows[b] = (t, 1, finished)
        for req in resumed:
            rows[req.seat] = (req.tokens[-1], len(req.tokens), False)
            req.preempted, req.key_data = False, None
        self.runner.set_rows(rows, keys)
        self.runner.set_history(joined)
        if resumed:
            self._replay(resumed)
        for req in new:
            if req.finish_reason is not None:
                self._free(req)

    def _replay(self, resumed: list[RequestState]) -> None:
        """Rebuild the KV of each resumed request whose pages were dropped by feeding
        its sampled tokens again through the decode step (`DecodeRunner.replay`: why a replay
        and not a prefill, and its costs)."""
        self.counters["replayed_tokens"] += self.runner.replay(resumed)

    def _decode(self, moved) -> None:
        """Dispatch one decode call of the running seats, then read back the call in flight
        before it, if any (overlap), and keep the new one in flight while any of its requests
        may go on; without overlap, read the new call back at once."""
        running = [r for r in self._occupant
                   if r is not None and r.prefilled == len(r.prompt) and r.finish_reason is None]
        previous = self.runner.take_in_flight()
        call = None
        if running:
            start = time.perf_counter()
            call = self.runner.dispatch(running, logprobs=self._decode_logprobs(running))
            self.timings["decode_s"] += time.perf_counter() - start
        if previous is not None:
            self._read_back(previous, moved)
        if call is None:
            return
        if self.runner.overlap and call.live():  # read back by the next step
            self.runner.in_flight = call
            self.scheduler.unread.update(r.request_id for r in call.live())
        else:  # without overlap; or every request of it has ended (its tokens unused)
            self._read_back(call, moved)

    def _decode_logprobs(self, running: list[RequestState]) -> int | None:
        """The decode call's log-probabilities K: `max_logprobs` while a request of `running`
        asks for them, else None (another program with them: only while one asks)."""
        want = any(r.top_logprobs is not None for r in running)
        return self.max_logprobs if want else None

    def _read_back(self, call, moved) -> None:
        """Read a decode call's tokens (waiting for the device) and record them for the
        requests it ran that still hold their seats (`InFlight.live`: one that finished or
        was cancelled since it was dispatched produced nothing more); free the seats of the
        requests it finished."""
        start = time.perf_counter()
        out = call.out
        tokens = call.tokens()  # waits for the program
        lp_np = None if out.logprobs is None else jax.device_get((out.logprobs,
                                                                  out.logprob_ids))
        self.timings["decode_s"] += time.perf_counter() - start
        self.runner.clock.end(call.work, call.ready_at, self.timings)
        self.scheduler.unread.clear()
        self.counters["decode_calls"] += 1
        self.counters["decode_tokens"] += int(np.sum(tokens >= 0))
        self.counters["decode_steps"] += int(out.num_steps)
        running = call.live()
        if self.num_drafts:
            self.counters["draft_accepted"] += int(np.sum(out.accepted))
            self.counters["draft_proposed"] += int(np.sum(out.proposed))
            counts = np.asarray(out.counts)
            for req in running:
                req.groups.extend(int(c) for c in counts[req.seat] if c > 0)
        if out.stats is not None:
            self.stats = out.stats if self.stats is None else jax.tree_util.tree_map(
                jnp.add, self.stats, out.stats)
        if self.metrics is not None:
            self.metrics.add_stats(out.stats)  # on the device: no host sync
        lengths = np.asarray(call.lengths)
        done = np.asarray(call.done)
        stopped = []
        for req in running:
            new = [int(t) for t in tokens[req.seat] if t >= 0]
            rows = None
            if req.top_logprobs is not None:  # no drafts: column i is step i (-1: none)
                steps = tokens[req.seat] >= 0
                rows = logprob_rows(lp_np[0][req.seat][steps], lp_np[1][req.seat][steps],
                                     req.top_logprobs)
            finished = self._record(req, new, moved, length=int(lengths[req.seat]),
                                    done=bool(done[req.seat]), logprobs=rows)
            if finished:
                stopped.append(req)
        if stopped:
            self.runner.set_done([req.seat for req in stopped])
            for req in stopped:
                self._free(req)

    # Bookkeeping ---------------------------------------------------------------------------

    def _record(self, req: RequestState, new: list[int], moved, *, length: int,
                done: bool = False, logprobs: list[TokenLogprobs] | None = None) -> bool:
        """Record sampled tokens (`RequestState.record`: stop tokens and strings, max_tokens,
        capacity) and the ones kept as moved; whether the request finished."""
        moved.setdefault(req.request_id, []).extend(req.record(
            new, tokenizer=self.tokenizer, capacity=self.capacity, length=length, done=done,
            logprobs=logprobs))
        return req.finish_reason is not None

    def _vacate(self, b: int) -> None:
        """Seat b empty: no occupant, default sampling, done, no tokens, no pages. O(B)."""
        self._occupant[b] = None
        self.runner.set_sampling(b, None)
        self.runner.set_done([b])
        self.kv.set_seats({b: (0, None)})

    def _free(self, req: RequestState) -> None:
        """Free the request's seat and drop its pages (finished or cancelled: a waiting
        request's kept pages too)."""
        if req.seat is not None and self._occupant[req.seat] is req:
            self._vacate(req.seat)
        if req.pages is not None:
            req.pages.release()
            req.pages = None
        req.seat, req.mtp_saved = None, None
        if req.finish_reason != "cancelled":
            self.counters["requests_finished"] += 1

    # Moving a request between engines (fo_jax.engine.auto) --------------------------------
    # Kept apart from admission and decoding: these only read and set one seat.

    def requests(self) -> dict[str, RequestState]:
        """The requests this engine knows (queued, running, or finished and not released), by
        id: their host records (`RequestState`), read-only to callers. O(1)."""
        return self._requests

    def running_requests(self) -> list[RequestState]:
        """The requests in the seats, by seat. O(seats)."""
        return [r for r in self._occupant if r is not None]

    def withdraw(self, request_id: str) -> RequestState:
        """Take a waiting request (checked by `add_request`) out of the queue and forget it,
        counted nowhere: another engine will serve it (`enqueue`). O(queue)."""
        req = self._requests.get(request_id)
        if req is None or req not in self._waiting:
            raise KeyError(f"no waiting request {request_id!r}")
        self._waiting.remove(req)
        del self._requests[request_id]
        return req

    def enqueue(self, req: RequestState) -> None:
        """Queue a request another engine's `add_request` checked (same model, tokenizer and
        max_stop_ids); it must fit this engine's seats."""
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if len(req.prompt) > self.capacity:
            raise ValueError(f"prompt of {len(req.prompt)} tokens does not fit a seat of "
                             f"{self.capacity} tokens")
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def export_seat(self, request_id: str, rows: int | None = None) -> SeatExport:
        """Take a decoding request out of this engine, with what its decode needs: its KV rows
        and indexer keys (`KVStore.read_seat`: resident, the seat's S = capacity rows, `rows`
        unused; paged, its first ceil(rows / Z) pages read through its page-table row, `rows`
        required: at least its length, the seat it goes to), its last token, PRNG key, tokens
        generated and MTP state (`DecodeRunner.export_seat`). The seat is freed at once, its
        pages released (the request counts as neither finished nor cancelled here) and the id
        forgotten."""
        self.synchronize()  # overlap: its exact state (the call in flight read back)
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        if req.seat is None or req.prefilled < len(req.prompt) or req.finish_reason is not None:
            raise ValueError(f"request {request_id!r} is not decoding (queued, prefilling or "
                             "finished): only a request past its prompt moves")
        seat = self.kv.read_seat(req.seat, length=req.stored_tokens(), rows=rows,
                                 row=None if req.pages is None else req.pages.table_row())
        out = self.runner.export_seat(req, seat)
        self._vacate(req.seat)
        if req.pages is not None:
            req.pages.release()
            req.pages = None
        del self._requests[request_id]
        req.seat = None
        return out

    def import_seat(self, moved: SeatExport) -> bool:
        """Seat a request `export_seat` took from another engine: its rows written
        (`KVStore.write_seat`: paged, its pages for prompt + max_tokens reserved as admission
        does, its first `length` rows written through them, its hot rows, maps and policy
        state built, `join_seats`; resident, its rows written into the seat, its length below
        this engine's capacity), then its last token, PRNG key, count, sampling row, MTP state
        and history (`DecodeRunner.import_seat`). False (nothing changed) when no seat is free
        or the pool cannot reserve the pages yet."""
        req = moved.request
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if (self.runner.mtp_seats is None) != (moved.mtp is None):
            raise ValueError("a request moves between engines that both draft with the MTP "
                             "layer (drafter='mtp') or neither")
        if self.pool is None and moved.length >= self.capacity:
            raise ValueError(f"a request of {moved.length} stored tokens does not fit a "
                             f"resident seat of {self.capacity} tokens (it needs room for the "
                             "token it feeds next)")
        free = self.scheduler.free_seats()
        if not free:
            return False
        b, rows = free[0], SeatRows(moved.kv, moved.index_keys, moved.length)
        pages = self.kv.write_seat(b, rows, reserve_tokens=self.scheduler.reserved_tokens(
            len(req.prompt), req.max_tokens))
        if self.pool is not None and pages is None:
            return False
        req.seat, req.pages = b, pages
        self.runner.import_seat(b, moved)
        self._occupant[b] = req
        self._requests[req.request_id] = req
        return True


__all__ = ["Engine", "FINISH_REASONS", "MAX_LOGPROBS", "RequestOutput", "TokenLogprobs"]

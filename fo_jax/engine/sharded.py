"""One sharded serving engine: every data-parallel rank of a mesh stepped in one program.

    mesh, rules = sharding.expert_mesh(4, expert=4)     # the experts split over the 4 ranks
    engine = ShardedEngine(params, config, mesh=mesh, rules=rules, seats=2, capacity=256)
    rid = engine.add_request(prompt_ids, max_tokens=64)  # placed on one rank, for good
    while engine.has_unfinished():
        for out in engine.step():        # one prefill program, one decode program: all ranks
            ...

An `Engine` whose parts span a mesh of R data ranks (`fo_jax.sharding`: the plain data mesh
`make_mesh(R)`, or the all-to-all layout `expert_mesh(R, expert=R)` whose ranks each hold 1/R of
the routed experts). Rank r holds seats [r B, (r + 1) B) of the engine's R B (`seats` is B, per
rank), their KV on its device (resident: its shard [L, B, S, D+R] of the rows,
`ShardedResidentKV`; paged, `offload=OffloadConfig(...)`: its own page pool of `num_pages`
pages, host KV in its device's `pinned_host` memory, `ShardedPagedKV`), and its own queue: a
request is placed on a rank for good by `add_request` (the `placement` rule of
`fo_jax.placement`: round_robin, least_requests, least_context, least_misses; default
least_misses paged, least_context resident) and admitted only into a free seat of its rank, in
its rank's queue order (`RankScheduler`; the parts: `fo_jax.engine.sharded_parts`). Each
`step()` admits per rank, then prefills: one program per round over all ranks, each rank running
one chunk of one of its prefilling requests (`fo_jax.sharded_seats.sharded_prefill_seats`; a
rank with nothing to prefill runs a row that writes nothing; paged, the chunks of a round load
the same number of history pages: the rounds go bucket by bucket, in increasing order), until
every prefilling request has had its chunk; then one decode call over every rank's seats
(`fo_jax.sharded_steps.sharded_decode_loop`: every rank takes part in every step's
all-to-alls, a rank with no decoding seat steps inactively). The weights are placed by the
rules (`shard_params`): with the all-to-all layout each device holds 1/R of the experts and
every other weight whole.

Contracts: a request's tokens are those of one single-device `Engine` of the same settings (B
seats, `num_pages` pages, the whole weights) serving it alone, bit for bit on the tiles MoE
path (the sharded steps' contract per rank, and the engine's: a seat's rows never depend on
the others'; preempted and resumed requests included); seats free and pages back in their
rank's pool when requests finish. Costs: one prefill program per round (the most requests prefilling
on one rank; paged, per history bucket), one decode program per step, whatever R; placement
O(R + requests) per `add_request`.

Paged, with reserve="prompt", each rank grows its requests' pages per decode call and, when its
pool runs short, preempts its own youngest request (`RankScheduler`: `Scheduler`'s rules over
the rank's seats, queue and pool); a request resumes on its rank (pages kept: rejoined; dropped:
prefilled again and its tokens replayed by the sharded decode step, `ShardedRunner._replay_step`).

Paged, each decode call's offload statistics ([G, R B] rows copied per seat) are read back
after its tokens (no further wait; O(G R B) on the host per call): they give each rank's rows
copied (`rank_misses`, `imbalance`) and, for least_misses, each request's running estimate of
its rows per step (`fo_jax.placement.MissEstimates`, as `DataParallelEngine` keeps it).

Across processes (jax.distributed; resident and paged): each process builds the same engine
over the global mesh, serves the ranks of its own devices (`local_ranks`: their requests,
seats, queues and, paged, page pools and host KV shards) and steps in lockstep with the
others, making the same programs in the same order: each step the processes agree (one small
all-gather, `fo_jax.distributed.process_max`, of O(buckets) ints) on the prefill rounds of
each history bucket (the most any process needs) and on the steps of the replay of requests
resumed with their pages dropped (the longest: a process replaying less steps its ranks
inactively, `ShardedRunner.replay_idle`), and then on whether a decode call runs (any decoding
seat anywhere); `run` and `any_unfinished` step until every process is done. Admission, page
growth and preemption stay per process (their programs involve no other rank: setting seats,
page-table rows and joins). No host read of another process's rows (`ShardedRunner`: seats and
sampling kept on the process's first device between decode calls; the joins' lengths and the
rows copied, `rank_misses`, read from the process's own devices). `fo-jax serve` drives it
across processes (resident or offloaded): one endpoint on process 0 (fo_jax.server.lockstep).

As one `Engine` does: log-probabilities (`add_request(logprobs=k)`: the decode call over the
mesh computes them on each rank, `sharded_decode_loop(logprobs=K)`; each request's are its
solo run's, bit for bit; across processes the processes agree on the call's K with its other
figures, one program); `device_bytes` and `host_pool_bytes` per rank (each rank's scheduler
charges its own device budget, each rank's pool holds `host_pool_bytes` of host KV:
`device_bytes_used()` per rank, `scheduler.device_bytes_used()` their sum); a metrics log
(`metrics_path`, or a `MetricsLog` set as `engine.metrics`: the engine's figures summed over
the ranks, and each rank's, `rank_figures`, in every record's "ranks"; one process only).

Not yet (refused with a message): a pool in device memory; prefix reuse, drafts, moving
requests between engines, and a metrics log across processes. It runs without
overlap (`overlap` is set False: each decode call is read back at once). Design:
docs/guides/many-devices.md, "One sharded engine".
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from fo_jax import distributed
from fo_jax import placement as placement_rules
from fo_jax import sharding
from fo_jax.config import ModelConfig
from fo_jax.engine.engine import Engine
from fo_jax.engine.metrics import check_engine as check_logged
from fo_jax.engine.scheduler import Scheduler
from fo_jax.engine.settings import EngineSettings
from fo_jax.engine.sharded_parts import (ShardedPagedKV, ShardedResidentKV, ShardedRunner,
                                         ShardedScheduler)

PLACEMENTS = placement_rules.RULES


class ShardedEngine(Engine):
    """Continuous batching over every data-parallel rank of `mesh` in one program per step (see
    the module doc).

    Args:
      params, config: the model; the weights are placed on the mesh by `rules`
        (`fo_jax.sharding.shard_params`).
      settings / kwargs: as `Engine`; `seats` and `num_pages` are per rank (the engine
        holds R times `seats` seats, and R pools).
      mesh, rules: `fo_jax.sharding.expert_mesh(R, expert=R)` (the all-to-all layout) or
        `make_mesh(R)` with rules None (`RULES`: every weight on every device).
      placement: a rule of `PLACEMENTS` (default least_misses paged, least_context
        resident; least_misses needs the paged path: the resident path copies no misses).
    Raises:
      ValueError: bad placement, and every `Engine` refusal.
      NotImplementedError: settings the sharded engine does not run yet.
    """

    def __init__(self, params, config: ModelConfig, settings: EngineSettings | None = None, *,
                 mesh: Mesh, rules=None, placement: str | None = None, tokenizer=None,
                 **kwargs):
        if settings is None:
            settings = EngineSettings.create(**kwargs)
        elif kwargs:
            raise TypeError(f"ShardedEngine(params, config, settings) takes no other settings, "
                            f"got {sorted(kwargs)}: put them in the EngineSettings")
        check_settings(settings)
        if any(mesh.shape.get(axis, 1) > 1 for axis in (sharding.MODEL, sharding.EXPERT)):
            raise NotImplementedError(
                f"the sharded engine runs a mesh of data ranks only (make_mesh(R), or "
                f"expert_mesh(R, expert=R): the experts split over the data ranks), got mesh "
                f"axes {dict(mesh.shape)}")
        paged = settings.cache.offload is not None
        if placement is None:
            placement = "least_misses" if paged else "least_context"
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r}: the sharded engine places by one of "
                             f"{PLACEMENTS} (fo_jax.placement)")
        if placement == "least_misses" and not paged:
            raise ValueError("placement='least_misses' needs the offloaded path (an "
                             "OffloadConfig): the resident path copies no misses; use "
                             "'least_context'")
        self.mesh, self.rules, self.placement = mesh, rules, placement
        self.ranks = sharding.data_size(mesh)
        # The ranks whose device this process drives (all of them in one process).
        me = jax.process_index()
        self.local_ranks = tuple(r for r, d in enumerate(mesh.devices.reshape(-1))
                                 if d.process_index == me)
        self.multiprocess = len(self.local_ranks) < self.ranks
        if settings.metrics.path is not None:
            check_logged(self)  # one process only, before anything is allocated
        self.seats_per_rank = int(settings.cache.seats)
        self._agreed_logprobs = None  # across processes: the decode call's K (`_decode`)
        self._placed: dict[str, int] = {}  # request id -> its rank, for good
        self._turn = 0
        # Every rank's seats; without overlap (each decode call is read back at once).
        whole = dataclasses.replace(
            settings, cache=dataclasses.replace(settings.cache,
                                                seats=self.seats_per_rank * self.ranks),
            scheduler=dataclasses.replace(settings.scheduler, overlap=False))
        super().__init__(sharding.shard_params(params, mesh, rules), config, whole,
                         tokenizer=tokenizer)
        self._misses = placement_rules.MissEstimates(  # least_misses's costs (paged)
            hot_slots=self.offload.hot_slots, topk=config.index_topk) if paged else None
        self._reset_rank_figures()

    def _make_kv_store(self, config: ModelConfig, settings: EngineSettings):
        store = ShardedPagedKV if settings.cache.paged else ShardedResidentKV
        return store(config, settings, mesh=self.mesh, rules=self.rules)

    def _make_runner(self, params, config: ModelConfig, settings: EngineSettings, mtp):
        return ShardedRunner(params, config, settings, self.kv)

    def _make_scheduler(self, settings: EngineSettings) -> Scheduler:
        return ShardedScheduler(settings, self.kv, placed=self._placed)

    # Requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], *, rank: int | None = None,
                    logprobs: int | None = None, **kwargs) -> str:
        """Place a request on a rank (the placement rule on the ranks' loads, or `rank`) and
        queue it there; returns its id. logprobs and kwargs: `Engine.add_request`'s (the
        log-probabilities those of one `Engine` serving the request alone, bit for bit);
        refusals are its own and leave the engine as it was. O(R + requests)."""
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                                 or not 0 <= rank < self.ranks):
            raise ValueError(f"rank={rank!r} must be an int in [0, R = {self.ranks}) or None "
                             "(placed by the rule)")
        if rank is not None and rank not in self.local_ranks:
            raise ValueError(f"rank={rank} is driven by another process: process "
                             f"{jax.process_index()} takes requests for its own ranks "
                             f"{list(self.local_ranks)}")
        prompt = list(prompt)
        turn = self._turn
        if rank is None:
            rank, turn = self.choose_rank(len(prompt))
        rid = super().add_request(prompt, logprobs=logprobs, **kwargs)
        self._placed[rid], self._turn = rank, turn
        self.placed_per_rank[rank] += 1
        return rid

    def choose_rank(self, prompt_len: int) -> tuple[int, int]:
        """(the rank a new request of `prompt_len` tokens would go to now, round robin's next
        turn): among this process's ranks with a free seat not promised to a waiting request
        (all of them when none has one), by the placement rule. Changes nothing.
        O(R + requests)."""
        load, busy = [0.0] * self.ranks, [0] * self.ranks
        for req in self._requests.values():
            if req.finish_reason is None:
                r = self._placed[req.request_id]
                busy[r] += 1
                load[r] += self.placement_cost(req.request_id, len(req.prompt) + len(req.tokens))
        local = self.local_ranks  # a process places on its own ranks only
        free = [max(self.seats_per_rank - busy[r], 0) for r in local]
        if not any(free):
            free = [1] * len(local)
        ranks, turn = placement_rules.assign(self.placement, [self.placement_cost(None, prompt_len)],
                                             load=[load[r] for r in local], free=free,
                                             turn=self._turn)
        return local[ranks[0]], turn

    def placement_cost(self, request_id: str | None, context: int) -> float:
        """A request's cost in the placement rule's unit, with `context` tokens (request_id
        None: one not placed yet; least_misses: its estimate of rows per step once it ran,
        else the calibrated prior). O(1)."""
        if self.placement == "least_context":
            return float(context)
        if self.placement == "least_misses":
            return self._misses.cost(request_id, context)
        return 1.0

    def rank_of(self, request_id: str) -> int:
        """The rank a request was placed on (KeyError for an unknown id)."""
        if request_id not in self._placed:
            raise KeyError(f"no request {request_id!r}")
        return self._placed[request_id]

    def release(self, request_id: str):
        out = super().release(request_id)
        del self._placed[request_id]
        if self._misses is not None:
            self._misses.forget(request_id)
        return out

    def rank_seats(self, rank: int) -> range:
        """The engine's seats of `rank`: [rank B, (rank + 1) B)."""
        return range(rank * self.seats_per_rank, (rank + 1) * self.seats_per_rank)

    def reset_figures(self) -> None:
        """Zero the counters, timings, statistics and the ranks' figures (a warm-up left
        out)."""
        self.counters = dict.fromkeys(self.counters, 0)
        self.timings = dict.fromkeys(self.timings, 0.0)
        self.stats = None
        self._reset_rank_figures()

    def _reset_rank_figures(self) -> None:
        self._rank_misses = np.zeros(self.ranks, np.int64)
        self._sum_max = self._sum_mean = 0.0
        self._misses_calls = 0
        self.placed_per_rank = [0] * self.ranks

    def rank_figures(self) -> list[dict]:
        """[R] each rank's figures now, as the metrics log records them (`MetricsLog`, its
        "ranks"): requests running and waiting, pool pages (free, held, cached, total) and
        device bytes of request state (paged; None resident), rows copied from its host pool
        and requests placed since the last `reset_figures`. O(R + seats + queue)."""
        running, waiting = [0] * self.ranks, [0] * self.ranks
        for req in self._occupant:
            if req is not None:
                running[self._placed[req.request_id]] += 1
        for req in self._waiting:
            waiting[self._placed[req.request_id]] += 1
        pools, used = self.rank_pool_occupancy(), self.device_bytes_used()
        return [{"rank": r, "running": running[r], "waiting": waiting[r],
                 "pool_pages": None if pools is None else pools[r],
                 "device_bytes_used": used[r], "rows_copied": int(self._rank_misses[r]),
                 "placed": self.placed_per_rank[r]} for r in range(self.ranks)]

    def rank_misses(self) -> list[int]:
        """[R] rows each rank copied from its host pool since the last `reset_figures` (its
        seats' miss unions, summed over indexer groups and decode calls); zeros resident.
        Across processes, this process's ranks' (read from its own devices), zeros for the
        others'."""
        return [int(x) for x in self._rank_misses]

    def imbalance(self) -> dict:
        """How unevenly the ranks copied (`DataParallelEngine.imbalance`'s figures): rows per
        rank, requests placed per rank, decode calls, and the spread, sum over calls of the
        largest rank's rows / sum of the mean rank's (1.0: even; R: one rank copied all; the
        call waits for the largest rank; across processes, over this process's ranks)."""
        mean = self._sum_mean
        return {"placement": self.placement, "rank_misses": self.rank_misses(),
                "placed_per_rank": list(self.placed_per_rank), "steps": self._misses_calls,
                "max_over_mean": self._sum_max / mean if mean else None}

    def withdraw(self, request_id: str):
        raise NotImplementedError("requests do not move out of the sharded engine yet")

    def enqueue(self, req):
        raise NotImplementedError("requests do not move into the sharded engine yet")

    def export_seat(self, request_id: str, rows: int | None = None):
        raise NotImplementedError("requests do not move out of the sharded engine yet")

    def import_seat(self, moved) -> bool:
        raise NotImplementedError("requests do not move into the sharded engine yet")

    # The step ------------------------------------------------------------------------------

    def _prefill(self, moved) -> None:
        """One prefill chunk of each prefilling request: in rounds, each round one program over
        every rank (`prefill_ranks`) in which each rank runs one chunk of its next prefilling
        request (by seat) of the round's history bucket (paged: the pages of history its chunk
        loads; resident: one bucket), the buckets in increasing order, as many rounds per
        bucket as the rank with the most chunks of it needs (a chunk runs the program one
        `Engine` runs for it); then the completed prompts join (`Engine._join`), the resumed
        ones replaying their tokens. A request's chunk is the [1, prefill_chunk] program of one
        `Engine`'s prefill on its own seat, so its KV and logits are those of its solo run.
        Across processes the rounds per bucket and the replay's steps are agreed first (one
        `distributed.process_max` of O(buckets) ints): every process runs the same programs in
        the same order, its ranks with nothing to run writing nothing."""
        per = self.seats_per_rank
        by_rank = [[r for r in self._occupant[rank * per:(rank + 1) * per]
                    if r is not None and r.prefilled < len(r.prompt)]
                   for rank in range(self.ranks)]
        requests = [req for reqs in by_rank for req in reqs]
        buckets = self.kv.history_buckets()
        queues = [{pages: [] for pages in buckets} for _ in range(self.ranks)]
        for rank, reqs in enumerate(by_rank):
            for req in reqs:
                queues[rank][self.kv.history_pages(req.prefilled)].append(req)
        due = [max(len(queue[pages]) for queue in queues) for pages in buckets]
        # The replay steps of the resumed requests this step's chunks complete (pages dropped:
        # their sampled tokens fed again, `_replay`): the longest replay.
        replay = max((len(r.tokens) - 1 for r in requests
                      if r.tokens and r.prefilled + self.chunk >= len(r.prompt)), default=0)
        if self.multiprocess:  # the busiest process's rounds per bucket, and replay
            *due, replay = (int(x) for x in distributed.process_max(due + [replay]))
        if not any(due):
            return
        before, last, rounds = {}, {}, 0  # per request: tokens in its chunk; seat: last [V]
        start = time.perf_counter()
        work = self.runner.clock.begin(start)
        for pages, count in zip(buckets, due):
            for _ in range(count):
                rows, parts = {}, {}
                for rank, queue in enumerate(queues):
                    if queue[pages]:
                        req = queue[pages].pop(0)
                        part = req.prompt[req.prefilled:req.prefilled + self.chunk]
                        rows[rank] = (req.seat - rank * per, part)
                        parts[rank] = (req, len(part))
                logits = self.kv.prefill_ranks(self.params, rows, history_pages=pages)
                rounds += 1
                for rank, (req, n) in parts.items():
                    before[req.request_id] = n
                    if req.prefilled + n == len(req.prompt):
                        # on the host: the first tokens are sampled with the engine's seats
                        last[req.seat] = (distributed.local_row(logits, rank)[n - 1]
                                          if self.multiprocess
                                          else np.asarray(logits[rank, n - 1]))
        jax.block_until_ready(logits)
        ready = time.perf_counter()
        self.timings["prefill_s"] += ready - start
        self.runner.clock.end(work, ready, self.timings)
        self.counters["prefill_calls"] += rounds
        self.counters["prefill_tokens"] += sum(before.values())
        for req in requests:
            req.prefilled += before[req.request_id]
        joined = [r for r in requests if r.prefilled == len(r.prompt)]
        ran = max((len(r.tokens) - 1 for r in joined if r.tokens), default=0)  # its replay
        if joined:
            self._join(joined, last, moved)
        self.runner.replay_idle(replay - ran)  # across processes: while another replays longer

    def _read_back(self, call, moved) -> None:
        """`Engine._read_back`, then the call's rows copied per seat (its statistics' union
        [G, R B], summed over groups): added to each rank's figures and, for least_misses,
        to the estimate of each request the call ran (by its context before the call)."""
        ran = [(r.request_id, r.seat, len(r.prompt) + len(r.tokens)) for r in call.live()]
        super()._read_back(call, moved)
        if call.out.stats is None:
            return
        union = call.out.stats.union  # [G, R B]; the call was read
        rows = (distributed.local_values(union, 0) if self.multiprocess  # its own seats only
                else np.asarray(union)).sum(axis=0)
        copied = rows.reshape(self.ranks, self.seats_per_rank).sum(axis=1)
        self._rank_misses += copied
        mine = copied[list(self.local_ranks)]
        self._sum_max += float(mine.max())
        self._sum_mean += float(mine.mean())
        self._misses_calls += 1
        if self.placement == "least_misses":
            for rid, seat, context in ran:
                self._misses.observe(rid, context, int(rows[seat]))

    def _decode(self, moved) -> None:
        """`Engine._decode`; across processes every process makes the call when any has a
        decoding seat, with log-probabilities when any has a decoding request that asks for
        them (one `distributed.process_max` for both: the processes run one program), a
        process with none making it for its ranks' all-to-alls and reading nothing back."""
        if not self.multiprocess:
            return super()._decode(moved)
        running = [r for r in self._occupant
                   if r is not None and r.prefilled == len(r.prompt) and r.finish_reason is None]
        any_running, any_logprobs = distributed.process_max(
            [bool(running), super()._decode_logprobs(running) is not None])
        if not any_running:
            return
        self._agreed_logprobs = self.max_logprobs if any_logprobs else None
        if running:
            return super()._decode(moved)
        # every local seat done: its ranks step inactively
        self.runner.decode(logprobs=self._agreed_logprobs)

    def _decode_logprobs(self, running) -> int | None:
        """`Engine._decode_logprobs`; across processes, the K the processes agreed on
        (`_decode`)."""
        if self.multiprocess:
            return self._agreed_logprobs
        return super()._decode_logprobs(running)

    def any_unfinished(self) -> bool:
        """Whether any process's engine has a request not finished (`has_unfinished` on each;
        across processes a collective every process makes at the same point: they step
        until all are done). One process: `has_unfinished`."""
        mine = self.has_unfinished()
        return bool(distributed.process_max([mine])[0]) if self.multiprocess else mine

    def run(self) -> dict:
        """Step until every request of every process has finished (`any_unfinished`); the
        final output of each of this process's requests."""
        while self.any_unfinished():
            self.step()
        return {rid: req.output([]) for rid, req in self._requests.items()}

    # Pools ---------------------------------------------------------------------------------

    def rank_pool_occupancy(self) -> list[dict] | None:
        """[R] each rank's pool pages (free, held, cached, total); None resident."""
        if self.pool is None:
            return None
        return [{"free": p.num_free, "held": p.num_held, "cached": p.num_cached,
                 "total": p.num_pages} for p in self.kv.pools]

    def device_bytes_used(self) -> list[int | None]:
        """[R] each rank's device bytes of request state by the planner's arithmetic
        (`Scheduler.device_bytes_used` of its scheduler, what its `device_bytes` budget is
        charged; None resident). Their sum: `scheduler.device_bytes_used()`."""
        return [rank.device_bytes_used() for rank in self.scheduler.ranks]

    def pool_occupancy(self) -> dict | None:
        """Every rank's pool pages summed (free, held, cached, total); None resident."""
        per_rank = self.rank_pool_occupancy()
        if per_rank is None:
            return None
        return {k: sum(p[k] for p in per_rank) for k in per_rank[0]}


def check_settings(settings: EngineSettings) -> None:
    """Raise NotImplementedError for settings the sharded engine does not run yet."""
    cache, offload = settings.cache, settings.cache.offload
    refused = [(offload is not None and offload.host_memory_kind == "device", "the paged KV "
                "pool in device memory (host_memory_kind='device')"),
               (cache.prefix_cache, "prefix_cache"),
               (settings.speculative.num_drafts > 0, "drafts (num_drafts > 0)")]
    for bad, what in refused:
        if bad:
            raise NotImplementedError(f"the sharded engine does not run {what} yet")


__all__ = ["PLACEMENTS", "RankScheduler", "ShardedEngine", "ShardedResidentKV",
           "ShardedRunner", "ShardedScheduler", "check_settings"]

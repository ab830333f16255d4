"""One sharded serving engine: every data-parallel rank of a mesh stepped in one program.

    mesh, rules = sharding.expert_mesh(4, expert=4)     # the experts split over the 4 ranks
    engine = ShardedEngine(params, config, mesh=mesh, rules=rules, seats=2, capacity=256)
    rid = engine.add_request(prompt_ids, max_tokens=64)  # placed on one rank, for good
    while engine.has_unfinished():
        for out in engine.step():        # one prefill program, one decode program: all ranks
            ...

An `Engine` whose parts span a mesh of R data ranks (`fo_jax.sharding`: the plain data mesh
`make_mesh(R)`, or the all-to-all layout `expert_mesh(R, expert=R)` whose ranks each hold 1/R
of the routed experts). Rank r holds seats [r B, (r + 1) B) of the engine's R B (`seats` is B,
per rank), their resident KV shard [L, B, S, D+R] on its device, and its own queue: a request
is placed on a rank for good by `add_request` (the `placement` rule of `fo_jax.placement`:
round_robin, least_requests, least_context; default least_context) and admitted only into a
free seat of its rank, in its rank's queue order (`RankScheduler`). Each `step()` admits per
rank, then prefills: one program per round over all ranks, each rank running one chunk of one
of its prefilling requests (`fo_jax.sharded_steps.sharded_prefill_seats`; a rank with nothing
to prefill runs a row that writes nothing), until every prefilling request has had its chunk;
then one decode call over every rank's seats (`fo_jax.sharded_steps.sharded_decode_loop`:
every rank takes part in every step's all-to-alls, a rank with no decoding seat steps
inactively). The weights are placed by the rules (`shard_params`): with the all-to-all layout
each device holds 1/R of the experts and every other weight whole.

Contracts: a request's tokens are those of one single-device `Engine` of the same settings (B
seats, the whole weights) serving it alone, bit for bit on the tiles MoE path (the sharded
steps' contract per rank, and the engine's: a seat's rows never depend on the others'); seats
free when requests finish. Costs: one prefill program per round (the most requests prefilling
on one rank), one decode program per step, whatever R; placement O(R + requests) per
`add_request`.

Not yet (refused with a message): the paged and offloaded KV (a page pool per rank), prefix
reuse, drafts, log-probabilities, a metrics log, and moving requests between engines. It runs
without overlap (`overlap` is set False: each decode call is read back at once). Design:
docs/guides/many-devices.md, "One sharded engine".
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fo_jax import placement as placement_rules
from fo_jax import resident, sharded_steps, sharding
from fo_jax.config import ModelConfig
from fo_jax.decode_loop import ResidentStep
from fo_jax.engine.engine import Engine
from fo_jax.engine.kv_store import KVStore
from fo_jax.engine.runner import DecodeRunner
from fo_jax.engine.scheduler import Scheduler
from fo_jax.engine.settings import EngineSettings

PLACEMENTS = ("round_robin", "least_requests", "least_context")


class ShardedResidentKV(KVStore):
    """Every rank's seats' resident KV in one `ResidentState` [L, R B, S, D+R] split over the
    mesh's `data` axis (rank r's rows on its device), built on the mesh directly; prefill by
    rank (`prefill_ranks`)."""

    def __init__(self, config: ModelConfig, settings: EngineSettings, *, mesh: Mesh, rules):
        super().__init__(config, settings)
        self.mesh, self.rules = mesh, rules
        self.ranks = sharding.data_size(mesh)
        self.per_rank = self.seats // self.ranks
        def create():
            return resident.ResidentState.create(config, batch=self.seats,
                                                 capacity=self.capacity)

        # Built on the mesh, each rank's rows on its device (never whole on one device).
        self._shardings = sharding.shardings(jax.eval_shape(create), mesh, rules)
        self.state = jax.jit(create, out_shardings=self._shardings)()
        self.step_fn = ResidentStep(config, "xla")

    def set_seats(self, seats: dict) -> None:
        super().set_seats(seats)
        self.state = dataclasses.replace(  # the lengths stay split as the programs take them
            self.state, lengths=jax.device_put(self.state.lengths, self._shardings.lengths))

    def prefill_ranks(self, params, rows: dict) -> jax.Array:
        """One prefill chunk per rank in one program: rows {rank: (rank-local seat, its chunk's
        tokens, at most prefill_chunk)}; a rank not in `rows` writes nothing. Returns the logits
        [R, prefill_chunk, V] (row r: rank r's chunk's)."""
        seats = np.zeros((self.ranks,), np.int32)
        tokens = np.zeros((self.ranks, self.chunk), np.int32)
        num_new = np.zeros((self.ranks,), np.int32)
        for r, (b, part) in rows.items():
            seats[r], num_new[r] = b, len(part)
            tokens[r, :len(part)] = part
        logits, self.state = sharded_steps.sharded_prefill_seats(
            params, self.state, seats, tokens, num_new, mesh=self.mesh, config=self.config,
            query_block=self.query_block, check=False, rules=self.rules)
        return logits

    def prefill(self, params, b: int, tokens, num_new, *, prefilled: int, hidden=False):
        raise NotImplementedError("the sharded engine prefills every rank at once "
                                  "(prefill_ranks)")

    def read_seat(self, b: int, **_):
        raise NotImplementedError("requests do not move out of the sharded engine yet")

    def write_seat(self, b: int, rows, **_):
        raise NotImplementedError("requests do not move into the sharded engine yet")


class ShardedRunner(DecodeRunner):
    """`DecodeRunner` whose seats and sampling settings are split over the mesh as the KV is,
    and whose decode call is `fo_jax.sharded_steps.sharded_decode_loop` over every rank."""

    def __init__(self, params, config: ModelConfig, settings: EngineSettings,
                 kv: ShardedResidentKV):
        super().__init__(params, config, settings, kv)
        self.mesh, self.rules = kv.mesh, kv.rules
        self.seats = self._on_mesh(self.seats)

    def _on_mesh(self, tree):
        """`tree`'s [B, ...] leaves split over `data` (the decode loop's layout)."""
        data = sharding.logical_spec(("batch",), self.mesh, self.rules)

        def one(x):
            spec = data if np.ndim(x) else P()
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(one, tree)

    def sampling(self):
        fresh = self._sampling is None
        out = super().sampling()
        if fresh:
            self._sampling = out = self._on_mesh(out)
        return out

    def decode(self, *, logprobs: int | None = None):
        """One decode call of every rank's seats (`sharded_decode_loop`)."""
        if logprobs is not None:
            raise NotImplementedError("the sharded engine computes no log-probabilities")
        kv = self.kv
        out, kv.state, self.seats = sharded_steps.sharded_decode_loop(
            self.params, kv.state, self.seats, self.n_steps, self.sampling(), mesh=self.mesh,
            step=kv.step_fn, rules=self.rules)
        return out


class RankScheduler(Scheduler):
    """One rank's admission: its own queue (the waiting requests placed on it, in the queue
    order of `Scheduler.queue`) and its own seats [r B, (r + 1) B) of the engine's seat list,
    which it shares with the other ranks' schedulers (as it shares the waiting list: a
    request's rank is `placed[request_id]`)."""

    def __init__(self, settings: EngineSettings, kv: KVStore, *, rank: int, per_rank: int,
                 occupants: list, waiting: list, placed: dict, admissions):
        super().__init__(settings, kv)
        self.rank, self.placed = rank, placed
        self.seat_range = range(rank * per_rank, (rank + 1) * per_rank)
        self.occupants, self.waiting, self.admissions = occupants, waiting, admissions

    def queue(self, now: int):
        return [r for r in super().queue(now) if self.placed[r.request_id] == self.rank]

    def free_seats(self) -> list[int]:
        return [b for b in self.seat_range if self.occupants[b] is None]


class ShardedScheduler(Scheduler):
    """The engine's scheduler: the seat list and waiting list of every rank, admission rank by
    rank (`RankScheduler`: a request takes a seat of its own rank only)."""

    def __init__(self, settings: EngineSettings, kv: ShardedResidentKV, *, placed: dict):
        super().__init__(settings, kv)
        self.ranks = [RankScheduler(settings, kv, rank=r, per_rank=kv.per_rank,
                                    occupants=self.occupants, waiting=self.waiting,
                                    placed=placed, admissions=self.admissions)
                      for r in range(kv.ranks)]

    def admit(self, now: int):
        new, kept = [], []
        for rank in self.ranks:
            n, k = rank.admit(now)
            new += n
            kept += k
        return new, kept


class ShardedEngine(Engine):
    """Continuous batching over every data-parallel rank of `mesh` in one program per step (see
    the module doc).

    Args:
      params, config: the model; the weights are placed on the mesh by `rules`
        (`fo_jax.sharding.shard_params`).
      settings / kwargs: as `Engine`; `seats` is per rank (the engine holds R seats times
        it).
      mesh, rules: `fo_jax.sharding.expert_mesh(R, expert=R)` (the all-to-all layout) or
        `make_mesh(R)` with rules None (`RULES`: every weight on every device).
      placement: a rule of `PLACEMENTS` (default least_context).
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
        placement = "least_context" if placement is None else placement
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r}: the sharded engine places by one of "
                             f"{PLACEMENTS} (fo_jax.placement; least_misses needs the "
                             "offloaded path)")
        self.mesh, self.rules, self.placement = mesh, rules, placement
        self.ranks = sharding.data_size(mesh)
        self.seats_per_rank = int(settings.cache.seats)
        self._placed: dict[str, int] = {}  # request id -> its rank, for good
        self._turn = 0
        # Every rank's seats; without overlap (each decode call is read back at once).
        whole = dataclasses.replace(
            settings, cache=dataclasses.replace(settings.cache,
                                                seats=self.seats_per_rank * self.ranks),
            scheduler=dataclasses.replace(settings.scheduler, overlap=False))
        super().__init__(sharding.shard_params(params, mesh, rules), config, whole,
                         tokenizer=tokenizer)

    def _make_kv_store(self, config: ModelConfig, settings: EngineSettings):
        return ShardedResidentKV(config, settings, mesh=self.mesh, rules=self.rules)

    def _make_runner(self, params, config: ModelConfig, settings: EngineSettings, mtp):
        return ShardedRunner(params, config, settings, self.kv)

    def _make_scheduler(self, settings: EngineSettings) -> Scheduler:
        return ShardedScheduler(settings, self.kv, placed=self._placed)

    # Requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], *, rank: int | None = None,
                    logprobs: int | None = None, **kwargs) -> str:
        """Place a request on a rank (the placement rule on the ranks' loads, or `rank`) and
        queue it there; returns its id. kwargs: `Engine.add_request`'s; refusals are its own
        and leave the engine as it was. O(R + requests)."""
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                                 or not 0 <= rank < self.ranks):
            raise ValueError(f"rank={rank!r} must be an int in [0, R = {self.ranks}) or None "
                             "(placed by the rule)")
        if logprobs is not None:
            raise ValueError("logprobs are not computed by the sharded engine yet: pass "
                             "logprobs=None")
        prompt = list(prompt)
        turn = self._turn
        if rank is None:
            rank, turn = self.choose_rank(len(prompt))
        rid = super().add_request(prompt, **kwargs)
        self._placed[rid], self._turn = rank, turn
        return rid

    def choose_rank(self, prompt_len: int) -> tuple[int, int]:
        """(the rank a new request of `prompt_len` tokens would go to now, round robin's next
        turn): among the ranks with a free seat not promised to a waiting request (all ranks
        when none has one), by the placement rule. Changes nothing. O(R + requests)."""
        load, busy = [0.0] * self.ranks, [0] * self.ranks
        for req in self._requests.values():
            if req.finish_reason is None:
                r = self._placed[req.request_id]
                busy[r] += 1
                load[r] += self._cost(len(req.prompt) + len(req.tokens))
        free = [max(self.seats_per_rank - n, 0) for n in busy]
        if not any(free):
            free = [1] * self.ranks
        ranks, turn = placement_rules.assign(self.placement, [self._cost(prompt_len)],
                                             load=load, free=free, turn=self._turn)
        return ranks[0], turn

    def _cost(self, context: int) -> float:
        return float(context) if self.placement == "least_context" else 1.0

    def rank_of(self, request_id: str) -> int:
        """The rank a request was placed on (KeyError for an unknown id)."""
        if request_id not in self._placed:
            raise KeyError(f"no request {request_id!r}")
        return self._placed[request_id]

    def release(self, request_id: str):
        out = super().release(request_id)
        del self._placed[request_id]
        return out

    def rank_seats(self, rank: int) -> range:
        """The engine's seats of `rank`: [rank B, (rank + 1) B)."""
        return range(rank * self.seats_per_rank, (rank + 1) * self.seats_per_rank)

    def reset_figures(self) -> None:
        """Zero the counters and timings (a warm-up left out)."""
        self.counters = dict.fromkeys(self.counters, 0)
        self.timings = dict.fromkeys(self.timings, 0.0)
        self.stats = None

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
        every rank (`ShardedResidentKV.prefill_ranks`) in which each rank runs one chunk of
        its next prefilling request (by seat); then the completed prompts join
        (`Engine._join`). A request's chunk is the [1, prefill_chunk] program of one
        `Engine`'s prefill on its own seat, so its KV and logits are those of its solo run."""
        per = self.seats_per_rank
        by_rank = [[r for r in self._occupant[rank * per:(rank + 1) * per]
                    if r is not None and r.prefilled < len(r.prompt)]
                   for rank in range(self.ranks)]
        rounds = max(len(reqs) for reqs in by_rank)
        if not rounds:
            return
        before, last = {}, {}  # per request: tokens in its chunk; seat: last logits [V]
        start = time.perf_counter()
        work = self.runner.clock.begin(start)
        for i in range(rounds):
            rows, parts = {}, {}
            for rank, reqs in enumerate(by_rank):
                if i < len(reqs):
                    req = reqs[i]
                    part = req.prompt[req.prefilled:req.prefilled + self.chunk]
                    rows[rank], parts[rank] = (req.seat - rank * per, part), (req, len(part))
            logits = self.kv.prefill_ranks(self.params, rows)
            for rank, (req, n) in parts.items():
                before[req.request_id] = n
                if req.prefilled + n == len(req.prompt):
                    # on the host: the first tokens are sampled with the engine's seats
                    last[req.seat] = np.asarray(logits[rank, n - 1])
        jax.block_until_ready(logits)
        ready = time.perf_counter()
        self.timings["prefill_s"] += ready - start
        self.runner.clock.end(work, ready, self.timings)
        self.counters["prefill_calls"] += rounds
        self.counters["prefill_tokens"] += sum(before.values())
        requests = [req for reqs in by_rank for req in reqs]
        for req in requests:
            req.prefilled += before[req.request_id]
        joined = [r for r in requests if r.prefilled == len(r.prompt)]
        if joined:
            self._join(joined, last, moved)


def check_settings(settings: EngineSettings) -> None:
    """Raise NotImplementedError for settings the sharded engine does not run yet."""
    cache, sched = settings.cache, settings.scheduler
    refused = [(cache.offload is not None, "the paged and offloaded KV (offload=...: a page "
                "pool per rank)"),
               (cache.prefix_cache, "prefix_cache"),
               (settings.speculative.num_drafts > 0, "drafts (num_drafts > 0)"),
               (settings.metrics.path is not None, "a metrics log (metrics_path)")]
    for bad, what in refused:
        if bad:
            raise NotImplementedError(f"the sharded engine does not run {what} yet; it runs "
                                      "the resident KV")


__all__ = ["PLACEMENTS", "RankScheduler", "ShardedEngine", "ShardedResidentKV",
           "ShardedRunner", "ShardedScheduler", "check_settings"]

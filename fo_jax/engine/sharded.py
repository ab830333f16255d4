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
per rank), their KV on its device (resident: its shard [L, B, S, D+R] of the rows,
`ShardedResidentKV`; paged, `offload=OffloadConfig(...)`: its own page pool of `num_pages`
pages, host KV in its device's `pinned_host` memory, `ShardedPagedKV`), and its own queue: a
request
is placed on a rank for good by `add_request` (the `placement` rule of `fo_jax.placement`:
round_robin, least_requests, least_context; default least_context) and admitted only into a
free seat of its rank, in its rank's queue order (`RankScheduler`). Each `step()` admits per
rank, then prefills: one program per round over all ranks, each rank running one chunk of one
of its prefilling requests (`fo_jax.sharded_seats.sharded_prefill_seats`; a rank with nothing
to prefill runs a row that writes nothing; paged, the chunks of a round load the same number
of history pages), until every prefilling request has had its chunk;
then one decode call over every rank's seats (`fo_jax.sharded_steps.sharded_decode_loop`:
every rank takes part in every step's all-to-alls, a rank with no decoding seat steps
inactively). The weights are placed by the rules (`shard_params`): with the all-to-all layout
each device holds 1/R of the experts and every other weight whole.

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
prefilled again and its tokens replayed by the sharded decode step, `ShardedRunner.replay`).

Across processes (jax.distributed; resident only): each process builds the same engine over
the global mesh, serves the ranks of its own devices (`local_ranks`: their requests, seats and
queues) and steps in lockstep with the others: each step the processes agree (one small
all-gather, `fo_jax.distributed.process_max`) on the number of prefill rounds (the most any
needs) and on whether a decode call runs (any decoding seat anywhere); `run` and
`any_unfinished` step until every process is done. No host read of another process's rows
(`ShardedRunner`: seats and sampling kept on the process's first device between decode calls).

Not yet (refused with a message): paged, device_bytes, host_pool_bytes, the pool in device
memory and least_misses placement; prefix reuse, drafts, log-probabilities, a metrics log,
moving requests between engines, and the paged path across processes. It runs without
overlap (`overlap` is set False: each decode call is read back at once). Design:
docs/guides/many-devices.md, "One sharded engine".
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fo_jax import distributed
from fo_jax import placement as placement_rules
from fo_jax import resident, sharded_seats, sharded_steps, sharding
from fo_jax.config import ModelConfig
from fo_jax.decode_loop import OffloadedStep, ResidentStep
from fo_jax.engine.costs import MemoryCosts
from fo_jax.engine.engine import Engine
from fo_jax.engine.kv_store import KVStore, masked_rows
from fo_jax.engine.pages import NO_PAGE, PagePool
from fo_jax.engine.runner import DecodeRunner
from fo_jax.engine.scheduler import Scheduler
from fo_jax.engine.settings import EngineSettings
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload.state import DecodeState

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
            self.state, lengths=sharded_steps.put_sharded(
                self.state.lengths, self._shardings.lengths))

    def history_pages(self, prefilled: int) -> None:
        """No history pages: a resident chunk reads its seat's rows."""
        return None

    def prefill_ranks(self, params, rows: dict, *, history_pages: None = None) -> jax.Array:
        """One prefill chunk per rank in one program: rows {rank: (rank-local seat, its chunk's
        tokens, at most prefill_chunk)}; a rank not in `rows` writes nothing. Returns the logits
        [R, prefill_chunk, V] (row r: rank r's chunk's)."""
        seats, tokens, num_new = _round_arrays(rows, self.ranks, self.chunk)
        logits, self.state = sharded_seats.sharded_prefill_seats(
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


class ShardedPagedKV(KVStore):
    """Every rank's seats' paged KV: one `DecodeState` of R B seats split over the mesh's
    `data` axis, whose host KV pool [L, R F, Z, D+R] (`pinned_host`) and indexer-key pool hold
    F pages per rank (rank r's frames on its device's host memory), and one `PagePool` of F
    pages per rank (`pools`; rank-local page ids, as the sharded state's page table holds
    them). `num_pages` (default B P) is per rank. The state is built on one device and split
    once (`shard_state`: a one-off O(pool) copy through host memory)."""

    paged = True

    def __init__(self, config: ModelConfig, settings: EngineSettings, *, mesh: Mesh, rules):
        super().__init__(config, settings)
        self.mesh, self.rules = mesh, rules
        self.ranks = sharding.data_size(mesh)
        self.per_rank = self.seats // self.ranks
        z = self.offload.page_size
        self.max_pages = self.capacity // z
        num_pages = settings.cache.num_pages
        num_pages = self.per_rank * self.max_pages if num_pages is None else int(num_pages)
        self.pools = [PagePool(num_pages, z) for _ in range(self.ranks)]
        self.pool = self.pools[0]  # the sizes every rank's pool has (`check_fits_alone`)
        num_buffers = self.num_buffers
        # The planner's bytes of one rank's seats and pages (each rank's scheduler's, `RankKV`).
        self.rank_costs = MemoryCosts.from_config(
            config, page_size=z, hot_slots=self.offload.hot_slots,
            num_buffers=min(4, config.num_layers) if num_buffers is None else num_buffers,
            pool_memory=self.offload.host_memory_kind)
        state = DecodeState.create(
            config, self.offload, batch=self.seats, num_frames=self.ranks * num_pages,
            table=np.full((self.seats, self.max_pages), NO_PAGE, np.int32))
        self.state = sharding.shard_state(state, mesh, rules)
        self._shardings = sharding.shardings(self.state, mesh, rules)
        self.step_fn = OffloadedStep(config, self.offload, "xla")

    def rank_view(self, rank: int) -> "RankKV":
        return RankKV(self, rank)

    def set_seats(self, seats: dict) -> None:
        super().set_seats(seats)
        self.state = dataclasses.replace(  # as the programs take them
            self.state, lengths=sharded_steps.put_sharded(
                self.state.lengths, self._shardings.lengths),
            table=jax.device_put(self.state.table, self._shardings.table))

    def set_rows(self, rows: dict) -> None:
        """Set seat b's page-table row to rows[b] (its rank's page ids; lengths unchanged)."""
        mask = np.zeros((self.seats,), bool)
        table = np.full((self.seats, self.max_pages), NO_PAGE, np.int32)
        for b, row in rows.items():
            mask[b], table[b] = True, row
        self.state = dataclasses.replace(self.state, table=jax.device_put(
            masked_rows(self.state.table, mask, table), self._shardings.table))

    def join(self, mask: np.ndarray) -> None:
        self.state = sharded_seats.sharded_join_seats(self.state, mask, config=self.config,
                                                      offload=self.offload, mesh=self.mesh,
                                                      rules=self.rules)

    def history_pages(self, prefilled: int) -> int:
        """The history pages a chunk after `prefilled` tokens loads: a power of two (one
        program per bucket), as one `Engine`'s paged prefill loads for it."""
        pages = -(-int(prefilled) // self.offload.page_size)
        bucket = 1 << (pages - 1).bit_length() if pages > 0 else 0
        return min(bucket, self.max_pages)

    def prefill_ranks(self, params, rows: dict, *, history_pages: int) -> jax.Array:
        """As `ShardedResidentKV.prefill_ranks`, over each rank's own pages, every rank loading
        `history_pages` pages of history (the bucket of every chunk of the round)."""
        seats, tokens, num_new = _round_arrays(rows, self.ranks, self.chunk)
        st, oc = self.state, self.offload
        view = offload_prefill.PrefillState(host=st.host, table=st.table,
                                            index_keys=st.index_keys, lengths=st.lengths)
        logits, view = sharded_seats.sharded_prefill_seats(
            params, view, seats, tokens, num_new, mesh=self.mesh, config=self.config,
            query_block=self.query_block, check=False, rules=self.rules,
            history_pages=history_pages, num_buffers=self.num_buffers,
            host_access=oc.host_access)
        self.state = dataclasses.replace(st, host=view.host, table=view.table,
                                         index_keys=view.index_keys, lengths=view.lengths)
        return logits

    def prefill(self, params, b: int, tokens, num_new, *, prefilled: int, hidden=False):
        raise NotImplementedError("the sharded engine prefills every rank at once "
                                  "(prefill_ranks)")

    def read_seat(self, b: int, **_):
        raise NotImplementedError("requests do not move out of the sharded engine yet")

    def write_seat(self, b: int, rows, **_):
        raise NotImplementedError("requests do not move into the sharded engine yet")


class RankKV:
    """What one rank's scheduler sees of a `ShardedPagedKV`: its own pool, the seat sizes."""

    paged, prefix = True, None

    def __init__(self, kv: ShardedPagedKV, rank: int):
        self.pool, self.costs = kv.pools[rank], kv.rank_costs
        self.seats, self.capacity, self.max_pages = kv.seats, kv.capacity, kv.max_pages


def _local_leaf(x: jax.Array) -> jax.Array:
    """`fo_jax.distributed.local_values` of a seats leaf (PRNG keys by their key data), on
    this process's first device."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = distributed.local_values(jax.random.key_data(x), 0)
        return jax.random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(x))
    return jnp.asarray(distributed.local_values(x, 0))


def _round_arrays(rows: dict, ranks: int, chunk: int):
    """[R] seats, [R, chunk] tokens and [R] counts of a prefill round's rows {rank: (rank-local
    seat, tokens)}; a rank not in `rows` runs seat 0 with no token."""
    seats = np.zeros((ranks,), np.int32)
    tokens = np.zeros((ranks, chunk), np.int32)
    num_new = np.zeros((ranks,), np.int32)
    for r, (b, part) in rows.items():
        seats[r], num_new[r] = b, len(part)
        tokens[r, :len(part)] = part
    return seats, tokens, num_new


class ShardedRunner(DecodeRunner):
    """`DecodeRunner` whose seats and sampling settings are split over the mesh as the KV is,
    and whose decode call is `fo_jax.sharded_steps.sharded_decode_loop` over every rank.

    Across processes (`multiprocess`) the seats and sampling settings are kept on this
    process's first device between decode calls, only its own seats' rows meaningful: every
    program over them (first tokens, joins, a finished seat marked) runs there alone, on no
    other process's values (the first tokens' sampling reduces over the seats: on the mesh it
    would be a collective every process must join). The decode call places them on the mesh
    (each process its own rows) and takes back its own rows (`fo_jax.distributed.local_values`)."""

    def __init__(self, params, config: ModelConfig, settings: EngineSettings, kv):
        super().__init__(params, config, settings, kv)
        self.mesh, self.rules = kv.mesh, kv.rules
        self.multiprocess = not kv.state.lengths.is_fully_addressable
        self._mesh_sampling = None  # (the local settings, them on the mesh), across processes
        if not self.multiprocess:
            self.seats = self._on_mesh(self.seats)

    def _on_mesh(self, tree):
        """`tree`'s [B, ...] leaves split over `data` (the decode loop's layout)."""
        data = sharding.logical_spec(("batch",), self.mesh, self.rules)

        def one(x):
            spec = data if np.ndim(x) else P()
            return sharded_steps.put_sharded(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(one, tree)

    def sampling(self):
        fresh = self._sampling is None
        out = super().sampling()
        if fresh and not self.multiprocess:
            self._sampling = out = self._on_mesh(out)
        return out

    def _placed_sampling(self):
        """The sampling settings as the decode call takes them (placed once per change)."""
        local = self.sampling()
        if not self.multiprocess:
            return local
        if self._mesh_sampling is None or self._mesh_sampling[0] is not local:
            self._mesh_sampling = (local, self._on_mesh(local))
        return self._mesh_sampling[1]

    def replay(self, resumed) -> int:
        """`DecodeRunner.replay` over every rank: each resumed request's sampled tokens but the
        last fed again, one per step, by the sharded decode step (`sharded_decode_step`: each
        rank the single-device step that computed them, the other seats inactive), so its KV
        is the one it had, bit for bit. Returns the tokens replayed."""
        kv, batch, replayed = self.kv, self.batch, 0
        for i in range(max(len(r.tokens) - 1 for r in resumed)):
            tokens = np.zeros((batch, 1), np.int32)
            active = np.zeros((batch,), bool)
            for req in resumed:
                if i < len(req.tokens) - 1:
                    tokens[req.seat, 0], active[req.seat] = req.tokens[i], True
            _, kv.state, _ = sharded_steps.sharded_decode_step(
                self.params, kv.state, tokens, mesh=self.mesh, config=self.config,
                offload=kv.offload, active=active, check=False, implementation="xla",
                rules=self.rules)
            replayed += int(active.sum())
        return replayed

    def dispatch(self, running, *, logprobs: int | None = None):
        """`DecodeRunner.dispatch`; across processes, the call's tokens and lengths as this
        process's seats' rows on the host (`distributed.local_values`: no read of another
        process's seats; the rest -1 and 0)."""
        call = super().dispatch(running, logprobs=logprobs)
        if self.multiprocess:
            tokens = distributed.local_values(call.out.tokens, -1)
            call.out = dataclasses.replace(call.out, tokens=tokens)
            call.lengths = distributed.local_values(call.lengths, 0)
        return call

    def decode(self, *, logprobs: int | None = None):
        """One decode call of every rank's seats (`sharded_decode_loop`)."""
        if logprobs is not None:
            raise NotImplementedError("the sharded engine computes no log-probabilities")
        kv = self.kv
        seats = self._on_mesh(self.seats) if self.multiprocess else self.seats
        out, kv.state, seats = sharded_steps.sharded_decode_loop(
            self.params, kv.state, seats, self.n_steps, self._placed_sampling(),
            mesh=self.mesh, step=kv.step_fn, rules=self.rules)
        self.seats = jax.tree.map(_local_leaf, seats) if self.multiprocess else seats
        return out


class RankSeats:
    """Rank r's seats [r B, (r + 1) B) of the engine's seat list, as its scheduler sees them:
    iterated, only its own occupants; indexed, by the engine's (global) seat numbers."""

    def __init__(self, seats: list, seat_range: range):
        self.seats, self.range = seats, seat_range

    def __iter__(self):
        return (self.seats[b] for b in self.range)

    def __len__(self) -> int:
        return len(self.range)

    def __getitem__(self, b: int):
        return self.seats[b]

    def __setitem__(self, b: int, req) -> None:
        self.seats[b] = req


class RankWaiting:
    """Rank r's waiting requests, as its scheduler sees them: iterated, only those placed on
    it (`placed[request_id] == r`); changed, the engine's waiting list."""

    def __init__(self, waiting: list, placed: dict, rank: int):
        self.waiting, self.placed, self.rank = waiting, placed, rank

    def __iter__(self):
        return (r for r in self.waiting if self.placed[r.request_id] == self.rank)

    def __contains__(self, req) -> bool:
        return req in self.waiting and self.placed[req.request_id] == self.rank

    def append(self, req) -> None:
        self.waiting.append(req)

    def remove(self, req) -> None:
        self.waiting.remove(req)


class RankScheduler(Scheduler):
    """One rank's admission, growth and preemption: `Scheduler`'s rules over its own queue
    (the waiting requests placed on it: `RankWaiting`), its own seats [r B, (r + 1) B) of the
    engine's (`RankSeats`) and, paged, its own page pool (`RankKV`): a request waits for a seat
    and pages of its rank, and only requests of its rank are preempted for it."""

    def __init__(self, settings: EngineSettings, kv, *, rank: int, per_rank: int,
                 occupants: list, waiting: list, placed: dict, admissions, unread: set):
        super().__init__(settings, kv)
        self.rank = rank
        self.occupants = RankSeats(occupants, range(rank * per_rank, (rank + 1) * per_rank))
        self.waiting = RankWaiting(waiting, placed, rank)
        self.admissions, self.unread = admissions, unread

    def free_seats(self) -> list[int]:
        return [b for b in self.occupants.range if self.occupants[b] is None]


class ShardedScheduler(Scheduler):
    """The engine's scheduler: the seat list and waiting list of every rank, admission rank by
    rank (`RankScheduler`: a request takes a seat of its own rank only)."""

    def __init__(self, settings: EngineSettings, kv, *, placed: dict):
        super().__init__(settings, kv)
        self.placed = placed
        self.ranks = [RankScheduler(settings, kv.rank_view(r) if kv.paged else kv, rank=r,
                                    per_rank=kv.per_rank, occupants=self.occupants,
                                    waiting=self.waiting, placed=placed,
                                    admissions=self.admissions, unread=self.unread)
                      for r in range(kv.ranks)]

    def admit(self, now: int):
        new, kept = [], []
        for rank in self.ranks:
            n, k = rank.admit(now)
            new += n
            kept += k
        return new, kept

    def make_room(self, req):
        """`Scheduler.make_room` on the request's rank (its pool, its requests)."""
        return self.ranks[self.placed[req.request_id]].make_room(req)


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
                             f"{PLACEMENTS} (fo_jax.placement; least_misses, which reads "
                             "each seat's misses, is not run by it yet)")
        self.mesh, self.rules, self.placement = mesh, rules, placement
        self.ranks = sharding.data_size(mesh)
        # The ranks whose device this process drives (all of them in one process).
        me = jax.process_index()
        self.local_ranks = tuple(r for r, d in enumerate(mesh.devices.reshape(-1))
                                 if d.process_index == me)
        self.multiprocess = len(self.local_ranks) < self.ranks
        if self.multiprocess and settings.cache.paged:
            raise NotImplementedError(
                "the sharded engine spans processes on the resident path only (offload=None): "
                "its paged prefill rounds group chunks by history bucket, which the processes "
                "do not agree on yet")
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
        queue it there; returns its id. kwargs: `Engine.add_request`'s; refusals are its own
        and leave the engine as it was. O(R + requests)."""
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                                 or not 0 <= rank < self.ranks):
            raise ValueError(f"rank={rank!r} must be an int in [0, R = {self.ranks}) or None "
                             "(placed by the rule)")
        if rank is not None and rank not in self.local_ranks:
            raise ValueError(f"rank={rank} is driven by another process: process "
                             f"{jax.process_index()} takes requests for its own ranks "
                             f"{list(self.local_ranks)}")
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
        turn): among this process's ranks with a free seat not promised to a waiting request
        (all of them when none has one), by the placement rule. Changes nothing.
        O(R + requests)."""
        load, busy = [0.0] * self.ranks, [0] * self.ranks
        for req in self._requests.values():
            if req.finish_reason is None:
                r = self._placed[req.request_id]
                busy[r] += 1
                load[r] += self._cost(len(req.prompt) + len(req.tokens))
        local = self.local_ranks  # a process places on its own ranks only
        free = [max(self.seats_per_rank - busy[r], 0) for r in local]
        if not any(free):
            free = [1] * len(local)
        ranks, turn = placement_rules.assign(self.placement, [self._cost(prompt_len)],
                                             load=[load[r] for r in local], free=free,
                                             turn=self._turn)
        return local[ranks[0]], turn

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
        every rank (`prefill_ranks`) in which each rank runs one chunk of its next prefilling
        request (by seat; paged, of those whose chunk loads the round's number of history
        pages, the bucket of the first one waiting: a chunk runs the program one `Engine`
        runs for it); then the completed prompts join (`Engine._join`). A request's chunk is
        the [1, prefill_chunk] program of one `Engine`'s prefill on its own seat, so its KV and
        logits are those of its solo run."""
        per = self.seats_per_rank
        by_rank = [[r for r in self._occupant[rank * per:(rank + 1) * per]
                    if r is not None and r.prefilled < len(r.prompt)]
                   for rank in range(self.ranks)]
        requests = [req for reqs in by_rank for req in reqs]
        # Across processes every process runs as many rounds as the busiest (resident: one
        # round per request of a rank; a process with fewer runs rounds that write nothing).
        rounds_due = max(len(reqs) for reqs in by_rank)
        if self.multiprocess:
            rounds_due = int(distributed.process_max([rounds_due])[0])
        if not rounds_due:
            return
        pending = [list(reqs) for reqs in by_rank]
        before, last, rounds = {}, {}, 0  # per request: tokens in its chunk; seat: last [V]
        start = time.perf_counter()
        work = self.runner.clock.begin(start)
        while any(pending) or rounds < rounds_due:
            first = next((reqs[0] for reqs in pending if reqs), None)
            pages = None if first is None else self.kv.history_pages(first.prefilled)
            rows, parts = {}, {}
            for rank, reqs in enumerate(pending):
                req = next((r for r in reqs if self.kv.history_pages(r.prefilled) == pages),
                           None)
                if req is not None:
                    reqs.remove(req)
                    part = req.prompt[req.prefilled:req.prefilled + self.chunk]
                    rows[rank], parts[rank] = (req.seat - rank * per, part), (req, len(part))
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
        if joined:
            self._join(joined, last, moved)

    def _decode(self, moved) -> None:
        """`Engine._decode`; across processes every process makes the call when any has a
        decoding seat (`distributed.process_max`), a process with none making it for its
        ranks' all-to-alls and reading nothing back."""
        if not self.multiprocess:
            return super()._decode(moved)
        running = any(r is not None and r.prefilled == len(r.prompt) and r.finish_reason is None
                      for r in self._occupant)
        if not distributed.process_max([running])[0]:
            return
        if running:
            return super()._decode(moved)
        self.runner.decode()  # every local seat done: its ranks step inactively

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
        (`Scheduler.device_bytes_used` of its scheduler; None resident)."""
        return [rank.device_bytes_used() for rank in self.scheduler.ranks]

    def pool_occupancy(self) -> dict | None:
        """Every rank's pool pages summed (free, held, cached, total); None resident."""
        per_rank = self.rank_pool_occupancy()
        if per_rank is None:
            return None
        return {k: sum(p[k] for p in per_rank) for k in per_rank[0]}


def check_settings(settings: EngineSettings) -> None:
    """Raise NotImplementedError for settings the sharded engine does not run yet."""
    cache, sched, offload = settings.cache, settings.scheduler, settings.cache.offload
    refused = [(offload is not None and offload.host_memory_kind == "device", "the paged KV "
                "pool in device memory (host_memory_kind='device')"),
               (sched.device_bytes is not None, "device_bytes"),
               (cache.host_pool_bytes is not None, "host_pool_bytes (size each rank's pool "
                "with num_pages)"),
               (cache.prefix_cache, "prefix_cache"),
               (settings.speculative.num_drafts > 0, "drafts (num_drafts > 0)"),
               (settings.metrics.path is not None, "a metrics log (metrics_path)")]
    for bad, what in refused:
        if bad:
            raise NotImplementedError(f"the sharded engine does not run {what} yet")


__all__ = ["PLACEMENTS", "RankScheduler", "ShardedEngine", "ShardedResidentKV",
           "ShardedRunner", "ShardedScheduler", "check_settings"]

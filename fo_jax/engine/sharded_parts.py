"""The parts of `fo_jax.engine.sharded.ShardedEngine`, as `Engine` has its own: the KV of every
rank's seats (`ShardedResidentKV`; paged, `ShardedPagedKV` with one pool per rank, `RankKV`
the view of one rank's pool), the decode-loop runner over the mesh (`ShardedRunner`), and the
per-rank scheduling (`ShardedScheduler` of one `RankScheduler` per rank, over the rank's
seats `RankSeats` and queue `RankWaiting`). The engine and its contracts:
`fo_jax.engine.sharded`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fo_jax import distributed
from fo_jax import resident, sharded_seats, sharded_steps, sharding
from fo_jax.config import ModelConfig
from fo_jax.decode_loop import OffloadedStep, ResidentStep
from fo_jax.engine.costs import MemoryCosts
from fo_jax.engine.kv_store import KVStore, masked_rows, pool_pages
from fo_jax.engine.pages import NO_PAGE, PagePool
from fo_jax.engine.runner import DecodeRunner
from fo_jax.engine.scheduler import Scheduler
from fo_jax.engine.settings import EngineSettings
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload.state import DecodeState


class ShardedKV(KVStore):
    """What both sharded KV stores refuse: a one-seat prefill (every rank prefills at once,
    `prefill_ranks`) and moving a seat's rows out or in."""

    def prefill(self, params, b: int, tokens, num_new, *, prefilled: int, hidden=False):
        raise NotImplementedError("the sharded engine prefills every rank at once "
                                  "(prefill_ranks)")

    def read_seat(self, b: int, **_):
        raise NotImplementedError("requests do not move out of the sharded engine yet")

    def write_seat(self, b: int, rows, **_):
        raise NotImplementedError("requests do not move into the sharded engine yet")


class ShardedResidentKV(ShardedKV):
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

    def history_buckets(self) -> tuple:
        """Every value `history_pages` takes: one bucket (None)."""
        return (None,)

    def prefill_ranks(self, params, rows: dict, *, history_pages: None = None) -> jax.Array:
        """One prefill chunk per rank in one program: rows {rank: (rank-local seat, its chunk's
        tokens, at most prefill_chunk)}; a rank not in `rows` writes nothing. Returns the logits
        [R, prefill_chunk, V] (row r: rank r's chunk's)."""
        seats, tokens, num_new = _round_arrays(rows, self.ranks, self.chunk)
        logits, self.state = sharded_seats.sharded_prefill_seats(
            params, self.state, seats, tokens, num_new, mesh=self.mesh, config=self.config,
            query_block=self.query_block, check=False, rules=self.rules)
        return logits


class ShardedPagedKV(ShardedKV):
    """Every rank's seats' paged KV: one `DecodeState` of R B seats split over the mesh's
    `data` axis, whose host KV pool [L, R F, Z, D+R] (`pinned_host`) and indexer-key pool hold
    F pages per rank (rank r's frames on its device's host memory), and one `PagePool` of F
    pages per rank (`pools`; rank-local page ids, as the sharded state's page table holds
    them). `num_pages` (default B P) and `host_pool_bytes` (`pool_pages`) size each rank's
    pool; `costs` are the planner's bytes of one rank's seat and page (every rank's alike).
    The state is built on one device and split once (`shard_state`: a one-off O(pool) copy
    through host memory)."""

    paged = True

    def __init__(self, config: ModelConfig, settings: EngineSettings, *, mesh: Mesh, rules):
        super().__init__(config, settings)
        self.mesh, self.rules = mesh, rules
        self.ranks = sharding.data_size(mesh)
        self.per_rank = self.seats // self.ranks
        z = self.offload.page_size
        self.max_pages = self.capacity // z
        num_buffers = self.num_buffers
        # The planner's bytes of one rank's seats and pages (each rank's scheduler's, `RankKV`).
        self.costs = MemoryCosts.from_config(
            config, page_size=z, hot_slots=self.offload.hot_slots,
            num_buffers=min(4, config.num_layers) if num_buffers is None else num_buffers,
            pool_memory=self.offload.host_memory_kind)
        cache = settings.cache
        num_pages = (pool_pages(cache.host_pool_bytes, self.costs, config)
                     if cache.host_pool_bytes is not None else cache.num_pages)
        num_pages = self.per_rank * self.max_pages if num_pages is None else int(num_pages)
        self.pools = [PagePool(num_pages, z) for _ in range(self.ranks)]
        self.pool = self.pools[0]  # the sizes every rank's pool has (`check_fits_alone`)
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

    def history_buckets(self) -> tuple[int, ...]:
        """Every value `history_pages` takes, in increasing order: 0, the powers of two below
        the pages of a seat's capacity, and those pages (O(log pages) buckets)."""
        powers = tuple(1 << i for i in range(max(self.max_pages - 1, 0).bit_length()))
        return (0,) + powers + (self.max_pages,)

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


class RankKV:
    """What one rank's scheduler sees of a `ShardedPagedKV`: its own pool, the seat sizes."""

    paged, prefix = True, None

    def __init__(self, kv: ShardedPagedKV, rank: int):
        self.pool, self.costs = kv.pools[rank], kv.costs
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

    def _replay_step(self, tokens: np.ndarray, active: np.ndarray) -> None:
        """`DecodeRunner.replay`'s step over every rank: the sharded decode step
        (`sharded_decode_step`: each rank the single-device step that computed the tokens, the
        other seats inactive), so a resumed request's KV is the one it had, bit for bit."""
        kv = self.kv
        _, kv.state, _ = sharded_steps.sharded_decode_step(
            self.params, kv.state, tokens, mesh=self.mesh, config=self.config,
            offload=kv.offload, active=active, check=False, implementation="xla",
            rules=self.rules)

    def replay_idle(self, steps: int) -> None:
        """`steps` steps of the replay's program with every seat inactive (nothing changes):
        across processes, those a process makes while another replays longer (every rank takes
        part in the step's all-to-alls)."""
        tokens, active = np.zeros((self.batch, 1), np.int32), np.zeros((self.batch,), bool)
        for _ in range(steps):
            self._replay_step(tokens, active)

    def dispatch(self, running, *, logprobs: int | None = None):
        """`DecodeRunner.dispatch`; across processes, the call's tokens, log-probabilities
        and lengths as this process's seats' rows on the host (`distributed.local_values`: no
        read of another process's seats; the rest -1, 0 and 0)."""
        call = super().dispatch(running, logprobs=logprobs)
        if self.multiprocess:
            out = call.out
            local = distributed.local_values
            call.out = dataclasses.replace(
                out, tokens=local(out.tokens, -1),
                logprobs=None if out.logprobs is None else local(out.logprobs, 0),
                logprob_ids=None if out.logprob_ids is None else local(out.logprob_ids, -1))
            call.lengths = distributed.local_values(call.lengths, 0)
        return call

    def decode(self, *, logprobs: int | None = None):
        """One decode call of every rank's seats (`sharded_decode_loop`; logprobs: its K, or
        None). Across processes every process makes it with the same `logprobs`
        (`ShardedEngine._decode_logprobs`): one program."""
        kv = self.kv
        seats = self._on_mesh(self.seats) if self.multiprocess else self.seats
        out, kv.state, seats = sharded_steps.sharded_decode_loop(
            self.params, kv.state, seats, self.n_steps, self._placed_sampling(),
            mesh=self.mesh, step=kv.step_fn, rules=self.rules, logprobs=logprobs)
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

    def device_bytes_used(self) -> int | None:
        """Every rank's `Scheduler.device_bytes_used` summed (None resident): a budget
        (`device_bytes`) is per rank, each rank's scheduler charging its own."""
        used = [rank.device_bytes_used() for rank in self.ranks]
        return None if used[0] is None else sum(used)

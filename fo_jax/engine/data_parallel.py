"""Data-parallel serving: R `Engine`s, one per device, each with its own seats and host pool.

    engine = DataParallelEngine(params, config, seats=8, offload=OffloadConfig(...),
                                devices=jax.local_devices(), placement="least_misses")
    rid = engine.add_request(prompt_ids, max_tokens=64)   # placed on one rank, for good
    while engine.has_unfinished():
        for out in engine.step():        # every rank steps at once; the union of outputs
            ...
    engine.imbalance()                   # rows copied per rank, the step's max / mean

Each rank is a whole `fo_jax.engine.Engine` (same arguments) committed to its device, weights
and host pool included. `add_request` places a request on one rank for good, by the
`placement` rule of `fo_jax.placement` ("round_robin", "least_requests", "least_context",
"least_misses"; default least_misses offloaded, least_context resident; an unknown rule, or
least_misses on the resident path, raises `ValueError`). `step()` steps every rank with work at
once, one thread per rank, and returns the union of their outputs; `counters` sums the ranks'.

Contracts: nothing crosses devices, so a request's tokens are those of one `Engine` (same
drafter) serving it alone, bit for bit. Costs: placement O(R + requests placed) on the host per
`add_request`; memory and compiles are R times one engine's. Rationale, the rules and drafts per
rank: docs/guides/many-devices.md, "Data-parallel serving"; the figures:
docs/benchmarks/rank-imbalance.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from typing import Sequence

import jax
import numpy as np

from fo_jax import placement as placement_rules
from fo_jax.engine.engine import Engine, RequestOutput, claim_request_id

PLACEMENTS = placement_rules.RULES


@dataclasses.dataclass
class _Placed:
    """Where a request went and what its cost is (host bookkeeping)."""

    rank: int
    prompt_len: int
    generated: int = 0
    finished: bool = False


class DataParallelEngine:
    """`Engine`s on R devices behind one request stream (see the module doc).

    Args:
      params, config: the model; the weights are copied to every device.
      devices: [R] the ranks' devices (default: every local device); a device listed twice
        holds two ranks (they share its memory and take turns on it: for tests).
      placement: a rule of `fo_jax.placement.RULES`, or None for the default (least_misses
        offloaded, least_context resident).
      **engine_kwargs: `Engine`'s arguments (seats, capacity, offload, ...), for every rank:
        `seats` and `num_pages` are per rank; `mtp` (the MTP parameters) is copied to every
        device, as the weights are. `metrics_path` is not supported (one log per engine:
        read `counters` / `imbalance()` instead). The ranks run without overlap (overlap is
        set False: the ranks' steps already run side by side, and the placement reads each
        step's offload statistics).
    Raises:
      ValueError: bad devices or placement, and every `Engine` refusal, before anything is
        allocated on a second device.
    """

    def __init__(self, params, config, *, devices: Sequence[jax.Device] | None = None,
                 placement: str | None = None, **engine_kwargs):
        devices = list(jax.local_devices() if devices is None else devices)
        if not devices:
            raise ValueError("devices=[] holds no rank: give at least one device (default: "
                             "jax.local_devices())")
        bad = [d for d in devices if not isinstance(d, jax.Device)
               or d.process_index != jax.process_index()]
        if bad:
            raise ValueError(f"devices must be this process's jax devices "
                             f"(jax.local_devices()), got {bad[0]!r}")
        settings = engine_kwargs.get("settings")  # an EngineSettings, or its flat keywords
        offloaded = (engine_kwargs.get("offload") if settings is None
                     else settings.cache.offload) is not None
        if placement is None:
            placement = "least_misses" if offloaded else "least_context"
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is not a placement rule; choose one of "
                             f"{PLACEMENTS} (fo_jax.placement)")
        if placement == "least_misses" and not offloaded:
            raise ValueError("placement='least_misses' needs the offloaded path (an "
                             "OffloadConfig): the resident path copies no misses; use "
                             "'least_context'")
        if (engine_kwargs.get("metrics_path") if settings is None
                else settings.metrics.path) is not None:
            raise ValueError("metrics_path is not supported by DataParallelEngine (one log per "
                             "engine); read counters, stats and imbalance() instead")
        # The ranks run without overlap: their steps already run side by side (one thread per
        # rank), and the placement reads each step's offload statistics as of that step.
        if settings is not None:
            engine_kwargs["settings"] = dataclasses.replace(
                settings, scheduler=dataclasses.replace(settings.scheduler, overlap=False))
        else:
            engine_kwargs["overlap"] = False
        self.devices, self.placement = devices, placement
        self.engines: list[Engine] = []
        mtp = engine_kwargs.pop("mtp", None)
        on_device = {}  # device: (weights, MTP parameters or None), one copy per device
        for device in devices:
            with jax.default_device(device):
                if device not in on_device:
                    on_device[device] = (jax.device_put(params, device),
                                         _arrays_to(mtp, device))
                rank_params, rank_mtp = on_device[device]
                self.engines.append(Engine(rank_params, config, mtp=rank_mtp,
                                           **engine_kwargs))
        first = self.engines[0]
        self.config, self.offload, self.tokenizer = first.config, first.offload, first.tokenizer
        self.capacity, self.chunk, self.n_steps = first.capacity, first.chunk, first.n_steps
        self.seats_per_rank = first.seats
        self.seats = first.seats * len(devices)  # every rank's seats (the driver's bound)
        self.pool = first.pool  # rank 0's (None resident); every rank has its own: pools
        self.metrics = None
        self._placed: dict[str, _Placed] = {}
        self._ids = itertools.count()
        self._turn = 0
        self._misses = placement_rules.MissEstimates(  # least_misses's costs (offloaded)
            hot_slots=self.offload.hot_slots, topk=self.config.index_topk) if offloaded else None
        self._union_seen = [None] * len(devices)  # [B] union rows counted so far per rank
        self._executor = None if len(devices) == 1 else concurrent.futures.ThreadPoolExecutor(
            max_workers=len(devices), thread_name_prefix="fo-jax-rank")
        self._closed = False
        self.reset_figures()

    # Requests ------------------------------------------------------------------------------

    @property
    def ranks(self) -> int:
        return len(self.engines)

    @property
    def pools(self) -> list:
        """Each rank's `PagePool` (None on the resident path)."""
        return [e.pool for e in self.engines]

    def add_request(self, prompt: Sequence[int], *, request_id: str | None = None,
                    rank: int | None = None, **kwargs) -> str:
        """Place a request on a rank (the placement rule, on the ranks' current loads; or
        `rank`, for warm-ups) and queue it there; returns its id, unique over the ranks.
        kwargs: `Engine.add_request`'s. Refusals are the rank engine's own (every rank has the
        same settings, so a request one refuses, all refuse) and leave every rank as it was.
        O(R + requests)."""
        prompt = list(prompt)
        if rank is not None and (not isinstance(rank, int) or not 0 <= rank < self.ranks):
            raise ValueError(f"rank={rank!r} must be an int in [0, R = {self.ranks}) or None "
                             "(placed by the rule)")
        request_id = claim_request_id(request_id, self._ids, self._placed)
        turn = self._turn
        if rank is None:
            rank, turn = self.choose_rank(len(prompt))
        with jax.default_device(self.devices[rank]):
            rid = self.engines[rank].add_request(prompt, request_id=request_id, **kwargs)
        self._turn = turn
        self._placed[rid] = _Placed(rank, len(prompt))
        self.placed_per_rank[rank] += 1
        return rid

    def choose_rank(self, prompt_len: int) -> tuple[int, int]:
        """(the rank a new request of `prompt_len` tokens would go to now, round robin's next
        turn), by the placement rule on the ranks' loads. Changes nothing. O(R + requests)."""
        free = [max(e.seats - e.num_running() - e.num_waiting(), 0) for e in self.engines]
        if not any(free):  # every seat taken or promised: it waits on one of the ranks
            free = [1] * self.ranks
        load = self.rank_loads()
        ranks, turn = placement_rules.assign(self.placement, [self._cost(None, prompt_len)],
                                             load=load, free=free, turn=self._turn)
        return ranks[0], turn

    def rank_loads(self) -> list[float]:
        """[R] each rank's load in the placement rule's unit: the sum of its unfinished
        requests' costs (requests for least_requests and round_robin, tokens for
        least_context, expected rows copied per step for least_misses). O(requests)."""
        load = [0.0] * self.ranks
        for rid, p in self._placed.items():
            if not p.finished:
                load[p.rank] += self._cost(rid, p.prompt_len + p.generated)
        return load

    def _cost(self, request_id: str | None, context: int) -> float:
        if self.placement in ("round_robin", "least_requests"):
            return 1.0
        if self.placement == "least_context":
            return float(context)
        return self._misses.cost(request_id, context)

    def rank_of(self, request_id: str) -> int:
        """The rank a request was placed on (KeyError for an unknown id)."""
        placed = self._placed.get(request_id)
        if placed is None:
            raise KeyError(f"no request {request_id!r}")
        return placed.rank

    def cancel(self, request_id: str) -> bool:
        """Stop a request now (`Engine.cancel` on its rank); False if it had finished."""
        rank = self.rank_of(request_id)
        with jax.default_device(self.devices[rank]):  # a freed seat's arrays stay on it
            stopped = self.engines[rank].cancel(request_id)
        self._placed[request_id].finished = True
        return stopped

    def release(self, request_id: str) -> RequestOutput:
        """Forget a finished request (`Engine.release` on its rank); its final output."""
        rank = self.rank_of(request_id)
        with jax.default_device(self.devices[rank]):
            out = self.engines[rank].release(request_id)
        del self._placed[request_id]
        if self._misses is not None:
            self._misses.forget(request_id)
        return out

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def num_waiting(self) -> int:
        return sum(e.num_waiting() for e in self.engines)

    def num_running(self) -> int:
        return sum(e.num_running() for e in self.engines)

    def waiting_ids(self) -> list[str]:
        """Waiting requests, rank by rank (each rank's in its admission order)."""
        return [rid for e in self.engines for rid in e.waiting_ids()]

    def rank_pool_occupancy(self) -> list[dict] | None:
        """[R] each rank's `Engine.pool_occupancy()`; None on the resident path."""
        if self.pool is None:
            return None
        return [e.pool_occupancy() for e in self.engines]

    def pool_occupancy(self) -> dict | None:
        """Pages of every rank's pools summed (free, held, cached, total); None resident."""
        per_rank = self.rank_pool_occupancy()
        if per_rank is None:
            return None
        return {k: sum(p[k] for p in per_rank) for k in per_rank[0]}

    def device_bytes_used(self) -> list[int | None]:
        """[R] each rank's `Engine.device_bytes_used()` (a budget is per device)."""
        return [e.device_bytes_used() for e in self.engines]

    # Figures -------------------------------------------------------------------------------

    @property
    def counters(self) -> dict:
        """Every rank's `Engine.counters` summed ("steps": this engine's own steps)."""
        out = {k: sum(e.counters[k] for e in self.engines) for k in self.engines[0].counters}
        out["steps"] = self._steps
        return out

    @property
    def stats(self):
        """The ranks' offload statistics (`LoopStats`, as numpy) side by side on the seat axis
        ([G, R B, W], [G, R B], [R B]): rank r's seats are r B ... r B + B - 1. None before
        any rank decoded (or resident). One device-to-host read per rank."""
        got = [None if e.stats is None else jax.device_get(e.stats) for e in self.engines]
        some = next((s for s in got if s is not None), None)
        if some is None:
            return None
        got = [jax.tree.map(np.zeros_like, some) if s is None else s for s in got]
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=1 if xs[0].ndim >= 2 else 0),
                            *got)

    def rank_misses(self) -> list[int]:
        """[R] rows each rank copied from its host pool since the last `reset_figures` (its
        seats' miss unions, summed over indexer groups and steps); zeros resident."""
        return [int(x) for x in self._rank_misses]

    def imbalance(self) -> dict:
        """How unevenly the ranks copied: rows per rank, requests placed per rank, and the
        spread, sum over steps of the largest rank's rows / sum of the mean rank's (1.0: even;
        R: one rank copied all; the step time follows the largest rank)."""
        mean = self._sum_mean
        return {"placement": self.placement, "rank_misses": self.rank_misses(),
                "placed_per_rank": list(self.placed_per_rank), "steps": self._steps,
                "max_over_mean": self._sum_max / mean if mean else None}

    def reset_figures(self) -> None:
        """Zero every rank's counters, timings and statistics, and the imbalance figures
        (a benchmark's warm-up left out)."""
        for e in self.engines:
            e.timings = dict.fromkeys(e.timings, 0.0)
            e.counters = dict.fromkeys(e.counters, 0)
            e.stats = None
        self._union_seen = [None] * self.ranks
        self._rank_misses = np.zeros(self.ranks, np.int64)
        self._sum_max = self._sum_mean = 0.0
        self._steps = 0
        self.placed_per_rank = [0] * self.ranks
        # Wall seconds: step_s of `step` (every rank at once); prefill_s / decode_s the
        # slowest rank's per step (what the step waited for).
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "step_s": 0.0}

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Step every rank that has work, at once (one thread per rank); the union of their
        outputs. An exception in one rank is raised after every rank's step has ended (the
        engine is then in an undefined state, as an `Engine` is after a failed step)."""
        if self._closed:
            raise RuntimeError("this DataParallelEngine was closed: it cannot step")
        start = time.perf_counter()
        if self._executor is None:
            results = [self._step_rank(0)]
        else:
            futures = [self._executor.submit(self._step_rank, r) for r in range(self.ranks)]
            concurrent.futures.wait(futures)
            results = [f.result() for f in futures]
        outputs, copied = [], np.zeros(self.ranks, np.int64)
        for r, (outs, rank_rows, rows, _) in enumerate(results):
            outputs += outs
            copied[r] = rank_rows
            for rid, n in rows.items():
                self._observe(rid, n)
            for out in outs:
                placed = self._placed.get(out.request_id)
                if placed is not None:
                    placed.generated = len(out.token_ids)
                    placed.finished = placed.finished or out.finished
        for k in ("prefill_s", "decode_s"):
            self.timings[k] += max(s[k] for *_, s in results)
        self._rank_misses += copied
        self._sum_max += float(copied.max())
        self._sum_mean += float(copied.mean())
        self._steps += 1
        self.timings["step_s"] += time.perf_counter() - start
        return outputs

    def _step_rank(self, r: int):
        """Rank r's step in the calling thread, with its device as the default: (outputs,
        rows its seats copied in the step, {request id: rows its seat copied}, {timing:
        seconds in the step}). A request admitted and finished within the step has no seat
        before or after it: its rows count for the rank, not for its estimate."""
        engine = self.engines[r]
        if not engine.has_unfinished():
            return [], 0, {}, {"prefill_s": 0.0, "decode_s": 0.0}
        before = dict(engine.timings)
        seated = _seat_ids(engine)
        with jax.default_device(self.devices[r]):
            outs = engine.step()
        copied, rows = 0, {}
        if engine.stats is not None:
            union = np.asarray(engine.stats.union).sum(axis=0)  # [B]; the step has synced
            seen = self._union_seen[r]
            new = union if seen is None or np.any(union < seen) else union - seen
            self._union_seen[r] = union
            copied = int(new.sum())
            after, decoding = _seat_ids(engine), engine.decoding_seats()
            for b, n in enumerate(new):
                rid = after[b] or seated[b]
                if rid is not None and n:
                    rows[rid] = int(n)
            for b, rid in enumerate(after):  # decoding, copied nothing: an observation too
                if rid is not None and rid not in rows and decoding[b]:
                    rows[rid] = 0
        return outs, copied, rows, {k: engine.timings[k] - before[k]
                                    for k in ("prefill_s", "decode_s")}

    def _observe(self, request_id: str, rows: int) -> None:
        """least_misses: fold one step's rows of a request into its estimate and the prior's
        calibration."""
        placed = self._placed.get(request_id)
        if placed is None or self.placement != "least_misses":
            return
        self._misses.observe(request_id, placed.prompt_len + placed.generated, rows)

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; the final output of each request."""
        while self.has_unfinished():
            self.step()
        out = {}
        for device, e in zip(self.devices, self.engines):
            with jax.default_device(device):
                out.update(e.run())
        return out

    def close(self) -> None:
        """Stop the rank threads (the engine cannot step afterwards)."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _arrays_to(tree, device: jax.Device):
    """`tree` with its array leaves (jax or numpy) copied to `device`; its other leaves (None,
    or what the `Engine` refuses with its own message) as they are."""
    return jax.tree.map(lambda x: jax.device_put(x, device)
                        if isinstance(x, (jax.Array, np.ndarray)) else x, tree)


def _seat_ids(engine: Engine) -> list[str | None]:
    """[B] the request id in each seat of `engine` (None: empty). Reads the engine's seat
    table (`Engine.seat_request_ids`): the offload statistics are per seat."""
    return engine.seat_request_ids()


__all__ = ["PLACEMENTS", "DataParallelEngine"]

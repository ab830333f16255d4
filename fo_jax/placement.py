"""Placement of new requests on data-parallel ranks: which rank's seat each request takes.

With data-parallel decode every rank copies its own requests' misses from its own host pool,
and the step ends when the slowest rank ends: the rank with the most misses sets the step
time. A request stays on the
rank it was placed on until it finishes, so placement is the one point where the scheduler can
spread the misses. Rules (R ranks, n requests placed at once):

    round_robin     the next rank with a free seat after the previous pick (what a naive
                    engine does; ignores the requests and the ranks' loads)
    least_requests  the rank running the fewest requests
    least_context   the rank whose running requests hold the fewest context tokens; a
                    request's cost is its context length
    least_misses    the rank whose running requests are expected to miss the least per step;
                    a request's cost is its expected misses per step: `expected_misses` from
                    its context before it has run, then the caller's running estimate (e.g.
                    `update_estimate`, an EMA of the misses it reported; `MissEstimates`
                    keeps both for an engine)

The three `least_*` rules place the n requests in decreasing cost, each on the rank of least
load (then most free seats, then lowest index) that still has a seat, and add its cost to that
load: greedy longest-processing-time-first. Everything here is host-side Python on [R] loads
and [n] costs: O(n log n + n R) per call, O(R) for one request; nothing touches device memory.

What each rule buys in simulation (experiments/traces/rank_imbalance.py) and in the engines
(experiments/serving/dp_serving.py; `--engine sharded`: the sharded engine):
docs/benchmarks/rank-imbalance.md.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

RULES = ("round_robin", "least_requests", "least_context", "least_misses")


def expected_misses(context: int, *, hot_slots: int, topk: int, ways: int = 1) -> float:
    """A request's misses per step before it has run: K W (1 - C / S), at least 0.

    The rows a request with S = `context` tokens copies per step (per indexer group) if each
    way's K selections were spread uniformly over its context and its C = `hot_slots` slots
    held C of them: a hit rate of C / S. Locality lowers the real count (a working set that
    fits C hits far more often), so this is usually above the real count, to be scaled or
    replaced by what the request reports once it runs; what it keeps is the order: a longer
    context, more misses. O(1).
    """
    for name, value, low in (("context", context, 0), ("hot_slots", hot_slots, 1),
                             ("topk", topk, 1), ("ways", ways, 1)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise ValueError(f"expected_misses: {name}={value!r} must be an int >= {low} "
                             f"(context tokens, C hot slots, top-k K, ways W)")
    if context <= hot_slots:
        return 0.0
    return float(topk * ways * (1.0 - hot_slots / context))


def update_estimate(estimate: float, observed: float, *, weight: float = 0.05) -> float:
    """The running miss estimate of a request after a step that copied `observed` rows:
    weight * observed + (1 - weight) * estimate (an EMA). O(1).

    The default keeps a long memory: a request's misses come in bursts (its focus moves, a
    tail block leaves the tail) and a placement wants its mean; in
    experiments/traces/rank_imbalance.py weight 0.25 followed the bursts and placed worse than round
    robin on topic-shift requests, 0.05 did not.
    """
    if not 0 < weight <= 1:
        raise ValueError(f"update_estimate: {weight=} must be in (0, 1] (the newest step's "
                         "share of the estimate)")
    if not math.isfinite(observed) or observed < 0:
        raise ValueError(f"update_estimate: {observed=} must be a finite count >= 0 (rows "
                         "copied in one step)")
    return weight * observed + (1.0 - weight) * estimate


class MissEstimates:
    """least_misses's request costs, the bookkeeping an engine keeps from the rows its
    requests copy: a request that has run costs its running estimate (`update_estimate` of
    the rows its seat copied, step by step); one that has not, its `expected_misses` scaled
    by the calibration of that prior so far (rows observed / rows the prior predicted for the
    same request steps; 1 before any). Host-side; O(1) per call.

    Args:
      hot_slots, topk: the prior's C and K (`expected_misses`).
      weight: the estimate's EMA weight (`update_estimate`).
    """

    def __init__(self, *, hot_slots: int, topk: int, weight: float = 0.05):
        self.hot_slots, self.topk, self.weight = hot_slots, topk, weight
        self.estimates: dict[str, float] = {}  # request id: its EMA, once it ran
        self.observed = self.predicted = 0.0  # the prior's calibration

    def prior(self, context: int) -> float:
        """`expected_misses` of a request with `context` tokens, uncalibrated."""
        return expected_misses(context, hot_slots=self.hot_slots, topk=self.topk)

    def cost(self, request_id: str | None, context: int) -> float:
        """The request's expected rows per step: its estimate once it ran, else the
        calibrated prior of its `context` (a request not placed yet: request_id None)."""
        estimate = self.estimates.get(request_id)
        if estimate is not None:
            return estimate
        scale = self.observed / self.predicted if self.predicted else 1.0
        return scale * self.prior(context)

    def observe(self, request_id: str, context: int, rows: int) -> None:
        """Fold one step's `rows` copied by the request (of `context` tokens) into its
        estimate (starting from its cost: one step is a burst or less) and the
        calibration."""
        start = self.cost(request_id, context)
        self.estimates[request_id] = update_estimate(start, rows, weight=self.weight)
        self.observed += rows
        self.predicted += self.prior(context)

    def forget(self, request_id: str) -> None:
        """Drop a request's estimate (it finished or was released)."""
        self.estimates.pop(request_id, None)


def assign(rule: str, costs: Sequence[float], *, load: Sequence[float], free: Sequence[int],
           turn: int = 0) -> tuple[list[int], int]:
    """The rank of each of n new requests under `rule`, and the next round-robin turn.

    Args:
      rule: one of RULES.
      costs: [n] each request's cost in the unit of `load` (its context length for
        least_context, its expected misses per step for least_misses; ignored by round_robin
        and least_requests, which count requests).
      load: [R] each rank's current load, the sum of its running requests' costs (running
        requests for least_requests). Not modified.
      free: [R] free seats per rank (>= 0). A rank with no free seat takes no request.
      turn: [] round_robin's cursor: the first rank it tries (the turn returned by the
        previous call); ignored by the other rules, which return it unchanged.

    Returns:
      ([n] ranks, -1 for a request that found no free seat (it waits for a later call), and
      round_robin's next turn). Requests are placed in order for round_robin (first come,
      first seated) and by decreasing cost for the others (ties: in order); the ranks are
      listed in the requests' order either way.
    """
    if rule not in RULES:
        raise ValueError(f"unknown placement rule {rule!r}; choose one of {RULES}")
    ranks = _check(costs, load, free)
    if not isinstance(turn, numbers.Integral) or not 0 <= turn < ranks:
        raise ValueError(f"{turn=} must be an int in [0, R = {ranks}): pass the turn the "
                         "previous call returned (0 at the start)")
    free = list(free)
    out = [-1] * len(costs)
    if rule == "round_robin":
        for i in range(len(costs)):
            for step in range(ranks):
                r = (turn + step) % ranks
                if free[r]:
                    out[i], free[r], turn = r, free[r] - 1, (r + 1) % ranks
                    break
        return out, turn
    load = [float(x) for x in load]
    if rule == "least_requests":
        costs = [1.0] * len(costs)
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    for i in order:
        open_ranks = [r for r in range(ranks) if free[r]]
        if not open_ranks:
            break
        r = min(open_ranks, key=lambda q: (load[q], -free[q], q))
        out[i], free[r] = r, free[r] - 1
        load[r] += costs[i]
    return out, turn


def _check(costs, load, free) -> int:
    """Raise ValueError unless costs [n], load [R] and free [R] are well formed; return R."""
    ranks = len(load)
    if ranks < 1 or len(free) != ranks:
        raise ValueError(f"load and free must both be [R] with R >= 1 (one entry per "
                         f"data-parallel rank), got {len(load)} loads and {len(free)} free "
                         "seat counts")
    bad = [r for r in range(ranks) if not isinstance(free[r], numbers.Integral) or free[r] < 0]
    if bad:
        raise ValueError(f"free[{bad[0]}] = {free[bad[0]]!r}: free seats must be ints >= 0")
    bad = [r for r in range(ranks) if not math.isfinite(load[r]) or load[r] < 0]
    if bad:
        raise ValueError(f"load[{bad[0]}] = {load[bad[0]]!r}: a rank's load must be finite and "
                         ">= 0 (the sum of its running requests' costs)")
    bad = [i for i, c in enumerate(costs) if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"costs[{bad[0]}] = {costs[bad[0]]!r}: a request's cost must be finite "
                         "and >= 0 (its context length or expected misses per step)")
    return ranks


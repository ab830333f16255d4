"""Placement of new requests on data-parallel ranks (fo_jax.placement)."""

import itertools
import random

import numpy as np
import pytest

from fo_jax import placement


def test_round_robin_cycles_and_skips_full_ranks():
    ranks, turn = placement.assign("round_robin", [5.0] * 5, load=[0, 0, 0], free=[2, 0, 4])
    assert ranks == [0, 2, 0, 2, 2] and turn == 0
    # The cursor carries over; costs and loads do not matter.
    ranks, turn = placement.assign("round_robin", [1e9, 0.0], load=[99, 0, 0], free=[1, 1, 1],
                                   turn=2)
    assert ranks == [2, 0] and turn == 1


def test_no_free_seat_leaves_requests_waiting():
    for rule in placement.RULES:
        ranks, turn = placement.assign(rule, [3.0, 1.0, 2.0], load=[0, 0], free=[1, 0])
        assert sorted(ranks) == [-1, -1, 0] and turn in (0, 1)
    # The balancing rules seat the most expensive request first.
    ranks, _ = placement.assign("least_misses", [3.0, 1.0, 2.0], load=[0, 0], free=[1, 0])
    assert ranks == [0, -1, -1]


def test_least_load_is_greedy_largest_first():
    # Loads 10 / 0 / 4; costs 7, 1, 5: 7 -> rank 1 (0), 5 -> rank 2 (4), 1 -> rank 1 (7 < 9).
    ranks, turn = placement.assign("least_context", [7.0, 1.0, 5.0], load=[10, 0, 4],
                                   free=[3, 3, 3], turn=1)
    assert ranks == [1, 1, 2] and turn == 1
    # Ties go to the rank with more free seats, then the lower index.
    ranks, _ = placement.assign("least_misses", [0.0, 0.0, 0.0], load=[0, 0, 0],
                                free=[1, 3, 3])
    assert ranks == [1, 2, 1]
    # least_requests counts requests: the load is the number running.
    ranks, _ = placement.assign("least_requests", [100.0, 1.0], load=[2, 1, 1],
                                free=[2, 3, 3])
    assert ranks == [1, 2]


def test_numpy_inputs():
    ranks, turn = placement.assign("least_misses", np.array([2.0, 1.0]),
                                   load=np.array([3.0, 0.0, 1.0]), free=np.array([1, 1, 1]),
                                   turn=np.int64(2))
    assert ranks == [1, 2] and turn == 2
    assert placement.expected_misses(np.int32(2048), hot_slots=1024, topk=64) == 32.0


def test_least_load_is_within_the_greedy_bound():
    """On random loads and costs, greedy placement of one request leaves the least maximum load
    any choice could, and of several a maximum at most the optimum plus the largest cost."""
    rng = random.Random(0)
    for _ in range(60):
        r = rng.randint(1, 6)
        load = [rng.uniform(0, 50) for _ in range(r)]
        costs = [rng.uniform(0, 30) for _ in range(rng.randint(1, 8))]
        free = [len(costs)] * r
        ranks, _ = placement.assign("least_misses", costs, load=load, free=free)
        after = list(load)
        for i, q in enumerate(ranks):
            after[q] += costs[i]
        if len(costs) == 1:
            assert max(after) == min(max(load[:q] + [load[q] + costs[0]] + load[q + 1:])
                                     for q in range(r))
        # The best of the first 500 assignments (at least the optimum).
        best = min(max(load[q] + sum(c for c, x in zip(costs, pick) if x == q)
                       for q in range(r))
                   for pick in itertools.islice(itertools.product(range(r),
                                                                  repeat=len(costs)), 500))
        assert max(after) <= best + max(costs) + 1e-9


def test_expected_misses_and_estimate():
    assert placement.expected_misses(1024, hot_slots=1024, topk=64) == 0.0
    # K W (1 - C / S) = 64 * 2 * (1 - 1024 / 4096) = 96.
    assert placement.expected_misses(4096, hot_slots=1024, topk=64, ways=2) == 96.0
    assert placement.update_estimate(10.0, 20.0, weight=0.25) == 12.5
    assert placement.update_estimate(10.0, 20.0, weight=1.0) == 20.0


def test_miss_estimates_calibrate_the_prior_then_follow_each_request():
    est = placement.MissEstimates(hot_slots=1024, topk=64, weight=0.25)
    # Nothing observed: a request costs its prior, K (1 - C / S) = 64 * 0.75 = 48.
    assert est.cost(None, 4096) == est.cost("a", 4096) == est.prior(4096) == 48.0
    est.observe("a", 4096, 24)  # from its cost: 0.25 * 24 + 0.75 * 48 = 42
    assert est.cost("a", 4096) == 42.0 and (est.observed, est.predicted) == (24.0, 48.0)
    # Another request's prior is scaled by observed / predicted = 24 / 48.
    assert est.cost("b", 2048) == 0.5 * est.prior(2048) == 16.0
    est.observe("b", 2048, 0)  # 0.75 * 16 = 12; the calibration is now 24 / 80
    assert est.cost("b", 2048) == 12.0 and est.cost(None, 4096) == pytest.approx(14.4)
    est.forget("a")
    assert est.cost("a", 4096) == pytest.approx(14.4) and "a" not in est.estimates
    est.forget("a")  # forgetting twice is harmless


@pytest.mark.parametrize("call, message", [
    (lambda: placement.assign("fastest", [1.0], load=[0], free=[1]),
     "unknown placement rule 'fastest'; choose one of ('round_robin', 'least_requests', "
     "'least_context', 'least_misses')"),
    (lambda: placement.assign("round_robin", [1.0], load=[0, 0], free=[1]),
     "load and free must both be [R] with R >= 1 (one entry per data-parallel rank), got 2 "
     "loads and 1 free seat counts"),
    (lambda: placement.assign("round_robin", [1.0], load=[], free=[]),
     "load and free must both be [R] with R >= 1 (one entry per data-parallel rank), got 0 "
     "loads and 0 free seat counts"),
    (lambda: placement.assign("least_context", [1.0], load=[0, 0], free=[1, -1]),
     "free[1] = -1: free seats must be ints >= 0"),
    (lambda: placement.assign("least_context", [1.0], load=[0, float("nan")], free=[1, 1]),
     "load[1] = nan: a rank's load must be finite and >= 0 (the sum of its running requests' "
     "costs)"),
    (lambda: placement.assign("least_context", [1.0, -2.0], load=[0], free=[1]),
     "costs[1] = -2.0: a request's cost must be finite and >= 0 (its context length or "
     "expected misses per step)"),
    (lambda: placement.assign("round_robin", [1.0], load=[0, 0], free=[1, 1], turn=2),
     "turn=2 must be an int in [0, R = 2): pass the turn the previous call returned (0 at the "
     "start)"),
    (lambda: placement.expected_misses(4096, hot_slots=0, topk=64),
     "expected_misses: hot_slots=0 must be an int >= 1 (context tokens, C hot slots, top-k K, "
     "ways W)"),
    (lambda: placement.update_estimate(1.0, 2.0, weight=0.0),
     "update_estimate: weight=0.0 must be in (0, 1] (the newest step's share of the estimate)"),
    (lambda: placement.update_estimate(1.0, -1.0),
     "update_estimate: observed=-1.0 must be a finite count >= 0 (rows copied in one step)"),
], ids=["rule", "lengths", "no-ranks", "free", "load", "cost", "turn", "hot-slots", "weight",
        "observed"])
def test_errors_say_what_was_expected(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message

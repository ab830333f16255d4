"""The rank-imbalance study's smoke run (every mix and placement rule, JSON lines, a table) and
its lookahead rule `fill`."""

import json

from fo_jax import placement


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "rank_imbalance.jsonl"
    study = load_experiment("rank_imbalance")
    rows = study.main(["--smoke", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # 3 mixes x 1 load x (every rule, the lookahead rule and the oracle).
    rules = placement.RULES + ("least_misses_lookahead", "oracle_mean")
    assert len(lines) == len(rows) == 3 * len(rules)
    assert {(r["mix"], r["rule"]) for r in lines} == {
        (m, rule) for m in ("contexts", "kinds", "both") for rule in rules}
    for r in lines:
        # The maximum over ranks is at least the mean.
        assert r["max_rank_misses_per_step"] >= r["misses_per_rank_step"] > 0
        assert r["spread"] >= 1 and r["free_moves_spread"] >= 1
        assert r["excess_p99"] >= r["excess_p50"] >= 0
        assert 0 < r["running_per_rank"] <= r["seats"] and r["steps_measured"] == 100
    # Seating first come first served, every rule runs the same requests at the same steps:
    # only their ranks differ. The lookahead seats other requests first.
    for mix in ("contexts", "kinds", "both"):
        assert len({r["misses_per_rank_step"] for r in lines if r["mix"] == mix and
                    r["rule"] != "least_misses_lookahead"}) == 1
    printed = capsys.readouterr().out
    assert "| contexts | 0.80 | least_misses |" in printed
    # The tables again from the JSON lines: the same text (past the run's "library: ..." line).
    assert study.main(["--table", str(out)]) == lines
    assert capsys.readouterr().out == printed.split("\n", 1)[1]


def test_fill_with_no_more_requests_than_seats_is_least_misses(load_experiment):
    fill = load_experiment("rank_imbalance").fill
    costs, load, free = [3.0, 9.0, 1.0], [5.0, 0.0, 2.0], [1, 2, 1]
    want, _ = placement.assign("least_misses", costs, load=load, free=free)
    assert fill(costs, load=load, free=free, lookahead=4) == want == [2, 1, 0]


def test_fill_picks_the_request_that_evens_the_loads(load_experiment):
    fill = load_experiment("rank_imbalance").fill
    # One seat free, at the light rank: T = (550 + 1 * mean(10, 50, 90)) / 3 = 200; rank 2
    # wants 200 - 150 = 50: the second request.
    load, free = [200.0, 200.0, 150.0], [0, 0, 1]
    assert fill([10.0, 50.0, 90.0], load=load, free=free, lookahead=2) == [-1, 2, -1]
    # No lookahead, or the head forced: first come, first seated.
    assert fill([10.0, 50.0, 90.0], load=load, free=free, lookahead=0) == [2, -1, -1]
    assert fill([10.0, 50.0, 90.0], load=load, free=free, lookahead=2, forced=1) == [2, -1, -1]
    # Two seats: rank 1 (load 0) first: T = (100 + 2 * 51.25) / 2, it wants 101.25 -> 100;
    # then rank 0: T = (200 + 35) / 2, it wants 17.5 -> 5.
    assert fill([5.0, 40.0, 60.0, 100.0], load=[100.0, 0.0], free=[1, 1],
                lookahead=2) == [0, -1, -1, 1]

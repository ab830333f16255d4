"""The rank-imbalance study's smoke run: every mix and placement rule, JSON lines, a table."""

import json

from fo_jax import placement


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "rank_imbalance.jsonl"
    rows = load_experiment("rank_imbalance").main(["--smoke", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # 3 mixes x 1 load x every rule.
    assert len(lines) == len(rows) == 3 * len(placement.RULES)
    assert {(r["mix"], r["rule"]) for r in lines} == {
        (m, rule) for m in ("contexts", "kinds", "both") for rule in placement.RULES}
    for r in lines:
        # The maximum over ranks is at least the mean; every rule copies the same rows.
        assert r["max_rank_misses_per_step"] >= r["misses_per_rank_step"] > 0
        assert r["spread"] >= 1 and r["excess_p99"] >= r["excess_p50"] >= 0
        assert 0 < r["running_per_rank"] <= r["seats"] and r["steps_measured"] == 100
    for mix in ("contexts", "kinds", "both"):
        assert len({r["misses_per_rank_step"] for r in lines if r["mix"] == mix}) == 1
    printed = capsys.readouterr().out
    assert "| contexts | 0.80 | least_misses |" in printed

"""The trace-replay study's smoke run: every policy and budget, JSON lines, a plot."""

import json

from fo_jax import replay


def test_smoke_and_plot(load_experiment, tmp_path):
    out = tmp_path / "replay.jsonl"
    rows = load_experiment("replay").main(["--smoke", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # 2 synthetic traces x 2 budgets (C = k is below k W = 2 k) x every policy.
    assert len(lines) == len(rows) == 2 * 2 * len(replay.POLICIES)
    assert {r["policy"] for r in lines} == set(replay.POLICIES)
    for r in lines:
        assert 0 <= r["hit_rate"] <= 1 and r["ratio_to_belady"] >= 1
        assert r["h2d_bytes_per_token"] == r["misses_per_request_group_step"] * 78 * 1152 / 2
        assert len(r["union_per_step"]) == r["steps"] and "prefetch_covered_fraction" in r
    png = tmp_path / "replay.png"
    load_experiment("plot_replay").main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0

"""The eviction-policy experiment's smoke run: every policy (one compiled decode step each) at
the tightest budget, JSON lines, a plot."""

import json


def test_smoke_and_plot(load_experiment, tmp_path):
    out = tmp_path / "eviction.jsonl"
    rows = load_experiment("eviction_policies").main(["--smoke", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 3
    assert {r["policy"] for r in lines} == {"ring", "lru", "random"}
    for r in lines:
        assert r["hot_slots"] == 16 * 2  # k * W of the tiny model, W = 2
        assert 0 <= r["hit_rate"] <= 1 and r["misses_per_request_group_step"] >= 0
    png = tmp_path / "eviction.png"
    load_experiment("plot_eviction_policies").main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0

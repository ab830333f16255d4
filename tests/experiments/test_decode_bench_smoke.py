"""The decode benchmark's smoke mode runs and reports both questions as JSON lines."""

import json


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    rows = load_experiment("decode_bench").main(["--smoke", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "management per step" in printed and "whole decode step" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 2 * 3 + 1
    management = [r for r in lines if r["question"] == "management"]
    assert {r["policy"] for r in management} == {"ring", "lru"}
    assert all(r["seconds"] > 0 for r in management)
    assert all(r["jax"] and r["backend"] and r["git"] for r in lines)
    step = [r for r in lines if r["question"] == "step"][0]
    assert step["ratio"] > 0 and 0 <= step["hit_rate"] <= 1
    png = tmp_path / "bench.png"
    load_experiment("plot_decode_bench").main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0

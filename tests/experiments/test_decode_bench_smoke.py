"""The decode benchmark's smoke mode runs and reports both questions as JSON lines."""

import json

import numpy as np
import pytest


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    rows = load_experiment("decode_bench").main(
        ["--smoke", "--policy", "ring", "clock", "--host-access", "ffi", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "management per step" in printed and "whole decode step" in printed
    assert "host_access ffi" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # 3 policies x 2 hot-cache sizes; the step: 2 policies x 2 workloads (locality, uniform).
    assert len(lines) == len(rows) == 3 * 2 + 2 * 2
    management = [r for r in lines if r["question"] == "management"]
    assert {(r["policy"], r["hot_slots"]) for r in management} == {
        (p, c) for p in ("ring", "clock", "lru") for c in (32, 64)}
    assert all(r["seconds"] > 0 for r in management)
    assert all(r["jax"] and r["backend"] and r["git"] for r in lines)
    # Every cell copies the same misses, and is timed over the same interleaved rounds.
    assert len({r["misses_per_step"] for r in management}) == 1
    assert management[0]["misses_per_step"] > 0
    assert all(len(r["round_seconds"]) == r["rounds"] >= 2 for r in management)
    for r in management:
        assert r["seconds_min"] <= r["seconds_q25"] <= r["seconds"] <= r["seconds_q75"] \
            <= r["seconds_max"]
        assert r["ratio_q25"] <= r["ratio"] <= r["ratio_q75"]
        if r["hot_slots"] == min(m["hot_slots"] for m in management):
            assert r["ratio"] == 1.0
    assert "misses per request per step" in printed and "IQR" in printed
    steps = [r for r in lines if r["question"] == "step"]
    assert sorted((r["workload"], r["policy"]) for r in steps) == [
        ("locality", "clock"), ("locality", "ring"), ("uniform", "clock"), ("uniform", "ring")]
    for step in steps:
        assert step["ratio"] > 0 and 0 <= step["hit_rate"] <= 1
        assert step["host_access"] == "ffi" and step["batch"] == 2
        assert step["ratio_q25"] <= step["ratio"] <= step["ratio_q75"]
        assert step["resident_q25"] <= step["resident_s"] <= step["resident_q75"]
        assert step["ratio_to_ring"] > 0
    # Uniform indexer keys leave little locality: fewer hits than the favoured-token workload.
    for policy in ("ring", "clock"):
        by = {r["workload"]: r for r in steps if r["policy"] == policy}
        assert by["uniform"]["hit_rate"] < by["locality"]["hit_rate"]
    # Both policies time the same steps against the same resident run.
    assert len({(r["workload"], r["resident_s"]) for r in steps}) == 2
    assert "hit rate" in printed
    png = tmp_path / "bench.png"
    load_experiment("plot_decode_bench").main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0
    assert np.isfinite([r["ratio"] for r in lines]).all()


def test_management_takes_one_batch(load_experiment, capsys):
    with pytest.raises(SystemExit):
        load_experiment("decode_bench").main(["--what", "both", "--batch", "8", "32"])
    assert ("--batch 8 32: the management benchmark takes one batch (run --what step for "
            "several)") in capsys.readouterr().err

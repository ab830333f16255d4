"""The eviction-policy experiment's smoke run: every policy and budget, JSON lines, a plot."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_and_plot(tmp_path):
    out = tmp_path / "eviction.jsonl"
    rows = _load("eviction_policies").main(["--smoke", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 3 * 2
    assert {r["policy"] for r in lines} == {"ring", "lru", "random"}
    for r in lines:
        assert 0 <= r["hit_rate"] <= 1 and r["misses_per_request_group_step"] >= 0
    png = tmp_path / "eviction.png"
    _load("plot_eviction_policies").main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0

"""The prefetch-distance experiment's smoke mode: model and measurement as JSON lines, a PNG."""

import json
import pathlib

import pytest


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "prefetch.jsonl"
    rows = load_experiment("prefetch_distance").main(["--smoke", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "glm52 @ 128k, chunk 65536, h200:" in printed
    assert "no asynchronous copy engine" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows)
    assert all(r["jax"] and r["backend"] and r["git"] for r in lines)

    model = [r for r in lines if r["kind"] == "model"]
    # glm52, 2 contexts, 2 profiles, 1 chunk size, d in {1, 2} with n = 4.
    assert {(r["distance"], r["num_buffers"]) for r in model} == {(1, 4), (2, 4)}
    assert len(model) == 2 * 2 * 2
    for r in model:
        # The design's bound is a lower bound of the simulated exposure.
        assert r["exposed_load_s"] >= r["bound_exposed_s"] - 1e-9
        assert r["total_s"] == pytest.approx(
            r["no_offload_s"] + r["exposed_load_s"] + r["writeback_tail_s"])

    measured = [r for r in lines if r["kind"] == "measured"]
    # The measurement: resident and one offloaded schedule (d = 2, n = 4).
    assert [(r["path"], r["distance"], r["num_buffers"]) for r in measured] == [
        ("resident", None, None), ("offload", 2, 4)]
    assert all(r["median_s"] > 0 and r["ratio_to_resident"] > 0 for r in measured)

    png = load_experiment("plot_prefetch_distance").main(
        ["--jsonl", str(out), "--out", str(tmp_path / "p.png"), "--chunk", "65536"])
    assert pathlib.Path(png).stat().st_size > 0

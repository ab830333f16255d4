"""experiments/serving/dp_serving.py's smoke run: the DataParallelEngine over a mixed stream, two
ranks on one device, round robin and least_misses: JSON lines, a table, the same tokens
under both rules, every pool empty at the end."""

import json


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "dp_serving.jsonl"
    rows = load_experiment("dp_serving").main(["--smoke", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rule"] for r in lines] == [r["rule"] for r in rows] == [
        "round_robin", "least_misses"]
    for r in lines:
        assert r["ranks"] == 2 and sum(r["placed_per_rank"]) == r["requests"] == 6
        assert r["same_tokens_as_first_rule"] and r["pool_held"] == 0
        assert r["spread"] >= 1 and r["output_tokens"] > 0 and len(r["rank_misses"]) == 2
    assert "| least_misses | [" in capsys.readouterr().out


def test_sharded_smoke(load_experiment, tmp_path, capsys):
    """--engine sharded: the ShardedEngine offloaded (one rank here: this process has one
    device), the same stream under both rules, the rows per rank per step kept."""
    out = tmp_path / "sharded.jsonl"
    rows = load_experiment("dp_serving").main(["--engine", "sharded", "--smoke", "--out",
                                               str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rule"] for r in lines] == [r["rule"] for r in rows] == [
        "round_robin", "least_misses"]
    for r in lines:
        assert r["engine"] == "sharded" and r["ranks"] == 1 and r["placed_per_rank"] == [6]
        assert r["same_tokens_as_first_rule"] and r["pool_held"] == 0
        steps = r["rank_rows_steps"]
        assert len(steps) == r["steps"] and [sum(s) for s in zip(*steps)] == r["rank_misses"]
        assert r["rank_rows_per_step"] == [r["rank_misses"][0] / r["steps"]]
        assert r["spread"] == r["step_spread_mean"] == 1.0 and r["output_tokens"] > 0
    assert "| least_misses | [6] |" in capsys.readouterr().out


def test_per_step_figures(load_experiment):
    figures = load_experiment("dp_serving").per_step_figures([[4, 0], [0, 0], [1, 3]])
    # Steps that copied: 4 / 2 = 2.0 and 3 / 2 = 1.5.
    assert figures["step_spread_mean"] == 1.75 and figures["steps_copying"] == 2
    assert figures["rank_rows_per_step"] == [5 / 3, 1.0]
    assert figures["rank_rows_steps"] == [[4, 0], [0, 0], [1, 3]]

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

"""The decode loop benchmark's smoke mode runs, checks the cells decode the same tokens, and
reports the tokens/s ratio as JSON lines."""

import json


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "loop.jsonl"
    rows = load_experiment("decode_loop_bench").main(["--smoke", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "dispatches/token" in printed and "loop 4" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 2
    by = {r["cell"]: r for r in lines}
    assert by["python"]["ratio"] == 1.0 and by["python"]["dispatches_per_token"] == 1.0
    assert by["loop 4"]["dispatches_per_token"] == 0.25
    assert by["loop 4"]["ratio_q25"] <= by["loop 4"]["ratio"] <= by["loop 4"]["ratio_q75"]
    assert all(r["tokens_per_second"] > 0 and r["jax"] and r["git"] for r in lines)
    assert all(len(r["round_seconds"]) == r["rounds"] for r in lines)

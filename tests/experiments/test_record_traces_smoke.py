"""Real-trace recording's smoke run, then the study on its trace beside synthetic look-alikes."""

import json


def test_record_replay_and_plot(load_experiment, tmp_path, capsys):
    record = tmp_path / "record.jsonl"
    rows = load_experiment("record_traces").main(["--smoke", "--out-dir", str(tmp_path),
                                                  "--jsonl", str(record)])
    traced = [r for r in rows if r["question"] == "trace"]
    assert [r["ways"] for r in traced] == [1, 2]
    assert all(r["replay_exact"] and 0 < r["hit_rate"] <= 1 for r in traced)
    losses = [r for r in rows if r["question"] == "loss_by_position"]
    assert [(r["start"], r["end"]) for r in losses] == [(0, 32), (32, 64), (64, 96)]
    assert sum(r["tokens"] for r in losses) == 2 * 96
    assert len(record.read_text().splitlines()) == len(rows)

    out = tmp_path / "replay.jsonl"
    rows = load_experiment("replay").main(["--smoke", "--trace", str(tmp_path / "ctx96_w2.npz"),
                                           "--out", str(out)])
    names = {r["trace"] for r in rows if r["question"] == "replay"}
    assert {"synthetic:recency~ctx96_w2.npz", "synthetic:topics~ctx96_w2.npz"} <= names
    liked = [r for r in rows if r["trace"] == "synthetic:topics~ctx96_w2.npz"]
    assert {r["policy"] for r in liked} == {"ring", "lru", "belady"}
    like = [r for r in rows if r["question"] == "resemblance"]
    assert sorted(r["synthetic"] for r in like) == ["recency", "topics"]
    assert all(0 <= r["mean_abs_hit_rate_difference"] <= 1 for r in like)
    png = tmp_path / "replay.png"
    load_experiment("plot_replay").main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0
    capsys.readouterr()
    load_experiment("plot_replay").main([str(out), "--table", "--traces", "ctx96"])
    table = capsys.readouterr().out
    assert table.startswith("ctx96_w2.npz: k 8, W 2, G 2, B 2, 8 steps after 80 tokens")
    assert "| belady | " in table and "| ring: misses / req / group / step" in table
    assert json.loads(out.read_text().splitlines()[-1])["question"] == "resemblance"

"""The serving latency experiment's smoke mode starts a server, streams from 3 clients, and
writes TTFT / inter-token percentiles as a JSON line."""

import json


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "serving.jsonl"
    rows = load_experiment("serving_latency").main(["--smoke", "--out", str(out)])
    assert "TTFT p50" in capsys.readouterr().out
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line == rows[0]
    assert line["requests"] == 3 and line["rejected"] == 0
    assert line["output_tokens"] == 3 * 6
    assert 0 < line["ttft_p50"] <= line["ttft_p99"]
    assert 0 <= line["itl_p50"] <= line["itl_p99"] and line["tokens_per_second"] > 0
    png = tmp_path / "serving.png"
    load_experiment("plot_serving_latency").main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0

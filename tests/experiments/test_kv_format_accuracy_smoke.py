"""The FP8 KV cache accuracy experiment's smoke run: one row per format and a comparison."""

import json


def test_kv_format_accuracy_smoke(load_experiment, tmp_path):
    out = tmp_path / "kv.jsonl"
    rows = load_experiment("kv_format_accuracy").main(["--smoke", "--jsonl", str(out)])
    held = [r for r in rows if r["question"] == "held_out"]
    assert [(r["kv_format"], r["row_bytes"]) for r in held] == [("bf16", 320),
                                                                ("fp8_ds_mla", 196)]
    assert all(0 < r["bits_per_byte"] < 20 for r in held)
    summary = rows[-1]
    assert summary["question"] == "fp8_vs_bf16"
    assert 0 <= summary["top1_agreement"] <= 1 and 0 <= summary["greedy_match_fraction"] <= 1
    assert summary["bits_per_byte_delta"] == held[1]["bits_per_byte"] - held[0]["bits_per_byte"]
    assert [json.loads(line)["question"] for line in out.read_text().splitlines()] == [
        "held_out", "held_out", "fp8_vs_bf16"]

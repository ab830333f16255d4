"""The real-width decode benchmark's smoke run: the preset's structure at tiny widths, random
FP8 weights, one cell per KV format."""

import json


def test_real_width_smoke(load_experiment, tmp_path):
    out = tmp_path / "real_width.jsonl"
    rows = load_experiment("real_width").main(["--smoke", "--out", str(out)])
    assert [(r["kv_format"], r["context"], r["batch"]) for r in rows] == [
        ("bf16", 128, 2), ("fp8_ds_mla", 128, 2)]
    for r in rows:
        assert r["resident_s"] > 0 and r["offload_s"] > 0 and r["ratio"] > 0
        assert 0 < r["hit_rate"] < 1 and r["h2d_bytes_per_step"] > 0
        assert r["weights"] == "fp8" and r["hot_slots"] == 32
    # 656-byte rows move fewer bytes per miss: here D = 128, R = 16 (128 + 4 + 32 = 164 bytes
    # against 144 * 2 = 288).
    assert [r["row_bytes"] for r in rows] == [288, 164]
    assert [json.loads(line)["kv_format"] for line in out.read_text().splitlines()] == [
        "bf16", "fp8_ds_mla"]

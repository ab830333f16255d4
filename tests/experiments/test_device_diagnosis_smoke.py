"""The device diagnosis scripts run end to end at tiny sizes and say what they found: the
history-load variants (each exact on CPU), the prefill variants against resident (exact on
CPU; the ffi variant through fo_jax's copy targets whatever --host-access says), and the
serving engine offloaded against resident (the same tokens)."""

import json


def test_load_history_variants(load_experiment, tmp_path, capsys):
    out = tmp_path / "variants.jsonl"
    rows = load_experiment("load_history_variants").main(["--smoke", "--out", str(out)])
    assert [r["variant"] for r in rows] == ["index_pages", "gather_pages", "gather_rows",
                                            "fenced_pages"]
    assert all(r["status"] == "ok" and r["exact"] for r in rows), rows
    assert len(out.read_text().splitlines()) == 4
    assert "a bulk device_put" in capsys.readouterr().out


def test_prefill_diagnosis(load_experiment, tmp_path, capsys):
    out, hlo = tmp_path / "diagnosis.jsonl", tmp_path / "hlo"
    rows = load_experiment("prefill_diagnosis").main(
        ["--smoke", "--variants", "host_pools", "ffi", "--host-access", "gather", "--hlo",
         str(hlo), "--out", str(out)])
    assert [(r["variant"], r["host_access"]) for r in rows] == [("host_pools", "gather"),
                                                                ("ffi", "ffi")]
    for row in rows:
        assert row["logits_equal"] and row["kv_equal"] and row["repeats_itself"], row
        assert row["first_layer_differing"] is None
        assert row["kv_rows_differing_per_layer"] == [0] * len(row["kv_max_abs_diff_per_layer"])
    assert [json.loads(x)["variant"] for x in out.read_text().splitlines()] == ["host_pools",
                                                                                 "ffi"]
    assert sorted(p.name for p in hlo.iterdir()) == ["ffi.hlo.txt.gz", "host_pools.hlo.txt.gz",
                                                     "resident_h32.hlo.txt.gz"]
    printed = capsys.readouterr().out
    assert "[exact] host_pools" in printed and "[exact] ffi" in printed
    assert "2 of 2 variants exact" in printed


def test_engine_check(load_experiment, tmp_path, capsys):
    out = tmp_path / "engine.jsonl"
    row = load_experiment("engine_check").main(
        ["--smoke", "--requests", "3", "--seats", "2", "--steps-per-call", "2",
         "--host-access", "ffi", "--out", str(out)])
    assert row["equal"] and row["parted_at"] == {} and row["tokens"] > 4
    assert row["host_access"] == "ffi" and row["misses"] > 0  # rows came through the copies
    assert row["pool_after"]["held"] == 0
    assert json.loads(out.read_text()) == row
    assert "tokens equal: True" in capsys.readouterr().out

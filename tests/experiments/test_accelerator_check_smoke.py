"""The accelerator check's smoke mode: every check under both settings, exact, as JSON lines;
a setting's process that crashes is reported, not fatal."""

import json
import sys


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "check.jsonl"
    rows = load_experiment("accelerator_check").main(["--smoke", "--in-process", "--out",
                                                      str(out)])
    printed = capsys.readouterr().out.splitlines()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 3 * 2 + 1 + 2 * 2
    # One summary line per check, in order.
    summaries = [line for line in printed if line.startswith("[")]
    assert [s.split()[1] for s in summaries] == [r["check"] for r in lines]
    assert {(r["check"], r["host_access"]) for r in lines} == {
        (check, access) for check in ("gather_rows", "write_rows", "write_back", "decode_step",
                                      "prefill_chunk") for access in ("gather", "slices")
    } | {("load_history", "both")}
    # On a CPU everything compiles and is exact; the figures are there (meaningless here).
    assert all(r["status"] == "ok" and r["bitwise"] for r in lines), summaries
    assert all(r["gb_per_s"] > 0 and r["ratio_to_bulk"] > 0 for r in lines if "gb_per_s" in r)
    assert all(r["ratio_to_resident"] > 0 for r in lines if r["check"] in ("decode_step",
                                                                             "prefill_chunk"))
    assert all(r["jax"] and r["backend"] and r["git"] for r in lines)
    assert printed[-3].startswith("settings that compiled and were exact everywhere")


def test_one_child_process_per_setting(load_experiment, tmp_path, capsys):
    module = load_experiment("accelerator_check")
    rows = module.main(["--smoke", "--checks", "access", "--access", "slices", "--out",
                        str(tmp_path / "check.jsonl")])
    assert [(r["check"], r["host_access"], r["status"]) for r in rows] == [
        ("gather_rows", "slices", "ok"), ("write_rows", "slices", "ok"),
        ("write_back", "slices", "ok"), ("load_history", "both", "ok")]
    assert "accelerator check on cpu" in capsys.readouterr().out


def test_a_crashed_process_is_reported(load_experiment):
    module = load_experiment("accelerator_check")
    args = module.main.__globals__["argparse"].Namespace(
        checks=["access", "decode"], access=["gather", "slices"], load_history_access=None)
    crash = [sys.executable, "-c",
             "import os, sys; sys.stderr.write('F0000 hlo.cc:1] Check failed: pretend\\n'); "
             "sys.stderr.flush(); os.abort()"]
    rows = module.run_isolated(args, [], "slices", 10, command=crash)
    assert [(r["check"], r["status"]) for r in rows] == [
        ("gather_rows", "crashed"), ("write_rows", "crashed"), ("write_back", "crashed"),
        ("decode_step", "crashed")]
    assert "Check failed: pretend" in rows[0]["error"]
    assert module.summary_line(rows[0]).startswith(
        "[crashed] gather_rows   host_access=slices the check process ended (-6) before "
        "reporting this check: F0000 hlo.cc:1] Check failed: pretend")


def test_a_compile_failure_is_reported_not_raised(load_experiment):
    module = load_experiment("accelerator_check")

    def refuses(*_):
        raise RuntimeError("UNIMPLEMENTED: pretend XLA CHECK failure")

    row = module._access_check(
        "gather_rows", "gather", fn=refuses, make_args=lambda: (), reference=None,
        moved_shape=(1, 1, 576), direction="h2d", repeats=1, donate_first=False)
    assert row["status"] == "compile_failed"
    assert "pretend XLA CHECK failure" in row["error"]
    assert module.summary_line({**row, "check": "gather_rows"}).startswith(
        "[compile_failed] gather_rows   host_access=gather RuntimeError: UNIMPLEMENTED")


def test_a_mismatch_says_where(load_experiment):
    """A prefill that is not bitwise says whether logits or KV differ, by how much, and from
    which layer on; its summary line carries that."""
    import jax.numpy as jnp

    module = load_experiment("accelerator_check")
    kv = jnp.zeros((3, 2, 4, 8), jnp.bfloat16)
    logits = jnp.ones((2, 5), jnp.float32)
    diff = module._differences(logits, logits, kv.at[1, 0, 2, 3].set(0.5), kv)
    assert diff["logits_equal"] and not diff["kv_equal"]
    assert diff["kv_max_abs_diff_per_layer"] == [0.0, 0.5, 0.0]
    assert diff["kv_first_layer_differing"] == 1 and diff["logits_max_abs_diff"] == 0.0
    row = {"check": "prefill_chunk", "host_access": "gather", "status": "mismatch",
           "bitwise": False, "seconds": 0.2, "resident_seconds": 0.1,
           "ratio_to_resident": 2.0, **diff, "resident_repeat_equal": True}
    line = module.summary_line(row)
    assert "first layer differing 1" in line and "resident repeatable True" in line

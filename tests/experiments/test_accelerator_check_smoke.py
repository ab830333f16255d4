"""The accelerator check's smoke mode: every access cell (row sizes x row counts) against both
baselines, the HLO report and the end-to-end checks, exact, as JSON lines; a setting's process
that crashes is reported, not fatal."""

import json
import sys

import jax
import jax.numpy as jnp
import pytest

ACCESSES = ("gather_rows", "write_rows", "write_back", "load_history")


def test_smoke(load_experiment, tmp_path, capsys):
    out, hlo = tmp_path / "check.jsonl", tmp_path / "hlo"
    rows = load_experiment("accelerator_check").main(
        ["--smoke", "--in-process", "--access", "ffi", "--row-bytes", "656", "--hlo", str(hlo),
         "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 4 + 2 + 1 + 1
    # One summary line per row, in order: the access cells, the HLO, end to end.
    summaries = [line for line in printed if line.startswith("[")]
    assert [s.split()[1] for s in summaries] == [r["check"] for r in lines]
    cells = [r for r in lines if r["check"] in ACCESSES]
    assert [(r["check"], r["row_bytes"], r["rows"]) for r in cells] == [
        (check, 656, 16) for check in ACCESSES]  # (1152-byte rows: the next test)
    assert [r["check"] for r in lines[len(cells):]] == [
        "hlo_decode_step", "hlo_prefill", "decode_step", "prefill_chunk"]
    # On a CPU everything compiles and is exact; the figures are there (meaningless here).
    assert all(r["status"] == "ok" and r["host_access"] == "ffi" for r in lines), summaries
    for r in cells:
        assert r["bitwise"] and r["moved_bytes"] == r["rows"] * r["row_bytes"]
        assert r["gb_per_s"] > 0 and r["ratio_to_bulk"] > 0
        assert r["read_bulk_gb_per_s"] > 0
        assert r["ratio_to_read_bulk"] == pytest.approx(r["gb_per_s"] / r["read_bulk_gb_per_s"])
    assert {r["direction"] for r in cells if r["check"].startswith("write")} == {"d2h"}
    hlo_rows = [r for r in lines if r["check"].startswith("hlo_")]
    for r in hlo_rows:  # only the copy targets touch the pools
        assert (r["host_memory_faults"], r["pool_copies"], r["pool_writes"]) == (0, 0, 0), r
    assert sorted(p.name for p in hlo.iterdir()) == ["hlo_decode_step_ffi.hlo.txt.gz",
                                                     "hlo_prefill_ffi.hlo.txt.gz"]
    assert all(r["bitwise"] for r in lines if "bitwise" in r)
    assert all(r["ratio_to_resident"] > 0 for r in lines if r["check"] in ("decode_step",
                                                                             "prefill_chunk"))
    assert all(r["jax"] and r["backend"] and r["git"] for r in lines)
    assert printed[-3].startswith("settings that compiled and were exact everywhere, fastest "
                                  "first: ffi")


def test_the_hlo_report_sees_host_compute_and_pool_copies(load_experiment, tmp_path):
    """A program that gathers on the host pool (what "gather" does) has host-memory faults;
    one that returns the pool updated out of place writes a whole pool: both are reported."""
    module = load_experiment("accelerator_check")
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    pool = jax.device_put(jnp.zeros((2, 4, 8, 16), jnp.bfloat16), host)
    index = jnp.zeros((3,), jnp.int32)

    @jax.jit
    def gathers(pool, index):
        rows = pool[0][jax.device_put(index, jax.memory.Space.Host)]
        return jax.device_put(rows, jax.memory.Space.Device)

    args = module.main.__globals__["argparse"].Namespace(hlo=str(tmp_path))
    row = module.program_report("gathers", "gather", args, gathers, (pool, index), {}, pool)
    assert row["status"] == "touches_host" and row["host_memory_faults"] > 0, row
    assert "reads a host value" in row["fault_lines"][0]
    assert (tmp_path / "gathers_gather.hlo.txt.gz").exists()

    @jax.jit
    def doubles(pool):  # a whole new pool (device memory: the write is what counts here)
        return pool * 2

    dev = jnp.zeros((2, 4, 8, 16), jnp.bfloat16)
    row = module.program_report("doubles", "gather", args, doubles, (dev,), {}, dev)
    assert row["status"] == "touches_host" and row["pool_writes"] == 1
    assert row["pool_copies"] == 0 and row["host_memory_faults"] == 0


def test_cells_split_their_rows(load_experiment):
    module = load_experiment("accelerator_check")
    args = module.main.__globals__["argparse"].Namespace(
        batch=4, page_size=64, ways=4, layers=64, context=131_072, write_context=1024)
    assert module.cell_shape(args, "gather_rows", 64) == {"batch": 4, "per_request": 16}
    assert module.cell_shape(args, "write_rows", 64) == {"batch": 1, "layers": 16, "ways": 4}
    assert module.cell_shape(args, "write_rows", 4096) == {"batch": 16, "layers": 64, "ways": 4}
    assert module.cell_shape(args, "write_back", 64) == {"batch": 1, "per_request": 64}
    assert module.cell_shape(args, "write_back", 4096) == {"batch": 4, "per_request": 1024}
    assert module.cell_shape(args, "load_history", 1024) == {"batch": 4, "pages": 4}
    with pytest.raises(ValueError, match="100 rows are not a multiple of 64"):
        module.cell_shape(args, "load_history", 100)
    args.write_context = 512
    with pytest.raises(ValueError, match="write_back of 4096 rows puts 1024 rows in a request "
                                         "of 512 tokens"):
        module.cell_shape(args, "write_back", 4096)


def test_one_child_process_per_setting(load_experiment, tmp_path, capsys):
    module = load_experiment("accelerator_check")
    rows = module.main(["--smoke", "--checks", "access", "--access", "slices", "--row-bytes",
                        "1152", "--row-counts", "8", "--out", str(tmp_path / "check.jsonl")])
    assert [(r["check"], r["host_access"], r["row_bytes"], r["rows"], r["status"])
            for r in rows] == [(check, "slices", 1152, 8, "ok") for check in ACCESSES]
    assert all(r["bitwise"] and r["ratio_to_read_bulk"] > 0 for r in rows)
    assert "accelerator check on cpu" in capsys.readouterr().out


def test_a_crashed_process_is_reported(load_experiment):
    module = load_experiment("accelerator_check")
    args = module.main.__globals__["argparse"].Namespace(
        checks=["access", "decode"], access=["gather", "slices"], row_bytes=[656],
        row_counts=[64], grace_s=10)
    crash = [sys.executable, "-c",
             "import os, sys; sys.stderr.write('F0000 hlo.cc:1] Check failed: pretend\\n'); "
             "sys.stderr.flush(); os.abort()"]
    rows = module.run_isolated(args, [], "slices", 10, command=crash)
    assert [(r["check"], r.get("rows"), r["status"]) for r in rows] == [
        ("gather_rows", 64, "crashed"), ("write_rows", 64, "crashed"),
        ("write_back", 64, "crashed"), ("load_history", 64, "crashed"),
        ("decode_step", None, "crashed")]
    assert "Check failed: pretend" in rows[0]["error"]
    assert module.summary_line(rows[0]).startswith(
        "[crashed] gather_rows     host_access=slices  656 B x   64 the check process ended "
        "(-6) before reporting this check: F0000 hlo.cc:1] Check failed: pretend")


def test_a_compile_failure_is_reported_not_raised(load_experiment):
    module = load_experiment("accelerator_check")

    def refuses(*_):
        raise RuntimeError("UNIMPLEMENTED: pretend XLA CHECK failure")

    row = module._access_check(
        "gather_rows", "gather", fn=refuses, make_args=lambda: (), reference=None,
        moved_bytes=576, direction="h2d", inner=1, repeats=1, donate_first=False)
    assert row["status"] == "compile_failed"
    assert "pretend XLA CHECK failure" in row["error"]
    assert module.summary_line({**row, "check": "gather_rows"}).startswith(
        "[compile_failed] gather_rows     host_access=gather RuntimeError: UNIMPLEMENTED")


def test_a_mismatch_says_where(load_experiment):
    """A prefill that is not bitwise says whether logits or KV differ, by how much, and from
    which layer on; its summary line carries that."""
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

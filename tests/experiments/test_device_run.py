"""The accelerator session script: it parses, every flag it passes is one its experiment takes,
its default parts run in order within 8 minutes of limits at full size (flags checked with a
stand-in Python), it stops when the host-copy library is missing, its first and last parts
run for real in smoke mode, and the summary judges each target from the parts' JSON lines."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
SCRIPT = ROOT / "experiments" / "accelerator" / "device_run.sh"
PARTS = ["ffi_library", "ffi_checks", "prefill_exact", "engine_exact", "access_rates",
         "access_gather", "decode_ratio", "serving_saturation", "summary"]
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")


@needs_bash
def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.parametrize("name", ["accelerator_check", "decode_bench", "decode_loop_bench",
                                  "prefill_diagnosis", "engine_check", "serving_bench",
                                  "host_copy_check", "device_summary", "real_width"])
def test_flags_exist(name):
    text = SCRIPT.read_text()
    (path,) = (ROOT / "experiments").glob(f"*/{name}.py")
    source = path.read_text()
    module = f"experiments.{path.parent.name}.{name}"
    calls = re.findall(rf"-m {re.escape(module)}(.*?)(?:\n(?!\s)|$)", text, re.S)
    assert calls, f"device_run.sh does not run {name}.py"
    for call in calls:
        for flag in set(re.findall(r"(--[a-z][a-z-]*)", call)) - {"--smoke"}:
            assert f'"{flag}"' in source, f"device_run.sh passes {flag} to {name}.py"


def _run(tmp_path, *, python, fail=None, **env):
    """Run the script with PYTHON=python (a stand-in that logs its arguments to tmp/calls and
    succeeds, failing for the script named `fail`, when python is None)."""
    if python is None:
        stub = tmp_path / "python"
        fails = (f'case "$*" in *{fail}*) echo "pretend failure"; exit 1;; esac\n'
                 if fail else "")
        stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> "{tmp_path}/calls"\n{fails}exit 0\n')
        stub.chmod(0o755)
        python = str(stub)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": python, **env}
    for name in ("SMOKE", "PARTS"):
        if name not in env or env[name] is None:
            env.pop(name, None)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@needs_bash
def test_default_parts_at_full_size(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "access_rates.jsonl").write_text('{"stale": true}\n')
    done = _run(tmp_path, python=None, SMOKE=None, PARTS=None)
    assert done.returncode == 0, done.stdout + done.stderr
    heads = re.findall(r"^=== (\w+) \(limit (\d+)s\)", done.stdout, re.M)
    assert [name for name, _ in heads] == PARTS
    assert sum(int(limit) for _, limit in heads) <= 480 - 10  # the preamble: a few seconds
    assert not (tmp_path / "out" / "access_rates.jsonl").exists()  # replaced when it runs
    lines = (tmp_path / "calls").read_text().splitlines()
    runs = [line for line in lines if not line.startswith("-c")]
    assert len(runs) == len(PARTS)
    for part, line in zip(PARTS, runs):
        assert "--smoke" not in line
        want = f"--dir {tmp_path}/out" if part == "summary" else \
            f"--out {tmp_path}/out/{part}.jsonl"
        assert want in line, (part, line)
        if part not in ("ffi_library", "summary", "access_gather"):
            assert "--access ffi" in line or "--host-access ffi" in line, line
    by_part = dict(zip(PARTS, runs))
    assert "--require-gpu" in by_part["ffi_library"]
    assert "--checks hlo decode prefill --budget-s 60 --grace-s 20" in by_part["ffi_checks"]
    assert "--row-counts 64 256 1024 4096 --row-bytes 656 1152" in by_part["access_rates"]
    assert "--batch 8 32 1" in by_part["decode_ratio"]
    assert "--context 32768" in by_part["decode_ratio"]
    assert "--closed-loop" in by_part["serving_saturation"]


@needs_bash
def test_real_width_is_a_named_part(tmp_path):
    """Not a default part (the defaults stay within 470 s), but named it runs at full size
    after the library check, with its time budget."""
    done = _run(tmp_path, python=None, SMOKE=None, PARTS="ffi_library real_width summary")
    assert done.returncode == 0, done.stdout + done.stderr
    heads = re.findall(r"^=== (\w+) \(limit (\d+)s\)", done.stdout, re.M)
    assert heads == [("ffi_library", "30"), ("real_width", "100"), ("summary", "5")]
    runs = [line for line in (tmp_path / "calls").read_text().splitlines()
            if not line.startswith("-c")]
    assert "--smoke" not in runs[1] and "--budget-s 70" in runs[1]
    assert f"--out {tmp_path}/out/real_width.jsonl" in runs[1]


@needs_bash
def test_serving_overlap_is_a_named_part(tmp_path):
    """The overlap comparison (host share with the engine's overlap on and off, one step per
    call) is not a default part (the defaults fill their 470 s); named, it runs at full size
    with both settings."""
    done = _run(tmp_path, python=None, SMOKE=None, PARTS="ffi_library serving_overlap summary")
    assert done.returncode == 0, done.stdout + done.stderr
    heads = re.findall(r"^=== (\w+) \(limit (\d+)s\)", done.stdout, re.M)
    assert heads == [("ffi_library", "30"), ("serving_overlap", "90"), ("summary", "5")]
    runs = [line for line in (tmp_path / "calls").read_text().splitlines()
            if not line.startswith("-c")]
    assert "--smoke" not in runs[1] and "--overlap on off" in runs[1]
    assert "--steps-per-call 1 " in runs[1] and "--seats 16 --requests 32" in runs[1]
    assert f"--out {tmp_path}/out/serving_overlap.jsonl" in runs[1]


@needs_bash
def test_smoke_flags_and_a_missing_library_stops_the_run(tmp_path):
    done = _run(tmp_path, python=None, SMOKE="1", PARTS=None, fail="host_copy_check")
    assert done.returncode == 1
    assert "=== ffi_library (limit 90s)" in done.stdout  # smoke: limits x3 (a busy CPU)
    assert "=== ffi_library exit 1" in done.stdout
    assert "=== stopping: every other part needs the host-copy library" in done.stdout
    runs = [line for line in (tmp_path / "calls").read_text().splitlines()
            if not line.startswith("-c")]
    assert len(runs) == 1 and "--smoke" in runs[0] and "--require-gpu" not in runs[0]


@needs_bash
def test_smoke_library_and_summary(tmp_path):
    done = _run(tmp_path, python=sys.executable, SMOKE="1", PARTS="ffi_library summary")
    out = done.stdout
    assert "  [exact] gather_rows" in out and "  [exact] scatter_rows" in out, out + done.stderr
    assert "[PASS] host-copy library registered, every copy exact" in out
    assert "[MISSING] decode steps offloaded (ffi) == resident" in out
    assert "=== summary exit 1" in out and "=== all done" in out  # the rest did not run
    row = json.loads((tmp_path / "out" / "ffi_library.jsonl").read_text())
    assert row["registered"] and all(row["exact"].values()) and row["backend"]


# The summary's verdicts ---------------------------------------------------------------------


def _figures(**change):
    """JSON lines of a run in which every target passes, then `change` applied per part."""
    cell = {"host_access": "ffi", "rows": 4096, "gb_per_s": 30.0, "ratio_to_read_bulk": 0.8}
    rows = {
        "library": [{"registered": True, "library": "lib.so", "exact": {"gather_rows": True}}],
        "checks": [{"check": "decode_step", "host_access": "ffi", "status": "ok",
                    "bitwise": True},
                   {"check": "prefill_chunk", "host_access": "ffi", "status": "ok",
                    "bitwise": True}]
        + [{"check": name, "host_access": "ffi", "status": "ok", "host_compute_ops": 0,
            "pool_copies": 0, "pool_writes": 0, "host_memory_faults": 0}
           for name in ("hlo_decode_step", "hlo_prefill")],
        "prefill": [{"variant": v, "logits_equal": True, "kv_equal": True}
                    for v in ("ffi", "device_pools")],
        "engine": [{"equal": True, "tokens": 10, "parted_at": {}, "host_access": "ffi"}],
        "access": [{**cell, "check": c, "row_bytes": b} for c in ("gather_rows", "write_rows")
                   for b in (656, 1152)],
        "gather": [],
        "decode": [{"question": "step", "workload": w, "batch": 8, "policy": "ring",
                    "ratio": 1.0, "ratio_q25": 1.0, "ratio_q75": 1.0, "model": "small",
                    "context": 32768, "hit_rate": 0.9} for w in ("locality", "uniform")],
        "serving": [{"workload": "closed_loop", "steps_per_call": 1, "path": p, "seats": 16,
                     "tpot_p50": t} for p, t in (("resident", 0.010), ("offload", 0.011))],
    }
    for part, fn in change.items():
        rows[part] = fn(rows[part])
    return rows


def _statuses(summary, rows):
    return [status for status, _ in summary.verdicts(rows) if status != "INFO"]


def test_summary_passes_a_good_run_and_fails_each_target(load_experiment):
    summary = load_experiment("device_summary")
    assert set(_statuses(summary, _figures())) == {"PASS"}
    assert len(_statuses(summary, _figures())) == 13

    def with_(index, **values):
        return lambda rows: [{**r, **values} if i == index else r for i, r in enumerate(rows)]

    for change, text in (
            (dict(library=with_(0, registered=False)), "host-copy library"),
            (dict(checks=with_(0, bitwise=False)), "decode steps offloaded"),
            (dict(prefill=with_(1, kv_equal=False)), "differ: device_pools"),
            (dict(engine=with_(0, equal=False)), "engine tokens"),
            (dict(checks=with_(3, host_memory_faults=2)), "ffi prefill"),
            (dict(access=with_(0, ratio_to_read_bulk=0.59)), "0.6 x read_bulk"),
            (dict(access=with_(1, gb_per_s=19.9)), "decode misses >= 20 GB/s"),
            (dict(access=with_(2, gb_per_s=19.9)), "write-through >= 20 GB/s"),
            (dict(decode=with_(0, ratio=1.11)), "<= 1.10, locality"),
            (dict(decode=with_(1, ratio=1.26)), "<= 1.25, uniform"),
            (dict(serving=with_(1, tpot_p50=0.0121)), "TPOT p50")):
        got = summary.verdicts(_figures(**change))
        failed = [line for status, line in got if status == "FAIL"]
        assert len(failed) == 1 and text in failed[0], (text, got)
    # At the limits: pass.
    edge = _figures(decode=with_(0, ratio=1.10),
                    access=with_(0, ratio_to_read_bulk=0.6, gb_per_s=20.0))
    assert set(_statuses(summary, edge)) == {"PASS"}


def test_summary_judges_the_overlap_part_only_when_it_ran(load_experiment):
    summary = load_experiment("device_summary")
    rows = _figures()
    assert not [line for _, line in summary.verdicts(rows) if "overlap" in line]
    rows["overlap"] = [{"path": "resident", "steps_per_call": 1, "overlap": o, "host_share": h}
                       for o, h in ((True, 0.05), (False, 0.30))]
    assert ("PASS", "host share with overlap <= 0.05 at one step per call, resident: 0.050 "
                    "(without overlap 0.300)") in summary.verdicts(rows)
    rows["overlap"][0]["host_share"] = 0.051
    assert [s for s, line in summary.verdicts(rows) if "overlap" in line] == ["FAIL"]


def test_summary_says_missing_not_pass(load_experiment, tmp_path, capsys):
    summary = load_experiment("device_summary")
    empty = {part: [] for part in summary.FILES}
    assert set(_statuses(summary, empty)) == {"MISSING"}
    # Only batch 1 measured: the batch-8 targets are missing, batch 1 is printed for the record.
    rows = _figures(decode=lambda rows: [{**r, "batch": 1} for r in rows])
    got = summary.verdicts(rows)
    assert [s for s, line in got if "decode step offloaded" in line] == ["MISSING", "MISSING"]
    assert any(s == "INFO" and "batch 1 locality x1.000" in line for s, line in got)
    # A skipped access cell leaves "every access" unproven.
    rows = _figures(access=lambda rows: rows + [{"check": "load_history", "host_access": "ffi",
                                                 "rows": 64, "row_bytes": 656,
                                                 "status": "skipped"}])
    got = dict((line.split(":")[0], s) for s, line in summary.verdicts(rows))
    assert got["every ffi access >= 0.6 x read_bulk"] == "MISSING"
    assert summary.main(["--dir", str(tmp_path)]) == 1
    assert "0 pass, 0 fail, 13 missing" in capsys.readouterr().out

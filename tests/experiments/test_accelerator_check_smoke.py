"""The accelerator check's smoke mode: every check under both settings, exact, as JSON lines."""

import json


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "check.jsonl"
    rows = load_experiment("accelerator_check").main(["--smoke", "--out", str(out)])
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

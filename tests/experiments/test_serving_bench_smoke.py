"""The serving benchmark's smoke mode: the three paths (resident, paged on the device,
offloaded), two steps-per-call settings, as JSON lines."""

import contextlib
import io
import json

import pytest


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "serving.jsonl"
    # Without overlap: the decode-call counts compared below then depend on the workload
    # only (with overlap, when a call is read back depends on the machine's timing).
    rows = load_experiment("serving_bench").main(["--smoke", "--overlap", "off", "--out",
                                                  str(out)])
    printed = capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 8
    prefix = [r for r in lines if r["workload"] == "shared_prefix"]
    lines = [r for r in lines if r["workload"] == "poisson"]
    assert {(r["path"], r["steps_per_call"]) for r in lines} == {
        (p, n) for p in ("resident", "paged_device", "offload") for n in (1, 4)}
    by_path = {r["path"]: r for r in lines}
    # The same device budget holds more offloaded seats than resident ones.
    assert by_path["offload"]["seats"] > by_path["resident"]["seats"]
    assert by_path["offload"]["seat_device_bytes"] < by_path["resident"]["seat_device_bytes"]
    # Paged on the device: seats for the mean request and a pool of the budget's pages.
    paged = by_path["paged_device"]
    assert paged["pool_size"] > 0 and paged["seats"] > by_path["resident"]["seats"]
    for r in lines:
        assert r["output_tokens"] > 0 and r["tokens_per_s"] > 0
        assert 0 <= r["host_share"] <= 1 and r["peak_running"] >= 1
        assert r["ttft_p50"] <= r["ttft_p99"]
    # More decode steps per program: fewer decode programs for the same tokens.
    for path in ("resident", "paged_device", "offload"):
        n1, n4 = (next(r for r in lines if r["path"] == path and r["steps_per_call"] == n)
                  for n in (1, 4))
        assert n4["decode_calls"] < n1["decode_calls"]
        assert n4["output_tokens"] == n1["output_tokens"]  # the same greedy tokens
    for n in (1, 4):  # every path: the same greedy tokens
        assert len({r["output_tokens"] for r in lines if r["steps_per_call"] == n}) == 1
    assert "host share" in printed
    # The shared-prefix workload: the cache serves prompt tokens, fewer are prefilled, and the
    # greedy tokens do not change.
    off, on = sorted(prefix, key=lambda r: r["prefix_cache"])
    assert off["cached_tokens"] == 0 < on["cached_tokens"]
    assert on["prefill_tokens"] == off["prefill_tokens"] - on["cached_tokens"]
    assert on["output_tokens"] == off["output_tokens"]


@pytest.fixture(scope="module")
def closed_loop(load_experiment, tmp_path_factory):
    """One closed-loop run at 2 seats and 1 step per call (the smoke budget's resident seats:
    the Poisson cells' programs), each cell with the engine's overlap and without: (rows, the
    JSON lines written, what it printed)."""
    out = tmp_path_factory.mktemp("closed") / "closed.jsonl"
    module = load_experiment("serving_bench")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        rows = module.main(["--smoke", "--closed-loop", "--seats", "2", "--steps-per-call", "1",
                            "--workloads", "poisson", "--host-access", "ffi", "--overlap", "on",
                            "off", "--out", str(out)])
    return rows, [json.loads(line) for line in out.read_text().splitlines()], printed.getvalue()


def test_closed_loop(closed_loop):
    """At saturation: resident and offloaded at the same seats, every seat busy, the same
    greedy tokens; the TPOT ratio printed against its target."""
    rows, lines, printed = closed_loop
    assert [(r["path"], r["workload"], r["seats"], r["overlap"]) for r in rows] == [
        ("resident", "closed_loop", 2, True), ("resident", "closed_loop", 2, False),
        ("offload", "closed_loop", 2, True), ("offload", "closed_loop", 2, False)]
    assert lines == rows
    assert all(r["peak_running"] == 2 and r["tpot_p50"] > 0 for r in rows)
    assert len({r["output_tokens"] for r in rows}) == 1
    assert all(r["host_access"] == "ffi" for r in rows[2:])
    assert all(r["host_access"] is None for r in rows[:2])
    ratio = rows[2]["tpot_p50"] / rows[0]["tpot_p50"]  # the first --overlap setting's
    assert (f"TPOT p50 offloaded / resident at saturation (target <= 1.2): N=1 x{ratio:.2f}"
            in printed)


def test_overlap_on_and_off(closed_loop):
    """`--overlap on off`: each cell served with the engine's overlap and without, the same
    greedy tokens; the host shares and idle times per step printed side by side."""
    rows, _, printed = closed_loop
    for r in rows:
        assert 0 <= r["host_share"] <= 1 and r["device_idle_per_step_s"] >= 0
    for path, (on, off) in (("resident", rows[:2]), ("offload", rows[2:])):
        assert on["output_tokens"] == off["output_tokens"]
        assert (f"{path} N=1 {on['host_share']:.3f} vs {off['host_share']:.3f}" in printed)
    assert (f"host share with overlap vs without: resident N=1 {rows[0]['host_share']:.3f} vs "
            f"{rows[1]['host_share']:.3f}" in printed)


def test_closed_loop_flags(load_experiment, capsys):
    module = load_experiment("serving_bench")
    for flags, message in (
            (["--closed-loop", "--paths", "paged_device"],
             "--closed-loop runs every path at the same --seats; paged_device sizes its seats "
             "by the device budget: leave it out of --paths"),
            (["--seats", "4"], "--seats is for --closed-loop (the Poisson cells size seats by "
                               "the device budget)")):
        with pytest.raises(SystemExit):
            module.main(["--smoke", *flags])
        assert message in capsys.readouterr().err

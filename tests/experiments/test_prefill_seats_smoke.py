"""The prefill-vs-idle-seats benchmark's smoke mode: one request prefilling on engines of 2 and
8 seats, resident and offloaded, then two requests prefilling at once, packed and one program
per request, as JSON lines."""

import json


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "prefill_seats.jsonl"
    rows = load_experiment("prefill_seats").main(["--smoke", "--out", str(out)])
    printed = capsys.readouterr().out
    every = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(every) == len(rows) == 8
    lines = [r for r in every if r["experiment"] == "prefill_seats"]
    assert len(lines) == 4
    assert {(r["path"], r["seats"]) for r in lines} == {
        (p, s) for p in ("resident", "offload") for s in (2, 8)}
    for r in lines:
        # 2 measured requests of 2 chunks each; the first seat count is the ratio's base.
        assert r["prefill_steps"] == 4 and r["first_seats"] == 2
        assert 0 < r["prefill_step_min_s"] <= r["prefill_step_p50_s"] <= r["prefill_step_max_s"]
        assert r["ratio_to_first"] > 0 and "jax" in r and "git" in r
    assert all(r["ratio_to_first"] == 1.0 for r in lines if r["seats"] == 2)
    assert "ratio" in printed
    packed = [r for r in every if r["experiment"] == "prefill_packs"]
    assert {(r["path"], r["prefill_batch"]) for r in packed} == {
        (p, b) for p in ("resident", "offload") for b in (1, 2)}
    for r in packed:
        # 2 measured rounds of 2 chunks; both requests in one program when packed.
        assert r["prefilling"] == 2 and r["prefill_steps"] == 4
        assert r["programs_per_step"] == (1.0 if r["prefill_batch"] == 2 else 2.0)
        assert r["ratio_to_per_request"] > 0
    assert all(r["ratio_to_per_request"] == 1.0 for r in packed if r["prefill_batch"] == 1)
    assert "packed prefill" in printed

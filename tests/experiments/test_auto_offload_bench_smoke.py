"""The automatic offload benchmark's smoke mode (auto, auto one-way and resident cells, no
offloaded one): every cell that can serve a workload serves it, losslessly, as JSON lines."""

import json


def test_smoke(load_experiment, tmp_path, capsys):
    out = tmp_path / "auto.jsonl"
    rows = load_experiment("auto_offload_bench").main(["--smoke", "--out", str(out)])
    printed = capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(rows) == 12
    cells = {(r["workload"], r["cell"]): r for r in lines}
    # The short resident seats cannot hold the large and mixed batches; every other cell
    # serves every workload.
    unserved = {("large", "resident short"), ("mixed", "resident short")}
    assert {key for key, r in cells.items() if not r["served"]} == unserved
    served = [r for r in lines if r["served"]]
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in served)
    # A small batch stays resident: no move, no host traffic; a large one moves and runs
    # more requests at once than the resident engine of long seats.
    assert cells["small", "auto"]["migrations"] == 0 == cells["small", "auto"]["h2d_bytes"]
    assert cells["large", "auto"]["migrations"] > 0
    # Mixed: small requests placed offloaded move back as resident seats free (not one-way).
    assert cells["mixed", "auto"]["moved_back"] > 0 == cells["mixed", "auto one-way"]["moved_back"]
    assert cells["large", "auto"]["peak_running"] > cells["large", "resident long"]["peak_running"]
    assert "vs auto" in printed and "cannot hold" in printed

"""experiments/parallel/expert_layouts.py's smoke run on 8 simulated devices (a subprocess: this
process keeps one device): one JSON line per layout with its figures, the tokens/s ratios
against replicated expert 8 x data 1, 1/expert of the experts' bytes per device, the step's
collectives (3 all-to-alls per MoE layer, or one all-reduce) and the same greedy tokens under
every layout; timings are not checked. In this process (one device) the script refuses."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke(tmp_path):
    out = tmp_path / "expert_layouts.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the script sets 8 devices itself
    proc = subprocess.run([sys.executable, "-m", "experiments.parallel.expert_layouts",
                           "--smoke", "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["layout"], r["expert"], r["data"]) for r in rows] == [
        ("all-to-all", 8, 8), ("replicated", 8, 1), ("replicated", 2, 4)]
    for r in rows:
        assert r["devices"] == 8 and r["smoke"] and len(r["step_times_s"]) == r["steps"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_s"])
        per_device = 8 if r["layout"] == "all-to-all" else r["expert"]
        assert r["expert_bytes_per_device"] * per_device == r["expert_bytes_total"]
        assert r["exchange_share"] == pytest.approx(r["exchange_s"] / r["step_s"])
        assert r["same_tokens_as_baseline"]
        assert len(r["greedy_tokens"]) == r["warmup"] + r["steps"] and all(
            len(t) == r["batch"] for t in r["greedy_tokens"])
    assert rows[1]["vs_baseline"] == 1.0
    assert rows[0]["greedy_tokens"] == rows[1]["greedy_tokens"] == rows[2]["greedy_tokens"]
    assert [c[0] for c in rows[0]["collectives"]] == ["all-to-all"] * 3
    assert [c[0] for c in rows[1]["collectives"]] == [c[0] for c in rows[2]["collectives"]] == [
        "all-reduce"]
    assert "| all-to-all data 8 |" in proc.stdout
    assert "greedy tokens equal across layouts: True" in proc.stdout
    assert "an estimate, not a profile" in proc.stdout


def test_refuses_fewer_devices(load_experiment, capsys):
    module = load_experiment("expert_layouts")
    with pytest.raises(SystemExit):
        module.main(["--smoke"])
    assert ("the layouts need 8 devices; jax started with 1 (run this script in a fresh "
            "process: it sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax "
            "starts)") in capsys.readouterr().err

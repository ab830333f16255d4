"""experiments/train.py --smoke: both stages run, the log, the checkpoints, the evaluations and
the loss plot come out; the weights load back into the inference path."""

import json
import pathlib

import numpy as np

from fo_jax import training


def test_smoke(load_experiment, tmp_path):
    out = tmp_path / "run"
    result = load_experiment("train").main(["--smoke", "--out-dir", str(out)])
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["stage"] for r in steps] == ["dense"] * 3 + ["sparse"] * 2
    assert all(np.isfinite(r["bits_per_byte"]) and r["tokens_per_s"] > 0 for r in steps)
    assert set(result["evals"]) == {"dense", "dense_run_sparse", "sparse", "sparse_run_dense"}
    assert all(0 < e["bits_per_byte"] < 10 for e in result["evals"].values())
    config, params = training.load_run(out, "sparse")
    assert config.vocab_size == training.VOCAB_SIZE and config.name == "tiny-bytes"
    assert training.params_finite(params)
    png = load_experiment("plot_train").main(["--jsonl", str(out / "log.jsonl")])
    assert pathlib.Path(png).stat().st_size > 0

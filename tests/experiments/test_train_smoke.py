"""experiments/train.py --smoke: both stages run, the log, the checkpoints, the evaluations and
the loss plot come out; the weights load back into the inference path."""

import json
import pathlib

import numpy as np

from fo_jax import training
from fo_jax.tokenizer import load_tokenizer


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
    assert config.name == "tiny-bpe" and config.vocab_size == 320
    assert training.params_finite(params)
    tok = load_tokenizer(out)  # the BPE trained on the train split
    assert tok.kind == "bpe" and tok.vocab_size <= config.vocab_size
    assert tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    # bits per byte count the bytes each token stands for (~1.1-1.5 bytes at 320 ids)
    assert all(1.0 < e["bytes_per_token"] < 3.0 for e in result["evals"].values())
    png = load_experiment("plot_train").main(["--jsonl", str(out / "log.jsonl")])
    assert pathlib.Path(png).stat().st_size > 0

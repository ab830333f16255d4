"""experiments/training/train.py --smoke: both stages run, the log, the checkpoints, the evaluations
and the loss plot come out; the weights load back into the inference path."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import training
from fo_jax.cli import main
from fo_jax.embedded import load_model_dir
from fo_jax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def smoke_run(load_experiment, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    return out, load_experiment("train").main(["--smoke", "--out-dir", str(out)])


def test_smoke(load_experiment, smoke_run):
    out, result = smoke_run
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


def test_export_and_generate_from_the_model_dir(load_experiment, smoke_run, tmp_path, capsys):
    run = smoke_run[0]
    model = tmp_path / "model"
    trained = load_experiment("export_model").main(
        ["--run-dir", str(run), "--out", str(model), "--eval-windows", "2", "--seq-len", "32"])
    assert 0 < trained["held_out_bits_per_byte"]["sparse"] < 10
    config, params, tok = load_model_dir(model)
    assert config.name == "tiny-bpe" and tok.kind == "bpe"
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    capsys.readouterr()
    code = main(["generate", "--model-dir", str(model), "--offload", "--check", "--prompt",
                 "def f(x):\n", "--max-new-tokens", "5", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "model: tiny-bpe" in out and "bitwise equal to the resident model's over 4" in out

"""Export a training run as a model directory (fo_jax.embedded): bf16 weights, config, tokenizer.

Reads `--run-dir` (experiments/training/train.py's output: config.json, {stage}.safetensors,
tokenizer.json, log.jsonl), rounds the weights to bfloat16, measures the held-out loss of the
rounded weights (the model that ships, not the float32 one), and writes `--out` with a
"trained" section in config.json: held-out bits per byte (sparse, and the sparse model run
with dense attention; the dense stage's figures from the run's log), steps, tokens, corpus and
license, the training command. The package's embedded model is this script's output:

    python -m experiments.training.train --out-dir runs/bpe --dense-steps 800 \\
        --sparse-steps 100 --batch 2 --max-minutes 62
    python -m experiments.training.export_model --run-dir runs/bpe \\
        --out fo_jax/assets/trained-small
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

from fo_jax import embedded, training
from fo_jax.tokenizer import load_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", default=str(embedded.EMBEDDED_DIR))
    p.add_argument("--stage", default="sparse", choices=training.STAGES)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None,
                   help="held-out window (default: the run's training length)")
    p.add_argument("--command", default=None, help="the training command, for the record")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    run = pathlib.Path(args.run_dir)
    config, params = training.load_run(run, args.stage)
    tok = load_tokenizer(run)
    meta = json.loads((run / "config.json").read_text())
    seq_len = args.seq_len or meta["train"]["seq_len"]
    rounded = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), params)
    held = training.load_split(training.split_files(training.stdlib_files())[1],
                               tokenizer=None if tok.kind == "bytes" else tok)
    windows = training.eval_windows(held, seq_len, args.eval_windows)
    token_bytes = tok.token_bytes
    evals = {}
    for name, stage in (("sparse", "sparse"), ("sparse_run_dense", "dense")):
        r = training.evaluate(rounded, windows, config=config, stage=stage,
                              token_bytes=token_bytes)
        evals[name] = round(r["bits_per_byte"], 4)
        print(f"held-out {name} (bf16 weights, {args.eval_windows} x {seq_len} tokens): "
              f"{r['bits_per_byte']:.4f} bits/byte, {r['bytes_per_token']:.2f} bytes/token")
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    # The last step and token count: the "end" row (steps are logged every --log-every only).
    steps = [r for r in log if r["kind"] in ("step", "end")]
    for r in log:  # the run's own evaluations (float32 weights)
        if r["kind"] == "eval":
            evals[f"{r['name']}_float32"] = round(r["bits_per_byte"], 4)
    trained = {
        "held_out_bits_per_byte": evals, "eval_windows": args.eval_windows,
        "eval_seq_len": seq_len, "steps": steps[-1]["step"] if steps else 0,
        "tokens": steps[-1]["tokens"] if steps else 0, "stage": args.stage,
        "train": meta["train"], "corpus": meta.get("corpus"),
        "license": "weights: Apache-2.0 (this project); corpus: PSF License Version 2",
        "command": args.command,
    }
    out = embedded.save_model_dir(args.out, config, params, tok, dtype="bfloat16",
                                  extra={"trained": trained})
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return trained


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

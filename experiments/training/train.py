"""Train a small DSA model on the Python standard library's sources (fo_jax.training).

The DeepSeek-V3.2 recipe at small scale: a dense stage (LM loss; indexers trained on the side by
KL to the dense attention), then a sparse stage (top-k attention; KL on the selected set).
Writes to --out-dir:
  log.jsonl            one line per logged step ("kind": "step") and per evaluation ("eval")
  dense.safetensors    weights after the dense stage; sparse.safetensors after the sparse one
  latest.safetensors   every --ckpt-every steps
  config.json          model + training configuration, tokenizer, corpus (PSF License)
  tokenizer.json       the byte-level BPE trained on the train split (--tokenizer bpe)
Held-out evaluation (bits per byte): the dense model, the sparse model, and the sparse model run
with dense attention.

    python -m experiments.training.train --smoke --out-dir /tmp/train_smoke
    python -m experiments.training.train --out-dir runs/trained-small --max-minutes 58

The defaults are the ~1-hour run on 2 CPU cores: 550 dense steps of 8 x 512 tokens (dense
attention costs T per token, so the dense stage uses short windows), then 60 sparse steps of
4 x 2048 tokens (top-k attention costs K per token); evaluations on 2048-token windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from fo_jax import training
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.tokenizer import TOKENIZER_FILE, train_bpe
from fo_jax.weights import save_params

from experiments.common import run_metadata


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="trained-small", help="model preset (fo_jax.config)")
    p.add_argument("--out-dir", default="runs/trained-small")
    p.add_argument("--dense-steps", type=int, default=550)
    p.add_argument("--sparse-steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048,
                   help="window of the sparse stage and of every evaluation")
    p.add_argument("--dense-seq-len", type=int, default=512,
                   help="window of the dense stage; shorter is cheaper: "
                        "dense attention costs T per token, top-k attention K")
    p.add_argument("--dense-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--indexer-weight", type=float, default=1.0)
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows per eval")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--max-train-bytes", type=int, default=None, help="cap the train stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe",
                   help="bpe: a byte-level BPE of the config's vocab_size ids trained on the "
                        "train split (saved as tokenizer.json); bytes: ids 0-255 + separator")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="safety net: the dense stage ends early past its share of this wall "
                        "time (dense steps / all steps), the sparse stage past all of it")
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps (seconds)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        # tiny's widths with 2 layers in one group (each group is its own code in every
        # program): compiles in seconds.
        config = get_config("tiny").replace(
            name="tiny-bytes" if args.tokenizer == "bytes" else "tiny-bpe",
            vocab_size=training.VOCAB_SIZE if args.tokenizer == "bytes" else 320,
            num_layers=2, indexer_layers=(0,), dim=32, mlp_hidden=64)
        args.dense_steps, args.sparse_steps, args.batch, args.seq_len = 3, 2, 2, 32
        args.eval_windows, args.log_every, args.ckpt_every, args.warmup = 2, 1, 2, 1
        args.max_train_bytes, args.dense_batch, args.dense_seq_len = 200_000, 2, 32
    else:
        config = get_config(args.config)
    if args.tokenizer == "bytes" and config.vocab_size != training.VOCAB_SIZE:
        raise ValueError(f"config {config.name!r} has vocab_size={config.vocab_size}; the byte "
                         f"tokenizer needs {training.VOCAB_SIZE}: pass --tokenizer bpe or a "
                         "byte-vocabulary preset")
    args.dense_seq_len = args.dense_seq_len or args.seq_len
    args.dense_batch = args.dense_batch or args.batch
    if max(args.seq_len, args.dense_seq_len) > config.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} / --dense-seq-len {args.dense_seq_len} "
                         f"exceeds max_seq_len={config.max_seq_len} of {config.name!r}")
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tc = training.TrainConfig(
        dense_steps=args.dense_steps, sparse_steps=args.sparse_steps, batch=args.batch,
        seq_len=args.seq_len, peak_lr=args.lr, warmup_steps=args.warmup,
        weight_decay=args.weight_decay, clip_norm=args.clip, indexer_weight=args.indexer_weight,
        seed=args.seed)

    files = training.stdlib_files()
    train_files, held_files = training.split_files(files)
    tokenizer = None
    if args.tokenizer == "bpe":
        t0 = time.perf_counter()
        tokenizer = train_bpe(training.load_texts(train_files, max_bytes=args.max_train_bytes),
                              config.vocab_size)
        tokenizer.save(out / TOKENIZER_FILE)
        print(f"tokenizer: byte-level BPE of {tokenizer.vocab_size} ids trained in "
              f"{time.perf_counter() - t0:.0f} s")
    train = training.load_split(train_files, max_bytes=args.max_train_bytes, tokenizer=tokenizer)
    held = training.load_split(held_files, max_bytes=None if not args.smoke else 50_000,
                               tokenizer=tokenizer)
    token_bytes = tokenizer.token_bytes if tokenizer is not None else None
    windows = training.eval_windows(held, args.seq_len, args.eval_windows)
    meta = {**run_metadata(), "config": config.name, "train_files": len(train_files),
            "held_out_files": len(held_files), "train_tokens": int(len(train)),
            "held_out_tokens": int(len(held))}
    training.save_run_config(out / "config.json", config, tc,
                             {"data": meta, "dense_seq_len": args.dense_seq_len,
                              "dense_batch": args.dense_batch}, tokenizer=tokenizer)
    print(f"corpus: {len(train_files)} train files ({len(train) / 1e6:.1f} M tokens), "
          f"{len(held_files)} held-out files ({len(held) / 1e6:.2f} M tokens)")

    params = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(tc.seed))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"model {config.name}: {n_params / 1e6:.2f} M parameters")
    optimizer = training.make_optimizer(tc)
    opt_state = jax.jit(optimizer.init)(params)  # one compile, not one per leaf
    rng = np.random.default_rng(tc.seed)
    log = open(out / "log.jsonl", "w")
    results: dict = {"meta": meta, "evals": {}}

    def write(row):
        log.write(json.dumps({**row, **meta}) + "\n")
        log.flush()

    def run_eval(name, p, stage, wins=windows):
        t0 = time.perf_counter()
        r = training.evaluate(p, wins, config=config, stage=stage, token_bytes=token_bytes)
        r.update(kind="eval", name=name, stage=stage, step=step, window=wins.shape[1] - 1,
                 seconds=time.perf_counter() - t0)
        write(r)
        results["evals"][name] = r
        tqdm.write(f"eval {name}: {r['bits_per_byte']:.3f} bits/byte "
                   f"(indexer KL {r['indexer_kl']:.3f})")

    started = time.perf_counter()
    step, timed_tokens, timed_s, seen_tokens = 0, 0, 0.0, 0
    stage_speed = {}
    bar = tqdm(total=tc.total_steps, desc="train", dynamic_ncols=True, disable=None)
    for stage, count in (("dense", tc.dense_steps), ("sparse", tc.sparse_steps)):
        rows, length = ((args.dense_batch, args.dense_seq_len) if stage == "dense"
                        else (tc.batch, tc.seq_len))
        tokens_per_step = rows * length
        timed_tokens, timed_s = 0, 0.0  # tokens/s per stage (the two stages differ)
        # --max-minutes: the dense stage gets its share of the budget (by steps).
        limit = None if not args.max_minutes else 60 * args.max_minutes * (
            tc.dense_steps / tc.total_steps if stage == "dense" else 1.0)
        for i in range(count):
            if limit is not None and time.perf_counter() - started > limit:
                tqdm.write(f"--max-minutes {args.max_minutes} reached: {stage} stage ends at "
                           f"step {step}")
                break
            batch_np = training.sample_batch(train, rows, length, rng)
            bytes_per_token = (1.0 if token_bytes is None
                               else float(np.mean(token_bytes[batch_np[:, 1:]])))
            batch = jnp.asarray(batch_np)
            t0 = time.perf_counter()
            params, opt_state, (lm, idx, gnorm) = training.train_step(
                params, opt_state, batch, config=config, stage=stage, optimizer=optimizer,
                indexer_weight=tc.indexer_weight)
            lm, idx, gnorm = float(lm), float(idx), float(gnorm)
            dt = time.perf_counter() - t0
            if i > 0:  # the first step of a stage includes compilation
                timed_tokens += tokens_per_step
                timed_s += dt
            tps = timed_tokens / timed_s if timed_s else tokens_per_step / dt
            step += 1
            seen_tokens += tokens_per_step
            bar.update(1)
            bar.set_postfix(stage=stage, bpb=f"{lm / training.LN2 / bytes_per_token:.3f}", kl=f"{idx:.3f}",
                            tok_s=f"{tps:.0f}")
            if step % args.log_every == 0 or step == 1:
                write({"kind": "step", "step": step, "stage": stage, "lm_nats": lm,
                       "bits_per_byte": lm / training.LN2 / bytes_per_token,
                       "bytes_per_token": bytes_per_token, "indexer_kl": idx, "grad_norm": gnorm,
                       "step_s": dt, "tokens_per_s": tps, "tokens": seen_tokens,
                       "seq_len": length})
            if not np.isfinite(lm):
                raise FloatingPointError(f"loss became {lm} at step {step} ({stage})")
            if args.ckpt_every and step % args.ckpt_every == 0:
                save_params(out / "latest.safetensors", params, config)
        if count:
            stage_speed[stage] = timed_tokens / timed_s if timed_s else None
            save_params(out / f"{stage}.safetensors", params, config)
            if stage == "dense":
                if args.dense_seq_len != tc.seq_len:
                    run_eval(f"dense_at_{args.dense_seq_len}", params, "dense",
                             training.eval_windows(held, args.dense_seq_len, args.eval_windows))
                run_eval("dense", params, "dense")
                run_eval("dense_run_sparse", params, "sparse")
            else:
                run_eval("sparse", params, "sparse")
                run_eval("sparse_run_dense", params, "dense")
    bar.close()
    write({"kind": "end", "step": step, "tokens": seen_tokens})
    log.close()
    results["tokens_per_s"] = stage_speed
    results["steps"] = step
    results["tokens"] = seen_tokens
    print(json.dumps({"tokens_per_s": results["tokens_per_s"],
                      **{k: round(v["bits_per_byte"], 4) for k, v in results["evals"].items()}}))
    return results


if __name__ == "__main__":
    main()

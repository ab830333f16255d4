"""What the fp8_ds_mla KV cache costs the trained embedded model, against the bf16 cache.

Question: how far does storing KV rows as DeepSeek's 656-byte FP8 layout (fo_jax.model.kv_format:
e4m3 latent values with a power-of-two scale per 128, RoPE in bfloat16) move a trained model?
Measured, not asserted. For --docs windows of --context held-out tokens (the standard
library's held-out split, as the training held it out; windows evenly spaced over its token
stream), each format runs the same inference path (resident prefill in chunks of --chunk,
top-k selection; offloaded runs give the same bits, see tests/offload) and reports:

  * held-out bits per byte of the window's next-token predictions (teacher forced);
  * top-1 agreement: positions where both formats' logits pick the same next token;
  * greedy continuation: --gen tokens decoded greedily after each window with each format,
    and how many match the bf16 run's (up to and after the first difference).

One JSON line per format and a summary line, each with run metadata.

    python -m experiments.decode.kv_format_accuracy --jsonl experiments/results/decode/kv_format/accuracy.jsonl
    python -m experiments.decode.kv_format_accuracy --smoke
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import resident, training  # noqa: E402
from fo_jax.embedded import load_embedded  # noqa: E402

FORMATS = ("bf16", "fp8_ds_mla")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2048, help="tokens per window")
    p.add_argument("--docs", type=int, default=8, help="held-out windows")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--gen", type=int, default=32, help="greedy tokens after each window")
    p.add_argument("--batch", type=int, default=4, help="windows per prefill")
    p.add_argument("--jsonl", default=None, help="append JSON lines here")
    p.add_argument("--smoke", action="store_true", help="a few short windows (tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.context, args.docs, args.chunk, args.gen, args.batch = 32, 1, 32, 2, 1
    return args


def run_format(config, params, windows: np.ndarray, *, chunk: int, gen: int, batch: int):
    """(nll [N, T] nats of each window's next tokens, argmax [N, T], greedy [N, gen])."""
    num, length = windows.shape[0], windows.shape[1] - 1
    nll, top1, greedy = [], [], []
    for lo in range(0, num, batch):
        tokens = windows[lo:lo + batch]
        b = tokens.shape[0]
        state = resident.ResidentState.create(config, batch=b, capacity=length + gen)
        logits = []
        for start in range(0, length, chunk):
            out, state = resident.prefill(params, state, tokens[:, start:start + chunk],
                                          config=config)
            logits.append(np.asarray(out, np.float32))
        logits = np.concatenate(logits, axis=1)  # [b, T, V]
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        targets = tokens[:, 1:length + 1]
        nll.append(-np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])
        top1.append(logits.argmax(-1))
        # Greedy continuation from the window's first `length` tokens.
        nxt = logits[:, -1].argmax(-1).astype(np.int32)
        seq = []
        for _ in range(gen):
            seq.append(nxt)
            out, state = resident.decode_step(params, state, nxt[:, None], config=config)
            nxt = np.asarray(out[:, -1], np.float32).argmax(-1).astype(np.int32)
        greedy.append(np.stack(seq, axis=1))
    return np.concatenate(nll), np.concatenate(top1), np.concatenate(greedy)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    config, params, tokenizer = load_embedded()
    if args.context + args.gen > config.max_seq_len:
        raise ValueError(f"--context {args.context} + --gen {args.gen} exceeds max_seq_len="
                         f"{config.max_seq_len} of the embedded model")
    _, held = training.split_files(training.stdlib_files())
    stream = training.load_split(held, max_bytes=200_000 if args.smoke else None,
                                 tokenizer=tokenizer)
    windows = training.eval_windows(stream, args.context, args.docs)
    token_bytes = np.asarray(tokenizer.token_bytes, np.float64)
    nbytes = float(token_bytes[windows[:, 1:]].sum())
    meta = {**run_metadata(), "experiment": "kv_format_accuracy", "model": config.name,
            "context": args.context, "docs": args.docs, "chunk": args.chunk, "gen": args.gen}
    rows, runs = [], {}
    for kv_format in FORMATS:
        cfg = config.replace(kv_format=kv_format)
        start = time.perf_counter()
        runs[kv_format] = run_format(cfg, params, windows, chunk=args.chunk, gen=args.gen,
                                     batch=args.batch)
        nll = runs[kv_format][0]
        rows.append({**meta, "question": "held_out", "kv_format": kv_format,
                     "row_bytes": cfg.kv_row_bytes,
                     "bits_per_byte": float(nll.sum() / math.log(2) / nbytes),
                     "nats_per_token": float(nll.mean()),
                     "seconds": time.perf_counter() - start})
    (nll_a, top_a, gen_a), (nll_b, top_b, gen_b) = runs["bf16"], runs["fp8_ds_mla"]
    same = gen_a == gen_b
    first = np.where(same.all(axis=1), args.gen, np.argmin(same, axis=1))
    rows.append({**meta, "question": "fp8_vs_bf16",
                 "bits_per_byte_delta": rows[1]["bits_per_byte"] - rows[0]["bits_per_byte"],
                 "top1_agreement": float(np.mean(top_a == top_b)),
                 "greedy_match_fraction": float(np.mean(same)),
                 "greedy_first_difference": first.tolist(),
                 "max_abs_nll_difference": float(np.abs(nll_a - nll_b).max())})
    for row in rows:
        if row["question"] == "held_out":
            print(f"{row['kv_format']:>10}: {row['row_bytes']:4d} B/row  "
                  f"{row['bits_per_byte']:.4f} bits/byte  ({row['seconds']:.1f} s)")
        else:
            print(f"fp8 - bf16: {row['bits_per_byte_delta']:+.4f} bits/byte; top-1 agreement "
                  f"{row['top1_agreement']:.4f}; greedy tokens matching "
                  f"{row['greedy_match_fraction']:.3f}, first difference at "
                  f"{row['greedy_first_difference']} (of {args.gen})")
    write_jsonl(args.jsonl, rows)
    return rows


if __name__ == "__main__":
    main()

"""Record top-k traces of a trained model over held-out documents (fo_jax.traces format).

Loads a training run (experiments/training/train.py's output: config.json, {stage}.safetensors, the
tokenizer), takes the held-out split of the standard library (by file, as the training did),
and for each context length builds --docs windows of that many tokens starting at the longest
held-out documents (a window longer than its document continues into the next held-out
documents, each behind the separator, as in the training stream). It prefills the first
P = context - steps * max(ways) tokens with the offloaded prefill, then runs --steps
teacher-forced offloaded decode steps for each W in --ways: W = 1 feeds the document's next
token; W = 2-4 feed its next W tokens as the ways of one step (the drafts a
multi-token-prediction verifier would check, all accepted). One trace per (context, W):

    {out_dir}/ctx{context}_w{W}.npz   selections, scores, k-th scores, every score where
                                      context <= --all-scores-context, the run's DecodeStats

JSON lines (--jsonl): held-out loss by position (buckets of --bucket tokens, from the prefill's
and the decode steps' logits: nats and bits per token, bits per byte), and per trace its sizes,
the recorded run's hit rate and whether fo_jax.replay reproduces its DecodeStats exactly.

    python -m experiments.traces.record_traces --run-dir runs/bpe --out-dir traces
    python -m experiments.traces.record_traces --smoke --out-dir /tmp/traces
    python -m experiments.traces.replay --trace traces/ctx2048_w1.npz ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import replay, training, traces  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402
from fo_jax.embedded import load_embedded  # noqa: E402
from fo_jax.tokenizer import load_tokenizer  # noqa: E402


def held_out_documents(tokenizer, max_files: int | None = None) -> list[np.ndarray]:
    """The held-out split's files (fo_jax.training.split_files), each tokenized."""
    _, held = training.split_files(training.stdlib_files())
    texts = training.load_texts(held[:max_files] if max_files else held)
    return [np.asarray(tokenizer.encode(t), np.int32) for t in texts]


def loss_rows(nll: np.ndarray, targets: np.ndarray, token_bytes: np.ndarray, bucket: int,
              info: dict) -> list[dict]:
    """Mean held-out loss per bucket of positions: nll [B, T] nats of targets [B, T]."""
    rows = []
    for lo in range(0, nll.shape[1], bucket):
        part, tgt = nll[:, lo:lo + bucket], targets[:, lo:lo + bucket]
        nbytes = float(token_bytes[tgt].sum())
        rows.append({**info, "question": "loss_by_position", "start": lo,
                     "end": lo + part.shape[1], "tokens": int(part.size),
                     "nats_per_token": float(part.mean()),
                     "bits_per_token": float(part.mean() / math.log(2)),
                     "bits_per_byte": float(part.sum() / math.log(2) / max(nbytes, 1.0))})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default=None,
                        help="a training run's directory (config.json, {stage}.safetensors); "
                             "default: the trained model shipped with the package")
    parser.add_argument("--stage", default="sparse")
    parser.add_argument("--out-dir", required=True, help="where the .npz traces go")
    parser.add_argument("--jsonl", default=None, help="append JSON lines here")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--docs", type=int, default=4, help="documents (requests) per context")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--ways", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--hot-multiple", type=int, default=4,
                        help="the recorded run's hot cache: C = this x k (ref_* stats)")
    parser.add_argument("--policy", default="ring", help="the recorded run's policy")
    parser.add_argument("--all-scores-context", type=int, default=2048,
                        help="keep every token's score up to this context")
    parser.add_argument("--bucket", type=int, default=512, help="loss-by-position bucket")
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a random tiny model on two short windows (seconds; the tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        import jax

        from fo_jax.config import get_config
        from fo_jax.model.dsa import init_params
        from fo_jax.tokenizer import ByteTokenizer

        config = get_config("tiny").replace(index_topk=8, max_ways=2, vocab_size=260)
        params = init_params(config, jax.random.key(0))
        tokenizer = ByteTokenizer()
        args.contexts, args.docs, args.steps, args.ways = [96], 2, 8, [1, 2]
        args.bucket, args.max_files, args.all_scores_context = 32, 6, 96
        source = "smoke: random tiny"
    else:
        if args.run_dir is None:  # the trained model shipped with the package
            config, params, tokenizer = load_embedded()
            source = "embedded:" + config.name
        else:
            config, params = training.load_run(args.run_dir, args.stage)
            tokenizer = load_tokenizer(args.run_dir)
            source = str(args.run_dir)
    if max(args.ways) > config.max_ways:
        parser.error(f"--ways up to {max(args.ways)} but the model allows max_ways="
                     f"{config.max_ways}")
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = held_out_documents(tokenizer, args.max_files)
    token_bytes = np.asarray(tokenizer.token_bytes, np.float64)
    k = config.index_topk
    meta = run_metadata()
    rows = []
    for context in args.contexts:
        prefill = context - args.steps * max(args.ways)
        if prefill < 1:
            parser.error(f"context {context} leaves no prefill for {args.steps} steps of "
                         f"{max(args.ways)} ways")
        if context > config.max_seq_len:
            print(f"context {context} > max_seq_len {config.max_seq_len}: skipped")
            continue
        windows, spans = traces.document_windows(docs, count=args.docs, length=context + 1,
                                                 sep=tokenizer.sep)
        capacity = -(-context // args.page_size) * args.page_size
        offload = OffloadConfig(hot_slots=args.hot_multiple * k, page_size=args.page_size,
                                capacity=capacity, policy=args.policy,
                                host_memory_kind="device")
        info = {"model": source, "stage": args.stage, "context": context, "docs": args.docs,
                "prefill": prefill, "decode_steps": args.steps, "topk": k,
                "tokenizer": tokenizer.kind, "windows": spans}
        start = time.perf_counter()
        state, prefill_nll = traces.prefill_documents(params, config, offload, windows,
                                                      prefill=prefill)
        print(f"context {context}: prefilled {args.docs} x {prefill} tokens in "
              f"{time.perf_counter() - start:.1f} s; documents per window "
              f"{[s['documents'] for s in spans]}")
        decode_nll = None
        for ways in args.ways:
            start = time.perf_counter()
            trace, nll = traces.record_document_trace(
                params, config, offload, windows, state, prefill=prefill, steps=args.steps,
                ways=ways, keep_all_scores=context <= args.all_scores_context,
                meta={"run": source, "stage": args.stage, "context": context,
                      "windows": spans})
            seconds = time.perf_counter() - start
            if ways == max(args.ways):
                decode_nll = nll
            path = out_dir / f"ctx{context}_w{ways}.npz"
            traces.save(path, trace)
            again = replay.replay(trace, hot_slots=trace.ref_hot_slots,
                                  policy=trace.ref_policy, seed=trace.ref_seed)
            exact = all(np.array_equal(getattr(again, n), getattr(trace, "ref_" + n))
                        for n in ("hits", "tail_hits", "misses", "union"))
            selected = trace.ref_hits.sum() + trace.ref_tail_hits.sum() + \
                trace.ref_misses.sum()
            hit_rate = float((trace.ref_hits.sum() + trace.ref_tail_hits.sum()) /
                             max(selected, 1))
            rows.append({**meta, **info, "question": "trace", "ways": ways,
                         "trace": str(path), "steps": trace.steps, "groups": trace.groups,
                         "hot_slots": offload.hot_slots, "policy": offload.policy,
                         "hit_rate": hit_rate, "replay_exact": bool(exact),
                         "decode_nats_per_token": float(nll.mean()),
                         "seconds": seconds})
            print(f"  W {ways}: {args.steps} steps in {seconds:.1f} s -> {path} (hit rate "
                  f"{hit_rate:.3f} at C {offload.hot_slots}, replay exact: {exact})")
        nll = np.concatenate([prefill_nll, decode_nll], axis=1)
        rows += [{**meta, **r} for r in loss_rows(nll, windows[:, 1:context + 1], token_bytes,
                                                  args.bucket, info)]
        for r in rows[-math.ceil(context / args.bucket):]:
            print(f"  loss [{r['start']}, {r['end']}): {r['bits_per_token']:.3f} bits/token, "
                  f"{r['bits_per_byte']:.3f} bits/byte")
    write_jsonl(args.jsonl, rows)
    return rows


if __name__ == "__main__":
    main()

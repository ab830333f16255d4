"""Decode loop benchmark: tokens/s with N decode steps per compiled call against one per call.

One question, one run (ratios are to the baseline measured in the same run):

  python    today's generation loop (`fo_jax.generate.generate` with decode_steps_per_call=1):
            per token, one jitted decode step, a key split and a jitted sampling call
            dispatched from Python (no host sync per step);
  loop N    `fo_jax.decode_loop.decode_loop` with N steps per call (sampling, stop checks and
            statistics on the device): one dispatch per N tokens.

With `--num-drafts D` the question is drafts in the loop instead (greedy, prefilled prompts that
repeat themselves: prompt lookup pays off): `loop N` against `loop N drafts D`
(`decode_loop(..., num_drafts=D)`: n-gram drafts verified on the device, W = D + 1 ways per
step), tokens/s and tokens per request and step, ratio to `loop N` in the same run. With
`--drafter ngram mtp` a cell `loop N mtp D` is added: the drafts come from the model's MTP
layer on the device (`decode_loop(..., mtp=...)`); no model here ships a trained MTP layer, so
it is random (`--mtp random`: accepts about nothing), random plus a copy of its input token
(`--mtp copy`: it proposes the last token again, about what prompt lookup's fallback does; a
check of the machinery's cost and acceptance accounting), or one `experiments/training/train_mtp.py`
trained for the embedded model (`--mtp PATH.npz`). With `--temperature T > 0`
too, the requests sample (one key per request; speculative sampling with drafts): the cells
draw other tokens (same law), so their tokens are not compared.

Every cell decodes the same tokens (they are checked equal) from the same synthetic state
(random KV rows and indexer keys of `context` tokens, `experiments/common.synthetic_states`: no
prefill), `tokens` new tokens per request per round; cells run in interleaved rounds (A B C,
then C B A, ...), the first round uncounted (compilation). Reported: median [IQR] of per-round
tokens/s ratios to `python`, and decode programs dispatched from Python per generated token.

    python -m experiments.decode.decode_loop_bench                         # small, offloaded
    python -m experiments.decode.decode_loop_bench --model tiny --context 256   # dispatch-bound
    python -m experiments.decode.decode_loop_bench --path resident
    python -m experiments.decode.decode_loop_bench --num-drafts 3  # drafts: the embedded model
    python -m experiments.decode.decode_loop_bench --num-drafts 3 --temperature 0.7  # sampled drafts
    python -m experiments.decode.decode_loop_bench --num-drafts 2 --drafter ngram mtp --mtp copy
    python -m experiments.decode.decode_loop_bench --smoke  # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_metadata, synthetic_states, write_jsonl  # noqa: E402

from fo_jax import generate as gen  # noqa: E402
from fo_jax import resident  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.decode_loop import (MTPSeats, OffloadedStep, ResidentStep, Seats, decode_loop,  # noqa: E402
                                mtp_feed_jit)
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402
from fo_jax.offload.state import DecodeState  # noqa: E402
from fo_jax.sampling import Sampling, sample  # noqa: E402


def _fresh(path, res, config, offload):
    """A new copy of the starting state (the runs donate theirs)."""
    kv, ik = jnp.array(res.kv, copy=True), jnp.array(res.index_keys, copy=True)
    if path == "resident":
        return resident.ResidentState(kv=kv, index_keys=ik, lengths=jnp.array(res.lengths))
    return DecodeState.from_resident(kv, ik, np.asarray(res.lengths), config=config,
                                     offload=offload)


def _python(params, state, first, key, tokens, *, path, config, offload, temperature, top_p):
    """generate's loop of single steps: (tokens [B, T], seconds, totals or None)."""
    start = time.perf_counter()
    out, nxt, totals = [], first, None
    for _ in range(tokens):
        if path == "resident":
            logits, state = resident.decode_step(params, state, nxt[:, None], config=config,
                                                 check=False)
        else:
            logits, state, stats = offload_decode.decode_step(
                params, state, nxt[:, None], config=config, offload=offload, check=False)
            misses = stats.misses.astype(jnp.float32).sum()
            totals = misses if totals is None else totals + misses
        key, sub = jax.random.split(key)
        nxt = sample(logits[:, -1], sub, temperature=temperature, top_p=top_p)
        out.append(nxt)
    result = np.stack([np.asarray(t) for t in out], axis=1)
    return result, time.perf_counter() - start, totals


def _looped(params, state, first, key, tokens, n, *, step, sampling):
    start = time.perf_counter()
    seats = Seats.create(first, key, sampling=sampling, lengths=np.asarray(state.lengths),
                         capacity=state.capacity)
    outs, totals = [], None
    for _ in range(-(-tokens // n)):
        out, state, seats = decode_loop(params, state, seats, n, sampling, step=step)
        outs.append(out.tokens)
        if out.stats is not None:
            misses = out.stats.misses.astype(jnp.float32).sum()
            totals = misses if totals is None else totals + misses
    result = np.concatenate([np.asarray(o) for o in outs], axis=1)[:, :tokens]
    return result, time.perf_counter() - start, totals


def run(args, meta):
    config = get_config(args.model).replace(max_ways=1)
    if args.smoke:  # one indexer group (each group is its own code in every program)
        config = config.replace(name=f"{config.name}-1group", indexer_layers=(0,))
    batch, context = args.batch, args.context
    hot = max(context // 4, config.index_topk)
    page = 16
    capacity = -(-(context + args.tokens + 1) // page) * page
    offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity, policy="ring")
    params = init_params(config, jax.random.key(0))
    res, _ = synthetic_states(config, offload, batch, context, seed=0)
    step = (ResidentStep(config) if args.path == "resident"
            else OffloadedStep(config, offload))
    # Every request samples `tokens` more (one already sampled counts): the last call of a
    # loop cell ends early on that count.
    sampling = Sampling.create(batch, temperature=args.temperature, top_p=args.top_p,
                               max_new_tokens=args.tokens + 1)
    first = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, batch),
                        jnp.int32)
    cells = ["python"] + [f"loop {n}" for n in args.steps_per_call]
    times = {c: [] for c in cells}
    reference = None
    print(f"decode loop: {config.name}, {args.path}, batch {batch}, context {context}, "
          f"{args.tokens} tokens per request per round, temperature {args.temperature}, "
          f"{args.rounds} rounds (+1 uncounted)")
    for r in range(args.rounds + 1):
        order = cells if r % 2 == 0 else cells[::-1]
        for cell in order:
            state = _fresh(args.path, res, config, offload)
            jax.block_until_ready(state)
            key = jax.random.key(2)
            if cell == "python":
                toks, secs, totals = _python(params, state, first, key, args.tokens,
                                             path=args.path, config=config, offload=offload,
                                             temperature=args.temperature, top_p=args.top_p)
            else:
                toks, secs, totals = _looped(params, state, first, key, args.tokens,
                                             int(cell.split()[1]), step=step, sampling=sampling)
            if reference is None:
                reference = (toks, None if totals is None else float(totals))
            elif not np.array_equal(toks, reference[0]) or (
                    totals is not None and float(totals) != reference[1]):
                raise AssertionError(f"{cell} decoded other tokens (or misses) than the first "
                                     "cell: the loop is not the Python loop")
            if r > 0:
                times[cell].append(secs)
    base = np.asarray(times["python"])
    rows = []
    print(f"{'cell':10s}{'tokens/s':>10s}{'ratio':>8s}{'IQR':>14s}{'dispatches/token':>18s}")
    for cell in cells:
        secs = np.asarray(times[cell])
        ratios = base / secs  # tokens/s ratio: same tokens, so the inverse time ratio
        n = 1 if cell == "python" else int(cell.split()[1])
        per_token = 1.0 if cell == "python" else 1.0 / n
        tps = batch * args.tokens / float(np.median(secs))
        q25, med, q75 = (float(np.percentile(ratios, q)) for q in (25, 50, 75))
        print(f"{cell:10s}{tps:>10.1f}{med:>8.2f}{q25:>7.2f}-{q75:<6.2f}{per_token:>18.4f}")
        rows.append({**meta, "question": "decode_loop", "cell": cell, "steps_per_call": n,
                     "path": args.path, "model": config.name, "batch": batch,
                     "context": context, "tokens": args.tokens, "rounds": args.rounds,
                     "temperature": args.temperature, "tokens_per_second": tps,
                     "ratio": med, "ratio_q25": q25, "ratio_q75": q75,
                     "round_seconds": secs.tolist(), "dispatches_per_token": per_token})
    return rows


def _repetitive_prompts(config, tokenizer, batch, context):
    """`batch` prompts of at most `context` tokens whose continuations repeat: with the
    embedded model's tokenizer, code that repeats itself (a list of zeros, test methods,
    imports, a table: the trained model continues them in kind, so prompt lookup finds its
    next tokens); with random weights, a random 16-token pattern repeated."""
    rng = np.random.default_rng(3)
    if tokenizer is None:
        return [np.tile(rng.integers(0, config.vocab_size, 16), -(-context // 16))[:context]
                .tolist() for _ in range(batch)]
    texts = ["values = [" + "0, " * 40,
             "    def test_a(self):\n        self.assertEqual(x, 1)\n" * 6,
             "import os\nimport sys\n" * 10,
             "TABLE = {\n" + "".join(f"    '{c}': {i},\n" for i, c in enumerate("abcdefghij"))]
    return [[int(t) for t in tokenizer.encode(texts[b % len(texts)])][-context:]
            for b in range(batch)]


def _mtp_params(config, params, kind: str):
    """MTP parameters for `config` (which has num_nextn_predict_layers >= 1): random, or random
    plus a copy of the input token (eh_proj passes the token's embedding through, the head
    reads it back: the argmax is mostly the input token)."""
    from fo_jax.model.mtp import init_mtp_params

    if kind not in ("random", "copy"):  # a file of experiments/training/train_mtp.py
        from experiments.training.train_mtp import load_mtp

        return load_mtp(kind, config)
    mtp = init_mtp_params(config, jax.random.key(1), own_head=kind == "copy")
    if kind == "copy":
        e = config.dim
        copy = jnp.concatenate([jnp.eye(e), jnp.zeros((e, e))])[None]
        mtp = {**mtp, "eh_proj": mtp["eh_proj"] + copy.astype(mtp["eh_proj"].dtype),
               "head": mtp["head"] + params["embed"].T[None].astype(mtp["head"].dtype)}
    return mtp


def _heldout_prompts(config, tokenizer, batch, context):
    """`batch` prompts of `context` tokens: windows evenly spaced over the held-out split of the
    embedded model's corpus (Python standard library sources it was not trained on; code that
    does not necessarily repeat); random tokens without a tokenizer."""
    if tokenizer is None:
        rng = np.random.default_rng(3)
        return [rng.integers(0, config.vocab_size, context).tolist() for _ in range(batch)]
    from fo_jax.training import eval_windows, load_split, split_files, stdlib_files

    stream = load_split(split_files(stdlib_files())[1], max_bytes=400_000, tokenizer=tokenizer)
    return [w[:context].tolist() for w in eval_windows(stream, context, batch)]


def run_drafts(args, meta):
    """Cells `loop N` and `loop N drafts D` (n-gram) / `loop N mtp D` on prefilled repetitive
    prompts (greedy, or sampled at args.temperature with one key per request)."""
    tokenizer = None
    if args.model == "embedded":
        from fo_jax.embedded import load_embedded

        config, params, tokenizer = load_embedded()
    else:
        config = get_config(args.model)
        params = init_params(config, jax.random.key(0))
    mtp = None
    if "mtp" in args.drafter:
        if config.num_nextn_predict_layers < 1:  # the main model's parameters do not change
            config = config.replace(num_nextn_predict_layers=1)
        mtp = _mtp_params(config, params, args.mtp)
    n, d = args.steps_per_call[-1], args.num_drafts
    batch = args.batch
    prompts = (_repetitive_prompts if args.prompts == "repeat" else _heldout_prompts)(
        config, tokenizer, batch, args.context)
    longest = max(len(p) for p in prompts)
    page = 16
    capacity = -(-(longest + args.tokens + d + 1) // page) * page
    tokens, lengths = gen.pad_prompts(prompts)
    if args.path == "resident":
        engine = gen.ResidentEngine(params, config, batch=batch, capacity=capacity, mtp=mtp)
        step = ResidentStep(config)
    else:
        offload = OffloadConfig(hot_slots=max(capacity // 4, config.index_topk * config.max_ways),
                                page_size=page, capacity=capacity, policy="ring")
        engine = gen.OffloadEngine(params, config, offload=offload, batch=batch, mtp=mtp)
        step = OffloadedStep(config, offload)
    logits, hidden = engine.prefill(tokens, lengths, hidden=True)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    prefilled = engine.state
    mtp_seats0 = None
    if mtp is not None:  # the prompts' pairs (h_i, t_{i+1}), the last with the first token
        nxt = np.zeros(tokens.shape, np.int32)
        nxt[:, :-1] = tokens[:, 1:]
        nxt[np.arange(batch), lengths - 1] = np.asarray(first)
        mtp_seats0 = mtp_feed_jit(params, mtp, MTPSeats.create(config, batch=batch,
                                                               capacity=capacity),
                                  hidden, jnp.asarray(nxt), jnp.asarray(lengths, jnp.int32),
                                  config=config, query_block=resident.QUERY_BLOCK)
    temperature = args.temperature
    sampling = Sampling.create(batch, temperature=temperature, top_p=args.top_p,
                               max_new_tokens=args.tokens + 1)
    history0 = np.zeros((batch, capacity), np.int32)
    for b, p in enumerate(prompts):
        history0[b, :len(p) + 1] = list(p) + [int(first[b])]
    cells = [f"loop {n}"] + [f"loop {n} {'mtp' if k == 'mtp' else 'drafts'} {d}"
                             for k in args.drafter]
    times, steps, results = {c: [] for c in cells}, {}, {}
    print(f"decode loop drafts: {config.name}, {args.path}, batch {batch}, prompts of "
          f"{int(lengths.min())}-{longest} tokens ({args.prompts}), {args.tokens} tokens per "
          f"request per round, {'greedy' if temperature == 0 else f'temperature {temperature}, '
          f'top_p {args.top_p}'}, {args.rounds} rounds (+1 uncounted)")
    for r in range(args.rounds + 1):
        for cell in (cells if r % 2 == 0 else cells[::-1]):
            drafts = d if cell != cells[0] else 0
            state = jax.tree_util.tree_map(jnp.copy, prefilled)
            history = jnp.asarray(history0) if drafts and "mtp" not in cell else None
            mtp_seats = (jax.tree_util.tree_map(jnp.copy, mtp_seats0) if "mtp" in cell
                         else None)
            jax.block_until_ready((state, history, mtp_seats))
            start = time.perf_counter()
            seats = Seats.create(first, jax.random.split(jax.random.key(0), batch),
                                 sampling=sampling,
                                 lengths=np.asarray(lengths), capacity=capacity)
            outs, num_steps, request_steps, accepted, proposed = [], 0, 0, 0, 0
            while not bool(np.all(np.asarray(seats.done))):
                kw = dict(num_drafts=drafts, history=history) if drafts else {}
                if mtp_seats is not None:
                    kw.update(mtp=mtp, mtp_seats=mtp_seats)
                out, state, seats = decode_loop(params, state, seats, n, sampling, step=step,
                                                **kw)
                history, mtp_seats = out.history, out.mtp_seats
                outs.append(np.asarray(out.tokens))
                num_steps += int(out.num_steps)
                if drafts:
                    request_steps += int(np.sum(np.asarray(out.counts) > 0))
                    accepted += int(np.sum(out.accepted))
                    proposed += int(np.sum(out.proposed))
                else:
                    request_steps += int(np.sum(out.fed))
            secs = time.perf_counter() - start
            got = np.concatenate(outs, axis=1)
            results[cell] = np.stack([row[row >= 0] for row in got])
            steps[cell] = (num_steps, request_steps, accepted, proposed)
            if r > 0:
                times[cell].append(secs)
    base = np.asarray(times[cells[0]])
    same = all(np.array_equal(results[cells[0]], results[c]) for c in cells[1:])
    rows = []
    print(f"{'cell':18s}{'tokens/s':>10s}{'ratio':>8s}{'IQR':>14s}{'tokens/step':>13s}"
          f"{'per request':>13s}{'drafts accepted':>17s}")
    for cell in cells:
        secs = np.asarray(times[cell])
        ratios = base / secs
        tps = batch * args.tokens / float(np.median(secs))
        num_steps, request_steps, accepted, proposed = steps[cell]
        per_step = args.tokens / num_steps  # per request and step of the batch (the slowest)
        per_request = batch * args.tokens / request_steps  # per step a request took
        q25, med, q75 = (float(np.percentile(ratios, q)) for q in (25, 50, 75))
        print(f"{cell:18s}{tps:>10.1f}{med:>8.2f}{q25:>7.2f}-{q75:<6.2f}{per_step:>13.2f}"
              f"{per_request:>13.2f}{f'{accepted}/{proposed}':>17s}")
        rows.append({**meta, "question": "decode_loop_drafts", "cell": cell,
                     "steps_per_call": n, "num_drafts": d if cell != cells[0] else 0,
                     "drafter": (None if cell == cells[0] else
                                 f"mtp ({args.mtp})" if "mtp" in cell else "ngram"),
                     "path": args.path, "model": config.name, "batch": batch,
                     "prompt_tokens": [len(p) for p in prompts], "tokens": args.tokens,
                     "prompts": args.prompts,
                     "rounds": args.rounds, "tokens_per_second": tps, "ratio": med,
                     "ratio_q25": q25, "ratio_q75": q75, "round_seconds": secs.tolist(),
                     "decode_steps": num_steps, "tokens_per_step": per_step,
                     "tokens_per_request_step": per_request, "accepted_drafts": accepted,
                     "proposed_drafts": proposed, "temperature": temperature,
                     "top_p": args.top_p, "same_tokens": same})
    if temperature > 0:
        print("sampled: the cells draw other tokens (speculative sampling: same law, other "
              "draws), not compared")
    else:
        print("same tokens with and without drafts" if same else
              "the drafted tokens differ from the undrafted ones (a near-tie of two logits: a "
              "W-way step's logits differ from a W = 1 step's in the last bits)")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--path", choices=("offload", "resident"), default="offload")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=32,
                        help="new tokens per request per round")
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--temperature", type=float, default=None,
                        help="default 0.8; with --num-drafts, 0 (greedy)")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--rounds", type=int, default=7, help="timed interleaved rounds")
    parser.add_argument("--num-drafts", type=int, default=0,
                        help="> 0: compare the loop with and without this many n-gram drafts "
                             "per step instead (greedy unless --temperature; --model "
                             "embedded: the trained model)")
    parser.add_argument("--drafter", nargs="+", choices=("ngram", "mtp"), default=["ngram"],
                        help="with --num-drafts: the drafters compared (mtp: the model's MTP "
                             "layer, num_nextn_predict_layers set to 1 where 0)")
    parser.add_argument("--mtp", default="random",
                        help="the MTP layer's weights: random, copy (random plus a copy of "
                             "its input token), or an .npz of experiments/training/train_mtp.py")
    parser.add_argument("--prompts", choices=("repeat", "heldout"), default="repeat",
                        help="with --num-drafts: prompts of code that repeats itself, or windows "
                             "of the embedded model's held-out corpus")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batch, args.context, args.tokens, args.rounds = "tiny", 2, 64, 6, 1
        args.steps_per_call = [4]
    if args.temperature is None:
        args.temperature = 0.0 if args.num_drafts else 0.8
    if args.num_drafts:
        if args.model == "small" and not args.smoke:
            args.model = "embedded"
        rows = run_drafts(args, run_metadata())
    else:
        rows = run(args, run_metadata())
    write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()

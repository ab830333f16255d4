"""Does a prefill step cost the same whatever the number of idle seats?

One request prefills a prompt of `--prompt-len` tokens in chunks of `--prefill-chunk` while
every other seat of the engine is empty, on engines of each of `--seats` seats (default 4, 16,
64), resident and offloaded. Per cell: the median wall time of its prefill steps (the engine's
own `timings["prefill_s"]`, which waits for the programs' results) over `--repeats` requests
after a warm-up request that compiles every program (each history bucket), and its ratio to
the first seat count (the target: <= 1.2). The requests are measured round by round over the
engines of one path (one request on each seat count, then the next), so that a busy spell of a
shared machine falls on every cell alike. The engine prefills each request over its own seat
and history (`Engine._prefill`, `prefill_seat`), so the ratio should stay near 1; an engine
whose prefill program spans every seat grows with the seats instead.

Then, do packed prefills pay? `--prefilling` (default 1, 4, 8) requests of the same prompt
length arrive at once and prefill together, on an engine of as many seats, packed
(`prefill_batch`: one program per pack, `prefill_seats`) and with one program per request
(`prefill_batch=1`, the baseline, measured in the same run, round by round): the median step
time of each and the ratio packed / per request (rows of experiment "prefill_packs").

    python -m experiments.serving.prefill_seats                 # small model, minutes on CPU
    python -m experiments.serving.prefill_seats --smoke         # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from experiments.common import run_metadata, write_jsonl

from fo_jax.config import get_config
from fo_jax.engine import Engine
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig


def prefill_step_times(engine: Engine, prompt: list[int]) -> list[float]:
    """Wall seconds of each prefill step of `prompt` served alone (one output token: the
    request ends at its first token, so the steps hold no decode)."""
    engine.add_request(prompt, max_tokens=1)
    times = []
    while engine.has_unfinished():
        before, calls = engine.timings["prefill_s"], engine.counters["prefill_calls"]
        engine.step()
        if engine.counters["prefill_calls"] > calls:
            times.append(engine.timings["prefill_s"] - before)
    engine.run()  # collect the finished request
    return times


def prefill_steps_together(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Wall seconds of each prefill step of `prompts` arriving at once (one output token
    each: the steps hold no decode)."""
    for prompt in prompts:
        engine.add_request(prompt, max_tokens=1)
    times = []
    while engine.has_unfinished():
        before, calls = engine.timings["prefill_s"], engine.counters["prefill_calls"]
        engine.step()
        if engine.counters["prefill_calls"] > calls:
            times.append(engine.timings["prefill_s"] - before)
    engine.run()  # collect the finished requests
    return times


def packs(args, params, config, offload, meta) -> list[dict]:
    """The packed-vs-per-request cells (module doc): one JSON row per (path, n, prefill_batch)."""
    seats, batch = max(args.prefilling), max(args.prefilling)
    rng = np.random.default_rng(1)
    print(f"\npacked prefill: n requests of {args.prompt_len} tokens prefilling at once on "
          f"{seats} seats, prefill_batch {batch} against 1 (one program per request)")
    print(f"{'path':10s}{'n':>4s}{'batch':>7s}{'programs':>10s}{'step p50 s':>12s}"
          f"{'min s':>9s}{'ratio':>8s}")
    rows = []
    for path in args.paths:
        engines = {}
        for b in (1, batch):
            engines[b] = Engine(params, config, seats=seats, capacity=args.capacity,
                                offload=offload if path == "offload" else None,
                                decode_steps_per_call=1, prefill_chunk=args.prefill_chunk,
                                prefill_batch=b)
        for n in args.prefilling:
            prompts = [[rng.integers(0, config.vocab_size, args.prompt_len).tolist()
                        for _ in range(n)] for _ in range(args.repeats + 1)]
            for engine in engines.values():
                prefill_steps_together(engine, prompts[0])  # compiles this n's programs
            times = {b: [] for b in engines}
            calls = {b: engine.counters["prefill_calls"] for b, engine in engines.items()}
            for group in prompts[1:]:  # round by round: a busy spell falls on both alike
                for b, engine in engines.items():
                    times[b] += prefill_steps_together(engine, group)
            base = statistics.median(times[1])
            for b, engine in engines.items():
                t = times[b]
                p50 = statistics.median(t)
                programs = (engine.counters["prefill_calls"] - calls[b]) / len(t)
                print(f"{path:10s}{n:>4d}{b:>7d}{programs:>10.1f}{p50:>12.4f}{min(t):>9.4f}"
                      f"{p50 / base:>8.2f}")
                rows.append({**meta, "experiment": "prefill_packs", "label": args.label,
                             "model": config.name, "path": path, "seats": seats,
                             "prefilling": n, "prefill_batch": b, "capacity": args.capacity,
                             "page_size": args.page_size if path == "offload" else None,
                             "prompt_len": args.prompt_len, "prefill_chunk": args.prefill_chunk,
                             "repeats": args.repeats, "prefill_steps": len(t),
                             "programs_per_step": programs,
                             "prefill_step_p50_s": p50, "prefill_step_min_s": min(t),
                             "prefill_step_max_s": max(t), "ratio_to_per_request": p50 / base})
            write_jsonl(args.out, rows[-len(engines):])
        del engines
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--capacity", type=int, default=1024, help="tokens per seat")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seats", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="measured requests per cell")
    parser.add_argument("--prefilling", type=int, nargs="*", default=[1, 4, 8],
                        help="requests prefilling at once (packed vs one program per request); "
                             "none: skip that part")
    parser.add_argument("--skip-seats", action="store_true",
                        help="only the packed-vs-per-request part")
    parser.add_argument("--paths", nargs="+", choices=("resident", "offload"),
                        default=["resident", "offload"])
    parser.add_argument("--label", default=None,
                        help="a note stored in every row (e.g. which engine was measured)")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.capacity, args.page_size, args.seats = "tiny", 64, 4, [2, 8]
        # 2 chunks: the prefill compiles for histories of 0 and 2 pages (its buckets) only.
        args.prompt_len, args.prefill_chunk, args.repeats = 16, 8, 2
        args.prefilling = [2]
    config = get_config(args.model).replace(max_ways=1)
    if args.smoke:  # one indexer group (each group is its own code in every program)
        config = config.replace(name=f"{config.name}-1group", indexer_layers=(0,))
    if args.capacity > config.max_seq_len:
        config = config.replace(max_seq_len=args.capacity)
    if args.prompt_len >= args.capacity:
        parser.error(f"--prompt-len {args.prompt_len} must be < --capacity {args.capacity} "
                     "(the request's first token needs room)")
    params = init_params(config, jax.random.key(0))
    offload = OffloadConfig(hot_slots=config.index_topk, page_size=args.page_size,
                            capacity=args.capacity)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist()
               for _ in range(args.repeats + 1)]
    meta = run_metadata()
    chunks = -(-args.prompt_len // args.prefill_chunk)
    if not args.skip_seats:
        print(f"prefill step vs idle seats: {config.name}, seat capacity {args.capacity}, one "
              f"prompt of {args.prompt_len} tokens ({chunks} chunks of {args.prefill_chunk}), "
              f"{args.repeats} measured requests per cell")
        print(f"{'path':10s}{'seats':>7s}{'step p50 s':>12s}{'min s':>11s}{'step mean s':>13s}"
              f"{'ratio':>8s}")
    rows = []
    for path in [] if args.skip_seats else args.paths:
        engines = {}
        for seats in args.seats:
            engines[seats] = Engine(params, config, seats=seats, capacity=args.capacity,
                                    offload=offload if path == "offload" else None,
                                    decode_steps_per_call=1, prefill_chunk=args.prefill_chunk)
            prefill_step_times(engines[seats], prompts[0])  # compiles every program
        # Round by round over the seat counts, so that a busy spell of the machine falls on
        # every cell alike.
        times = {seats: [] for seats in args.seats}
        for prompt in prompts[1:]:
            for seats in args.seats:
                times[seats] += prefill_step_times(engines[seats], prompt)
        base = None
        for seats in args.seats:
            t = times[seats]
            p50, mean = statistics.median(t), statistics.fmean(t)
            base = base or p50
            print(f"{path:10s}{seats:>7d}{p50:>12.4f}{min(t):>11.4f}{mean:>13.4f}"
                  f"{p50 / base:>8.2f}")
            rows.append({**meta, "experiment": "prefill_seats", "label": args.label,
                         "model": config.name,
                         "path": path, "seats": seats, "capacity": args.capacity,
                         "page_size": args.page_size if path == "offload" else None,
                         "prompt_len": args.prompt_len, "prefill_chunk": args.prefill_chunk,
                         "repeats": args.repeats, "prefill_steps": len(t),
                         "prefill_step_p50_s": p50, "prefill_step_min_s": min(t),
                         "prefill_step_mean_s": mean, "prefill_step_max_s": max(t),
                         "ratio_to_first": p50 / base, "first_seats": args.seats[0]})
        write_jsonl(args.out, rows[-len(args.seats):])
        del engines
    if args.prefilling:
        rows += packs(args, params, config, offload, meta)
    return rows


if __name__ == "__main__":
    main()

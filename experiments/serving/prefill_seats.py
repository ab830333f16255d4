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
    parser.add_argument("--paths", nargs="+", choices=("resident", "offload"),
                        default=["resident", "offload"])
    parser.add_argument("--label", default=None,
                        help="a note stored in every row (e.g. which engine was measured)")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.capacity, args.page_size, args.seats = "tiny", 64, 4, [2, 8]
        args.prompt_len, args.prefill_chunk, args.repeats = 24, 8, 2
    config = get_config(args.model).replace(max_ways=1)
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
    print(f"prefill step vs idle seats: {config.name}, seat capacity {args.capacity}, one "
          f"prompt of {args.prompt_len} tokens ({chunks} chunks of {args.prefill_chunk}), "
          f"{args.repeats} measured requests per cell")
    print(f"{'path':10s}{'seats':>7s}{'step p50 s':>12s}{'min s':>11s}{'step mean s':>13s}"
          f"{'ratio':>8s}")
    rows = []
    for path in args.paths:
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
    return rows


if __name__ == "__main__":
    main()

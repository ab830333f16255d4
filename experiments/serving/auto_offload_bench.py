"""Automatic offload benchmark: at one device budget, small batches pay nothing and large batches
still fit.

At a fixed device budget for the seats' KV state (`--device-budget-mb`), four engines:

  resident short   `Engine`, resident, as many seats of `--short` tokens as the auto engine's
                   resident tier (the same programs: what the auto engine must not be slower
                   than while a batch fits);
  resident long    `Engine`, resident, as many seats of `--capacity` tokens as the budget holds;
  offloaded        `Engine`, offloaded, as many seats of `--capacity` as the budget holds;
  auto             `AutoEngine`: `--resident-share` of the budget in resident seats of `--short`
                   tokens, the rest in offloaded seats of `--capacity`;
  auto one-way     the same without moving requests back (an offloaded request stays there
                   when a resident seat frees: the engine before moves went both ways).

Three workloads, all requests arriving at once, greedy:
  small batch: as many requests as the auto engine's resident seats, each fitting a short seat
    (prompt + output <= short): the auto engine runs resident only, with no host traffic;
  large batch: `--large` requests whose outputs outgrow a short seat: the auto engine starts
    them resident, moves them to offloaded seats when they outgrow them, and serves many more
    at once than the resident engine of long seats (a resident engine of short seats cannot
    serve them at all);
  mixed: `--mixed` requests alternating small and large ones (more than the resident seats):
    small ones placed offloaded because the resident seats were taken move back as these free.
Per cell: seats, peak running requests, output tokens/s and its ratio to the auto engine's in
the same run (these machines are noisy), moves out and back, host-to-device kB, offloaded misses
per offloaded decode step, and whether every request's tokens equal
the resident long engine's (the switch is lossless). Each cell runs its workload once untimed
(compiling every program) and then timed.

    python -m experiments.serving.auto_offload_bench                   # tiny model, CPU sizes
    python -m experiments.serving.auto_offload_bench --smoke           # seconds; run by the tests
                                                               # (no offloaded cell, no warm-up)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax.config import get_config  # noqa: E402
from fo_jax.engine import Engine  # noqa: E402
from fo_jax.engine.auto import AutoEngine  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402
from fo_jax.offload.state import device_bytes_formula  # noqa: E402

CELLS = ("auto", "auto one-way", "resident short", "resident long", "offloaded")


class OneWayAutoEngine(AutoEngine):
    """AutoEngine without moves back (offloaded -> resident): the baseline of "auto"."""

    def _move_back(self) -> int:
        return 0

OUT = os.path.join(os.path.dirname(__file__), "..", "results",
                   "serving", "auto_offload",
                   "auto_offload.jsonl")


def resident_seat_bytes(config, capacity: int) -> int:
    """Device bytes of one resident seat: its KV [L, S, D+R] and indexer keys [G, S, N]."""
    kvb = config.jnp_kv_dtype.itemsize
    return (config.num_layers * capacity * config.kv_width * kvb
            + config.num_groups * capacity * config.index_head_dim * kvb + 4)


def offload_seat_bytes(config, offload: OffloadConfig) -> int:
    """Device bytes of one offloaded seat (hot rows, indexer keys, maps: the design formula)."""
    return device_bytes_formula(config, offload, 1)["total"]


def requests(n: int, prompt_len, output_len, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist(),
             int(rng.integers(output_len[0], output_len[1] + 1))) for _ in range(n)]


def serve(engine, reqs) -> dict:
    """Add every request, step until all finish; wall seconds, tokens, peak running, outputs."""
    start = time.perf_counter()
    ids = [engine.add_request(p, max_tokens=m) for p, m in reqs]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.num_running())
    wall = time.perf_counter() - start
    outputs = engine.run()
    tokens = [outputs[rid].token_ids for rid in ids]
    for rid in ids:
        engine.release(rid)
    return {"wall_s": wall, "output_tokens": sum(map(len, tokens)),
            "tokens_per_s": sum(map(len, tokens)) / wall, "peak_running": peak,
            "tokens": tokens}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--capacity", type=int, default=512, help="tokens per long seat")
    parser.add_argument("--short", type=int, default=64, help="tokens per resident auto seat")
    parser.add_argument("--hot-slots", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=8)
    parser.add_argument("--device-budget-mb", type=float, default=1.0)
    parser.add_argument("--resident-share", type=float, default=0.25,
                        help="share of the budget the auto engine gives resident seats")
    parser.add_argument("--large", type=int, default=12, help="requests of the large batch")
    parser.add_argument("--mixed", type=int, default=24,
                        help="requests of the mixed batch (small and large alternating)")
    parser.add_argument("--small-prompt", type=int, nargs=2, default=[16, 32])
    parser.add_argument("--small-output", type=int, nargs=2, default=[16, 24])
    parser.add_argument("--large-prompt", type=int, nargs=2, default=[32, 64])
    parser.add_argument("--large-output", type=int, nargs=2, default=[64, 128])
    parser.add_argument("--steps-per-call", type=int, default=4)
    parser.add_argument("--prefill-chunk", type=int, default=32)
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS,
                        help="engines to run (auto is always run: the ratios are to it)")
    parser.add_argument("--out", default=OUT, help="append JSON lines here ('' for none)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.capacity, args.short, args.hot_slots, args.page_size = 64, 16, 8, 4
        args.device_budget_mb, args.large, args.prefill_chunk = 0.03, 6, 8
        args.mixed = 8
        args.resident_share = 0.3
        args.small_prompt, args.small_output = [4, 6], [3, 5]
        args.large_prompt, args.large_output = [4, 8], [14, 20]
        args.steps_per_call = 2
        args.cells = ["auto", "auto one-way", "resident short", "resident long"]  # fewer
        # programs to compile
    config = get_config(args.model).replace(max_ways=1)
    if args.smoke:
        config = config.replace(num_layers=1, indexer_layers=(0,), index_topk=4)
    offload = OffloadConfig(hot_slots=args.hot_slots, page_size=args.page_size,
                            capacity=args.capacity)
    params = init_params(config, jax.random.key(0))
    budget = int(args.device_budget_mb * 1e6)
    short_b, long_b = (resident_seat_bytes(config, s) for s in (args.short, args.capacity))
    off_b = offload_seat_bytes(config, offload)
    auto_res = int(args.resident_share * budget) // short_b
    auto_off = (budget - auto_res * short_b) // off_b
    seats = {"resident short": auto_res, "resident long": budget // long_b,
             "offloaded": budget // off_b, "auto": (auto_res, auto_off),
             "auto one-way": (auto_res, auto_off)}
    if min(auto_res, auto_off, seats["resident long"]) < 1:
        raise SystemExit(f"the budget {budget} B holds no seat of a tier (resident short "
                         f"{short_b} B, long {long_b} B, offloaded {off_b} B): raise it")
    kw = dict(decode_steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk)

    def make(cell):
        if cell.startswith("auto"):
            kind = AutoEngine if cell == "auto" else OneWayAutoEngine
            return kind(params, config, resident_seats=auto_res, resident_capacity=args.short,
                        offload=offload, offload_seats=auto_off, **kw)
        if cell == "offloaded":
            return Engine(params, config, seats=seats[cell], offload=offload, **kw)
        cap = args.short if cell == "resident short" else args.capacity
        return Engine(params, config, seats=seats[cell], capacity=cap, **kw)

    workloads = {
        "small": requests(auto_res, args.small_prompt, args.small_output, config.vocab_size, 0),
        "large": requests(args.large, args.large_prompt, args.large_output, config.vocab_size,
                          1),
        "mixed": [r for pair in zip(
            requests(args.mixed // 2, args.small_prompt, args.small_output, config.vocab_size, 2),
            requests(args.mixed - args.mixed // 2, args.large_prompt, args.large_output,
                     config.vocab_size, 3)) for r in pair]}
    meta = run_metadata()
    print(f"auto offload: {config.name}, device budget {budget / 1e6:g} MB: resident seat "
          f"{short_b / 1e3:.1f} kB of {args.short} tokens / {long_b / 1e3:.1f} kB of "
          f"{args.capacity}; offloaded seat {off_b / 1e3:.1f} kB (C = {args.hot_slots}, Z = "
          f"{args.page_size}); N = {args.steps_per_call} steps per call; greedy")
    print(f"{'workload':9s}{'cell':16s}{'seats':>8s}{'peak run':>9s}{'tok/s':>9s}"
          f"{'vs auto':>9s}{'out':>5s}{'back':>5s}{'H2D kB':>9s}{'miss/step':>10s}"
          f"{'same tokens':>13s}")
    rows = []
    for name, reqs in workloads.items():
        results = {}
        for cell in ("auto",) + tuple(c for c in CELLS[1:] if c in args.cells):
            if cell == "resident short" and any(len(p) + m > args.short for p, m in reqs):
                results[cell] = None  # its seats cannot hold these requests
                continue
            engine = make(cell)
            if not args.smoke:
                serve(engine, reqs)  # untimed: compiles every program
            auto = cell.startswith("auto")
            counted = engine.offloaded if auto else engine  # offload statistics
            counted.stats = None
            steps0 = counted.counters["decode_steps"]
            if auto:
                engine.counters = dict.fromkeys(engine.counters, 0)
            fig = serve(engine, reqs)
            fig["migrations"] = engine.counters["migrations"] if auto else 0
            fig["moved_back"] = engine.counters["moved_back"] if auto else 0
            fig["h2d_bytes"] = (0.0 if counted.stats is None
                                else float(np.sum(counted.stats.h2d_bytes)))
            fig["misses"] = (0 if counted.stats is None
                             else int(np.sum(counted.stats.misses)))
            fig["offloaded_decode_steps"] = (counted.counters["decode_steps"] - steps0
                                             if counted.pool is not None or auto else 0)
            fig["misses_per_step"] = fig["misses"] / max(fig["offloaded_decode_steps"], 1)
            results[cell] = fig
        base = results["auto"]["tokens_per_s"]
        want = results["resident long"]["tokens"] if "resident long" in results else None
        for cell, fig in results.items():
            n = seats[cell]
            n_txt = f"{n[0]}+{n[1]}" if isinstance(n, tuple) else str(n)
            if fig is None:
                print(f"{name:9s}{cell:16s}{n_txt:>8s}   cannot hold these requests (prompt + "
                      f"output > {args.short} tokens)")
                rows.append({**meta, "workload": name, "cell": cell, "seats": n_txt,
                             "served": False})
                continue
            same = want is None or fig["tokens"] == want
            print(f"{name:9s}{cell:16s}{n_txt:>8s}{fig['peak_running']:>9d}"
                  f"{fig['tokens_per_s']:>9.1f}{fig['tokens_per_s'] / base:>9.2f}"
                  f"{fig['migrations']:>5d}{fig['moved_back']:>5d}"
                  f"{fig['h2d_bytes'] / 1e3:>9.1f}{fig['misses_per_step']:>10.1f}"
                  f"{'yes' if same else 'NO':>13s}")
            rows.append({**meta, "model": config.name, "workload": name, "cell": cell,
                         "seats": n_txt, "served": True, "device_budget_bytes": budget,
                         "capacity": args.capacity, "short": args.short,
                         "requests": len(reqs), "same_tokens": same,
                         "ratio_to_auto": fig["tokens_per_s"] / base,
                         **{k: v for k, v in fig.items() if k != "tokens"}})
    write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()

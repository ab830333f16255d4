"""Serving benchmark: the engine under a Poisson stream of requests, resident vs paged on the
device vs offloaded at the same device memory, and N decode steps per program vs 1.

For each cell the engine (`fo_jax.engine.Engine`) gets what a device budget holds
(`--device-budget-mb`): resident, as many seats as it holds (a seat holds its whole KV and
indexer keys); offloaded, as many seats (C + 2Z rows per layer plus its indexer keys and maps;
the KV pool in host memory); paged on the device ("paged_device": the offloaded engine with its
page pool in device memory, `OffloadConfig(host_memory_kind="device")`), as many seats as the
budget holds with the pages of the workload's mean request each (at most `--max-seats`; the
pool holds at least one seat's capacity) and a pool of the pages the rest of the budget holds
(KV + indexer keys per page), with admission and preemption by bytes
(`device_bytes` = the budget, reserve="prompt"): its concurrency follows the tokens the
requests hold, not their capacity. Each serves the same
workload: `--requests` requests arriving as a Poisson process of `--rate` requests per second,
random prompts of `--prompt-len` tokens and outputs of `--output-len` tokens (uniform in each
range), greedy. The host clock drives arrivals, so a cell whose steps are slower sees more
requests waiting. Per cell: seats, mean and peak concurrency (running requests per step),
output tokens per second, TTFT and time per output token (p50 / p99), compiled programs per
output token (host round trips), the host share (the share of the device's time it sat idle
waiting for the engine's host work: scheduling, tables, sampling bookkeeping, detokenizing, and
between steps the caller's; `fo_jax.engine.overlap.DeviceClock`) and the device's idle time per
engine step. Ratios are to the first cell of the same run (these machines are noisy).

`--overlap on off` serves each Poisson cell twice, with the engine's overlap (decode call
n + 1 dispatched before call n is read back, `SchedulerSettings.overlap`, the default) and
without it: the same workload, the same tokens, and the host share each leaves.

    python -m experiments.serving.serving_bench                         # small model, CPU sizes
    python -m experiments.serving.serving_bench --smoke                 # seconds; run by the tests
    python -m experiments.serving.serving_bench --closed-loop --seats 16 --workloads poisson
    python -m experiments.serving.serving_bench --closed-loop --workloads poisson \
        --steps-per-call 1 --overlap on off                            # overlap against none

With `--closed-loop` the engine runs at saturation instead: the same requests, arrival times
ignored, `--seats` of them in the engine at once (each finished one replaced at once by the
next, `fo_jax.engine.bench.run_workload(concurrency=...)`) until all are done, on each of
`--paths` (resident and offloaded) with the same `--seats` seats: the paths compare at equal
batch, so the offloaded / resident TPOT ratio is the cost of offloading per step (the target:
<= 1.2). The budget then sizes nothing.

With `--shared-prefix F` (default 0.8) a second workload gives F of the prompts one
`--prefix-len`-token system prompt before their own tokens, served with and without the prefix
cache (`Engine(prefix_cache=True)`) on each path of `--prefix-paths` (offloaded: cached pages
mapped; resident: cached rows copied into the seat from a prefix store of one seat's rows, on
top of the budget's seats): prompt tokens prefilled, TTFT, throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax.config import get_config  # noqa: E402
from fo_jax.engine import Engine, MemoryCosts  # noqa: E402
from fo_jax.engine.bench import poisson_workload, run_workload  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload.config import HOST_ACCESS, OffloadConfig  # noqa: E402
from fo_jax.offload.state import device_bytes_formula  # noqa: E402


PATHS = ("resident", "paged_device", "offload")


def paged_device_layout(config, offload: OffloadConfig, budget: int, max_seats: int,
                        mean_tokens: int):
    """(seats, pages, costs) of the paged device pool in `budget` bytes: as many seats as the
    budget holds with the pages of `mean_tokens` tokens each (the workload's mean prompt +
    output: what a request holds on average), at most `max_seats`, fewer so that the pool
    holds at least one seat's capacity; the pool gets the pages of KV + indexer keys the rest
    of the budget holds (`MemoryCosts` with pool_memory="device"). (0, 0, costs) when one seat
    and its capacity do not fit. O(max_seats)."""
    costs = MemoryCosts.from_config(config, page_size=offload.page_size,
                                    hot_slots=offload.hot_slots, num_buffers=2,
                                    pool_memory="device")
    per_page, full = costs.held_page_device_bytes, offload.capacity // offload.page_size
    mean = costs.seat_device_bytes + costs.pages(mean_tokens) * per_page
    for seats in range(min(max_seats, max(1, budget // mean)), 0, -1):
        pages = (budget - seats * costs.seat_device_bytes) // per_page
        if pages >= full:
            return seats, int(pages), costs
    return 0, 0, costs


def seat_bytes(config, path: str, capacity: int, offload: OffloadConfig | None) -> int:
    """Device bytes one seat's state takes on `path` ("resident" or "offload")."""
    if path == "resident":
        kvb = config.jnp_kv_dtype.itemsize
        return (config.num_layers * capacity * config.kv_width * kvb
                + config.num_groups * capacity * config.index_head_dim * kvb + 4)
    return device_bytes_formula(config, offload, 1)["total"]


def workload(args, vocab: int, seed: int = 0, shared: float = 0.0):
    """The benchmark's requests (`fo_jax.engine.bench.poisson_workload`)."""
    return poisson_workload(args.requests, rate=args.rate, prompt_len=tuple(args.prompt_len),
                            output_len=tuple(args.output_len), vocab=vocab, seed=seed,
                            shared_fraction=shared, prefix_len=args.prefix_len)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--capacity", type=int, default=1024, help="tokens per seat")
    parser.add_argument("--hot-slots", type=int, default=None,
                        help="offloaded hot cache (default: index_topk)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-budget-mb", type=float, default=64.0,
                        help="device bytes for the seats' KV state (seats = budget / seat)")
    parser.add_argument("--max-seats", type=int, default=16)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[64, 384])
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=None,
                        help="decode steps per program, one cell each (default: 1 16; smoke: "
                             "1 4)")
    parser.add_argument("--shared-prefix", type=float, default=0.8,
                        help="prefix workload: fraction of prompts sharing the system prompt "
                             "(0: skip that workload)")
    parser.add_argument("--prefix-len", type=int, default=512,
                        help="prefix workload: tokens of the shared system prompt")
    parser.add_argument("--prefix-paths", nargs="+", choices=("offload", "resident"),
                        default=["offload", "resident"],
                        help="prefix workload: the paths served with and without the cache")
    parser.add_argument("--workloads", nargs="+", choices=("poisson", "shared_prefix"),
                        default=["poisson", "shared_prefix"])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=None,
                        help="poisson workload: the paths measured (default: all; closed "
                             "loop: resident offload)")
    parser.add_argument("--closed-loop", action="store_true",
                        help="poisson workload: arrival times ignored, --seats requests in the "
                             "engine at once on every path (saturation)")
    parser.add_argument("--seats", type=int, default=None,
                        help="closed loop: seats of every path (default: --max-seats)")
    parser.add_argument("--overlap", nargs="+", choices=("on", "off"), default=["on"],
                        help="poisson workload: serve each cell with the engine's overlap on "
                             "(the default) and / or off")
    parser.add_argument("--host-access", default=None, choices=HOST_ACCESS,
                        help="how the offloaded engine moves rows (default: the backend's)")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        # Prompts of at most 2 chunks, 3 with the one-chunk system prompt: the offloaded
        # prefill compiles for histories of 0, 2 and 4 pages (its buckets), no more. The budget
        # holds 2 resident seats (5 offloaded, 4 paged on the device): a closed loop at 2 seats
        # then runs the resident Poisson cells' programs (compiled once in one process).
        args.model, args.capacity, args.page_size, args.requests = "tiny", 64, 4, 5
        args.prompt_len, args.output_len, args.prefill_chunk = [4, 16], [2, 6], 8
        args.rate, args.device_budget_mb = 50.0, 0.06
        args.steps_per_call = args.steps_per_call or [1, 4]
        args.prefix_len, args.prefix_paths = 8, ["offload"]
    args.steps_per_call = args.steps_per_call or [1, 16]
    if args.paths is None:
        args.paths = ["resident", "offload"] if args.closed_loop else list(PATHS)
    if args.closed_loop and "paged_device" in args.paths:
        parser.error("--closed-loop runs every path at the same --seats; paged_device sizes "
                     "its seats by the device budget: leave it out of --paths")
    if args.seats is not None and not args.closed_loop:
        parser.error("--seats is for --closed-loop (the Poisson cells size seats by the "
                     "device budget)")
    seats_closed = args.seats or args.max_seats
    config = get_config(args.model).replace(max_ways=1)
    if args.smoke:  # one indexer group (each group is its own code in every program)
        config = config.replace(name=f"{config.name}-1group", indexer_layers=(0,))
    if args.capacity > config.max_seq_len:
        config = config.replace(max_seq_len=args.capacity)
    hot = args.hot_slots or config.index_topk
    offload = OffloadConfig(hot_slots=hot, page_size=args.page_size, capacity=args.capacity,
                            host_access=args.host_access)
    params = init_params(config, jax.random.key(0))
    requests = workload(args, config.vocab_size)
    budget = int(args.device_budget_mb * 1e6)
    meta = run_metadata()
    print(f"serving: {config.name}, seat capacity {args.capacity}, device budget "
          f"{budget / 1e6:g} MB, {args.requests} requests at {args.rate:g}/s, prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
          f"{args.output_len[1]} tokens, greedy; C = {hot} when offloaded (host_access "
          f"{offload.host_access})"
          + (f"; closed loop: {seats_closed} seats on every path, every seat busy"
             if args.closed_loop else ""))
    print(f"{'cell':22s}{'seats':>6s}{'mean/peak run':>15s}{'tok/s':>9s}{'ratio':>7s}"
          f"{'TTFT p50/p99 s':>17s}{'TPOT p50 ms':>13s}{'prog/tok':>10s}{'host share':>12s}"
          f"{'idle ms/step':>14s}{'preempt':>9s}")
    rows, base = [], None
    for path in args.paths if "poisson" in args.workloads else ():
        kwargs, pages = {}, None
        if path == "paged_device":
            mean_tokens = (sum(args.prompt_len) + sum(args.output_len)) // 2
            seats, pages, costs = paged_device_layout(config, offload, budget, args.max_seats,
                                                      mean_tokens)
            per_seat = costs.seat_device_bytes
            kwargs = dict(offload=dataclasses.replace(offload, host_memory_kind="device"),
                          num_pages=pages, device_bytes=budget, reserve="prompt",
                          num_buffers=2)
        else:
            per_seat = seat_bytes(config, path, args.capacity, offload)
            seats = seats_closed if args.closed_loop else min(args.max_seats, budget // per_seat)
            kwargs = dict(offload=None if path == "resident" else offload)
        if seats < 1:
            print(f"{path}: one seat (and its capacity) needs more than the budget; skipped")
            continue
        for n, overlap in [(n, o) for n in args.steps_per_call for o in args.overlap]:
            engine = Engine(params, config, seats=int(seats), capacity=args.capacity,
                            decode_steps_per_call=n, prefill_chunk=args.prefill_chunk,
                            overlap=overlap == "on", **kwargs)
            fig = run_workload(engine, requests,
                               concurrency=int(seats) if args.closed_loop else None)
            base = base or fig["tokens_per_s"]
            name = f"{path} N={n}" + (f" overlap {overlap}" if len(args.overlap) > 1 else "")
            tpot = "-" if fig["tpot_p50"] is None else f"{fig['tpot_p50'] * 1e3:.1f}"
            print(f"{name:22s}{seats:>6d}{fig['mean_running']:>9.2f}/{fig['peak_running']:<5d}"
                  f"{fig['tokens_per_s']:>9.1f}{fig['tokens_per_s'] / base:>7.2f}"
                  f"{fig['ttft_p50']:>8.2f}/{fig['ttft_p99']:<8.2f}{tpot:>13s}"
                  f"{fig['programs_per_token']:>10.3f}{fig['host_share']:>12.3f}"
                  f"{fig['device_idle_per_step_s'] * 1e3:>14.2f}"
                  f"{engine.counters['preemptions']:>9d}")
            rows.append({**meta, "model": config.name, "path": path, "steps_per_call": n,
                         "overlap": overlap == "on",
                         "workload": "closed_loop" if args.closed_loop else "poisson",
                         "host_access": offload.host_access if path != "resident" else None,
                         "pool_size": pages,
                         "preemptions": engine.counters["preemptions"],
                         "seats": int(seats), "seat_device_bytes": int(per_seat),
                         "device_budget_bytes": budget, "capacity": args.capacity,
                         "hot_slots": hot if path != "resident" else None,
                         "requests": args.requests, "rate": args.rate,
                         "ratio": fig["tokens_per_s"] / base, **fig})
            write_jsonl(args.out, rows[-1:])  # cell by cell: a cell cut short loses no other
    if args.closed_loop:
        print(tpot_ratio_line(rows))
    if len(args.overlap) > 1:
        print(overlap_line(rows))
    if args.shared_prefix > 0 and "shared_prefix" in args.workloads:
        prefix_rows = _prefix_cells(args, config, params, offload, budget, meta)
        write_jsonl(args.out, prefix_rows)
        rows += prefix_rows
    return rows


def overlap_line(rows) -> str:
    """Host share and device idle ms per step with overlap against without, per path and
    steps per call, from the rows of one run."""
    parts = []
    for path, n in dict.fromkeys((r["path"], r["steps_per_call"]) for r in rows):
        by = {r["overlap"]: r for r in rows if (r["path"], r["steps_per_call"]) == (path, n)}
        if {True, False} <= set(by):
            on, off = by[True], by[False]
            parts.append(f"{path} N={n} {on['host_share']:.3f} vs {off['host_share']:.3f} "
                         f"({on['device_idle_per_step_s'] * 1e3:.2f} vs "
                         f"{off['device_idle_per_step_s'] * 1e3:.2f} ms idle per step)")
    return ("host share with overlap vs without: "
            + ("; ".join(parts) or "no pair of cells with and without overlap"))


def tpot_ratio_line(rows) -> str:
    """Offloaded / resident TPOT p50 per steps-per-call, from the closed-loop rows (the first
    `--overlap` setting's)."""
    parts = []
    for n in sorted({r["steps_per_call"] for r in rows}):
        by = {}
        for r in rows:
            if r["steps_per_call"] == n:
                by.setdefault(r["path"], r)
        if {"resident", "offload"} <= set(by) and by["resident"]["tpot_p50"] \
                and by["offload"]["tpot_p50"] is not None:
            parts.append(f"N={n} x{by['offload']['tpot_p50'] / by['resident']['tpot_p50']:.2f}")
    return ("TPOT p50 offloaded / resident at saturation (target <= 1.2): "
            + (", ".join(parts) or "no pair of resident and offloaded cells"))


def _prefix_cells(args, config, params, offload, budget, meta):
    """The shared-prefix workload on each of `--prefix-paths`, without and with the prefix
    cache (resident: a prefix store of one seat's rows, the engine's default)."""
    requests = workload(args, config.vocab_size, seed=1, shared=args.shared_prefix)
    n = max(args.steps_per_call)
    print(f"\nshared prefix: {args.shared_prefix:.0%} of {args.requests} prompts start with the "
          f"same {args.prefix_len} tokens; N={n}")
    print(f"{'cell':30s}{'seats':>6s}{'prefilled':>10s}{'cached':>8s}{'tok/s':>9s}"
          f"{'TTFT p50/p99 s':>17s}")
    rows, chunk = [], args.prefill_chunk - args.prefill_chunk % offload.page_size
    for path in args.prefix_paths:
        seats = int(min(args.max_seats, budget // seat_bytes(config, path, args.capacity,
                                                             offload)))
        if seats < 1:
            print(f"{path}: one seat does not fit the budget; skipped")
            continue
        for cache in (False, True):
            engine = Engine(params, config, seats=seats, capacity=args.capacity,
                            offload=offload if path == "offload" else None,
                            decode_steps_per_call=n,
                            prefill_chunk=max(chunk, offload.page_size), prefix_cache=cache)
            fig = run_workload(engine, requests)
            cached = fig["cached_tokens"]
            name = f"{path}, prefix cache {'on' if cache else 'off'}"
            print(f"{name:30s}{seats:>6d}{fig['prefill_tokens']:>10d}{cached:>8d}"
                  f"{fig['tokens_per_s']:>9.1f}{fig['ttft_p50']:>8.2f}/{fig['ttft_p99']:<8.2f}")
            rows.append({**meta, "model": config.name, "path": path,
                         "workload": "shared_prefix", "prefix_cache": cache,
                         "shared_fraction": args.shared_prefix, "prefix_len": args.prefix_len,
                         "steps_per_call": n, "seats": seats, "cached_tokens": cached, **fig})
    return rows


if __name__ == "__main__":
    main()

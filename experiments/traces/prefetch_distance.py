"""Prefetch distance and buffer count of the offloaded prefill: modelled exposure, measured cost.

Question: how far ahead must the offloaded prefill load a layer's history (the distance d of
`onload_layer_map`), and how many device layer buffers n does that take, for the loads and
write-backs to hide behind compute? Two parts, one run, one JSON line per cell:

  model     the three-engine pipeline model (fo_jax.offload.pipeline_model: H2D, compute, D2H, or
            one shared copy engine) on the H200 profiles (55 GB/s each way, 790 TFLOP/s bf16),
            for the real presets at 64k .. 1M context (a whole chunked prefill: the sum over its
            chunks), d in {1, 2, 3}, n in {3, 4, 6} (pairs with d <= n - 2). Each line also
            carries the design's bound, sum over layers of max(0, tau_H2D(l) - d_on(l) *
            tau_compute), which the simulated exposure equals while loads do not queue and
            exceeds once the copy engine is the bottleneck.
  measure   wall time of the real offloaded prefill (fo_jax.offload.prefill) for each (d, n)
            (d from --measure-distances, default --distances) and of the resident prefill
            (fo_jax.resident) in the same run, same tokens: median of a few runs after a
            warm-up, and the ratio. On a CPU the memory moves compile to nothing and there is
            no asynchronous copy engine, so this measures the offload path's overhead (buffer
            bookkeeping, write-backs, reloading history every chunk), not overlap.

    python -m experiments.traces.prefetch_distance                 # CPU: model + measurement
    python -m experiments.traces.prefetch_distance --smoke         # seconds; run by the tests
    python -m experiments.traces.prefetch_distance --gpu           # the GPU command (needs a GPU)
    python -m experiments.traces.plot_prefetch_distance            # PNG from the JSON lines

Results go to results/prefetch_distance.jsonl (appended); the table of exposed time for glm52 at
128k on the H200 profiles is printed.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import resident  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload import prefill as offload_prefill  # noqa: E402
from fo_jax.offload.layer_schedule import default_onload_layer_map  # noqa: E402
from fo_jax.offload.pipeline_model import (  # noqa: E402
    HARDWARE_PROFILES,
    chunk_layer_times,
    simulate_prefill_pipeline,
)

DISTANCES = (1, 2, 3)
BUFFERS = (3, 4, 6)
PRESETS = ("deepseek_v32", "glm5", "glm52")
CONTEXTS = (65_536, 131_072, 262_144, 524_288, 1_048_576)
CHUNKS = (2_048, 4_096, 65_536)
PROFILES = ("h200", "h200_shared_copy")
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "..", "results",
                           "prefetch_distance.jsonl")


def valid_pairs(distances, buffers, num_layers):
    """(d, n) pairs a prefill accepts: d <= max(1, n - 2) and n <= L."""
    return [(d, n) for n in buffers for d in distances if d <= max(1, n - 2) and n <= num_layers]


# Model ------------------------------------------------------------------------------------------


def bound_exposed(load, compute, onload_layer_map) -> float:
    """sum over layers l >= 1 of max(0, tau_H2D(l) - window(l)), window(l) = compute of the layers
    from the one that issues l's load to l - 1 (d_on(l) layers): the design's bound."""
    issued = {j: i for i, targets in enumerate(onload_layer_map) for j in targets}
    return float(sum(max(0.0, load[j] - compute[issued[j]:j].sum()) for j in issued))


def model_rows(presets, contexts, chunks, profiles, pairs_for, meta):
    """One row per (preset, profile, chunk, d, n, context): a whole prefill of `context` tokens
    in `chunk`-token forwards, summed over its forwards."""
    rows = []
    for name in presets:
        config = get_config(name)
        for profile_name in profiles:
            profile = HARDWARE_PROFILES[profile_name]
            for chunk in chunks:
                usable = [c for c in contexts if c % chunk == 0 and c <= config.max_seq_len]
                if not usable:
                    continue
                num_chunks = max(usable) // chunk
                times = [chunk_layer_times(config, (k + 1) * chunk, chunk, profile)
                         for k in range(num_chunks)]
                for distance, num_buffers in pairs_for(config.num_layers):
                    schedule = default_onload_layer_map(config.num_layers, distance, num_buffers)
                    acc = dict(exposed_load_s=0.0, buffer_stall_s=0.0, writeback_tail_s=0.0,
                               total_s=0.0, no_offload_s=0.0, bound_exposed_s=0.0)
                    for k, (load, compute, writeback) in enumerate(times):
                        result = simulate_prefill_pipeline(
                            load, compute, writeback, onload_layer_map=schedule,
                            num_buffers=num_buffers,
                            shared_copy_engine=profile.shared_copy_engine)
                        acc["exposed_load_s"] += float(result.exposed_load.sum())
                        acc["buffer_stall_s"] += float(result.buffer_stall.sum())
                        acc["writeback_tail_s"] += result.writeback_tail
                        acc["total_s"] += result.total_time
                        acc["no_offload_s"] += result.no_offload_time
                        acc["bound_exposed_s"] += bound_exposed(load, compute, schedule)
                        context = (k + 1) * chunk
                        if context in usable:
                            rows.append({
                                **meta, "kind": "model", "preset": name, "context": context,
                                "chunk": chunk, "profile": profile_name,
                                "shared_copy_engine": profile.shared_copy_engine,
                                "h2d_bytes_per_s": profile.h2d_bytes_per_s,
                                "flops_per_s": profile.flops_per_s,
                                "distance": distance, "num_buffers": num_buffers,
                                **acc,
                                "overhead_s": acc["total_s"] - acc["no_offload_s"],
                                "last_chunk_exposed_s": float(result.exposed_load.sum()),
                                "last_chunk_layer_load_s": float(load[1]),
                                "last_chunk_layer_compute_s": float(np.median(compute)),
                            })
    return rows


def print_table(rows, preset: str, context: int) -> None:
    """Exposed load time (ms, whole prefill) per distance (rows) and buffer count (columns)."""
    cells = [r for r in rows if r["kind"] == "model" and r["preset"] == preset
             and r["context"] == context]
    for profile in sorted({r["profile"] for r in cells}):
        for chunk in sorted({r["chunk"] for r in cells}):
            sub = {(r["distance"], r["num_buffers"]): r for r in cells
                   if r["profile"] == profile and r["chunk"] == chunk}
            if not sub:
                continue
            any_row = next(iter(sub.values()))
            print(f"\n{preset} @ {context // 1024}k, chunk {chunk}, {profile}: exposed load ms "
                  f"(+ write-back tail ms) over the whole prefill; compute "
                  f"{any_row['no_offload_s'] * 1e3:.1f} ms; per layer of the last chunk: load "
                  f"{any_row['last_chunk_layer_load_s'] * 1e3:.2f} ms, compute "
                  f"{any_row['last_chunk_layer_compute_s'] * 1e3:.2f} ms")
            print("  d \\ n " + "".join(f"{n:>22}" for n in BUFFERS))
            for d in DISTANCES:
                line = f"  d={d}  "
                for n in BUFFERS:
                    r = sub.get((d, n))
                    line += (f"{'n/a':>22}" if r is None else
                             f"{r['exposed_load_s'] * 1e3:>13.1f} (+{r['writeback_tail_s'] * 1e3:.1f})")
                print(line)


def print_context_table(rows, preset: str, chunk: int, profile: str) -> None:
    """Exposed load time (ms, whole prefill) per context (rows) and (d, n) pair (columns)."""
    cells = {(r["context"], r["distance"], r["num_buffers"]): r for r in rows
             if r["kind"] == "model" and (r["preset"], r["chunk"], r["profile"])
             == (preset, chunk, profile)}
    if not cells:
        return
    pairs = sorted({(d, n) for _, d, n in cells}, key=lambda p: (p[1], p[0]))
    print(f"\n{preset}, chunk {chunk}, {profile}: exposed load ms over the whole prefill "
          "(compute ms)")
    print("  context " + "".join(f"{f'd={d} n={n}':>12}" for d, n in pairs) + f"{'compute':>12}")
    for context in sorted({c for c, _, _ in cells}):
        line = f"  {context // 1024:>5}k "
        for d, n in pairs:
            line += f"{cells[(context, d, n)]['exposed_load_s'] * 1e3:>12.1f}"
        any_row = cells[(context,) + pairs[0]]
        print(line + f"{any_row['no_offload_s'] * 1e3:>12.1f}")


def print_buffer_limits(rows, threshold: float = 0.01) -> None:
    """Per preset, profile and chunk: the first context at which n = 4 (d = 2) exposes more than
    `threshold` of the compute time, and n = 6 (d = 3) at the same context."""
    print(f"\nwhere 4 buffers (d=2) stop hiding the copies (exposed > {threshold:.0%} of compute):")
    keys = sorted({(r["preset"], r["profile"], r["chunk"]) for r in rows if r["kind"] == "model"})
    for preset, profile, chunk in keys:
        cells = {(r["context"], r["distance"], r["num_buffers"]): r for r in rows
                 if r["kind"] == "model" and (r["preset"], r["profile"], r["chunk"])
                 == (preset, profile, chunk)}
        found = None
        for context in sorted({c for c, _, _ in cells}):
            four = cells.get((context, 2, 4))
            if four and four["exposed_load_s"] > threshold * four["no_offload_s"]:
                found = (context, four, cells.get((context, 3, 6)))
                break
        if found is None:
            print(f"  {preset:>12} {profile:>16} chunk {chunk:>6}: hidden up to the longest "
                  "context")
            continue
        context, four, six = found
        six_text = (f"; n=6 d=3: {six['exposed_load_s'] * 1e3:.1f} ms" if six else "")
        print(f"  {preset:>12} {profile:>16} chunk {chunk:>6}: from {context // 1024}k: n=4 d=2 "
              f"exposes {four['exposed_load_s'] * 1e3:.1f} ms of "
              f"{four['no_offload_s'] * 1e3:.1f} ms compute{six_text}")


# Measurement ------------------------------------------------------------------------------------


def _timed(paths, *, warmup: int, runs: int) -> dict[str, list[float]]:
    """Wall seconds of each path's run(state) over fresh states (creation not timed).

    paths: {name: (run, make_state)}. Runs are interleaved (every path once per round), so a
    noisy, shared machine's drift hits all paths alike.
    """
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(warmup + runs):
        for name, (run, make_state) in paths.items():
            state = jax.block_until_ready(make_state())
            start = time.perf_counter()
            jax.block_until_ready(run(state))
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def measure_rows(args, meta):
    """Offloaded vs resident chunked prefill, same tokens, same run."""
    base = get_config(args.preset)
    config = base.replace(
        num_layers=args.layers,
        indexer_layers=tuple(range(0, args.layers, max(1, args.layers // 4))),
        max_seq_len=max(base.max_seq_len, args.capacity))
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (args.batch, args.capacity),
                                      dtype=np.int32))
    chunks = [tokens[:, lo:lo + args.chunk] for lo in range(0, args.capacity, args.chunk)]

    def run_resident(state):
        for chunk in chunks:
            logits, state = resident.prefill(params, state, chunk, config=config)
        return logits, state

    def make_resident():
        return resident.ResidentState.create(config, batch=args.batch, capacity=args.capacity)

    def run_offload(state, d, n):
        for chunk in chunks:
            logits, state = offload_prefill.prefill(params, state, chunk, config=config,
                                                    distance=d, num_buffers=n)
        return logits, state

    def make_offload():
        return offload_prefill.PrefillState.create(
            config, batch=args.batch, capacity=args.capacity, page_size=args.page_size)

    pairs = valid_pairs(args.measure_distances or args.distances, args.buffers,
                        config.num_layers)
    paths = {"resident": (run_resident, make_resident)}
    for d, n in pairs:
        paths[f"d={d} n={n}"] = (functools.partial(run_offload, d=d, n=n), make_offload)
    times = _timed(paths, warmup=args.warmup, runs=args.runs)

    common = dict(preset=args.preset, num_layers=config.num_layers, batch=args.batch,
                  capacity=args.capacity, chunk=args.chunk, page_size=args.page_size,
                  runs=args.runs, warmup=args.warmup)
    base_median = statistics.median(times["resident"])
    rows = [{**meta, "kind": "measured", "path": "resident", **common, "distance": None,
             "num_buffers": None, "median_s": base_median, "times_s": times["resident"],
             "ratio_to_resident": 1.0}]
    print(f"\nmeasured on {meta['backend']} ({meta['device']}): {args.preset} with "
          f"{config.num_layers} layers, batch {args.batch}, {args.capacity} tokens in chunks of "
          f"{args.chunk}; median of {args.runs} interleaved runs after {args.warmup} warm-up")
    if meta["backend"] == "cpu":
        print("  (a CPU has no asynchronous copy engine and host/device moves compile to nothing:"
              " this is the offload path's overhead, not overlap)")
    print(f"  resident          {base_median * 1e3:9.1f} ms")
    for d, n in pairs:
        got = times[f"d={d} n={n}"]
        median = statistics.median(got)
        rows.append({**meta, "kind": "measured", "path": "offload", **common, "distance": d,
                     "num_buffers": n, "median_s": median, "times_s": got,
                     "ratio_to_resident": median / base_median})
        print(f"  offload d={d} n={n}   {median * 1e3:9.1f} ms   x{median / base_median:.2f} of "
              "resident")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("model", "measure", "both"), default="both")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--gpu", action="store_true",
                        help="GPU sizes for the measurement; fails unless the backend is a GPU")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--chunks", type=int, nargs="+", default=list(CHUNKS),
                        help="tokens per prefill forward in the model")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--distances", type=int, nargs="+", default=list(DISTANCES))
    parser.add_argument("--buffers", type=int, nargs="+", default=list(BUFFERS))
    parser.add_argument("--measure-distances", type=int, nargs="+", default=None,
                        help="distances d of the measurement (default: --distances); each "
                             "valid (d, n) compiles its own offloaded prefill")
    parser.add_argument("--preset", default="small", help="model of the measurement")
    parser.add_argument("--layers", type=int, default=8, help="layers of the measured model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=1024, help="tokens prefilled")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per measured forward")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT, help="append JSON lines here ('' = none)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.presets, args.contexts, args.chunks = ["glm52"], [65_536, 131_072], [65_536]
        args.preset, args.layers, args.capacity, args.chunk = "tiny", 4, 32, 16
        args.page_size, args.runs, args.warmup = 8, 1, 1
        args.distances, args.buffers = [1, 2], [4]
        # The model is arithmetic (both distances); the measurement compiles: d = 2 only (two
        # loads in flight), against the resident baseline.
        args.measure_distances = [2]
    if args.gpu:
        if jax.default_backend() != "gpu":
            parser.error(f"--gpu needs a GPU backend, got {jax.default_backend()!r}")
        args.capacity, args.chunk, args.page_size, args.runs = 32_768, 4_096, 64, 5
    if args.capacity % args.chunk or args.capacity % args.page_size:
        parser.error(f"--capacity {args.capacity} must be a multiple of --chunk {args.chunk} "
                     f"and --page-size {args.page_size}")

    meta = run_metadata()
    rows = []
    if args.what in ("model", "both"):
        rows += model_rows(args.presets, args.contexts, args.chunks, args.profiles,
                           lambda layers: valid_pairs(args.distances, args.buffers, layers), meta)
        preset = "glm52" if "glm52" in args.presets else args.presets[0]
        context = 131_072 if 131_072 in args.contexts else args.contexts[0]
        print_table(rows, preset, context)
        for chunk in args.chunks:
            for profile in args.profiles:
                print_context_table(rows, preset, chunk, profile)
        print_buffer_limits(rows)
    if args.what in ("measure", "both"):
        rows += measure_rows(args, meta)
    write_jsonl(args.out, rows)
    if args.out:
        print(f"\n{len(rows)} JSON lines appended to {os.path.normpath(args.out)}")
    return rows


if __name__ == "__main__":
    main()

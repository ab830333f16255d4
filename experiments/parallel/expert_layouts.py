"""Expert layouts on 8 devices: all-to-all against replicated attention, same requests, one run.

The offloaded decode step of a MoE model (`fo_jax.sharded_steps`, one compiled program per
layout) on the same B requests and the same cache under three layouts:

  all-to-all data 8      attention data-parallel on every device, each device 1/8 of the
                         experts, 3 all-to-alls per MoE layer (`sharding.ALL_TO_ALL_RULES`)
  replicated expert 8    one data rank: its tokens, cache and attention replicated on the 8
                         devices, 1/8 of the experts each, one all-reduce per MoE layer
  replicated expert 2    4 data ranks of 2 devices, 1/2 of the experts each (`sharding.RULES`)

The steps of the layouts are interleaved (step t of every layout, then step t + 1), each fed
its own greedy tokens. Per layout: the median step time, tokens/s (B / step), its ratio to
replicated expert 8 measured in the same run, each device's expert bytes (read from the
arrays' shards), the greedy tokens (equal across layouts: the same requests) and the
exchange's share of the step.

The exchange's share is an estimate, not a profile: a second jitted program runs only the
compiled step's collectives (read from its optimized HLO: opcode, shapes, dtype), once per MoE
layer as the step's loop does, chained so none overlaps another, on buffers of the step's
shapes; its median time over the step's median time is the share. It leaves out what the
step's own collectives overlap with computation and the routing's packing around them, so
read it as the order of the exchange's cost, not its exact part.

On a CPU the 8 devices are simulated (XLA_FLAGS=--xla_force_host_platform_device_count=8, set
here before jax starts) and share the machine's cores: the step time sums the work of all 8
devices, so a layout that replicates attention pays it once per device here.

    python -m experiments.parallel.expert_layouts               # writes the results file
    python -m experiments.parallel.expert_layouts --smoke       # small shapes; the tests
    python -m experiments.parallel.expert_layouts \\
        --table experiments/results/parallel/expert_layouts/expert_layouts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

DEVICES = 8
FLAG = "--xla_force_host_platform_device_count"
if "jax" not in sys.modules and FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" {FLAG}={DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import hlo_checks, sharded_steps, sharding  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.model import dsa  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402
from fo_jax.offload.state import DecodeState  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "results", "parallel",
                           "expert_layouts", "expert_layouts.jsonl")
# (name, layout, expert): data = 8 / expert for the replicated layout, 8 for all-to-all.
LAYOUTS = (("all-to-all data 8", "all-to-all", DEVICES),
           ("replicated expert 8 x data 1", "replicated", DEVICES),
           ("replicated expert 2 x data 4", "replicated", 2))
BASELINE = LAYOUTS[1][0]
EXPERTS = ("w1", "w2", "w3")


def numpy_params(config, seed):
    """Weights of `dsa.init_params`' shapes, dtypes and distributions (unit norms, zero
    biases, normal(0, fan_in^-0.5) matrices), drawn with numpy: its one program that draws
    them all takes longer to compile than this run's steps on 8 simulated devices."""
    rng = np.random.default_rng(seed)
    treedef, specs = dsa._leaf_specs(config)
    leaves = []
    for kind, shape, dtype in specs:
        if kind in ("ones", "zeros"):
            value = np.full(shape, 1.0 if kind == "ones" else 0.0, np.float32)
        else:
            value = rng.standard_normal(shape, np.float32)
            value *= 1.0 if kind == "embed" else shape[-2] ** -0.5
        leaves.append(jnp.asarray(value.astype(jnp.dtype(dtype))))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def cache_state(config, offload, batch, context, seed, heavy=0.1, boost=4.0):
    """The offloaded state of `batch` requests of `context` random tokens each, drawn with
    numpy (experiments/common.py's `synthetic_states` without its jax.random programs): a `heavy`
    share of the tokens with indexer keys `boost` times longer, which the indexer keeps
    selecting step after step."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(config.jnp_kv_dtype)
    kv = rng.standard_normal((config.num_layers, batch, offload.capacity, config.kv_width),
                             np.float32).astype(dtype)
    keys = rng.standard_normal((config.num_groups, batch, offload.capacity,
                                config.index_head_dim), np.float32)
    keys = np.where(rng.random((1, batch, offload.capacity, 1)) < heavy, keys * boost, keys)
    lengths = np.full((batch,), context, np.int32)
    return DecodeState.from_resident(kv, keys.astype(dtype), lengths, config=config,
                                     offload=offload)


def expert_bytes(placed) -> int:
    """Bytes of the routed experts (w1, w2, w3, FP8 scales too) one device holds, read from
    the placed arrays' shards."""
    return sum(x.addressable_shards[0].data.nbytes for name in EXPERTS
               for x in jax.tree.leaves(placed["moe"][name]))


def exchange_program(found, mesh, moe_layers: int):
    """(program, buffers): a jitted program running `found` (the step's collectives,
    `hlo_checks.collectives`) `moe_layers` times in a loop, each on the previous one's result
    (nothing overlaps), on buffers of their shapes on every device."""
    axes = {"all-to-all": "data", "all-reduce": "expert"}
    unknown = {c.opcode for c in found} - set(axes)
    if unknown:
        raise ValueError(f"the step holds collectives {sorted(unknown)} this estimate does not "
                         f"time; it times {sorted(axes)}")
    shapes = []
    for c in found:
        arrays = c.arrays if c.opcode == "all-reduce" else c.arrays[:1]  # all-to-all: per peer
        dtype, dims = arrays[0]
        if c.opcode == "all-to-all":  # XLA:CPU splits it per peer: the buffer is their concat
            dims = (dims[0] * len(c.arrays),) + tuple(dims[1:])
        shapes.append((c.opcode, jnp.dtype(_NUMPY[dtype]), dims))
    names = mesh.axis_names

    def body(*bufs):
        def one(_, bufs):
            out = []
            carry = jnp.zeros((), jnp.float32)
            for (opcode, dtype, _), x in zip(shapes, bufs):
                x = x + carry.astype(dtype)  # each collective waits for the one before
                if opcode == "all-to-all":
                    y = jax.lax.all_to_all(x, axes[opcode], 0, 0, tiled=True)
                else:
                    y = jax.lax.psum(x, axes[opcode])
                carry = (y.reshape(-1)[0] * 0).astype(jnp.float32)
                out.append(y)
            return tuple(out)

        return jax.lax.fori_loop(0, moe_layers, one, bufs)

    spec = P(names)  # each device its own block of the first axis
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                    check_vma=False))  # an all-reduce's result is carried
    size = mesh.devices.size
    bufs = tuple(jax.device_put(jnp.ones((size * dims[0],) + tuple(dims[1:]), dtype),
                                jax.sharding.NamedSharding(mesh, spec))
                 for _, dtype, dims in shapes)
    return program, bufs, [(o, str(d), list(s)) for o, d, s in shapes]


_NUMPY = {"f32": "float32", "bf16": "bfloat16", "s32": "int32", "f16": "float16",
          "u32": "uint32", "s8": "int8", "u8": "uint8"}


def build(name, layout, expert, params, dec, first, *, config, offload):
    mesh, rules = sharding.expert_mesh(DEVICES, expert=expert, layout=layout)
    placed = sharding.shard_params(params, mesh, rules)
    state = sharding.shard_state(dec, mesh, rules)
    compiled = sharded_steps.lower_sharded_decode_step(
        placed, state, first, mesh=mesh, config=config, offload=offload,
        rules=rules).compile()
    found = hlo_checks.collectives(compiled)
    # One loop of MoE layers per indexer group holding some: its collectives sit once in the
    # HLO, whatever its trip count.
    runs = [end - start for lo, hi in config.group_bounds
            for start, end, is_moe in config.mlp_ranges(lo, hi) if is_moe]
    per = len(found) // len(runs)
    layer = [(c.opcode, c.arrays) for c in found[:per]]
    if per * len(runs) != len(found) or any(
            [(c.opcode, c.arrays) for c in found[i * per:(i + 1) * per]] != layer
            for i in range(len(runs))):
        raise ValueError(f"expected the same collectives in each of the {len(runs)} loops of "
                         f"MoE layers, got {[(c.opcode, c.arrays) for c in found]}")
    program, bufs, shapes = exchange_program(found[:per], mesh, sum(runs))
    return {"name": name, "layout": layout, "expert": expert,
            "data": sharding.data_size(mesh), "mesh": mesh, "placed": placed, "state": state,
            "compiled": compiled, "token_sharding": compiled.input_shardings[0][2],
            "exchange": program, "buffers": bufs, "collectives": shapes,
            "expert_bytes": expert_bytes(placed), "tokens": first, "greedy": [],
            "times": []}


def step(run):
    """One timed step of `run` on its own greedy tokens."""
    tokens = jax.device_put(run["tokens"], run["token_sharding"])
    start = time.perf_counter()
    logits, run["state"], _ = run["compiled"](run["placed"], run["state"], tokens, None)
    logits.block_until_ready()
    elapsed = time.perf_counter() - start
    run["tokens"] = np.asarray(logits)[:, -1].argmax(-1).astype(np.int32)[:, None]
    run["greedy"].append(run["tokens"][:, 0].tolist())
    return elapsed


def exchange_time(run, *, warmup, repeats):
    program, bufs = run["exchange"], run["buffers"]
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*bufs))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(rows) -> str:
    lines = ["| layout | expert bytes / device | step (ms) | tokens / s | vs replicated "
             "expert 8 | exchange (ms) | exchange / step | same greedy tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout_name']} | {r['expert_bytes_per_device']} | "
                     f"{1e3 * r['step_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['vs_baseline']:.2f}x | {1e3 * r['exchange_s']:.2f} | "
                     f"{r['exchange_share']:.1%} | {r['same_tokens_as_baseline']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_moe")
    parser.add_argument("--dim", type=int, default=512, help="overrides the model's width")
    parser.add_argument("--moe-hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top", type=int, default=4, help="experts per token (K')")
    parser.add_argument("--batch", type=int, default=32, help="requests (B), as many per layout")
    parser.add_argument("--context", type=int, default=512, help="tokens of each request's cache")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--hot-slots", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--table", default=None, help="print the table of these JSON lines")
    parser.add_argument("--out", default=None,
                        help="append JSON lines here (default: results/parallel/expert_layouts/"
                             "expert_layouts.jsonl; none with --smoke)")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(table(rows))
        return rows
    if len(jax.devices()) < DEVICES:
        parser.error(f"the layouts need {DEVICES} devices; jax started with "
                     f"{len(jax.devices())} (run this script in a fresh process: it sets "
                     f"XLA_FLAGS={FLAG}={DEVICES} before jax starts)")
    if args.out is None and not args.smoke:
        args.out = DEFAULT_OUT
    if args.smoke:
        args.dim, args.moe_hidden, args.experts, args.top = 64, 16, 8, 2
        args.batch, args.context, args.capacity, args.hot_slots = 8, 12, 16, 8
        args.page_size, args.steps, args.warmup = 4, 3, 1
    base = get_config(args.model)
    config = base.replace(dim=args.dim, moe_hidden=args.moe_hidden,
                          n_routed_experts=args.experts, num_experts_per_tok=args.top)
    if args.smoke:
        config = config.replace(num_layers=2, indexer_layers=(0,), index_topk=4, max_ways=2)
    offload = OffloadConfig(hot_slots=args.hot_slots, page_size=args.page_size,
                            capacity=args.capacity, policy="ring")
    params = numpy_params(config, args.seed)
    dec = cache_state(config, offload, args.batch, args.context, args.seed)
    rng = np.random.default_rng(args.seed)
    first = rng.integers(0, config.vocab_size, (args.batch, 1)).astype(np.int32)
    runs = []
    for name, layout, expert in LAYOUTS:
        start = time.perf_counter()
        runs.append(build(name, layout, expert, params, dec, first, config=config,
                          offload=offload))
        print(f"{name}: compiled in {time.perf_counter() - start:.1f} s; collectives "
              f"{runs[-1]['collectives']}", flush=True)
    for t in range(args.warmup + args.steps):  # interleaved: every layout's step t together
        for run in runs:
            elapsed = step(run)
            if t >= args.warmup:
                run["times"].append(elapsed)
    meta = run_metadata()
    rows = []
    for run in runs:
        step_s = statistics.median(run["times"])
        exchange_s = exchange_time(run, warmup=args.warmup, repeats=args.steps)
        rows.append({**meta, "question": "expert_layouts", "layout_name": run["name"],
                     "layout": run["layout"], "expert": run["expert"], "data": run["data"],
                     "devices": DEVICES, "model": config.name, "dim": config.dim,
                     "num_layers": config.num_layers,
                     "moe_layers": config.num_layers - config.num_dense_layers,
                     "experts": config.n_routed_experts, "top": config.num_experts_per_tok,
                     "moe_hidden": config.moe_hidden, "batch": args.batch,
                     "context": args.context, "capacity": args.capacity,
                     "hot_slots": args.hot_slots, "page_size": args.page_size,
                     "steps": args.steps, "warmup": args.warmup, "smoke": args.smoke,
                     "seed": args.seed,
                     "step_s": step_s, "step_times_s": run["times"],
                     "tokens_per_s": args.batch / step_s,
                     "expert_bytes_per_device": run["expert_bytes"],
                     "expert_bytes_total": sum(x.nbytes for n in EXPERTS
                                               for x in jax.tree.leaves(params["moe"][n])),
                     "collectives": run["collectives"], "exchange_s": exchange_s,
                     "exchange_share": exchange_s / step_s,
                     "exchange_estimate": "a jitted program of only the step's collectives "
                                          "(from its HLO), once per MoE layer, chained",
                     "greedy_tokens": run["greedy"]})
    baseline = next(r for r in rows if r["layout_name"] == BASELINE)
    for r in rows:
        r["vs_baseline"] = r["tokens_per_s"] / baseline["tokens_per_s"]
        r["same_tokens_as_baseline"] = r["greedy_tokens"] == baseline["greedy_tokens"]
    write_jsonl(args.out, rows)
    print(table(rows))
    print(f"tokens/s ratios against {BASELINE}, measured in this run; exchange share: a "
          "jitted program of only the step's collectives (opcodes and shapes read from its "
          "HLO), once per MoE layer, over the step's median time: an estimate, not a profile")
    print("greedy tokens equal across layouts:",
          all(r["same_tokens_as_baseline"] for r in rows))
    return rows


if __name__ == "__main__":
    main()

"""Fused kernels (LIM, CopySFA) against the XLA path, on an accelerator.

For one layer at production-like shapes (k = 2048, 576-wide bf16 rows, C = 16384, W ways):

  select    XLA indexer scores + top-k   vs  LIM (scores fused with the slot lookup) + top-k
  copy      the misses alone: host rows -> victim slots (XLA)
  sfa       attention over rows already resident (XLA gather + sparse_attention)
  fused     XLA: copy then attention;  Pallas: CopySFA (copy fused into the gather)

and the overlap ratio of the seed, OverlapRatio = (T_copy + T_sfa - T_fused) / T_copy: how
much of the copy the fused operation hides. Ratios are to the XLA baseline measured in the same
run. The Pallas kernels are Pallas TPU kernels: they run compiled on a TPU only; on a GPU the
XLA rows run (Mosaic GPU has no host memory space); on a CPU there is nothing to measure (TPU
interpret mode is a correctness tool, not a benchmark) and the script says so and exits 0.

    python -m experiments.accelerator.kernel_bench [--batch 16] [--ways 4] [--miss-rate 0.05]
                                       [--host-access gather|slices] [--out F]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import median_time, run_metadata, write_jsonl  # noqa: E402

from fo_jax.model.attention import sparse_attention  # noqa: E402
from fo_jax.model.forward import xla_select  # noqa: E402
from fo_jax.offload.host import HOST_ACCESS, host_gather_rows  # noqa: E402
from fo_jax.offload.manage import GroupPlan  # noqa: E402


def _inputs(args):
    b, w, k, c, s = args.batch, args.ways, args.k, args.hot_slots, args.context
    d, r, h, n, i = 512, 64, args.heads, 128, args.index_heads
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 6)
    hot = jax.random.normal(keys[0], (1, b, c + 128, d + r), jnp.float32).astype(jnp.bfloat16)
    # The host pool [1, F = B P, Z, D+R] of the identity page table [B, P].
    host = jax.random.normal(keys[1], (1, b * (s // 64), 64, d + r), jnp.float32
                             ).astype(jnp.bfloat16)
    table = jnp.arange(b * (s // 64), dtype=jnp.int32).reshape(b, s // 64)
    q_lat = jax.random.normal(keys[2], (b, w, h, d))
    q_pe = jax.random.normal(keys[3], (b, w, h, r))
    q_i = jax.random.normal(keys[4], (b, w, i, n))
    w_i = jax.random.normal(keys[5], (b, w, i))
    index_keys = jax.random.normal(keys[0], (b, s, n), jnp.float32).astype(jnp.bfloat16)
    misses = int(k * args.miss_rate)
    read = np.sort(rng.choice(c, (b, w, k)), axis=-1).astype(np.int32)
    miss_tokens = np.full((b, k * w), -1, np.int32)
    victims = np.full((b, k * w), -1, np.int32)
    for bb in range(b):
        miss_tokens[bb, :misses] = np.sort(rng.choice(s, misses, replace=False))
        victims[bb, :misses] = read[bb, 0, :misses]
    plan = GroupPlan(read_row=jnp.asarray(read), mask=jnp.ones((b, w, k), bool),
                     miss_tokens=jnp.asarray(miss_tokens), victims=jnp.asarray(victims),
                     num_miss=jnp.full((b,), misses, jnp.int32))
    return dict(hot=hot, host=host, table=table, q_lat=q_lat, q_pe=q_pe, q_i=q_i, w_i=w_i,
                index_keys=index_keys, plan=plan)


def run(args, meta):
    backend = jax.default_backend()
    if backend == "cpu":
        print("kernel_bench: no accelerator on this machine (backend 'cpu'). The Pallas TPU "
              "kernels run compiled on a TPU only, and TPU interpret mode measures nothing "
              "useful; run this script on a TPU (fused kernels vs XLA) or a GPU (XLA rows).")
        return []
    x = _inputs(args)
    host = jax.device_put(x["host"], jax.sharding.SingleDeviceSharding(
        jax.devices()[0], memory_kind="pinned_host"))
    scale = 576 ** -0.5
    plan = x["plan"]
    rows = []

    @jax.jit
    def xla_sel(keys, q, w):
        return xla_select(keys, q, w, jnp.full(q.shape[:2], keys.shape[1], jnp.int32), args.k)

    @functools.partial(jax.jit, donate_argnums=0)
    def xla_copy(hot, host, plan):
        fetched = host_gather_rows(host, x["table"], 0, plan.miss_tokens, plan.num_miss,
                                   chunk=64, on_host=True, access=args.host_access)
        b2 = jnp.arange(hot.shape[1])[:, None]
        return hot.at[0, b2, jnp.where(plan.victims >= 0, plan.victims, hot.shape[2])].set(
            fetched, mode="drop")

    @jax.jit
    def xla_sfa(hot, q_lat, q_pe, plan):
        b3 = jnp.arange(hot.shape[1])[:, None, None]
        return sparse_attention(q_lat, q_pe, hot[0, b3, plan.read_row], plan.mask, scale=scale)

    state = {"hot": x["hot"]}

    def t_copy():
        state["hot"] = xla_copy(state["hot"], host, plan)
        state["hot"].block_until_ready()

    def t_sfa():
        xla_sfa(state["hot"], x["q_lat"], x["q_pe"], plan).block_until_ready()

    def t_fused_xla():
        t_copy()
        t_sfa()

    def t_select():
        jax.block_until_ready(xla_sel(x["index_keys"], x["q_i"], x["w_i"]))

    times = {"xla_select": median_time(t_select), "xla_copy": median_time(t_copy),
             "xla_sfa": median_time(t_sfa), "xla_copy_then_sfa": median_time(t_fused_xla)}
    if backend == "tpu":
        from pallas_kernels.copy_sfa import copy_sfa
        from pallas_kernels.lim import lim

        read = jnp.where(plan.mask, plan.read_row, -1)

        @functools.partial(jax.jit, donate_argnums=0)
        def fused(hot, host):
            return copy_sfa(x["q_lat"], x["q_pe"], hot, host, read, plan.miss_tokens,
                            plan.victims, plan.num_miss, scale=scale, layer=0,
                            page_table=x["table"])

        def t_fused():
            out, state["hot"] = fused(state["hot"], host)
            out.block_until_ready()

        slots = jnp.full((args.batch, args.context), -1, jnp.int32)
        visible = jnp.full((args.batch, args.ways), args.context, jnp.int32)

        def t_lim():
            jax.block_until_ready(lim(x["q_i"], x["w_i"], x["index_keys"], slots, visible,
                                      k=args.k))

        times["pallas_lim"] = median_time(t_lim)
        times["pallas_copy_sfa"] = median_time(t_fused)
    overlap_xla = (times["xla_copy"] + times["xla_sfa"] - times["xla_copy_then_sfa"]) \
        / times["xla_copy"]
    print(f"backend {backend} ({meta['device']}): batch {args.batch}, W {args.ways}, "
          f"k {args.k}, C {args.hot_slots}, miss rate {args.miss_rate}, "
          f"host access {args.host_access}")
    for name, t in times.items():
        base = times["xla_select"] if "select" in name or "lim" in name \
            else times["xla_copy_then_sfa"]
        print(f"  {name:20s} {t * 1e6:10.1f} us   {t / base:5.2f}x")
    print(f"  overlap ratio (XLA copy then SFA): {overlap_xla:.2f}")
    if "pallas_copy_sfa" in times:
        overlap = (times["xla_copy"] + times["xla_sfa"] - times["pallas_copy_sfa"]) \
            / times["xla_copy"]
        print(f"  overlap ratio (CopySFA):           {overlap:.2f}")
    rows.append({**meta, **vars(args), **{f"{k}_s": v for k, v in times.items()},
                 "overlap_xla": overlap_xla})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ways", type=int, default=4)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--hot-slots", type=int, default=16384)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--index-heads", type=int, default=32)
    parser.add_argument("--miss-rate", type=float, default=0.05)
    parser.add_argument("--host-access", choices=HOST_ACCESS, default="gather",
                        help="how the copy reads host pages (experiments/accelerator/accelerator_check.py "
                             "compares both)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = run(args, run_metadata())
    write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()

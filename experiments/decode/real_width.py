"""Real-width decode: offloaded / resident decode step at DeepSeek-V3.2's widths, FP8 weights.

The `deepseek_v32_width` preset (hidden 7168, 128 heads, MLA 512 + 64, 64 indexer heads of 128,
k = 2048, 256 routed experts of 2048 + a shared one; 4 layers: 1 dense + 3 MoE) with random FP8
weights drawn on the device (`fo_jax.model.dsa.init_fp8_params`, 128 x 128 block scales: the
projections multiply in FP8), decoding over a synthetic history (`experiments.common`'s
locality workload: a tenth of the tokens favoured by the indexer). Cells: both KV formats x
contexts 32k and 128k x batch 1, 16, 64, C = 16k hot slots: the cells of the FlashOffloading
paper's table. Per cell: the resident and the offloaded step alternating step by step on the
same tokens (median [IQR] of per-step times, the paired ratio), the hit rate, and the bytes
moved per step (host to device: misses x layers x row bytes; device to host: the new rows
written through), one JSON line per cell. A cell that does not fit the device is reported as
such and the run goes on; with `--budget-s`, cells that would start after the budget are
reported as skipped (the cells run by context, then batch, then KV format).

    python -m experiments.decode.real_width --out real_width.jsonl     # an accelerator
    python -m experiments.decode.real_width --smoke                    # tiny shapes (tests)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_metadata, write_jsonl
from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import init_fp8_params
from fo_jax.model.kv_format import store_kv_rows
from fo_jax.offload import decode as offload_decode
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState

KV_FORMATS = ("bf16", "fp8_ds_mla")


def states(config, offload, batch, context, *, seed, heavy=0.1, boost=4.0):
    """Resident and offloaded states holding the same random history of `context` tokens,
    built layer by layer (a real-width cache is tens of GB: no float32 copy of it)."""
    key = jax.random.key(seed)
    capacity = offload.capacity
    layers = []
    for layer in range(config.num_layers):
        rows = jax.random.normal(jax.random.fold_in(key, layer),
                                 (batch, capacity, config.kv_width), config.jnp_kv_dtype)
        layers.append(store_kv_rows(rows, config=config))
    kv = jnp.stack(layers)
    del layers
    k_keys, k_fav = jax.random.split(jax.random.fold_in(key, config.num_layers))
    ik = jax.random.normal(k_keys, (config.num_groups, batch, capacity, config.index_head_dim),
                           config.jnp_kv_dtype)
    favoured = jax.random.bernoulli(k_fav, heavy, (1, batch, capacity, 1))
    ik = jnp.where(favoured, ik * boost, ik).astype(config.jnp_kv_dtype)
    lengths = np.full((batch,), context, np.int32)
    dec = DecodeState.from_resident(kv, ik, lengths, config=config, offload=offload)
    res = resident.ResidentState(kv=kv, index_keys=ik, lengths=jnp.asarray(lengths))
    return res, dec


def _spread(values):
    values = np.asarray(values)
    return (float(np.median(values)), float(np.percentile(values, 25)),
            float(np.percentile(values, 75)))


def bench_cell(params, config, *, batch, context, hot_slots, steps, warmup, host_access):
    """One cell: (row dict) resident and offloaded steps alternating."""
    page = 64 if hot_slots >= 128 else 16
    capacity = -(-(context + warmup + steps + 8) // page) * page
    offload = OffloadConfig(hot_slots=hot_slots, page_size=page, capacity=capacity,
                            host_access=host_access)
    res, dec = states(config, offload, batch, context, seed=1)
    rng = np.random.default_rng(2)
    tokens = [jnp.asarray(rng.integers(0, config.vocab_size, (batch, 1), np.int32))
              for _ in range(warmup + steps)]
    t_res, t_off, stats = [], [], []
    for i, token in enumerate(tokens):
        start = time.perf_counter()
        logits, res = resident.decode_step(params, res, token, config=config, check=False)
        logits.block_until_ready()
        t_res.append(time.perf_counter() - start)
        start = time.perf_counter()
        logits, dec, step_stats = offload_decode.decode_step(params, dec, token, config=config,
                                                             offload=offload, check=False)
        logits.block_until_ready()
        t_off.append(time.perf_counter() - start)
        if i >= warmup:
            stats.append(jax.device_get(step_stats))
    t_res, t_off = np.asarray(t_res[warmup:]), np.asarray(t_off[warmup:])
    hits = sum(int(s.hits.sum()) + int(s.tail_hits.sum()) for s in stats)
    misses = sum(int(s.misses.sum()) for s in stats)
    h2d = np.mean([int(s.h2d_bytes.sum()) for s in stats])
    d2h = np.mean([int(s.d2h_bytes.sum()) for s in stats])
    res_med, res_q25, res_q75 = _spread(t_res)
    off_med, off_q25, off_q75 = _spread(t_off)
    ratio, r25, r75 = _spread(t_off / t_res)
    return {"resident_s": res_med, "resident_q25": res_q25, "resident_q75": res_q75,
            "offload_s": off_med, "offload_q25": off_q25, "offload_q75": off_q75,
            "ratio": ratio, "ratio_q25": r25, "ratio_q75": r75,
            "hit_rate": hits / max(hits + misses, 1), "h2d_bytes_per_step": float(h2d),
            "d2h_bytes_per_step": float(d2h), "steps": len(stats),
            "host_access": offload.host_access, "row_bytes": config.kv_row_bytes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--model", default="deepseek_v32_width")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--hot-slots", type=int, default=16384)
    parser.add_argument("--kv-format", nargs="+", default=list(KV_FORMATS), choices=KV_FORMATS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="uncounted steps (compilation)")
    parser.add_argument("--host-access", default=None,
                        help="how the offloaded step moves rows (default: the backend's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no cell after this many seconds (the rest are reported "
                             "as skipped)")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    config = get_config(args.model)
    block = (128, 128)
    if args.smoke:  # the preset's structure (a dense layer, then MoE, an indexer per layer),
        # tiny, 2 layers (1 dense + 1 MoE: half the indexer groups to compile)
        config = config.replace(
            name="deepseek_v32_width-smoke", num_layers=2, indexer_layers=(0, 1),
            vocab_size=256, dim=64, num_heads=4,
            q_lora_rank=32, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, mlp_hidden=96, index_n_heads=4, index_head_dim=32, index_topk=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_hidden=32, n_group=2, topk_group=1,
            max_seq_len=4096)
        args.batch, args.context, args.hot_slots = [2], [128], 32
        args.steps, args.warmup, block = 2, 1, (32, 32)
    meta = run_metadata()
    start = time.perf_counter()
    params = init_fp8_params(config, jax.random.key(0), block)
    jax.block_until_ready(params)
    print(f"{config.name}: random FP8 weights ({block[0]} x {block[1]} blocks) drawn on "
          f"{meta['backend']} in {time.perf_counter() - start:.1f} s; C = {args.hot_slots}, "
          f"{args.steps} timed steps after {args.warmup}")
    rows = []
    cells = [(fmt, context, batch) for context in args.context for batch in args.batch
             for fmt in args.kv_format]
    for fmt, context, batch in cells:
        cfg = config.replace(kv_format=fmt)
        cell = {**meta, "question": "real_width", "model": config.name,
                "kv_format": fmt, "context": context, "batch": batch,
                "hot_slots": args.hot_slots, "weights": "fp8"}
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            cell["skipped"] = f"--budget-s {args.budget_s:g} spent"
            print(f"  {fmt:10} context {context:>7,} batch {batch:>3}: {cell['skipped']}")
            write_jsonl(args.out, [cell])
            rows.append(cell)
            continue
        try:
            cell.update(bench_cell(params, cfg, batch=batch, context=context,
                                   hot_slots=args.hot_slots, steps=args.steps,
                                   warmup=args.warmup, host_access=args.host_access))
            print(f"  {fmt:10} context {context:>7,} batch {batch:>3}: resident "
                  f"{cell['resident_s'] * 1e3:8.2f} ms, offloaded "
                  f"{cell['offload_s'] * 1e3:8.2f} ms, ratio {cell['ratio']:.3f} "
                  f"[{cell['ratio_q25']:.3f}-{cell['ratio_q75']:.3f}], hit rate "
                  f"{cell['hit_rate']:.3f}, H2D {cell['h2d_bytes_per_step'] / 1e6:.2f} "
                  f"MB / step, D2H {cell['d2h_bytes_per_step'] / 1e3:.1f} kB / step")
        except (jax.errors.JaxRuntimeError, MemoryError, ValueError) as err:
            if "RESOURCE_EXHAUSTED" not in str(err) and not isinstance(
                    err, MemoryError) and "memory" not in str(err).lower():
                raise
            cell["skipped"] = f"does not fit: {str(err).splitlines()[0][:200]}"
            print(f"  {fmt:10} context {context:>7,} batch {batch:>3}: "
                  f"{cell['skipped']}")
        write_jsonl(args.out, [cell])
        rows.append(cell)
    return rows


if __name__ == "__main__":
    main()

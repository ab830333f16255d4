"""Ways to write the prefill's history load (pages of one layer, host pool -> device): which
compile on this backend, which are exact, and how fast.

On an H200 (jax 0.11.2) the paged `load_history` (a gather of whole pages by numpy indexing,
moved to the device, then reshaped) failed to compile: "Bitcast cannot have different memory
spaces of output (0) and operand (5)". Each variant below reads the same pages of a pool
[L, F, Z, D+R] in `pinned_host` memory through a shuffled page table [B, P]:

  index_pages    host_kv[layer, frames] (numpy indexing), to the device, reshape (the old one)
  gather_pages   one lax.gather with the page as its slice, giving [B, hp, Z, D+R], to the
                 device, reshape there
  gather_rows    the pool seen as rows [L, F Z, D+R], one lax.gather of [B, hp Z] rows giving
                 [B, hp Z, D+R] directly (the decode miss gather's pattern), to the device
  fenced_pages   gather_pages with the moved pages behind lax.optimization_barrier before the
                 reshape

    python -m experiments.accelerator.load_history_variants            # on an accelerator
    python -m experiments.accelerator.load_history_variants --smoke    # tiny sizes, any backend
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import median_time, run_metadata, write_jsonl  # noqa: E402

from fo_jax.offload.host import to_device, to_host  # noqa: E402
from fo_jax.offload.state import to_memory_kind  # noqa: E402

_PAGES = jax.lax.GatherDimensionNumbers(offset_dims=(2, 3), collapsed_slice_dims=(0, 1),
                                        start_index_map=(0, 1))
_ROWS = jax.lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0, 1),
                                       start_index_map=(0, 1))


def index_pages(host_kv, table, layer, hp):
    _, _, z, w = host_kv.shape
    frames = jnp.maximum(table[:, :hp], 0)
    layers = jnp.broadcast_to(layer, frames.shape)
    pages = host_kv[to_host(layers, True), to_host(frames, True)]
    return to_device(pages, True).reshape(table.shape[0], hp * z, w)


def _page_index(table, layer, hp):
    frames = jnp.maximum(table[:, :hp], 0)
    return jnp.stack([jnp.broadcast_to(layer, frames.shape), frames], axis=-1)  # [B, hp, 2]


def gather_pages(host_kv, table, layer, hp, fence=False):
    _, _, z, w = host_kv.shape
    got = jax.lax.gather(host_kv, to_host(_page_index(table, layer, hp), True), _PAGES,
                         slice_sizes=(1, 1, z, w),
                         mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    got = to_device(got, True)
    if fence:
        got = jax.lax.optimization_barrier(got)
    return got.reshape(table.shape[0], hp * z, w)


def gather_rows(host_kv, table, layer, hp):
    num_l, frames, z, w = host_kv.shape
    rows_kv = host_kv.reshape(num_l, frames * z, w)
    tokens = jnp.arange(hp * z, dtype=jnp.int32)
    rows = jnp.maximum(table[:, tokens // z], 0) * z + tokens % z  # [B, hp Z] pool rows
    idx = jnp.stack([jnp.broadcast_to(layer, rows.shape), rows], axis=-1)
    got = jax.lax.gather(rows_kv, to_host(idx, True), _ROWS, slice_sizes=(1, 1, w),
                         mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return to_device(got, True)


VARIANTS = {"index_pages": index_pages, "gather_pages": gather_pages,
            "gather_rows": gather_rows,
            "fenced_pages": lambda h, t, l, hp: gather_pages(h, t, l, hp, fence=True)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pages", type=int, default=512, help="history pages per request")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.batch, args.pages, args.page_size, args.width = 2, 2, 3, 4, 8
    num_l, b, hp, z, w = args.layers, args.batch, args.pages, args.page_size, args.width
    frames = b * hp
    dev = jax.random.normal(jax.random.key(0), (num_l, frames, z, w),
                            jnp.float32).astype(jnp.bfloat16)
    pool = to_memory_kind(dev, "pinned_host")
    table = jnp.asarray(np.random.default_rng(0).permutation(frames).reshape(b, hp)
                        .astype(np.int32))
    want = dev[1][table].reshape(b, hp * z, w)
    moved = b * hp * z * w * 2
    bulk = median_time(lambda: jax.device_put(pool, _device()).block_until_ready(),
                       warmup=1, repeats=5)  # the whole pool, every layer
    bulk_gbps = pool.nbytes / bulk / 1e9
    meta = {**run_metadata(), "batch": b, "pages": hp, "page_size": z, "width": w,
            "bulk_gb_per_s": bulk_gbps}
    rows = []
    for name, fn in VARIANTS.items():
        row = {**meta, "variant": name}
        start = time.perf_counter()
        try:
            run = jax.jit(lambda h, t, f=fn: f(h, t, jnp.int32(1), hp))
            got = run(pool, table)
            row["exact"] = bool(jnp.array_equal(got, want))
            seconds = median_time(lambda: run(pool, table).block_until_ready(), warmup=1,
                                  repeats=5)
            row.update(status="ok", seconds=seconds, gb_per_s=moved / seconds / 1e9,
                       ratio_to_bulk=moved / seconds / 1e9 / bulk_gbps)
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:400])
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        if row["status"] == "ok":
            print(f"[ok] {name:13s} exact {row['exact']} {row['seconds'] * 1e3:.3f} ms "
                  f"{row['gb_per_s']:.2f} GB/s (x{row['ratio_to_bulk']:.2f} a bulk device_put)")
        else:
            print(f"[failed] {name:13s} {row['error'][:300]}")
    print(f"bulk device_put of the whole pool ({pool.nbytes / 1e9:.3f} GB): {bulk_gbps:.2f} GB/s")
    write_jsonl(args.out, rows)
    return rows


def _device():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")


if __name__ == "__main__":
    main()

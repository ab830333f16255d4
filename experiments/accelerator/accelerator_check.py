"""The accelerator run's host-access checks: which setting compiles, is exact and is fast, and
what XLA made of it.

One command, bounded in time (`--budget-s`, default 270 s, shared by the settings: cells not
started by then are reported as skipped; one started may run on). For each setting of
`OffloadConfig.host_access` (`--access`: "gather", "slices", "ffi"; see fo_jax/offload/host.py
for what is known about each on accelerators), the checks of `--checks`, in this order:

  access       the four host accesses, each at `--row-counts` rows (64, 256, 1024, 4096) of
               each of `--row-bytes` (656: DeepSeek's fp8 layout, as uint8 rows; 1152: bf16
               rows of 576), from or to host pools in `pinned_host` memory:
    gather_rows    decode misses: rows of each request out of the host pages, to the device
    write_rows     decode write-through: W new rows of each request and layer, to host pages
    write_back     prefill write-back: one layer's new rows of each request, to host pages
    load_history   prefill history load: one layer's first pages of each request, to the device
               (the rows of a cell are split over requests, layers and pages as `cell_shape`
               says). Each cell reports compile success (or the error text), bitwise equality
               with the same access done on a device copy, the time per call (median over
               `--repeats` rounds of `--inner` calls issued back to back), GB/s of the rows
               moved, and two baselines over the same bytes in the same run: `read_bulk` (one
               contiguous copy out of the cell's own pinned pool: on a GPU the copy engine's
               `cudaMemcpyAsync`, the physical limit; host to device for every cell) and a bulk
               `jax.device_put` in the cell's direction; plus the ops XLA marked as host
               compute in the compiled program.
  hlo          hlo_decode_step, hlo_prefill: the programs of the two checks below as compiled
               here: ops marked as host compute (`_xla_compute_type="host"`), writes of a
               whole pool-shaped array into a new buffer, copies included (`fo_jax.
               hlo_checks.state_array_writes`), and what touches host memory besides fo_jax's
               copy targets in the program lowered for CUDA (`fo_jax.host_memory_checks.
               host_memory_faults`: what XLA's host offloader would turn into host compute);
               `--hlo DIR` keeps each compiled program's text
  decode       decode_step: resident vs offloaded decode steps on the `small` preset (synthetic
               history with misses): bitwise logits, median step time, ratio to resident
  prefill      prefill_chunk: one chunk on top of a long history, resident vs offloaded (layer
               buffers, prefetch distance 1): bitwise logits and host pages, ratio of times

One summary line per row is printed, one JSON line per row (with run metadata) is appended to
`--out` as it ends; then a line naming the settings that compiled and were exact, fastest
first. Each setting runs in its own child process (`--in-process` to run in this one): an XLA
CHECK failure or a faulting kernel aborts a process, and is then reported as "crashed" with the
end of its output, while the other settings still run.

    python -m experiments.accelerator.accelerator_check  # on a GPU (within --budget-s + grace)
    python -m experiments.accelerator.accelerator_check --smoke  # tiny sizes, any backend (the tests)

On a CPU the moves compile to nothing and XLA keeps no memory spaces: the smoke run checks the
script and exactness, its GB/s and host-compute counts mean nothing (the CUDA lowering's
faults do).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_metadata, synthetic_states, write_jsonl  # noqa: E402

from fo_jax import hlo_checks, host_memory_checks, resident  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload import host  # noqa: E402
from fo_jax.offload import prefill as offload_prefill  # noqa: E402
from fo_jax.offload.config import HOST_ACCESS, OffloadConfig  # noqa: E402
from fo_jax.offload.ffi import read_bulk  # noqa: E402
from fo_jax.offload.ffi.library import TARGETS  # noqa: E402
from fo_jax.offload.state import HostPages, committed, to_memory_kind  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "..", "results",
                           "accelerator_check.jsonl")
# Row bytes -> (dtype, width) of a KV row: DeepSeek's fp8 layout (512 e4m3 latent values, 4
# float32 scales, 64 bf16 RoPE values: moved as 656 opaque bytes) and bf16 rows of 512 + 64.
ROW_TYPES = {656: (jnp.uint8, 656), 1152: (jnp.bfloat16, 576)}
ACCESSES = ("gather_rows", "write_rows", "write_back", "load_history")


def _device_kind(kind: str):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def _model(args):
    config = get_config(args.preset)
    if args.model_layers:
        config = config.replace(num_layers=args.model_layers,
                                indexer_layers=tuple(range(0, args.model_layers, 2)))
    return config


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text[:2000]


def _host_compute_ops(compiled) -> int | None:
    """Ops the compiled program marks as host compute (`_xla_compute_type="host"`)."""
    try:
        return len(re.findall(r'compute_type="host"', compiled.as_text()))
    except Exception:  # noqa: BLE001  (not every backend prints its program)
        return None


def per_call_seconds(call, *, inner: int, repeats: int, chained: bool = False) -> float:
    """Median over `repeats` rounds of the seconds per call of `inner` calls issued back to
    back (one wait at the end of each round): the device's time per call, with the dispatch of
    one call hidden behind the previous one. `call()` returns its (unwaited) result; `chained`:
    each call donates the previous result (only the last is alive to wait on)."""
    jax.block_until_ready(call())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [call() for _ in range(inner)]
        jax.block_until_ready(outs[-1] if chained else outs)
        times.append((time.perf_counter() - start) / inner)
        del outs
    return statistics.median(times)


# One host access --------------------------------------------------------------------------


def _split(total: int, cap: int, unit: int = 1) -> tuple[int, int]:
    """(requests, rows per request): `total` rows over at most `cap` requests, each a multiple
    of `unit` rows, as many requests as that allows."""
    if total % unit:
        raise ValueError(f"{total} rows are not a multiple of {unit}")
    b = max(1, min(cap, total // unit))
    while total % (b * unit):
        b -= 1
    return b, total // b


def cell_shape(args, check: str, rows: int) -> dict:
    """How a cell's `rows` rows are laid out: the requests (`batch`) and, per check, the rows
    per request (`per_request`), layers and ways (write_rows) or pages (load_history)."""
    z = args.page_size
    if check == "gather_rows":
        b, per = _split(rows, args.batch)
        shape = {"batch": b, "per_request": per}
        limit = args.context
    elif check == "write_rows":  # [L, B, W] rows: W ways, up to --layers layers, then requests
        if rows % args.ways:
            raise ValueError(f"{rows} rows are not a multiple of ways={args.ways}")
        per_way = rows // args.ways
        layers = min(per_way, args.layers)
        while per_way % layers:
            layers -= 1
        shape = {"batch": per_way // layers, "layers": layers, "ways": args.ways}
        # Every layer's W rows in a request's pages; read_bulk reads `rows` rows of one layer.
        per, limit = layers * args.ways, args.write_context
    elif check == "write_back":
        b, per = _split(rows, args.batch, min(z, rows))
        shape = {"batch": b, "per_request": per}
        limit = args.write_context
    elif check == "load_history":
        b, per = _split(rows, args.batch, z)
        shape = {"batch": b, "pages": per // z}
        limit = args.context
    else:
        raise ValueError(f"unknown access check {check!r}; choose one of {ACCESSES}")
    if per > limit:
        raise ValueError(f"{check} of {rows} rows puts {per} rows in a request of {limit} "
                         "tokens: raise --context / --write-context or --batch")
    return shape


def _random(key, shape, dtype):
    if jnp.dtype(dtype) == jnp.uint8:
        return jax.random.bits(key, shape, jnp.uint8)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _pool(pages):
    """[L, B, P, Z, W] per-request pages as the pool [L, B P, Z, W] of the identity table."""
    num_l, batch, num_p, page, width = pages.shape
    return pages.reshape(num_l, batch * num_p, page, width)


def _table(batch, context, page):
    """The identity page table [B, P] int32."""
    return jnp.arange(batch * (context // page), dtype=jnp.int32).reshape(batch, -1)


def _bulk_seconds(nbytes: int, direction: str, *, inner: int, repeats: int) -> float:
    """Seconds per bulk jax.device_put of `nbytes` bytes in `direction` ("h2d" or "d2h")."""
    src, dst = ("pinned_host", "device") if direction == "h2d" else ("device", "pinned_host")
    x = jax.device_put(jnp.ones((nbytes,), jnp.uint8), _device_kind(src))
    target = _device_kind(dst)
    return per_call_seconds(lambda: jax.device_put(x, target), inner=inner, repeats=repeats)


def _access_check(name, access, *, fn, make_args, reference, moved_bytes, direction, inner,
                  repeats, donate_first: bool, bulk_pool=None, bulk_rows: int = 0,
                  bulk_cache: dict | None = None):
    """Compile fn(*make_args()), compare with reference(*args) on the device, time it, and time
    the baselines over the same bytes: `read_bulk` of `bulk_rows` rows out of `bulk_pool()` (a
    pinned pool; skipped when None) and a bulk device_put in `direction` (kept in
    `bulk_cache`)."""
    row = {"check": name, "host_access": access, "moved_bytes": int(moved_bytes),
           "direction": direction}
    jitted = jax.jit(fn, donate_argnums=(0,) if donate_first else ())
    args = make_args()
    start = time.perf_counter()
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as e:  # noqa: BLE001  (the point is to report it)
        return {**row, "status": "compile_failed", "error": _error(e)}
    row["compile_s"] = time.perf_counter() - start
    row["host_compute_ops"] = _host_compute_ops(compiled)
    try:
        want = reference(*args)
        got = compiled(*args)
        row["bitwise"] = bool(jnp.array_equal(jax.device_put(got, _device_kind("device")),
                                              want))
        del got, want
        state = {"args": make_args() if donate_first else args}

        def once():
            out = compiled(*state["args"])
            if donate_first:
                state["args"] = (out,) + tuple(state["args"][1:])
            return out

        seconds = per_call_seconds(once, inner=inner, repeats=repeats, chained=donate_first)
        del state
        key = (moved_bytes, direction)
        cache = {} if bulk_cache is None else bulk_cache
        if key not in cache:
            cache[key] = _bulk_seconds(moved_bytes, direction, inner=inner, repeats=repeats)
        bulk = cache[key]
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "run_failed", "error": _error(e)}
    gbps, bulk_gbps = moved_bytes / seconds / 1e9, moved_bytes / bulk / 1e9
    row.update(status="ok" if row["bitwise"] else "mismatch", seconds=seconds, gb_per_s=gbps,
               bulk_gb_per_s=bulk_gbps, ratio_to_bulk=gbps / bulk_gbps)
    if bulk_pool is not None:
        try:
            pool = bulk_pool()
            copy = jax.jit(functools.partial(read_bulk, layer=0, row=0, rows=bulk_rows))
            copy = copy.lower(pool).compile()
            read_s = per_call_seconds(lambda: copy(pool), inner=inner, repeats=repeats)
            del pool
            row.update(read_bulk_gb_per_s=moved_bytes / read_s / 1e9,
                       ratio_to_read_bulk=read_s / seconds)
        except Exception as e:  # noqa: BLE001  (no copy library here: the cell stands)
            row["read_bulk_error"] = _error(e)
    return row


def access_cells(args, access):
    """[(key, run)] of every access cell of this setting, row type by row type: run() returns
    the cell's row. The read pool is made when a cell first needs it and kept for the cells of
    its row type."""
    pools: dict = {}
    return [({"check": check, "host_access": access, "row_bytes": row_bytes, "rows": rows},
             functools.partial(_access_cell, args, access, check, row_bytes, rows, pools))
            for row_bytes in args.row_bytes for check in ACCESSES for rows in args.row_counts]


def _access_cell(args, access, check, row_bytes, rows, pools):
    dtype, width = ROW_TYPES[row_bytes]
    if pools.get("row_bytes") != row_bytes:  # the previous row type's pool goes
        pools.clear()
        pools["row_bytes"] = row_bytes
    shape = cell_shape(args, check, rows)
    head = {"row_bytes": row_bytes, "rows": rows, **shape}
    key = jax.random.key(rows)
    z, s, wc = args.page_size, args.context, args.write_context
    b = shape["batch"]
    bidx = jnp.arange(b)[:, None]
    timing = dict(inner=args.inner, repeats=args.repeats, bulk_cache=pools.setdefault(
        "bulk", {}))
    if check in ("gather_rows", "load_history"):
        if "read" not in pools:  # one pool of --batch requests of --context tokens, one layer
            dev = _random(jax.random.key(0), (1, args.batch, s // z, z, width), dtype)
            pools["read"] = (to_memory_kind(_pool(dev), "pinned_host"), dev)
        pages, dev = pools["read"]
        table = _table(args.batch, s, z)[:b]
        flat = dev.reshape(args.batch, s, width)
        bulk = dict(bulk_pool=lambda: pages, bulk_rows=rows)
    if check == "gather_rows":
        rng = np.random.default_rng(rows)
        per = shape["per_request"]
        tokens = jnp.asarray(np.stack([np.sort(rng.choice(s, per, replace=False))
                                       for _ in range(b)]).astype(np.int32))
        count = jnp.full((b,), per, jnp.int32)
        return {**head, **_access_check(
            check, access,
            fn=lambda h, t, c: host.host_gather_rows(h, table, 0, t, c, chunk=args.miss_chunk,
                                                     on_host=True, access=access),
            make_args=lambda: (pages, tokens, count),
            reference=lambda h, t, c: flat[bidx, t],
            moved_bytes=rows * row_bytes, direction="h2d", donate_first=False, **bulk,
            **timing)}
    if check == "load_history":
        hist = shape["pages"]
        return {**head, **_access_check(
            check, access,
            fn=lambda h: host.load_history(h, table, 0, history_pages=hist, on_host=True,
                                           access=access),
            make_args=lambda: (pages,),
            reference=lambda *_: flat[:b, :hist * z],
            moved_bytes=rows * row_bytes, direction="h2d", donate_first=False, **bulk,
            **timing)}
    rng = np.random.default_rng(rows)
    w_table = _table(b, wc, z)
    if check == "write_rows":
        layers, ways = shape["layers"], shape["ways"]
        w_dev = _random(key, (layers, b, wc // z, z, width), dtype)
        new = _random(jax.random.fold_in(key, 1), (layers, b, ways, width), dtype)
        positions = jnp.asarray(rng.integers(0, wc - ways, (b, 1))
                                + np.arange(ways)).astype(jnp.int32)
        w_ref = _pool(w_dev.reshape(layers, b, wc, width).at[:, bidx, positions].set(new)
                      .reshape(w_dev.shape))

        def make():
            return to_memory_kind(_pool(w_dev), "pinned_host"), new, positions

        return {**head, **_access_check(
            check, access,
            fn=lambda h, r, p: host.host_write_rows(h, w_table, r, p, on_host=True,
                                                    access=access),
            make_args=make, reference=lambda *_: w_ref, moved_bytes=rows * row_bytes,
            direction="d2h", donate_first=True, bulk_pool=lambda: make()[0], bulk_rows=rows,
            **timing)}
    per = shape["per_request"]  # write_back: layer 1 of a 2-layer pool, the last `per` tokens
    wb_dev = _random(key, (2, b, wc // z, z, width), dtype)
    chunk_rows = _random(jax.random.fold_in(key, 1), (b, per, width), dtype)
    write_pos = jnp.broadcast_to(wc - per + jnp.arange(per, dtype=jnp.int32), (b, per))
    wb_ref = _pool(wb_dev.reshape(2, b, wc, width).at[1, bidx, write_pos].set(chunk_rows)
                   .reshape(wb_dev.shape))

    def make_wb():
        return to_memory_kind(_pool(wb_dev), "pinned_host"), chunk_rows, write_pos

    return {**head, **_access_check(
        check, access,
        fn=lambda h, r, p: host.write_back_rows(h, w_table, 1, r, p, on_host=True,
                                                access=access),
        make_args=make_wb, reference=lambda *_: wb_ref, moved_bytes=rows * row_bytes,
        direction="d2h", donate_first=True, bulk_pool=lambda: make_wb()[0], bulk_rows=rows,
        **timing)}


# End to end ----------------------------------------------------------------------------------


def decode_check(args, access):
    """Resident vs offloaded decode steps on a synthetic history: bitwise logits, times."""
    row = {"check": "decode_step", "host_access": access, "preset": args.preset,
           "batch": args.batch, "context": args.decode_context, "hot_slots": args.hot_slots}
    try:
        config, offload, params, res, dec, tokens = _decode_inputs(args, access)
        equal, misses, selected, t_res, t_off = True, 0, 0, [], []
        for tok in tokens:
            start = time.perf_counter()
            want, res = resident.decode_step(params, res, tok, config=config, check=False)
            want.block_until_ready()
            t_res.append(time.perf_counter() - start)
            start = time.perf_counter()
            got, dec, stats = offload_decode.decode_step(params, dec, tok, config=config,
                                                         offload=offload, check=False)
            got.block_until_ready()
            t_off.append(time.perf_counter() - start)
            equal &= bool(jnp.array_equal(got, want))
            misses += int(jnp.sum(stats.misses))
            selected += int(jnp.sum(stats.selected >= 0))
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "failed", "error": _error(e)}
    t_res, t_off = t_res[1:] or t_res, t_off[1:] or t_off  # step 0 compiles
    seconds, base = statistics.median(t_off), statistics.median(t_res)
    return {**row, "status": "ok" if equal else "mismatch", "bitwise": equal,
            "steps": args.steps, "hit_rate": 1 - misses / max(selected, 1),
            "seconds": seconds, "resident_seconds": base, "ratio_to_resident": seconds / base}


def _differences(logits, want_logits, kv, want_kv):
    """Where two prefills differ: logits and each layer's KV rows, bitwise and by how much."""
    logits_diff = jnp.abs(logits.astype(jnp.float32) - want_logits.astype(jnp.float32))
    kv_diff = jnp.abs(kv.astype(jnp.float32) - want_kv.astype(jnp.float32))
    per_layer = np.asarray(jnp.max(kv_diff.reshape(kv.shape[0], -1), axis=1))
    return {"logits_equal": bool(jnp.array_equal(logits, want_logits)),
            "kv_equal": bool(jnp.array_equal(kv, want_kv)),
            "logits_max_abs_diff": float(jnp.max(logits_diff)),
            "logits_max_abs": float(jnp.max(jnp.abs(want_logits.astype(jnp.float32)))),
            "kv_max_abs_diff_per_layer": [float(d) for d in per_layer],
            "kv_first_layer_differing": next(
                (i for i, d in enumerate(per_layer) if d > 0), None)}


def _prefill_inputs(args):
    """(config, params, make_resident, make_offload, kv, tokens, num_buffers) of the prefill
    checks: one chunk on top of a random history, both states holding the same rows."""
    base = _model(args)
    hist, chunk, z = args.prefill_history, args.prefill_chunk, args.page_size
    cap = hist + chunk
    config = base.replace(max_seq_len=max(base.max_seq_len, cap))
    params = init_params(config, jax.random.key(2))
    keys = jax.random.split(jax.random.key(3), 3)
    b = args.batch
    kv = jax.random.normal(keys[0], (config.num_layers, b, cap, config.kv_width),
                           jnp.float32).astype(config.jnp_kv_dtype)
    ik = jax.random.normal(keys[1], (config.num_groups, b, cap, config.index_head_dim),
                           jnp.float32).astype(config.jnp_kv_dtype)
    lengths = jnp.full((b,), hist, jnp.int32)
    tokens = jax.random.randint(keys[2], (b, chunk), 0, config.vocab_size, jnp.int32)

    def make_resident():
        return resident.ResidentState(kv=kv + 0, index_keys=ik + 0, lengths=lengths + 0)

    def make_offload():
        # The identity page table: the pools are the per-request arrays, reshaped.
        pages = to_memory_kind(kv.reshape(config.num_layers, b * (cap // z), z, -1),
                               "pinned_host")
        return offload_prefill.PrefillState(
            host=HostPages(kv=pages), table=_table(b, cap, z),
            index_keys=ik.reshape(config.num_groups, b * (cap // z), z, -1) + 0,
            lengths=lengths + 0)

    return config, params, make_resident, make_offload, kv, tokens, min(3, config.num_layers)


def prefill_check(args, access):
    """One chunk on top of a history, resident vs offloaded: bitwise, ratio of times."""
    row = {"check": "prefill_chunk", "host_access": access, "preset": args.preset,
           "history": args.prefill_history, "chunk": args.prefill_chunk, "distance": 1}
    try:
        config, params, make_resident, make_offload, kv, tokens, num_buffers = \
            _prefill_inputs(args)
        row["num_buffers"] = num_buffers
        run_res = functools.partial(resident.prefill, params, config=config, check=False)
        run_off = functools.partial(offload_prefill.prefill, params, config=config,
                                    num_buffers=num_buffers, distance=1, check=False,
                                    host_access=access)
        want, want_state = run_res(make_resident(), tokens)
        got, got_state = run_off(make_offload(), tokens)
        pages = jax.device_put(got_state.host.kv, _device_kind("device")).reshape(kv.shape)
        diff = _differences(got, want, pages, want_state.kv)
        equal = diff["logits_equal"] and diff["kv_equal"]
        if not equal:  # is either path even deterministic here? (same program, run again)
            again, again_state = run_res(make_resident(), tokens)
            diff["resident_repeat_equal"] = bool(jnp.array_equal(again, want)) and bool(
                jnp.array_equal(again_state.kv, want_state.kv))
            again, again_state = run_off(make_offload(), tokens)
            diff["offload_repeat_equal"] = bool(jnp.array_equal(again, got)) and bool(
                jnp.array_equal(again_state.host.kv, got_state.host.kv))
        row.update(diff)
        times = {"resident": [], "offload": []}
        for _ in range(args.repeats + 1):
            for name, run, make in (("resident", run_res, make_resident),
                                    ("offload", run_off, make_offload)):
                state = jax.block_until_ready(make())
                start = time.perf_counter()
                jax.block_until_ready(run(state, tokens))
                times[name].append(time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "failed", "error": _error(e)}
    seconds = statistics.median(times["offload"][1:])
    base_s = statistics.median(times["resident"][1:])
    return {**row, "status": "ok" if equal else "mismatch", "bitwise": equal,
            "seconds": seconds, "resident_seconds": base_s, "ratio_to_resident": seconds / base_s}


# What XLA made of it ---------------------------------------------------------------------------


def _decode_inputs(args, access):
    """(config, offload, params, resident state, decode state, tokens) of the decode checks."""
    config = _model(args)
    z = args.page_size
    capacity = -(-(args.decode_context + args.steps * config.max_ways) // z) * z
    offload = OffloadConfig(hot_slots=args.hot_slots, page_size=z, capacity=capacity,
                            host_access=access)
    params = init_params(config, jax.random.key(1))
    res, dec = committed(synthetic_states(config, offload, args.batch, args.decode_context,
                                           seed=1))
    tokens = [jnp.asarray(np.random.default_rng(i).integers(
        0, config.vocab_size, (args.batch, config.max_ways), dtype=np.int32))
        for i in range(args.steps)]
    return config, offload, params, res, dec, tokens


def program_report(name, access, args, jitted, a, k, pool) -> dict:
    """The compiled program's host-compute ops and whole-pool writes, the CUDA lowering's host
    memory faults; the compiled text to `args.hlo`."""
    row = {"check": name, "host_access": access, "pool_shape": list(pool.shape)}
    start = time.perf_counter()
    try:
        faults = host_memory_checks.host_memory_faults(
            host_memory_checks.lower_for(jitted, *a, platform="cuda", **k), targets=TARGETS)
        compiled = hlo_checks.compile_jitted(jitted, *a, **k)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "compile_failed", "error": _error(e)}
    text = compiled.as_text()
    writes = hlo_checks.state_array_writes(
        text, {"pool": jax.ShapeDtypeStruct(pool.shape, pool.dtype)})
    copies = [w for w in writes if w.split(" ", 1)[0] in ("copy", "copy-start", "copy-done")]
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
        with gzip.open(os.path.join(args.hlo, f"{name}_{access}.hlo.txt.gz"), "wt") as f:
            f.write(text)
    row.update(compile_s=time.perf_counter() - start, host_compute_ops=_host_compute_ops(
        compiled), pool_copies=len(copies), pool_writes=len(writes), pool_write_lines=writes[:5],
        host_memory_faults=len(faults), fault_lines=faults[:5])
    clean = not (row["host_compute_ops"] or writes or faults)
    return {**row, "status": "ok" if clean else "touches_host"}


def hlo_check(args, access):
    """The decode step and the prefill chunk of the end-to-end checks, as compiled and as
    lowered for CUDA: one row each."""
    def decode():
        config, offload, params, _, dec, tokens = _decode_inputs(args, access)
        jitted, a, k = hlo_checks.captured_call(
            offload_decode, "decode_jit", offload_decode.decode_step, params, dec, tokens[0],
            config=config, offload=offload, check=False)
        return program_report("hlo_decode_step", access, args, jitted, a, k, dec.host.kv)

    def prefill():
        config, params, _, make_offload, _, tokens, num_buffers = _prefill_inputs(args)
        state = make_offload()
        jitted, a, k = hlo_checks.captured_call(
            offload_prefill, "prefill_jit", offload_prefill.prefill, params, state, tokens,
            config=config, num_buffers=num_buffers, distance=1, check=False,
            host_access=access)
        return program_report("hlo_prefill", access, args, jitted, a, k, state.host.kv)

    rows = []
    for name, report in (("hlo_decode_step", decode), ("hlo_prefill", prefill)):
        try:
            rows.append(report())
        except Exception as e:  # noqa: BLE001  (making its inputs failed: say so)
            rows.append({"check": name, "host_access": access, "status": "failed",
                         "error": _error(e)})
    return rows


# Report ----------------------------------------------------------------------------------------


def summary_line(row) -> str:
    cell = f" {row['row_bytes']:4d} B x {row['rows']:4d}" if "row_bytes" in row else ""
    head = f"[{row['status']}] {row['check']:15s} host_access={row['host_access']:6s}{cell}"
    if row["status"] == "skipped":
        return f"{head} skipped: {row['reason']}"
    if "error" in row:
        return f"{head} {row['error'].splitlines()[0][:200]}"
    if "gb_per_s" in row:
        bulk = (f"read_bulk {row['read_bulk_gb_per_s']:.2f} GB/s (ratio "
                f"{row['ratio_to_read_bulk']:.3f})" if "read_bulk_gb_per_s" in row else
                f"read_bulk failed ({row.get('read_bulk_error', 'not run')[:80]})")
        return (f"{head} bitwise={row['bitwise']} {row['moved_bytes'] / 1e6:.3f} MB "
                f"{row['seconds'] * 1e3:.3f} ms = {row['gb_per_s']:.2f} GB/s; {bulk}; "
                f"device_put {row['bulk_gb_per_s']:.2f} GB/s (ratio {row['ratio_to_bulk']:.3f})"
                f"; compile {row['compile_s']:.1f} s, host-compute ops {row['host_compute_ops']}")
    if "pool_copies" in row:
        faults = "; ".join(line[:160] for line in row["fault_lines"][:2])
        return (f"{head} host-compute ops {row['host_compute_ops']}, copies of the pool "
                f"{row['pool_copies']} (whole-pool writes {row['pool_writes']}), host memory "
                f"faults of the CUDA lowering {row['host_memory_faults']}"
                + (f": {faults}" if faults else ""))
    extra = f" hit rate {row['hit_rate']:.2f}" if "hit_rate" in row else ""
    if "logits_equal" in row and not row["bitwise"]:
        extra += (f" (logits equal {row['logits_equal']}, max |diff| "
                  f"{row['logits_max_abs_diff']:.3g} of {row['logits_max_abs']:.3g}; KV equal "
                  f"{row['kv_equal']}, first layer differing {row['kv_first_layer_differing']}"
                  f"; resident repeatable {row.get('resident_repeat_equal')}, offloaded "
                  f"repeatable {row.get('offload_repeat_equal')})")
    return (f"{head} bitwise={row['bitwise']} {row['seconds'] * 1e3:.2f} ms vs resident "
            f"{row['resident_seconds'] * 1e3:.2f} ms (x{row['ratio_to_resident']:.2f}){extra}")


def pick(rows) -> str:
    """The settings that compiled and were exact (and, in the hlo check, clean) in every row
    they ran, fastest first."""
    good = []
    for access in HOST_ACCESS:
        mine = [r for r in rows if r["host_access"] == access and r["status"] != "skipped"]
        if mine and all(r["status"] == "ok" for r in mine):
            total = sum(r.get("seconds", 0.0) for r in mine)
            good.append((total, access))
    if not good:
        return "no host_access setting passed every check"
    ranked = ", ".join(f"{a} ({t * 1e3:.1f} ms over its checks)" for t, a in sorted(good))
    return f"settings that compiled and were exact everywhere, fastest first: {ranked}"


CHECKS = ("access", "hlo", "decode", "prefill")
GRACE_S = 240  # a check started just before the budget ends may still run this long


def key_of(row) -> tuple:
    """What names a row: check, setting, and for an access cell its row bytes and rows."""
    return row["check"], row["host_access"], row.get("row_bytes"), row.get("rows")


def cells(args, access) -> list[tuple[list[dict], object]]:
    """[(keys of the rows it reports, run)] of every cell this setting runs, in order."""
    out = []
    if "access" in args.checks:
        out += [([key], run) for key, run in access_cells(args, access)]
    if "hlo" in args.checks:  # compiles only: what XLA does with the copies, seen first
        out.append(([{"check": name, "host_access": access}
                     for name in ("hlo_decode_step", "hlo_prefill")],
                    functools.partial(hlo_check, args, access)))
    if "decode" in args.checks:
        out.append(([{"check": "decode_step", "host_access": access}],
                    functools.partial(decode_check, args, access)))
    if "prefill" in args.checks:
        out.append(([{"check": "prefill_chunk", "host_access": access}],
                    functools.partial(prefill_check, args, access)))
    return out


def planned(args, access) -> list[dict]:
    """The keys of every row a run reports for this setting."""
    return [key for keys, _ in cells(args, access) for key in keys]


def run_in_process(args, emit) -> None:
    """Every planned cell in this process, setting by setting; emit(row) as each one ends.
    A cell not started within the budget is reported as skipped; one that raises, as failed."""
    meta = run_metadata()
    started = time.perf_counter()
    for access in args.access:
        for keys, run in cells(args, access):
            elapsed = time.perf_counter() - started
            if elapsed > args.budget_s:
                got = [{**key, "status": "skipped",
                        "reason": f"time budget of {args.budget_s:.0f} s spent"}
                       for key in keys]
            else:
                try:
                    got = run()
                except Exception as e:  # noqa: BLE001  (making its inputs failed: say so)
                    got = [{**key, "status": "failed", "error": _error(e)} for key in keys]
                got = got if isinstance(got, list) else [got]
                for row in got:
                    row["wall_s"] = (time.perf_counter() - started - elapsed) / len(got)
            for row in got:
                emit({**meta, **row})


def _crash_text(returncode, stderr: str) -> str:
    lines = [line for line in (stderr or "").splitlines() if line.strip()]
    fatal = [line for line in lines if "Check failed" in line or "F0" in line[:3]
             or "Fatal" in line or "Error" in line]
    key = (fatal or lines or ["(no output)"])[-1].strip()
    return (f"the check process ended ({returncode}) before reporting this check: {key}\n"
            + "\n".join(lines[-20:]))[:4000]


def run_isolated(args, argv, access, remaining: float, command=None) -> list[dict]:
    """One setting's checks in a child process, so that a compiler crash (an XLA CHECK failure
    aborts the process) or a faulting kernel is reported as such and the other settings still
    run. The rows it wrote before ending are kept; the planned rows it did not report are
    "crashed"."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        cmd = command or [sys.executable, "-m", "experiments.accelerator.accelerator_check",
                          *argv, "--access", access, "--in-process", "--out", out,
                          "--budget-s", f"{max(remaining, 0):.0f}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=max(remaining, 0) + args.grace_s)
            returncode, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            err = e.stderr or b""
            returncode = f"timed out after {max(remaining, 0) + args.grace_s:.0f} s"
            stderr = err.decode(errors="replace") if isinstance(err, bytes) else err
        rows = []
        if os.path.exists(out):
            with open(out) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    seen = {key_of(r) for r in rows}
    for key in planned(args, access):
        if key_of(key) not in seen:
            rows.append({**key, "status": "crashed", "error": _crash_text(returncode, stderr)})
    return rows


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds, any backend)")
    parser.add_argument("--access", nargs="+", default=list(HOST_ACCESS), choices=HOST_ACCESS)
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    parser.add_argument("--in-process", action="store_true",
                        help="run every setting in this process (default: one child process "
                             "per setting, so that a compiler crash is reported, not fatal)")
    parser.add_argument("--row-counts", type=int, nargs="+", default=[64, 256, 1024, 4096],
                        help="access: rows moved per call")
    parser.add_argument("--row-bytes", type=int, nargs="+", default=sorted(ROW_TYPES),
                        choices=sorted(ROW_TYPES), help="access: bytes per row")
    parser.add_argument("--batch", type=int, default=4,
                        help="requests (the access cells: at most)")
    parser.add_argument("--context", type=int, default=131_072,
                        help="host tokens per request of the read pool")
    parser.add_argument("--miss-chunk", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=64,
                        help="write_rows: at most this many layers written through")
    parser.add_argument("--ways", type=int, default=4, help="write_rows: rows per request "
                                                          "and layer")
    parser.add_argument("--write-context", type=int, default=1024,
                        help="host tokens per request of the write cells' pools")
    parser.add_argument("--inner", type=int, default=8, help="access: calls per timed round")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model-layers", type=int, default=None,
                        help="layers of the end-to-end model (default: the preset's)")
    parser.add_argument("--hot-slots", type=int, default=2048)
    parser.add_argument("--decode-context", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefill-history", type=int, default=16_384)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hlo", default=None, help="hlo: write each compiled program's text "
                                                    "here (gzip)")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="cells not started by then are reported as skipped")
    parser.add_argument("--grace-s", type=float, default=GRACE_S,
                        help="a setting's process may run this long past the budget")
    parser.add_argument("--out", default=DEFAULT_OUT, help="append JSON lines here ('' = none)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.miss_chunk, args.page_size = 2, 256, 8, 8
        args.layers, args.ways, args.write_context = 2, 2, 64
        args.preset, args.hot_slots, args.model_layers = "tiny", 64, 2
        args.decode_context, args.steps = 100, 3
        args.prefill_history, args.prefill_chunk, args.repeats, args.inner = 24, 8, 1, 2
        if "--row-counts" not in argv:
            args.row_counts = [16]
    for check in ACCESSES if "access" in args.checks else ():
        for rows in args.row_counts:
            try:
                cell_shape(args, check, rows)
            except ValueError as e:
                parser.error(f"--row-counts {rows}: {e}")
    started = time.perf_counter()
    rows = []

    def emit(row):
        if not rows and "backend" in row:
            print(f"accelerator check on {row['backend']} ({row['device']}), jax {row['jax']}"
                  + (": a CPU compiles every move to nothing, its GB/s mean nothing"
                     if row["backend"] == "cpu" else ""))
        rows.append(row)
        print(summary_line(row), flush=True)
        write_jsonl(args.out, [row])  # as it comes: a crash later loses nothing

    if args.in_process:
        run_in_process(args, emit)
    else:  # the parent never starts a backend (a GPU would be taken from the children)
        for i, access in enumerate(args.access):  # the budget left, shared by those to come
            remaining = (args.budget_s - (time.perf_counter() - started)) / (len(args.access) - i)
            for row in run_isolated(args, argv, access, remaining):
                emit(row)
    print(pick(rows))
    print(f"{len(rows)} checks in {time.perf_counter() - started:.0f} s")
    if args.out:
        print(f"JSON lines appended to {os.path.normpath(args.out)}")
    return rows


if __name__ == "__main__":
    main()

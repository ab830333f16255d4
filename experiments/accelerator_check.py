"""The first accelerator run: which host-access setting compiles, is exact, and is fast.

One command, bounded in time (`--budget-s`, default 270 s, shared by the settings: checks not
started by then are reported as skipped; one started may run on). For each setting of
`OffloadConfig.host_access` ("gather", "slices"; see fo_jax/offload/host.py for what is known
about each on accelerators), at real sizes (rows of 576 bf16, host pages of a 128k-token
context in `pinned_host` memory):

  gather_rows    decode misses: `--rows` rows per request out of the host pages, to the device
  write_rows     decode write-through: W new rows of each of `--layers` layers, to host pages
  write_back     prefill write-back: one layer's `--chunk` new rows per request, to host pages
  load_history   prefill history load: one layer's pages through the page table (measured
                 under one setting, labelled "both")

each one reports compile success (or the error text), bitwise equality with the same access
done on a device-side copy, the median time, GB/s of the rows moved, and the ratio to a bulk
`jax.device_put` of the same bytes in the same direction; plus a heuristic count of ops XLA
marked as host compute in the compiled program. Then, end to end:

  decode_step    resident vs offloaded decode steps on the `small` preset (synthetic history
                 with misses): bitwise logits per setting, median step time, ratio to resident
  prefill_chunk  one prefill chunk on top of a long history, resident vs offloaded (layer
                 buffers, prefetch distance 1): bitwise logits and host pages, the ratio of
                 times (on an accelerator, how much of the loads and write-backs stays exposed)

One summary line per check is printed, one JSON line per check is appended to `--out` as it
ends; then a line naming the settings that compiled and were exact, fastest first. Each setting
runs in its own child process (`--in-process` to run in this one): an XLA CHECK failure aborts
a process, and is then reported as "crashed" with the end of the compiler's output, while the
other setting still runs.

    python experiments/accelerator_check.py            # on a GPU or TPU (< 5 min on an H200)
    python experiments/accelerator_check.py --smoke    # tiny sizes, any backend (the tests)

On a CPU the moves compile to nothing: the smoke run checks the script and exactness, its GB/s
mean nothing.
"""

from __future__ import annotations

import argparse
import functools
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

sys.path.insert(0, os.path.dirname(__file__))
from common import median_time, run_metadata, synthetic_states, write_jsonl  # noqa: E402

from fo_jax import resident  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload import host  # noqa: E402
from fo_jax.offload import prefill as offload_prefill  # noqa: E402
from fo_jax.offload.config import HOST_ACCESS, OffloadConfig  # noqa: E402
from fo_jax.offload.state import HostPages, committed, to_memory_kind  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "results", "accelerator_check.jsonl")
WIDTH = 576  # D + R of DeepSeek-V3.2 / GLM-5 (512 + 64), bf16 rows of 1152 bytes


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
    """Ops the compiled program marks as host compute (heuristic: `compute_type="host"`)."""
    try:
        return len(re.findall(r'compute_type="host"', compiled.as_text()))
    except Exception:  # noqa: BLE001  (not every backend prints its program)
        return None


def _bulk_seconds(nbytes_shape, direction: str, repeats: int) -> float:
    """Median seconds of one bulk jax.device_put of a bf16 array of this shape."""
    src, dst = ("pinned_host", "device") if direction == "h2d" else ("device", "pinned_host")
    x = jax.device_put(jnp.ones(nbytes_shape, jnp.bfloat16), _device_kind(src))
    target = _device_kind(dst)
    return median_time(lambda: jax.device_put(x, target).block_until_ready(), warmup=1,
                       repeats=repeats)


# One host access --------------------------------------------------------------------------


def _access_check(name, access, *, fn, make_args, reference, moved_shape, direction, repeats,
                  donate_first: bool):
    """Compile fn(*make_args()), compare with reference(*args) on the device, time it."""
    row = {"check": name, "host_access": access, "moved_bytes": int(np.prod(moved_shape)) * 2,
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
        state = {"args": make_args() if donate_first else args}

        def once():
            out = compiled(*state["args"])
            jax.block_until_ready(out)
            if donate_first:
                state["args"] = (out,) + tuple(state["args"][1:])

        seconds = median_time(once, warmup=1, repeats=repeats)
        bulk = _bulk_seconds(moved_shape, direction, repeats)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "run_failed", "error": _error(e)}
    gbps, bulk_gbps = row["moved_bytes"] / seconds / 1e9, row["moved_bytes"] / bulk / 1e9
    return {**row, "status": "ok" if row["bitwise"] else "mismatch", "seconds": seconds,
            "gb_per_s": gbps, "bulk_gb_per_s": bulk_gbps, "ratio_to_bulk": gbps / bulk_gbps}


def _pages(key, layers, batch, context, page):
    """Random bf16 host pages: a pool [L, B P, Z, 576] in pinned_host memory (the identity page
    table: request b's page p is pool page b P + p), and a device copy [L, B, P, Z, 576]."""
    dev = jax.random.normal(key, (layers, batch, context // page, page, WIDTH),
                            jnp.float32).astype(jnp.bfloat16)
    return to_memory_kind(_pool(dev), "pinned_host"), dev


def _pool(pages):
    """[L, B, P, Z, W] per-request pages as the pool [L, B P, Z, W] of the identity table."""
    num_l, batch, num_p, page, width = pages.shape
    return pages.reshape(num_l, batch * num_p, page, width)


def _table(batch, context, page):
    """The identity page table [B, P] int32."""
    return jnp.arange(batch * (context // page), dtype=jnp.int32).reshape(batch, -1)


def access_checks(args, access):
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    b, s, z, rows = args.batch, args.context, args.page_size, args.rows
    pages, dev = _pages(key, 1, b, s, z)
    tokens = jnp.asarray(np.stack([np.sort(rng.choice(s, rows, replace=False))
                                   for _ in range(b)]).astype(np.int32))
    count = jnp.full((b,), rows, jnp.int32)
    bidx = jnp.arange(b)[:, None]
    out = []

    out.append(_access_check(
        "gather_rows", access,
        fn=lambda h, t, c: host.host_gather_rows(h, _table(b, s, z), 0, t, c,
                                                 chunk=args.miss_chunk, on_host=True,
                                                 access=access),
        make_args=lambda: (pages, tokens, count),
        reference=lambda h, t, c: dev.reshape(1, b, s, WIDTH)[0, bidx, t],
        moved_shape=(b, rows, WIDTH), direction="h2d", repeats=args.repeats,
        donate_first=False))

    layers, ways = args.layers, args.ways
    w_pages, w_dev = _pages(key, layers, b, args.write_context, z)
    new = jax.random.normal(key, (layers, b, ways, WIDTH), jnp.float32).astype(jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, args.write_context - ways, (b, 1))
                            + np.arange(ways)).astype(jnp.int32)
    w_ref = _pool(w_dev.reshape(layers, b, -1, WIDTH).at[:, bidx, positions].set(new).reshape(
        w_dev.shape))
    w_table = _table(b, args.write_context, z)
    out.append(_access_check(
        "write_rows", access,
        fn=lambda h, r, p: host.host_write_rows(h, w_table, r, p, on_host=True,
                                                access=access),
        make_args=lambda: (to_memory_kind(_pool(w_dev), "pinned_host"), new, positions),
        reference=lambda *_: w_ref,
        moved_shape=(layers, b, ways, WIDTH), direction="d2h", repeats=args.repeats,
        donate_first=True))
    del w_pages

    chunk, wb_layers = args.chunk, 2
    wb_dev = _pages(key, wb_layers, b, args.write_context, z)[1]
    chunk_rows = jax.random.normal(key, (b, chunk, WIDTH), jnp.float32).astype(jnp.bfloat16)
    start = args.write_context - chunk
    write_pos = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
    wb_ref = _pool(wb_dev.reshape(wb_layers, b, -1, WIDTH).at[1, bidx, write_pos].set(
        chunk_rows).reshape(wb_dev.shape))
    out.append(_access_check(
        "write_back", access,
        fn=lambda h, r, p: host.write_back_rows(h, w_table, 1, r, p, on_host=True,
                                                access=access),
        make_args=lambda: (to_memory_kind(_pool(wb_dev), "pinned_host"), chunk_rows,
                           write_pos),
        reference=lambda *_: wb_ref,
        moved_shape=(b, chunk, WIDTH), direction="d2h", repeats=args.repeats,
        donate_first=True))

    if access == _load_access(args):  # one pattern under both settings: measured once
        hist = args.history_pages
        load_ref = dev[0, :, :hist].reshape(b, hist * z, WIDTH)
        out.append(_access_check(
            "load_history", "both",
            fn=lambda h: host.load_history(h, _table(b, s, z), 0, history_pages=hist,
                                           on_host=True, access=access),
            make_args=lambda: (pages,),
            reference=lambda *_: load_ref,
            moved_shape=(b, hist * z, WIDTH), direction="h2d", repeats=args.repeats,
            donate_first=False))
    return out


# End to end ----------------------------------------------------------------------------------


def decode_check(args, access):
    """Resident vs offloaded decode steps on a synthetic history: bitwise logits, times."""
    config = _model(args)
    z = args.page_size
    capacity = -(-(args.decode_context + args.steps * config.max_ways) // z) * z
    offload = OffloadConfig(hot_slots=args.hot_slots, page_size=z, capacity=capacity,
                            host_access=access)
    row = {"check": "decode_step", "host_access": access, "preset": args.preset,
           "batch": args.batch, "context": args.decode_context, "hot_slots": args.hot_slots}
    params = init_params(config, jax.random.key(1))
    res, dec = committed(synthetic_states(config, offload, args.batch, args.decode_context,
                                           seed=1))
    tokens = [jnp.asarray(np.random.default_rng(i).integers(
        0, config.vocab_size, (args.batch, config.max_ways), dtype=np.int32))
        for i in range(args.steps)]
    try:
        equal, misses, selected, t_res, t_off = True, 0, 0, [], []
        for i, tok in enumerate(tokens):
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


def prefill_check(args, access):
    """One chunk on top of a history, resident vs offloaded: bitwise, ratio of times."""
    base = _model(args)
    hist, chunk, z = args.prefill_history, args.prefill_chunk, args.page_size
    cap = hist + chunk
    config = base.replace(max_seq_len=max(base.max_seq_len, cap))
    row = {"check": "prefill_chunk", "host_access": access, "preset": args.preset,
           "history": hist, "chunk": chunk, "num_buffers": min(3, config.num_layers),
           "distance": 1}
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

    run_res = functools.partial(resident.prefill, params, config=config, check=False)
    run_off = functools.partial(offload_prefill.prefill, params, config=config,
                                num_buffers=row["num_buffers"], distance=1, check=False,
                                host_access=access)
    try:
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


# Report ----------------------------------------------------------------------------------------


def summary_line(row) -> str:
    head = f"[{row['status']}] {row['check']:13s} host_access={row['host_access']:6s}"
    if row["status"] == "skipped":
        return f"{head} skipped: {row['reason']}"
    if "error" in row:
        return f"{head} {row['error'].splitlines()[0][:200]}"
    if "gb_per_s" in row:
        return (f"{head} bitwise={row['bitwise']} {row['moved_bytes'] / 1e6:.1f} MB "
                f"{row['seconds'] * 1e3:.3f} ms = {row['gb_per_s']:.2f} GB/s, bulk device_put "
                f"{row['bulk_gb_per_s']:.2f} GB/s (ratio {row['ratio_to_bulk']:.3f}), compile "
                f"{row['compile_s']:.1f} s, host-compute ops {row['host_compute_ops']}")
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
    """The settings that compiled and were exact in every check they ran, fastest first."""
    good = []
    for access in HOST_ACCESS:
        mine = [r for r in rows if r["host_access"] == access and r["status"] != "skipped"]
        if mine and all(r["status"] == "ok" for r in mine):
            total = sum(r["seconds"] for r in mine)
            good.append((total, access))
    if not good:
        return "no host_access setting passed every check"
    ranked = ", ".join(f"{a} ({t * 1e3:.1f} ms over its checks)" for t, a in sorted(good))
    return f"settings that compiled and were exact everywhere, fastest first: {ranked}"


CHECKS = ("access", "decode", "prefill")
GRACE_S = 240  # a check started just before the budget ends may still run this long


def _load_access(args) -> str:
    """The setting whose run also measures load_history (the same pattern under both)."""
    return args.load_history_access or args.access[0]


def planned(args, access) -> list[tuple[str, str]]:
    """(check, host_access label) of every row a run reports for this setting."""
    names = []
    if "access" in args.checks:
        names += [(n, access) for n in ("gather_rows", "write_rows", "write_back")]
        if access == _load_access(args):
            names.append(("load_history", "both"))
    if "decode" in args.checks:
        names.append(("decode_step", access))
    if "prefill" in args.checks:
        names.append(("prefill_chunk", access))
    return names


def run_in_process(args, emit) -> None:
    """Every planned check in this process; emit(row) as each one ends."""
    meta = run_metadata()
    started = time.perf_counter()
    functions = {"access": access_checks, "decode": decode_check, "prefill": prefill_check}
    for name in CHECKS:
        if name not in args.checks:
            continue
        for access in args.access:
            elapsed = time.perf_counter() - started
            if elapsed > args.budget_s:
                got = [{"check": check, "host_access": label, "status": "skipped",
                        "reason": f"time budget of {args.budget_s:.0f} s spent"}
                       for check, label in planned(args, access)
                       if check in {"access": ("gather_rows", "write_rows", "write_back",
                                               "load_history"),
                                    "decode": ("decode_step",),
                                    "prefill": ("prefill_chunk",)}[name]]
            else:
                got = functions[name](args, access)
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
    aborts the process) is reported as such and the other setting still runs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        cmd = command or [sys.executable, os.path.abspath(__file__), *argv, "--access", access,
                          "--in-process", "--out", out, "--budget-s", f"{max(remaining, 0):.0f}",
                          "--load-history-access", _load_access(args)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=max(remaining, 0) + GRACE_S)
            returncode, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            err = e.stderr or b""
            returncode = f"timed out after {max(remaining, 0) + GRACE_S:.0f} s"
            stderr = err.decode(errors="replace") if isinstance(err, bytes) else err
        rows = []
        if os.path.exists(out):
            with open(out) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    seen = {(r["check"], r["host_access"]) for r in rows}
    for check, label in planned(args, access):
        if (check, label) not in seen:
            rows.append({"check": check, "host_access": label, "status": "crashed",
                         "error": _crash_text(returncode, stderr)})
    return rows


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds, any backend)")
    parser.add_argument("--access", nargs="+", default=list(HOST_ACCESS), choices=HOST_ACCESS)
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    parser.add_argument("--load-history-access", default=None, choices=HOST_ACCESS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true",
                        help="run every setting in this process (default: one child process "
                             "per setting, so that a compiler crash is reported, not fatal)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=131_072, help="host tokens per request")
    parser.add_argument("--rows", type=int, default=2048, help="rows gathered per request")
    parser.add_argument("--miss-chunk", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=61, help="layers written through")
    parser.add_argument("--ways", type=int, default=4)
    parser.add_argument("--write-context", type=int, default=8192,
                        help="host tokens per request of the write checks' pages")
    parser.add_argument("--chunk", type=int, default=4096, help="rows written back per request")
    parser.add_argument("--history-pages", type=int, default=512, help="pages loaded per layer")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model-layers", type=int, default=None,
                        help="layers of the end-to-end model (default: the preset's)")
    parser.add_argument("--hot-slots", type=int, default=2048)
    parser.add_argument("--decode-context", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefill-history", type=int, default=16_384)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="checks not started by then are reported as skipped")
    parser.add_argument("--out", default=DEFAULT_OUT, help="append JSON lines here ('' = none)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.rows, args.miss_chunk, args.page_size = 2, 256, 12, 8, 8
        args.layers, args.ways, args.write_context, args.chunk = 3, 2, 64, 16
        args.history_pages, args.preset, args.hot_slots, args.model_layers = 4, "tiny", 64, 2
        args.decode_context, args.steps = 100, 3
        args.prefill_history, args.prefill_chunk, args.repeats = 24, 8, 1
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

"""Where the offloaded prefill parts from the resident one, bit for bit, on an accelerator.

On the H200 the offloaded prefill chunk was not bitwise equal to the resident one (layer 0's
new KV rows off by one bf16 ulp) while each program repeated itself exactly. This script runs
one chunk on top of a history through several variants of the offloaded program and compares
each with the resident program, layer by layer:

  host_pools      the pools in `pinned_host` memory (what the engine runs)
  ffi             host pools, host_access="ffi" whatever `--host-access` says: fo_jax's copy
                  targets are the only ops that touch host memory, so on a GPU the computing
                  program holds no host value (the variant that must be exact)
  device_pools    the same program with the pools in device memory (no host memory space)
  host_fenced     host pools, each layer's new rows put behind `lax.optimization_barrier`
                  before their write-back (the rows are final on the device first)
  host_no_history host pools, a new batch (no history: no loads)

Every variant but `ffi` moves rows the way `--host-access` says (default: the backend's,
`fo_jax.offload.config.default_host_access`). If `device_pools` is exact and `host_pools` is
not, the host memory space changes the arithmetic (work XLA's host offloader moves to the
host); if neither is, the two programs fuse the model's arithmetic differently. `--hlo DIR`
writes each compiled program's text. One JSON line per variant is appended to `--out` as it
ends.

    python -m experiments.accelerator.prefill_diagnosis --out results/prefill_diagnosis.jsonl
    python -m experiments.accelerator.prefill_diagnosis --host-access ffi  # every variant through ffi
    python -m experiments.accelerator.prefill_diagnosis --smoke  # tiny sizes, any backend (the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import os
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
from fo_jax.offload.config import HOST_ACCESS, default_host_access  # noqa: E402
from fo_jax.offload.state import HostPages, read_back, to_memory_kind  # noqa: E402

VARIANTS = ("host_pools", "ffi", "device_pools", "host_fenced", "host_no_history")


@contextlib.contextmanager
def fenced_write_back():
    """Within: the prefill's write-back takes its rows through `lax.optimization_barrier`.
    Compiled programs are dropped on entry and exit (the patch acts when a program traces)."""
    original = offload_prefill.write_back_rows

    def fenced(host, table, layer, rows, write_pos, **kw):
        rows = jax.lax.optimization_barrier(rows)
        return original(host, table, layer, rows, write_pos, **kw)

    jax.clear_caches()
    offload_prefill.write_back_rows = fenced
    try:
        yield
    finally:
        offload_prefill.write_back_rows = original
        jax.clear_caches()


def _compare(logits, want_logits, kv, want_kv) -> dict:
    per_layer = np.asarray(jnp.max(jnp.abs(kv.astype(jnp.float32) - want_kv.astype(jnp.float32))
                                   .reshape(kv.shape[0], -1), axis=1))
    rows_differing = np.asarray(jnp.sum(jnp.any(kv != want_kv, axis=-1), axis=(1, 2)))
    return {"logits_equal": bool(jnp.array_equal(logits, want_logits)),
            "logits_max_abs_diff": float(jnp.max(jnp.abs(logits.astype(jnp.float32)
                                                         - want_logits.astype(jnp.float32)))),
            "kv_equal": bool(jnp.array_equal(kv, want_kv)),
            "kv_max_abs_diff_per_layer": [float(d) for d in per_layer],
            "kv_rows_differing_per_layer": [int(n) for n in rows_differing],
            "first_layer_differing": next((i for i, d in enumerate(per_layer) if d > 0), None)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds, any backend)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--history", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--host-access", default=None, choices=HOST_ACCESS,
                        help="how every variant but `ffi` moves rows (default: the backend's)")
    parser.add_argument("--hlo", default=None, help="write each compiled program's text here")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.history, args.chunk, args.page_size = "tiny", 32, 16, 8
    config = get_config(args.preset)
    if args.smoke:  # one indexer group (each group is its own code in every program)
        config = config.replace(name=f"{config.name}-1group", indexer_layers=(0,))
    hist, chunk, z, b = args.history, args.chunk, args.page_size, args.batch
    cap = hist + chunk
    config = config.replace(max_seq_len=max(config.max_seq_len, cap))
    params = init_params(config, jax.random.key(2))
    keys = jax.random.split(jax.random.key(3), 3)
    kv = jax.random.normal(keys[0], (config.num_layers, b, cap, config.kv_width),
                           jnp.float32).astype(config.jnp_kv_dtype)
    ik = jax.random.normal(keys[1], (config.num_groups, b, cap, config.index_head_dim),
                           jnp.float32).astype(config.jnp_kv_dtype)
    tokens = jax.random.randint(keys[2], (b, chunk), 0, config.vocab_size, jnp.int32)
    table = jnp.arange(b * (cap // z), dtype=jnp.int32).reshape(b, -1)
    meta = {**run_metadata(), "preset": args.preset, "batch": b, "history": hist,
            "chunk": chunk, "page_size": z}
    access = args.host_access or default_host_access()
    print(f"prefill diagnosis on {meta.get('backend')} ({meta.get('device')}), "
          f"jax {jax.__version__}: {args.preset}, batch {b}, history {hist}, chunk {chunk}, "
          f"host_access {access} (the ffi variant: ffi)")

    def resident_state(history):
        return resident.ResidentState(kv=kv + 0, index_keys=ik + 0,
                                      lengths=jnp.full((b,), history, jnp.int32))

    def offload_state(history, kind):
        pages = kv.reshape(config.num_layers, b * (cap // z), z, -1) + 0
        if kind == "pinned_host":
            pages = to_memory_kind(pages, "pinned_host")
        return offload_prefill.PrefillState(
            host=HostPages(kv=pages), table=table + 0,
            index_keys=ik.reshape(config.num_groups, b * (cap // z), z, -1) + 0,
            lengths=jnp.full((b,), history, jnp.int32))

    run_res = functools.partial(resident.prefill, params, config=config, check=False)
    references = {}
    rows = []
    for variant in args.variants:
        history = 0 if variant == "host_no_history" else hist
        kind = "device" if variant == "device_pools" else "pinned_host"
        variant_access = "ffi" if variant == "ffi" else access
        run_off = functools.partial(offload_prefill.prefill, params, config=config,
                                    num_buffers=min(3, config.num_layers), distance=1,
                                    check=False, host_access=variant_access)
        if history not in references:
            want, want_state = run_res(resident_state(history), tokens)
            references[history] = (want, want_state.kv)
            if args.hlo:
                _dump(args.hlo, f"resident_h{history}",
                      resident.lower_prefill(params, resident_state(history), tokens,
                                             config=config, check=False))
        want, want_kv = references[history]
        start = time.perf_counter()
        ctx = fenced_write_back() if variant == "host_fenced" else contextlib.nullcontext()
        with ctx:
            got, got_state = run_off(offload_state(history, kind), tokens)
            again, _ = run_off(offload_state(history, kind), tokens)
            if args.hlo:
                _dump(args.hlo, variant, offload_prefill.lower_prefill(
                    params, offload_state(history, kind), tokens, config=config,
                    num_buffers=min(3, config.num_layers), distance=1, check=False,
                    host_access=variant_access))
        pages = read_back(got_state.host.kv).reshape(kv.shape)
        row = {**meta, "variant": variant, "host_access": variant_access,
               **_compare(got, want, jnp.asarray(pages), want_kv),
               "repeats_itself": bool(jnp.array_equal(again, got)),
               "wall_s": time.perf_counter() - start}
        rows.append(row)
        write_jsonl(args.out, [row])  # as it comes: a variant that hangs loses no other
        print(f"[{'exact' if row['logits_equal'] and row['kv_equal'] else 'differs'}] "
              f"{variant:16s} logits equal {row['logits_equal']} (max |diff| "
              f"{row['logits_max_abs_diff']:.3g}); KV equal {row['kv_equal']}, first layer "
              f"differing {row['first_layer_differing']}, rows differing per layer "
              f"{row['kv_rows_differing_per_layer']}; repeats itself {row['repeats_itself']}")
    exact = sum(r["logits_equal"] and r["kv_equal"] for r in rows)
    print(f"{exact} of {len(rows)} variants exact")
    return rows


def _dump(folder, name, lowered) -> None:
    os.makedirs(folder, exist_ok=True)
    with gzip.open(os.path.join(folder, f"{name}.hlo.txt.gz"), "wt") as f:
        f.write(lowered.compile().as_text())


if __name__ == "__main__":
    main()

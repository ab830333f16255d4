"""Is fo_jax's host-copy library here, registered, and right on this backend? The first part of
an accelerator run: without it every host_access="ffi" part would fail one by one.

Says which library the backend uses (on a GPU: the CUDA library found at
`$FO_JAX_CUDA_LIBRARY`, `fo_jax/offload/ffi/lib/` or the cache, see
`fo_jax.offload.ffi.library`; on a CPU: the C++ target, compiled on first use), registers its
targets, then runs each of them once on a small `pinned_host` pool against its jnp reference
(`gather_items` of single rows and of pages, `scatter_items` into the donated pool, `read_bulk`),
bit for bit. Prints one line per step and appends one JSON line (with run metadata) to `--out`.

Exit status: 0 when the library is registered and every copy is exact; 1 when the library is
missing or cannot be registered (the message says how to build it) or `--require-gpu` is given
on a machine whose jax backend is not a GPU; 2 when a copy runs but gives other bits.

    python -m experiments.accelerator.host_copy_check --require-gpu     # the accelerator run
    python -m experiments.accelerator.host_copy_check --smoke           # any backend (the tests)
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax.offload.ffi import (  # noqa: E402
    LibraryUnavailable,
    ensure_registered,
    gather_items,
    gather_items_reference,
    read_bulk,
    scatter_items,
    scatter_items_reference,
)
from fo_jax.offload.ffi import library  # noqa: E402
from fo_jax.offload.state import to_memory_kind  # noqa: E402

BUILD = ("python -m fo_jax.offload.ffi cuda --jaxlib 0.11.2 "
         "--out fo_jax/offload/ffi/lib/libfo_jax_host_copy_cuda.so")


def library_path(backend: str) -> str | None:
    """Where the library for `backend` is (None: not found; CPU: compiled now if needed)."""
    if library.platform_of(backend) == "cpu":
        return str(library.cpu_library())
    path = library.cuda_library()
    return None if path is None else str(path)


def copies_exact(rows: int = 64, width: int = 576, page: int = 16) -> dict[str, bool]:
    """Each copy target once on a small pinned_host pool [2, F, Z, W] of bf16, against its jnp
    reference: {copy: bitwise equal}."""
    frames = 2 * rows // page
    pool_dev = jax.random.normal(jax.random.key(0), (2, frames, page, width),
                                 jnp.float32).astype(jnp.bfloat16)
    pool = to_memory_kind(pool_dev, "pinned_host")
    rng = np.random.default_rng(0)
    index = np.stack([rng.integers(0, 2, rows), rng.permutation(frames * page)[:rows]], -1)
    index[::7] = -1  # skipped entries: zeros when read, nothing written
    index = jnp.asarray(index, jnp.int32)
    pages = jnp.asarray(np.stack([rng.integers(0, 2, 4), rng.permutation(frames)[:4] * page],
                                 -1), jnp.int32)
    new = jax.random.normal(jax.random.key(1), (rows, 1, width),
                            jnp.float32).astype(jnp.bfloat16)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    got = {}
    gather = jax.jit(gather_items, static_argnames="item_rows")
    got["gather_rows"] = gather(pool, index), gather_items_reference(pool_dev, index)
    got["gather_pages"] = (gather(pool, pages, item_rows=page),
                           gather_items_reference(pool_dev, pages, item_rows=page))
    bulk = jax.jit(read_bulk, static_argnames=("layer", "row", "rows"))
    got["read_bulk"] = (bulk(pool, layer=1, row=page, rows=rows),
                        pool_dev.reshape(2, -1, width)[1, page:page + rows])
    want = scatter_items_reference(pool_dev, new, index)
    written = jax.jit(scatter_items, donate_argnums=0)(pool, new, index)
    got["scatter_rows"] = jax.device_put(written, dev), want
    return {name: bool(jnp.array_equal(jax.device_put(a, dev), b))
            for name, (a, b) in got.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="(the same check: it is small)")
    parser.add_argument("--require-gpu", action="store_true",
                        help="fail unless jax's backend is a GPU (the accelerator run)")
    parser.add_argument("--out", default=None, help="append a JSON line here")
    args = parser.parse_args(argv)
    meta = run_metadata()
    backend = meta["backend"]
    row = {**meta, "check": "host_copy_library", "registered": False}
    print(f"host-copy library on {backend} ({meta['device']}), jax {meta['jax']}")
    status = 0
    if args.require_gpu and backend not in ("gpu", "cuda"):
        row["error"] = (f"jax's backend is {backend!r}, not a GPU: this run measures nothing "
                        "(is the GPU visible, and jax's CUDA plugin installed?)")
        status = 1
    else:
        row["library"] = None
        try:
            row["library"] = library_path(backend)
            if row["library"] is None and library.find_nvcc() is None:
                raise LibraryUnavailable("no CUDA host-copy library found and no nvcc to build "
                                         "one")
            ensure_registered(backend)
            row["library"] = row["library"] or library_path(backend)  # built on first use
            row["registered"] = True
        except (LibraryUnavailable, NotImplementedError, OSError) as e:
            row["error"] = f"{type(e).__name__}: {e}"
            status = 1
    if status:
        print(f"FAILED: {row['error']}")
        if "library" in row:  # the backend is right; its library is not here
            print(f"  Build the CUDA library on any machine with the CUDA 13 wheels (no GPU "
                  f"needed):\n    {BUILD}\n  and take the git-ignored file along with the "
                  "working tree (or point $FO_JAX_CUDA_LIBRARY at it).")
        write_jsonl(args.out, [row])
        return status
    print(f"  library {row['library']}: registered the targets {', '.join(library.TARGETS)}")
    row["exact"] = copies_exact()
    for name, equal in row["exact"].items():
        print(f"  [{'exact' if equal else 'DIFFERS'}] {name}")
    write_jsonl(args.out, [row])
    if not all(row["exact"].values()):
        print("FAILED: a copy target gives other bits than its reference")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

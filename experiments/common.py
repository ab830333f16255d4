"""Shared helpers of the experiment scripts: timing, run metadata, JSON lines, synthetic states."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax import resident
from fo_jax.offload.state import DecodeState


def run_metadata() -> dict[str, Any]:
    """jax version, backend, device kind and git revision: stamped on every JSON line."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=os.path.dirname(__file__), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    device = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(device, "device_kind", str(device)), "git": rev or "unknown"}


def median_time(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall seconds of fn() (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_jsonl(path: str | None, rows: list[dict]) -> None:
    """Append rows as JSON lines to `path` (nothing if path is None)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def synthetic_states(config, offload, batch, context, seed, heavy=0.1, boost=4.0):
    """Resident and offloaded states holding the same random history of `context` tokens.

    A random `heavy` fraction of the tokens gets indexer keys `boost` times longer, so the
    indexer keeps preferring them step after step: the temporal locality real long-context
    sessions show (a working set smaller than the hot cache). heavy=0 gives uniform keys, where
    every step's top-k is an independent draw and the hit rate falls to about C / context.
    """
    keys = jax.random.split(jax.random.key(seed), 3)
    capacity = offload.capacity
    kv = jax.random.normal(keys[0], (config.num_layers, batch, capacity, config.kv_width),
                           jnp.float32).astype(config.jnp_kv_dtype)
    ik = jax.random.normal(keys[1], (config.num_groups, batch, capacity,
                                     config.index_head_dim), jnp.float32)
    favoured = jax.random.bernoulli(keys[2], heavy, (1, batch, capacity, 1))
    ik = jnp.where(favoured, ik * boost, ik).astype(config.jnp_kv_dtype)
    lengths = np.full((batch,), context, np.int32)
    dec = DecodeState.from_resident(kv, ik, lengths, config=config, offload=offload)
    res = resident.ResidentState(kv=kv, index_keys=ik, lengths=jnp.asarray(lengths))
    return res, dec

"""Shared helpers of the experiment scripts: timing, run metadata, JSON lines."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import Any, Callable

import jax


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

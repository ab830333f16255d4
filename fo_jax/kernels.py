"""Choosing the implementation of the two fused operations: XLA or the Pallas kernels.

    implementation = "xla"     indexer scores + `select_topk` and gather + `sparse_attention`
                               in XLA: runs on every backend (the reference).
    implementation = "pallas"  LIM (scores fused with the slot lookup) and CopySFA (attention
                               whose gather copies the misses from host) from `pallas_kernels`:
                               Pallas TPU kernels; on other backends only in TPU interpret mode
                               (`interpret=True` or a `pltpu.InterpretParams`).
    implementation = None      "pallas" on a TPU, "xla" elsewhere.

An explicit choice that cannot run raises; nothing falls back silently.
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("xla", "pallas")


def resolve_implementation(implementation: str | None, interpret=False) -> str:
    """The implementation to run on this backend; raises if an explicit one cannot run."""
    backend = jax.default_backend()
    if implementation is None:
        return "pallas" if backend == "tpu" else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of "
                         f"{IMPLEMENTATIONS} or None (by backend)")
    if implementation == "pallas" and backend != "tpu" and not interpret:
        raise NotImplementedError(
            f"implementation='pallas' runs Pallas TPU kernels, which the {backend!r} backend "
            "cannot compile (Mosaic GPU has no host memory space); pass interpret=True to run "
            "them in TPU interpret mode, or use implementation='xla'")
    return implementation


def interpret_params(interpret):
    """`interpret` as the kernels take it: False, or a `pltpu.InterpretParams`."""
    if interpret is True:
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams(dma_execution_mode="on_wait")
    return interpret


def check_kv_format(implementation: str, kv_format: str) -> None:
    """Raise NotImplementedError for a cache format the chosen implementation cannot read:
    CopySFA (the Pallas path) attends over float rows, not fp8_ds_mla bytes."""
    if implementation == "pallas" and kv_format != "bf16":
        raise NotImplementedError(
            f"implementation='pallas' (CopySFA) reads kv_format='bf16' rows, not "
            f"{kv_format!r}: use implementation='xla' (which dequantizes the K rows it "
            "gathers) or kv_format='bf16'")

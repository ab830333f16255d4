"""fo_jax's own host copies: XLA FFI targets that move rows between host pools and the device
(CPU and CUDA twins of one semantics), their jax calls and pure-jnp references."""

from fo_jax.offload.ffi.copies import (
    gather_items,
    gather_items_reference,
    read_bulk,
    scatter_items,
    scatter_items_reference,
)
from fo_jax.offload.ffi.library import (
    LibraryUnavailable,
    available,
    ensure_registered,
    export_checks,
)

__all__ = [
    "LibraryUnavailable",
    "available",
    "ensure_registered",
    "export_checks",
    "gather_items",
    "gather_items_reference",
    "read_bulk",
    "scatter_items",
    "scatter_items_reference",
]

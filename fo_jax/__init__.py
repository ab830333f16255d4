"""fo_jax: FlashOffloading for DSA (DeepSeek-V3.2-style sparse attention) models in JAX.

The authoritative KV cache lives in host memory; the device keeps the indexer keys, a hot cache
and the slot maps, and every output is bit for bit that of the same model with the whole KV on
the device (`fo_jax.resident`).
"""

__version__ = "0.1.0"

"""Pallas kernels of fo_jax, each beside its pure-jnp reference; depends on jax only."""

"""Offloading: state, decode step, prefill loop, eviction policies, and their models."""

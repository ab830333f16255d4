"""Traces and policies: attention traces, their replay, eviction policies, prefetch distance,
rank imbalance."""

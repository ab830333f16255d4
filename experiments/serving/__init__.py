"""Serving: the engine's throughput and latency, data parallel, automatic offload."""

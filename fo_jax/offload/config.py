"""Settings of the offloaded decode path: hot-cache size, page / tail-block size, policy, memory."""

from __future__ import annotations

import dataclasses

from fo_jax.config import INT32_MAX, ModelConfig

POLICIES = ("ring", "lru", "random")
MEMORY_KINDS = ("pinned_host", "device")
HOST_ACCESS = ("gather", "slices")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """How a batch's KV is split between host memory and the device.

    Attributes:
      hot_slots: C, hot-cache slots per layer and request (>= top-k * max ways, so that every
        way's selection fits).
      page_size: Z, tokens per host page; also the size of each of the two tail blocks that
        receive new tokens on the device.
      capacity: S, positions per request in host memory (a multiple of page_size).
      policy: eviction policy: "ring" (default, O(K * W + misses) per step), "lru" (O(C) per
        step: the HiSparse / ECHO-style baseline) or "random".
      host_memory_kind: where host pages live: "pinned_host" (real offload) or "device" (Pallas
        interpret mode, whose jit cannot mix memory kinds; on a CPU it is the same RAM).
      miss_chunk: host rows fetched per iteration of the miss loop; a step fetches
        ceil(max over the batch of misses / miss_chunk) * miss_chunk rows per request and layer,
        not K * W.
      seed: seed of the random policy.
      host_access: how rows move between host pages and the device (fo_jax.offload.host):
        "gather" (gathers / scatters on the host array) or "slices" (one dynamic slice / dynamic
        update slice per row, with explicit memory-space moves). Same bits; which one compiles
        and is fast on an accelerator is what experiments/accelerator_check.py measures.
    """

    hot_slots: int
    page_size: int = 16
    capacity: int = 1024
    policy: str = "ring"
    host_memory_kind: str = "pinned_host"
    miss_chunk: int = 64
    seed: int = 0
    host_access: str = "gather"

    def __post_init__(self):
        for field in ("hot_slots", "page_size", "capacity", "miss_chunk"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"OffloadConfig.{field} must be a positive int, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose one of {POLICIES}")
        if self.host_memory_kind not in MEMORY_KINDS:
            raise ValueError(f"host_memory_kind={self.host_memory_kind!r}; choose one of "
                             f"{MEMORY_KINDS}")
        if self.host_access not in HOST_ACCESS:
            raise ValueError(f"host_access={self.host_access!r}; choose one of {HOST_ACCESS}")
        if self.page_size > self.hot_slots:
            raise ValueError(f"a tail block of page_size={self.page_size} tokens is larger than "
                             f"the hot cache (hot_slots={self.hot_slots}); use a smaller page")
        if self.capacity % self.page_size:
            raise ValueError(f"capacity={self.capacity} must be a multiple of "
                             f"page_size={self.page_size}")
        if self.capacity + self.hot_slots + 2 * self.page_size >= INT32_MAX:
            raise ValueError(f"capacity={self.capacity} and hot_slots={self.hot_slots} overflow "
                             "int32 token / slot indices")

    @property
    def num_pages(self) -> int:
        """P: host pages per request."""
        return self.capacity // self.page_size

    @property
    def rows(self) -> int:
        """C + 2Z: device rows per layer and request (hot slots, then two tail blocks)."""
        return self.hot_slots + 2 * self.page_size

    def validate_for(self, config: ModelConfig) -> None:
        """Raise if this offload setting cannot serve `config` (checked before any state exists)."""
        need = config.index_topk * config.max_ways
        if self.hot_slots < need:
            raise ValueError(
                f"hot_slots={self.hot_slots} < index_topk * max_ways = {config.index_topk} * "
                f"{config.max_ways} = {need}: one step's selections must fit the hot cache; "
                f"use hot_slots >= {need}")
        if self.page_size < config.max_ways:
            raise ValueError(
                f"page_size={self.page_size} < max_ways={config.max_ways}: one step's new tokens "
                "must fit in the two tail blocks; use a larger page")
        if self.capacity > config.max_seq_len:
            raise ValueError(f"capacity={self.capacity} exceeds max_seq_len={config.max_seq_len}"
                             f" of config {config.name!r}")
        if self.capacity * config.max_ways >= INT32_MAX:
            raise ValueError(f"capacity={self.capacity} overflows int32 index arithmetic")

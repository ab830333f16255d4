"""Settings of the offloaded decode path: hot-cache size, page / tail-block size, policy, memory."""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings

from fo_jax.config import INT32_MAX, ModelConfig

POLICIES = ("ring", "lru", "random", "clock")
MEMORY_KINDS = ("pinned_host", "device")
HOST_ACCESS = ("gather", "slices", "ffi")


def default_host_access(backend: str | None = None) -> str:
    """The host access used when none is named: "ffi" on a GPU when the CUDA host-copy library
    is found (fo_jax.offload.ffi.library), else "gather". On a GPU without the library it warns
    once, naming the fallback and how to build the library. CPU (and TPU) default to "gather":
    XLA compiles plain gathers there without host compute (a CPU has one memory)."""
    import jax

    backend = backend or jax.default_backend()
    if backend not in ("gpu", "cuda"):
        return "gather"
    from fo_jax.offload.ffi.library import available

    if available(backend):
        return "ffi"
    _warn_no_library()
    return "gather"


@functools.cache
def _warn_no_library():
    warnings.warn("host_access defaults to 'gather' on this GPU: the CUDA host-copy library "
                  "was not found, so XLA runs the host gathers and scatters as host compute "
                  "(several times slower). Build it with `python -m fo_jax.offload.ffi cuda` "
                  "(no GPU needed) and point $FO_JAX_CUDA_LIBRARY at it, or pass "
                  "host_access='gather' to silence this", stacklevel=3)


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
        step: the HiSparse / ECHO-style baseline), "random" or "clock" (second chance: O(K * W +
        misses) per step amortised, O(C) in the worst step).
      host_memory_kind: where host pages live: "pinned_host" (real offload) or "device" (Pallas
        interpret mode, whose jit cannot mix memory kinds; on a CPU it is the same RAM).
      miss_chunk: host rows fetched per iteration of the miss loop; a step fetches
        ceil(max over the batch of misses / miss_chunk) * miss_chunk rows per request and layer,
        not K * W.
      seed: seed of the random policy.
      host_access: how rows move between host pages and the device (fo_jax.offload.host):
        "gather" (gathers / scatters on the host array), "slices" (one dynamic slice / dynamic
        update slice per row, with explicit memory-space moves) or "ffi" (fo_jax's own copy
        targets, fo_jax.offload.ffi: on a GPU the only thing that touches host memory). Same
        bits. None (default): `default_host_access()`, "ffi" on a GPU with the CUDA host-copy
        library, else "gather".
    """

    hot_slots: int
    page_size: int = 16
    capacity: int = 1024
    policy: str = "ring"
    host_memory_kind: str = "pinned_host"
    miss_chunk: int = 64
    seed: int = 0
    host_access: str | None = None

    def __post_init__(self):
        if self.host_access is None:
            object.__setattr__(self, "host_access", default_host_access())
        for field in ("hot_slots", "page_size", "capacity", "miss_chunk"):
            value = as_int(getattr(self, field))
            if value is None or value < 1:
                raise ValueError(f"OffloadConfig.{field} must be a positive int, got "
                                 f"{getattr(self, field)!r}")
            # numpy integers become ints: the config is a static jit argument, hashed and shown.
            object.__setattr__(self, field, value)
        if as_int(self.seed) is not None:
            object.__setattr__(self, "seed", as_int(self.seed))
        if self.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose one of {POLICIES}")
        if self.host_memory_kind not in MEMORY_KINDS:
            raise ValueError(f"host_memory_kind={self.host_memory_kind!r}; choose one of "
                             f"{MEMORY_KINDS}")
        if self.host_access not in HOST_ACCESS:
            raise ValueError(f"host_access={self.host_access!r}; choose one of {HOST_ACCESS}")
        if self.page_size > self.hot_slots:
            raise ValueError(f"a tail block of page_size={self.page_size} tokens is larger than "
                             f"the hot cache (hot_slots={self.hot_slots}); use a smaller page "
                             "or more hot slots (decode needs hot_slots >= index_topk * "
                             "max_ways: see check_hot_slots)")
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
        check_hot_slots(self.hot_slots, config)
        if self.page_size < config.max_ways:
            raise ValueError(
                f"page_size={self.page_size} < max_ways={config.max_ways}: one step's new tokens "
                "must fit in the two tail blocks; use a larger page")
        if self.capacity > config.max_seq_len:
            raise ValueError(f"capacity={self.capacity} exceeds max_seq_len={config.max_seq_len}"
                             f" of config {config.name!r}")
        if self.capacity * config.max_ways >= INT32_MAX:
            raise ValueError(f"capacity={self.capacity} overflows int32 index arithmetic")


def as_int(value) -> int | None:
    """`value` as an int if it is an integer (int, numpy integer; not bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def min_hot_slots(config: ModelConfig) -> int:
    """The fewest hot slots a decode step of `config` runs with: index_topk * max_ways (every
    way's selection must fit the hot cache at once)."""
    return config.index_topk * config.max_ways


def check_hot_slots(hot_slots: int, config: ModelConfig) -> None:
    """Raise unless `hot_slots` can serve `config`: the one rule of decode and the planner."""
    need = min_hot_slots(config)
    if hot_slots < need:
        raise ValueError(
            f"hot_slots={hot_slots} < index_topk * max_ways = {config.index_topk} * "
            f"{config.max_ways} = {need}: one step's selections must fit the hot cache; "
            f"use hot_slots >= {need}")


def check_num_buffers(num_buffers, num_layers: int) -> int:
    """`num_buffers` as an int if the offloaded prefill can run with it, else raise.

    The one rule of the prefill, its engine and the planner: n in [min(2, L), L]. Buffer 0 is
    pinned to layer 0 and layers >= 1 need at least one rotating buffer; more buffers than
    layers are never used.
    """
    low = min(2, num_layers)
    value = as_int(num_buffers)
    if value is None or not low <= value <= num_layers:
        raise ValueError(
            f"num_buffers={num_buffers!r} must be an int in [{low}, {num_layers}] "
            f"(num_layers={num_layers}): buffer 0 is pinned to layer 0 and at least one more "
            "rotates over the other layers; more buffers than layers are never used")
    return value

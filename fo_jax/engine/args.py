"""The engine's command-line flags in one place (`fo-jax serve`, `fo-jax bench-serve`).

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    engine_args = EngineArgs.from_cli_args(parser.parse_args())   # flags checked here
    config, load, tokenizer = resolve_model(engine_args.model_args)   # fo_jax.resolve
    offload = engine_args.offload_config(config)                  # checked against the model
    settings = engine_args.engine_settings(config, offload)       # fo_jax.engine.EngineSettings

`EngineArgs` holds the flags' values as parsed (GB, -1 for "no aging", ...), one field per flag,
the model flags and the drafting flags being those every command shares (`fo_jax.flags`:
`ModelArgs`, `add_drafting_args`, as `fo-jax generate` takes them);
`from_cli_args` checks the rules between flags (an offloaded-only flag without --offload, ...)
before any model is read, with messages that name the flags; `engine_settings` turns them into
the engine's settings (`fo_jax.engine.settings`: bytes, None, ...), which check themselves
again as the library's API does.
"""

from __future__ import annotations

import argparse
import dataclasses

from fo_jax import flags
from fo_jax.config import ModelConfig
from fo_jax.engine.settings import (DEFAULT_PREFILL_BATCH, CacheSettings, EngineSettings,
                                    SchedulerSettings, SpeculativeSettings)
from fo_jax.flags import ModelArgs, add_drafting_args, drafting
from fo_jax.offload.config import MEMORY_KINDS, OffloadConfig, check_hot_slots, min_hot_slots

PLACEMENTS = ("round_robin", "least_requests", "least_context", "least_misses")
DEFAULT_CAPACITY = 2048  # --capacity default: min(max_seq_len, this)


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """The model and engine flags, one field per flag (`add_cli_args` gives each its help);
    the model flags are `model_args` (`fo_jax.flags.ModelArgs`).

    Raises (at construction, `__post_init__`):
      ValueError: flags that cannot go together or are out of range, naming the flags.
    """

    model_args: ModelArgs = ModelArgs()
    seats: int = 4
    capacity: int | None = None
    offload: bool = False
    hot_slots: int | None = None
    page_size: int = 16
    policy: str | None = None
    pool_memory: str | None = None
    host_pool_gb: float | None = None
    prefix_cache: bool = False
    prefix_cache_gb: float | None = None
    device_gb: float | None = None
    reserve: str = "full"
    queue_order: str = "fifo"
    max_wait_steps: int = 256
    decode_steps_per_call: int = 1
    overlap: bool = True
    num_drafts: int | None = None
    drafter: str | None = None
    prefill_chunk: int = 256
    prefill_batch: int = DEFAULT_PREFILL_BATCH
    devices: int | None = None
    expert_parallel: int | None = None
    placement: str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the model and engine flags to `parser`."""
        ModelArgs.add_cli_args(parser)
        parser.add_argument("--seats", type=int, default=4, help="requests decoded at once")
        parser.add_argument("--capacity", type=int, default=None,
                            help="tokens per seat, prompt + output (default: min(max_seq_len, "
                                 "2048))")
        parser.add_argument("--offload", action="store_true",
                            help="a paged KV pool shared by the seats, in host memory "
                                 "(offloaded; --pool-memory device: in device memory)")
        parser.add_argument("--hot-slots", type=int, default=None,
                            help="with --offload: hot-cache slots per layer (default: top-k x "
                                 "max ways)")
        parser.add_argument("--page-size", type=int, default=16,
                            help="with --offload: host page")
        parser.add_argument("--policy", default=None,
                            help="with --offload: eviction policy ring (default), lru, random, "
                                 "clock")
        parser.add_argument("--pool-memory", default=None, metavar="{pinned_host,device}",
                            help="with --offload: where the KV page pool lives: pinned_host "
                                 "(default: offloaded to host memory) or device (the paged KV "
                                 "on the device: its pages count against --device-gb, with "
                                 "admission and preemption by bytes)")
        parser.add_argument("--host-pool-gb", type=flags.gigabytes, default=None,
                            help="with --offload: host KV pool shared by the seats, in GB "
                                 "(default every seat full at once; with --expert-parallel, "
                                 "each device's pool)")
        parser.add_argument("--prefix-cache", action="store_true",
                            help="reuse earlier prompts' prefixes: offloaded, their pool pages; "
                                 "resident, their KV rows, copied from a prefix store in device "
                                 "memory")
        parser.add_argument("--prefix-cache-gb", type=flags.gigabytes, default=None,
                            help="with --prefix-cache, resident: the prefix store's size in GB "
                                 "(default: one seat's rows)")
        parser.add_argument("--device-gb", type=flags.gigabytes, default=None,
                            help="with --offload: device budget of request state in GB (hot "
                                 "caches, indexer-key pages, prefill buffers, and the KV pages "
                                 "with --pool-memory device: the planner's arithmetic); "
                                 "requests wait for it, one that never fits is refused (with "
                                 "--expert-parallel, each device's budget)")
        parser.add_argument("--reserve", choices=("full", "prompt"), default="full",
                            help="with --offload: pages reserved at admission: prompt + "
                                 "max_tokens (full), or the prompt and the next decode call, "
                                 "growing as it decodes and preempting the youngest request "
                                 "when short (prompt)")
        parser.add_argument("--queue-order", choices=("fifo", "shortest"), default="fifo",
                            help="waiting requests: by arrival, or shortest prompt + max_tokens "
                                 "first")
        parser.add_argument("--max-wait-steps", type=int, default=256,
                            help="with --queue-order shortest: engine steps after which a "
                                 "waiting request goes ahead of shorter ones (-1: no aging)")
        parser.add_argument("--decode-steps-per-call", type=int, default=1)
        parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                            help="dispatch the next decode call before reading back the last "
                                 "one, so the engine's host work runs while the device "
                                 "computes (the same tokens either way; --no-overlap reads "
                                 "each call back first; not with --devices, whose ranks run "
                                 "side by side already)")
        add_drafting_args(parser)  # --drafter, --num-drafts: as `fo-jax generate`
        parser.add_argument("--prefill-chunk", type=int, default=256)
        parser.add_argument("--prefill-batch", type=int, default=DEFAULT_PREFILL_BATCH,
                            help="the most prefilling requests one prefill program runs, each "
                                 "over its own seat and history (1: one program per request; "
                                 "the same tokens either way where the matmuls compute rows "
                                 "independently, as on CPU)")
        parser.add_argument("--devices", type=int, default=None,
                            help="serve data-parallel on this many local devices: one engine "
                                 "per device (--seats and the host pool per device), each "
                                 "request placed on one (fo_jax.engine.data_parallel). On a "
                                 "CPU, simulated devices need XLA_FLAGS="
                                 "--xla_force_host_platform_device_count=N. Across processes "
                                 "(jax.distributed, e.g. python -m fo_jax.distributed launch): "
                                 "the global device count, each process driving its own, with "
                                 "--expert-parallel (one endpoint, on process 0)")
        parser.add_argument("--expert-parallel", type=int, default=None, metavar="E",
                            help="with --devices N: one sharded engine stepping the N devices "
                                 "in one program, the MoE experts split over them (E = N: each "
                                 "device holds its own requests' KV and 1/N of the experts, "
                                 "rows exchanged by all-to-all; fo_jax.engine.sharded); "
                                 "with --offload, a host pool per device")
        parser.add_argument("--placement", default=None, choices=PLACEMENTS,
                            help="with --devices: the rank of a new request (default "
                                 "least_misses with --offload, else least_context; "
                                 "fo_jax.placement)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The engine flags of parsed `args` (a parser given `add_cli_args`; other flags are
        left alone), checked."""
        values = vars(args)
        return cls(model_args=ModelArgs.from_cli_args(args),
                   **{f.name: values[f.name] for f in dataclasses.fields(cls)
                      if f.name != "model_args"})

    def __post_init__(self):
        for flag in ("seats", "decode_steps_per_call", "prefill_chunk", "prefill_batch",
                     "page_size"):
            value = getattr(self, flag)
            if value < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        if self.pool_memory is not None and self.pool_memory not in MEMORY_KINDS:
            raise ValueError(f"--pool-memory {self.pool_memory}: choose pinned_host (the KV "
                             "pages in host memory: offloaded) or device (the paged KV on the "
                             "device, its pages counted against --device-gb)")
        if not self.offload:
            for flag in ("policy", "hot_slots", "pool_memory"):
                if getattr(self, flag) is not None:
                    raise ValueError(f"--{flag.replace('_', '-')} applies to the offloaded "
                                     "path only: add --offload")
            if (self.host_pool_gb is not None or self.device_gb is not None
                    or self.reserve != "full"):
                raise ValueError("--host-pool-gb, --device-gb and --reserve prompt need "
                                 "--offload")
        if self.device_gb is not None and self.device_gb <= 0:
            raise ValueError(f"--device-gb must be > 0, got {self.device_gb}")
        if self.prefix_cache_gb is not None:
            if self.offload or not self.prefix_cache:
                raise ValueError("--prefix-cache-gb sizes the resident prefix store: it needs "
                                 "--prefix-cache without --offload (offloaded, cached prefixes "
                                 "live in the host pool: --host-pool-gb)")
            if self.prefix_cache_gb <= 0:
                raise ValueError(f"--prefix-cache-gb must be > 0, got {self.prefix_cache_gb}")
        if self.max_wait_steps is not None and self.max_wait_steps < -1:
            raise ValueError(f"--max-wait-steps must be >= 0, or -1 for no aging; got "
                             f"{self.max_wait_steps}")
        if self.devices is None and self.placement is not None:
            raise ValueError("--placement chooses among data-parallel ranks: add --devices N")
        if self.devices is not None and self.placement == "least_misses" and not self.offload:
            raise ValueError("--placement least_misses needs --offload (the resident path "
                             "copies no misses)")
        if self.expert_parallel is not None:
            self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        """--expert-parallel E: the sharded engine's limits (`fo_jax.engine.sharded`)."""
        expert = self.expert_parallel
        if self.devices is None:
            raise ValueError("--expert-parallel splits the experts over --devices: add --devices")
        if expert != self.devices:
            raise ValueError(f"--expert-parallel {expert} must equal --devices {self.devices}: "
                             "the sharded engine splits the experts over every device (each "
                             "holds its own requests and 1/devices of the experts)")
        refused = [(self.pool_memory == "device", "--pool-memory device"),
                   (self.prefix_cache, "--prefix-cache"),
                   (self.drafter is not None or bool(self.num_drafts), "drafts (--drafter, "
                    "--num-drafts)")]
        for bad, what in refused:
            if bad:
                raise ValueError(f"--expert-parallel does not run with {what} yet: drop it")

    def drafting(self, config: ModelConfig) -> tuple[str | None, int]:
        """(drafter or None, drafts per step) of --drafter and --num-drafts for `config`
        (`fo_jax.flags.drafting`: --num-drafts defaults to max_ways - 1 with a drafter)."""
        return drafting(self.drafter, self.num_drafts, config)

    def capacity_for(self, config: ModelConfig) -> int:
        """--capacity, or its default min(max_seq_len, 2048)."""
        if self.capacity is None:
            return min(config.max_seq_len, DEFAULT_CAPACITY)
        return self.capacity

    def offload_config(self, config: ModelConfig) -> OffloadConfig | None:
        """The OffloadConfig of --offload (None without it), checked against `config`."""
        if not self.offload:
            return None
        capacity = self.capacity_for(config)
        if capacity % self.page_size:
            raise ValueError(f"--capacity {capacity} must be a multiple of --page-size "
                             f"{self.page_size} with --offload")
        if self.hot_slots is not None:
            check_hot_slots(self.hot_slots, config)
        hot = min_hot_slots(config) if self.hot_slots is None else self.hot_slots
        offload = OffloadConfig(hot_slots=hot, page_size=self.page_size, capacity=capacity,
                                policy=self.policy or "ring",
                                host_memory_kind=self.pool_memory or "pinned_host")
        offload.validate_for(config)
        return offload

    def engine_settings(self, config: ModelConfig,
                        offload: OffloadConfig | None) -> EngineSettings:
        """The engine's settings of these flags (`offload`: `offload_config(config)`)."""
        def gb(value):
            return None if value is None else max(1, int(value * 1e9))

        cache = CacheSettings(
            seats=self.seats, capacity=self.capacity_for(config), offload=offload,
            host_pool_bytes=(None if self.host_pool_gb is None
                             else int(self.host_pool_gb * 1e9)),
            prefix_cache=self.prefix_cache, prefix_cache_bytes=gb(self.prefix_cache_gb))
        scheduler = SchedulerSettings(
            order=self.queue_order, reserve=self.reserve, device_bytes=gb(self.device_gb),
            max_wait_steps=None if self.max_wait_steps == -1 else self.max_wait_steps,
            prefill_chunk=self.prefill_chunk, prefill_batch=self.prefill_batch,
            decode_steps_per_call=self.decode_steps_per_call,
            overlap=self.overlap)
        drafter, num_drafts = self.drafting(config)
        return EngineSettings(cache=cache, scheduler=scheduler, speculative=SpeculativeSettings(
            num_drafts=num_drafts, drafter=drafter or "ngram"))


__all__ = ["EngineArgs", "PLACEMENTS"]

"""The engine's settings as data: frozen dataclasses grouped by concern, checked once.

    settings = EngineSettings(
        cache=CacheSettings(seats=8, offload=OffloadConfig(...), prefix_cache=True),
        scheduler=SchedulerSettings(reserve="prompt", device_bytes=2 * 10**9),
        speculative=SpeculativeSettings(num_drafts=2))
    engine = Engine(params, config, settings, tokenizer=tokenizer)

Each group checks its own fields in `__post_init__` and `EngineSettings` the rules that span
groups (a page pool for admission by bytes, a prefill chunk that fits a seat, ...): a bad
setting raises ValueError saying what was expected, what came and how to fix it, before the
engine allocates anything. What needs the model (`capacity` against `max_seq_len`, drafts
against `max_ways`, `max_logprobs` against the vocabulary) is checked by
`EngineSettings.for_model(config)`, which also fills in the defaults that depend on it.
`EngineSettings.create(**kwargs)` builds the groups from the flat keywords of
`Engine(params, config, seats=..., ...)`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from fo_jax import resident
from fo_jax.config import ModelConfig, check_num_drafts
from fo_jax.offload.config import OffloadConfig

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_PREFILL_BATCH = 8  # SchedulerSettings.prefill_batch: most requests per prefill program
ORDERS = ("fifo", "shortest")  # the queue's order (`SchedulerSettings.order`)
RESERVES = ("full", "prompt")  # the pages reserved at admission (`SchedulerSettings.reserve`)
DRAFTERS = ("ngram", "mtp")
MAX_LOGPROBS = 20  # Engine(max_logprobs=...) default: most tokens a request's logprobs lists


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """Where the KV lives and how much of it there is.

    Attributes:
      seats: requests decoded at once (the batch of every program).
      capacity: tokens per seat (prompt + output); with `offload`, its `capacity` is used
        (resolved here) and must equal this when both are given.
      offload: OffloadConfig for the paged path (the pool in host memory, offloaded, or on
        the device, `host_memory_kind="device"`), or None for the resident path.
      num_pages: paged: pages of `offload.page_size` tokens in the shared host-KV and
        indexer-key pools (default seats x capacity / page_size: every seat full at once).
      host_pool_bytes: paged: size the pools in bytes of host KV instead (the planner's
        bytes per page, `fo_jax.engine.costs.MemoryCosts`; as vLLM's host pool setting;
        with drafter="mtp" and prefix_cache, + a page's MTP rows, `mtp_block_bytes`).
      prefix_cache: reuse the prefixes of earlier prompts, whole prefill chunks of them (a
        reused prefix ends where a chunk ends, so the rest of the prompt is computed exactly
        as from scratch: the KV rows and tokens do not change, bit for bit). Paged: map
        their cached pages (needs prefill_chunk a multiple of page_size). Resident: copy their
        rows into the seat from a prefix store (`fo_jax.engine.resident_prefix`) of blocks of
        one prefill chunk (needs prefill_chunk < capacity). With drafter="mtp", the MTP
        layer's rows of the cached chunks are kept and reused too (docs/design/engine.md).
      prefix_cache_bytes: resident: the prefix store's bytes of KV rows and indexer keys
        (`block_bytes(config, prefill_chunk, mtp=drafter == "mtp")` per block; whole blocks;
        least recently released blocks evicted first). Default: one seat's blocks
        (capacity // prefill_chunk).
      prefix_cache_memory: resident: where the store's blocks live: "device" (default: the
        copy into a seat is one device program; the store counts on the device budget) or
        "pinned_host" (off the device budget; one host-to-device move of the prefix rows per
        admission).
    """

    seats: int
    capacity: int | None = None
    offload: OffloadConfig | None = None
    num_pages: int | None = None
    host_pool_bytes: int | None = None
    prefix_cache: bool = False
    prefix_cache_bytes: int | None = None
    prefix_cache_memory: str = "device"

    def __post_init__(self):
        _check_positive(seats=self.seats)
        if self.offload is not None:
            if self.capacity is not None and self.capacity != self.offload.capacity:
                raise ValueError(f"capacity={self.capacity} differs from offload.capacity="
                                 f"{self.offload.capacity}: give one, or the same value")
            object.__setattr__(self, "capacity", self.offload.capacity)
        if self.capacity is None:
            raise ValueError("capacity (tokens per seat) is required without an OffloadConfig")
        if (self.prefix_cache_bytes is not None or self.prefix_cache_memory != "device"):
            if not self.prefix_cache:
                raise ValueError("prefix_cache_bytes and prefix_cache_memory need "
                                 "prefix_cache=True")
            if self.offload is not None:
                raise ValueError("prefix_cache_bytes and prefix_cache_memory size the resident "
                                 "path's prefix store; offloaded, the prefix cache keeps pages "
                                 "of the pool: size it with num_pages or host_pool_bytes")
        if self.num_pages is not None and self.host_pool_bytes is not None:
            raise ValueError("give num_pages or host_pool_bytes, not both (both size the pool)")
        if self.offload is not None and self.num_pages is not None and (
                not isinstance(self.num_pages, numbers.Integral) or self.num_pages < 1):
            raise ValueError(f"num_pages={self.num_pages!r} must be an int >= 1 (pages of "
                             f"{self.offload.page_size} tokens in the shared pools)")

    @property
    def paged(self) -> bool:
        """Whether the seats share a page pool (an OffloadConfig), not fixed resident rows."""
        return self.offload is not None


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
    """Who runs when (`fo_jax.engine.scheduler`).

    Attributes:
      order: the waiting queue: "fifo" (arrival order) or "shortest" (by prompt + max_tokens,
        ties by arrival). Either way admission stops at the first request that does not fit
        (no overtaking) and preempted requests come first.
      max_wait_steps: order="shortest" only: a request that has waited this many engine
        steps goes ahead of every request that has not (those that did, in arrival order), so
        a long request does not wait for ever under a steady stream of shorter ones. None: no
        aging (it can).
      reserve: paged: "full" reserves pages for prompt + max_tokens at admission (a running
        request never needs a page: no preemption); "prompt" reserves the prompt and the next
        decode call, and grows each running request's pages before every decode call,
        preempting the youngest running request when they cannot be had: dropping its pages
        when the pool is short, keeping them (its seat freed) when only device_bytes is (with
        the pool on the device, only when freeing its seat covers the bytes;
        docs/design/engine.md).
      device_bytes: paged: the device budget of request state, the planner's arithmetic
        (`MemoryCosts`): hot cache and tails per running seat + indexer keys per page held
        (+ its KV rows with the pool on the device, `host_memory_kind="device"`) + prefill
        layer buffers per prompt page while prefilling (weights and activations not
        counted). A request that can never fit it is refused by `add_request`; one that does
        not fit now waits. None: no device limit beyond the seats and the pool.
      prefill_chunk: prompt tokens per seat and prefill program (at most max(capacity, 256):
        a longer chunk would only pad).
      prefill_batch: the most prefilling requests one prefill program runs (a pack,
        `prefill_seats`: one dispatch and one layer loop for all of them, each request over its
        own seat and, offloaded, its own history bucket; the engine splits the requests of a
        bucket into packs of powers of two up to it, 5 = 4 + 1, so no row is padding and at
        most log2(prefill_batch) + 1 programs compile per bucket). 1: one program per request.
        Default 8: four programs per bucket (1, 2, 4, 8); a pack's activations are those of
        8 x prefill_chunk tokens, as one prefill of a batch of 8 (offloaded, its layer buffers
        hold 8 requests' rows, which the device budget counts already: it counts every
        prefilling request's buffers at once); one dispatch and one pass over the weights per
        layer instead of 8 (on a 2-core CPU, compute-bound, the step time of 8 requests
        prefilling is 0.90-1.06x that of one program each: docs/status.md). Each request's
        tokens are the same bit for bit whatever the pack, where the matmuls compute each row
        independently of the others (a pack changes their M): XLA:CPU does; on an
        accelerator check it, or use 1.
      decode_steps_per_call: decode steps per program (1 keeps per-token latency; more means
        fewer host round trips per token).
      overlap: dispatch decode call n + 1 before reading back call n's tokens, so the
        engine's host work (scheduling, page tables, detokenizing, the caller's streaming)
        runs while the device computes (`fo_jax.engine.overlap`); the host learns of a
        finished request one call later (the device has masked it meanwhile). Every
        request's tokens are the same either way, bit for bit. False: read each call back
        before the next step (docs/design/engine.md, "Overlap").
    """

    order: str = "fifo"
    max_wait_steps: int | None = 256
    reserve: str = "full"
    device_bytes: int | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prefill_batch: int = DEFAULT_PREFILL_BATCH
    decode_steps_per_call: int = 1
    overlap: bool = True

    def __post_init__(self):
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap={self.overlap!r} must be True or False (dispatch the "
                             "next decode call before reading back the last one)")
        _check_positive(decode_steps_per_call=self.decode_steps_per_call,
                        prefill_chunk=self.prefill_chunk)
        batch = self.prefill_batch
        if not isinstance(batch, numbers.Integral) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"prefill_batch={batch!r} must be an int >= 1 (the most prefilling "
                             "requests one prefill program runs; 1: one program per request)")
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r} must be one of {ORDERS}")
        steps = self.max_wait_steps
        if steps is not None and (not isinstance(steps, numbers.Integral)
                                  or isinstance(steps, bool) or steps < 0):
            raise ValueError(f"max_wait_steps={steps!r} must be an int >= 0 (engine "
                             "steps a request waits before it goes ahead of shorter ones with "
                             "order='shortest') or None (no aging)")
        if self.reserve not in RESERVES:
            raise ValueError(f"reserve={self.reserve!r} must be one of {RESERVES}")
        budget = self.device_bytes
        if budget is not None and (not isinstance(budget, numbers.Integral)
                                   or isinstance(budget, bool) or budget < 1):
            raise ValueError(f"device_bytes={budget!r} must be an int >= 1 (bytes of "
                             "device memory for request state), or None")


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings:
    """Drafts verified by the decode loop.

    Attributes:
      num_drafts: D >= 0 drafts per request and decode step, verified on the device
        (`decode_loop(..., num_drafts=D)`: steps of W = D + 1 <= config.max_ways ways;
        greedy requests keep the confirmed drafts, sampled ones do speculative sampling);
        0: one token per step.
      drafter: with num_drafts > 0, "ngram" (prompt lookup in each seat's history, prompt +
        sampled tokens, kept on the device) or "mtp" (the model's multi-token-prediction
        layer, its parameters given as `Engine(..., mtp=...)`: each seat's MTP state is kept
        on the device; with prefix_cache, a mapped prefix's MTP rows come from the cache;
        docs/design/engine.md).
    """

    num_drafts: int = 0
    drafter: str = "ngram"

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter={self.drafter!r} must be one of {DRAFTERS} (where the "
                             "drafts come from: n-gram lookup in each request's history, or "
                             "the model's MTP layer)")

    def check(self, config: ModelConfig, mtp) -> None:
        """Raise unless these drafts can run on `config` with the MTP parameters `mtp`."""
        from fo_jax.decode_loop import check_mtp_drafting

        try:
            check_num_drafts(self.num_drafts, config)
        except ValueError as err:
            raise ValueError(f"{err} (Engine(num_drafts=...))") from None
        if self.drafter == "ngram":
            if mtp is not None:
                raise ValueError("mtp (the MTP parameters) is read only with drafter='mtp': "
                                 "pass drafter='mtp', or drop mtp")
            return
        if self.num_drafts == 0:
            raise ValueError("drafter='mtp' needs num_drafts >= 1 (drafts per request and "
                             "decode step): pass num_drafts, or drop drafter")
        try:
            check_mtp_drafting(mtp, config)
        except ValueError as err:
            raise ValueError(f"drafter='mtp': {err}") from None


@dataclasses.dataclass(frozen=True)
class RequestSettings:
    """Bounds on what a request may ask.

    Attributes:
      max_stop_ids: stop token ids per request (fixed so that the programs' shapes are).
      max_logprobs: the most top tokens a request's logprobs may list (`add_request(
        logprobs=k)`, k <= max_logprobs): while some request asks for logprobs, the programs
        compute this many (one program whatever k; None: min(20, vocab_size), vLLM's,
        resolved by `EngineSettings.for_model`).
    """

    max_stop_ids: int = 8
    max_logprobs: int | None = None

    def __post_init__(self):
        _check_positive(max_stop_ids=self.max_stop_ids)


@dataclasses.dataclass(frozen=True)
class ProgramSettings:
    """How the programs are built; none of them changes a token.

    Attributes:
      query_block: the prefill's query blocks (the same for both paths: bitwise equal).
      num_buffers: paged: full-layer device buffers of the offloaded prefill (default
        min(4, layers)).
      implementation, interpret: the decode step's kernels ("xla" by default) and the Pallas
        interpret mode.
    """

    query_block: int | None = resident.QUERY_BLOCK
    num_buffers: int | None = None
    implementation: str | None = None
    interpret: Any = False


@dataclasses.dataclass(frozen=True)
class MetricsSettings:
    """A JSON line of counters appended to `path` every `every` steps (`Engine` keywords
    metrics_path, metrics_every; `fo_jax.engine.metrics.MetricsLog`, kept as `engine.metrics`;
    counters are summed on the device between reads; a caller may set `engine.metrics` to
    its own log instead). None: no log."""

    path: str | None = None
    every: int = 16

    def __post_init__(self):
        _check_positive(metrics_every=self.every)


# Engine(...) keyword -> (group, field): the flat keywords `EngineSettings.create` takes.
_KEYWORDS = {
    **{name: ("cache", name) for name in (
        "seats", "capacity", "offload", "num_pages", "host_pool_bytes", "prefix_cache",
        "prefix_cache_bytes", "prefix_cache_memory")},
    **{name: ("scheduler", name) for name in (
        "order", "max_wait_steps", "reserve", "device_bytes", "prefill_chunk",
        "prefill_batch", "decode_steps_per_call", "overlap")},
    **{name: ("speculative", name) for name in ("num_drafts", "drafter")},
    **{name: ("requests", name) for name in ("max_stop_ids", "max_logprobs")},
    **{name: ("programs", name) for name in (
        "query_block", "num_buffers", "implementation", "interpret")},
    "metrics_path": ("metrics", "path"), "metrics_every": ("metrics", "every"),
}


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """Every setting of an `Engine`, by concern; the rules across groups checked here.

    Attributes:
      cache, scheduler, speculative, requests, programs, metrics: the groups above.
    """

    cache: CacheSettings
    scheduler: SchedulerSettings = dataclasses.field(default_factory=SchedulerSettings)
    speculative: SpeculativeSettings = dataclasses.field(default_factory=SpeculativeSettings)
    requests: RequestSettings = dataclasses.field(default_factory=RequestSettings)
    programs: ProgramSettings = dataclasses.field(default_factory=ProgramSettings)
    metrics: MetricsSettings = dataclasses.field(default_factory=MetricsSettings)

    def __post_init__(self):
        cache, sched = self.cache, self.scheduler
        chunk, capacity = sched.prefill_chunk, cache.capacity
        if chunk > max(capacity, DEFAULT_PREFILL_CHUNK):
            raise ValueError(f"prefill_chunk={chunk} must be <= max(capacity, "
                             f"{DEFAULT_PREFILL_CHUNK}) = {max(capacity, DEFAULT_PREFILL_CHUNK)}"
                             f": a prompt fits a seat of capacity={capacity} tokens, so a longer "
                             "chunk only pads the [1, prefill_chunk] prefill buffers")
        if not cache.paged and (cache.num_pages is not None or cache.host_pool_bytes is not None
                                or sched.device_bytes is not None or sched.reserve != "full"):
            raise ValueError(
                "num_pages, host_pool_bytes, device_bytes and reserve='prompt' need a page "
                "pool (an OffloadConfig): the resident path (offload=None) has fixed seats of "
                "`capacity` tokens each, allocated once, so nothing runs out mid-decode and "
                "there is nothing to admit or preempt by bytes; for admission and preemption "
                "by device bytes with the KV on the device, use the paged device pool, "
                "offload=OffloadConfig(..., host_memory_kind='device') (or 'pinned_host' to "
                "offload the KV to host memory)")
        if cache.paged and cache.prefix_cache and chunk % cache.offload.page_size:
            raise ValueError(f"prefix_cache needs prefill_chunk={chunk} to be a "
                             f"multiple of page_size={cache.offload.page_size}: a reused prefix "
                             "must end where a prefill chunk ends, so the rest of the prompt is "
                             "computed exactly as it would be from scratch")

    @classmethod
    def create(cls, **kwargs) -> "EngineSettings":
        """The settings of `Engine(params, config, **kwargs)`'s flat keywords (seats,
        capacity, offload, ..., the names of `Engine`'s Args). Raises TypeError for a keyword
        that is no setting, ValueError for a bad value."""
        groups: dict[str, dict] = {}
        for name, value in kwargs.items():
            if name not in _KEYWORDS:
                raise TypeError(f"Engine() got an unexpected keyword argument {name!r}")
            group, field = _KEYWORDS[name]
            groups.setdefault(group, {})[field] = value
        if "seats" not in groups.get("cache", {}):
            raise TypeError("Engine() missing 1 required keyword-only argument: 'seats'")
        built = {"cache": CacheSettings(**groups.pop("cache"))}
        for name, group in (("scheduler", SchedulerSettings),
                            ("speculative", SpeculativeSettings),
                            ("requests", RequestSettings), ("programs", ProgramSettings),
                            ("metrics", MetricsSettings)):
            if name in groups:
                built[name] = group(**groups[name])
        return cls(**built)

    def for_model(self, config: ModelConfig, *, mtp=None) -> "EngineSettings":
        """These settings checked against the model (`config`, and with drafter="mtp" its MTP
        parameters `mtp`), with the defaults that depend on it filled in. Raises ValueError."""
        cache = self.cache
        if cache.offload is not None:
            cache.offload.validate_for(config)
        capacity = cache.capacity
        if not isinstance(capacity, numbers.Integral) or not 1 <= capacity <= config.max_seq_len:
            raise ValueError(f"capacity={capacity!r} must be an int in [1, max_seq_len="
                             f"{config.max_seq_len}] of config {config.name!r}")
        self.speculative.check(config, mtp)
        requests = self.requests
        top = requests.max_logprobs
        if top is None:
            top = min(MAX_LOGPROBS, config.vocab_size)
        if (not isinstance(top, numbers.Integral) or isinstance(top, bool)
                or not 0 <= top <= config.vocab_size):
            raise ValueError(f"max_logprobs={top!r} must be an int in [0, vocab_size="
                             f"{config.vocab_size}] (the most top tokens a request's logprobs "
                             "may list)")
        return dataclasses.replace(self, requests=dataclasses.replace(requests,
                                                                      max_logprobs=int(top)))


__all__ = ["DEFAULT_PREFILL_BATCH", "DEFAULT_PREFILL_CHUNK", "DRAFTERS", "MAX_LOGPROBS",
           "ORDERS", "RESERVES", "CacheSettings", "EngineSettings", "MetricsSettings",
           "ProgramSettings", "RequestSettings", "SchedulerSettings", "SpeculativeSettings"]

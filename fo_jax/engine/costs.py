"""The bytes of paged serving, per seat and per page: the planner's arithmetic cut for the
scheduler.

    costs = MemoryCosts.from_config(config, page_size=16, hot_slots=64)
    seat, prefill, pages = costs.device_need(prompt_len, num_pages)

`MemoryCosts` cuts the planner's bytes (`fo_jax.plan.offload_request_bytes`, behind `fo-jax
plan`) into a fixed part per running request (its seat: hot cache, tails, slot map), a part per
page of Z tokens (indexer keys on the device, KV rows on the host, or on the device with the
pool there) and a part per prompt page while prefilling. The engine's scheduler
(`fo_jax.engine.scheduler`) charges its device budget with them, counted from the pool's held
pages. Pure Python, O(1) per figure. The formulas: docs/design/engine.md, "Admission by
memory".
"""

from __future__ import annotations

import dataclasses

from fo_jax.config import ModelConfig
from fo_jax.offload.config import MEMORY_KINDS, check_hot_slots, check_num_buffers
from fo_jax.plan import offload_request_bytes


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class MemoryCosts:
    """The bytes of one request of paged offloaded serving, per seat and per page.

    Attributes:
      page_size: Z, tokens per page (also the tail block).
      hot_slots: C, hot-cache slots per layer and request.
      num_buffers: full-layer device buffers of the offloaded prefill.
      max_context: the model's max_seq_len: the longest request.
      seat_device_bytes: hot cache + tails + slot_to_token, device, per running request.
      page_device_bytes: indexer keys + token_to_slot of one page, device.
      page_host_bytes: KV of one page in every layer, host.
      page_prefill_bytes: prefill-buffer rows of one prompt page, device, while prefilling.
      pool_memory: where the KV page pool lives: "pinned_host" (offloaded: a page's KV is host
        memory) or "device" (the paged KV on the device: a page's KV is device memory too).
    """

    page_size: int
    hot_slots: int
    num_buffers: int
    max_context: int
    seat_device_bytes: int
    page_device_bytes: int
    page_host_bytes: int
    page_prefill_bytes: int
    pool_memory: str = "pinned_host"

    def __post_init__(self):
        if self.pool_memory not in MEMORY_KINDS:
            raise ValueError(f"pool_memory={self.pool_memory!r} must be one of {MEMORY_KINDS} "
                             "(where the KV page pool lives)")

    @classmethod
    def from_config(cls, config: ModelConfig, *, page_size: int, hot_slots: int,
                    num_buffers: int = 4, pool_memory: str = "pinned_host") -> MemoryCosts:
        """The costs of `config` served with pages of `page_size` tokens and `hot_slots` hot
        slots, from `fo_jax.plan.offload_request_bytes`, with the page pool in `pool_memory`
        ("pinned_host", or "device": `OffloadConfig.host_memory_kind`).

        Raises:
          ValueError: page_size < 1, hot_slots / num_buffers break the decode or prefill
            rule (`check_hot_slots`, `check_num_buffers`), or an unknown pool_memory
            (`__post_init__`).
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        _check_int("page_size", page_size, 1)
        _check_int("hot_slots", hot_slots, 1)
        check_hot_slots(hot_slots, config)
        num_buffers = check_num_buffers(num_buffers, config.num_layers)
        kwargs = dict(hot_slots=hot_slots, tail_block=page_size, num_buffers=num_buffers)
        fixed = offload_request_bytes(config, 0, **kwargs)  # S = 0: the per-request parts
        page = offload_request_bytes(config, page_size, **kwargs)  # S = Z: adds one page
        return cls(
            page_size=page_size,
            hot_slots=hot_slots,
            num_buffers=num_buffers,
            max_context=config.max_seq_len,
            seat_device_bytes=fixed.device_decode,
            page_device_bytes=page.index_keys + page.token_to_slot,
            page_host_bytes=page.host_kv,
            page_prefill_bytes=page.prefill_buffers,
            pool_memory=pool_memory,
        )

    def pages(self, num_tokens: int) -> int:
        """Pages holding `num_tokens` tokens: ceil(num_tokens / Z)."""
        return -(-num_tokens // self.page_size)

    @property
    def pool_on_device(self) -> bool:
        """The KV page pool lives in device memory (the paged KV on the device)."""
        return self.pool_memory == "device"

    @property
    def held_page_device_bytes(self) -> int:
        """Device bytes of one page held: its indexer keys and slot map, + its KV rows of every
        layer (Z * L * (D + R) * bytes) when the pool is on the device."""
        return self.page_device_bytes + (self.page_host_bytes if self.pool_on_device else 0)

    @property
    def held_page_host_bytes(self) -> int:
        """Host bytes of one page held: its KV rows of every layer; 0 with the pool on the
        device."""
        return 0 if self.pool_on_device else self.page_host_bytes

    @property
    def page_label(self) -> str:
        """What a page's device bytes are, for messages."""
        return "KV and indexer-key pages" if self.pool_on_device else "indexer-key pages"

    def device_need(self, prompt_len: int, pages: int, *,
                    prefilling: bool = True) -> tuple[int, int, int]:
        """(seat, prefill buffers, pages): the device bytes of one request of `prompt_len`
        prompt tokens holding `pages` pages: hot cache + tails + slot map of its seat, prefill
        layer buffers for its prompt pages (0 once `prefilling` is over), and `pages` x
        `held_page_device_bytes`. The one place device bytes are added up. O(1)."""
        prefill = self.pages(prompt_len) * self.page_prefill_bytes if prefilling else 0
        return self.seat_device_bytes, prefill, pages * self.held_page_device_bytes


__all__ = ["MemoryCosts"]

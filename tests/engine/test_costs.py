"""The planner's bytes per seat and page (fo_jax.engine.costs): they equal the planner's in each
KV format, a page held with the pool on the device counts its KV rows on the device, and bad
settings are refused with their messages pinned. The scheduler's use of them:
tests/engine/test_scheduler.py."""

import dataclasses
import re

import pytest

from fo_jax.config import get_config
from fo_jax.engine.costs import MemoryCosts
from fo_jax.offload.config import min_hot_slots
from fo_jax.plan import plan_capacity

# Round figures, so the arithmetic of each test reads at a glance.
COSTS = MemoryCosts(page_size=4, hot_slots=8, num_buffers=2, max_context=64,
                    seat_device_bytes=100, page_device_bytes=10, page_host_bytes=1000,
                    page_prefill_bytes=5)


# Bytes of one KV row of the tiny model (D = 32, R = 8) in each format: bf16 (D + R) * 2;
# fp8_ds_mla D + 4 (one scale: blocks of min(128, D)) + 2 R.
ROW_BYTES = {"bf16": 40 * 2, "fp8_ds_mla": 32 + 4 + 2 * 8}


@pytest.mark.parametrize("kv_format", list(ROW_BYTES))
def test_costs_are_the_planners(kv_format):
    config = get_config("tiny").replace(kv_format=kv_format)
    row = ROW_BYTES[kv_format]
    hot_slots, page, buffers = min_hot_slots(config), 16, 2
    costs = MemoryCosts.from_config(config, page_size=page, hot_slots=hot_slots,
                                    num_buffers=buffers)
    # tiny: L = 4, a row of `row` bytes, G = 2, N = 16 bfloat16 keys; C = 64.
    assert costs.seat_device_bytes == 64 * 4 * row + 2 * 16 * 4 * row + 4 * 2 * 64
    assert costs.page_device_bytes == 16 * 2 * 16 * 2 + 4 * 2 * 16
    assert costs.page_host_bytes == 16 * 4 * row
    assert costs.page_prefill_bytes == 2 * 16 * row
    for context in (16, 256, 1024):
        plan = plan_capacity(config, context, hot_slots=hot_slots, tail_block=page,
                             num_buffers=buffers, budget_gb=1.0)
        pages = costs.pages(context)
        assert (costs.seat_device_bytes + pages * costs.page_device_bytes
                == plan.offload_device_bytes)
        assert pages * costs.page_host_bytes == plan.host_bytes_per_request
        assert pages * costs.page_prefill_bytes == plan.prefill_offload_kv_bytes
    with pytest.raises(ValueError, match=re.escape(
            "hot_slots=8 < index_topk * max_ways = 16 * 4 = 64")):
        MemoryCosts.from_config(config, page_size=16, hot_slots=8)
    with pytest.raises(ValueError, match=re.escape("page_size must be an int >= 1, got 0")):
        MemoryCosts.from_config(config, page_size=0, hot_slots=64)


def test_a_device_pool_charges_kv_pages_to_the_device():
    """With the page pool in device memory a page held costs its indexer keys + its KV rows
    of the device budget (10 + 1,000 B) and nothing of the host budget."""
    costs = dataclasses.replace(COSTS, pool_memory="device")
    assert costs.pool_on_device and not COSTS.pool_on_device
    assert (costs.held_page_device_bytes, costs.held_page_host_bytes) == (1010, 0)
    assert (COSTS.held_page_device_bytes, COSTS.held_page_host_bytes) == (10, 1000)
    # 6 prompt tokens holding 2 pages: seat 100 + prefill buffers 2 x 5 + 2 x 1,010.
    assert costs.device_need(6, 2) == (100, 2 * 5, 2 * 1010)
    assert costs.device_need(6, 2, prefilling=False) == (100, 0, 2 * 1010)
    assert (costs.page_label, COSTS.page_label) == ("KV and indexer-key pages",
                                                    "indexer-key pages")
    with pytest.raises(ValueError, match=re.escape(
            "pool_memory='hbm' must be one of ('pinned_host', 'device') (where the KV page pool "
            "lives)")):
        dataclasses.replace(COSTS, pool_memory="hbm")

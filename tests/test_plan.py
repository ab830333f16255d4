"""Tests of the capacity planner against the figures of the design brief (GLM-5.2, bf16)."""

from __future__ import annotations

import pytest

from fo_jax.config import get_config
from fo_jax.plan import CapacityPlan, format_plan, plan_capacity


@pytest.fixture(scope="module")
def glm52():
    return get_config("glm52")


def test_bytes_per_token(glm52):
    # KV: 78 layers * 576 values * 2 bytes = 89,856 B; indexer: 21 groups * 128 * 2 = 5,376 B.
    plan = plan_capacity(glm52, 1)
    assert plan.kv_bytes_per_token == 89_856
    assert plan.index_bytes_per_token == 5_376
    assert plan.bytes_per_token == 95_232
    text = format_plan(plan)
    assert "95.23 kB" in text and "89.86 kB" in text and "5.38 kB" in text


SCENARIOS = {
    # context: (request GB, max decode batch without offload under 29 GB)
    "64k": (64_000, "6.09", 4),
    "128k": (128_000, "12.19", 2),
    "256k": (256_000, "24.38", 1),
    "512k": (512_000, "48.76", 0),
    "1M": (1_024_000, "97.52", 0),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_request_bytes_and_batch(glm52, name):
    context, request_gb, batch = SCENARIOS[name]
    plan = plan_capacity(glm52, context, budget_gb=29)
    assert f"{plan.request_bytes / 1e9:.2f}" == request_gb
    assert plan.request_bytes == context * 95_232
    assert plan.max_batch_resident == batch
    assert f"{request_gb} GB" in format_plan(plan)
    # Offloading always fits at least as many requests, and 512k / 1M become servable.
    assert plan.max_batch_offload >= max(batch, 1)


def test_offload_device_bytes_128k(glm52):
    plan = plan_capacity(glm52, 128_000, hot_slots=16_384, tail_block=64)
    # hot cache: 16,384 slots * 78 layers * 576 * 2 B = 1,472,200,704 B -> 1.47 GB
    assert plan.hot_cache_bytes == 1_472_200_704
    # tails: 2 * 64 * 78 * 576 * 2 = 11,501,568 B
    assert plan.tail_bytes == 11_501_568
    # indexer keys: 128,000 * 21 * 128 * 2 = 688,128,000 B -> 0.69 GB
    assert plan.index_key_bytes == 688_128_000
    # slot maps: 4 B * 21 * (128,000 + 16,384) = 12,128,256 B -> 0.01 GB
    assert plan.slot_map_bytes == 12_128_256
    # keys + maps = 700,256,256 B -> 0.70 GB
    text = format_plan(plan)
    assert "hot-cache KV:" in text and "1.47 GB" in text
    assert "tail blocks:" in text
    assert "indexer keys + slot maps:" in text
    assert "0.70 GB  (keys 0.69 GB + maps 0.01 GB)" in text
    assert plan.offload_device_bytes == 1_472_200_704 + 11_501_568 + 700_256_256
    # 29e9 / 2,183,958,528 = 13.28 -> 13 requests with offload, against 2 without.
    assert plan.max_batch_offload == 13
    assert plan.host_bytes_per_request == 128_000 * 89_856


@pytest.mark.parametrize("num_buffers", [2, 4, 8])
def test_prefill_ratio_is_buffers_over_layers(glm52, num_buffers):
    plan = plan_capacity(glm52, 64_000, num_buffers=num_buffers)
    ratio = plan.prefill_offload_kv_bytes / plan.prefill_resident_kv_bytes
    assert ratio == pytest.approx(num_buffers / 78)
    # Indexer keys stay on the device in both cases.
    assert plan.prefill_resident_bytes - plan.prefill_offload_bytes == (
        plan.prefill_resident_kv_bytes - plan.prefill_offload_kv_bytes
    )


def test_prefill_chunks_and_reload(glm52):
    single = plan_capacity(glm52, 10_000)
    assert single.prefill_chunk == 10_000 and single.prefill_num_chunks == 1
    assert single.prefill_reload_bytes == 0
    # 10,000 tokens in chunks of 4,096: 3 forwards, history 0, 4,096, 8,192 rows -> 12,288 rows
    # of 77 layers (layer 0 pinned) * 1,152 B.
    chunked = plan_capacity(glm52, 10_000, prefill_chunk=4_096)
    assert chunked.prefill_num_chunks == 3
    assert chunked.prefill_reload_bytes == 12_288 * 77 * 1_152
    # A chunk longer than the context is cut to it.
    assert plan_capacity(glm52, 100, prefill_chunk=4_096).prefill_chunk == 100


def test_plan_is_frozen(glm52):
    plan = plan_capacity(glm52, 1_000)
    assert isinstance(plan, CapacityPlan)
    with pytest.raises(AttributeError):
        plan.context = 2  # type: ignore[misc]


ERRORS = {
    "zero_context": (dict(context=0), r"context must be an int >= 1, got 0"),
    "float_context": (dict(context=1.5), r"context must be an int >= 1, got 1.5"),
    "too_long": (dict(context=2_000_000), r"exceeds max_seq_len=1048576"),
    "zero_budget": (dict(budget_gb=0), r"budget_gb must be a finite number > 0, got 0"),
    "negative_budget": (dict(budget_gb=-1.0), r"budget_gb must be .* > 0, got -1.0"),
    "few_slots": (dict(hot_slots=1024), r"hot_slots=1024 < index_topk \* max_ways = 2048 \* 4"),
    "decode_refuses": (dict(hot_slots=4096), r"hot_slots=4096 < index_topk \* max_ways = "
                                             r"2048 \* 4 = 8192: one step's selections"),
    "zero_tail": (dict(tail_block=0), r"tail_block must be an int >= 1, got 0"),
    "one_buffer": (dict(num_buffers=1), r"num_buffers=1 must be an int in \[2, 78\]"),
    "too_many_buffers": (dict(num_buffers=79), r"num_buffers=79 must be an int in \[2, 78\]"),
    "zero_chunk": (dict(prefill_chunk=0), r"prefill_chunk must be an int >= 1, got 0"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(glm52, name):
    overrides, message = ERRORS[name]
    kwargs = dict(context=1_000) | overrides
    context = kwargs.pop("context")
    with pytest.raises(ValueError, match=message):
        plan_capacity(glm52, context, **kwargs)


def test_other_presets_plan():
    tiny = get_config("tiny")
    plan = plan_capacity(tiny, 100, hot_slots=64, num_buffers=2)
    assert plan.bytes_per_token == (4 * 40 + 2 * 16) * 2
    assert "fo-jax plan: tiny" in format_plan(plan)


def test_fp8_kv_format_at_deepseek_widths_matches_the_state_arrays():
    # DeepSeek-V3.2 with the 656-byte rows: every KV figure of the plan is that of the arrays a
    # DecodeState of this config and setting holds (jax.eval_shape: nothing allocated).
    import jax

    from fo_jax.offload.config import OffloadConfig
    from fo_jax.offload.state import DecodeState

    config = get_config("deepseek_v32").replace(kv_format="fp8_ds_mla")
    context, hot_slots, z = 16_384, 8_192, 64
    plan = plan_capacity(config, context, hot_slots=hot_slots, tail_block=z)
    # 61 layers * 656 B = 40,016 B of KV per token (against 61 * 1,152 = 70,272 in bf16), and
    # 61 indexer keys of 128 bfloat16 = 15,616 B.
    assert plan.kv_bytes_per_token == 40_016 and plan.index_bytes_per_token == 15_616
    state = jax.eval_shape(lambda: DecodeState.create(
        config, OffloadConfig(hot_slots=hot_slots, page_size=z, capacity=context), batch=1))
    nbytes = lambda x: x.size * x.dtype.itemsize  # noqa: E731
    assert plan.host_bytes_per_request == nbytes(state.host.kv)
    assert plan.hot_cache_bytes + plan.tail_bytes == nbytes(state.hot)
    assert plan.index_key_bytes == nbytes(state.index_keys)
    text = format_plan(plan)
    assert "fp8_ds_mla (indexer keys bfloat16) KV" in text
    bf16 = plan_capacity(config.replace(kv_format="bf16"), context, hot_slots=hot_slots,
                         tail_block=z)
    assert bf16.host_bytes_per_request * 656 == plan.host_bytes_per_request * 1152

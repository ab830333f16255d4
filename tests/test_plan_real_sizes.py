"""The planner at the real models' sizes: weights per device (bf16 and FP8), one request's KV
in both formats, refusals naming what would fit. Every figure is checked to the byte against
`jax.eval_shape` of the state it counts (nothing is allocated)."""

from __future__ import annotations

import re

import jax
import pytest

from fo_jax.cli import main
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params, quantize_params
from fo_jax.model.linear import Fp8Weight
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState
from fo_jax.plan import (FP8_BLOCK, KV_FORMATS, format_device_plan, plan_devices,
                         weight_bytes)
from fo_jax.resident import ResidentState

REAL = ("deepseek_v32", "glm5", "glm52")
CONTEXT, HOT, Z = 131_072, 16_384, 64


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("name", REAL)
def test_weight_bytes_are_those_of_the_parameters(name):
    config = get_config(name)
    key = jax.random.key(0)
    bf16 = jax.eval_shape(lambda k: init_params(config, k), key)
    assert weight_bytes(config, "bf16") == _nbytes(bf16)
    fp8 = jax.eval_shape(lambda k: quantize_params(init_params(config, k), FP8_BLOCK), key)
    assert weight_bytes(config, "fp8") == _nbytes(fp8)
    experts = fp8["moe"]["w1"]
    assert isinstance(experts, Fp8Weight) and experts.q.dtype == jax.numpy.float8_e4m3fn
    # 256 experts of [E, 2048] in 58 (DeepSeek) or 75 (GLM) MoE layers.
    assert experts.shape[1:] == (256, config.dim, 2048)
    # FP8 halves the weights, less the bfloat16 embedding / head and the scales.
    assert 0.5 < weight_bytes(config, "fp8") / weight_bytes(config, "bf16") < 0.51


def test_deepseek_v32_weights_are_its_671b_parameters():
    # 671 B parameters: 1.34 TB in bfloat16 (more than 8 x 141 GB) and 0.67 TB in FP8.
    config = get_config("deepseek_v32")
    assert 1.343e12 < weight_bytes(config, "bf16") < 1.344e12 > 8 * 141e9
    assert 0.674e12 < weight_bytes(config, "fp8") < 0.675e12


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_kv_figures_are_those_of_the_states(name, kv_format):
    config = get_config(name)
    plan = plan_devices(config, CONTEXT, devices=8, device_gb=141, hot_slots=HOT, tail_block=Z)
    kv = plan.kv[kv_format]
    config = config.replace(kv_format=kv_format)
    resident = jax.eval_shape(lambda: ResidentState.create(config, batch=1, capacity=CONTEXT))
    assert kv.resident_bytes == _nbytes((resident.kv, resident.index_keys))
    state = jax.eval_shape(lambda: DecodeState.create(
        config, OffloadConfig(hot_slots=HOT, page_size=Z, capacity=CONTEXT), batch=1))
    assert kv.host_bytes == _nbytes(state.host.kv)
    assert kv.offload_device_bytes == _nbytes((state.hot, state.index_keys, state.slots))
    row = 656 if kv_format == "fp8_ds_mla" else 1152
    assert kv.host_bytes == CONTEXT * config.num_layers * row


def test_setting_and_batch_per_device():
    plan = plan_devices(get_config("deepseek_v32"), CONTEXT, devices=8, device_gb=141)
    assert plan.weights_per_device == {w: -(-plan.weight_bytes[w] // 8) for w in ("bf16", "fp8")}
    assert plan.kv_budget_bytes == 141e9 - plan.weights_per_device["fp8"]
    assert plan.max_batch_offload == int(plan.kv_budget_bytes // plan.kv["bf16"]
                                         .offload_device_bytes) > plan.max_batch_resident >= 1
    text = format_device_plan(plan)
    assert "Devices: 8 x 141.00 GB" in text and "bf16 1343.76 GB (167.97 GB per device)" in text


def test_what_does_not_fit_is_refused_naming_what_would():
    ds = get_config("deepseek_v32")
    with pytest.raises(ValueError, match=re.escape(
            "deepseek_v32: its bf16 weights take 167.97 GB per device on 8 device(s) (1343.76 "
            "GB in all), above the 141.00 GB of a device: they need at least 10 devices, or FP8 "
            "weights (84.25 GB per device here, 5 devices at least)")):
        plan_devices(ds, CONTEXT, devices=8, device_gb=141, weights="bf16")
    with pytest.raises(ValueError, match="its fp8 weights take 674.03 GB per device on 1 "
                                         "device\\(s\\) .* they need at least 5 devices$"):
        plan_devices(ds, CONTEXT, devices=1, device_gb=141)
    # 87 GB devices: 84.25 GB of FP8 weights each leave 2.75 GB; a bf16-KV request needs
    # 3.24 GB (1.15 GB of hot cache, 2.08 GB of indexer keys and slot maps for 131,072 tokens),
    # fewer tokens fit: (2.75e9 - 1.16e9 fixed) / 15,860 B per token; 656-byte rows fit.
    with pytest.raises(ValueError, match=re.escape(
            "deepseek_v32: one offloaded request of 131,072 tokens takes 3.24 GB of device "
            "memory, above the 2.75 GB the fp8 weights leave on each of 8 device(s): a context "
            "of at most 99,740 tokens fits; kv_format 'fp8_ds_mla' (2.74 GB per request) fits; "
            "fewer hot slots than 16,384 or more devices leave more")):
        plan_devices(ds, CONTEXT, devices=8, device_gb=87)
    assert plan_devices(ds.replace(kv_format="fp8_ds_mla"), CONTEXT, devices=8,
                        device_gb=87).max_batch_offload == 1
    for bad, message in [(dict(devices=0), "devices must be an int >= 1, got 0"),
                         (dict(device_gb=-1.0), "device_gb must be a finite number > 0"),
                         (dict(weights="int4"), "weights='int4' is not one of \\('bf16', "
                                                "'fp8'\\)")]:
        with pytest.raises(ValueError, match=message):
            plan_devices(ds, CONTEXT, **(dict(devices=8, device_gb=141) | bad))


def test_plan_command_with_devices(capsys):
    assert main(["plan", "--model", "glm52", "--context", "128000", "--devices", "8",
                 "--device-gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "Devices: 8 x 141.00 GB" in out and "with fp8 weights and bf16 KV" in out
    assert re.search(r"fp8_ds_mla: +resident 7.24 GB, offloaded 1.55 GB device \+ 6.55 GB host",
                     out)
    assert main(["plan", "--model", "glm52", "--context", "128000", "--devices", "8",
                 "--device-gb", "141", "--weight-format", "bf16"]) == 2
    assert "they need at least 11 devices, or FP8 weights" in capsys.readouterr().err
    assert main(["plan", "--model", "glm52", "--context", "1000", "--devices", "8"]) == 2
    assert "--devices and --device-gb go together" in capsys.readouterr().err


def test_generate_counts_the_real_width_preset_in_fp8(capsys):
    # deepseek_v32_width's random weights are FP8: 38.88 GB (74.03 GB in bfloat16).
    assert main(["generate", "--model", "deepseek_v32_width", "--offload", "--max-param-gb",
                 "1", "--max-new-tokens", "1", "--prompt", "x", "--no-progress"]) == 2
    assert ("the parameters of 'deepseek_v32_width' take 38.88 GB (FP8 projections), above "
            "--max-param-gb=1") in capsys.readouterr().err

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


# The all-to-all layout (data-parallel attention, routed experts split over the devices) ------


def _per_device(tree, specs, mesh) -> int:
    """Bytes one device holds of `tree` placed with `specs` (PartitionSpecs) on `mesh`."""
    def one(x, spec):
        split = 1
        for axis in spec:
            split *= 1 if axis is None else mesh.shape[axis]
        return x.size * x.dtype.itemsize // split

    return sum(jax.tree_util.tree_leaves(jax.tree.map(
        one, tree, specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))))


@pytest.mark.parametrize("name", ["deepseek_v32", "glm52"])
def test_expert_parallel_plan_per_device_is_that_of_the_placed_arrays(name):
    # 8 devices in the all-to-all layout: the weights per device, and the device and host
    # bytes of each rank's batch, are what `fo_jax.sharding`'s rules place on one device of
    # 8, from jax.eval_shape of the FP8 parameters and the states (nothing allocated).
    from fo_jax import sharding
    from fo_jax.plan import plan_expert_parallel

    config = get_config(name)
    plan = plan_expert_parallel(config, CONTEXT, devices=8, device_gb=141, hot_slots=HOT,
                                tail_block=Z)
    mesh = jax.sharding.AbstractMesh((8, 1, 1), sharding.MESH_AXES)
    rules = sharding.ALL_TO_ALL_RULES
    fp8 = jax.eval_shape(lambda k: quantize_params(init_params(config, k), FP8_BLOCK),
                         jax.random.key(0))
    assert plan.weights_per_device == _per_device(fp8, sharding.param_specs(fp8, mesh, rules),
                                                  mesh)
    assert plan.replicated_bytes + plan.expert_bytes == _nbytes(fp8)
    assert plan.expert_bytes == _nbytes([fp8["moe"][w] for w in ("w1", "w2", "w3")])
    batch = 8 * plan.max_batch_offload  # every rank holds max_batch_offload requests
    state = jax.eval_shape(lambda: DecodeState.create(
        config, OffloadConfig(hot_slots=HOT, page_size=Z, capacity=CONTEXT), batch=batch))
    state_specs = sharding.specs(state, mesh, rules)
    device = (state.hot, state.index_keys, state.slots)
    assert plan.max_batch_offload * plan.offload_request_bytes == _per_device(
        device, (state_specs.hot, state_specs.index_keys, state_specs.slots), mesh)
    assert plan.host_bytes_offload == _per_device(state.host.kv, state_specs.host.kv, mesh)
    res = jax.eval_shape(lambda: ResidentState.create(config, batch=8 * plan.max_batch_resident,
                                                      capacity=CONTEXT))
    res_specs = sharding.specs(res, mesh, rules)
    assert plan.max_batch_resident * plan.resident_request_bytes == _per_device(
        (res.kv, res.index_keys), (res_specs.kv, res_specs.index_keys), mesh)
    # What fits: the batch with its all-to-all buffers, and one more request would not.
    for batch, request in ((plan.max_batch_offload, plan.offload_request_bytes),
                           (plan.max_batch_resident, plan.resident_request_bytes)):
        used = batch * (request + plan.all_to_all_bytes_per_token)
        assert used <= plan.kv_budget_bytes < used + request + plan.all_to_all_bytes_per_token
    assert plan.max_batch_offload > plan.max_batch_resident >= 1
    assert plan.max_context_offload >= CONTEXT and plan.max_context_resident >= CONTEXT


def test_expert_parallel_plan_refuses_a_mesh_that_does_not_fit_naming_what_would(capsys):
    from fo_jax.plan import plan_expert_parallel

    ds = get_config("deepseek_v32")
    with pytest.raises(ValueError, match=re.escape(
            "deepseek_v32: its bf16 weights take 199.42 GB per device on 8 device(s) in the "
            "all-to-all layout (35.94 GB replicated + 1307.82 GB of routed experts / 8), above "
            "the 141.00 GB of a device: it needs at least 16 devices (a divisor of 256); FP8 "
            "weights take 101.72 GB per device here")):
        plan_expert_parallel(ds, CONTEXT, devices=8, device_gb=141, weights="bf16")
    with pytest.raises(ValueError, match=re.escape(
            "deepseek_v32: 6 devices do not divide its 256 routed experts (every device holds "
            "X / devices of them): use one of [1, 2, 4, 8, 16, 32, 64, 128, 256]")):
        plan_expert_parallel(ds, CONTEXT, devices=6, device_gb=141)
    with pytest.raises(ValueError, match=re.escape(
            "it needs more than 256 devices: the replicated weights alone take 19.96 GB")):
        plan_expert_parallel(ds, CONTEXT, devices=8, device_gb=15)
    with pytest.raises(ValueError, match=re.escape(
            "deepseek_v32: one offloaded request of 131,072 tokens takes 3.25 GB of device "
            "memory, above the 1.28 GB the fp8 weights leave on each of 8 device(s) in the "
            "all-to-all layout: a context of at most 7,032 tokens fits; more devices or fewer "
            "hot slots than 16,384 leave more")):
        plan_expert_parallel(ds, CONTEXT, devices=8, device_gb=103)
    with pytest.raises(ValueError, match="tiny has no routed experts"):
        plan_expert_parallel(get_config("tiny"), 100, devices=2, device_gb=1)
    assert main(["plan", "--model", "glm52", "--context", "131072", "--devices", "8",
                 "--device-gb", "141", "--expert-layout", "all-to-all"]) == 0
    out = capsys.readouterr().out
    assert "All-to-all layout: 8 x 141.00 GB" in out, out
    assert "weights per device (fp8): 111.25 GB (20.63 GB replicated + 724.95 GB" in out, out
    assert main(["plan", "--model", "glm52", "--context", "131072", "--expert-layout",
                 "all-to-all"]) == 2
    assert "--expert-layout applies with --devices and --device-gb" in capsys.readouterr().err

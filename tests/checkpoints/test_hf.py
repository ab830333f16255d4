"""Hugging Face checkpoints: config.json -> ModelConfig, tiny random checkpoint directories
(sharded, FP8 with block scales) loaded, saved and refused."""

import json
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest

from fo_jax import weights
from fo_jax.checkpoints import (config_from_hf, dequantize_fp8, load_checkpoint,
                                save_checkpoint, tensor_names, to_hf_config)
from fo_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params

TINY = get_config("tiny")
MOE = TINY.replace(num_layers=3, indexer_layers=(0, 2), n_routed_experts=4,
                   num_experts_per_tok=2, moe_hidden=16, n_shared_experts=1, n_group=2,
                   topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                   dtype="bfloat16", index_fp8=True)

# DeepSeek-V3.2-Exp's config.json (Hugging Face), every field.
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128],
                            "scale_fmt": "ue8m0"},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.44.2", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}


def _glm(**changes):
    hf = dict(DEEPSEEK_V32, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
              hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
              num_key_value_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256,
              intermediate_size=12288, index_n_heads=32, vocab_size=154880,
              max_position_embeddings=202752, n_group=1, topk_group=1, rms_norm_eps=1e-5,
              indexer_rope_interleave=True, rope_parameters={"rope_theta": 1e6,
                                                             "rope_type": "default"})
    del hf["rope_scaling"], hf["rope_theta"], hf["quantization_config"]
    hf.update(changes)
    return hf


def test_deepseek_v32_config_json_is_the_preset_plus_moe():
    config = config_from_hf(DEEPSEEK_V32, name="deepseek_v32")
    want = get_config("deepseek_v32").replace(
        n_routed_experts=256, num_experts_per_tok=8, moe_hidden=2048, n_shared_experts=1,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
        num_nextn_predict_layers=1)
    assert config == want
    assert (config.num_dense_layers, config.num_moe_layers) == (3, 58)


def test_indexer_rope_layout_defaults_per_architecture():
    # transformers' GlmMoeDsa always rotates interleaved pairs in the indexer and writes no
    # indexer_rope_interleave field; DeepSeek-V3.2 rotates halves.
    glm = _glm()
    del glm["indexer_rope_interleave"]
    assert config_from_hf(glm, max_seq_len=4096).index_rope_interleave
    assert not config_from_hf(_glm(indexer_rope_interleave=False),
                              max_seq_len=4096).index_rope_interleave
    assert not config_from_hf(DEEPSEEK_V32).index_rope_interleave


def test_glm_indexer_sharing_and_rope_layout():
    config = config_from_hf(_glm(), max_seq_len=4096)
    assert config.indexer_layers == tuple(range(78)) and config.index_rope_interleave
    assert config.rope_theta == 1e6 and config.rope_factor == 1.0 and config.norm_eps == 1e-5
    # index_topk_freq 4, offset 2 (Hugging Face's schedule): full at 0, 1, then every 4th.
    shared = config_from_hf(_glm(index_topk_freq=4, index_skip_topk_offset=2), max_seq_len=4096)
    assert shared.indexer_layers[:4] == (0, 1, 5, 9) and shared.indexer_layers[-1] == 77
    kinds = ["full", "shared", "shared", "full"] + ["shared"] * 74
    assert config_from_hf(_glm(indexer_types=kinds), max_seq_len=4096).indexer_layers == (0, 3)
    assert config_from_hf(_glm(index_topk_pattern="FSSF" + "S" * 74),
                          max_seq_len=4096).indexer_layers == (0, 3)


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["DeepseekV3ForCausalLM"]),
     "architectures=['DeepseekV3ForCausalLM']: fo_jax loads exactly one of"),
    (dict(sliding_window=4096), "fields ['sliding_window'] are not implemented by fo_jax"),
    (dict(scoring_func="softmax"),
     "scoring_func='softmax' is not supported: fo_jax implements scoring_func='sigmoid'"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(rope_scaling=dict(DEEPSEEK_V32["rope_scaling"], mscale=0.707)),
     "rope_scaling mscale=0.707, mscale_all_dim=1.0: fo_jax implements YaRN with mscale == "
     "mscale_all_dim > 0"),
    (dict(rope_scaling={"type": "yarn", "factor": 40}), "mscale=None, mscale_all_dim=None"),
    (dict(rope_scaling=dict(DEEPSEEK_V32["rope_scaling"], attention_factor=1.0)),
     "rope_scaling fields ['attention_factor'] are not implemented"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling type='linear'"),
    (dict(q_lora_rank=None), "q_lora_rank=None (a full-rank query projection)"),
    (dict(quantization_config={"quant_method": "awq"}), "quant_method='awq'"),
    (dict(mlp_layer_types=["sparse"] * 61), "mlp_layer_types=['sparse', 'sparse'"),
    (dict(indexer_types=["shared"] + ["full"] * 60), "layer 0 must be 'full'"),
])
def test_unsupported_config_fields_are_refused_by_name(changes, message):
    from fo_jax.checkpoints import hf_quantization
    hf = dict(DEEPSEEK_V32, **changes)
    with pytest.raises(ValueError) as err:
        config_from_hf(hf)
        hf_quantization(hf)
    assert message in str(err.value)


def test_expert_count_aliases():
    hf = dict(DEEPSEEK_V32)
    hf["num_local_experts"] = hf.pop("n_routed_experts")
    assert config_from_hf(hf).n_routed_experts == 256
    with pytest.raises(ValueError, match="num_experts=8 contradicts n_routed_experts=256"):
        config_from_hf(dict(DEEPSEEK_V32, num_experts=8))


def test_unknown_fields_can_be_vouched_for_and_yarn_needs_a_long_context():
    config = config_from_hf(dict(DEEPSEEK_V32, my_note=1), ignore_fields=("my_note",))
    assert config.yarn_active
    with pytest.raises(ValueError, match="max_seq_len=4096 <= original_max_position_embeddings"
                                         "=4096: fo_jax"):
        config_from_hf(DEEPSEEK_V32, max_seq_len=4096)


@pytest.mark.parametrize("config, arch", [
    (MOE, "GlmMoeDsaForCausalLM"),
    (TINY.replace(rope_factor=4.0, rope_original_seq_len=256, rope_mscale=0.5,
                  index_rope_interleave=True), "DeepseekV32ForCausalLM"),
])
def test_config_json_round_trip(config, arch):
    hf = to_hf_config(config, arch)
    back = config_from_hf(json.loads(json.dumps(hf)), max_ways=config.max_ways,
                          kv_dtype=config.kv_dtype, index_fp8=config.index_fp8)
    assert back == config


def test_save_load_round_trip_is_bitwise(tmp_path):
    params = init_params(MOE, jax.random.key(0))
    save_checkpoint(tmp_path, params, MOE, architecture="GlmMoeDsaForCausalLM",
                    max_shard_bytes=60_000, progress=False)
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 2
    config, loaded = load_checkpoint(tmp_path, progress=False, index_fp8=True)
    assert config == MOE
    assert weights.params_equal(params, loaded)
    assert loaded["moe"]["gate_bias"].dtype == np.float32
    assert loaded["moe"]["w1"].dtype == MOE.jnp_dtype


def _quantize(w, block):
    """FP8 e4m3 blocks of w [O, I] with power-of-two scales (as DeepSeek's ue8m0 scales)."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = np.ones(grid, np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = 2.0 ** np.ceil(np.log2(max(np.abs(tile).max(), 1e-30) / 448.0))
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:rows, :cols]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_fp8_block_scaled_weights_are_dequantised_on_load(tmp_path, block):
    config = MOE.replace(dtype="float32")
    params = init_params(config, jax.random.key(1))
    save_checkpoint(tmp_path, params, config, progress=False)
    file = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")][0]
    tensors = {n: SafetensorsFile(tmp_path / file).get(n)
               for n in SafetensorsFile(tmp_path / file).keys()}
    expected = {}
    for name in list(tensors):  # every projection except the router and the head goes FP8
        if name.endswith("proj.weight") or name.endswith("wq_b.weight") or name.endswith(
                "wk.weight"):
            q, scale = _quantize(tensors[name], block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            expected[name] = dequantize_fp8(q, scale, block)
    write_safetensors(tmp_path / file, tensors)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    _, loaded = load_checkpoint(tmp_path, config, progress=False, weights="dequantize")
    names = tensor_names(config)
    for name, want in expected.items():
        slot = names[name]
        got = loaded
        for key in slot.path:
            got = got[key]
        got = np.asarray(got[slot.index])
        np.testing.assert_array_equal(got.T if slot.transpose else got, want)
    # By hand: one e4m3 value times its block's scale.
    q = np.array([[1.5, -2.0], [0.25, 448.0]], ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(dequantize_fp8(q, np.array([[4.0]], np.float32), (128, 128)),
                                  [[6.0, -8.0], [1.0, 1792.0]])
    # The FP8 model is the bf16 one up to FP8 rounding (<= 2^-4 relative per value).
    w = np.asarray(params["moe"]["w1"][0, 0])
    np.testing.assert_allclose(np.asarray(loaded["moe"]["w1"][0, 0]), w, rtol=2 ** -4,
                               atol=1e-6)


def _saved(tmp_path, config=MOE):
    save_checkpoint(tmp_path, init_params(config, jax.random.key(0)), config,
                    max_shard_bytes=60_000, progress=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    return index["weight_map"]


def _edit(tmp_path, shard, fn):
    file = SafetensorsFile(tmp_path / shard)
    tensors = {n: file.get(n) for n in file.keys()}
    fn(tensors)
    write_safetensors(tmp_path / shard, tensors)


def test_bad_checkpoints_are_refused_before_loading(tmp_path):
    weight_map = _saved(tmp_path)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    shard = weight_map[name]
    _edit(tmp_path, shard, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"puts \\['{name}'\\] in this shard but it does not"):
        load_checkpoint(tmp_path, MOE, progress=False)
    # Without its index entry too: a missing tensor.
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"missing \\['{name}'\\], unexpected \\[\\]"):
        load_checkpoint(tmp_path, MOE, progress=False)
    # A config with fewer experts: experts 2 and 3 are extra.
    small = MOE.replace(n_routed_experts=2, n_group=1, topk_group=1)
    with pytest.raises(ValueError, match="unexpected \\['model.layers.1.mlp.experts.2."):
        load_checkpoint(tmp_path, small, progress=False)


def test_wrong_shapes_truncated_shards_and_missing_scales_are_refused(tmp_path):
    weight_map = _saved(tmp_path)
    name = "model.layers.0.self_attn.q_a_proj.weight"
    _edit(tmp_path, weight_map[name], lambda t: t.update({name: t[name][:, :-1]}))
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape \\(32, 63\\), expected "
                                         "\\(32, 64\\)"):
        load_checkpoint(tmp_path, MOE, progress=False)
    _edit(tmp_path, weight_map[name], lambda t: t.update(
        {name: np.zeros((32, 64), ml_dtypes.float8_e4m3fn)}))
    with pytest.raises(ValueError, match=f"tensor '{name}' is FP8 but config.json has no "
                                         "quantization_config"):
        load_checkpoint(tmp_path, MOE, progress=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"FP8 tensor '{name}' has no '{name}_scale_inv'"):
        load_checkpoint(tmp_path, MOE, progress=False)
    path = tmp_path / weight_map["lm_head.weight"]
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="has .* bytes \\(truncated file\\?\\)"):
        load_checkpoint(tmp_path, MOE, progress=False)


def test_mtp_layer_tensors_are_skipped(tmp_path):
    config = MOE.replace(num_nextn_predict_layers=1)
    weight_map = _saved(tmp_path, config)
    shard = weight_map["lm_head.weight"]
    _edit(tmp_path, shard, lambda t: t.update(
        {"model.layers.3.eh_proj.weight": np.zeros((64, 128), ml_dtypes.bfloat16)}))
    loaded_config, _ = load_checkpoint(tmp_path, progress=False)
    assert loaded_config.num_nextn_predict_layers == 1


def test_reference_names_round_trip_with_moe(tmp_path):
    params = init_params(MOE, jax.random.key(2))
    tensors = weights.to_checkpoint(params, MOE)
    assert "layers.1.ffn.experts.3.w2.weight" in tensors and "layers.1.ffn.gate.bias" in tensors
    assert "layers.0.ffn.w1.weight" in tensors and "layers.2.attn.indexer.wk.weight" in tensors
    assert weights.params_equal(weights.from_checkpoint(tensors, MOE), params)


def test_packed_experts_load_like_per_expert_tensors(tmp_path):
    # Layer 2's experts packed as recent transformers hold them: gate_up_proj [X, 2M, E] (gate
    # rows first), down_proj [X, E, M].
    params = init_params(MOE, jax.random.key(0))  # what _saved writes
    weight_map = _saved(tmp_path)
    pre = "model.layers.2.mlp.experts."
    per = {n: s for n, s in weight_map.items() if n.startswith(pre)}
    tensors = {}
    for shard in sorted(set(per.values())):
        file = SafetensorsFile(tmp_path / shard)
        tensors.update({n: file.get(n) for n in file.keys() if n in per})
        _edit(tmp_path, shard, lambda t: [t.pop(n) for n in per if n in t])
    experts = range(MOE.n_routed_experts)
    gate_up = np.stack([np.concatenate([tensors[f"{pre}{e}.gate_proj.weight"],
                                        tensors[f"{pre}{e}.up_proj.weight"]]) for e in experts])
    down = np.stack([tensors[f"{pre}{e}.down_proj.weight"] for e in experts])
    write_safetensors(tmp_path / "packed.safetensors",
                      {pre + "gate_up_proj": gate_up, pre + "down_proj": down})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for n in per:
        del index["weight_map"][n]
    index["weight_map"].update({pre + "gate_up_proj": "packed.safetensors",
                                pre + "down_proj": "packed.safetensors"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _, loaded = load_checkpoint(tmp_path, MOE, progress=False)
    assert weights.params_equal(params, loaded)


def _without(*keys, **changes):
    hf = dict(DEEPSEEK_V32, **changes)
    for key in keys:
        del hf[key]
    return hf


def _without_key(d, key):
    return {k: v for k, v in d.items() if k != key}


_YARN = DEEPSEEK_V32["rope_scaling"]


# Each bad config.json is refused with one line naming the field, what came and what was
# expected (a dict is named "config.json"; a file by its path: see the next tests).
BAD_CONFIGS = {
    "no num_hidden_layers": (_without("num_hidden_layers"),
                             "config.json lacks ['num_hidden_layers']: fo_jax builds the model "
                             "from"),
    "no sizes": (_without("hidden_size", "vocab_size", "index_topk", "num_attention_heads",
                          "kv_lora_rank"),
                 "config.json lacks ['hidden_size', 'index_topk', 'kv_lora_rank', "
                 "'num_attention_heads', 'vocab_size']"),
    "string hidden_size": (dict(DEEPSEEK_V32, hidden_size="7168"),
                           "config.json hidden_size='7168' must be an int >= 1, got a str"),
    "negative num_hidden_layers": (dict(DEEPSEEK_V32, num_hidden_layers=-1),
                                   "config.json num_hidden_layers=-1 must be an int >= 1"),
    # 10**9 layers built its per-layer tables for minutes: refused at once.
    "absurd num_hidden_layers": (dict(DEEPSEEK_V32, num_hidden_layers=10**9),
                                 "config.json num_hidden_layers=1000000000 is above 4096: no "
                                 "DSA model has that many"),
    "float vocab_size": (dict(DEEPSEEK_V32, vocab_size=129280.0),
                         "config.json vocab_size=129280.0 must be an int >= 1, got a float"),
    "bool index_topk": (dict(DEEPSEEK_V32, index_topk=True),
                        "config.json index_topk=True must be an int >= 1, got a bool"),
    "null kv_lora_rank": (dict(DEEPSEEK_V32, kv_lora_rank=None),
                          "config.json kv_lora_rank=None must be an int >= 1, got a NoneType"),
    "string expert count": (dict(DEEPSEEK_V32, n_routed_experts="256"),
                            "config.json n_routed_experts='256' must be an int >= 0, got a str"),
    "NaN rms_norm_eps": (dict(DEEPSEEK_V32, rms_norm_eps=float("nan")),
                         "config.json rms_norm_eps=nan must be a finite number > 0"),
    "string max_position_embeddings": (dict(DEEPSEEK_V32, max_position_embeddings="163840"),
                                       "config.json max_position_embeddings='163840' must be "
                                       "an int >= 1"),
    "string norm_topk_prob": (dict(DEEPSEEK_V32, norm_topk_prob="true"),
                              "config.json norm_topk_prob='true' must be true or false"),
    "infinite rope_theta": (dict(DEEPSEEK_V32, rope_theta=float("inf")),
                            "config.json rope_theta=inf must be a finite number > 0"),
    "architectures a string": (dict(DEEPSEEK_V32, architectures="DeepseekV32ForCausalLM"),
                               "config.json architectures='DeepseekV32ForCausalLM': fo_jax "
                               "loads exactly one of"),
    "architectures nested": (dict(DEEPSEEK_V32, architectures=[["DeepseekV32ForCausalLM"]]),
                             "architectures=[['DeepseekV32ForCausalLM']]: fo_jax loads exactly"),
    "attention_bias 0": (dict(DEEPSEEK_V32, attention_bias=0),
                         "config.json attention_bias=0 is not supported: fo_jax implements "
                         "attention_bias=False"),
    "torch_dtype a list": (dict(DEEPSEEK_V32, torch_dtype=["bfloat16"]),
                           "config.json torch_dtype=['bfloat16'] is not supported"),
    "rope_scaling a list": (dict(DEEPSEEK_V32, rope_scaling=["yarn"]),
                            "config.json rope_scaling=['yarn'] must be an object"),
    "yarn without factor": (dict(DEEPSEEK_V32, rope_scaling=_without_key(_YARN, "factor")),
                            "config.json rope_scaling has no factor: YaRN needs one"),
    "yarn string factor": (dict(DEEPSEEK_V32, rope_scaling=dict(_YARN, factor="40")),
                           "config.json rope_scaling.factor='40' must be a finite number >= 1"),
    "yarn derived factor < 1": (dict(DEEPSEEK_V32, max_position_embeddings=2048,
                                     rope_scaling=dict(_YARN, factor=None)),
                                "config.json rope_scaling.factor=None derives "
                                "max_position_embeddings / original_max_position_embeddings = "
                                "2048 / 4096 = 0.5, which must be >= 1"),
    "yarn fractional original": (dict(DEEPSEEK_V32, rope_scaling=dict(
        _YARN, original_max_position_embeddings=4096.5)),
        "config.json rope_scaling.original_max_position_embeddings=4096.5 must be an int >= 1"),
    "yarn string beta": (dict(DEEPSEEK_V32, rope_scaling=dict(_YARN, beta_fast="32")),
                         "config.json rope_scaling.beta_fast='32' must be a finite number"),
    "yarn string mscale": (dict(DEEPSEEK_V32, rope_scaling=dict(_YARN, mscale="1.0",
                                                                mscale_all_dim="1.0")),
                           "config.json rope_scaling.mscale='1.0' must be a finite number"),
    "string index_topk_freq": (_glm(index_topk_freq="2"),
                               "config.json index_topk_freq='2' must be an int >= 0 or null"),
    "indexer_types an int": (_glm(indexer_types=5),
                             "config.json indexer_types=5 must give 'full' or 'shared' for each "
                             "of the 78 layers"),
    "index_topk_pattern a list": (_glm(index_topk_pattern=["F"] * 78),
                                  "config.json index_topk_pattern=['F', 'F'"),
    "mlp_layer_types an int": (dict(DEEPSEEK_V32, mlp_layer_types=3),
                               "config.json mlp_layer_types=3: fo_jax implements"),
    "quantization_config a list": (dict(DEEPSEEK_V32, quantization_config=["fp8"]),
                                   "config.json quantization_config=['fp8'] must be an object"),
    "zero FP8 block": (dict(DEEPSEEK_V32, quantization_config=dict(
        DEEPSEEK_V32["quantization_config"], weight_block_size=[0, 128])),
        "config.json quantization_config weight_block_size=[0, 128]: expected [rows, cols], "
        "two ints >= 1"),
    # What ModelConfig refuses is named with the file, in config.json's names.
    "index_head_dim not a power of two": (dict(DEEPSEEK_V32, index_head_dim=100),
                                          "config.json: index_head_dim=100 must be a power of "
                                          "two"),
    "first_k_dense_replace > layers": (dict(DEEPSEEK_V32, first_k_dense_replace=62),
                                       "config.json: first_k_dense_replace=62 must be <= "
                                       "num_layers=61 (num_layers is config.json's "
                                       "num_hidden_layers)"),
}


@pytest.mark.parametrize("hf, message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_values_are_refused_naming_the_field(hf, message):
    from fo_jax.checkpoints import hf_quantization
    with pytest.raises(ValueError) as err:
        hf_quantization(hf)
        config_from_hf(hf)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_config_files_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "config.json"
    for text, message in [("[1, 2]", "expected a JSON object of config fields "
                                     '({"architectures": [...], ...}), got a list'),
                          ("{", "is not valid JSON (Expecting property name"),
                          (json.dumps(_without("num_hidden_layers")),
                           "config.json lacks ['num_hidden_layers']")]:
        path.write_text(text)
        with pytest.raises(ValueError) as err:
            config_from_hf(tmp_path)
        assert str(err.value).startswith(f"{path}") and message in str(err.value)


def test_yarn_factor_null_is_derived_as_transformers_does():
    # transformers' YaRN: factor None -> max_position_embeddings /
    # original_max_position_embeddings (163840 / 4096 = 40); original_max_position_embeddings
    # absent -> max_position_embeddings.
    derived = config_from_hf(dict(DEEPSEEK_V32, rope_scaling=dict(_YARN, factor=None)))
    assert derived.rope_factor == 40.0 and derived == config_from_hf(DEEPSEEK_V32)
    no_original = dict(DEEPSEEK_V32, max_position_embeddings=8192,
                       rope_scaling=_without_key(_YARN, "original_max_position_embeddings"))
    assert config_from_hf(no_original, max_seq_len=16384).rope_original_seq_len == 8192
    both = dict(no_original, rope_scaling=dict(no_original["rope_scaling"], factor=None))
    assert config_from_hf(both).rope_factor == 1.0  # 8192 / 8192: plain RoPE


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    weight_map = _saved(tmp_path)
    name = "model.layers.0.self_attn.q_a_proj.weight"  # [32, 64] bfloat16, stored [out, in]
    path = tmp_path / weight_map[name]
    clean = SafetensorsFile(path).get(name)

    def refused(value, config=MOE):
        _edit(tmp_path, weight_map[name], lambda t: t.update({name: value}))
        with pytest.raises(ValueError) as err:
            load_checkpoint(tmp_path, config, progress=False)
        assert str(err.value).startswith(f"{path}: tensor '{name}' ") and "\n" not in str(
            err.value)
        return str(err.value)

    ones = np.frombuffer(b"\xff" * clean.nbytes, clean.dtype).reshape(clean.shape)
    assert "holds 2048 non-finite values (the first, nan, at [0, 0]): a corrupt or " \
           "mis-converted checkpoint" in refused(ones)  # 0xffff is a bfloat16 NaN
    inf = clean.copy()
    inf[3, 5] = -np.inf
    assert "holds 1 non-finite value (the first, -inf, at [3, 5])" in refused(inf)
    # Finite in the file (bfloat16) but not in the config's dtype (float16, max 65504).
    big = clean.copy()
    big[1, 2] = 1e5
    assert ("holds 1 value that overflows float16 (the first, 99840.0, at [1, 2]): load it "
            "with a wider dtype") in refused(big, MOE.replace(dtype="float16"))
    # An FP8 weight whose e4m3 NaN byte (0x7f) survives dequantisation.
    q = np.zeros(clean.shape, ml_dtypes.float8_e4m3fn)
    q.view(np.uint8)[0, 1] = 0x7F
    _edit(tmp_path, weight_map[name], lambda t: t.update(
        {name + "_scale_inv": np.ones((1, 1), np.float32)}))
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert "holds 1 non-finite value (the first, nan, at [0, 1]) once dequantised with " \
           f"'{name}_scale_inv'" in refused(q)


def test_bad_index_files_are_refused_naming_the_file_and_entry(tmp_path):
    _saved(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    for text, message in [
            ("{", f"{index} is not valid JSON (Expecting property name"),
            ("[]", f"{index}: expected a JSON object of {{\"weight_map\": {{tensor name: "
                   "shard file name}}, got a list"),
            ("{}", f"{index}: \"weight_map\" must map tensor names to the names of shard "
                   f"files in {tmp_path}, got None"),
            (json.dumps({"weight_map": {"lm_head.weight": 5}}),
             f"{index}: weight_map['lm_head.weight']=5 must be the name of a shard file in "
             f"{tmp_path}"),
            (json.dumps({"weight_map": {"lm_head.weight": "../model.safetensors"}}),
             f"{index}: weight_map['lm_head.weight']='../model.safetensors' must be the name "
             "of a shard file")]:
        index.write_text(text)
        with pytest.raises(ValueError) as err:
            load_checkpoint(tmp_path, MOE, progress=False)
        assert str(err.value).startswith(message), (str(err.value), message)


def test_an_indexer_layout_mismatch_names_the_config_fields(tmp_path):
    # MOE's indexers are at layers 0 and 2 (indexer_types); with index_topk_freq=2 (and the
    # default offset 2) config.json puts them at 0 and 1.
    _saved(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["indexer_types"]
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, index_topk_freq=2)))
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path, progress=False)
    assert ("unexpected ['model.layers.2.self_attn.indexer.k_norm.bias'" in str(err.value)
            and str(err.value).endswith(
                f"; the checkpoint holds indexer tensors at layers (0, 2), config {MOE.name!r} "
                "puts indexers at layers (0, 1) (config.json: index_topk_freq=2, "
                "index_skip_topk_offset=2 (default))"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_all_finite_finds_inf_and_nan_in_any_chunk(dtype):
    from fo_jax.checkpoints.hf import all_finite
    x = np.linspace(-1e3, 1e3, 3 * (1 << 18) + 8).astype(dtype)  # 4 chunks, the last ragged
    assert all_finite(x) and all_finite(x.reshape(-1, 5)[:, ::2])  # strided: copied first
    info = jax.numpy.finfo(dtype)
    assert all_finite(np.array([info.max, -info.max, info.tiny, 0.0], dtype))
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 1 << 18, x.size - 1):
            y = x.copy()
            y[at] = bad
            assert not all_finite(y), (bad, at)


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    weight_map = _saved(tmp_path)
    name = "lm_head.weight"
    other = sorted(set(weight_map.values()) - {weight_map[name]})[0]
    head = SafetensorsFile(tmp_path / weight_map[name]).get(name)
    _edit(tmp_path, other, lambda t: t.update({name: np.zeros_like(head)}))
    first, second = sorted([tmp_path / other, tmp_path / weight_map[name]])
    with pytest.raises(ValueError, match=re.escape(
            f"{second}: tensor '{name}' is also in {first}: which copy to load is ambiguous "
            f"(the index puts it in {weight_map[name]}); remove the other")):
        load_checkpoint(tmp_path, MOE, progress=False)

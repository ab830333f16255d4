"""Loading and saving the multi-token-prediction (MTP) layers of HF checkpoints."""

import json
import re
import os

import jax
import numpy as np
import pytest

from fo_jax import weights
from fo_jax.checkpoints.hf import load_checkpoint, save_checkpoint
from fo_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.model.mtp import init_mtp_params, mtp_param_shapes

# Three layers (one dense, two MoE) and one MTP layer (a MoE layer with its own indexer).
MOE = get_config("tiny").replace(
    num_layers=3, indexer_layers=(0, 2), n_routed_experts=4, num_experts_per_tok=2,
    moe_hidden=16, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    first_k_dense_replace=1, dtype="bfloat16", num_nextn_predict_layers=1)
PARITY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "parity", "deepseek_v32")


@pytest.fixture(scope="module")
def random_params():
    """Random parameters of MOE and its MTP layer (with its own embed / head), made once."""
    return (init_params(MOE, jax.random.key(0)),
            init_mtp_params(MOE, jax.random.key(1), own_embed=True, own_head=True))


def _save(path, random_params, own: bool):
    params, mtp = random_params
    if not own:
        mtp = {k: v for k, v in mtp.items() if k not in ("embed", "head")}
    save_checkpoint(path, params, MOE, mtp=mtp, max_shard_bytes=60_000, progress=False)
    return params, mtp


@pytest.mark.parametrize("own", [True, False], ids=["own-embed-head", "shared-embed-head"])
def test_mtp_layers_round_trip_bitwise(tmp_path, random_params, own):
    params, mtp = _save(tmp_path, random_params, own)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    # The names of a DeepSeek-V3 checkpoint's MTP layer (layer L = 3 here).
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "self_attn.indexer.wk.weight",
                 "mlp.experts.3.down_proj.weight", "mlp.shared_experts.up_proj.weight",
                 "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.3.{name}" in weight_map
    assert ("model.layers.3.embed_tokens.weight" in weight_map) == own
    assert ("model.layers.3.shared_head.head.weight" in weight_map) == own
    config, got, got_mtp = load_checkpoint(tmp_path, progress=False, mtp=True)
    assert (config.num_layers, config.num_nextn_predict_layers) == (3, 1)
    assert weights.params_equal(got, params) and weights.params_equal(got_mtp, mtp)
    assert jax.tree_util.tree_structure(got_mtp) == jax.tree_util.tree_structure(mtp)
    # Without mtp=True the loader behaves as before: two results, the MTP tensors skipped.
    config2, plain = load_checkpoint(tmp_path, progress=False)
    assert weights.params_equal(plain, params)
    assert mtp_param_shapes(MOE)["eh_proj"] == (1, 2 * MOE.dim, MOE.dim)


def _edit(path, fn):
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["model.layers.3.enorm.weight"]
    file = SafetensorsFile(path / shard)
    tensors = {n: file.get(n) for n in file.keys()}
    fn(tensors)
    write_safetensors(path / shard, tensors)
    weight_map = {n: s for n, s in weight_map.items() if s != shard}
    weight_map.update({n: shard for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_missing_or_misshaped_mtp_tensors_are_refused_naming_them(tmp_path, random_params):
    _save(tmp_path, random_params, own=False)
    _edit(tmp_path, lambda t: t.pop("model.layers.3.eh_proj.weight"))
    with pytest.raises(ValueError, match=r"the multi-token-prediction layer tensors \(layers "
                       r"3\.\.3\) do not match config 'tiny': missing "
                       r"\['model\.layers\.3\.eh_proj\.weight'\], unexpected \[\]; load with "
                       r"mtp=False to skip them"):
        load_checkpoint(tmp_path, progress=False, mtp=True)
    load_checkpoint(tmp_path, progress=False)  # the main model still loads
    _edit(tmp_path, lambda t: t.update(
        {"model.layers.3.eh_proj.weight": np.zeros((64, 64), t["model.layers.3.enorm.weight"]
                                                   .dtype)}))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.3\.eh_proj\.weight' has shape "
                       r"\(64, 64\), expected \(64, 128\)"):
        load_checkpoint(tmp_path, progress=False, mtp=True)


def test_the_parity_fixture_mtp_layer_loads_sharing_embed_and_head():
    # transformers' save_pretrained writes layer L's decoder layer, enorm / hnorm / eh_proj and
    # shared_head.norm, but no embed_tokens / shared_head.head of its own: shared with the model.
    config, _, mtp = load_checkpoint(PARITY, progress=False, mtp=True)
    assert "embed" not in mtp and "head" not in mtp
    assert mtp["eh_proj"].shape == (1, 2 * config.dim, config.dim)
    assert mtp["moe"]["w1"].shape[:2] == (1, config.n_routed_experts)


def test_mtp_needs_an_mtp_layer(tmp_path, random_params):
    config = MOE.replace(num_nextn_predict_layers=0)
    save_checkpoint(tmp_path, random_params[0], config, progress=False)
    with pytest.raises(ValueError, match=r"mtp=True: config 'tiny' has "
                       r"num_nextn_predict_layers=0"):
        load_checkpoint(tmp_path, config, progress=False, mtp=True)


def test_cli_draft_mtp_from_a_model_dir(tmp_path, capsys):
    # A tiny HF checkpoint with an MTP layer and a tokenizer: --drafter mtp prints the text of
    # a run without drafts and its drafting figures, resident and offloaded (checked bitwise).
    from fo_jax.cli import main
    from tests.checkpoints.hf_tiny import tiny_hf_config, write_tokenizer

    config = tiny_hf_config().replace(num_layers=2, indexer_layers=(0,),
                                      num_nextn_predict_layers=1)
    save_checkpoint(tmp_path, init_params(config, jax.random.key(0)), config,
                    mtp=init_mtp_params(config, jax.random.key(1)), progress=False)
    write_tokenizer(tmp_path)
    common = ["generate", "--model-dir", str(tmp_path), "--prompt", "hello world",
              "--max-new-tokens", "6", "--no-progress"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main(common + ["--drafter", "mtp"]) == 0
    out = capsys.readouterr().out
    assert out.split("--- summary ---")[0] == plain.split("--- summary ---")[0]
    assert re.search(r"drafts: mtp, 3 per step: [0-9.]+ tokens per step over \d+ steps "
                     r"\(accepted \d+ of \d+ drafts\)", out), out
    assert main(common + ["--drafter", "mtp", "--offload", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.split("--- summary ---")[0] == plain.split("--- summary ---")[0]
    assert "offloaded logits bitwise equal to the resident model's" in out

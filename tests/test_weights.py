"""safetensors round trip under the DeepSeek-V3.2 reference names."""

import jax
import numpy as np
import pytest
from flax import nnx

from fo_jax.config import get_config
from fo_jax.model.dsa import DSAModel, init_params
from fo_jax.weights import (from_checkpoint, load_params, params_equal, save_params,
                            to_checkpoint)

CONFIG = get_config("tiny")


def test_round_trip_is_bitwise(tmp_path):
    params = init_params(CONFIG, jax.random.key(3))
    path = tmp_path / "tiny.safetensors"
    save_params(path, params, CONFIG)
    assert params_equal(load_params(path, CONFIG), params)


def test_bf16_round_trip(tmp_path):
    config = CONFIG.replace(dtype="bfloat16")
    params = init_params(config, jax.random.key(4))
    save_params(tmp_path / "w.safetensors", params, config)
    assert params_equal(load_params(tmp_path / "w.safetensors", config), params)


def test_reference_names_and_layouts():
    params = init_params(CONFIG, jax.random.key(5))
    tensors = to_checkpoint(params, CONFIG)
    assert tensors["layers.1.attn.wq_a.weight"].shape == (CONFIG.q_lora_rank, CONFIG.dim)
    np.testing.assert_array_equal(tensors["layers.1.attn.wq_a.weight"],
                                  np.asarray(params["layers"]["wq_a"][1]).T)
    # Indexers live in the first layer of their group (groups start at 0 and 2).
    assert "layers.2.attn.indexer.wk.weight" in tensors
    assert "layers.1.attn.indexer.wk.weight" not in tensors
    assert tensors["layers.0.attn.indexer.k_norm.bias"].shape == (CONFIG.index_head_dim,)
    assert tensors["embed.weight"].shape == (CONFIG.vocab_size, CONFIG.dim)
    assert tensors["head.weight"].shape == (CONFIG.vocab_size, CONFIG.dim)


def test_missing_tensor_is_a_clear_error():
    tensors = to_checkpoint(init_params(CONFIG, jax.random.key(6)), CONFIG)
    del tensors["layers.3.ffn.w2.weight"]
    with pytest.raises(ValueError, match=r"checkpoint has no tensor 'layers.3.ffn.w2.weight'"):
        from_checkpoint(tensors, CONFIG)
    with pytest.raises(FileNotFoundError, match="no weights file"):
        load_params("/nonexistent.safetensors", CONFIG)


def test_nnx_model_owns_the_same_params():
    model = DSAModel(CONFIG, rngs=nnx.Rngs(params=7))
    params = model.params()
    assert params["layers"]["wq_a"].shape == (4, CONFIG.dim, CONFIG.q_lora_rank)
    other = init_params(CONFIG, jax.random.key(8))
    model.load_params(other)
    assert params_equal(model.params(), other)
    bad = dict(other, norm=other["norm"][:3])
    with pytest.raises(ValueError, match=r"params/norm: expected shape \(64,\)"):
        model.load_params(bad)

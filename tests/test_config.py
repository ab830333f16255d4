"""ModelConfig validation and presets."""

import pytest

from fo_jax.config import PRESETS, ModelConfig, balanced_groups, get_config

TINY = get_config("tiny")


def test_presets_are_valid_and_real_shapes_are_real():
    assert set(PRESETS) >= {"tiny", "small", "deepseek_v32", "glm5", "glm52"}
    for name in ("deepseek_v32", "glm5", "glm52"):
        c = get_config(name)
        assert (c.kv_lora_rank, c.qk_rope_head_dim, c.kv_width, c.index_topk) == (512, 64, 576,
                                                                                   2048)
        assert c.index_head_dim == 128
    assert 16 <= TINY.index_topk <= 64


def test_glm52_indexer_groups():
    c = get_config("glm52")
    assert (c.num_layers, c.num_groups) == (78, 21)
    sizes = [hi - lo for lo, hi in c.group_bounds]
    assert sum(sizes) == 78 and set(sizes) == {3, 4}
    assert c.layer_group[:5] == (0, 0, 0, 0, 1) and c.layer_group[-1] == 20
    assert get_config("deepseek_v32").num_groups == 61
    assert balanced_groups(10, 3) == (0, 4, 7)


@pytest.mark.parametrize("change,message", [
    (dict(dim=0), r"ModelConfig.dim must be a positive int, got 0"),
    (dict(index_head_dim=12), r"index_head_dim=12 must be a power of two.*try 8 or 16"),
    (dict(qk_rope_head_dim=7), r"qk_rope_head_dim=7 must be even"),
    (dict(indexer_layers=(1, 2)), r"indexer_layers=\(1, 2\) must start with layer 0"),
    (dict(indexer_layers=(0, 2, 2)), r"must be strictly increasing"),
    (dict(indexer_layers=(0, 9)), r"names layer 9 but num_layers=4"),
    (dict(dtype="int8"), r"ModelConfig.dtype='int8' is not supported"),
    (dict(max_seq_len=2**30), r"overflows int32"),
])
def test_bad_configs_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        TINY.replace(**change)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown model preset 'llama'; known presets"):
        get_config("llama")


def test_config_is_frozen_and_hashable():
    with pytest.raises(Exception):
        TINY.dim = 3
    assert hash(TINY) == hash(TINY.replace())
    assert isinstance(TINY, ModelConfig)

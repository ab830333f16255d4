"""init_params: one compiled program, kept across `jax.clear_caches()`, whose parameters are bit
for bit those of the original leaf-by-leaf eager draws (the reference below)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax.config import get_config
from fo_jax.model import dsa

TINY = get_config("tiny")
MOE = TINY.replace(n_routed_experts=8, num_experts_per_tok=2, moe_hidden=16, n_shared_experts=1,
                   n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)


def init_params_reference(config, key):
    """The original init_params: every leaf drawn eagerly, one small program per shape."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        dsa.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), leaf_key in zip(leaves, keys):
        name = path[-1].key
        dtype = dsa.param_dtype(tuple(k.key for k in path), config)
        if name in {"norm", "attn_norm", "q_norm", "kv_norm", "ffn_norm", "k_norm_w"}:
            value = jnp.ones(shape, dtype)
        elif name in {"k_norm_b", "gate_bias"}:
            value = jnp.zeros(shape, dtype)
        elif name == "embed":
            value = jax.random.normal(leaf_key, shape, dtype)
        else:
            value = jax.random.normal(leaf_key, shape, dtype) * shape[-2] ** -0.5
        out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)


def assert_bitwise(got, want):
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8),
                                      err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("config, key", [
    (TINY, lambda: jax.random.key(0)),
    (MOE.replace(dtype="bfloat16", n_shared_experts=0, first_k_dense_replace=0),
     lambda: jax.random.PRNGKey(3)),  # float32 gate_bias in a bfloat16 model; a raw key
], ids=["tiny", "moe-bf16-raw-key"])
def test_init_params_matches_the_eager_draws_bit_for_bit(config, key):
    want = init_params_reference(config, key())
    assert_bitwise(dsa.init_params(config, key()), want)
    # Under a trace (eval_shape, jit) the draws are traced inline: same structure and types.
    shapes = jax.eval_shape(lambda k: dsa.init_params(config, k), key())
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want)


def test_init_params_compiles_once_per_shapes(caplog):
    # A config differing only in fields that change no shape reuses the program, after
    # jax.clear_caches() too (tests/conftest.py clears the caches after each module).
    first = dsa.init_params(TINY, jax.random.key(0))
    other = TINY.replace(name="tiny-other", index_topk=8, max_ways=2)
    key = jax.random.key(0)
    jax.clear_caches()
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        again = dsa.init_params(other, key)
    compiled = [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    assert compiled == [], compiled
    assert_bitwise(again, first)

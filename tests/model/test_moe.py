"""The MoE MLP (ragged_dot dispatch) against its dense-mask reference; routing by hand; the
layer loop with dense and MoE layers."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import check_params, init_params, param_bytes, param_shapes
from fo_jax.model.moe import (EXPERT_AXIS, IMPLEMENTATIONS, TILE_ROWS, AllToAllExperts,
                              all_to_all_capacity, expert_rows, moe_mlp, moe_mlp_reference,
                              resolve_implementation, route, route_reference)

TINY = get_config("tiny")
# 8 experts in 4 groups of 2, top-2 of the best 2 groups, one shared expert; layer 0 dense.
MOE = TINY.replace(n_routed_experts=8, num_experts_per_tok=2, moe_hidden=16, n_shared_experts=1,
                   n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)
SCENARIOS = {
    "grouped": {},
    "one_group": dict(n_group=1, topk_group=1, num_experts_per_tok=3),
    "no_shared_unnormalised": dict(n_shared_experts=0, norm_topk_prob=False),
}


def _layer(config, key, bias_scale=0.1):
    """One MoE layer's parameters (numpy random, fan-in scaled) with a random correction bias."""
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    shapes = {name: shape[1:] for name, shape in param_shapes(config)["moe"].items()}
    p = {name: jnp.asarray(rng.standard_normal(shape, np.float32) * shape[-2] ** -0.5)
         for name, shape in shapes.items() if name != "gate_bias"}
    p["gate_bias"] = jnp.asarray(rng.standard_normal(shapes["gate_bias"], np.float32)
                                 * bias_scale)
    return p


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_moe_mlp_matches_the_dense_mask_reference(name, implementation):
    config = MOE.replace(**SCENARIOS[name])
    key = jax.random.key(3)
    p = _layer(config, key)
    h = jax.random.normal(jax.random.fold_in(key, 2), (3, 5, config.dim))
    w, e = route(h.reshape(-1, config.dim), p["gate"], p["gate_bias"], config=config)
    w_ref, e_ref = route_reference(h.reshape(-1, config.dim), p["gate"], p["gate_bias"],
                                   config=config)
    np.testing.assert_array_equal(e, e_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-7)
    got = jax.jit(lambda h, p: moe_mlp(h, p, config=config,
                                       implementation=implementation))(h, p)
    want = moe_mlp_reference(h, p, config=config)
    assert got.shape == h.shape and got.dtype == h.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lowest_group_and_expert():
    # A zero router scores every expert sigmoid(0) = 0.5; with no bias all 8 experts and all 4
    # groups tie, so groups 0, 1 and then experts 0, 1 win. Weights 0.5 / (0.5 + 0.5) * 2.5.
    p = _layer(MOE, jax.random.key(0), bias_scale=0.0)
    p["gate"] = jnp.zeros_like(p["gate"])
    h = jnp.ones((2, MOE.dim))
    for fn in (route, route_reference):
        w, e = fn(h, p["gate"], p["gate_bias"], config=MOE)
        np.testing.assert_array_equal(e, [[0, 1], [0, 1]])
        np.testing.assert_array_equal(w, [[1.25, 1.25], [1.25, 1.25]])
    # Experts 3 and 5 tie at the top (biased 0.5 + 0.25) in groups 1 and 2; the rest tie lower.
    p["gate_bias"] = jnp.zeros(8).at[3].set(0.25).at[5].set(0.25)
    for fn in (route, route_reference):
        _, e = fn(h, p["gate"], p["gate_bias"], config=MOE)
        np.testing.assert_array_equal(e, [[3, 5], [3, 5]])
    np.testing.assert_allclose(moe_mlp(h, p, config=MOE), moe_mlp_reference(h, p, config=MOE),
                               rtol=1e-5, atol=1e-5)


def test_group_limiting_and_the_bias_selects_only():
    # Every score is 0.5 (zero router); the bias decides. Biased scores per group of two:
    # g0 [1.4, 0.5] (top-2 sum 1.9), g1 [1.0, 1.0] (2.0), g2 and g3 [0.5, 0.5] (1.0).
    # One group allowed: g1, so experts 2, 3 although expert 0 scores highest; one group of
    # eight (no limit): experts 0 and then 2 (ties with 3: lower index).
    config = MOE.replace(topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    p = _layer(config, jax.random.key(0), bias_scale=0.0)
    p["gate"] = jnp.zeros_like(p["gate"])
    p["gate_bias"] = jnp.array([0.9, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    h = jnp.ones((1, config.dim))
    ungrouped = config.replace(n_group=1)
    for fn in (route, route_reference):
        w, e = fn(h, p["gate"], p["gate_bias"], config=config)
        np.testing.assert_array_equal(e, [[2, 3]])
        np.testing.assert_array_equal(w, [[0.5, 0.5]])  # the unbiased scores weigh
        _, e = fn(h, p["gate"], p["gate_bias"], config=ungrouped)
        np.testing.assert_array_equal(e, [[0, 2]])


def test_dispatch_touches_routed_rows_not_every_expert():
    # 6 tokens x top-2 = 12 routed rows of X = 8 experts. ragged_dot: three ragged dots over the
    # 12 sorted rows. tiles: one loop whose matmuls are [TILE_ROWS, E] @ [E, M] of one expert.
    # Neither forms a product of every token with every expert.
    p = _layer(MOE, jax.random.key(0))
    h = jnp.ones((6, MOE.dim))
    x, m, e = MOE.n_routed_experts, MOE.moe_hidden, MOE.dim
    ragged = str(jax.make_jaxpr(
        lambda h, p: moe_mlp(h, p, config=MOE, implementation="ragged_dot"))(h, p))
    assert ragged.count("ragged_dot_general[") == 3
    assert f"f32[12,{m}] = ragged_dot_general" in ragged
    tiles = str(jax.make_jaxpr(lambda h, p: moe_mlp(h, p, config=MOE, implementation="tiles"))(
        h, p))
    assert "ragged_dot" not in tiles and "scan[" in tiles and "cond[" in tiles
    assert f"f32[{TILE_ROWS},{m}] = dot_general" in tiles
    for text in (ragged, tiles):
        assert f"f32[6,{x},{m}]" not in text and f"f32[{x},6,{m}]" not in text
        assert f"f32[6,{x * m}]" not in text and f"f32[{x},{e},{m}] = dot" not in text


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_match_the_reference(implementation):
    # Routing is piecewise constant, so d/dh of both paths is the same sum of expert gradients.
    p = _layer(MOE, jax.random.key(5))
    h = jax.random.normal(jax.random.key(6), (4, MOE.dim))

    def loss(fn, **kw):
        return lambda h: jnp.sum(jnp.sin(fn(h, p, config=MOE, **kw)))

    got = jax.grad(loss(moe_mlp, implementation=implementation))(h)
    want = jax.grad(loss(moe_mlp_reference))(h)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _split(p, parts):
    """p with w1 / w2 / w3 [X, ...] cut into `parts` equal slices of experts, [parts, X / parts,
    ...]: what each device of an `expert` mesh axis holds."""
    return {k: v.reshape(parts, -1, *v.shape[1:]) if k in ("w1", "w2", "w3") else v
            for k, v in p.items()}


@pytest.mark.parametrize("parts", [2, 4])
def test_expert_slices_sum_to_the_whole_bitwise(parts):
    # Tiles path (ragged_dot: to rounding). Each slice's expert_rows computes its experts' rows
    # (-0.0 elsewhere); summed over the slices (a psum over `expert`) they are the rows of all
    # experts, bit for bit. moe_mlp under vmap over the slices with axis_name EXPERT_AXIS
    # (axis_index, psum as in a shard_map) returns on every slice the unsplit moe_mlp's
    # output, bit for bit.
    config = MOE
    p = _layer(config, jax.random.key(7))
    h = jax.random.normal(jax.random.key(8), (3, 7, config.dim))
    x = h.reshape(-1, config.dim)
    _, experts = route(x, p["gate"], p["gate_bias"], config=config)
    whole = jax.jit(lambda x, p: expert_rows(x, experts, p, implementation="tiles"))(x, p)
    split = _split(p, parts)
    num_local = config.n_routed_experts // parts
    rows = [jax.jit(lambda x, q, first: expert_rows(x, experts, q, first=first,
                                                    implementation="tiles"))(
        x, {k: v[i] if k in ("w1", "w2", "w3") else v for k, v in split.items()},
        i * num_local) for i in range(parts)]
    mine = (experts.reshape(-1) // num_local)[:, None] == jnp.arange(parts)  # [N K', parts]
    for i, part in enumerate(rows):  # the other slices' rows are -0.0
        assert np.all(np.signbit(np.asarray(part)[~np.asarray(mine[:, i])]))
        assert np.all(np.asarray(part)[~np.asarray(mine[:, i])] == 0)
    total = functools.reduce(jnp.add, rows)
    np.testing.assert_array_equal(np.asarray(total).view(np.uint32),
                                  np.asarray(whole).view(np.uint32))
    want = jax.jit(lambda h, p: moe_mlp(h, p, config=config, implementation="tiles"))(h, p)
    weights = {k: 0 if k in ("w1", "w2", "w3") else None for k in split}
    got = jax.jit(jax.vmap(lambda q: moe_mlp(h, q, config=config, implementation="tiles"),
                           in_axes=(weights,), axis_name=EXPERT_AXIS))(split)
    for i in range(parts):
        np.testing.assert_array_equal(np.asarray(got[i]).view(np.uint32),
                                      np.asarray(want).view(np.uint32))
    if parts == 2:  # ragged_dot: grouped matmuls of another shape, equal to rounding
        got = jax.jit(jax.vmap(
            lambda q: moe_mlp(h, q, config=config, implementation="ragged_dot"),
            in_axes=(weights,), axis_name=EXPERT_AXIS))(split)
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [2, 4])
def test_all_to_all_dispatch_is_each_devices_own_moe(parts):
    # Tiles path. `parts` devices (a vmap with axis_name "data": its all_to_all as in a
    # shard_map), each with its own 5 tokens and 1/parts of the experts (AllToAllExperts):
    # every device's output is the unsplit moe_mlp of its own tokens. Grouped routing (4
    # groups of 2, top-2 groups), 3 experts per token: with 4 parts a device owns 2 experts
    # (C = 2 N rows per peer), with 2 parts 4 (C = 3 N). To rounding here: vmap batches the
    # devices' routing matmuls into one [parts N, E] product, which XLA:CPU rounds otherwise
    # than [N, E] (not batch-invariant); tests/sharding/test_all_to_all.py runs the real
    # per-device programs on simulated devices, bit for bit.
    config = MOE.replace(num_experts_per_tok=3)
    p = _layer(config, jax.random.key(11))
    h = jax.random.normal(jax.random.key(12), (parts, 5, config.dim))
    split = _split(p, parts)
    weights = {k: 0 if k in ("w1", "w2", "w3") else None for k in split}
    got = jax.jit(jax.vmap(
        lambda h, q: moe_mlp(h, AllToAllExperts(q, "data"), config=config,
                             implementation="tiles"),
        in_axes=(0, weights), axis_name="data"))(h, split)
    one = jax.jit(lambda h, p: moe_mlp(h, p, config=config, implementation="tiles"))
    for i in range(parts):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(one(h[i], p)), rtol=1e-5,
                                   atol=1e-6)
    assert all_to_all_capacity(5, top=3, num_local=8 // parts) == 5 * min(3, 8 // parts)


def test_all_to_all_experts_is_a_pytree_mapping():
    p = AllToAllExperts({"w1": jnp.zeros((2, 3)), "gate": jnp.ones(4)}, "data")
    assert set(p) == {"w1", "gate"} and len(p) == 2 and p["gate"].shape == (4,)
    q = jax.tree.map(lambda x: x[0], p)  # layer_slice's way
    assert isinstance(q, AllToAllExperts) and q.axis == "data" and q["w1"].shape == (3,)
    with pytest.raises(ValueError, match="p\\['w1'\\] holds 3 experts, which does not divide "
                                         "n_routed_experts=8: split the experts evenly over "
                                         "the 'data' mesh axis"):
        layer = _layer(MOE, jax.random.key(0))
        layer = {k: v[:3] if k in ("w1", "w2", "w3") else v for k, v in layer.items()}
        moe_mlp(jnp.ones((2, MOE.dim)), AllToAllExperts(layer, "data"), config=MOE)


def test_a_slice_of_experts_must_divide_them():
    p = _layer(MOE, jax.random.key(0))
    p = {k: v[:3] if k in ("w1", "w2", "w3") else v for k, v in p.items()}
    with pytest.raises(ValueError) as err:
        moe_mlp(jnp.ones((2, MOE.dim)), p, config=MOE)
    assert str(err.value) == ("p['w1'] holds 3 experts, which does not divide "
                              "n_routed_experts=8: give moe_mlp all the experts, or an equal "
                              "slice of them per device of the 'expert' mesh axis")


def test_implementation_resolves_by_backend_and_refuses_unknown_names():
    expected = "tiles" if jax.default_backend() == "cpu" else "ragged_dot"
    assert resolve_implementation(None) == expected
    with pytest.raises(ValueError, match=r"MoE implementation='pallas' is not one of "
                                         r"\('ragged_dot', 'tiles'\)"):
        resolve_implementation("pallas")


def test_param_shapes_split_dense_and_moe_layers():
    shapes = param_shapes(MOE)
    assert "w1" not in shapes["layers"]
    assert shapes["dense_mlp"]["w1"] == (1, MOE.dim, MOE.mlp_hidden)
    assert shapes["moe"]["w2"] == (3, 8, 16, MOE.dim)
    assert shapes["moe"]["shared_w1"] == (3, MOE.dim, 16)
    params = init_params(MOE, jax.random.key(0))
    check_params(params, MOE)
    assert params["moe"]["gate_bias"].dtype == jnp.float32
    assert param_bytes(MOE) == sum(a.nbytes for a in jax.tree.leaves(params))
    all_moe = MOE.replace(first_k_dense_replace=0)
    assert "dense_mlp" not in param_shapes(all_moe)


def _prefill(config, params, tokens):
    state = resident.ResidentState.create(config, batch=tokens.shape[0], capacity=32)
    logits, _ = resident.prefill(params, state, tokens, np.full(tokens.shape[0], tokens.shape[1]),
                                 config=config)
    return logits


def test_all_dense_moe_config_is_the_dense_model_bitwise():
    # first_k_dense_replace = L: no MoE layer; the dense weights move to dense_mlp/ only.
    config = TINY.replace(max_seq_len=64, num_layers=2, indexer_layers=(0,))
    params = init_params(config, jax.random.key(1))
    moe_config = config.replace(n_routed_experts=4, num_experts_per_tok=2, moe_hidden=8,
                                first_k_dense_replace=config.num_layers)
    moved = dict(params, layers=dict(params["layers"]))
    moved["dense_mlp"] = {k: moved["layers"].pop(k) for k in ("w1", "w2", "w3")}
    check_params(moved, moe_config)
    tokens = np.arange(20, dtype=np.int32).reshape(2, 10)
    np.testing.assert_array_equal(_prefill(moe_config, moved, tokens),
                                  _prefill(config, params, tokens))


def test_model_with_moe_layers_matches_the_reference_mlp(monkeypatch):
    # One indexer group of layers 0-2: the layer loop runs layer 0 dense and layers 1-2 (MoE)
    # through moe_mlp; the dense-mask reference changes the logits by float32 rounding only.
    config = MOE.replace(max_seq_len=64, num_layers=3, indexer_layers=(0,))
    params = init_params(config, jax.random.key(2))
    params["moe"]["gate_bias"] = jax.random.normal(jax.random.key(3), (2, 8)) * 0.1
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) * 7 % config.vocab_size
    got = _prefill(config, params, tokens)
    monkeypatch.setattr(importlib.import_module("fo_jax.model.forward"), "moe_mlp",
                        moe_mlp_reference)
    jax.clear_caches()  # the jitted prefill traced moe_mlp
    want = _prefill(config, params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(n_routed_experts=6, n_group=4), "n_group=4 must be >= 1 and divide n_routed_experts=6"),
    (dict(n_group=8, topk_group=2), "n_group=8 leaves 1 expert per group"),
    (dict(topk_group=5), "topk_group=5 must be in [1, n_group=4]"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be in [1, 4]"),
    (dict(moe_hidden=0), "moe_hidden=0 must be >= 1 with n_routed_experts=8"),
    (dict(first_k_dense_replace=5), "first_k_dense_replace=5 must be <= num_layers=4"),
    (dict(n_routed_experts=0), "num_experts_per_tok=2, moe_hidden=16, n_shared_experts=1, "
                               "first_k_dense_replace=1 describe MoE layers but"),
])
def test_bad_moe_configs_are_refused(change, message):
    with pytest.raises(ValueError) as err:
        MOE.replace(**change)
    assert message in str(err.value)

"""fo_jax.training: parity with resident prefill, the indexer KL, stop-gradient, corpus split,
a few steps that learn, checkpoint round trip."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import resident, training
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.weights import load_params, params_equal, save_params

CFG = get_config("tiny").replace(vocab_size=training.VOCAB_SIZE)
# Two layers in two groups: the gradient and step tests compile in seconds.
SMALL = CFG.replace(num_layers=2, indexer_layers=(0, 1), dim=32, mlp_hidden=64)


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0)(CFG, jax.random.PRNGKey(0))


@pytest.mark.parametrize("stage", training.STAGES)
def test_forward_matches_resident_prefill(params, stage):
    # T = 24 > top-k 16: the sparse stage really selects. A float32 cache: the two programs
    # compute the KV rows in other orders, and with a bfloat16 cache a last-bit difference can
    # round a row to the neighbouring bfloat16 value (2**-8 relative), which moved logits by
    # 3e-3 on one CPU (an AMD EPYC; 0 on others). In float32 they agree to the tolerance.
    config = CFG.replace(kv_dtype="float32")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 24), 0, 256)
    got, _ = jax.jit(lambda p, t: training.train_forward(p, t, config=config, stage=stage))(
        params, tokens)
    state = resident.ResidentState.create(config, batch=2, capacity=32)
    want, _ = resident.prefill(params, state, tokens, config=config, dense=stage == "dense",
                               query_block=None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_indexer_kl_hand_made():
    # One query, 3 keys of which the last is masked out (causal).
    # target [1, 3, 99] -> p = [0.25, 0.75] over the mask; scores [0, ln 3] -> q = [0.25, 0.75]
    # -> KL 0. With scores [0, 0]: q = [0.5, 0.5],
    # KL = 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5) = 0.25 ln 0.5 + 0.75 ln 1.5 = 0.130812.
    mask = jnp.array([[[True, True, False]]])
    target = jnp.array([[[1.0, 3.0, 99.0]]])
    same = training.indexer_kl(jnp.array([[[0.0, math.log(3.0), 7.0]]]), target, mask)
    flat = training.indexer_kl(jnp.array([[[0.0, 0.0, 7.0]]]), target, mask)
    assert float(same) == pytest.approx(0.0, abs=1e-6)
    assert float(flat) == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-5)
    assert float(flat) == pytest.approx(0.130812, abs=1e-6)


@pytest.fixture(scope="module")
def small_params():
    return jax.jit(init_params, static_argnums=0)(SMALL, jax.random.PRNGKey(0))


@pytest.mark.parametrize("stage", training.STAGES)
def test_indexer_loss_moves_only_the_indexer(small_params, stage):
    tokens = jax.random.randint(jax.random.PRNGKey(2), (1, 21), 0, 256)
    grads, lm_grads = jax.jit(lambda p: (
        jax.grad(lambda q: training.losses(q, tokens, config=SMALL, stage=stage)[1])(p),
        jax.grad(lambda q: training.losses(q, tokens, config=SMALL, stage=stage)[0])(p)))(
            small_params)
    for name, g in {**grads["layers"], "embed": grads["embed"], "head": grads["head"]}.items():
        assert not np.any(np.asarray(g)), name
    assert any(np.any(np.asarray(g)) for g in grads["indexer"].values())
    assert not any(np.any(np.asarray(g)) for g in lm_grads["indexer"].values())
    assert np.any(np.asarray(lm_grads["layers"]["wq_a"]))


def test_split_is_deterministic_and_disjoint():
    files = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(20)]
    train, held = training.split_files(files)
    assert (train, held) == training.split_files(list(reversed(files)))
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(files)
    assert 0 < len(held) < 0.15 * len(files)
    assert training.is_held_out("json/decoder.py") == training.is_held_out("json/decoder.py")


def test_stdlib_stream_and_codec():
    files = training.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    stream = training.load_split(files[:3], max_bytes=10_000)
    assert stream[0] == training.SEP and stream.max() <= training.SEP
    assert training.decode(training.encode("def f():\n\tpass é")) == "def f():\n\tpass é"


def test_a_few_steps_reduce_the_loss(small_params):
    # Dense steps only (the sparse stage's steps run in the script's smoke test).
    tc = training.TrainConfig(dense_steps=6, sparse_steps=0, batch=2, seq_len=20, peak_lr=1e-2,
                              warmup_steps=1)
    opt = training.make_optimizer(tc)
    batch = jnp.asarray(training.sample_batch(
        training.encode("abcabcabdabcabcabd" * 4), 2, 20, np.random.default_rng(0)))
    p, state = small_params, jax.jit(opt.init)(small_params)
    seen = []
    for step in range(tc.total_steps):
        p, state, (lm, idx, gnorm) = training.train_step(p, state, batch, config=SMALL,
                                                         stage="dense", optimizer=opt)
        seen.append(float(lm))
    assert all(np.isfinite(seen))
    assert seen[-1] < 0.7 * seen[0]


def test_checkpoint_round_trip_is_bitwise(params, tmp_path):
    path = tmp_path / "w.safetensors"
    save_params(path, params, CFG)
    assert params_equal(load_params(path, CFG), params)

"""Sampling (fo_jax.sampling): one implementation for the simple loop, the decode loop and the
engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax.sampling import Sampling, sample, sample_tokens


def test_sample_greedy_and_top_p():
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), temperature=0.0,
                                         top_p=1.0), [1, 0])
    # top_p small: only the most likely token survives, whatever the key.
    for seed in range(5):
        got = sample(logits, jax.random.key(seed), temperature=1.0, top_p=0.05)
        np.testing.assert_array_equal(got, [1, 0])
    # top_p = 0.8 keeps {1, 2} for row 0 (0.6 + 0.3 reaches it), never token 0.
    draws = np.stack([sample(logits, jax.random.key(s), temperature=1.0, top_p=0.8)
                      for s in range(60)])
    assert set(draws[:, 0]) == {1, 2}
    assert set(draws[:, 1]) <= {0, 2}


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 0.9), (1.0, 1.0), (1.3, 0.5)])
def test_sample_is_sample_tokens_with_one_setting_for_all(temperature, top_p):
    """`sample` (one setting, static) and `sample_tokens` (per-request settings, one key for the
    batch) draw the same tokens bit for bit: one sampler, not two."""
    logits = jax.random.normal(jax.random.key(1), (6, 300)) * 3
    settings = Sampling.create(6, temperature=temperature, top_p=top_p)
    for seed in range(4):
        key = jax.random.key(seed)
        _, sub = jax.random.split(key)
        tokens, _ = sample_tokens(logits, key, settings)
        np.testing.assert_array_equal(sample(logits, sub, temperature=temperature, top_p=top_p),
                                      tokens)

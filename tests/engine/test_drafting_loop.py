"""Drafts inside the jitted decode loop (fo_jax.engine.loop, fo_jax.engine.engine): the device
n-gram drafter proposes what the host NGramDrafter proposes; a loop with drafts yields the
tokens of host-driven drafting (`fo_jax.generate.generate(..., draft="ngram")`) and of W = 1
greedy decoding, in fewer steps; an engine with drafts gives every request the tokens it gets
alone in the same engine, bit for bit, and never yields past max_tokens or a stop token."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax.config import get_config
from fo_jax.drafting import NGramDrafter, ngram_drafts
from fo_jax.engine.engine import Engine
from fo_jax.engine.loop import OffloadedStep, ResidentStep, Sampling, Seats, decode_loop
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

# Two layers sharing one indexer, top-4, W <= 3: small programs. Seats of 32 tokens.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=3,
                                    index_topk=4)
CAPACITY = 32
DRAFTS = 2
# Prompts whose greedy continuations repeat (found by trying [t] * k prompts on this model:
# 44 44 44 ... and 161 40 161 40 ...), so the n-gram drafts are accepted. Random prompts'
# continuations rarely repeat within a few tokens on random weights.
PROMPTS = [[96] * 5, [208] * 7]


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _offload():
    return OffloadConfig(hot_slots=12, page_size=4, capacity=CAPACITY, policy="ring")


@pytest.mark.parametrize("ngram", [(1, 3), (2, 2), (1, 1), (2, 4)])
def test_device_drafter_equals_the_host_drafter(ngram):
    """Random histories over a 4-token vocabulary (many matches, at every n), garbage past each
    history's length; 1 and 3 drafts (continuations cut at the history's end, filled)."""
    lo, hi = ngram
    rng = np.random.default_rng(hi)
    histories = rng.integers(0, 4, (48, 20)).astype(np.int32)
    lengths = rng.integers(1, 21, 48)
    drafter = NGramDrafter(max_ngram=hi, min_ngram=lo)
    for num_drafts in (1, 3):
        got = ngram_drafts(jnp.asarray(histories), jnp.asarray(lengths), num_drafts,
                           max_ngram=hi, min_ngram=lo)
        want = drafter.propose([h[:n] for h, n in zip(histories, lengths)], num_drafts)
        np.testing.assert_array_equal(np.asarray(got), want)


def _generate(path, max_new, **kwargs):
    engine = (gen.ResidentEngine(_params(), CONFIG, batch=2, capacity=CAPACITY)
              if path == "resident" else
              gen.OffloadEngine(_params(), CONFIG, offload=_offload(), batch=2))
    return gen.generate(engine, PROMPTS, max_new_tokens=max_new, **kwargs)


@pytest.mark.parametrize("path", ["resident", "ring"])
def test_loop_with_drafts_yields_the_greedy_tokens_in_fewer_steps(path):
    max_new = 12
    want_w1 = _generate(path, max_new).tokens
    host = _generate(path, max_new, draft="ngram", num_drafts=DRAFTS)
    np.testing.assert_array_equal(host.tokens, want_w1)  # no near-tie on these prompts
    # The same prefill, then the device loop with drafts: 4 steps per call.
    engine = (gen.ResidentEngine(_params(), CONFIG, batch=2, capacity=CAPACITY)
              if path == "resident" else
              gen.OffloadEngine(_params(), CONFIG, offload=_offload(), batch=2))
    tokens, lengths = gen.pad_prompts(PROMPTS)
    first = np.asarray(jnp.argmax(engine.prefill(tokens, lengths), axis=-1), np.int32)
    sampling = Sampling.create(2, max_new_tokens=max_new)
    seats = Seats.create(first, jax.random.key(0), sampling=sampling, lengths=lengths,
                         capacity=CAPACITY)
    history = np.zeros((2, CAPACITY), np.int32)
    for b, p in enumerate(PROMPTS):
        history[b, :len(p) + 1] = p + [int(first[b])]
    history = jnp.asarray(history)
    state = engine.state
    step = ResidentStep(CONFIG) if path == "resident" else OffloadedStep(CONFIG, _offload())
    got = [[int(t)] for t in first]
    steps = accepted = proposed = 0
    while not bool(np.all(np.asarray(seats.done))):
        out, state, seats = decode_loop(_params(), state, seats, 4, sampling, step=step,
                                        num_drafts=DRAFTS, history=history)
        history = out.history
        toks = np.asarray(out.tokens)
        assert toks.shape == (2, 4 * (DRAFTS + 1))
        for b in range(2):
            row = toks[b][toks[b] >= 0]
            assert len(row) == int(out.fed[b])
            got[b] += row.tolist()
        steps += int(out.num_steps)
        accepted += int(np.sum(out.accepted))
        proposed += int(np.sum(out.proposed))
    np.testing.assert_array_equal(np.asarray(got), want_w1)
    np.testing.assert_array_equal(np.asarray(got), host.tokens)
    # Every token after the prefill's came from a step; drafts make the steps fewer.
    assert accepted > 0
    assert steps < max_new - 1
    assert proposed >= DRAFTS * steps
    print(f"{path}: {steps} steps for {max_new - 1} tokens per request "
          f"({steps / (max_new - 1):.2f} steps/token), {accepted}/{proposed} drafts accepted")
    np.testing.assert_array_equal(np.asarray(state.lengths),
                                  lengths + max_new - 1)


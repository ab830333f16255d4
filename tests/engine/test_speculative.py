"""Speculative sampling in the decode loop (fo_jax.sampling.speculative_tokens): a request at
temperature > 0 accepts a draft d with probability p(d) and on the first rejection samples the
residual (p with d removed), so its tokens follow the nucleus distribution token by token;
greedy rows are untouched; in the engine a sampled request's tokens equal its run alone, bit
for bit, and its drafts count in draft_accepted / draft_proposed."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax.config import get_config
from fo_jax.engine.engine import Engine
from fo_jax.sampling import Sampling, speculative_tokens
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

# The distribution checks: V = 6 tokens, W = 3 ways (2 drafts), temperature 0.7, top_p 0.9 (the
# nucleus drops the least likely token or two). L0: the first token's logits; L1[t]: the
# second token's after t (a toy model: the target process is x1 ~ p(L0), x2 ~ p(L1[x1])).
VOCAB, TEMPERATURE, TOP_P = 6, 0.7, 0.9
L0 = np.array([0.67, 1.36, -0.10, 0.39, 0.94, 0.23], np.float32)  # p0 ~ .16 .42 0 .1 .23 .08
L1 = np.random.default_rng(5).normal(0.0, 0.6, (VOCAB, VOCAB)).astype(np.float32)
SAMPLES = 30_000


def _nucleus_probs(logits):
    """The distribution `_nucleus` samples from, in float64: softmax(l / T) over the smallest
    set of most likely tokens whose mass reaches top_p, renormalized."""
    scaled = np.asarray(logits, np.float64) / TEMPERATURE
    order = np.argsort(-scaled)
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept = np.zeros(VOCAB)
    kept[order[before < TOP_P]] = np.exp(scaled[order[before < TOP_P]])
    return kept / kept.sum()


P0 = _nucleus_probs(L0)
P1 = np.stack([_nucleus_probs(row) for row in L1])
JOINT = P0[:, None] * P1  # [x1, x2]: the target's first two tokens


@jax.jit
def _speculate(fed, logits, keys):
    sampling = Sampling(temperature=jnp.full(fed.shape[:1], TEMPERATURE, jnp.float32),
                        top_p=jnp.full(fed.shape[:1], TOP_P, jnp.float32),
                        stop_tokens=jnp.full((fed.shape[0], 1), -1, jnp.int32),
                        max_new_tokens=jnp.full(fed.shape[:1], 2**30, jnp.int32))
    return speculative_tokens(fed, logits, keys, sampling,
                                          jnp.ones(fed.shape[:1], bool))


def _two_tokens(drafts, keys):
    """The first two tokens of SAMPLES requests that draft `drafts` (d1, d2) at every step:
    step 1 feeds [x0, d1, d2] with the logits L0, L1[d1], L1[d2] (way 2's are the toy's stand-in:
    only x1 and x2 are checked); a request that accepted d1 has x2 from step 1, else step 2
    feeds [x1, d1, d2] with L1[x1] at way 0. Returns (x1, x2, accepted drafts at step 1)."""
    n = SAMPLES
    d1, d2 = drafts
    fed = jnp.asarray(np.tile([0, d1, d2], (n, 1)), jnp.int32)
    logits = jnp.asarray(np.tile(np.stack([L0, L1[d1], L1[d2]]), (n, 1, 1)))
    tokens, accepted, keys = _speculate(fed, logits, keys)
    x1 = np.asarray(tokens[:, 0])
    fed2 = fed.at[:, 0].set(tokens[:, 0])
    logits2 = jnp.asarray(np.stack([L1[x1], np.tile(L1[d1], (n, 1)), np.tile(L1[d2], (n, 1))],
                                   axis=1))
    tokens2, _, _ = _speculate(fed2, logits2, keys)
    accepted = np.asarray(accepted)
    x2 = np.where(accepted >= 1, np.asarray(tokens[:, 1]), np.asarray(tokens2[:, 0]))
    return x1, x2, accepted


def _chi_square(counts, probs):
    """(Pearson statistic over the cells of nonzero probability, degrees of freedom, the
    counts of cells of probability 0)."""
    counts, probs = np.ravel(counts).astype(np.float64), np.ravel(probs)
    live = probs > 0
    expected = counts.sum() * probs[live]
    return (float(np.sum((counts[live] - expected) ** 2 / expected)), int(live.sum()) - 1,
            int(counts[~live].sum()))


def _bound(df):
    """df + 8 standard deviations of a chi-square of df degrees of freedom: a correct sampler
    exceeds it with probability 1.6e-6 at df = 10, 1.7e-7 at 19, 1.7e-8 at 36 (the chi-square
    tail), and the keys are fixed, so a run that passes always passes."""
    return df + 8 * np.sqrt(2 * df)


# (d1, d2): the most likely first token and its most likely follower (accepted most often),
# a middling one, and one outside the first token's nucleus (p0(d1) = 0: never accepted).
DRAFTS = {"likely": (1, int(np.argmax(L1[1]))), "middling": (3, 0),
          "outside_nucleus": (int(np.argmin(L0)), 4)}


def test_the_check_catches_wrong_rules():
    """The toy is sharp enough: p0 keeps 5 tokens, the drafts' probabilities are away from 0
    and 1, and the chi-square a wrong rule would score at SAMPLES draws (N times the
    chi-square divergence of its first token's law) is far above the bound: accepting every
    draft, or resampling from p (not the residual) after a rejection."""
    assert np.count_nonzero(P0) == VOCAB - 1 and P0[DRAFTS["outside_nucleus"][0]] == 0
    assert 0.3 < P0[1] < 0.6 and 0.05 < P0[3] < 0.3
    df = np.count_nonzero(JOINT) - 1
    for d1, _ in DRAFTS.values():
        always = np.eye(VOCAB)[d1]
        resample = P0[d1] * np.eye(VOCAB)[d1] + (1 - P0[d1]) * P0
        for wrong in (always, resample):
            if np.allclose(wrong, P0):
                continue
            live = P0 > 0
            divergence = np.sum((wrong[live] - P0[live]) ** 2 / P0[live]) + (
                np.inf if wrong[~live].sum() else 0)
            assert SAMPLES * divergence > 20 * _bound(df), (d1, SAMPLES * divergence)


@pytest.mark.parametrize("keys", ["per_request", "batch"])
@pytest.mark.parametrize("drafts", DRAFTS)
def test_speculative_tokens_follow_the_nucleus_distribution(drafts, keys):
    """The first two tokens over SAMPLES keys: their joint law is p0(x1) p1(x2 | x1) (Pearson
    chi-square under an 8-sigma bound; no draw where the target has probability 0), and a
    draft is accepted at the rate p0(d1)."""
    seed = list(DRAFTS).index(drafts)
    keys = (jax.random.split(jax.random.key(seed), SAMPLES) if keys == "per_request"
            else jax.random.key(seed))
    x1, x2, accepted = _two_tokens(DRAFTS[drafts], keys)
    if keys.ndim == 0:  # one key for the batch: the rows still draw independently
        assert len(set(zip(x1[:64].tolist(), x2[:64].tolist()))) > 4
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (x1, x2), 1)
    stat, df, impossible = _chi_square(counts, JOINT)
    assert impossible == 0
    assert stat < _bound(df), (stat, df)
    stat1, df1, _ = _chi_square(np.bincount(x1, minlength=VOCAB), P0)
    assert stat1 < _bound(df1), (stat1, df1)
    d1 = DRAFTS[drafts][0]
    rate, want = float(np.mean(accepted >= 1)), P0[d1]
    assert abs(rate - want) < 6 * np.sqrt(want * (1 - want) / SAMPLES) + 1e-9, (rate, want)
    # A token yielded after an accepted draft is the draft; a rejection never yields it.
    np.testing.assert_array_equal(x1 == d1, accepted >= 1)


_speculative_tokens = jax.jit(speculative_tokens)


def _greedy_reference(fed, logits):
    """The greedy rule in numpy: the longest prefix of drafts equal to the previous way's
    argmax, then the next argmax: (tokens [B, W], accepted [B])."""
    g = np.argmax(logits, axis=-1)
    agree = np.cumprod(fed[:, 1:] == g[:, :-1], axis=1)
    return g, agree.sum(axis=1)


def test_greedy_rows_are_unchanged_next_to_sampled_ones():
    """Rows 0-3 greedy, 4-5 sampled: the greedy rows take the greedy rule's tokens and accepted
    drafts bit for bit, as in an all-greedy batch (where the sort is skipped); active rows
    advance their key once (split, as without drafts), an inactive row's key stays."""
    rng = np.random.default_rng(0)
    batch, ways, vocab = 6, 3, 16
    logits = rng.normal(size=(batch, ways, vocab)).astype(np.float32)
    g = np.argmax(logits, axis=-1)
    fed = rng.integers(0, vocab, (batch, ways)).astype(np.int32)
    fed[0, 1:] = g[0, :2]  # both drafts confirmed
    fed[1, 1] = g[1, 0]  # the first only
    fed[4, 1:] = g[4, :2]
    want_tokens, want_accepted = _greedy_reference(fed, logits)
    keys = jax.random.split(jax.random.key(3), batch)
    active = jnp.asarray([True, True, True, False, True, True])
    for temperature in ([0, 0, 0, 0, 0.8, 1.0], [0.0] * batch):
        sampling = Sampling.create(batch, temperature=temperature, top_p=0.9)
        tokens, accepted, new_keys = _speculative_tokens(jnp.asarray(fed), jnp.asarray(logits),
                                                         keys, sampling, active)
        np.testing.assert_array_equal(np.asarray(tokens)[:4], want_tokens[:4])
        np.testing.assert_array_equal(np.asarray(accepted)[:4], want_accepted[:4])
        assert list(np.asarray(accepted)[:3]) == [2, 1, 0]
        split = jax.vmap(jax.random.split)(keys)[:, 0]
        want_keys = np.where(np.asarray(active)[:, None], jax.random.key_data(split),
                             jax.random.key_data(keys))
        np.testing.assert_array_equal(jax.random.key_data(new_keys), want_keys)
    # The sampled rows yield their accepted drafts, then one token of the nucleus.
    sampling = Sampling.create(batch, temperature=[0, 0, 0, 0, 0.8, 1.0], top_p=0.9)
    tokens, accepted, _ = _speculative_tokens(jnp.asarray(fed), jnp.asarray(logits), keys,
                                              sampling, active)
    for b in (4, 5):
        a = int(accepted[b])
        assert 0 <= a <= ways - 1
        np.testing.assert_array_equal(np.asarray(tokens)[b, :a], fed[b, 1:a + 1])
        assert 0 <= int(tokens[b, a]) < vocab


# The engine ----------------------------------------------------------------------------------

# As tests/engine/test_drafting_loop.py: two layers sharing one indexer, top-4, W <= 3.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=3,
                                    index_topk=4, kv_dtype="float32")
CAPACITY = 32
NUM_DRAFTS = 2

# (prompt, max_tokens, temperature, seed, stop ids, arrival step). At temperature 0.3 the
# repeating prompts' continuations are peaked (the most likely token ~0.8 on this model), so
# drafts are accepted and rejected; at 1.0 the random prompt's are flat (few accepted).
REQUESTS = [
    ([96] * 5, 12, 0.3, 1, (), 0),
    ([208] * 7, 12, 0.3, 2, (40,), 0),
    ([100, 219, 141] * 3, 8, 0.0, 0, (), 1),
    ([17, 4, 230, 9, 41], 6, 1.0, 3, (), 1),
]


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _engine(path):
    offload = None if path == "resident" else OffloadConfig(hot_slots=12, page_size=4,
                                                            capacity=CAPACITY, policy="ring")
    pages = {} if offload is None else dict(num_pages=16)
    return Engine(_params(), CONFIG, seats=3, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=2, prefill_chunk=8, query_block=None,
                  num_drafts=NUM_DRAFTS, **pages)


def _add(engine, i):
    prompt, max_tokens, temperature, seed, stops, _ = REQUESTS[i]
    return engine.add_request(prompt, max_tokens=max_tokens, temperature=temperature,
                              seed=seed, stop_token_ids=stops)


@functools.cache
def _alone(path, i):
    """(tokens, finish reason, counters) of request i served alone."""
    engine = _engine(path)
    rid = _add(engine, i)
    out = engine.run()[rid]
    return tuple(out.token_ids), out.finish_reason, dict(engine.counters)


@pytest.mark.parametrize("path", ["resident", "ring"])
def test_a_sampled_request_with_drafts_gets_its_tokens_alone(path):
    """Staggered arrivals into 3 seats (the fourth request waits for a seat): every request's
    tokens equal its run alone in the same engine and, offloaded, the resident engine's, bit
    for bit; a sampled request alone counts every step's drafts as proposed and the drafts it
    yielded as accepted (each step yields its accepted drafts + 1 token)."""
    engine = _engine(path)
    ids, step = {}, 0
    while len(ids) < len(REQUESTS) or engine.has_unfinished():
        for i, request in enumerate(REQUESTS):
            if request[-1] == step:
                ids[i] = _add(engine, i)
        engine.step()
        step += 1
        assert step < 100
    outputs = engine.run()
    for i, rid in ids.items():
        got = (tuple(outputs[rid].token_ids), outputs[rid].finish_reason)
        assert got == _alone(path, i)[:2], i
        assert got == _alone("resident", i)[:2], i
    for i in (0, 1, 3):
        c = _alone(path, i)[2]
        assert c["draft_proposed"] == NUM_DRAFTS * c["decode_steps"], i
        assert c["draft_accepted"] == c["decode_tokens"] - c["decode_steps"], i
    c = _alone(path, 0)[2]
    assert c["draft_accepted"] > 0 and c["decode_steps"] < c["decode_tokens"]
    c = engine.counters
    assert 0 < c["draft_accepted"] < c["draft_proposed"]
    print(f"{path}: {c['decode_steps']} decode steps for {c['decode_tokens']} tokens, "
          f"{c['draft_accepted']}/{c['draft_proposed']} drafts accepted")
    if path != "resident":
        assert engine.pool_occupancy()["held"] == 0

"""Speculative sampling in the host `generate` (a drafter at temperature > 0): the rule of the
decode loop (`fo_jax.sampling.speculative_tokens`), so a request's tokens follow the nucleus
distribution token by token. (Offloaded equals resident bit for bit: tests/test_drafting.py;
MTP drafts: tests/test_mtp_drafting.py.)"""

import functools

import jax
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params

# As tests/test_drafting.py: one indexer group of two layers, max_ways 4.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), index_topk=8)

# The distribution check: SAMPLES copies of PROMPT in one generation (one key for the batch:
# the rows draw independently), NEW = 3 tokens each. At temperature 0.2 / top_p 0.75 this
# model's nuclei keep 1 to 4 tokens, so the law of (x0, x1, x2) has 22 cells.
PROMPT = [5, 17, 99, 3, 41, 200]
TEMPERATURE, TOP_P = 0.2, 0.75
SAMPLES = 2000
NEW = 3


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _nucleus_probs(logits):
    """The distribution `sample` draws from, in float64: softmax(l / T) over the smallest set
    of most likely tokens whose mass reaches top_p, renormalized; and the distance of the
    nucleus cut to top_p (a near-tie there could make float32 keep another set)."""
    scaled = np.asarray(logits, np.float64) / TEMPERATURE
    order = np.argsort(-scaled)
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept = np.zeros(scaled.shape)
    kept[order[before < TOP_P]] = probs[before < TOP_P]
    return kept / kept.sum(), float(np.min(np.abs(before - TOP_P)))


def _engine():
    return gen.ResidentEngine(_params(), CONFIG, batch=SAMPLES, capacity=len(PROMPT) + NEW)


@functools.cache
def _exact():
    """(law [V, V, V] of the first three tokens, p1 {x0: [V]}, p2 {(x0, x1): [V]}, the
    smallest distance of a nucleus cut to top_p), from the logits of the programs the
    generation runs: the prefill of PROMPT, then W = 2 steps feeding rows [x0, x1] (way 0:
    the logits after x0, way 1: after x1), each rolled back."""
    engine = _engine()
    first = np.asarray(engine.prefill(*gen.pad_prompts([PROMPT] * SAMPLES)))[0]

    def after(rows):  # logits [R, 2, V] of one step feeding rows [R, 2]
        fed = np.zeros((SAMPLES, 2), np.int32)
        fed[:len(rows)] = rows
        logits = np.asarray(engine.step(fed))[:len(rows)]
        engine.rollback(np.zeros(SAMPLES, np.int64))
        return logits

    p0, margin = _nucleus_probs(first)
    support0 = np.flatnonzero(p0)
    p1, pairs = {}, []
    for a, row in zip(support0, after([[a, 0] for a in support0])[:, 0]):
        p1[int(a)], m = _nucleus_probs(row)
        margin = min(margin, m)
        pairs += [(int(a), int(b)) for b in np.flatnonzero(p1[int(a)])]
    law = np.zeros((CONFIG.vocab_size,) * 3)
    p2 = {}
    for (a, b), row in zip(pairs, after(pairs)[:, 1]):
        p2[a, b], m = _nucleus_probs(row)
        margin = min(margin, m)
        law[a, b] = p0[a] * p1[a][b] * p2[a, b]
    return law, p1, p2, margin


class TableDrafter:
    """Drafts the most likely continuation under the exact law (accepted about half the time
    at these settings): after x0, (argmax p1(x0), argmax p2(x0, that)); after (x0, x1),
    argmax p2(x0, x1) and then token 0."""

    name = "table"

    def __init__(self, p1, p2):
        self.p1, self.p2 = p1, p2

    def propose(self, histories, num_drafts):
        out = []
        for h in histories:
            x = [int(t) for t in h[len(PROMPT):]]
            if len(x) == 1:
                d1 = int(np.argmax(self.p1[x[0]]))
                drafts = [d1, int(np.argmax(self.p2[x[0], d1]))]
            else:
                drafts = [int(np.argmax(self.p2[x[0], x[1]])), 0]
            out.append(drafts[:num_drafts])
        return np.asarray(out, np.int32)


def _chi_square(counts, probs, least=5.0):
    """(Pearson statistic, degrees of freedom, draws in cells of probability 0), the cells of
    expected count < `least` pooled into one."""
    counts, probs = np.ravel(counts).astype(np.float64), np.ravel(probs)
    live = probs > 0
    expected = counts.sum() * probs
    small = live & (expected < least)
    cells_c = np.append(counts[live & ~small], counts[small].sum())
    cells_e = np.append(expected[live & ~small], expected[small].sum())
    if cells_e[-1] == 0:
        cells_c, cells_e = cells_c[:-1], cells_e[:-1]
    stat = float(np.sum((cells_c - cells_e) ** 2 / cells_e))
    return stat, len(cells_e) - 1, int(counts[~live].sum())


def _bound(df):
    """df + 8 standard deviations of a chi-square of df degrees of freedom: a correct sampler
    exceeds it with probability 2e-7 at df = 19 (this test's), less at larger df."""
    return df + 8 * np.sqrt(2 * df)


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_sampled_drafting_follows_the_nucleus_distribution(num_drafts):
    """The first three tokens of SAMPLES requests: their joint law is p0(x0) p1(x1 | x0)
    p2(x2 | x0, x1) (chi-square under an 8-sigma bound; no draw of probability 0). With one
    draft, step 1 tests d1 against p1 (accepted: x1 = d1 and x2 the bonus token from way 1;
    rejected: x1 from the residual); with two, x2 tests d2 against way 1's p2. A wrong rule
    is far outside the bound (always accepting the drafts scores > 10 bounds here)."""
    law, p1, p2, margin = _exact()
    assert margin > 1e-3  # no nucleus cut near a float32 tie
    drafter = TableDrafter(p1, p2)
    result = gen.generate(_engine(), [PROMPT] * SAMPLES, max_new_tokens=NEW,
                          temperature=TEMPERATURE, top_p=TOP_P, key=jax.random.key(num_drafts),
                          drafter=drafter, num_drafts=num_drafts)
    x = result.tokens
    assert x.shape == (SAMPLES, NEW)
    counts = np.zeros(law.shape)
    np.add.at(counts, (x[:, 0], x[:, 1], x[:, 2]), 1)
    stat, df, impossible = _chi_square(counts, law)
    assert impossible == 0
    assert stat < _bound(df), (stat, df)
    extra = result.extra
    assert 0.2 * extra["proposed_drafts"] < extra["accepted_drafts"] < extra["proposed_drafts"]
    # Always accepting the drafts: x1 = d1(x0) (and x2 = d2 with two drafts).
    wrong = np.zeros(law.shape)
    for a in np.flatnonzero(law.sum(axis=(1, 2))):
        d1, d2 = drafter.propose([PROMPT + [a]], 2)[0]
        p0a = law[a].sum()
        wrong[a, d1] = p0a * (np.eye(law.shape[0])[d2] if num_drafts == 2 else p2[a, d1])
    live = law > 0
    divergence = np.sum((wrong[live] - law[live]) ** 2 / law[live]) + (
        np.inf if wrong[~live].sum() else 0)
    assert SAMPLES * divergence > 10 * _bound(df)

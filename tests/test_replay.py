"""The trace-replay simulator: exact against decode_step, Belady as the bound, known answers."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fo_jax import replay, synthetic_traces, traces
from fo_jax.config import get_config
from fo_jax.offload.config import OffloadConfig

FIELDS = ("hits", "tail_hits", "misses", "union")


# Exactness against the implementation ------------------------------------------------------

# Ragged lengths at the handoff with C = 24, Z = 8: request 0 starts with an empty hot cache
# (tail_start 0), request 1 partly filled (8 of 24 slots), request 2 full (tail_start 144).
# k = 8: W = 3 fills C exactly (C = k W), W = 1 leaves 3 k.
CASES = [("ring", 1), ("ring", 3), ("lru", 2), ("random", 2), ("clock", 1), ("clock", 3)]


@pytest.mark.parametrize("policy,ways", CASES)
def test_replay_reproduces_decode_step(policy, ways, tmp_path):
    # One config for every case (W <= max_ways), so only the decode step compiles per case.
    config = get_config("tiny").replace(index_topk=8, max_ways=3)
    offload = OffloadConfig(hot_slots=24, page_size=8, capacity=256, policy=policy, seed=3)
    trace = traces.record_decode_trace(config, offload, lengths=[5, 13, 150], steps=10,
                                       ways=ways, seed=1, heavy=0.05)
    assert trace.ref_union.sum() > 0 and trace.ref_tail_hits.sum() > 0
    assert trace.ref_hits[:, :, 2].sum() > 0  # the full cache serves hits
    traces.save(tmp_path / "decode.npz", trace)
    trace = traces.load(tmp_path / "decode.npz")
    got = replay.replay(trace, hot_slots=trace.ref_hot_slots, policy=trace.ref_policy,
                        seed=trace.ref_seed)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(trace, "ref_" + name),
                                      err_msg=name)


def test_replay_reproduces_prefilled_document_decode():
    # The real-trace path: offloaded prefill of documents, the handoff, teacher-forced W-way
    # decode steps (experiments/traces/record_traces.py; the shapes of its --smoke, so one compile
    # serves both). The replay reproduces the run's stats; the recorded scores are the
    # selection's own.
    import jax

    from fo_jax.model.dsa import init_params

    config = get_config("tiny").replace(index_topk=8, max_ways=2, vocab_size=260)
    params = init_params(config, jax.random.key(0))
    offload = OffloadConfig(hot_slots=32, page_size=16, capacity=96, policy="ring",
                            host_memory_kind="device")
    docs = np.random.default_rng(0).integers(0, 256, (2, 97)).astype(np.int32)
    state, prefill_nll = traces.prefill_documents(params, config, offload, docs, prefill=80)
    assert prefill_nll.shape == (2, 80) and np.all(np.isfinite(prefill_nll))
    trace, nll = traces.record_document_trace(params, config, offload, docs, state, prefill=80,
                                              steps=8, ways=2, keep_all_scores=True)
    assert nll.shape == (2, 16) and trace.selected.shape == (8, 2, 2, 2, 8)
    assert trace.lengths[:, 0].tolist() == list(range(80, 96, 2))
    assert trace.ref_union.sum() > 0 and trace.ref_hits.sum() > 0
    got = replay.replay(trace, hot_slots=32, policy="ring")
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(trace, "ref_" + name),
                                      err_msg=name)
    # The selection is the top-k of the recorded scores; the k-th score is the smallest.
    top = np.sort(np.argsort(-trace.all_scores, axis=-1, kind="stable")[..., :8], axis=-1)
    np.testing.assert_array_equal(trace.selected, top)
    np.testing.assert_array_equal(trace.scores, np.take_along_axis(trace.all_scores,
                                                                   trace.selected, axis=-1))
    np.testing.assert_array_equal(trace.kth_score, trace.scores.min(-1))


def test_document_windows():
    docs = [np.arange(3), np.arange(10, 16), np.arange(20, 22)]
    windows, info = traces.document_windows(docs, count=2, length=8, sep=99)
    # Longest first (doc 1: 1 + 6 tokens, then doc 2 behind the separator); doc 0 next,
    # continued by doc 1.
    assert windows.tolist() == [[99, 10, 11, 12, 13, 14, 15, 99],
                                [99, 0, 1, 2, 99, 10, 11, 12]]
    assert info == [{"first": 1, "documents": 2}, {"first": 0, "documents": 2}]
    with pytest.raises(ValueError, match="4 windows need at least 4 documents, got 3"):
        traces.document_windows(docs, count=4, length=8, sep=99)


def test_document_recording_refuses_short_documents():
    offload = OffloadConfig(hot_slots=32, page_size=16, capacity=96)
    docs = np.zeros((2, 90), np.int32)
    with pytest.raises(ValueError, match=r"prefill 80 \+ 8 steps x 2 ways = 96 tokens need "
                       r"documents longer than that \(got N=90\) and offload.capacity >= 96 "
                       r"\(got 96\)"):
        traces.record_document_trace(None, None, offload, docs, None, prefill=80, steps=8,
                                     ways=2)
    with pytest.raises(ValueError, match=r"prefill=90 must be in \[1, N\) for documents of "
                       r"N=90 tokens"):
        traces.prefill_documents(None, None, offload, docs, prefill=90)


# Known answers -------------------------------------------------------------------------------

def _sequence(tokens, *, length=10, page=1, ways=1):
    """A 1-group, 1-request trace selecting one token per step (k = 1)."""
    t = len(tokens)
    sel = np.asarray(tokens, np.int32).reshape(t, 1, 1, ways, -1)
    return traces.Trace(selected=sel, lengths=np.full((t, 1), length, np.int32),
                        page_size=page)


def test_three_slots_min_beats_lru_and_ring():
    # C = 3, Z = 1, length 10: the handoff puts tokens 7, 8, 9 in slots 0, 1, 2 (tail_start 10).
    # Requests 1, 2, 7, 8, 9.
    # LRU (all slots last used at step 0, ties lower slot first): 1 evicts 7 (slot 0), 2 evicts
    #   8, 7 evicts 9, 8 evicts 1, 9 evicts 2: 5 misses. Ring (hand 0): the same slots, 5.
    # MIN: 1 evicts 9 (next use step 5, the farthest of 7 @3, 8 @4, 9 @5); 2 evicts 1 (never
    #   used again); 7 and 8 hit; 9 misses: 3 misses.
    trace = _sequence([[1], [2], [7], [8], [9]])
    union = {p: replay.replay(trace, hot_slots=3, policy=p).union[:, 0, 0].tolist()
             for p in ("lru", "ring", "belady", "hisparse")}
    assert union == {"lru": [1, 1, 1, 1, 1], "ring": [1, 1, 1, 1, 1],
                     "belady": [1, 1, 0, 0, 1], "hisparse": [1, 1, 1, 1, 1]}


def test_clock_second_chance():
    # C = 3, slots 0, 1, 2 = tokens 7, 8, 9, bits clear, hand 0. Requests 7, 1, 8, 9, 7:
    #   7 hits (bit 0 set); 1: the hand clears slot 0, evicts 8 (slot 1), hand 2;
    #   8: evicts 9 (slot 2), hand 0; 9: slot 0's bit is clear now: evicts 7, hand 1;
    #   7: bits 1, 2, 0 all set: one sweep clears them, the second pass evicts slot 1 (token 1).
    # LRU: 7 hits; 1 evicts 8 and 8 evicts 9 (last used 0); 9 evicts 7 (used at 1); 7 evicts 1.
    trace = _sequence([[7], [1], [8], [9], [7]])
    for policy in ("clock", "lru"):
        got = replay.replay(trace, hot_slots=3, policy=policy)
        assert got.union[:, 0, 0].tolist() == [0, 1, 1, 1, 1], policy
    # After the sweep the cache holds 9, 7, 8: all hit under clock.
    again = _sequence([[7], [1], [8], [9], [7], [9], [8], [7]])
    assert replay.replay(again, hot_slots=3, policy="clock").union[5:, 0, 0].tolist() == \
        [0, 0, 0]


def test_score_eviction():
    # C = 2, Z = 1, length 10: slots 0, 1 = tokens 8, 9, never scored (cold).
    # Steps select 8 (score 5), 9 (score 1), 2 (score 3), 9 (score 2).
    # score-last: 8 and 9 hit and get scores 5 and 1; 2 misses and evicts the lowest, 9 (slot
    #   1); 9 misses and evicts the lowest of 8 (5) and 2 (3): 2. Copies 0, 0, 1, 1.
    # lru: 2 evicts 8 (used at step 1, 9 at step 2); 9 hits. Copies 0, 0, 1, 0.
    trace = _sequence([[8], [9], [2], [9]])
    trace = traces.Trace(selected=trace.selected, lengths=trace.lengths, page_size=1,
                         scores=np.asarray([5, 1, 3, 2], np.float32).reshape(4, 1, 1, 1, 1))
    for policy, want in (("score-last", [0, 0, 1, 1]), ("score-max", [0, 0, 1, 1]),
                         ("lru", [0, 0, 1, 0])):
        assert replay.replay(trace, hot_slots=2, policy=policy).union[:, 0, 0].tolist() == \
            want, policy
    # Cold start: a token never scored goes before any scored one. Selecting 9 (score 1) then
    # 2 (score 3): 2 evicts the cold 8, not 9; then 8 misses again.
    cold = traces.Trace(selected=np.asarray([9, 2, 8], np.int32).reshape(3, 1, 1, 1, 1),
                        lengths=np.full((3, 1), 10, np.int32), page_size=1,
                        scores=np.asarray([1, 3, 4], np.float32).reshape(3, 1, 1, 1, 1))
    assert replay.replay(cold, hot_slots=2, policy="score-ema").union[:, 0, 0].tolist() == \
        [0, 1, 1]


def test_tail_and_protection_rules():
    # Z = 4, length 9 (tail_start 8), C = 4 (k = 2, W = 2): the handoff fills slots 0-3 with
    # tokens 4-7. Step 1: way 0 selects 8 (tail) and 4 (hit); way 1 selects 4 and 0 (miss).
    # The union is {0}; slot 0 (token 4) is protected, so ring's window 0, 1, ... gives slot 1.
    # Step 2 (length 11, tail_start 8): way 0 selects 4 and 5: 4 hits, 5 (evicted) misses.
    sel = np.asarray([[[4, 8], [0, 4]], [[4, 5], [4, 5]]], np.int32).reshape(2, 1, 1, 2, 2)
    trace = traces.Trace(selected=sel, lengths=np.asarray([[9], [11]], np.int32), page_size=4)
    got = replay.replay(trace, hot_slots=4, policy="ring")
    assert got.hits[:, 0, 0].tolist() == [[1, 1], [1, 1]]
    assert got.tail_hits[:, 0, 0].tolist() == [[1, 0], [0, 0]]
    assert got.misses[:, 0, 0].tolist() == [[0, 1], [1, 1]]
    assert got.union[:, 0, 0].tolist() == [1, 1]


def test_echo_prefetch_counts():
    # C = 2, Z = 1, length 4 (slots: tokens 2, 3), k = 2, all scores given.
    # Step 1 selects 2, 3 (k-th score 5): no prediction yet. Step 2 selects 0 and 3 (k-th 6):
    # the prediction 5 takes every non-resident token scoring >= 5: 0 (7, a miss: covered)
    # and 1 (5, not selected: wasted).
    every = np.asarray([[1, 1, 6, 5, -np.inf], [7, 5, 1, 6, -np.inf]], np.float32)
    sel = np.asarray([[2, 3], [0, 3]], np.int32).reshape(2, 1, 1, 1, 2)
    trace = traces.Trace(selected=sel, lengths=np.full((2, 1), 4, np.int32), page_size=1,
                         all_scores=every.reshape(2, 1, 1, 1, 5))
    got = replay.replay(trace, hot_slots=2, policy="ring", prefetch=True)
    assert got.union[:, 0, 0].tolist() == [0, 1]
    assert got.prefetch_covered[:, 0, 0].tolist() == [0, 1]
    assert got.prefetch_wasted[:, 0, 0].tolist() == [0, 1]


# Belady is the bound -------------------------------------------------------------------------

@st.composite
def small_traces(draw):
    steps, groups = draw(st.integers(1, 10)), draw(st.integers(1, 2))
    batch = draw(st.integers(1, 2))
    ways, k, page = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    length0 = draw(st.integers(k * ways, 20))
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    lengths = length0 + ways * np.arange(steps, dtype=np.int32)
    sel = np.full((steps, groups, batch, ways, k), -1, np.int32)
    for idx in np.ndindex(steps, groups, batch, ways):
        visible = lengths[idx[0]] + idx[3] + 1
        # Skewed toward a few tokens, so caches have something to keep.
        pool = rng.choice(visible, size=min(k, visible), replace=False,
                          p=None if rng.random() < 0.3 else _skew(visible))
        sel[idx][:len(pool)] = np.sort(pool)
    scores = np.where(sel >= 0, rng.random(sel.shape), np.nan).astype(np.float32)
    trace = traces.Trace(selected=sel, lengths=np.repeat(lengths[:, None], batch, 1),
                         page_size=page, scores=scores)
    extra = draw(st.integers(0, 3))
    return trace, k * ways + extra


def _skew(n):
    p = 1.0 / (1 + np.arange(n)) ** 1.5
    return p[::-1] / p.sum() if n % 2 else p / p.sum()


@settings(max_examples=30)
@given(small_traces())
def test_belady_never_worse(case):
    # random is left out here: its starts come from a jax.random scan compiled per shape.
    trace, hot = case
    best = replay.replay(trace, hot_slots=hot, policy="belady").union.sum(0)  # [G, B]
    for policy in set(replay.POLICIES) - {"random"}:
        got = replay.replay(trace, hot_slots=hot, policy=policy)
        assert np.all(best <= got.union.sum(0)), policy
        selected = (trace.selected >= 0).sum(-1)
        np.testing.assert_array_equal(got.hits + got.tail_hits + got.misses, selected)


# Errors and output ---------------------------------------------------------------------------

def test_errors():
    trace = _sequence([[1], [2]])
    with pytest.raises(ValueError, match=r"policy 'score-ema' evicts by indexer score but the "
                       r"trace has no scores"):
        replay.replay(trace, hot_slots=3, policy="score-ema")
    with pytest.raises(ValueError, match=r"unknown policy 'fifo'"):
        replay.replay(trace, hot_slots=3, policy="fifo")
    with pytest.raises(ValueError, match=r"hot_slots=0 < top-k \* ways = 1 \* 1 = 1"):
        replay.replay(trace, hot_slots=0, policy="ring")
    with pytest.raises(ValueError, match=r"prefetch=True needs the score of every token"):
        replay.replay(trace, hot_slots=3, prefetch=True)


def test_synthetic_kinds_and_summary():
    for kind in synthetic_traces.KINDS:
        trace = synthetic_traces.generate(kind, steps=6, context=64, topk=8, ways=2,
                                          page_size=4, keep_all_scores=True)
        assert json.loads(trace.meta)["kind"] == kind
        stats = replay.replay(trace, hot_slots=32, policy="score-ema", prefetch=True)
        row = replay.summary(stats, ways=2)
        assert 0 <= row["hit_rate"] <= 1
        # glm52: 78 layers of 1152-byte rows per union row, per generated token (W = 2).
        assert row["h2d_bytes_per_token"] == pytest.approx(
            stats.union.mean() * 78 * 1152 / 2)
    with pytest.raises(ValueError, match=r"unknown synthetic trace kind 'zipf'"):
        synthetic_traces.generate("zipf", steps=1, context=8, topk=2)


def _optimal_copies(trace, hot):
    """The fewest copies any eviction choice achieves (exhaustive; 1 group, 1 request)."""
    import itertools

    z = trace.page_size
    start = frozenset(int(x) for x in replay.initial_slots(trace.lengths[0], hot, z)[0]
                      if x >= 0)
    best = {start: 0}
    for t in range(trace.steps):
        sel = trace.selected[t, 0, 0]
        tail_start = (int(trace.lengths[t, 0]) // z) * z
        used = {int(x) for x in sel.ravel() if 0 <= x < tail_start}
        nxt = {}
        for cache, cost in best.items():
            missing = used - cache
            keep = cache & used
            free = hot - len(cache)
            evictable = sorted(cache - keep)
            drop = max(len(missing) - free, 0)
            for victims in itertools.combinations(evictable, drop):
                state = frozenset((cache - set(victims)) | missing)
                nxt[state] = min(nxt.get(state, 1 << 30), cost + len(missing))
        best = nxt
    return min(best.values())


@settings(max_examples=40)
@given(st.integers(1, 7), st.integers(1, 2), st.integers(1, 2), st.integers(0, 2),
       st.integers(0, 2 ** 16))
def test_belady_is_optimal(steps, k, ways, extra, seed):
    # Belady's copies equal the exhaustive optimum over every eviction choice on tiny traces
    # (W ways united, this step's hits protected, every miss installed).
    rng = np.random.default_rng(seed)
    length = 8
    sel = np.full((steps, 1, 1, ways, k), -1, np.int32)
    for t in range(steps):
        for w in range(ways):
            sel[t, 0, 0, w] = np.sort(rng.choice(length, size=k, replace=False))
    trace = traces.Trace(selected=sel, lengths=np.full((steps, 1), length, np.int32),
                         page_size=1)
    hot = k * ways + extra
    got = replay.replay(trace, hot_slots=hot, policy="belady").union.sum()
    assert got == _optimal_copies(trace, hot)

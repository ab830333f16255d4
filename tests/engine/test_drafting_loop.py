"""Drafts inside the jitted decode loop (fo_jax.decode_loop, fo_jax.engine.engine): the device
n-gram rule proposes what a plain numpy reference proposes (and the host NGramDrafter runs that
rule); a loop with drafts yields the tokens of host-driven drafting
(`fo_jax.generate.generate(..., drafter="ngram")`, greedy or sampled with the same key) and of
W = 1 greedy decoding, in fewer steps; an engine with drafts gives every request the tokens it
gets alone in the same engine, bit for bit, and never yields past max_tokens or a stop token."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax import hlo_checks
from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.drafting import NGramDrafter, ngram_drafts
from fo_jax.engine.engine import Engine
from fo_jax import decode_loop as loop
from fo_jax.decode_loop import OffloadedStep, ResidentStep, Seats, decode_loop
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState
from fo_jax.sampling import Sampling, sample

# Two layers sharing one indexer, top-4, W <= 3: small programs. Seats of 32 tokens. KV in
# float32: the last bits where a W-way step's rows differ from a W = 1 step's survive storage
# (bfloat16 rounds them away on this model).
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=3,
                                    index_topk=4, kv_dtype="float32")
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

def ngram_reference(history, num_drafts: int, *, max_ngram: int, min_ngram: int):
    """The n-gram rule, plainly, for one history (numpy): for n = max_ngram down to
    min_ngram, the most recent earlier match of the last n tokens and what followed it, the
    missing drafts filled with the last token found (or the history's last token)."""
    history = np.asarray(history).reshape(-1)
    found = np.zeros(0, history.dtype)
    for n in range(min(max_ngram, history.size - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
        hits = np.flatnonzero(np.all(windows == history[-n:], axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            found = history[start:start + num_drafts]
            break
    out = np.full(num_drafts, found[-1] if found.size else history[-1], history.dtype)
    out[:found.size] = found
    return out


@pytest.mark.parametrize("ngram", [(1, 3), (2, 2), (1, 1), (2, 4)])
def test_device_drafter_equals_the_host_drafter(ngram):
    """Random histories over a 4-token vocabulary (many matches, at every n), garbage past each
    history's length; 1 and 3 drafts (continuations cut at the history's end, filled): the
    device rule equals the plain numpy reference, and the host drafter runs the same rule."""
    lo, hi = ngram
    rng = np.random.default_rng(hi)
    histories = rng.integers(0, 4, (48, 20)).astype(np.int32)
    lengths = rng.integers(1, 21, 48)
    drafter = NGramDrafter(max_ngram=hi, min_ngram=lo)
    for num_drafts in (1, 3):
        got = ngram_drafts(jnp.asarray(histories), jnp.asarray(lengths), num_drafts,
                           max_ngram=hi, min_ngram=lo)
        want = np.stack([ngram_reference(h[:n], num_drafts, max_ngram=hi, min_ngram=lo)
                         for h, n in zip(histories, lengths)])
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(
            drafter.propose([h[:n] for h, n in zip(histories, lengths)], num_drafts), want)

MAX_NEW = 12


# The sampled variant: what `generate(..., temperature=..., top_p=..., key=SAMPLED_KEY)` runs.
SAMPLED = dict(temperature=0.3, top_p=0.9)
SAMPLED_KEY = 3


@functools.cache
def _loop(path, sampled=False):
    """Prefill PROMPTS (fo_jax.generate's engine), then decode_loop with drafts, 4 steps per
    call, until both are done: (tokens [2, MAX_NEW], batch steps, accepted, proposed). (The
    offloaded loop runs in the engine tests below.) sampled: at SAMPLED settings, the first
    token and the loop's key as `generate` has them from jax.random.key(SAMPLED_KEY)."""
    engine = (gen.ResidentEngine(_params(), CONFIG, batch=2, capacity=CAPACITY)
              if path == "resident" else
              gen.OffloadEngine(_params(), CONFIG, offload=_offload(), batch=2))
    tokens, lengths = gen.pad_prompts(PROMPTS)
    logits = engine.prefill(tokens, lengths)
    if sampled:
        key, sub = jax.random.split(jax.random.key(SAMPLED_KEY))
        first = np.asarray(sample(logits, sub, **SAMPLED))
        sampling = Sampling.create(2, max_new_tokens=MAX_NEW, **SAMPLED)
    else:
        key = jax.random.key(0)
        first = np.asarray(jnp.argmax(logits, axis=-1), np.int32)
        sampling = Sampling.create(2, max_new_tokens=MAX_NEW)
    seats = Seats.create(first, key, sampling=sampling, lengths=lengths, capacity=CAPACITY)
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
            assert len(row) == int(out.fed[b]) == int(np.sum(out.counts[b]))
            got[b] += row.tolist()
            # The history holds the prompt and every token so far (the state's + 1).
            n = int(state.lengths[b]) + 1
            assert history[b, :n].tolist() == PROMPTS[b] + got[b]
        steps += int(out.num_steps)
        accepted += int(np.sum(out.accepted))
        proposed += int(np.sum(out.proposed))
    np.testing.assert_array_equal(np.asarray(state.lengths), lengths + MAX_NEW - 1)
    return np.asarray(got), steps, accepted, proposed


def test_loop_with_drafts_yields_the_greedy_tokens_in_fewer_steps():
    """Resident: the loop's tokens equal host-driven drafting's and W = 1 greedy decoding's
    (no near-tie on these prompts), in fewer steps than tokens."""
    def generate(**kwargs):
        engine = gen.ResidentEngine(_params(), CONFIG, batch=2, capacity=CAPACITY)
        return gen.generate(engine, PROMPTS, max_new_tokens=MAX_NEW, **kwargs).tokens

    got, steps, accepted, proposed = _loop("resident")
    np.testing.assert_array_equal(got, generate(drafter="ngram", num_drafts=DRAFTS))
    np.testing.assert_array_equal(got, generate())
    assert accepted > 0 and proposed >= DRAFTS * steps
    assert steps < MAX_NEW - 1
    print(f"{steps} steps for {MAX_NEW - 1} tokens per request "
          f"({steps / (MAX_NEW - 1):.2f} steps/token), {accepted}/{proposed} drafts accepted")


def test_sampled_loop_with_drafts_yields_host_drafting_tokens():
    """At temperature > 0 the host `generate` verifies its drafts with the loop's rule
    (`speculative_tokens`, one key for the batch split once per step): the loop and host
    drafting yield the same tokens for the same key (the logits of the two W-way programs
    agree but for the last bits, which decide nothing here), not the greedy ones."""
    got, steps, accepted, proposed = _loop("resident", sampled=True)
    engine = gen.ResidentEngine(_params(), CONFIG, batch=2, capacity=CAPACITY)
    host = gen.generate(engine, PROMPTS, max_new_tokens=MAX_NEW, drafter="ngram",
                        num_drafts=DRAFTS, key=jax.random.key(SAMPLED_KEY), **SAMPLED)
    np.testing.assert_array_equal(host.tokens, got)
    assert host.extra["verify_steps"] == steps
    assert host.extra["accepted_drafts"] == accepted > 0
    assert not np.array_equal(got, _loop("resident")[0])


def test_a_step_yields_the_confirmed_drafts_cut_at_stop_max_tokens_and_capacity():
    """draft_step_tokens on hand-made logits (greedy g = [2, 3, 4] in every row, W = 3):
    drafts [2, 3] are both confirmed, so a request yields g_0 g_1 g_2 unless cut. Every way's
    distribution is a point mass at g (logits 0 and 100), so the sampled row accepts the
    drafts too (speculative sampling: with probability p(d) = 1) and yields g."""
    batch, ways, vocab = 6, 3, 8
    greedy = np.array([2, 3, 4])
    logits = jnp.asarray(np.broadcast_to(100 * np.eye(vocab)[greedy], (batch, ways, vocab)))
    fed = jnp.asarray([[9 % vocab, 2, 3]] * batch, jnp.int32)
    fed = fed.at[4, 2].set(5)  # row 4: the second draft is wrong
    sampling = Sampling.create(batch, temperature=[0, 0, 0, 0, 0, 0.7],
                               stop_tokens=[[], [3], [], [], [], []],
                               max_new_tokens=[50, 50, 6, 50, 50, 50])
    seats = Seats(tokens=jnp.zeros((batch,), jnp.int32), keys=jax.random.key(0),
                  generated=jnp.full((batch,), 5, jnp.int32), done=jnp.zeros((batch,), bool))
    lengths = jnp.asarray([10, 10, 10, CAPACITY - 2, 10, 10], jnp.int32)
    active = jnp.asarray([True] * 5 + [True])
    tokens, count, _ = loop.draft_step_tokens(fed, logits, lengths, seats, sampling,
                                                     CAPACITY, active)
    # 0: all 3; 1: stop token 3 at way 1 ends it there; 2: max_new_tokens 6 - 5 generated;
    # 3: capacity - length = 2; 4: one draft confirmed; 5: sampled, both drafts accepted.
    np.testing.assert_array_equal(count, [3, 2, 1, 2, 2, 3])
    np.testing.assert_array_equal(tokens, np.broadcast_to(greedy, (6, 3)))
    _, count, _ = loop.draft_step_tokens(fed, logits, lengths, seats, sampling,
                                                CAPACITY, jnp.zeros((batch,), bool))
    np.testing.assert_array_equal(count, [0] * batch)

def _engine(path, *, n=2, **kwargs):
    offload = None if path == "resident" else _offload()
    if offload is not None:
        kwargs.setdefault("num_pages", 16)
    return Engine(_params(), CONFIG, seats=3, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=n, prefill_chunk=8, query_block=None,
                  num_drafts=DRAFTS, **kwargs)

# (prompt, max_tokens, temperature, seed, stop ids, arrival step). [96] * 5 yields 44 44 ...
# (max_tokens 6 ends inside a step that accepted drafts); [208] * 7 yields 161 40 161 40 ...
# (stop id 40: nothing after it); a sampled request (speculative sampling: on this random
# prompt at 0.9 its distributions are flat, so it accepts few drafts).
REQUESTS = [
    ([96] * 5, 6, 0.0, 0, (), 0),
    ([208] * 7, 12, 0.0, 0, (), 0),
    ([100, 219, 141] * 3, 12, 0.0, 0, (), 1),
    ([208] * 7, 12, 0.0, 0, (40,), 1),
    ([17, 4, 230, 9, 41], 5, 0.9, 3, (), 2),
]

@functools.cache
def _alone(path, i):
    prompt, max_tokens, temperature, seed, stops, _ = REQUESTS[i]
    engine = _engine(path)
    rid = engine.add_request(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                             stop_token_ids=stops)
    out = engine.run()[rid]
    return tuple(out.token_ids), out.finish_reason

@pytest.mark.parametrize("path", ["resident", "ring"])
def test_engine_with_drafts_gives_each_request_its_tokens_alone(path):
    """Staggered arrivals into 3 seats: every request's tokens (and finish reason) equal its
    run alone in the same engine, and, offloaded, the resident engine's, bit for bit."""
    engine = _engine(path)
    ids, step = {}, 0
    while len(ids) < len(REQUESTS) or engine.has_unfinished():
        for i, (prompt, max_tokens, temperature, seed, stops, arrival) in enumerate(REQUESTS):
            if arrival == step:
                ids[i] = engine.add_request(prompt, max_tokens=max_tokens,
                                            temperature=temperature, seed=seed,
                                            stop_token_ids=stops)
        engine.step()
        step += 1
        assert step < 100
    outputs = engine.run()
    for i, rid in ids.items():
        got = (tuple(outputs[rid].token_ids), outputs[rid].finish_reason)
        assert got == _alone(path, i), i
        assert got == _alone("resident", i), i  # offloaded: lossless, bit for bit
        assert len(got[0]) <= REQUESTS[i][1]
    assert outputs[ids[0]].token_ids == [44] * 6 and outputs[ids[0]].finish_reason == "length"
    assert outputs[ids[3]].token_ids == [161, 40] and outputs[ids[3]].finish_reason == "stop"
    c = engine.counters
    assert c["draft_accepted"] > 0 and c["draft_proposed"] >= c["draft_accepted"]
    assert c["decode_steps"] < c["decode_tokens"]
    print(f"{path}: {c['decode_steps']} decode steps for {c['decode_tokens']} tokens "
          f"({c['decode_steps'] / c['decode_tokens']:.2f} steps/token), "
          f"{c['draft_accepted']}/{c['draft_proposed']} drafts accepted")
    if path != "resident":
        assert engine.pool_occupancy()["held"] == 0
        assert engine.pool_occupancy()["free"] == engine.pool_occupancy()["total"]

@pytest.mark.parametrize("kwargs,message", [
    (dict(num_drafts=-1), r"num_drafts=-1 must be an int >= 0 \(draft tokens per request and "
                          r"step; 0 = no drafts\) \(Engine\(num_drafts=\.\.\.\)\)"),
    (dict(num_drafts=3), r"num_drafts=3 makes steps of W = 4 ways, but config 'tiny' allows at "
                         r"most max_ways=3: use num_drafts <= 2, or a config with max_ways >= 4"),
])
def test_bad_num_drafts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(_params(), CONFIG, seats=2, capacity=CAPACITY, **kwargs)

def test_bad_loop_drafting_arguments_are_refused():
    step = ResidentStep(CONFIG)

    state = resident.ResidentState.create(CONFIG, batch=2, capacity=CAPACITY)
    sampling = Sampling.create(2)
    seats = Seats.create([1, 2], jax.random.key(0), sampling=sampling, lengths=[3, 3],
                         capacity=CAPACITY)
    with pytest.raises(ValueError, match=r"num_drafts=2 needs history: an int32 \[2, 32\] array "
                                         r"\(each request's prompt and sampled tokens, the "
                                         r"state's capacity wide\), got None"):
        decode_loop(_params(), state, seats, 2, sampling, step=step, num_drafts=2)
    with pytest.raises(ValueError, match=r"history and drafter are read only with "
                                         r"num_drafts > 0"):
        decode_loop(_params(), state, seats, 2, sampling, step=step,
                    history=jnp.zeros((2, CAPACITY), jnp.int32))
    with pytest.raises(NotImplementedError, match=r"drafts inside the decode loop come from "
                                                  r"the device n-gram drafter"):
        decode_loop(_params(), state, seats, 2, sampling, step=step, num_drafts=1,
                    drafter=object(), history=jnp.zeros((2, CAPACITY), jnp.int32))


def _rows(engine, req):
    """The request's stored KV rows [L, n, D+R] and indexer keys [G, n, N] (n = its length),
    read from the pools through its page-table row."""
    b, z = req.seat, engine.offload.page_size
    pos = np.arange(int(engine.state.lengths[b]))
    frames = np.asarray(engine.state.table[b])[pos // z]
    return (np.asarray(engine.state.host.kv)[:, frames, pos % z],
            np.asarray(engine.state.index_keys)[:, frames, pos % z])


def test_a_preempted_request_with_drafts_replays_its_steps_bit_for_bit():
    """reserve="prompt", three requests of 7-8 pages growing in a 16-page pool: the older ones'
    growth preempts the youngest; it resumes, prefills again and replays its tokens in the
    groups its W-way steps stored them: its KV rows and indexer keys after the replay are the
    ones it had when preempted, bit for bit (a replay by W = 1 steps differs in the last bits:
    7e-7 here), and every request gets its tokens alone (the sampled one too: its key is kept
    while it waits)."""
    engine = _engine("ring", reserve="prompt")
    before, after = {}, {}
    preempt, replay = engine._preempt, engine._replay

    def preempt_and_keep_rows(req, **kwargs):
        if req.prefilled == len(req.prompt):
            before[req.request_id] = _rows(engine, req)
        preempt(req, **kwargs)

    def replay_and_keep_rows(resumed):
        replay(resumed)
        after.update({req.request_id: _rows(engine, req) for req in resumed})

    engine._preempt, engine._replay = preempt_and_keep_rows, replay_and_keep_rows
    # (prompt, max_tokens, temperature): the youngest samples (speculative sampling).
    jobs = [(REQUESTS[1][0], 20, 0.0), (REQUESTS[2][0], 18, 0.0), (REQUESTS[0][0], 22, 0.3)]
    ids = [engine.add_request(prompt, max_tokens=max_tokens, temperature=t, seed=1)
           for prompt, max_tokens, t in jobs]
    outputs = engine.run()
    assert engine.counters["preemptions"] > 0 and engine.counters["replayed_tokens"] > 0
    assert engine.counters["draft_accepted"] > 0
    assert after and set(after) <= set(before) and ids[2] in after  # the sampled one too
    for rid, rows in after.items():
        np.testing.assert_array_equal(rows[0], before[rid][0])
        np.testing.assert_array_equal(rows[1], before[rid][1])
    for rid, (prompt, max_tokens, t) in zip(ids, jobs):
        alone = _engine("ring")
        want = alone.add_request(prompt, max_tokens=max_tokens, temperature=t, seed=1)
        assert outputs[rid].token_ids == alone.run()[want].token_ids
    assert engine.pool_occupancy()["held"] == 0


def test_a_request_that_kept_its_pages_resumes_with_its_draft_history():
    """A request preempted keeping its pages (what a device-bytes shortage does) resumes
    without recompute; its seat's draft history is set again at the rejoin, so its steps
    take the same drafts, hence the same W-way programs, as alone: same tokens bit for bit."""
    engine = _engine("ring", reserve="prompt")
    jobs = [(REQUESTS[1][0], 20), (REQUESTS[0][0], 22)]
    ids = [engine.add_request(prompt, max_tokens=max_tokens) for prompt, max_tokens in jobs]
    while len(engine._requests[ids[1]].tokens) < 3:
        engine.step()
    engine.synchronize()  # a preemption reads the seat's exact state (the engine's own
    # preemptions read back the decode call in flight first: overlap)
    req = engine._requests[ids[1]]
    seat = req.seat
    engine._preempt(req, keep_pages=True)
    # What another occupant of the seat would leave in its history meanwhile.
    engine.runner.history = engine.runner.history.at[seat].set(0)
    while engine.counters["resumed_without_recompute"] == 0:
        engine.step()
    row = np.concatenate([req.prompt, np.asarray(req.tokens, np.int32)])
    np.testing.assert_array_equal(np.asarray(engine.runner.history)[req.seat, :len(row)], row)
    outputs = engine.run()
    assert engine.counters["resumed_without_recompute"] == 1
    assert engine.counters["replayed_tokens"] == 0 and engine.counters["draft_accepted"] > 0
    for rid, (prompt, max_tokens) in zip(ids, jobs):
        alone = _engine("ring")
        want = alone.add_request(prompt, max_tokens=max_tokens)
        assert outputs[rid].token_ids == alone.run()[want].token_ids
    assert engine.pool_occupancy()["held"] == 0


def test_draft_loop_carries_the_state_in_place():
    """The offloaded loop with drafts (compiled, not run): the state is updated in place in the
    loop body, the rollback included (as tests/engine/test_loop.py checks without drafts).
    Distinctive shapes: B = 3, C = 36, Z = 4, S = 96."""
    batch, capacity = 3, 96
    params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.key(0)))
    offload = OffloadConfig(hot_slots=36, page_size=4, capacity=capacity, policy="ring")
    state = DecodeState.create(CONFIG, offload, batch=batch)
    settings = Sampling.create(batch, stop_tokens=[1, 2])
    seats = Seats.create(np.zeros(batch, np.int32), jax.random.key(0), sampling=settings,
                         lengths=np.zeros(batch), capacity=capacity)
    compiled = hlo_checks.compile_call(
        loop, "_draft_loop_jit", decode_loop, params, state, seats, 5, settings,
        step=OffloadedStep(CONFIG, offload), num_drafts=DRAFTS,
        history=jnp.zeros((batch, capacity), jnp.int32),
        compiler_options=hlo_checks.FAST_COMPILE)
    assert " while(" in compiled.as_text()
    ignore = ("lengths", "step", "policy.hand", "policy.key")
    hlo_checks.assert_no_state_copies(compiled, state, ignore=ignore)
    hlo_checks.assert_donation_aliased(compiled, state, ignore=ignore)

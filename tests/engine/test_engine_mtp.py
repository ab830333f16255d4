"""MTP drafts inside the jitted decode loop (fo_jax.decode_loop, fo_jax.engine.engine): the
loop's drafts are those of the host `fo_jax.drafting.MTPDrafter` for the same history; an
engine drafting with the MTP layer gives every request the tokens it gets alone in the same
engine, bit for bit (offloaded: the resident engine's), through staggered arrivals, preemption
with dropped pages (replay) and with kept pages, and with the prefix cache (the MTP rows of a
mapped prefix from the cache, bit for bit); bad settings are refused with clear messages.

The MTP layer: random parameters plus a copy of the input token (eh_proj passes the token's
embedding through, the head reads it back), so its drafts repeat the last token more often than
not (and sometimes not: the random layer and the hidden state count): drafts on the prompts
below whose continuations repeat (44 44 ...) are accepted. A purely random MTP layer accepts
almost nothing on random weights."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax import hlo_checks
from fo_jax import resident
from fo_jax.config import get_config
from fo_jax import decode_loop as loop
from fo_jax.engine.engine import Engine
from fo_jax.engine.mtp_prefix import mtp_block_bytes
from fo_jax.decode_loop import (MTPSeats, OffloadedStep, ResidentStep, Seats, decode_loop,
                                mtp_feed_jit)
from fo_jax.engine.resident_prefix import block_bytes
from fo_jax.model.dsa import init_params
from fo_jax.model.mtp import init_mtp_params
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState
from fo_jax.sampling import Sampling

# The model of tests/engine/test_drafting_loop.py (2 layers, top-4, W <= 3, float32 KV) with
# one MTP layer (the main parameters do not change).
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=3,
                                    index_topk=4, kv_dtype="float32",
                                    num_nextn_predict_layers=1)
CAPACITY = 32
DRAFTS = 2
CHUNK = 8  # prefill_chunk


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


@functools.cache
def _mtp():
    """Random MTP parameters (own head) plus the copy of the input token (module doc)."""
    mtp = init_mtp_params(CONFIG, jax.random.key(1), own_head=True)
    e = CONFIG.dim
    copy = jnp.concatenate([jnp.eye(e), jnp.zeros((e, e))])[None]
    return {**mtp, "eh_proj": mtp["eh_proj"] + copy.astype(mtp["eh_proj"].dtype),
            "head": mtp["head"] + _params()["embed"].T[None].astype(mtp["head"].dtype)}


def _offload():
    return OffloadConfig(hot_slots=12, page_size=4, capacity=CAPACITY, policy="ring")


def _engine(path, **kwargs):
    offload = None if path == "resident" else _offload()
    if offload is not None:
        kwargs.setdefault("num_pages", 16)
    return Engine(_params(), CONFIG, seats=3, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=2, prefill_chunk=8, query_block=None,
                  num_drafts=DRAFTS, drafter="mtp", mtp=_mtp(), **kwargs)


def test_loop_mtp_drafts_are_the_host_drafters():
    """Resident, 3 prompts (one of 9 tokens: two prefill chunks of 8), 4 steps per call: each
    request's drafts at each of its steps equal those `fo_jax.generate.generate(...,
    drafter="mtp")` verified (the host MTPDrafter, fed the same hidden states), its tokens equal
    the host's (W = 1 greedy decoding's), and drafts were accepted."""
    prompts, new = [[96] * 5, [208] * 7, [100, 219, 141] * 3], 12
    batch = len(prompts)

    def engine():
        return gen.ResidentEngine(_params(), CONFIG, batch=batch, capacity=CAPACITY,
                                  mtp=_mtp(), prefill_chunk=8)

    host = []
    want = gen.generate(engine(), prompts, max_new_tokens=new, drafter="mtp", num_drafts=DRAFTS,
                        on_step=lambda step, fed, logits: host.append(np.asarray(fed)[:, 1:]))
    # The W = 1 greedy tokens (no near-tie: tests/engine/test_drafting_loop.py).
    assert want.tokens[0].tolist() == [44] * new
    assert want.tokens[1, :4].tolist() == [161, 40, 161, 40]
    # The loop, from the same prefill: its MTP seats fed the prompts' pairs chunk by chunk.
    res = engine()
    tokens, lengths = gen.pad_prompts(prompts)
    logits, hidden = res.prefill(tokens, lengths, hidden=True)
    first = np.asarray(jnp.argmax(logits, axis=-1), np.int32)
    nxt = np.zeros(tokens.shape, np.int32)
    nxt[:, :-1] = tokens[:, 1:]
    nxt[np.arange(batch), lengths - 1] = first
    mtp_seats = MTPSeats.create(CONFIG, batch=batch, capacity=CAPACITY)
    for lo in range(0, tokens.shape[1], 8):
        mtp_seats = mtp_feed_jit(_params(), _mtp(), mtp_seats, hidden[:, lo:lo + 8],
                                 jnp.asarray(nxt[:, lo:lo + 8]),
                                 jnp.asarray(np.clip(lengths - lo, 0, 8), jnp.int32),
                                 config=CONFIG, query_block=resident.QUERY_BLOCK)
    sampling = Sampling.create(batch, max_new_tokens=new)
    seats = Seats.create(first, jax.random.key(0), sampling=sampling, lengths=lengths,
                         capacity=CAPACITY)
    state, got = res.state, [[int(t)] for t in first]
    drafts, counts_of = [[] for _ in range(batch)], [[] for _ in range(batch)]
    accepted = 0
    while not bool(np.all(np.asarray(seats.done))):
        out, state, seats = decode_loop(_params(), state, seats, 4, sampling,
                                        step=ResidentStep(CONFIG), num_drafts=DRAFTS,
                                        mtp=_mtp(), mtp_seats=mtp_seats)
        mtp_seats = out.mtp_seats
        assert out.history is None and out.drafts.shape == (batch, 4, DRAFTS)
        # Between steps the MTP layer holds one pair per stored token.
        np.testing.assert_array_equal(mtp_seats.state.lengths, state.lengths)
        toks, counts = np.asarray(out.tokens), np.asarray(out.counts)
        for b in range(batch):
            got[b] += toks[b][toks[b] >= 0].tolist()
            drafts[b] += [np.asarray(out.drafts)[b, i].tolist() for i in range(4)
                          if counts[b, i] > 0]
            counts_of[b] += [int(c) for c in counts[b] if c > 0]
        accepted += int(np.sum(out.accepted))
    np.testing.assert_array_equal(np.asarray(got), want.tokens)
    for b in range(batch):
        assert drafts[b] == [host[k][b].tolist() for k in range(len(drafts[b]))], b
    assert accepted == want.extra["accepted_drafts"] > 0
    # Not only copies of the last token: the random layer and the hidden states count.
    lasts = [[got[b][n - 1] for n in np.cumsum([1] + counts_of[b][:-1])] for b in range(batch)]
    assert any(d[0] != t for b in range(batch) for d, t in zip(drafts[b], lasts[b]))
    assert sum(d[0] == t for b in range(batch) for d, t in zip(drafts[b], lasts[b])) > 10


# (prompt, max_tokens, temperature, seed, stop ids, arrival step). [96] * 5 yields 44 44 ...
# (drafts accepted); [208] * 7 yields 161 40 ... (stop id 40); a sampled request takes one
# token per step; the prompt of 9 tokens takes two prefill chunks.
REQUESTS = [
    ([96] * 5, 9, 0.0, 0, (), 0),
    ([208] * 7, 10, 0.0, 0, (), 0),
    ([100, 219, 141] * 3, 8, 0.0, 0, (), 1),
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
def test_engine_with_mtp_drafts_gives_each_request_its_tokens_alone(path):
    """Staggered arrivals into 3 seats: every request's tokens (and finish reason) equal its
    run alone in the same engine, and, offloaded, the resident engine's, bit for bit; drafts
    were accepted, fewer steps than tokens."""
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
    # The W = 1 greedy tokens (tests/engine/test_drafting_loop.py: no near-tie here).
    assert outputs[ids[0]].token_ids == [44] * 9
    assert outputs[ids[3]].token_ids == [161, 40] and outputs[ids[3]].finish_reason == "stop"
    c = engine.counters
    assert 0 < c["draft_accepted"] < c["draft_proposed"]
    assert c["draft_proposed"] % DRAFTS == 0
    assert c["decode_steps"] < c["decode_tokens"]
    print(f"{path}: {c['decode_steps']} decode steps for {c['decode_tokens']} tokens, "
          f"{c['draft_accepted']}/{c['draft_proposed']} MTP drafts accepted")
    if path != "resident":
        assert engine.pool_occupancy()["held"] == engine.pool_occupancy()["cached"] == 0


def _mtp_rows(engine, req):
    """The request's seat MTP state: (KV rows, indexer keys, length, draft, h')."""
    return engine.runner.save_mtp(req.seat)


def _assert_same_mtp(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_preempted_mtp_requests_resume_with_their_mtp_state():
    """reserve="prompt" in a 16-page pool: the older requests' growth preempts the youngest
    (pages dropped: it prefills again and replays); a request preempted keeping its pages
    (what a device-bytes shortage does) rejoins without recompute, its seat's MTP state
    clobbered meanwhile. Each takes back the MTP state it had when preempted (bit for bit)
    and every request gets its tokens alone."""
    engine = _engine("ring", reserve="prompt")
    before, checked = {}, []
    preempt, replay, rejoin = engine._preempt, engine._replay, engine._rejoin

    def preempt_and_keep(req, **kwargs):
        if req.tokens:
            before[req.request_id] = _mtp_rows(engine, req)
        preempt(req, **kwargs)

    def check(resumed, kind):
        for req in resumed:
            _assert_same_mtp(_mtp_rows(engine, req), before[req.request_id])
            checked.append((req.request_id, kind))

    engine._preempt = preempt_and_keep
    engine._replay = lambda resumed: (replay(resumed), check(resumed, "replay"))
    engine._rejoin = lambda resumed: (rejoin(resumed), check(resumed, "rejoin"))
    jobs = [(REQUESTS[1][0], 20), (REQUESTS[2][0], 18), (REQUESTS[0][0], 22)]
    ids = [engine.add_request(prompt, max_tokens=max_tokens) for prompt, max_tokens in jobs]
    while len(engine._requests[ids[0]].tokens) < 3:
        engine.step()
    engine.synchronize()  # a preemption reads the seat's exact state (the engine's own
    # preemptions read back the decode call in flight first: overlap)
    req = engine._requests[ids[0]]
    seat = req.seat
    engine._preempt(req, keep_pages=True)
    mtp = engine.runner.mtp_seats  # what another occupant would leave in the seat
    engine.runner.mtp_seats = dataclasses.replace(
        mtp, state=dataclasses.replace(mtp.state, kv=mtp.state.kv.at[:, seat].set(0)),
        draft=mtp.draft.at[seat].set(7), hidden=mtp.hidden.at[seat].set(1.0))
    outputs = engine.run()
    c = engine.counters
    assert c["preemptions"] > c["preemptions_kept_pages"] == 1
    assert c["resumed_without_recompute"] == 1 and c["replayed_tokens"] > 0
    assert c["draft_accepted"] > 0
    assert {kind for _, kind in checked} == {"replay", "rejoin"}, checked
    for rid, (prompt, max_tokens) in zip(ids, jobs):
        alone = _engine("ring")
        want = alone.add_request(prompt, max_tokens=max_tokens)
        assert outputs[rid].token_ids == alone.run()[want].token_ids
    assert engine.pool_occupancy()["held"] == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(drafter="eagle", num_drafts=2),
     r"drafter='eagle' must be one of \('ngram', 'mtp'\) \(where the drafts come from: n-gram "
     r"lookup in each request's history, or the model's MTP layer\)"),
    (dict(drafter="mtp"), r"drafter='mtp' needs num_drafts >= 1 \(drafts per request and "
                          r"decode step\): pass num_drafts, or drop drafter"),
    (dict(drafter="mtp", num_drafts=2),
     r"drafter='mtp': MTP drafts need the MTP parameters: load them with "
     r"load_checkpoint\(\.\.\., mtp=True\) \(or fo_jax\.model\.mtp\.init_mtp_params\) and "
     r"pass them as mtp="),
    (dict(num_drafts=2, mtp="MTP"), r"mtp \(the MTP parameters\) is read only with "
                                    r"drafter='mtp': pass drafter='mtp', or drop mtp"),
    (dict(drafter="mtp", num_drafts=2, mtp={"enorm": 0}),
     r"drafter='mtp': MTP params: missing \["),
])
def test_bad_mtp_settings_are_refused(kwargs, message):
    if kwargs.get("mtp") == "MTP":
        kwargs["mtp"] = _mtp()
    with pytest.raises(ValueError, match=message):
        Engine(_params(), CONFIG, seats=2, capacity=CAPACITY, prefill_chunk=8, **kwargs)


def test_mtp_drafts_need_a_model_with_an_mtp_layer():
    config = CONFIG.replace(num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"drafter='mtp': MTP drafts need the model's "
                                         r"multi-token-prediction layer, but config 'tiny' has "
                                         r"num_nextn_predict_layers=0: use n-gram drafts, or a "
                                         r"model with an MTP layer"):
        Engine(_params(), config, seats=2, capacity=CAPACITY, num_drafts=2, drafter="mtp",
               mtp=_mtp())
    step = ResidentStep(CONFIG)
    state = resident.ResidentState.create(CONFIG, batch=2, capacity=CAPACITY)
    sampling = Sampling.create(2)
    seats = Seats.create([1, 2], jax.random.key(0), sampling=sampling, lengths=[3, 3],
                         capacity=CAPACITY)
    with pytest.raises(ValueError, match=r"mtp and mtp_seats are read only with num_drafts > 0"):
        decode_loop(_params(), state, seats, 2, sampling, step=step, mtp=_mtp())
    with pytest.raises(ValueError, match=r"MTP drafts need mtp_seats: an MTPSeats of 2 seats "
                                         r"and capacity 32 \(MTPSeats\.create, filled with the "
                                         r"prompts' pairs by mtp_feed\), got NoneType"):
        decode_loop(_params(), state, seats, 2, sampling, step=step, num_drafts=1, mtp=_mtp())


def test_mtp_draft_loop_carries_both_states_in_place():
    """The offloaded loop with MTP drafts (compiled, not run): the main state and the MTP
    layer's state ([1, B, S, D+R] rows, [1, B, S, N] indexer keys) are updated in place in the
    loop body, the chained pairs and the rollback included (as test_drafting_loop.py checks
    for n-gram drafts). Distinctive shapes: B = 3, C = 36, Z = 4, S = 96. (Resident with one
    indexer group, the main and MTP indexer keys have the same shape, and XLA copies both once
    per call, at the loop's entry and exit: never per step.)"""
    batch, capacity = 3, 96
    params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.key(0)))
    mtp = jax.eval_shape(lambda: init_mtp_params(CONFIG, jax.random.key(1)))
    offload = OffloadConfig(hot_slots=36, page_size=4, capacity=capacity, policy="ring")
    state = DecodeState.create(CONFIG, offload, batch=batch)
    mtp_seats = MTPSeats.create(CONFIG, batch=batch, capacity=capacity)
    settings = Sampling.create(batch, stop_tokens=[1, 2])
    seats = Seats.create(np.zeros(batch, np.int32), jax.random.key(0), sampling=settings,
                         lengths=np.zeros(batch), capacity=capacity)
    compiled = hlo_checks.compile_call(
        loop, "_draft_loop_jit", decode_loop, params, state, seats, 5, settings,
        step=OffloadedStep(CONFIG, offload), num_drafts=DRAFTS, mtp=mtp, mtp_seats=mtp_seats,
        compiler_options=hlo_checks.FAST_COMPILE)
    assert " while(" in compiled.as_text()
    for tree, ignore in ((state, ("lengths", "step", "policy.hand", "policy.key")),
                         (mtp_seats, ("state.lengths", "draft", "hidden"))):
        hlo_checks.assert_no_state_copies(compiled, tree, ignore=ignore)
        hlo_checks.assert_donation_aliased(compiled, tree, ignore=ignore)


# MTP drafts with the prefix cache (fo_jax.engine.mtp_prefix): a request that maps a cached
# prefix also gets its MTP layer rows from the cache (stored per prefill chunk, keyed by the
# chunk's chain hash and the token after it), bit for bit those a prefill from scratch
# computes, so its drafts and tokens are those of its run alone without the cache; its prefill
# drops by the reused tokens, no page or block leaks, and a prefix followed by another next
# token than the stored one maps one chunk fewer. (In this file: the programs are those of the
# tests above, compiled once.)


def _prefix_engine(path, **kwargs):
    """An engine of `_engine` with the prefix cache. path: "resident", "resident-pinned" (the
    prefix store in pinned host memory) or "ring" (offloaded: the MTP rows of cached chunks
    in pinned host memory, as the host pages)."""
    if path == "resident-pinned":
        path, kwargs["prefix_cache_memory"] = "resident", "pinned_host"
    return _engine(path, prefix_cache=True, **kwargs)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


SYSTEM = [96] * 6 + _prompt(99, 10)  # two prefill chunks


@functools.cache
def _solo(path, prompt, max_tokens):
    """The request alone on the same engine without the prefix cache: its tokens, and its
    seat's MTP state right after its prefill (rows [0, length), length, draft, h')."""
    engine = _engine(path.split("-")[0])
    rid = engine.add_request(list(prompt), max_tokens=max_tokens)
    seen = _watch(engine)
    out = engine.run()[rid]
    return tuple(out.token_ids), seen[rid]


def _watch(engine):
    """Record each request's seat MTP state right after the prefill program that completes
    its prompt (and, with a mapped prefix, its MTP rows right after admission)."""
    seen, prefill, start = {}, engine._prefill, engine._start_mtp

    def watched_prefill(moved):
        before = [r for r in engine._occupant if r is not None and r.prefilled < len(r.prompt)]
        prefill(moved)
        for req in before:
            if req.prefilled == len(req.prompt):
                seen[req.request_id] = engine.runner.save_mtp(req.seat)

    def watched_start(started):
        start(started)
        for req in started:
            if req.cached_tokens:
                seen["admitted", req.request_id] = engine.runner.save_mtp(req.seat)

    engine._prefill, engine._start_mtp = watched_prefill, watched_start
    return seen


def _check(engine):
    if engine.pool is not None:
        engine.pool.check()
        engine.prefix.check()
        assert engine.pool.num_held == len({p for r in engine._occupant if r is not None
                                            for p in r.pages.pages.tolist()})
    else:
        engine.prefix.store.check()
    engine.prefix.mtp.check()
    memory = "pinned_host"
    if engine.prefix.store is not None:
        memory = engine.prefix.store.memory
    for _, kv, keys in engine.prefix.mtp._blocks.values():
        assert kv.sharding.memory_kind == keys.sharding.memory_kind == memory


@pytest.mark.parametrize("path", ["resident", "ring"])
def test_shared_prefix_requests_with_mtp_drafts_equal_their_solo_runs(path):
    """Three requests share a 16-token system prompt (two chunks) and the token after it,
    arriving while the first
    prefills and decodes: the later ones map both chunks (main KV and MTP rows) and prefill
    only the rest; their MTP rows right after admission are the solo prefill's rows of the
    prefix, their MTP state after the prefill the solo one's, their tokens their solo runs',
    bit for bit; drafts were accepted; no page or block is left held."""
    engine = _prefix_engine(path)
    seen = _watch(engine)
    # The same token after the system prompt: the second chunk's MTP rows are shared too.
    specs = [(SYSTEM + [96] * 3, 8), (SYSTEM + [96] + _prompt(2, 6), 6),
             (SYSTEM + [96] + _prompt(3, 2), 6)]
    arrivals, ids, step = [0, 2, 3], {}, 0
    while len(ids) < len(specs) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step:
                ids[i] = engine.add_request(specs[i][0], max_tokens=specs[i][1])
        engine.step()
        _check(engine)
        step += 1
    outputs = engine.run()
    for i, (prompt, max_tokens) in enumerate(specs):
        tokens, mtp_state = _solo(path, tuple(prompt), max_tokens)
        assert tuple(outputs[ids[i]].token_ids) == tokens, i
        _assert_same_mtp(seen[ids[i]], mtp_state)
        if i:
            kv, keys, length, _, _ = seen["admitted", ids[i]]
            assert length == 16
            np.testing.assert_array_equal(kv, mtp_state[0][:16])
            np.testing.assert_array_equal(keys, mtp_state[1][:16])
    c = engine.counters
    assert c["prefix_hit_tokens"] == 2 * 16
    assert c["prefill_tokens"] == sum(len(p) for p, _ in specs) - 2 * 16
    assert c["draft_accepted"] > 0
    assert engine.prefix.mtp.num_blocks == 2
    if path != "resident":
        assert engine.pool_occupancy()["held"] == 0


@pytest.mark.parametrize("path", ["resident", "resident-pinned", "ring"])
def test_a_prefix_followed_by_another_token_maps_one_chunk_fewer(path):
    """The second chunk's MTP rows take the token after it: a request whose prompt goes on
    with another token than the stored one maps one chunk (main KV and MTP rows), prefills
    the second chunk again and stores its MTP rows for its own next token (the latest
    replaces the stored ones), so the next request of that kind maps both chunks, and one
    going on with the first token now maps one. Tokens equal the solo runs throughout."""
    engine = _prefix_engine(path)
    x, y = _prompt(5, 4), _prompt(6, 4)
    assert x[0] != y[0]
    hits = []
    for prompt in (SYSTEM + x, SYSTEM + x[:1] + y[1:], SYSTEM + y, SYSTEM + y[::-1],
                   SYSTEM + x):
        hit, prefilled = engine.counters["prefix_hit_tokens"], engine.counters["prefill_tokens"]
        rid = engine.add_request(prompt, max_tokens=4)
        out = engine.run()[rid]
        _check(engine)
        assert tuple(out.token_ids) == _solo(path, tuple(prompt), 4)[0]
        hits.append(engine.counters["prefix_hit_tokens"] - hit)
        assert engine.counters["prefill_tokens"] - prefilled == len(prompt) - hits[-1]
    # y[::-1] starts with y[-1]: another token than y[0] unless they agree.
    assert hits == [0, 16, 8, 16 if y[-1] == y[0] else 8, 8]
    # The main cache did match both chunks every time.
    cache = engine.prefix.cache
    assert cache.num_hit_tokens == 4 * 16


def test_mtp_rows_count_in_the_prefix_budget():
    """Resident: a block of the prefix store holds the MTP layer's rows of its chunk too, and
    its bytes count in prefix_cache_bytes; offloaded, host_pool_bytes counts a page's MTP rows
    beside its KV."""
    per_block = block_bytes(CONFIG, CHUNK) + mtp_block_bytes(CONFIG, CHUNK)
    assert mtp_block_bytes(CONFIG, CHUNK) == CHUNK * (CONFIG.kv_width + CONFIG.index_head_dim) * 4
    engine = _prefix_engine("resident", prefix_cache_bytes=3 * per_block - 1)
    assert engine.prefix.store.num_blocks == 2
    assert engine.prefix.store.block_bytes == per_block
    probe = _engine("ring", num_pages=1)
    page = probe.kv.costs.page_host_bytes + mtp_block_bytes(CONFIG, 4)
    engine = _prefix_engine("ring", num_pages=None, host_pool_bytes=10 * page)
    assert engine.pool.num_pages == 10


def test_mtp_blocks_are_evicted_with_their_chunks():
    """Resident, a prefix store of two blocks: a prompt of two other chunks evicts the system
    prompt's blocks, and their MTP rows go with them (every MTP block's chunk is cached);
    the system prompt is then prefilled again, its tokens still the solo run's."""
    per_block = block_bytes(CONFIG, CHUNK, mtp=True)
    engine = _prefix_engine("resident", prefix_cache_bytes=2 * per_block)
    hits = []
    for prompt in (SYSTEM + [96] * 3, _prompt(7, 19), SYSTEM + [96] * 3):
        hit = engine.counters["prefix_hit_tokens"]
        rid = engine.add_request(prompt, max_tokens=3)
        out = engine.run()[rid]
        _check(engine)
        assert tuple(out.token_ids) == _solo("resident", tuple(prompt), 3)[0]
        assert engine.prefix.mtp.num_blocks == 2
        hits.append(engine.counters["prefix_hit_tokens"] - hit)
    assert hits == [0, 0, 0]
    assert engine.prefix.store.cache.num_evicted == 4


def test_a_preempted_request_maps_the_prefix_again():
    """Offloaded, reserve="prompt" in the 16-page pool, three requests sharing a chunk,
    admitted together (nothing cached yet): the older ones' growth preempts the youngest
    with its pages dropped; it maps the cached chunk when it resumes (its MTP state comes
    back as saved) and replays; every request gets its solo tokens; no page is left held."""
    engine = _prefix_engine("ring", reserve="prompt")
    specs = [(SYSTEM[:8] + [96] * 2, 20), (SYSTEM[:8] + [96] + _prompt(2, 1), 20),
             (SYSTEM[:8] + [96] + _prompt(3, 2), 20)]
    ids = [engine.add_request(p, max_tokens=m) for p, m in specs]
    while engine.has_unfinished():
        engine.step()
        _check(engine)
    outputs = engine.run()
    for rid, (prompt, max_tokens) in zip(ids, specs):
        assert tuple(outputs[rid].token_ids) == _solo("ring", tuple(prompt), max_tokens)[0]
    c = engine.counters
    assert c["preemptions"] > c["preemptions_kept_pages"] == 0 and c["replayed_tokens"] > 0
    assert c["prefix_hit_tokens"] > 0
    assert engine.pool_occupancy()["held"] == 0


def test_mtp_feed_seat_is_the_seat_alone_and_leaves_the_others():
    # Pairs fed seat by seat (the seat traced) equal those fed to a batch-1
    # MTPSeats holding that seat alone, bit for bit; the other seats' rows, drafts and h' are
    # untouched; and, on this model, the batched feed's row too.
    from fo_jax.decode_loop import mtp_feed, mtp_feed_seat_jit

    batch, rng = 3, np.random.default_rng(4)
    hidden = jnp.asarray(rng.standard_normal((batch, 16, CONFIG.dim)), CONFIG.jnp_dtype)
    nxt = rng.integers(0, CONFIG.vocab_size, (batch, 16)).astype(np.int32)
    counts = [(8, 8), (8, 3), (5, 0)]
    seats = MTPSeats.create(CONFIG, batch=batch, capacity=CAPACITY)
    batched = MTPSeats.create(CONFIG, batch=batch, capacity=CAPACITY)
    alone = [MTPSeats.create(CONFIG, batch=1, capacity=CAPACITY) for _ in range(batch)]
    kw = dict(config=CONFIG, query_block=None)
    for c in range(2):
        lo = 8 * c
        num = np.asarray([n[c] for n in counts], np.int32)
        batched = mtp_feed(_params(), _mtp(), batched, hidden[:, lo:lo + 8],
                           jnp.asarray(nxt[:, lo:lo + 8]), jnp.asarray(num), **kw)
        for b in (2, 0, 1):
            if not num[b]:
                continue
            before = jax.device_get(seats)
            seats = mtp_feed_seat_jit(_params(), _mtp(), seats, jnp.asarray(b, jnp.int32),
                                      hidden[b:b + 1, lo:lo + 8],
                                      jnp.asarray(nxt[b:b + 1, lo:lo + 8]),
                                      jnp.asarray(num[b:b + 1]), **kw)
            alone[b] = mtp_feed(_params(), _mtp(), alone[b], hidden[b:b + 1, lo:lo + 8],
                                jnp.asarray(nxt[b:b + 1, lo:lo + 8]),
                                jnp.asarray(num[b:b + 1]), **kw)
            after, solo = jax.device_get(seats), jax.device_get(alone[b])
            others = np.arange(batch) != b
            for got, want, old in [(after.state.kv, solo.state.kv, before.state.kv),
                                   (after.state.index_keys, solo.state.index_keys,
                                    before.state.index_keys)]:
                np.testing.assert_array_equal(got[:, b], want[:, 0])
                np.testing.assert_array_equal(got[:, others], old[:, others])
            for got, want, old in [(after.state.lengths, solo.state.lengths,
                                    before.state.lengths),
                                   (after.draft, solo.draft, before.draft),
                                   (after.hidden, solo.hidden, before.hidden)]:
                np.testing.assert_array_equal(got[b], want[0])
                np.testing.assert_array_equal(got[others], old[others])
    for got, want in zip(jax.tree_util.tree_leaves(jax.device_get(seats)),
                         jax.tree_util.tree_leaves(jax.device_get(batched))):
        np.testing.assert_array_equal(got, want)

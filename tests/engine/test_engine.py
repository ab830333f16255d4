"""Continuous batching (fo_jax.engine.engine): requests that join and leave while others decode
get exactly the tokens they get alone, offloaded or resident; bad requests are refused before
anything changes; cancel, release, stop tokens and stop strings."""

import functools
import re

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.engine.scheduler import RequestRefused
from fo_jax.engine.engine import Engine, TokenLogprobs
from fo_jax.engine.overlap import DeviceClock
from fo_jax.decode_loop import ResidentStep
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants

# Two layers sharing one indexer, top-4: small programs. Seats of 32 tokens, pages of 4.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
CAPACITY = 32
SEATS = 3
# Pages in the offloaded engines' pool: one seat's worth. The pool size is a shape of the
# state (another size compiles every program again), so every test shares this one.
PAGES = 8


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _offload(path="ring"):
    """The offloaded engines' setting: `path` is a policy name, "+ffi" for fo_jax's own host
    copies (fo_jax.offload.ffi) instead of the default host access."""
    policy, _, access = path.partition("+")
    return OffloadConfig(hot_slots=8, page_size=4, capacity=CAPACITY, policy=policy,
                         host_access=access or None)


def _engine(path="ring", *, n=2, seats=SEATS, tokenizer=None, config=CONFIG, **kwargs):
    offload = None if path == "resident" else _offload(path)
    if offload is not None and "host_pool_bytes" not in kwargs:
        kwargs.setdefault("num_pages", PAGES)
    return Engine(_params(), config, seats=seats, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=n, prefill_chunk=8, query_block=None,
                  tokenizer=tokenizer, **kwargs)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


@functools.cache
def _solo(prompt, max_tokens, temperature, seed, stop_ids=(), config=CONFIG):
    """The request alone in a resident engine of the same seats: the reference."""
    engine = _engine("resident", config=config)
    rid = engine.add_request(list(prompt), max_tokens=max_tokens, temperature=temperature,
                             seed=seed, stop_token_ids=stop_ids)
    out = engine.run()[rid]
    return tuple(out.token_ids), out.finish_reason


SYSTEM = _prompt(99, 16)  # a shared "system prompt": two prefill chunks, four pages

# (shares the system prompt, prompt seed, length, max_tokens, temperature, sampling seed)
REQUEST = st.tuples(st.booleans(), st.integers(0, 10**6), st.integers(1, 9), st.integers(1, 16),
                    st.sampled_from([0.0, 0.9]), st.integers(0, 5))


# The random schedules of both KV formats.
SCHEDULE = dict(
    requests=st.lists(REQUEST, min_size=2, max_size=6),
    arrivals=st.lists(st.integers(0, 4), min_size=6, max_size=6),
    cancels=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 5)), max_size=2),
    path=st.sampled_from(["ring", "clock"]),
    # (prefix_cache, reserve, device_bytes): the pool's 8 pages hold one request of a
    # whole seat; 9,000 device bytes one request of a whole seat (8,224 B), not two;
    # 6,300 two decoding seats and 7 pages (seats short before pages), and refuse a
    # request whose prefill buffers pass it alone (a shared prompt)
    pool=st.tuples(st.booleans(), st.sampled_from(["full", "prompt"]),
                   st.sampled_from([None, 9000, 6300])))


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Preemption for sure: three requests growing in an 8-page pool (one at temperature 0.9).
@example(requests=[(True, 1, 9, 8, 0.0, 0), (True, 2, 3, 8, 0.9, 1), (False, 3, 5, 8, 0.0, 0)],
         arrivals=[0, 0, 1, 0, 0, 0], cancels=[], path="ring",
         pool=(True, "prompt", None))
# The same through fo_jax's own host copies: every host access of the engine (prefill loads
# and write-backs, misses, write-through, preemption's page reads) is an FFI copy.
@example(requests=[(True, 1, 9, 8, 0.0, 0), (True, 2, 3, 8, 0.9, 1), (False, 3, 5, 8, 0.0, 0)],
         arrivals=[0, 0, 1, 0, 0, 0], cancels=[(6, 1)], path="ring+ffi",
         pool=(True, "prompt", None))
# Seats, not pages, short (6,150 device bytes: two decoding seats and 6 pages): the youngest
# is preempted keeping its pages and resumes without recompute; the third (a shared prompt:
# its prefill buffers alone pass the budget) is refused.
@example(requests=[(False, 1, 1, 16, 0.0, 0), (False, 2, 1, 12, 0.9, 3), (True, 3, 9, 8, 0.0, 0)],
         arrivals=[0, 0, 3, 0, 0, 0], cancels=[], path="ring",
         pool=(False, "prompt", 6150))
# The same, the oldest growing to the whole pool: the kept pages are dropped while their
# request waits (pages are short now); it resumes by prefilling and replaying.
@example(requests=[(False, 1, 1, 28, 0.0, 0), (False, 2, 1, 12, 0.9, 3)],
         arrivals=[0, 0, 0, 0, 0, 0], cancels=[], path="ring",
         pool=(False, "prompt", 6150))
@given(**SCHEDULE)
def test_random_schedules(requests, arrivals, cancels, path, pool):
    """Random arrival, cancel, prefix-sharing and preemption schedules over a shared pool
    (small enough that requests wait for pages and, with reserve="prompt", running ones are
    preempted and resumed: dropping their pages when pages are short, keeping them when
    device bytes are) and a device budget: every request's tokens equal its solo resident
    run's bit for bit (a cancelled one's are a prefix of them); seats are reused; the
    offloaded state keeps its invariants after every step; when all have ended no page is
    held (the pool and the prefix cache agree; cached pages are mapped by none)."""
    _check_random_schedule(requests, arrivals, cancels, path, pool, CONFIG)


FP8_CONFIG = CONFIG.replace(kv_format="fp8_ds_mla")


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Preemption for sure (as above), with a cancel: pages dropped, the prompt prefilled again.
@example(requests=[(True, 1, 9, 8, 0.0, 0), (True, 2, 3, 8, 0.9, 1), (False, 3, 5, 8, 0.0, 0)],
         arrivals=[0, 0, 1, 0, 0, 0], cancels=[(6, 1)], path="ring",
         pool=(True, "prompt", None))
@given(**SCHEDULE)
def test_random_schedules_with_the_fp8_kv_format(requests, arrivals, cancels, path, pool):
    """`test_random_schedules` with kv_format="fp8_ds_mla" (52-byte uint8 rows in the pool,
    hot cache, tails and prefill buffers; the device budgets then hold more): every request's
    tokens equal its solo run on the resident FP8 engine bit for bit, the invariants hold after
    every step, no page is held at the end."""
    _check_random_schedule(requests, arrivals, cancels, path, pool, FP8_CONFIG)


def test_a_random_schedule_without_overlap():
    """overlap=False (each decode call read back before the step returns; the random
    schedules run with overlap on, the default): the preemption schedule of
    `test_random_schedules`, with a cancel, gives every request its solo tokens too."""
    _check_random_schedule(
        [(True, 1, 9, 8, 0.0, 0), (True, 2, 3, 8, 0.9, 1), (False, 3, 5, 8, 0.0, 0)],
        [0, 0, 1, 0, 0, 0], [(6, 1)], "ring", (True, "prompt", None), CONFIG, overlap=False)


def _check_random_schedule(requests, arrivals, cancels, path, pool, config, overlap=True):
    """Run one random schedule on the offloaded engine of `config` and check it against the
    solo resident runs (`test_random_schedules`)."""
    prefix_cache, reserve, device_bytes = pool
    engine = _engine(path, n=2, prefix_cache=prefix_cache, config=config,
                     reserve=reserve, device_bytes=device_bytes, overlap=overlap)
    assert engine.config.kv_format == config.kv_format
    assert engine.settings.scheduler.overlap == overlap
    prompts = [(SYSTEM if shared else []) + _prompt(seed, length)
               for shared, seed, length, *_ in requests]
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    ids, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            *_, max_tokens, temperature, sample_seed = requests[i]
            try:
                ids[i] = engine.add_request(prompts[i], max_tokens=max_tokens,
                                            temperature=temperature, seed=sample_seed)
            except RequestRefused:  # never fits device_bytes: nothing changed
                assert device_bytes is not None
        for when, i in cancels:
            if when == step and i % len(requests) in ids:
                engine.cancel(ids[i % len(requests)])
        engine.step()
        check_invariants(engine.state, config=config, offload=_offload(path),
                         seats=engine.decoding_seats())
        engine.pool.check()
        assert engine.device_bytes_used() <= (device_bytes or float("inf"))
        step += 1
        assert step < 200
    assert engine.num_running() == 0 and engine.num_waiting() == 0
    outputs = engine.run()
    for i, rid in ids.items():
        *_, max_tokens, temperature, sample_seed = requests[i]
        want, reason = _solo(tuple(prompts[i]), max_tokens, temperature, sample_seed,
                             config=config)
        got = outputs[rid]
        if got.finish_reason == "cancelled":
            assert tuple(got.token_ids) == want[:len(got.token_ids)]
        else:
            assert (tuple(got.token_ids), got.finish_reason) == (want, reason), rid
    occupancy = engine.pool_occupancy()
    assert occupancy["held"] == 0
    assert occupancy["free"] + occupancy["cached"] == occupancy["total"]
    assert engine.device_bytes_used() == 0
    if prefix_cache:
        engine.prefix.check()
    else:
        assert occupancy["cached"] == 0


def test_fp8_cache_schedule_with_preemption_and_a_shared_prefix():
    """kv_format="fp8_ds_mla" (uint8 rows in the pool, hot cache, tails and prefill buffers):
    three requests, two sharing a cached prefix, growing in the 8-page pool until the youngest
    is preempted (pages dropped: its prompt is prefilled again and its tokens replayed), each
    gets the tokens of its solo run on the resident fp8 engine bit for bit."""
    config = CONFIG.replace(kv_format="fp8_ds_mla")
    engine = _engine("ring", config=config, prefix_cache=True, reserve="prompt")
    assert engine.state.host.kv.dtype == np.uint8
    assert engine.kv.costs.page_host_bytes == 4 * config.num_layers * 52  # Z L Y, Y = 52 bytes
    requests = [(SYSTEM + _prompt(1, 9), 8, 0.0, 0), (SYSTEM + _prompt(2, 3), 8, 0.9, 1),
                (_prompt(3, 5), 8, 0.0, 0)]
    ids = [engine.add_request(p, max_tokens=m, temperature=t, seed=s)
           for p, m, t, s in requests]
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine.state, config=config, offload=_offload("ring"),
                         seats=engine.decoding_seats())
    assert engine.counters["preemptions"] > 0
    outputs = engine.run()
    for rid, (prompt, max_tokens, temperature, seed) in zip(ids, requests):
        want, reason = _solo(tuple(prompt), max_tokens, temperature, seed, config=config)
        assert (tuple(outputs[rid].token_ids), outputs[rid].finish_reason) == (want, reason)


def test_more_requests_than_seats_wait_and_reuse_seats():
    # Five requests of 2 pages for three seats (the 8-page pool could hold a fourth; the
    # same shapes as the other tests: another seat count would compile every program again).
    engine = _engine("ring")
    prompts = [_prompt(i, 1 + i % 3) for i in range(5)]
    ids = [engine.add_request(p, max_tokens=5) for p in prompts]
    engine.step()
    assert engine.num_running() == 3 and engine.num_waiting() == 2
    outputs = engine.run()
    for prompt, rid in zip(prompts, ids):
        assert outputs[rid].token_ids == list(_solo(tuple(prompt), 5, 0.0, 0)[0])
        assert outputs[rid].finish_reason == "length"
        assert outputs[rid].time_to_first_token > 0


@pytest.mark.parametrize("path", ["ring", "resident"])
def test_requests_prefilling_together_are_packed_and_get_their_solo_tokens(path):
    # Three requests admitted at once (3 + 2 + 3 pages: the 8-page pool), prompts of 10, 5
    # and 9 tokens (chunks of 8): step 1 packs the three new histories (bucket 0) as 2 + 1,
    # step 2 the two of 8 tokens: 3 programs for 5 chunks (prefill_batch=1: 5), and every
    # request's tokens are those of its solo run, bit for bit (offloaded, against the resident
    # engine too).
    engine = _engine(path, prefill_batch=4)
    prompts = [_prompt(31, 10), _prompt(32, 5), _prompt(33, 9)]
    ids = [engine.add_request(p, max_tokens=2) for p in prompts]
    engine.step()
    assert engine.num_running() == 3 and engine.counters["prefill_calls"] == 2
    outputs = engine.run()
    assert engine.counters["prefill_calls"] == 3 and engine.counters["prefill_tokens"] == 24
    for prompt, rid in zip(prompts, ids):
        assert outputs[rid].token_ids == list(_solo(tuple(prompt), 2, 0.0, 0)[0])


def test_stop_token_and_capacity():
    prompt = _prompt(3, 6)
    want, _ = _solo(tuple(prompt), 8, 0.0, 0)
    engine = _engine("ring")
    rid = engine.add_request(prompt, max_tokens=8, stop_token_ids=[want[2]])
    out = engine.run()[rid]
    assert out.finish_reason == "stop" and out.token_ids == list(want[:want.index(want[2]) + 1])
    # A prompt that fills the seat samples one token and stops: nothing more fits.
    engine = _engine("ring")
    rid = engine.add_request(_prompt(4, CAPACITY), max_tokens=5)
    out = engine.run()[rid]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


class _Letters:
    """A tokenizer stand-in: token t decodes to one letter."""

    def decode(self, ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.mark.parametrize("n", [1, 4])
def test_stop_strings_cut_the_text_whatever_the_steps_per_call(n):
    prompt = _prompt(5, 7)
    want, _ = _solo(tuple(prompt), 10, 0.0, 0)
    text = _Letters().decode(want)
    stop = text[3:5]
    engine = _engine("ring", n=n, tokenizer=_Letters())
    rid = engine.add_request(prompt, max_tokens=10, stop=[stop])
    out = engine.run()[rid]
    at = text.find(stop)
    assert out.finish_reason == "stop" and out.text == text[:at]
    assert out.token_ids == list(want[:at + len(stop)])


def test_cancel_and_release():
    engine = _engine("ring")
    a = engine.add_request(_prompt(1, 9), max_tokens=8)
    b = engine.add_request(_prompt(2, 4), max_tokens=8)
    engine.step()
    assert engine.cancel(a) is True
    assert engine.num_running() == 1
    outputs = engine.run()
    assert outputs[a].finish_reason == "cancelled" and outputs[b].finish_reason == "length"
    assert engine.cancel(a) is False  # already over
    assert engine.release(a).finish_reason == "cancelled"
    with pytest.raises(KeyError, match="no request 'req-0'"):
        engine.cancel(a)
    # The id is free again.
    assert engine.add_request(_prompt(1, 3), request_id=a) == a
    with pytest.raises(ValueError, match="has not finished: cancel it first"):
        engine.release(a)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "prompt must be a non-empty list of token ids"),
    (dict(prompt=[1, 99999]), r"prompt token 99999 at position 1 is outside the vocabulary"),
    (dict(prompt=[1] * (CAPACITY + 1)), f"prompt of {CAPACITY + 1} tokens does not fit a seat "
                                         f"of {CAPACITY} tokens"),
    (dict(max_tokens=0), "max_tokens=0 must be an int >= 1"),
    (dict(temperature=-1.0), r"temperature=-1.0 of request 0 must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 of request 0 must be a number in \(0, 1\]"),
    (dict(stop_token_ids=[CONFIG.vocab_size]),
     r"stop token id 256 at position 0 is outside the vocabulary \[0, 256\)"),
    (dict(stop_token_ids=list(range(9))), "9 stop token ids, at most max_stop_ids=8"),
    (dict(stop=[""]), "stop strings must be non-empty strings"),
    (dict(stop=["x"]), "stop strings need a tokenizer"),
    (dict(request_id="dup"), "request_id 'dup' is already in use"),
    (dict(logprobs=-1), r"logprobs=-1 must be None \(no log-probabilities\) or an int in "
                        r"\[0, max_logprobs=20\]"),
    (dict(logprobs=True), r"logprobs=True must be None \(no log-probabilities\) or an int in"),
    (dict(logprobs=21), r"logprobs=21 must be None .* or an int in \[0, max_logprobs=20\] "
                        r"\(the most likely tokens returned besides the sampled one; "
                        r"Engine\(max_logprobs=...\) raises the bound\)"),
    # Ids past int64 are named, not an OverflowError of a cast (a server's engine thread died
    # of one); values that are not ints are refused, not truncated (1.5 ran as token 1).
    *[(dict(prompt=[1, big]), rf"prompt token {big} at position 1 is outside the vocabulary")
      for big in (2**63, 2**64, 10**30)],
    (dict(prompt=[None]), r"prompt token None at position 0 is not an int \(token ids are "
                          r"ints in \[0, 256\)\)"),
    (dict(prompt=[1.5]), "prompt token 1.5 at position 0 is not an int"),
    (dict(prompt=[1, True]), "prompt token True at position 1 is not an int"),
    (dict(prompt=np.asarray([1.0, 2.0])), "prompt token 1.0 at position 0 is not an int"),
    (dict(prompt="abc"), "prompt token 'a' at position 0 is not an int"),
    (dict(stop_token_ids=[1.7]), "stop token id 1.7 at position 0 is not an int"),
    (dict(stop_token_ids=[False]), "stop token id False at position 0 is not an int"),
    (dict(stop_token_ids=[2**64]), "stop token id 18446744073709551616 at position 0 is "
                                   "outside the vocabulary"),
    (dict(seed=2**64), r"seed=18446744073709551616 must be an int in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=-2**63 - 1), r"seed=-9223372036854775809 must be an int in \[-2\*\*63"),
    (dict(temperature="0.5"), "temperature='0.5' must be a number"),
    (dict(top_p=None), "top_p=None must be a number"),
    (dict(stop=["ab"] * 17), r"17 stop strings, at most 16 per request"),
    (dict(stop=["x" * 257]), r"a stop string of 257 characters, at most 256 per string"),
])
def test_bad_requests_are_refused_before_anything_changes(kwargs, message):
    engine = _engine("ring")
    engine.add_request([1, 2], request_id="dup")
    before = (engine.num_waiting(), dict(engine.counters))
    kwargs = {"prompt": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.add_request(kwargs.pop("prompt"), **kwargs)
    assert (engine.num_waiting(), dict(engine.counters)) == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(seats=0), "seats=0 must be an int >= 1"),
    (dict(capacity=None, offload=None), "capacity .* is required without an OffloadConfig"),
    (dict(capacity=16), "capacity=16 differs from offload.capacity=32"),
    (dict(decode_steps_per_call=0), "decode_steps_per_call=0 must be an int >= 1"),
    (dict(order="lifo"), r"order='lifo' must be one of \('fifo', 'shortest'\)"),
    (dict(max_wait_steps=-1), r"max_wait_steps=-1 must be an int >= 0 \(engine steps a "
     r"request waits before it goes ahead of shorter ones with order='shortest'\) or None"),
    (dict(reserve="all"), r"reserve='all' must be one of \('full', 'prompt'\)"),
    (dict(device_bytes=0), "device_bytes=0 must be an int >= 1 .bytes of device memory for "
                           "request state., or None"),
    # A chunk past max(capacity, the default 256) only pads the prefill buffers: 10**9 was
    # accepted and the first step died of a MemoryError.
    (dict(prefill_chunk=10**9), r"prefill_chunk=1000000000 must be <= max\(capacity, 256\) = "
                                r"256: a prompt fits a seat of capacity=32 tokens"),
])
def test_bad_settings(kwargs, message):
    args = dict(seats=2, capacity=CAPACITY, offload=_offload())
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Engine(_params(), CONFIG, **args)


def _direct_logits(prompt, tokens, seat):
    """The logits each token of `tokens` was sampled from, computed by the engine's programs
    outside it: the prompt prefilled in chunks of 8 into seat `seat` of a fresh resident state
    ([SEATS, 8] programs, the other seats taking 0 tokens), then the tokens but the last fed
    one per decode step ([SEATS, 1], the other seats inactive). [len(tokens), V] float32."""
    state = resident.ResidentState.create(CONFIG, batch=SEATS, capacity=CAPACITY)
    for lo in range(0, len(prompt), 8):
        part = prompt[lo:lo + 8]
        chunk, num_new = np.zeros((SEATS, 8), np.int32), np.zeros((SEATS,), np.int32)
        chunk[seat, :len(part)], num_new[seat] = part, len(part)
        logits, state = resident.prefill(_params(), state, chunk, num_new, config=CONFIG,
                                         query_block=None)
    rows = [np.asarray(logits[seat, len(part) - 1], np.float32)]
    step, active = ResidentStep(CONFIG), np.arange(SEATS) == seat
    for t in tokens[:-1]:
        fed = np.zeros((SEATS, 1), np.int32)
        fed[seat] = t
        logits, state, _ = step(_params(), state, jax.numpy.asarray(fed),
                                jax.numpy.asarray(active))
        rows.append(np.asarray(logits[seat, -1], np.float32))
    return np.stack(rows)


def test_logprobs_equal_the_logits_computed_directly_and_leave_the_tokens_alone():
    """add_request(logprobs=k): every sampled token (the first, from the prefill's logits,
    included) comes with its log-probability and the k most likely tokens', log_softmax of
    the raw logits it was sampled from (before temperature and top_p), equal to the logits of
    the same programs run directly; requesting them changes no token of any request (each
    equals its solo run without logprobs, bit for bit). Resident and offloaded alike."""
    top = 3
    asks = [(_prompt(11, 13), 7, 0.9, 5, top), (_prompt(12, 5), 6, 0.0, 0, None),
            (_prompt(13, 9), 5, 0.0, 0, 0)]
    got = {}
    for path in ("resident", "ring"):
        engine = _engine(path)
        ids = [engine.add_request(p, max_tokens=m, temperature=t, seed=s, logprobs=k)
               for p, m, t, s, k in asks]
        got[path] = engine.run()
        for (prompt, max_tokens, temperature, seed, k), rid in zip(asks, ids):
            out = got[path][rid]
            assert tuple(out.token_ids) == _solo(tuple(prompt), max_tokens, temperature, seed)[0]
            if k is None:
                assert out.logprobs is None
                continue
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
            assert all(len(lp.top) == k for lp in out.logprobs)
    # Offloaded, the logits are those of the resident path bit for bit: so are the logprobs.
    assert [got["ring"][r].logprobs for r in got["ring"]] == \
        [got["resident"][r].logprobs for r in got["resident"]]
    for seat, ((prompt, *_), rid) in enumerate(zip(asks, ids)):
        out = got["resident"][rid]
        if out.logprobs is None:
            continue
        want = np.asarray(jax.nn.log_softmax(_direct_logits(prompt, out.token_ids, seat)))
        np.testing.assert_allclose([lp.logprob for lp in out.logprobs],
                                   want[np.arange(len(want)), out.token_ids], rtol=0, atol=1e-5)
        order = np.argsort(-want, axis=-1, kind="stable")
        for j, lp in enumerate(out.logprobs):
            assert [t for t, _ in lp.top] == order[j, :len(lp.top)].tolist()
            np.testing.assert_allclose([v for _, v in lp.top], want[j, order[j, :len(lp.top)]],
                                       rtol=0, atol=1e-5)
            assert isinstance(lp, TokenLogprobs) and isinstance(lp.logprob, float)


def test_logprobs_follow_the_tokens_a_stop_string_keeps():
    """A text stop string drops the tokens sampled after it in the same decode call: their
    logprobs go with them (one entry per token of token_ids, the token that completed the
    stop string included)."""
    prompt = _prompt(5, 7)
    want, _ = _solo(tuple(prompt), 10, 0.0, 0)
    text = _Letters().decode(want)
    stop = text[2:4]
    end = text.find(stop) + len(stop)  # tokens kept: the prefill's, then calls of 2 tokens
    assert end % 2 == 0, "the stop string must end on the first token of a call"
    engine = _engine("resident", tokenizer=_Letters())
    rid = engine.add_request(prompt, max_tokens=10, stop=[stop], logprobs=1)
    out = engine.run()[rid]
    assert out.token_ids == list(want[:end]) and out.finish_reason == "stop"
    assert [lp.token_id for lp in out.logprobs] == out.token_ids


def test_logprobs_are_refused_with_drafts():
    engine = Engine(_params(), CONFIG.replace(max_ways=2), seats=1, capacity=CAPACITY,
                    num_drafts=1)
    with pytest.raises(ValueError, match=re.escape(
            "logprobs are not computed with drafts (this engine verifies num_drafts=1 drafts "
            "per step): serve without drafts (num_drafts=0) to have them, or drop logprobs")):
        engine.add_request([1, 2, 3], logprobs=0)
    assert engine.num_waiting() == 0


def test_prefix_reuse_skips_the_shared_chunks():
    engine = _engine("ring", prefix_cache=True)
    first = engine.add_request(SYSTEM + _prompt(1, 5), max_tokens=3)
    engine.run()
    before = engine.counters["prefill_tokens"]
    prompt = SYSTEM + _prompt(2, 7)
    second = engine.add_request(prompt, max_tokens=4)
    out = engine.run()
    # The 16 system tokens (two whole chunks) come from the cache; 7 are prefilled.
    assert engine.counters["prefix_hit_tokens"] == 16
    assert engine.counters["prefill_tokens"] - before == 7
    assert tuple(out[second].token_ids) == _solo(tuple(prompt), 4, 0.0, 0)[0]
    assert out[first].finish_reason == "length"


def test_pool_settings_and_sizes_are_checked():
    for kwargs in (dict(num_pages=8), dict(reserve="prompt"), dict(device_bytes=10**6)):
        with pytest.raises(ValueError, match=re.escape(
                "num_pages, host_pool_bytes, device_bytes and reserve='prompt' need a page pool"
                " (an OffloadConfig): the resident path (offload=None) has fixed seats of "
                "`capacity` tokens each, allocated once, so nothing runs out mid-decode and "
                "there is nothing to admit or preempt by bytes; for admission and preemption "
                "by device bytes with the KV on the device, use the paged device pool, "
                "offload=OffloadConfig(..., host_memory_kind='device') (or 'pinned_host' to "
                "offload the KV to host memory)")):
            _engine("resident", **kwargs)
    with pytest.raises(ValueError, match="give num_pages or host_pool_bytes, not both"):
        _engine("ring", num_pages=8, host_pool_bytes=10**6)
    # Sized in bytes: a page holds Z tokens of every layer's KV row.
    page_bytes = CONFIG.num_layers * 4 * CONFIG.kv_width * CONFIG.jnp_kv_dtype.itemsize
    assert _engine("ring", host_pool_bytes=10 * page_bytes + 1).pool.num_pages == 10
    with pytest.raises(ValueError, match="holds no page of 4 tokens"):
        _engine("ring", host_pool_bytes=page_bytes - 1)
    with pytest.raises(ValueError, match="prefill_chunk=6 to be a multiple of page_size=4"):
        Engine(_params(), CONFIG, seats=2, offload=_offload(), prefill_chunk=6,
               prefix_cache=True)
    engine = _engine("ring", num_pages=4)
    with pytest.raises(ValueError, match=r"prompt of 10 tokens \+ max_tokens=8 needs 5 pages "
                                         "of 4 tokens, but the pool holds 4"):
        engine.add_request(_prompt(0, 10), max_tokens=8)
    assert engine.num_waiting() == 0


def test_a_prefix_is_shared_while_it_is_still_being_prefilled():
    """Pages register as soon as their chunk is prefilled: a request admitted while another
    is still prefilling the same system prompt maps the chunks done so far (5 pages each,
    2 of them shared, in the 8-page pool)."""
    engine = _engine("ring", prefix_cache=True)
    first = engine.add_request(SYSTEM + _prompt(1, 1), max_tokens=1)
    engine.step()  # first chunk of `first` prefilled
    prompt = SYSTEM + _prompt(2, 2)
    second = engine.add_request(prompt, max_tokens=1)
    out = engine.run()
    assert engine.counters["prefix_hit_tokens"] == 8
    assert tuple(out[second].token_ids) == _solo(tuple(prompt), 1, 0.0, 0)[0]
    assert tuple(out[first].token_ids) == _solo(tuple(SYSTEM + _prompt(1, 1)), 1, 0.0, 0)[0]


def test_device_bytes_refuse_what_never_fits_and_queue_what_fits_later():
    """The planner's device bytes (tiny model, Z=4, C=8, 2 buffers): seat 2,592 B, indexer
    keys 144 B per page, prefill buffers 640 B per prompt page."""
    engine = _engine("ring", device_bytes=5000)
    with pytest.raises(RequestRefused, match=re.escape(
            "prompt of 10 tokens + max_tokens=8 can never fit device_bytes=5,000: alone it needs"
            " 5,232 bytes of device memory (seat hot cache 2,592 + prefill buffers 1,920 + "
            "indexer-key pages 720 for 5 pages of 4 tokens); shorten the prompt or max_tokens, "
            "or raise device_bytes")):
        engine.add_request(_prompt(0, 10), max_tokens=8)
    assert engine.num_waiting() == 0
    # 5,088 B each alone (3 prompt pages, 4 pages): the second waits for the first to end.
    engine = _engine("ring", device_bytes=6000)
    prompts = [_prompt(1, 9), _prompt(2, 9)]
    ids = [engine.add_request(p, max_tokens=6) for p in prompts]
    engine.step()
    assert engine.num_running() == 1 and engine.waiting_ids() == [ids[1]]
    assert engine.device_bytes_used() == 2592 + 3 * 640 + 4 * 144
    while engine.has_unfinished():
        engine.step()
        assert engine.device_bytes_used() <= 6000
    outputs = engine.run()
    for rid, prompt in zip(ids, prompts):
        assert tuple(outputs[rid].token_ids) == _solo(tuple(prompt), 6, 0.0, 0)[0]


@pytest.mark.parametrize("order", ["fifo", "shortest"])
def test_queue_order(order):
    """An 8-page pool: the long request (32 tokens, 8 pages) first blocks the two short ones
    (2 pages each) with "fifo"; with "shortest" they go first, together."""
    engine = _engine("ring", order=order)
    long = engine.add_request(_prompt(1, 17), max_tokens=15)
    short = [engine.add_request(_prompt(2, 3), max_tokens=2),
             engine.add_request(_prompt(3, 5), max_tokens=3)]
    if order == "fifo":
        assert engine.waiting_ids() == [long] + short
    else:
        assert engine.waiting_ids() == short + [long]
    engine.step()
    assert engine.waiting_ids() == (short if order == "fifo" else [long])
    outputs = engine.run()
    assert all(out.finish_reason == "length" for out in outputs.values())


@pytest.mark.parametrize("max_wait_steps", [None, 3])
def test_shortest_first_ages_a_waiting_request(max_wait_steps):
    """order="shortest": a long request waits while a short one arrives at every step.
    Without aging it stays behind all of them; with max_wait_steps=3 it heads the queue once
    it has waited 3 steps (the shorts that waited as long follow it, in arrival order). The
    queue only: no program runs."""
    engine = _engine("resident", seats=1, order="shortest", max_wait_steps=max_wait_steps)
    long = engine.add_request(_prompt(1, 17), max_tokens=15)
    shorts = []
    for step in range(1, 7):
        engine.counters["steps"] = step  # what `step()` counts
        shorts.append(engine.add_request(_prompt(2 + step, 3), max_tokens=2))
        if max_wait_steps is not None and step >= max_wait_steps:
            assert engine.waiting_ids() == [long] + shorts
        else:
            assert engine.waiting_ids() == shorts + [long]


def test_preemption_takes_the_youngest_and_keeps_its_tokens():
    """reserve="prompt" in an 8-page pool: both requests start (4 + 3 pages), then the older
    one's growth preempts the younger one (temperature 0.9: its key is kept too), dropping
    its pages (pages are short), and it resumes once there is room, prefills its prompt
    again and replays its tokens."""
    engine = _engine("ring", reserve="prompt")
    old = engine.add_request(_prompt(1, 13), max_tokens=12)
    young = engine.add_request(_prompt(2, 9), max_tokens=12, temperature=0.9, seed=3)
    while engine.counters["preemptions"] == 0:
        engine.step()
    assert engine.waiting_ids() == [young] and engine.num_running() == 1
    outputs = engine.run()
    assert engine.counters["replayed_tokens"] > 0
    # Pages, not device bytes, were short: keeping them would not have helped.
    assert engine.counters["preemptions_kept_pages"] == 0
    assert engine.counters["resumed_without_recompute"] == 0
    assert tuple(outputs[old].token_ids) == _solo(tuple(_prompt(1, 13)), 12, 0.0, 0)[0]
    assert tuple(outputs[young].token_ids) == _solo(tuple(_prompt(2, 9)), 12, 0.9, 3)[0]
    assert engine.pool_occupancy()["free"] == 8


def _two_growing(max_tokens_old, **kwargs):
    """reserve="prompt", a device budget of 6,150 B (tiny model, Z=4: seat 2,592 B, indexer
    keys 144 B per page, prefill buffers 640 B per prompt page): two decoding requests of a
    1-token prompt fit with up to 6 pages (5,184 + 864), not 7, while the 8-page pool still
    has pages; the younger one (temperature 0.9: its key is kept too) is admitted once the
    older one decodes (2,736 + 2,592 + 640 + 144 = 6,112 B)."""
    engine = _engine("ring", reserve="prompt", device_bytes=6150, **kwargs)
    old = engine.add_request(_prompt(1, 1), max_tokens=max_tokens_old)
    young = engine.add_request(_prompt(2, 1), max_tokens=12, temperature=0.9, seed=3)
    return engine, old, young


def _held(engine, request_id):
    pages = engine._requests[request_id].pages  # the engine's own record of its pages
    return 0 if pages is None else pages.num_pages


def test_a_device_bound_preemption_keeps_the_pages_and_resumes_without_recompute():
    """Seats, not pages, are short: the younger request is preempted keeping its pages (held
    in the pool while it waits, its seat's bytes freed) and resumes once the older one ends,
    with no prefill and no replay: its tokens are those of its solo run bit for bit."""
    engine, old, young = _two_growing(16)
    while engine.counters["preemptions"] == 0:
        engine.step()
        assert engine.device_bytes_used() <= 6150
    assert engine.waiting_ids() == [young] and engine.num_running() == 1
    assert engine.counters["preemptions_kept_pages"] == 1
    kept = _held(engine, young)
    assert kept > 0 and engine.pool_occupancy()["held"] == _held(engine, old) + kept
    prefill_calls = engine.counters["prefill_calls"]
    while engine.has_unfinished():
        engine.step()
        assert engine.device_bytes_used() <= 6150
    assert engine.counters["prefill_calls"] == prefill_calls  # nothing prefilled again
    assert engine.counters["resumed_without_recompute"] >= 1
    assert engine.counters["replayed_tokens"] == 0
    assert engine.counters["preemptions"] == engine.counters["preemptions_kept_pages"]
    outputs = engine.run()
    assert tuple(outputs[old].token_ids) == _solo(tuple(_prompt(1, 1)), 16, 0.0, 0)[0]
    assert tuple(outputs[young].token_ids) == _solo(tuple(_prompt(2, 1)), 12, 0.9, 3)[0]
    assert engine.pool_occupancy()["held"] == 0 and engine.device_bytes_used() == 0


def test_kept_pages_are_dropped_when_the_pool_runs_short():
    """The older request grows to the whole pool (29 tokens, 8 pages): the pages the waiting
    younger one kept are dropped (pages, not bytes, are short now) and it resumes by
    prefilling and replaying, with its tokens unchanged."""
    engine, old, young = _two_growing(28)
    while engine.counters["preemptions"] == 0:
        engine.step()
    assert _held(engine, young) > 0
    while _held(engine, young) > 0:
        engine.step()
    assert engine.waiting_ids() == [young]  # its pages dropped while it waited
    outputs = engine.run()
    assert engine.counters["replayed_tokens"] > 0
    assert tuple(outputs[old].token_ids) == _solo(tuple(_prompt(1, 1)), 28, 0.0, 0)[0]
    assert tuple(outputs[young].token_ids) == _solo(tuple(_prompt(2, 1)), 12, 0.9, 3)[0]
    assert engine.pool_occupancy()["held"] == 0


def test_cancelling_a_request_that_kept_its_pages_releases_them():
    engine, old, young = _two_growing(16)
    while engine.counters["preemptions"] == 0:
        engine.step()
    assert _held(engine, young) > 0
    assert engine.cancel(young) is True
    assert engine.pool_occupancy()["held"] == _held(engine, old)
    outputs = engine.run()
    assert outputs[young].finish_reason == "cancelled" and engine.num_waiting() == 0
    assert tuple(outputs[old].token_ids) == _solo(tuple(_prompt(1, 1)), 16, 0.0, 0)[0]
    assert engine.pool_occupancy()["held"] == 0


def test_a_request_that_kept_its_pages_resumes_only_when_the_call_leaves_it_its_seat():
    """The budget set so that the waiting request's seat fits but not beside the page the
    older request needs for the coming call: it stays waiting (resuming would only get it
    preempted again by that call's growth, its join wasted) and resumes when it can decode."""
    engine, old, young = _two_growing(16)
    while engine.counters["preemptions"] == 0:
        engine.step()
    costs, waiting = engine.kv.costs, engine._requests[young]
    running = engine._requests[old]
    while running.pages.pages_needed(engine.scheduler.tokens_needed(running)) == 0:
        engine.step()
    need = waiting.pages.pages_needed(engine.scheduler.tokens_needed(waiting))
    engine.scheduler.device_bytes = (engine.device_bytes_used() + costs.seat_device_bytes
                                     + need * costs.page_device_bytes)  # one page short of both
    outputs = {o.request_id: o for o in engine.step()}
    assert engine.waiting_ids() == [young] and young not in outputs
    assert engine.counters["preemptions"] == 1 and engine.counters["resumed_without_recompute"] == 0
    engine.scheduler.device_bytes = 10**6
    outputs = engine.run()
    assert engine.counters["resumed_without_recompute"] == 1
    assert tuple(outputs[young].token_ids) == _solo(tuple(_prompt(2, 1)), 12, 0.9, 3)[0]
    assert tuple(outputs[old].token_ids) == _solo(tuple(_prompt(1, 1)), 16, 0.0, 0)[0]


# Overlap: decode call n + 1 dispatched before call n is read back -----------------------------


def _log_calls(engine):
    """Record the engine's decode calls in order: ("dispatch", k) when call k is dispatched,
    ("read", k) when its tokens are read back (`DecodeRunner.dispatch`, `InFlight.tokens`)."""
    events, dispatch = [], engine.runner.dispatch

    def logged(running, **kwargs):
        call = dispatch(running, **kwargs)
        number, read = sum(e[0] == "dispatch" for e in events), call.tokens
        events.append(("dispatch", number))

        def tokens():
            events.append(("read", number))
            return read()

        call.tokens = tokens
        return call

    engine.runner.dispatch = logged
    return events


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_dispatches_the_next_call_before_reading_the_last(overlap):
    """With overlap each step dispatches decode call k + 1 and only then reads call k's tokens
    (the device computes k + 1 while the host records k, and the caller streams); the last
    call, dispatched before the host knew the request had finished, is read back at once (no
    call is left in flight). Without overlap each call is read back before the next is
    dispatched. The tokens are the solo run's either way."""
    prompt = _prompt(3, 6)
    engine = _engine("ring", overlap=overlap)
    rid = engine.add_request(prompt, max_tokens=9)
    events = _log_calls(engine)
    out = engine.run()[rid]
    assert tuple(out.token_ids) == _solo(tuple(prompt), 9, 0.0, 0)[0]
    calls = sum(e[0] == "dispatch" for e in events)
    assert sorted(events) == sorted([(e, k) for k in range(calls) for e in ("dispatch", "read")])
    if overlap:
        assert events[:3] == [("dispatch", 0), ("dispatch", 1), ("read", 0)]
        for k in range(calls - 1):
            assert events.index(("dispatch", k + 1)) < events.index(("read", k))
        assert calls == 5  # 8 tokens in calls of 2, + the one dispatched after the last
    else:
        assert events == [(e, k) for k in range(calls) for e in ("dispatch", "read")]
        assert calls == 4
    assert engine.runner.in_flight is None and not engine.scheduler.unread
    assert engine.timings["device_busy_s"] > 0 and engine.timings["device_idle_s"] >= 0


def test_overlap_finished_requests_emit_nothing_more_and_their_seats_go_on_cleanly():
    """The host learns of a finish one call later: a request ending on a stop token (masked
    on the device in the call already in flight) and one ending on a stop string (seen by the
    host only: the call in flight decodes it once more, its tokens dropped, its pages written
    past its end) emit nothing after their stop, and the requests that take their seats (and
    pages) next get their solo tokens; the state's invariants hold after every step and no
    page stays held."""
    engine = _engine("ring", n=1, tokenizer=_Letters())
    first = _prompt(3, 6)
    want_first, _ = _solo(tuple(first), 8, 0.0, 0)
    second = _prompt(5, 7)
    want_second, _ = _solo(tuple(second), 10, 0.0, 0)
    text = _Letters().decode(want_second)
    stop = text[3:5]
    a = engine.add_request(first, max_tokens=8, stop_token_ids=[want_first[2]])
    b = engine.add_request(second, max_tokens=10, stop=[stop])
    others = [(_prompt(7, 5), 12), (_prompt(8, 4), 6), (_prompt(9, 3), 6)]
    ids = [engine.add_request(p, max_tokens=m) for p, m in others]  # two wait for a and b
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine.state, config=CONFIG, offload=_offload("ring"),
                         seats=engine.decoding_seats())
        engine.pool.check()
    outputs = engine.run()
    assert outputs[a].finish_reason == "stop"
    assert outputs[a].token_ids == list(want_first[:want_first.index(want_first[2]) + 1])
    at = text.find(stop)
    assert outputs[b].finish_reason == "stop" and outputs[b].text == text[:at]
    assert outputs[b].token_ids == list(want_second[:at + len(stop)])
    for rid, (prompt, max_tokens) in zip(ids, others):
        assert tuple(outputs[rid].token_ids) == _solo(tuple(prompt), max_tokens, 0.0, 0)[0]
    assert engine.pool_occupancy()["held"] == 0


def test_overlap_cancel_while_its_call_is_in_flight():
    """A request cancelled while a decode call that runs it is in flight gets no token of
    that call (its seat's results are dropped at the read back); the waiting requests that
    take its seat and pages, the first at the next step, before that call is read, get their
    solo tokens."""
    engine = _engine("ring")
    a = engine.add_request(_prompt(1, 9), max_tokens=8)
    kept = [(_prompt(2, 4), 8), (_prompt(4, 5), 8), (_prompt(6, 3), 6)]
    ids = [engine.add_request(p, max_tokens=m) for p, m in kept]  # the last ones wait
    while a not in engine.scheduler.unread:  # its prompt takes two prefill chunks
        engine.step()
    assert engine.runner.in_flight is not None and engine.num_waiting() >= 1
    before = len(engine.requests()[a].tokens)
    assert engine.cancel(a) is True
    outputs = engine.run()
    assert outputs[a].finish_reason == "cancelled" and len(outputs[a].token_ids) == before
    assert tuple(outputs[a].token_ids) == _solo(tuple(_prompt(1, 9)), 8, 0.0, 0)[0][:before]
    for rid, (prompt, max_tokens) in zip(ids, kept):
        assert tuple(outputs[rid].token_ids) == _solo(tuple(prompt), max_tokens, 0.0, 0)[0]
    assert engine.pool_occupancy()["held"] == 0


def test_overlap_reads_the_call_in_flight_back_before_a_preemption():
    """reserve="prompt" under overlap: a request of the call in flight grows for that call's
    tokens too, and when the pool runs short the call in flight is read back before anyone is
    preempted (the victim's tokens, key and state exact); both get their solo tokens."""
    engine = _engine("ring", reserve="prompt")
    seen, preempt = [], engine._preempt

    def checked(req, **kwargs):
        seen.append(engine.runner.in_flight)
        return preempt(req, **kwargs)

    engine._preempt = checked
    old = engine.add_request(_prompt(1, 13), max_tokens=12)
    young = engine.add_request(_prompt(2, 9), max_tokens=12, temperature=0.9, seed=3)
    outputs = engine.run()
    assert seen and all(call is None for call in seen)
    assert tuple(outputs[old].token_ids) == _solo(tuple(_prompt(1, 13)), 12, 0.0, 0)[0]
    assert tuple(outputs[young].token_ids) == _solo(tuple(_prompt(2, 9)), 12, 0.9, 3)[0]
    assert engine.pool_occupancy()["free"] == 8


def test_the_device_clock_counts_the_gaps_between_work_in_dispatch_order():
    """`DeviceClock`: work begun in dispatch order, ended out of order (a decode call in
    flight ends after the prefill dispatched behind it), counted in dispatch order: idle is the
    gap between the end of one and the start of the next, from the last `rest`."""
    clock, timings = DeviceClock(), {}
    clock.rest(0.0)
    call = clock.begin(1.0)  # dispatched at 1 s: idle 1 s since the rest
    prefill = clock.begin(2.0)  # behind the call: starts when it ends, at 3 s
    clock.end(prefill, 4.0, timings)
    assert timings == {}  # waits for the call before it
    clock.end(call, 3.0, timings)
    assert timings == {"device_idle_s": 1.0, "device_busy_s": 3.0}
    clock.end(clock.begin(4.5), 5.0, timings)  # 0.5 s idle, 0.5 s busy
    assert timings == {"device_idle_s": 1.5, "device_busy_s": 3.5}


def test_overlap_export_seat_reads_the_call_in_flight_back_first():
    """`export_seat` with a decode call in flight reads it back first (`Engine.synchronize`):
    the request leaves with every token the device sampled for it, its exact length and
    count, and in another engine it goes on to its solo tokens."""
    prompt = _prompt(3, 6)
    source, target = _engine("ring"), _engine("ring")
    rid = source.add_request(prompt, max_tokens=12)
    while rid not in source.scheduler.unread or len(source.requests()[rid].tokens) < 3:
        source.step()
    moved = source.export_seat(rid, rows=CAPACITY)
    assert source.runner.in_flight is None and not source.has_unfinished()
    tokens = moved.request.tokens
    assert (moved.length, moved.generated) == (len(prompt) + len(tokens) - 1, len(tokens))
    assert target.import_seat(moved)
    out = target.run()[rid]
    assert tuple(out.token_ids) == _solo(tuple(prompt), 12, 0.0, 0)[0]
    assert source.pool_occupancy()["held"] == target.pool_occupancy()["held"] == 0

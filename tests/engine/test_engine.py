"""Continuous batching (fo_jax.engine.engine): requests that join and leave while others decode
get exactly the tokens they get alone, offloaded or resident; bad requests are refused before
anything changes; cancel, release, stop tokens and stop strings."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fo_jax.config import get_config
from fo_jax.engine.engine import Engine
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants

# Two layers sharing one indexer, top-4: small programs. Seats of 32 tokens, pages of 4.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
CAPACITY = 32
SEATS = 3


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _offload(policy="ring"):
    return OffloadConfig(hot_slots=8, page_size=4, capacity=CAPACITY, policy=policy)


def _engine(path="ring", *, n=2, seats=SEATS, tokenizer=None, **kwargs):
    offload = None if path == "resident" else _offload(path)
    return Engine(_params(), CONFIG, seats=seats, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=n, prefill_chunk=8, query_block=None,
                  tokenizer=tokenizer, **kwargs)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


@functools.cache
def _solo(prompt, max_tokens, temperature, seed, stop_ids=()):
    """The request alone in a resident engine of the same seats: the reference."""
    engine = _engine("resident")
    rid = engine.add_request(list(prompt), max_tokens=max_tokens, temperature=temperature,
                             seed=seed, stop_token_ids=stop_ids)
    out = engine.run()[rid]
    return tuple(out.token_ids), out.finish_reason


REQUEST = st.tuples(st.integers(0, 10**6), st.integers(1, 20), st.integers(1, 8),
                    st.sampled_from([0.0, 0.9]), st.integers(0, 5))


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests=st.lists(REQUEST, min_size=2, max_size=6),
       arrivals=st.lists(st.integers(0, 4), min_size=6, max_size=6),
       cancels=st.lists(st.integers(0, 5), max_size=2),
       path=st.sampled_from(["ring", "clock"]))
def test_tokens_do_not_depend_on_the_batch(requests, arrivals, cancels, path):
    """Random arrival and cancel schedules: every request's tokens equal its solo resident
    run's bit for bit (a cancelled one's are a prefix of them); seats are reused; the
    offloaded state keeps its invariants after every step."""
    engine = _engine(path, n=2)
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    ids, step = {}, 0
    cancel_at = {c % len(requests): step_no for step_no, c in enumerate(cancels, start=2)}
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            seed, length, max_tokens, temperature, sample_seed = requests[i]
            ids[i] = engine.add_request(_prompt(seed, length), max_tokens=max_tokens,
                                        temperature=temperature, seed=sample_seed)
        for i, when in cancel_at.items():
            if when == step and i in ids:
                engine.cancel(ids[i])
        engine.step()
        if path != "resident":
            check_invariants(engine.state, config=CONFIG, offload=_offload(path),
                             seats=engine.decoding_seats())
        step += 1
        assert step < 200
    assert engine.num_running() == 0 and engine.num_waiting() == 0
    outputs = engine.run()
    for i, rid in ids.items():
        seed, length, max_tokens, temperature, sample_seed = requests[i]
        want, reason = _solo(tuple(_prompt(seed, length)), max_tokens, temperature, sample_seed)
        got = outputs[rid]
        if got.finish_reason == "cancelled":
            assert tuple(got.token_ids) == want[:len(got.token_ids)]
        else:
            assert (tuple(got.token_ids), got.finish_reason) == (want, reason), rid


def test_more_requests_than_seats_wait_and_reuse_seats():
    engine = _engine("ring", seats=2)
    ids = [engine.add_request(_prompt(i, 5 + i), max_tokens=6) for i in range(5)]
    engine.step()
    assert engine.num_running() == 2 and engine.num_waiting() == 3
    outputs = engine.run()
    for i, rid in enumerate(ids):
        assert outputs[rid].token_ids == list(_solo(tuple(_prompt(i, 5 + i)), 6, 0.0, 0)[0])
        assert outputs[rid].finish_reason == "length"
        assert outputs[rid].time_to_first_token > 0


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
    (dict(stop_token_ids=[CONFIG.vocab_size]), "stop_token_ids .* must be ids in"),
    (dict(stop_token_ids=list(range(9))), "9 stop token ids, at most max_stop_ids=8"),
    (dict(stop=[""]), "stop strings must be non-empty strings"),
    (dict(stop=["x"]), "stop strings need a tokenizer"),
    (dict(request_id="dup"), "request_id 'dup' is already in use"),
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
])
def test_bad_settings(kwargs, message):
    args = dict(seats=2, capacity=CAPACITY, offload=_offload())
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Engine(_params(), CONFIG, **args)


SYSTEM = _prompt(99, 16)  # a shared "system prompt": two prefill chunks, four pages


@settings(max_examples=2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(requests=[(True, 1, 9, 6), (True, 2, 3, 2), (True, 3, 5, 4)], cancel=8)
@given(requests=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6), st.integers(1, 9),
                                   st.integers(1, 6)), min_size=3, max_size=6),
       cancel=st.integers(0, 8))
def test_shared_pool_and_prefix_reuse(requests, cancel):
    """A pool smaller than seats x capacity (requests wait for pages) and the prefix cache
    (requests that share the system prompt map its pages instead of prefilling them): every
    request's tokens still equal its solo resident run, and when all have ended no page is
    held (the pool and cache agree; cached pages are mapped by none)."""
    engine = _engine("ring", num_pages=12, prefix_cache=True)
    prompts = [(SYSTEM if shared else []) + _prompt(seed, length)
               for shared, seed, length, _ in requests]
    ids = [engine.add_request(p, max_tokens=m) for p, (*_, m) in zip(prompts, requests)]
    step = 0
    while engine.has_unfinished():
        if step == cancel:
            engine.cancel(ids[-1])
        engine.step()
        check_invariants(engine.state, config=CONFIG, offload=_offload(),
                         seats=engine.decoding_seats())
        engine.pool.check()
        step += 1
    outputs = engine.run()
    for rid, prompt, (*_, max_tokens) in zip(ids, prompts, requests):
        want, reason = _solo(tuple(prompt), max_tokens, 0.0, 0)
        got = outputs[rid]
        if got.finish_reason == "cancelled":
            assert tuple(got.token_ids) == want[:len(got.token_ids)]
        else:
            assert (tuple(got.token_ids), got.finish_reason) == (want, reason), rid
    occupancy = engine.pool_occupancy()
    assert occupancy["held"] == 0 and occupancy["free"] + occupancy["cached"] == 12
    engine.prefix.check()


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
    with pytest.raises(ValueError, match="num_pages, host_pool_bytes and prefix_cache need the "
                                         "offloaded path"):
        _engine("resident", num_pages=8)
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
    is still prefilling the same system prompt maps the chunks done so far."""
    engine = _engine("ring", prefix_cache=True)
    first = engine.add_request(SYSTEM + _prompt(1, 5), max_tokens=3)
    engine.step()  # first chunk of `first` prefilled
    prompt = SYSTEM + _prompt(2, 7)
    second = engine.add_request(prompt, max_tokens=4)
    out = engine.run()
    assert engine.counters["prefix_hit_tokens"] == 8
    assert tuple(out[second].token_ids) == _solo(tuple(prompt), 4, 0.0, 0)[0]
    assert tuple(out[first].token_ids) == _solo(tuple(SYSTEM + _prompt(1, 5)), 3, 0.0, 0)[0]

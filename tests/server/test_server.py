"""`fo-jax serve` (fo_jax.server): the OpenAI client against the server on loopback; greedy
output equals the engine's own; backpressure (429), refused requests (400), bad fields (422),
disconnects cancel, metrics add up, graceful shutdown."""

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from fo_jax import resident
from fo_jax.embedded import load_embedded
from fo_jax.engine import Engine
from fo_jax.server.protocol import simple_chat_template
from fo_jax.server.serve import ServerThread, build_served, final_report, warm_up

# The embedded model (read from the package in 0.3 s; random tiny weights take longer to make),
# two seats of 64 tokens, resident, with a prefix store (n > 1 shares its prompt): small
# programs.
CONFIG, PARAMS, TOKENIZER = load_embedded()
CAPACITY = 64
SEATS = 2
MAX_QUEUE = 2
NAME = CONFIG.name
SEP = TOKENIZER.sep  # the server's default stop token


def _engine():
    return Engine(PARAMS, CONFIG, seats=SEATS, capacity=CAPACITY, decode_steps_per_call=2,
                  prefill_chunk=8, query_block=None, tokenizer=TOKENIZER, prefix_cache=True)


def _start(max_queue=MAX_QUEUE, shutdown_timeout=2.0):
    engine = _engine()
    warm_up(engine)
    served = build_served(engine, TOKENIZER, model_name=NAME, max_queue=max_queue,
                          shutdown_timeout=shutdown_timeout)
    return ServerThread(served, shutdown_timeout=shutdown_timeout).start()


def _n(text):
    return len(TOKENIZER.encode(text))


@pytest.fixture(scope="module")
def server():
    srv = _start()
    try:
        yield srv
    finally:
        assert srv.stop(timeout=20)


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)


def _metrics(srv) -> dict:
    out = {}
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _idle(srv, timeout=10.0):
    """Wait until the engine has neither running nor waiting requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _metrics(srv)
        if m["fojax_requests_running"] == 0 and m["fojax_requests_waiting"] == 0 and \
                srv.served.driver.in_flight() == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"still busy: {m}")


def test_models_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [NAME]


def test_completion_greedy_equals_engine(server):
    """Greedy tokens over HTTP equal the engine's own for the same request, streamed or not."""
    prompt = "def read_lines(path):"
    reference = _engine()
    rid = reference.add_request(TOKENIZER.encode(prompt), max_tokens=10, temperature=0.0,
                                stop_token_ids=[SEP])
    ref = reference.run()[rid]
    assert ref.finish_reason == "length"
    client = _client(server)
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) \
        == (_n(prompt), 10, _n(prompt) + 10)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_serve_kv_format_flag_builds_an_fp8_engine_that_answers():
    """`fo-jax serve --kv-format fp8_ds_mla`: the engine its flags build stores FP8 rows (uint8,
    `kv_row_width` bytes) and the server's greedy tokens are that engine's own."""
    import argparse

    from fo_jax.server.serve import add_engine_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-format", "fp8_ds_mla", "--seats", "1", "--capacity",
                              str(CAPACITY), "--prefill-chunk", "8", "--no-progress"])
    engine, config, tokenizer, offload = build_engine(args)
    assert offload is None and config.kv_format == engine.config.kv_format == "fp8_ds_mla"
    assert engine.state.kv.dtype == np.uint8
    assert engine.state.kv.shape[-1] == config.kv_row_width
    reference = build_engine(args)[0]
    prompt = "def read_lines(path):"
    rid = reference.add_request(tokenizer.encode(prompt), max_tokens=4, temperature=0.0,
                                stop_token_ids=[SEP])
    ref = reference.run()[rid]
    served = build_served(engine, tokenizer, model_name=config.name, shutdown_timeout=2.0)
    srv = ServerThread(served, shutdown_timeout=2.0).start()
    try:
        resp = _client(srv).completions.create(model=config.name, prompt=prompt, max_tokens=4,
                                               temperature=0,
                                               extra_body={"return_token_ids": True})
    finally:
        assert srv.stop(timeout=20)
    assert resp.choices[0].model_extra["token_ids"] == ref.token_ids
    assert resp.choices[0].text == ref.text


def test_chat_streaming_and_not(server):
    client = _client(server)
    messages = [{"role": "user", "content": "hello"}]
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                          temperature=0)
    text = resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == _n("user: hello\nassistant:")
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_is_cut_and_sampling_is_seeded(server):
    client = _client(server)
    kwargs = dict(model=NAME, prompt="abc", max_tokens=12, temperature=1.0, seed=7)
    a = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == a
    stop = a[3:5]
    assert len(stop) == 2, a
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.text == a[:a.find(stop)] and cut.finish_reason == "stop"
    streamed = client.completions.create(stop=stop, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == a[:a.find(stop)]


def test_usage_counts_the_token_that_completed_a_stop_string(server):
    """vLLM's convention: completion_tokens counts every token generated, the one that
    completed a stop string included, though the text drops the stop string (and that token's
    text with it); each counted token has its logprob. Streamed or not."""
    client = _client(server)
    kwargs = dict(model=NAME, prompt="abc", max_tokens=12, temperature=1.0, seed=7,
                  extra_body={"return_token_ids": True})
    full = client.completions.create(**kwargs).choices[0]
    ids, text = full.model_extra["token_ids"], full.text
    stop = text[3:5]
    end = next(j + 1 for j in range(len(ids)) if stop in TOKENIZER.decode(ids[:j + 1]))
    cut = client.completions.create(stop=[stop], logprobs=0, **kwargs)
    choice = cut.choices[0]
    assert choice.text == text[:text.find(stop)] and choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == ids[:end]
    assert cut.usage.completion_tokens == end == len(choice.logprobs.tokens)
    assert len(TOKENIZER.decode(ids[:end])) >= len(choice.text) + len(stop)
    chunks = list(client.completions.create(stop=[stop], stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == end


def test_bad_requests(server):
    url = server.url + "/v1/completions"
    bad = httpx.post(url, json={"prompt": "x", "temperature": -1})
    assert bad.status_code == 422
    assert bad.json()["error"]["param"] == "temperature"
    assert "temperature" in bad.json()["error"]["message"]
    missing = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "messages"
    broken = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400
    assert broken.json()["error"]["message"].startswith("malformed JSON body")
    long = httpx.post(url, json={"prompt": [1] * (CAPACITY + 1), "max_tokens": 1})
    assert long.status_code == 400
    assert long.json()["error"]["message"] == (
        f"prompt of {CAPACITY + 1} tokens does not fit a seat of {CAPACITY} tokens: shorten it "
        "or raise the capacity")
    vocab = httpx.post(url, json={"prompt": [1, CONFIG.vocab_size]})
    assert vocab.status_code == 400 and "outside the vocabulary" in vocab.text
    other = httpx.post(url, json={"prompt": "x", "model": "gpt-4"})
    assert other.status_code == 404 and repr(NAME) in other.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="does not fit a seat"):
        _client(server).completions.create(model=NAME, prompt="import os\n" * 40,
                                          max_tokens=1)


def test_wrong_types_and_unimplemented_fields_are_refused_by_name(server):
    """No coercion (a boolean max_tokens, a prompt of booleans or floats: 422 naming the
    field) and no field silently ignored: what is not implemented gets 400 naming it, unless
    it asks for nothing."""
    url = server.url + "/v1/completions"
    chat_url = server.url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    for body, param in (({"prompt": "x", "max_tokens": True}, "max_tokens"),
                        ({"prompt": [True, False]}, "prompt"),
                        ({"prompt": [1.0, 2.0]}, "prompt"),
                        ({"prompt": "x", "temperature": "0.5"}, "temperature")):
        resp = httpx.post(url, json=body)
        assert resp.status_code == 422 and resp.json()["error"]["param"] == param, resp.text
    before = _metrics(server)
    for target, body, param in (
            (url, {"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
            (url, {"prompt": "x", "suffix": "y"}, "suffix"),
            (url, {"prompt": "x", "top_k": 3}, "top_k"),
            (url, {"prompt": ["x", "y"]}, "prompt"),
            (chat_url, {"messages": messages, "tools": [{"type": "function"}]}, "tools"),
            (chat_url, {"messages": messages, "response_format": {"type": "json_object"}},
             "response_format")):
        resp = httpx.post(target, json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and param in error["message"], error
    after = _metrics(server)
    assert after['fojax_requests_rejected_total{reason="invalid"}'] == \
        before.get('fojax_requests_rejected_total{reason="invalid"}', 0) + 6
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="best_of=2 is not supported"):
        client.completions.create(model=NAME, prompt="x", max_tokens=1, best_of=2)
    ok = client.completions.create(model=NAME, prompt="x", max_tokens=1, best_of=1,
                                   logit_bias={}, suffix=None, frequency_penalty=0)
    assert ok.usage.completion_tokens == 1


def _direct_logprobs(prompt_ids, token_ids):
    """log_softmax of the logits each token was sampled from, computed directly: the embedded
    model's resident prefill of prompt + tokens but the last in one chunk (selection is dense
    here: index_topk 128 > every position). [len(token_ids), V]."""
    ids = list(prompt_ids) + list(token_ids[:-1])
    state = resident.ResidentState.create(CONFIG, batch=1, capacity=CAPACITY)
    logits, _ = resident.prefill(PARAMS, state, np.asarray([ids], np.int32), config=CONFIG,
                                 query_block=None)
    rows = np.asarray(logits[0, len(prompt_ids) - 1:], np.float32)
    return np.asarray(jax.nn.log_softmax(rows, axis=-1))


def _piece(token_id):
    return TOKENIZER.decode([token_id])


def test_logprobs_of_completions_and_chat_streamed_or_not(server):
    """logprobs (completions: k, chat: logprobs + top_logprobs) in OpenAI's formats, from the
    engine (equal to its own output bit for bit) and equal to the log_softmax of the logits
    computed directly (up to float32 rounding, the top ids exactly); streamed chunks carry
    the logprobs of their tokens, which add up to the whole response's."""
    prompt, top = "def read_lines(path):", 2
    client = _client(server)
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0.8,
                                     seed=3, logprobs=top, extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    ids = choice.model_extra["token_ids"]
    reference = _engine()
    rid = reference.add_request(TOKENIZER.encode(prompt), max_tokens=6, temperature=0.8, seed=3,
                                stop_token_ids=[SEP], logprobs=top)
    want = reference.run()[rid]
    assert ids == want.token_ids and len(ids) == resp.usage.completion_tokens == 6
    lp = choice.logprobs
    assert lp.tokens == [_piece(t) for t in ids]
    assert lp.token_logprobs == [e.logprob for e in want.logprobs]
    assert lp.text_offset == [sum(len(p) for p in lp.tokens[:i]) for i in range(len(ids))]
    for entry, tops in zip(want.logprobs, lp.top_logprobs):
        expected = {_piece(entry.token_id): entry.logprob}  # the sampled token first
        for t, v in entry.top:
            expected.setdefault(_piece(t), v)
        assert tops == expected and list(tops) == list(expected)
        assert len(tops) in (top, top + 1)
    direct = _direct_logprobs(TOKENIZER.encode(prompt).tolist(), ids)
    np.testing.assert_allclose(lp.token_logprobs, direct[np.arange(len(ids)), ids],
                               rtol=0, atol=1e-4)
    order = np.argsort(-direct, axis=-1, kind="stable")[:, :top]
    assert [[t for t, _ in e.top] for e in want.logprobs] == order.tolist()

    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=6,
                                            temperature=0.8, seed=3, logprobs=top, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((c.tokens for c in streamed), []) == lp.tokens
    assert sum((c.token_logprobs for c in streamed), []) == lp.token_logprobs
    assert sum((c.text_offset for c in streamed), []) == lp.text_offset
    assert sum((c.top_logprobs for c in streamed), []) == lp.top_logprobs

    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=top)
    content = reply.choices[0].logprobs.content
    chat_ids = TOKENIZER.encode("user: hello\nassistant:")
    rid = reference.add_request(chat_ids, max_tokens=5, temperature=0.0, stop_token_ids=[SEP],
                                logprobs=top)
    want = reference.run()[rid]
    assert len(content) == len(want.token_ids) == reply.usage.completion_tokens
    for item, entry in zip(content, want.logprobs):
        assert (item.token, item.logprob, item.bytes) == (
            _piece(entry.token_id), entry.logprob, list(_piece(entry.token_id).encode()))
        assert [(t.token, t.logprob) for t in item.top_logprobs] == \
            [(_piece(t), v) for t, v in entry.top]
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=top,
                                            stream=True)
    pieces = [c.choices[0].logprobs.content for c in stream
              if c.choices and c.choices[0].logprobs]
    assert [item.model_dump() for part in pieces for item in part] == \
        [item.model_dump() for item in content]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == reply.choices[0].message.content


def test_n_choices_each_equal_the_request_with_seed_plus_index_alone(server):
    """n > 1: choice i is the request with seed + i alone (vLLM's rule), bit for bit (tokens
    and logprobs), checked against the same engine run directly; the prompt is prefilled once
    (the other choices map its whole chunks from the prefix cache and prefill the rest);
    usage sums the choices' tokens (the prompt counted once). Streamed, each chunk holds one
    choice naming its index; chat too."""
    prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self):"
    ids = TOKENIZER.encode(prompt).tolist()
    n, seed, chunk = 3, 21, 8
    assert len(ids) - 1 >= 2 * chunk
    client = _client(server)
    counters = server.served.driver.engine.counters
    before = dict(counters)
    resp = client.completions.create(model=NAME, prompt=prompt, n=n, seed=seed,
                                     temperature=0.9, max_tokens=5, logprobs=1,
                                     extra_body={"return_token_ids": True})
    cached = (len(ids) - 1) // chunk * chunk
    assert counters["prefix_hit_tokens"] - before["prefix_hit_tokens"] == (n - 1) * cached
    assert counters["prefill_tokens"] - before["prefill_tokens"] == \
        len(ids) + (n - 1) * (len(ids) - cached)
    reference = _engine()
    tokens = []
    for i, choice in enumerate(resp.choices):
        rid = reference.add_request(ids, max_tokens=5, temperature=0.9, seed=seed + i,
                                    stop_token_ids=[SEP], logprobs=1)
        want = reference.run()[rid]
        assert choice.index == i and choice.finish_reason == want.finish_reason
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.logprobs.token_logprobs == [e.logprob for e in want.logprobs]
        tokens.append(want.token_ids)
    assert len({tuple(t) for t in tokens}) > 1, tokens  # other seeds, other samples
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == \
        (len(ids), sum(len(t) for t in tokens))

    chunks = list(client.completions.create(model=NAME, prompt=prompt, n=n, seed=seed,
                                            temperature=0.9, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(len(c.choices) == 1 for c in chunks[:-1]) and chunks[-1].choices == []
    for i, choice in enumerate(resp.choices):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens

    messages = [{"role": "user", "content": "a stack class"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, n=2, seed=seed,
                                          temperature=0.9, max_tokens=4)
    assert [c.index for c in chat.choices] == [0, 1]
    used = 0
    for i in range(2):
        alone = client.chat.completions.create(model=NAME, messages=messages, seed=seed + i,
                                               temperature=0.9, max_tokens=4)
        assert chat.choices[i].message.content == alone.choices[0].message.content
        used += alone.usage.completion_tokens
    assert chat.usage.completion_tokens == used
    too_many = httpx.post(server.url + "/v1/completions",
                          json={"prompt": "x", "n": SEATS + MAX_QUEUE + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert too_many.json()["error"]["message"] == (
        f"n={SEATS + MAX_QUEUE + 1} choices can never be queued at once: this server has "
        f"{SEATS} seats and --max-queue {MAX_QUEUE} (at most {SEATS + MAX_QUEUE} choices per "
        "request)")


def test_token_ids_past_int64_are_refused_and_the_engine_goes_on(server):
    """Ids past int64 once ended the engine thread (an OverflowError): every later request
    got 503. Now each gets 400 naming the id, and the requests after them run."""
    url = server.url + "/v1/completions"
    for big in (2**63, 2**64, 10**30):
        resp = httpx.post(url, json={"prompt": [big], "max_tokens": 4})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"] == (
            f"prompt token {big} at position 0 is outside the vocabulary [0, "
            f"{CONFIG.vocab_size})")
    for prompt in ([1, 2, 3], "def f():"):
        resp = httpx.post(url, json={"prompt": prompt, "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200, resp.text
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are not JSON (a client's parser fails)."""
    def refuse(constant):
        raise AssertionError(f"{constant} in a JSON reply")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"prompt": "x"'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}]'),
])
@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("temperature", "Infinity"),
                                         ("temperature", "-Infinity"), ("top_p", "NaN")])
def test_non_finite_sampling_values_get_4xx_naming_the_field(server, path, body, field, value):
    """NaN and Infinity (Python's json reads them) were echoed by the 422 handler, whose JSON
    encoder then failed: 500."""
    resp = httpx.post(server.url + path, content=f'{body}, "{field}": {value}}}',
                      headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    error = _strict_json(resp.text)["error"]
    got = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[value]
    assert error["param"] == field
    assert error["message"] == f"invalid request: {field}: must be a finite number, got {got}"


def test_lone_surrogates_are_refused_naming_the_field(server):
    r"""A JSON string may hold a lone surrogate ("\ud800"), which is no Unicode text: the
    tokenizer failed on it (500)."""
    resp = httpx.post(server.url + "/v1/completions", content='{"prompt": "def \\ud800 f"}',
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt"
    assert resp.json()["error"]["message"] == (
        "prompt: a lone surrogate (U+D800) at character 4 is not Unicode text: send the text "
        "as UTF-8 (or a character outside the BMP as its surrogate pair)")
    chat = httpx.post(server.url + "/v1/chat/completions",
                      content='{"messages": [{"role": "user", "content": "ok"}, '
                              '{"role": "user", "content": "\\udfff"}]}',
                      headers={"content-type": "application/json"})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages.1.content"
    assert "a lone surrogate (U+DFFF) at character 0" in chat.json()["error"]["message"]


def test_a_chat_template_that_refuses_the_messages_gets_400():
    """A checkpoint's chat template may refuse messages (`raise_exception("roles must
    alternate")`: a ValueError of `apply_chat_template`): the client's input, so 400 naming
    `messages`, not a 500."""
    def template(messages):
        if len(messages) > 1 and messages[-1].role == messages[-2].role:
            raise ValueError("the chat template of ckpt refused the messages: Conversation "
                             "roles must alternate user/assistant/user/assistant/...")
        return simple_chat_template(messages)

    engine = _engine()
    srv = ServerThread(build_served(engine, TOKENIZER, model_name=NAME, chat_template=template),
                       shutdown_timeout=1.0).start()
    try:
        url = srv.url + "/v1/chat/completions"
        refused = httpx.post(url, json={"messages": [{"role": "user", "content": "a"},
                                                     {"role": "user", "content": "b"}]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "messages"
        assert refused.json()["error"]["message"].endswith(
            "Conversation roles must alternate user/assistant/user/assistant/...")
        fine = httpx.post(url, json={"messages": [{"role": "user", "content": "a"}],
                                     "max_tokens": 2})
        assert fine.status_code == 200, fine.text
    finally:
        assert srv.stop(timeout=20)


def test_stop_strings_are_bounded(server):
    """A 100k-character stop string streamed nothing until the end (the server holds back
    its length - 1 characters): long ones, and too many, are refused naming the limit."""
    url = server.url + "/v1/completions"
    long = httpx.post(url, json={"prompt": "x", "stop": ["a" * 100_000], "stream": True})
    assert long.status_code == 400
    assert long.json()["error"]["message"] == (
        "a stop string of 100000 characters, at most 256 per string")
    many = httpx.post(url, json={"prompt": "x", "stop": [f"s{i}" for i in range(17)]})
    assert many.status_code == 400
    assert many.json()["error"]["message"] == "17 stop strings, at most 16 per request"


def test_client_dropped_mid_stream_is_cancelled(server):
    before = _idle(server)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions",
                           json={"prompt": "a", "max_tokens": 40, "stream": True,
                                 "temperature": 0, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    after = _idle(server)  # the seat was freed: nothing running, nothing waiting
    assert after["fojax_requests_cancelled_total"] == before["fojax_requests_cancelled_total"] + 1
    with pytest.raises(httpx.ReadTimeout):  # a whole-response client that gives up
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.02),
                   json={"prompt": "b", "max_tokens": 60, "ignore_eos": True})
    last = _idle(server)
    assert last["fojax_requests_cancelled_total"] == after["fojax_requests_cancelled_total"] + 1


async def _stream_one(client, url, i):
    body = {"prompt": f"request {i}:", "max_tokens": 8, "stream": True, "temperature": 0}
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code == 429:
            assert resp.headers["retry-after"] == "1"
            return "rejected"
        assert resp.status_code == 200
        lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][5:])["choices"][0]["finish_reason"] == "length"
        return "completed"


CLIENTS = 64  # concurrent streaming clients of the load test


def test_load_accepted_complete_rejected_429_and_metrics_add_up(server):
    before = _idle(server)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_stream_one(client, server.url + "/v1/completions", i)
                                          for i in range(CLIENTS)))

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert results.count("completed") >= SEATS and results.count("rejected") >= 1
    m = _idle(server)

    def delta(name):
        return m.get(name, 0.0) - before.get(name, 0.0)

    completed = sum(delta(k) for k in m if k.startswith("fojax_requests_completed_total"))
    rejected = sum(delta(k) for k in m if k.startswith("fojax_requests_rejected_total"))
    assert delta("fojax_requests_received_total") == CLIENTS
    assert completed == results.count("completed")
    assert delta('fojax_requests_rejected_total{reason="queue_full"}') == results.count("rejected")
    assert delta("fojax_requests_received_total") == \
        completed + delta("fojax_requests_cancelled_total") + rejected
    assert m["fojax_time_to_first_token_seconds_count"] >= completed
    assert m['fojax_engine_events_total{counter="decode_calls"}'] > 0


def test_shutdown_ends_in_flight_requests():
    """Shutdown: new requests get 503; in-flight streams end with finish_reason "cancelled"
    and [DONE] once the drain time is over (0 here, as in the CLI test: at once); the
    server and engine threads exit."""
    srv = _start(max_queue=4, shutdown_timeout=0.0)
    results = []

    def call():
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", srv.url + "/v1/completions",
                               json={"prompt": "z", "max_tokens": 60, "stream": True,
                                     "ignore_eos": True}) as resp:
                results.append([line for line in resp.iter_lines() if line])

    threads = [threading.Thread(target=call) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        # All three submitted (two in seats, one waiting) before shutdown begins: a request
        # arriving after it would be refused (503), not ended.
        while ((srv.served.driver.snapshot.running < SEATS
                or srv.served.driver.in_flight() < 3) and time.monotonic() < deadline):
            time.sleep(0.01)
        srv.served.driver.stop_accepting()  # what SIGTERM does first
        assert httpx.get(srv.url + "/health").status_code == 503
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"})
        assert refused.status_code == 503
        assert srv.stop(timeout=30)  # the server thread and the engine thread have exited
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        for t in threads:
            t.join(30)
        srv.stop(timeout=5)
    assert len(results) == 3 and srv.served.driver.in_flight() == 0
    assert all(lines[-1] == "data: [DONE]" for lines in results)
    reasons = [json.loads(lines[-2][5:])["choices"][0]["finish_reason"] for lines in results]
    assert "cancelled" in reasons, reasons
    snap = srv.served.driver.snapshot
    assert snap.running == 0 and snap.waiting == 0
    completed = reasons.count("length")
    assert final_report(srv.served) == (
        f"fo-jax serve: stopped: requests received 4, completed {completed}, cancelled "
        f"{3 - completed}, rejected 1, failed 0; no page pool (resident)")


class _TemplatedTokenizer:
    """The embedded tokenizer with a chat template and EOS ids, as a Hugging Face checkpoint's
    tokenizer has them (fo_jax.tokenizer.HFTokenizer's interface)."""

    chat_template = "{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}bot>"
    sep = None
    eos_ids = (SEP,)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"{m['role']}> {m['content']}\n" for m in messages) + "bot>"

    def encode(self, text, *, add_special_tokens=True):
        assert not add_special_tokens, "a rendered template is encoded without BOS"
        return TOKENIZER.encode(text)

    def decode(self, ids):
        return TOKENIZER.decode(ids)


def test_chat_uses_the_checkpoints_template_and_eos():
    engine = _engine()
    tokenizer = _TemplatedTokenizer()
    served = build_served(engine, tokenizer, model_name=NAME, max_queue=4)
    srv = ServerThread(served, shutdown_timeout=2.0).start()
    try:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        reply = _client(srv).chat.completions.create(model=NAME, messages=messages,
                                                     max_tokens=2, temperature=0)
        want = tokenizer.apply_chat_template(messages)
        assert reply.usage.prompt_tokens == len(TOKENIZER.encode(want))
    finally:
        assert srv.stop(timeout=20)


class _GatedTokenizer:
    """The embedded tokenizer, whose `encode` waits until the test opens `gate` (a long
    prompt being tokenized)."""

    sep = SEP

    def __init__(self):
        self.entered, self.gate = threading.Event(), threading.Event()

    def encode(self, text):
        self.entered.set()
        assert self.gate.wait(10), "the gate was not opened"
        return TOKENIZER.encode(text)

    def decode(self, ids):
        return TOKENIZER.decode(ids)


def test_tokenizing_leaves_the_event_loop_free_and_big_bodies_get_413():
    """A prompt is tokenized off the event loop (a 20 MB one held every stream and /health
    for 46 s): /health answers while an encode is under way. A body above `max_body_bytes`
    gets 413 naming the limit, from its Content-Length or, chunked, once that many bytes came
    in."""
    tokenizer = _GatedTokenizer()
    served = build_served(_engine(), tokenizer, model_name=NAME, max_body_bytes=4096)
    srv = ServerThread(served, shutdown_timeout=2.0).start()
    url = srv.url + "/v1/completions"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, url, json={"prompt": "x" * 3000}, timeout=30)
            assert tokenizer.entered.wait(10)
            assert httpx.get(srv.url + "/health", timeout=5).json() == {"status": "ok"}
            tokenizer.gate.set()
            assert slow.result().status_code == 400  # longer than a seat
        limit = "the server takes at most 4,096 (fo-jax serve --max-body-mb)"
        big = httpx.post(url, content=b'{"prompt": "' + b"x" * 5000 + b'"}',
                         headers={"content-type": "application/json"})
        assert big.status_code == 413
        assert big.json()["error"]["message"] == f"request body of 5,014 bytes: {limit}"
        chunked = httpx.post(url, content=iter([b'{"prompt": "', b"x" * 3000, b"x" * 3000]),
                             headers={"content-type": "application/json"})
        assert "content-length" not in chunked.request.headers
        assert chunked.status_code == 413
        assert chunked.json()["error"]["message"] == (
            f"request body of more than 4,096 bytes: {limit}")
        fits = httpx.post(url, content=iter([b'{"prompt": [1, 2], ', b'"max_tokens": 1}']),
                          headers={"content-type": "application/json"}, timeout=30)
        assert fits.status_code == 200, fits.text  # a chunked body under the limit
    finally:
        tokenizer.gate.set()
        assert srv.stop(timeout=20)


def test_an_engine_failure_stops_the_server():
    """The engine thread ends only on a fault of its own state (here: its step raises); then
    the request in flight gets 500 and the server shuts down (`fo-jax serve` exits 1)."""
    engine = _engine()

    def broken():
        raise RuntimeError("device lost")

    engine.step = broken
    srv = ServerThread(build_served(engine, TOKENIZER, model_name=NAME),
                       shutdown_timeout=2.0).start()
    try:
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2]}, timeout=30)
        assert resp.status_code == 500
        assert resp.json()["error"]["message"] == "engine failure: RuntimeError: device lost"
        srv.thread.join(20)
        assert not srv.thread.is_alive()  # no stop() called: the server stopped by itself
        assert final_report(srv.served).startswith(
            "fo-jax serve: stopped: requests received 1, completed 0, cancelled 0, rejected 0, "
            "failed 1")
    finally:
        srv.stop(timeout=5)

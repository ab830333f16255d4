"""Request bodies (fo_jax.server.protocol): strict types (no bool as int, no string as number,
finite numbers, prompts of the supported shapes only), and every OpenAI field the server does
not implement refused by name unless it holds the value that asks for nothing. No model: the
bodies alone."""

import math

import pytest
from pydantic import ValidationError

from fo_jax.server.protocol import NO_OP_VALUES, ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROMPT = {"prompt": "def f():"}


def _errors(model, body) -> dict:
    """{dotted field: message} of the body's validation errors."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return {".".join(str(x) for x in e["loc"]): e["msg"] for e in info.value.errors()}


@pytest.mark.parametrize("body, field, message", [
    ({"max_tokens": True}, "max_tokens", "Input should be a valid integer"),
    ({"max_tokens": "4"}, "max_tokens", "Input should be a valid integer"),
    ({"max_tokens": 4.0}, "max_tokens", "Input should be a valid integer"),
    ({"temperature": "0.5"}, "temperature", "Input should be a valid number"),
    ({"temperature": True}, "temperature", "Input should be a valid number"),
    ({"temperature": math.nan}, "temperature", "Input should be a finite number"),
    ({"temperature": math.inf}, "temperature", "Input should be a finite number"),
    ({"temperature": -math.inf}, "temperature", "Input should be a finite number"),
    ({"top_p": math.nan}, "top_p", "Input should be a finite number"),
    ({"n": True}, "n", "Input should be a valid integer"),
    ({"seed": "7"}, "seed", "Input should be a valid integer"),
    ({"stream": "yes"}, "stream", "Input should be a valid boolean"),
    ({"stream": 1}, "stream", "Input should be a valid boolean"),
    ({"logprobs": True}, "logprobs", "Input should be a valid integer"),
    ({"logprobs": 21}, "logprobs", "Input should be less than or equal to 20"),
    ({"user": 5}, "user", "Input should be a valid string"),
    ({"frequency_penalty": math.nan}, "frequency_penalty", "Input should be a finite number"),
])
def test_completion_fields_take_their_own_type_only(body, field, message):
    errors = _errors(CompletionRequest, {**PROMPT, **body})
    assert errors.get(field) == message, errors


@pytest.mark.parametrize("prompt", [[True, False], [1.0, 2.0], [1, "a"], {"a": 1}, 5,
                                    [[1, 2], "x"], [[True]]])
def test_prompts_of_other_shapes_are_refused_by_name(prompt):
    errors = _errors(CompletionRequest, {"prompt": prompt})
    assert list(errors) == ["prompt"], errors
    assert errors["prompt"].startswith(
        "Value error, prompt must be a string, a list of strings, a list of token ids "
        "(integers: not booleans or floats) or a list of lists of token ids, got ")


@pytest.mark.parametrize("body, field, message", [
    ({"logprobs": 1}, "logprobs", "Input should be a valid boolean"),
    ({"top_logprobs": True}, "top_logprobs", "Input should be a valid integer"),
    ({"top_logprobs": 21}, "top_logprobs", "Input should be less than or equal to 20"),
    ({"max_completion_tokens": "9"}, "max_completion_tokens", "Input should be a valid integer"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content.str",
     "Input should be a valid string"),
    ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage",
     "Input should be a valid boolean"),
    ({"stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "Extra inputs are not permitted"),
])
def test_chat_fields_take_their_own_type_only(body, field, message):
    errors = _errors(ChatCompletionRequest, {**CHAT, **body})
    assert errors.get(field) == message, errors


def test_numbers_take_integers_and_the_prompt_shapes_stay():
    body = CompletionRequest.model_validate({"prompt": [[1, 2, 3]], "temperature": 1,
                                             "top_p": 1, "max_tokens": 3})
    assert body.temperature == 1.0 and isinstance(body.temperature, float)
    assert body.prompts() == [[1, 2, 3]]
    for prompt, want in (("ab", ["ab"]), (["ab"], ["ab"]), ([4, 5], [[4, 5]]),
                         ([], [[]]), (["a", "b"], ["a", "b"]), ([[1], [2]], [[1], [2]])):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == want


@pytest.mark.parametrize("body, param, message", [
    ({"logit_bias": {"50256": -100}}, "logit_bias",
     "logit_bias={'50256': -100} is not supported: logit biases are not implemented: send {} "
     "or omit it"),
    ({"frequency_penalty": 0.5}, "frequency_penalty",
     "frequency_penalty=0.5 is not supported: penalties are not implemented: send 0 or omit it"),
    ({"presence_penalty": -1}, "presence_penalty",
     "presence_penalty=-1.0 is not supported: penalties are not implemented: send 0 or omit it"),
    ({"best_of": 2}, "best_of",
     "best_of=2 is not supported: every choice sampled is returned, so best_of must equal n (1) "
     "or be omitted"),
    ({"best_of": 3, "n": 2}, "best_of",
     "best_of=3 is not supported: every choice sampled is returned, so best_of must equal n (2) "
     "or be omitted"),
    ({"suffix": " end"}, "suffix",
     "suffix=' end' is not supported: text after the completion (insertion) is not "
     "implemented: omit it"),
    ({"echo": True}, "echo",
     "echo=True is not supported: echoing the prompt is not implemented: send echo=false or "
     "omit it"),
    ({"top_k": 5}, "top_k",
     "unknown field 'top_k': this server does not implement it (see the serving guide, "
     "docs/guides/serving.md, for the fields it takes); drop it"),
])
def test_unimplemented_completion_fields_are_refused_by_name(body, param, message):
    refusal = CompletionRequest.model_validate({**PROMPT, **body}).refusal()
    assert refusal is not None and (refusal.param, refusal.message) == (param, message)


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tools=[{'type': 'function', 'function': {'name': 'f'}}] is not supported: tool calls are "
     "not implemented: send no tools"),
    ({"tool_choice": "required"}, "tool_choice",
     "tool_choice='required' is not supported: tool calls are not implemented: send no "
     "tool_choice (or \"none\")"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format={'type': 'json_object'} is not supported: only plain text is produced "
     "(no JSON mode or schema): send {\"type\": \"text\"} or omit it"),
    ({"top_logprobs": 2}, "top_logprobs",
     "top_logprobs=2 needs logprobs=true (the log-probabilities it lists more of)"),
    ({"logit_bias": {"1": 1}}, "logit_bias",
     "logit_bias={'1': 1} is not supported: logit biases are not implemented: send {} or omit "
     "it"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio",
     "audio={'voice': 'alloy', 'format': 'mp3'} is not supported: audio output is not "
     "implemented: omit it"),
    ({"modalities": ["text", "audio"]}, "modalities",
     "modalities=['text', 'audio'] is not supported: only text output is produced: send "
     "[\"text\"] or omit it"),
    ({"reasoning_effort": "high"}, "reasoning_effort",
     "reasoning_effort='high' is not supported: reasoning effort is not implemented: omit it"),
    ({"store": True}, "store",
     "store=True is not supported: stored completions are not implemented: send store=false "
     "or omit it"),
    ({"functions": [{"name": "f"}]}, "functions",
     "functions=[{'name': 'f'}] is not supported: function calls are not implemented: send no "
     "functions"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction",
     "prediction={'type': 'content', 'content': 'x'} is not supported: predicted outputs are "
     "not implemented: omit it"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name",
     "messages.0.name='bob' is not supported: participant names are not rendered by the chat "
     "template: omit it"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": "1", "type": "function"}]}]}, "messages.0.tool_calls",
     "messages.0.tool_calls=[{'id': '1', 'type': 'function'}] is not supported: tool calls are "
     "not implemented: send no tool_calls"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "good"}]}, "messages.0.mood",
     "unknown message field 'mood': a message has role and content (and null name, "
     "tool_calls, function_call, audio, refusal); drop it"),
    ({"min_p": 0.1}, "min_p",
     "unknown field 'min_p': this server does not implement it (see the serving guide, "
     "docs/guides/serving.md, for the fields it takes); drop it"),
])
def test_unimplemented_chat_fields_are_refused_by_name(body, param, message):
    refusal = ChatCompletionRequest.model_validate({**CHAT, **body}).refusal()
    assert refusal is not None and (refusal.param, refusal.message) == (param, message)


def test_fields_that_ask_for_nothing_are_accepted():
    completion = dict(PROMPT, logit_bias={}, best_of=2, n=2, suffix=None, echo=False,
                      frequency_penalty=0, presence_penalty=0.0, user="u", logprobs=0,
                      stream=None, temperature=None, stream_options={"include_usage": True,
                                                                      "include_obfuscation": True})
    body = CompletionRequest.model_validate(completion)
    assert body.refusal() is None and body.choices == 2 and body.engine_logprobs() == 0
    chat = dict(CHAT, tools=[], tool_choice="none", parallel_tool_calls=True,
                response_format={"type": "text"}, modalities=["text"], store=False,
                metadata={}, service_tier="auto", logit_bias=None, functions=[],
                safety_identifier="s", prompt_cache_key="k", audio=None, logprobs=True,
                top_logprobs=3,
                messages=[{"role": "tool", "content": "1", "tool_call_id": "c1"},
                          {"role": "assistant", "content": "x", "tool_calls": [],
                           "name": None, "refusal": None}])
    body = ChatCompletionRequest.model_validate(chat)
    assert body.refusal() is None and body.engine_logprobs() == 3
    assert ChatCompletionRequest.model_validate(dict(CHAT, logprobs=True)).engine_logprobs() == 0
    assert ChatCompletionRequest.model_validate(CHAT).engine_logprobs() is None
    assert CompletionRequest.model_validate(PROMPT).engine_logprobs() is None


def test_every_field_of_the_openai_client_is_served_or_refused_by_name():
    """Each request field the installed `openai` client knows is implemented (a declared
    field) or has its no-op values and refusal message (NO_OP_VALUES): a field a newer
    client adds fails here until it is decided (meanwhile it is refused as unknown)."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    for model, params in ((CompletionRequest, completion_create_params),
                          (ChatCompletionRequest, chat_params)):
        fields = set(params.CompletionCreateParamsBase.__annotations__)
        assert len(fields) > 10
        assert not fields - set(model.model_fields) - set(NO_OP_VALUES), model.__name__

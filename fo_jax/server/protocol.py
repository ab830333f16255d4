"""OpenAI-compatible request bodies, validated strictly, and the chat template of models
without one of their own.

Types are strict (pydantic's strict mode): an integer field takes a JSON integer only (not
`true`, `1.0` or `"1"`), a number field a JSON number (an integer too) that is finite (not NaN
or an infinity), a boolean field `true` / `false`, a string field a string; `prompt` is a
string, a list of strings, a list of token ids (integers) or a list of lists of token ids. A
value of the wrong type or out of range is answered 422 naming the field (pydantic's error).

What the server implements: `prompt` (one: a list holds one string or one list of ids),
`messages` (text content), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`,
`seed`, `stop`, `n` (choices, each sampled with its own seed), `stream` and
`stream_options.include_usage` (`include_obfuscation` is accepted; no padding is added),
`logprobs` (completions: k top tokens; chat: `logprobs: true` and `top_logprobs: k`, k <=
`MAX_LOGPROBS`), vLLM's `ignore_eos` and `return_token_ids`. `user`, `safety_identifier` and
`prompt_cache_key` are accepted and change nothing (they identify the caller, or route a
cache, at OpenAI; the prefix cache here keys on the prompt itself).

Every other field of OpenAI's completions and chat-completions requests is refused with 400
naming it (`Body.refusal`) unless it holds the value that asks for nothing (`best_of` equal
to `n`, `echo` false, penalties 0, `logit_bias` {}, `suffix` null or "", `tools` [],
`tool_choice` "none" or "auto" without tools, `response_format` {"type": "text"}, `store`
false, ...: `NO_OP_VALUES`); so is a field OpenAI does not define (vLLM's `top_k`, `min_p`,
...). A client never gets an answer that silently ignored part of its question.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_LOGPROBS = 20  # top log-probabilities per token a request may ask (OpenAI's chat bound)
MAX_CHOICES = 128  # n: choices per request (each is one engine request)


def _finite(**kwargs):
    return Field(allow_inf_nan=False, **kwargs)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; no obfuscation padding is added


def _is_none(value) -> bool:
    return value is None


def _is_zero(value) -> bool:
    return value is None or value == 0


def _is_empty(value) -> bool:
    return value is None or value == [] or value == {}


# Fields OpenAI defines that this server does not implement: the values that ask for nothing
# (accepted) and what the refusal says (400, naming the field).
NO_OP_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_is_zero, "penalties are not implemented: send 0 or omit it"),
    "presence_penalty": (_is_zero, "penalties are not implemented: send 0 or omit it"),
    "logit_bias": (_is_empty, "logit biases are not implemented: send {} or omit it"),
    "echo": (lambda v: v is None or v is False,
             "echoing the prompt is not implemented: send echo=false or omit it"),
    "suffix": (lambda v: v is None or v == "",
               "text after the completion (insertion) is not implemented: omit it"),
    "tools": (_is_empty, "tool calls are not implemented: send no tools"),
    "tool_choice": (lambda v: v is None or v in ("none", "auto"),
                    "tool calls are not implemented: send no tool_choice (or \"none\")"),
    "functions": (_is_empty, "function calls are not implemented: send no functions"),
    "function_call": (lambda v: v is None or v in ("none", "auto"),
                      "function calls are not implemented: send no function_call"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool),
                            "must be a boolean (tool calls are not implemented anyway)"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "only plain text is produced (no JSON mode or schema): send "
                        "{\"type\": \"text\"} or omit it"),
    "audio": (_is_none, "audio output is not implemented: omit it"),
    "modalities": (lambda v: v is None or v == ["text"],
                   "only text output is produced: send [\"text\"] or omit it"),
    "prediction": (_is_none, "predicted outputs are not implemented: omit it"),
    "reasoning_effort": (_is_none, "reasoning effort is not implemented: omit it"),
    "verbosity": (_is_none, "verbosity is not implemented: omit it"),
    "web_search_options": (_is_none, "web search is not implemented: omit it"),
    "moderation": (_is_none, "moderation is not implemented: omit it"),
    "prompt_cache_options": (_is_none, "prompt cache options are not implemented: omit them"),
    "prompt_cache_retention": (_is_none, "prompt cache retention is not implemented: omit it"),
    "store": (lambda v: v is None or v is False,
              "stored completions are not implemented: send store=false or omit it"),
    "metadata": (_is_empty, "metadata is kept with stored completions, which are not "
                            "implemented: send {} or omit it"),
    "service_tier": (lambda v: v is None or v in ("auto", "default"),
                     "service tiers are not implemented: send \"auto\" or omit it"),
}

# Keys of a chat message besides role and content: the values that ask for nothing.
MESSAGE_NO_OP_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (_is_none, "participant names are not rendered by the chat template: omit it"),
    "tool_calls": (_is_empty, "tool calls are not implemented: send no tool_calls"),
    "function_call": (_is_none, "function calls are not implemented: omit it"),
    "audio": (_is_none, "audio is not implemented: omit it"),
    "refusal": (_is_none, "refusals are not rendered by the chat template: omit it"),
    "tool_call_id": (lambda v: v is None or isinstance(v, str), "must be a string"),
}


class Refusal(BaseModel):
    """Why a valid body is refused (HTTP 400): the field (dotted path) and the message."""
    param: str
    message: str


class Body(BaseModel):
    """What both endpoints share. Unknown keys are kept (`model_extra`) so that `refusal`
    can name them."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = _finite(default=None, ge=0.0, le=2.0)
    top_p: float | None = _finite(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    stop: Union[str, list[str], None] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    frequency_penalty: float | None = _finite(default=None)
    presence_penalty: float | None = _finite(default=None)
    logit_bias: dict[str, int] | None = None
    ignore_eos: bool | None = None  # vLLM's extension: do not stop at the separator token
    return_token_ids: bool | None = None  # vLLM's extension: choices[i].token_ids
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def engine_logprobs(self) -> int | None:
        """The engine's `logprobs` argument: None, or k top tokens per token."""
        raise NotImplementedError

    def refusal(self) -> Refusal | None:
        """The first field this server does not implement with a value that asks for
        something (or a field OpenAI does not define), else None."""
        extra = self.model_extra or {}
        given = [n for n in type(self).model_fields if n in self.model_fields_set]
        for name in given + list(extra):
            if name in NO_OP_VALUES:
                no_op, why = NO_OP_VALUES[name]
                value = extra[name] if name in extra else getattr(self, name)
                if not no_op(value):
                    return Refusal(param=name, message=f"{name}={_show(value)} is not "
                                                       f"supported: {why}")
            elif name not in type(self).model_fields:
                return Refusal(param=name, message=(
                    f"unknown field {name!r}: this server does not implement it (see the "
                    "serving guide, docs/guides/serving.md, for the fields it takes); drop it"))
        return None


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class CompletionRequest(Body):
    """POST /v1/completions. `max_tokens` defaults to 16, as OpenAI's."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """A clear message for a prompt of the wrong shape (the union's own names every
        member it tried)."""
        def ids(x):
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(value, str) or ids(value):
            return value
        if isinstance(value, list) and (all(isinstance(p, str) for p in value)
                                        or all(ids(p) for p in value)):
            return value
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids (integers: not "
            "booleans or floats) or a list of lists of token ids, got "
            f"{_show(value)}")

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts: one string or one list of ids per entry."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def refusal(self) -> Refusal | None:
        if self.best_of is not None and self.best_of != self.choices:
            return Refusal(param="best_of", message=(
                f"best_of={self.best_of} is not supported: every choice sampled is returned, "
                f"so best_of must equal n ({self.choices}) or be omitted"))
        return super().refusal()


class TextContent(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextContent], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def refusal(self, where: str) -> Refusal | None:
        for name, value in (self.model_extra or {}).items():
            param = f"{where}.{name}"
            if name not in MESSAGE_NO_OP_VALUES:
                return Refusal(param=param, message=(
                    f"unknown message field {name!r}: a message has role and content (and "
                    "null name, tool_calls, function_call, audio, refusal); drop it"))
            no_op, why = MESSAGE_NO_OP_VALUES[name]
            if not no_op(value):
                return Refusal(param=param, message=f"{param}={_show(value)} is not "
                                                    f"supported: {why}")
        return None


class ChatCompletionRequest(Body):
    """POST /v1/chat/completions. `max_tokens` (or `max_completion_tokens`) defaults to the
    rest of the seat."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusal(self) -> Refusal | None:
        if self.top_logprobs and not self.logprobs:
            return Refusal(param="top_logprobs", message=(
                f"top_logprobs={self.top_logprobs} needs logprobs=true (the log-probabilities "
                "it lists more of)"))
        for i, message in enumerate(self.messages):
            refused = message.refusal(f"messages.{i}")
            if refused is not None:
                return refused
        return super().refusal()


def simple_chat_template(messages: list[ChatMessage]) -> str:
    """The chat template of a model that has none (the embedded model): one line per message,
    `"{role}: {content}\\n"`, then `"assistant:"` for the model to continue.

        [{"role": "user", "content": "hi"}] -> "user: hi\\nassistant:"

    The embedded model was trained on Python sources, not dialogues: its replies are code-like
    text; the template only gives chat clients a working endpoint."""
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


__all__ = ["MAX_CHOICES", "MAX_LOGPROBS", "MESSAGE_NO_OP_VALUES", "NO_OP_VALUES", "Body",
           "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "Refusal",
           "StreamOptions", "simple_chat_template"]

"""OpenAI-compatible request bodies (pydantic: a bad field is answered 422 naming it), and the
chat template of models without one of their own.

Only what the engine does is accepted: one choice per request (`n` = 1), `prompt` as one string
or one list of token ids, sampling by `temperature` / `top_p` / `seed`, `stop` strings,
`max_tokens`. Fields OpenAI clients send that do not change the output here (`user`,
`stream_options`, penalties at their neutral 0) are accepted; unknown fields are ignored, as
vLLM does.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    ignore_eos: bool = False  # vLLM's extension: do not stop at the separator token
    return_token_ids: bool = False  # vLLM's extension: choices[0].token_ids (the engine's)
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `max_tokens` defaults to 16, as OpenAI's."""
    prompt: Union[str, list[int], list[str]]
    echo: bool = Field(default=False, description="not supported (must be false)")


class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextContent], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_tokens` (or `max_completion_tokens`) defaults to the
    rest of the seat."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def simple_chat_template(messages: list[ChatMessage]) -> str:
    """The chat template of a model that has none (the embedded model): one line per message,
    `"{role}: {content}\\n"`, then `"assistant:"` for the model to continue.

        [{"role": "user", "content": "hi"}] -> "user: hi\\nassistant:"

    The embedded model was trained on Python sources, not dialogues: its replies are code-like
    text; the template only gives chat clients a working endpoint."""
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions",
           "simple_chat_template"]

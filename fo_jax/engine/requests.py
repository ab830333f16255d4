"""A request's life in the engine, on the host: what `add_request` checks, what the engine
records of it (`RequestState`) and what it returns (`RequestOutput`, `TokenLogprobs`).

Nothing here touches a device array: these are the host-side records that the scheduler, the
KV store and the engine's step read and update.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Any, NamedTuple

import numpy as np

from fo_jax.sampling import check_sampling_values

FINISH_REASONS = ("stop", "length", "cancelled")


class TokenLogprobs(NamedTuple):
    """One sampled token's log-probability (`add_request(logprobs=k)`).

    Attributes:
      token_id: the token sampled.
      logprob: its log-probability under the raw model distribution (log_softmax of the
        logits it was sampled from, before temperature and top_p: vLLM's default).
      top: the k most likely tokens, ((id, logprob), ...) in descending order (ties: the lower
        id first); the sampled token is among them only if it is one of the k.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]

# Text stop strings per request and characters per string: each step searches the new text
# for every one, and a server streaming the text holds back the longest one's length - 1
# characters (a stop string of 100k characters streamed nothing until the end).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
SEEDS = (-2**63, 2**63)  # jax.random.key takes an int64


def token_ids(ids, vocab: int, what: str) -> np.ndarray:
    """`ids` (ints: Python or numpy integers, not bools) as an int32 array, each checked in
    [0, vocab) before any cast: an id past int64 is named, not an OverflowError, and 1.5 is
    refused, not truncated to 1. Raises ValueError naming the first bad one. O(len(ids))."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            raise ValueError(f"{what} {ids[bad[0]]} at position {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        return ids.astype(np.int32)
    try:
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
    except TypeError:
        raise ValueError(f"{what}s must be a sequence of token ids, got "
                         f"{type(ids).__name__} {ids!r}") from None
    for i, t in enumerate(ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)):
            raise ValueError(f"{what} {t!r} at position {i} is not an int (token ids are ints "
                             f"in [0, {vocab}))")
        if not 0 <= t < vocab:
            raise ValueError(f"{what} {t} at position {i} is outside the vocabulary "
                             f"[0, {vocab})")
    return np.asarray(ids, np.int32)


@dataclasses.dataclass
class RequestOutput:
    """What a request produced so far (returned by `Engine.step` for each request that moved).

    Attributes:
      request_id: the id `add_request` returned.
      new_token_ids: tokens sampled in this step.
      token_ids: every token sampled so far (a stop token included; text stops cut `text` only).
      text: the decoded output (with a tokenizer), cut before a text stop string; else None.
      finished: no more tokens will come.
      finish_reason: None while running; "stop" (a stop token or stop string), "length"
        (max_tokens, or the seat's capacity), or "cancelled".
      prompt_tokens: the prompt's length.
      time_to_first_token: seconds from `add_request` to the first token (None before it).
      time_per_output_token: mean seconds between its tokens after the first (None before the
        second token): tokens of one decode call arrive together, so with N steps per call
        this is the call's time over N.
      logprobs: with `add_request(logprobs=k)`, one `TokenLogprobs` per token of token_ids
        (so far); else None.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    time_to_first_token: float | None
    time_per_output_token: float | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclasses.dataclass
class RequestState:
    """The engine's host record of one request: its prompt and settings, where it sits, what it
    holds and what it has produced (fields commented below)."""

    request_id: str
    prompt: np.ndarray
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    arrival: float
    seat: int | None = None
    prefilled: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    pages: Any = None  # RequestPages (offloaded path): the pool pages the request maps
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled)
    order: int = 0  # arrival number: the queue's tie-break
    admitted: int = -1  # admission (or resume) number: the youngest is preempted first
    preempted: bool = False  # waiting to resume (its tokens kept; `pages` None: dropped)
    key_data: Any = None  # its PRNG key data when preempted after sampling (restored on resume)
    groups: list[int] = dataclasses.field(default_factory=list)  # with drafts: tokens yielded
    # by each decode step (a replay feeds the same groups: the same W-way programs)
    queued_at: int = 0  # the engine step it arrived at (aging of order="shortest")
    mtp_saved: Any = None  # MTP drafts: its seat's MTP rows when preempted (`save_mtp`)
    mtp_blocks: Any = None  # MTP drafts + prefix cache: its mapped prefix's MTP rows (admitted)
    prefix_held: Any = None  # admitted: its cached prefix's blocks, until copied (resident)
    top_logprobs: int | None = None  # logprobs=k: k top tokens per token; None: no logprobs
    logprobs: list | None = None  # with top_logprobs: one TokenLogprobs per token of `tokens`

    def stored_tokens(self) -> int:
        """Tokens its seat (or pages) hold: the cached prefix (admitted), the prompt tokens
        prefilled, or, decoding, prompt + sampled tokens but the last (not fed yet)."""
        if self.prefilled == len(self.prompt) and self.tokens:
            return len(self.prompt) + len(self.tokens) - 1
        return self.prefilled

    def record(self, new: list[int], *, tokenizer, capacity: int, length: int,
               done: bool = False, logprobs: list[TokenLogprobs] | None = None) -> list[int]:
        """Append sampled tokens one by one until one finishes the request; decide whether it
        finished, and why (`finish_reason`: a stop token or text stop string, "stop";
        max_tokens, the seat's `capacity` reached by its `length`, or the device's `done`,
        "length"). Tokens the device sampled after a text stop string (within the same decode
        call) are dropped, so the output does not depend on decode_steps_per_call. With stop
        strings the output is decoded by `tokenizer` after every token (O(output) per token).
        `logprobs` (one per token of `new`) go with their tokens. Returns the tokens kept."""
        kept = []
        if new:
            self.last_token_at = time.perf_counter()
        for j, t in enumerate(new):
            self.tokens.append(t)
            kept.append(t)
            if logprobs is not None:
                self.logprobs.append(logprobs[j])
            if self.stop:
                self.text = tokenizer.decode(self.tokens)
                cut = [at for at in (self.text.find(s) for s in self.stop) if at >= 0]
                if cut:
                    self.text = self.text[:min(cut)]
                    self.finish_reason = "stop"
                    return kept
            if t in self.stop_token_ids:
                self.finish_reason = "stop"
                break
        if self.text is not None and not self.stop:
            self.text = tokenizer.decode(self.tokens)
        if self.finish_reason is None and (len(self.tokens) >= self.max_tokens
                                           or length >= capacity or done):
            self.finish_reason = "length"
        return kept

    def output(self, new: list[int]) -> RequestOutput:
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        tpot = None
        if len(self.tokens) > 1 and self.last_token_at is not None:
            tpot = (self.last_token_at - self.first_token_at) / (len(self.tokens) - 1)
        return RequestOutput(self.request_id, list(new), list(self.tokens), self.text,
                             self.finish_reason is not None, self.finish_reason,
                             len(self.prompt), ttft, tpot,
                             None if self.logprobs is None else list(self.logprobs))


def logprob_rows(values, ids, top: int) -> list[TokenLogprobs]:
    """TokenLogprobs of rows of `token_logprobs` output (host arrays [T, K + 1]), the first
    `top` of the K most likely tokens kept."""
    return [TokenLogprobs(int(i[0]), float(v[0]),
                          tuple(zip(i[1:top + 1].tolist(), v[1:top + 1].tolist())))
            for v, i in zip(values, ids)]


def claim_request_id(request_id, ids, taken) -> str:
    """A request's id: `request_id` checked (a non-empty string not in `taken`), or, for None,
    the next "req-N" of the counter `ids` not in `taken`. Raises ValueError before anything
    is queued. O(1) per id tried."""
    if request_id is None:
        request_id = f"req-{next(ids)}"
        while request_id in taken:
            request_id = f"req-{next(ids)}"
    elif not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r} must be a non-empty string")
    elif request_id in taken:
        raise ValueError(f"request_id {request_id!r} is already in use (queued, running or "
                         "finished and not yet collected)")
    return request_id


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What an engine accepts of a request (`check_prompt`, `check_sampling`).

    Attributes:
      vocab: token ids are in [0, vocab).
      capacity: tokens per seat: the longest prompt.
      max_stop_ids: stop token ids per request.
      max_logprobs: the most top tokens a request's logprobs may list.
      num_drafts: the engine's drafts per step (logprobs are refused with drafts).
      tokenizer: whether the engine has one (text stop strings need it).
    """

    vocab: int
    capacity: int
    max_stop_ids: int
    max_logprobs: int
    num_drafts: int
    tokenizer: bool


def check_prompt(prompt, max_tokens, limits: RequestLimits) -> np.ndarray:
    """The prompt as an int32 array [P], checked (non-empty token ids in the vocabulary, at
    most a seat), and max_tokens an int >= 1. Raises ValueError naming what is wrong.
    O(P)."""
    vocab = limits.vocab
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(f"prompt must be a non-empty list of token ids, got an array of "
                         f"shape {prompt.shape}")
    prompt_np = token_ids(prompt, vocab, "prompt token")
    if prompt_np.size == 0:
        raise ValueError("prompt must be a non-empty list of token ids")
    if prompt_np.size > limits.capacity:
        raise ValueError(f"prompt of {prompt_np.size} tokens does not fit a seat of "
                         f"{limits.capacity} tokens: shorten it or raise the capacity")
    if (not isinstance(max_tokens, numbers.Integral) or isinstance(max_tokens, bool)
            or max_tokens < 1):
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
    return prompt_np


def check_sampling(*, temperature, top_p, seed, stop_token_ids, stop, logprobs,
                   limits: RequestLimits) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop token ids, stop strings) of a request, its sampling settings checked: temperature
    and top_p numbers in range, seed an int64, at most `limits.max_stop_ids` stop ids in the
    vocabulary, at most `MAX_STOP_STRINGS` non-empty stop strings of at most `MAX_STOP_CHARS`
    characters (with a tokenizer), logprobs None or in [0, max_logprobs] (without drafts).
    Raises ValueError naming what is wrong. O(stop ids + stop characters)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be a number")
    check_sampling_values(np.asarray([temperature]), np.asarray([top_p]))
    if (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)
            or not SEEDS[0] <= seed < SEEDS[1]):
        raise ValueError(f"seed={seed!r} must be an int in [-2**63, 2**63)")
    stop_ids = tuple(token_ids(stop_token_ids, limits.vocab, "stop token id").tolist())
    if len(stop_ids) > limits.max_stop_ids:
        raise ValueError(f"{len(stop_ids)} stop token ids, at most max_stop_ids="
                         f"{limits.max_stop_ids} per request")
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {list(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(stop)} stop strings, at most {MAX_STOP_STRINGS} per request")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string of {longest} characters, at most {MAX_STOP_CHARS} "
                         "per string")
    if stop and not limits.tokenizer:
        raise ValueError("stop strings need a tokenizer (Engine(..., tokenizer=...)); "
                         "without one, use stop_token_ids")
    if logprobs is not None:
        if (not isinstance(logprobs, numbers.Integral) or isinstance(logprobs, bool)
                or not 0 <= logprobs <= limits.max_logprobs):
            raise ValueError(
                f"logprobs={logprobs!r} must be None (no log-probabilities) or an int in "
                f"[0, max_logprobs={limits.max_logprobs}] (the most likely tokens returned "
                "besides the sampled one; Engine(max_logprobs=...) raises the bound)")
        if limits.num_drafts:
            raise ValueError(
                f"logprobs are not computed with drafts (this engine verifies num_drafts="
                f"{limits.num_drafts} drafts per step): serve without drafts (num_drafts=0) "
                "to have them, or drop logprobs")
    return stop_ids, stop


__all__ = ["FINISH_REASONS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "SEEDS", "RequestLimits",
           "RequestOutput", "RequestState", "TokenLogprobs", "check_prompt", "check_sampling",
           "claim_request_id", "logprob_rows", "token_ids"]

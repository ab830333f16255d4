"""Drafters for speculative decoding: they propose the next tokens, a W-way step verifies them.

    drafter = make_drafter("ngram", config)           # or "none" (None), "mtp"
    drafts = drafter.propose(histories, num_drafts)    # [B, W - 1] int32

A drafter sees each request's history (prompt + every token generated so far, the last one not
yet fed to the model) and proposes `num_drafts` tokens to follow it. `fo_jax.generate` feeds
[last token, drafts...] as the W = 1 + num_drafts ways of one decode step and keeps the longest
prefix of drafts equal to the model's greedy choices (see `generate`): a drafter changes how
many tokens a step yields, never which tokens.

  * `NGramDrafter` (prompt lookup): finds the most recent earlier occurrence of the history's
    last n tokens (n from `max_ngram` down to `min_ngram`) and proposes what followed it. Needs
    no model: it pays off when the output repeats its input (code, quotes, summaries).
  * The MTP drafter (DeepSeek-V3.2 / GLM-5 `num_nextn_predict_layers`) is not available yet:
    `make_drafter("mtp", ...)` raises NotImplementedError naming what is missing. Besides the
    layer's weights it needs the main model's final hidden state at each request's last kept
    position (which `fo_jax.model.forward` does not return yet): it will be a Drafter whose
    state the generation loop updates after each verification step, proposing with its own
    small decode step, with the same `propose` contract.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

DRAFTS = ("none", "ngram", "mtp")


class Drafter(Protocol):
    """What `fo_jax.generate.generate` asks of a drafter.

    name: shown in the summary.
    propose(histories, num_drafts) -> [B, num_drafts] int32: histories holds one 1-D int
      sequence per request (prompt + generated tokens, the last not yet fed); every proposed
      id must be a vocabulary id. Called once per decode step, on the host.
    """

    name: str

    def propose(self, histories: Sequence[Sequence[int]], num_drafts: int) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    """Prompt-lookup drafting: continue the history the way it continued before.

    For n = max_ngram down to min_ngram, the history's last n tokens are searched for in the
    history before them; at the most recent match, the (up to num_drafts) tokens that followed
    it are the drafts. With no match at any n, or a continuation shorter than num_drafts, the
    missing drafts repeat the last known token (a guess like any other: the verification
    rejects it when wrong). O(T n) numpy work per request and step, T the history length.

    Attributes:
      max_ngram, min_ngram: the n-gram lengths tried, longest first (1 <= min <= max).
    """

    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "ngram"

    def __post_init__(self):
        for field in ("max_ngram", "min_ngram"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} must be an int >= 1 (tokens of the "
                                 "pattern looked up in the history)")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram={self.min_ngram} > max_ngram={self.max_ngram}: the "
                             "n-gram lengths tried run from max_ngram down to min_ngram")

    def propose(self, histories: Sequence[Sequence[int]], num_drafts: int) -> np.ndarray:
        check_num_drafts(num_drafts)
        return np.stack([self.propose_one(np.asarray(h), num_drafts) for h in histories]
                        ).astype(np.int32).reshape(len(histories), num_drafts)

    def propose_one(self, history: np.ndarray, num_drafts: int) -> np.ndarray:
        """[num_drafts] drafts to follow one request's history (1-D, at least one token)."""
        history = np.asarray(history).reshape(-1)
        if history.size == 0:
            raise ValueError("a history needs at least one token (the prompt is never empty)")
        found = np.zeros(0, history.dtype)
        for n in range(min(self.max_ngram, history.size - 1), self.min_ngram - 1, -1):
            pattern = history[-n:]
            # Windows of the history before its last token: a match starting at i is followed
            # by history[i + n:], which is never empty.
            windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
            hits = np.flatnonzero(np.all(windows == pattern, axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                found = history[start:start + num_drafts]
                break
        fill = found[-1] if found.size else history[-1]
        out = np.full(num_drafts, fill, history.dtype)
        out[:found.size] = found
        return out


def check_num_drafts(num_drafts) -> None:
    if not isinstance(num_drafts, (int, np.integer)) or isinstance(num_drafts, bool) \
            or num_drafts < 0:
        raise ValueError(f"num_drafts={num_drafts!r} must be an int >= 0")


def make_drafter(draft: str, config) -> Drafter | None:
    """The drafter named `draft` for a model of `config`: None for "none".

    "mtp" needs the model's multi-token-prediction layer (`num_nextn_predict_layers` of a
    DeepSeek-V3.2 / GLM-5 checkpoint), which fo_jax does not load or run yet: refused with
    NotImplementedError until it does.
    """
    if draft not in DRAFTS:
        raise ValueError(f"draft={draft!r} is not one of {', '.join(DRAFTS)} (the drafter "
                         "proposing tokens for the W-way verification step)")
    if draft == "none":
        return None
    if draft == "ngram":
        return NGramDrafter()
    raise NotImplementedError(
        f"draft='mtp' needs the multi-token-prediction layer of the model "
        f"(num_nextn_predict_layers of a DeepSeek-V3.2 / GLM-5 checkpoint); model "
        f"{getattr(config, 'name', config)!r} has no MTP layer loaded: fo_jax does not load or "
        "run MTP layers yet. Use draft='ngram' (prompt lookup) or 'none'")

"""Drafters for speculative decoding: they propose the next tokens, a W-way step verifies them.

    drafter = make_drafter("ngram", config)           # or "none" (None), "mtp"
    drafts = drafter.propose(histories, num_drafts)    # [B, W - 1] int32

A drafter sees each request's history (prompt + every token generated so far, the last one not
yet fed to the model) and proposes `num_drafts` tokens to follow it. `fo_jax.generate` feeds
[last token, drafts...] as the W = 1 + num_drafts ways of one decode step and keeps the longest
prefix of drafts equal to the model's greedy choices at temperature 0, or the drafts that
speculative sampling accepts above it (see `generate`): a drafter changes how many tokens a
step yields, never which tokens (greedy) or their distribution (sampled).

  * `NGramDrafter` (prompt lookup): finds the most recent earlier occurrence of the history's
    last n tokens (n from `max_ngram` down to `min_ngram`) and proposes what followed it. Needs
    no model: it pays off when the output repeats its input (code, quotes, summaries).
  * `MTPDrafter` (DeepSeek-V3.2 / GLM-5 `num_nextn_predict_layers`): the model's own
    multi-token-prediction layer (`fo_jax.model.mtp`), fed the main model's last hidden states
    (before the final norm) and the tokens that follow them. Besides `propose` it has the hooks
    the generation loop calls: `start` after the prefill and `observe` after each
    verification step (with the step's hidden states and what was kept). It needs an engine
    that returns hidden states: `ResidentEngine(..., mtp=mtp_params)` or
    `OffloadEngine(..., mtp=mtp_params)`. The serving engine's decode loop runs the same rule
    on the device (`fo_jax.engine.Engine(..., drafter="mtp")`, `fo_jax.decode_loop.MTPSeats`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
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


def ngram_drafts(history, lengths, num_drafts: int, *, max_ngram: int = 3,
                 min_ngram: int = 1):
    """`NGramDrafter.propose` on the device: [B, num_drafts] int32 drafts, pure jnp.

    history: [B, S] int32, row b's first lengths[b] tokens (>= 1) are its history (prompt +
      generated, the last not yet fed); what lies past them is never read.
    The rule is NGramDrafter's (tests/engine/test_drafting_loop.py checks it against the host
    drafter): for n = max_ngram down to min_ngram (n <= T - 1), the most recent earlier
    occurrence of the last n tokens, its continuation (at most num_drafts tokens, cut at the
    history's end), the missing drafts filled with the last token found (or, with no match,
    the history's last token). A window ending at j matches n tokens iff it matches n - 1 and
    history[j - n + 1] == history[T - n], so the n-gram lengths share one pass each:
    O(B S max_ngram) compares and max-reductions, on the device (S the history's width; no
    host sync). Jit-able; num_drafts, max_ngram and min_ngram are static.
    """
    NGramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)  # validates the range
    check_num_drafts(num_drafts)
    history = jnp.asarray(history, jnp.int32)
    batch, width = history.shape
    if num_drafts == 0:
        return jnp.zeros((batch, 0), jnp.int32)
    total = jnp.asarray(lengths, jnp.int32)[:, None]  # [B, 1] T
    ends = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, S] window end j
    match = ends <= total - 2  # windows of history[:T - 1]
    start = jnp.full((batch,), -1, jnp.int32)  # where the continuation starts (-1: none)
    for n in range(1, max_ngram + 1):
        # history[j - n + 1] for every j (-1 before the start: never a token).
        shifted = jnp.pad(history, ((0, 0), (n - 1, 0)), constant_values=-1)[:, :width]
        want = jnp.take_along_axis(history, jnp.clip(total - n, 0, width - 1), axis=1)
        match = match & (shifted == want) & (ends >= n - 1)
        if n >= min_ngram:
            last = jnp.max(jnp.where(match, ends, -1), axis=1)  # most recent match
            start = jnp.where(last >= 0, last + 1, start)  # a longer n overrides
    found = start >= 0
    count = jnp.minimum(num_drafts, total[:, 0] - start)  # >= 1 where found
    k = jnp.arange(num_drafts, dtype=jnp.int32)[None, :]
    pos = jnp.where(found[:, None], start[:, None] + jnp.minimum(k, count[:, None] - 1),
                    total - 1)
    return jnp.take_along_axis(history, jnp.clip(pos, 0, width - 1), axis=1)


def check_num_drafts(num_drafts) -> None:
    if not isinstance(num_drafts, (int, np.integer)) or isinstance(num_drafts, bool) \
            or num_drafts < 0:
        raise ValueError(f"num_drafts={num_drafts!r} must be an int >= 0")


class MTPDrafter:
    """Drafts from the model's multi-token-prediction layer, greedy.

    MTP layer 0 maps (h_i, t_{i+1}) -- the main model's last hidden state at position i and the
    token after it -- to logits of t_{i+2} (`fo_jax.resident.mtp_step`). Its KV state (one
    layer, one indexer group: resident on the device) holds one pair per position the main
    model stores: `start` feeds the prompt's pairs (the last one pairs h_{T-1} with the first
    generated token), `observe` the pairs of the tokens a verification step kept. The first
    draft is the argmax at the last pair; draft k >= 2 chains, as DeepSeek does with one
    layer: the layer's own output h' and draft k - 1 are fed back as the next pair (always
    through MTP layer 0: a checkpoint's further MTP layers, if any, are loaded but unused).
    Chained pairs are speculative: `observe` rolls them back (`fo_jax.resident.rollback`)
    before feeding the kept pairs, so the state equals that of a run that never chained.
    Per step: one MTP call of W pairs (`observe`) plus W - 2 calls of one pair (`propose`),
    each one decoder layer against the layer's own cache; host reads of the drafts only.

    Attributes:
      params: the main model's parameters (embed / head when the MTP layer shares them).
      mtp: the MTP parameters (`fo_jax.checkpoints.hf.load_checkpoint(..., mtp=True)`).
      batch, capacity: those of the engine.
      prefill_chunk: pairs per `start` call (None: the whole prompt at once).
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, params, mtp, config, *, batch: int, capacity: int,
                 prefill_chunk: int | None = None):
        from fo_jax.model.mtp import check_mtp_params

        check_mtp_params(mtp, config)
        self.params, self.mtp, self.config = params, mtp, config
        self.batch, self.capacity, self.prefill_chunk = batch, capacity, prefill_chunk
        self.state = None
        self._draft = self._hidden = self._real = None

    def _run(self, hidden, tokens, num_new, query_block=None):
        from fo_jax.resident import mtp_step

        logits, out, self.state = mtp_step(
            self.params, self.mtp, self.state, hidden, jnp.asarray(tokens, jnp.int32),
            jnp.asarray(num_new, jnp.int32), config=self.config, query_block=query_block)
        return logits, out

    def _take(self, logits, out, last) -> None:
        """The first draft and h' at each request's last real pair (index `last` [B])."""
        rows = jnp.arange(self.batch)
        last = jnp.asarray(np.clip(last, 0, logits.shape[1] - 1))
        self._draft = jnp.argmax(logits[rows, last], axis=-1).astype(jnp.int32)
        self._hidden = out[rows, last]
        self._real = jnp.copy(self.state.lengths)  # the state is donated to the next call

    def start(self, hidden, tokens: np.ndarray, lengths: np.ndarray, first) -> None:
        """After the prefill: hidden [B, T, E] of the padded prompts tokens [B, T] (lengths [B]
        real), first [B] the first generated tokens. Starts a new MTP state."""
        from fo_jax.resident import create_mtp_state
        from fo_jax.resident import QUERY_BLOCK

        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, np.int32)
        nxt = np.zeros(tokens.shape, np.int64)
        nxt[:, :-1] = tokens[:, 1:]
        nxt[np.arange(self.batch), lengths - 1] = np.asarray(first)
        self.state = create_mtp_state(self.config, batch=self.batch, capacity=self.capacity)
        num_t = tokens.shape[1]
        chunk = num_t if self.prefill_chunk is None else int(self.prefill_chunk)
        draft = hid = None
        for lo in range(0, num_t, chunk):
            hi = min(lo + chunk, num_t)
            logits, out = self._run(hidden[:, lo:hi], nxt[:, lo:hi],
                                    np.clip(lengths - lo, 0, hi - lo), QUERY_BLOCK)
            end = lengths - 1 - lo
            here = jnp.asarray((end >= 0) & (end < hi - lo))
            self._take(logits, out, end)
            draft = self._draft if draft is None else jnp.where(here, self._draft, draft)
            hid = self._hidden if hid is None else jnp.where(here[:, None], self._hidden, hid)
        self._draft, self._hidden = draft, hid

    def observe(self, hidden, tokens, keep) -> None:
        """After a verification step: hidden [B, W, E] of the W fed tokens, tokens [B, W] the
        tokens generated after each (greedy or sampled; read for the kept ones only), keep [B]
        how many fed tokens were kept (0: none)."""
        if self.state is None:
            raise ValueError("MTPDrafter.observe before start: the generation loop calls "
                             "start after the prefill")
        from fo_jax.resident import rollback

        self.state = rollback(self.state, self.state.lengths - self._real)
        keep = np.asarray(keep, np.int32)
        logits, out = self._run(hidden, tokens, keep)
        self._take(logits, out, keep - 1)

    def propose(self, histories: Sequence[Sequence[int]], num_drafts: int) -> np.ndarray:
        """[B, num_drafts] drafts (the histories are not read: the state holds them)."""
        check_num_drafts(num_drafts)
        if self.state is None:
            raise ValueError("MTPDrafter.propose before start: the generation loop calls "
                             "start after the prefill")
        if len(histories) != self.batch:
            raise ValueError(f"{len(histories)} histories for an MTP drafter of batch "
                             f"{self.batch}")
        drafts = [self._draft]
        draft, hidden = self._draft, self._hidden
        ones = np.ones(self.batch, np.int32)
        for _ in range(1, num_drafts):
            logits, out = self._run(hidden[:, None], draft[:, None], ones)
            draft = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            hidden = out[:, 0]
            drafts.append(draft)
        out = np.asarray(jax.device_get(jnp.stack(drafts, axis=1))).astype(np.int32)
        return out[:, :num_drafts]


def make_drafter(draft: str, config, *, engine=None) -> Drafter | None:
    """The drafter named `draft` for a model of `config`: None for "none".

    "mtp" needs `engine`: a `fo_jax.generate.ResidentEngine` or `OffloadEngine` built with the
    model's MTP parameters (`mtp=`, from `load_checkpoint(..., mtp=True)`); an engine whose step
    does not return the hidden states the layer reads is refused with NotImplementedError.
    """
    if draft not in DRAFTS:
        raise ValueError(f"draft={draft!r} is not one of {', '.join(DRAFTS)} (the drafter "
                         "proposing tokens for the W-way verification step)")
    if draft == "none":
        return None
    if draft == "ngram":
        return NGramDrafter()
    name = getattr(config, "name", config)
    if engine is not None and not getattr(engine, "returns_hidden", False):
        raise NotImplementedError(
            f"draft='mtp' reads the main model's last hidden states, which the "
            f"{getattr(engine, 'name', type(engine).__name__)!r} engine's step does not return "
            "yet: use the resident engine (ResidentEngine(..., mtp=...)) or draft='ngram'")
    mtp = getattr(engine, "mtp", None)
    if mtp is None or config.num_nextn_predict_layers < 1:
        raise ValueError(
            f"draft='mtp' needs the multi-token-prediction layer of the model "
            f"(num_nextn_predict_layers of a DeepSeek-V3.2 / GLM-5 checkpoint); model "
            f"{name!r} has no MTP layer loaded: load it with load_checkpoint(..., mtp=True) "
            "and pass it as ResidentEngine(..., mtp=...), or use draft='ngram' or 'none'")
    batch = getattr(engine, "batch", None) or engine.state.batch
    return MTPDrafter(engine.params, mtp, config, batch=batch,
                      capacity=engine.capacity, prefill_chunk=engine.prefill_chunk)

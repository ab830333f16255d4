"""Drafters for speculative decoding: they propose the next tokens, a W-way step verifies them.

    drafter = make_drafter("ngram", config)           # or "mtp"; None: no drafter
    drafts = drafter.propose(histories, num_drafts)    # [B, W - 1] int32

A drafter sees each request's history (prompt + every token generated so far, the last one not
yet fed to the model) and proposes `num_drafts` tokens to follow it. `fo_jax.generate` feeds
[last token, drafts...] as the W = 1 + num_drafts ways of one decode step and keeps the longest
prefix of drafts equal to the model's greedy choices at temperature 0, or the drafts that
speculative sampling accepts above it (see `generate`): a drafter changes how many tokens a
step yields, never which tokens (greedy) or their distribution (sampled).

One drafter per kind, its rule written once, as pure jnp that runs on the device: the decode
loop (`fo_jax.decode_loop`, what the engine runs) traces it inside its program, and the
drafter objects `generate` calls from the host run the same functions.

  * n-gram (prompt lookup): `ngram_drafts` finds the most recent earlier occurrence of the
    history's last n tokens (n from `max_ngram` down to `min_ngram`) and proposes what
    followed it; `NGramDrafter` holds its settings and runs it on the host's histories. Needs
    no model: it pays off when the output repeats its input (code, quotes, summaries).
  * MTP (DeepSeek-V3.2 / GLM-5 `num_nextn_predict_layers`): the model's own
    multi-token-prediction layer (`fo_jax.model.mtp`), fed the main model's last hidden states
    (before the final norm) and the tokens that follow them. `MTPSeats` carries its state and
    each request's next draft; `mtp_feed` (and `mtp_feed_seat`, one seat) feeds pairs,
    `mtp_drafts` chains the drafts, `mtp_observe` keeps what a verification step kept.
    `MTPDrafter` runs them for `generate`: besides `propose` it has the hooks the generation
    loop calls, `start` after the prefill and `observe` after each verification step (with
    the step's hidden states and what was kept). It needs an engine that returns hidden
    states: `ResidentEngine(..., mtp=mtp_params)` or `OffloadEngine(..., mtp=mtp_params)`.
    The serving engine's decode loop runs the same functions on the device
    (`fo_jax.engine.Engine(..., drafter="mtp")`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig, check_num_drafts

DRAFTERS = ("ngram", "mtp")  # make_drafter's names (None: no drafter)


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
    rejects it when wrong). The rule is `ngram_drafts` (on the device; the decode loop runs it
    in its program): `propose` pads the host's histories to a width of a power of two (one
    program per width and setting) and runs it.

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
        rows = [np.asarray(h).reshape(-1) for h in histories]
        if any(h.size == 0 for h in rows):
            raise ValueError("a history needs at least one token (the prompt is never empty)")
        if not rows:
            return np.zeros((0, num_drafts), np.int32)
        longest = max(h.size for h in rows)
        width = max(16, 1 << (longest - 1).bit_length())  # a power of two: few programs
        padded = np.zeros((len(rows), width), np.int32)
        for b, h in enumerate(rows):
            padded[b, :h.size] = h
        lengths = np.asarray([h.size for h in rows], np.int32)
        drafts = _ngram_drafts_jit(padded, lengths, int(num_drafts),
                                   max_ngram=int(self.max_ngram), min_ngram=int(self.min_ngram))
        return np.asarray(drafts).astype(np.int32).reshape(len(rows), num_drafts)

    def propose_one(self, history: np.ndarray, num_drafts: int) -> np.ndarray:
        """[num_drafts] drafts to follow one request's history (1-D, at least one token)."""
        return self.propose([history], num_drafts)[0]


def ngram_drafts(history, lengths, num_drafts: int, *, max_ngram: int = 3,
                 min_ngram: int = 1):
    """`NGramDrafter.propose` on the device: [B, num_drafts] int32 drafts, pure jnp.

    history: [B, S] int32, row b's first lengths[b] tokens (>= 1) are its history (prompt +
      generated, the last not yet fed); what lies past them is never read.
    The rule (tests/engine/test_drafting_loop.py checks it against a plain numpy reference):
    for n = max_ngram down to min_ngram (n <= T - 1), the most recent earlier
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


_ngram_drafts_jit = jax.jit(ngram_drafts, static_argnames=("num_drafts", "max_ngram",
                                                         "min_ngram"))


# MTP drafts ------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPSeats:
    """What MTP drafting (`decode_loop(..., mtp=...)`) carries per seat between steps and calls.

    The MTP drafter's state (`MTPDrafter` runs the same from the host): MTP layer 0 holds one
    pair (h_i, t_{i+1}) per position i the main model stores (h_i its last hidden state there,
    t_{i+1} the token after it), so between steps state.lengths equals the main state's
    lengths.

    Attributes:
      state: the MTP layer's `fo_jax.resident.ResidentState` (one layer, one indexer group):
        [1, B, S, D+R] KV rows, [1, B, S, N] indexer keys, lengths [B].
      draft: [B] int32 the next step's first draft (the argmax at the last pair).
      hidden: [B, E] the layer's output h' at the last pair (what further drafts chain from).
    """

    state: Any
    draft: jax.Array
    hidden: jax.Array

    @classmethod
    def create(cls, config: ModelConfig, *, batch: int, capacity: int) -> "MTPSeats":
        """Empty seats (lengths 0): fill them with `mtp_feed` (a prompt's pairs) first."""
        from fo_jax.resident import create_mtp_state

        return cls(state=create_mtp_state(config, batch=batch, capacity=capacity),
                   draft=jnp.zeros((batch,), jnp.int32),
                   hidden=jnp.zeros((batch, config.dim), config.jnp_dtype))

    @property
    def batch(self) -> int:
        return self.draft.shape[0]


def mtp_feed(params, mtp, seats: MTPSeats, hidden, tokens, num_new, *, config: ModelConfig,
             query_block: int | None = None) -> MTPSeats:
    """Append T pairs per seat to the MTP state (`fo_jax.resident.mtp_step`): hidden [B, T, E]
    the main model's last hidden states, tokens [B, T] the tokens after them, the first
    num_new[b] real (0: the seat is not written and keeps its draft). A seat fed >= 1 pair
    takes its draft and h' at its last pair (`MTPDrafter.start` / `observe`). Pure and
    jit-able: one MTP layer over T tokens against its own cache of S rows."""
    from fo_jax.resident import mtp_step

    num_new = jnp.asarray(num_new, jnp.int32)
    logits, out, state = mtp_step(params, mtp, seats.state, hidden, tokens, num_new,
                                  config=config, query_block=query_block)
    rows = jnp.arange(seats.batch)
    last = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
    fed = num_new > 0
    draft = jnp.argmax(logits[rows, last], axis=-1).astype(jnp.int32)
    return MTPSeats(state=state, draft=jnp.where(fed, draft, seats.draft),
                    hidden=jnp.where(fed[:, None], out[rows, last].astype(seats.hidden.dtype),
                                     seats.hidden))


mtp_feed_jit = jax.jit(mtp_feed, static_argnames=("config", "query_block"),
                       donate_argnames=("seats",))


def mtp_feed_seat(params, mtp, seats: MTPSeats, seat, hidden, tokens, num_new, *,
                  config: ModelConfig, query_block: int | None = None) -> MTPSeats:
    """`mtp_feed` of seat `seat` alone: hidden [1, T, E], tokens [1, T], num_new [1]; the seat's
    MTP rows, draft and h' are sliced out, fed and written back, the other seats left as they
    are (work independent of B, bit for bit `mtp_feed` on a batch-1 `MTPSeats`). `seat` is an
    int32 scalar, traced under `mtp_feed_seat_jit` (one program for every seat). Pure."""
    def one(x, axis):
        return jax.lax.dynamic_slice_in_dim(x, seat, 1, axis=axis)

    def put(full, part, axis):
        return jax.lax.dynamic_update_slice_in_dim(full, part, seat, axis=axis)

    st = seats.state
    view = MTPSeats(state=dataclasses.replace(st, kv=one(st.kv, 1),
                                              index_keys=one(st.index_keys, 1),
                                              lengths=one(st.lengths, 0)),
                    draft=one(seats.draft, 0), hidden=one(seats.hidden, 0))
    out = mtp_feed(params, mtp, view, hidden, tokens, num_new, config=config,
                   query_block=query_block)
    state = dataclasses.replace(st, kv=put(st.kv, out.state.kv, 1),
                                index_keys=put(st.index_keys, out.state.index_keys, 1),
                                lengths=put(st.lengths, out.state.lengths, 0))
    return MTPSeats(state=state, draft=put(seats.draft, out.draft, 0),
                    hidden=put(seats.hidden, out.hidden, 0))


mtp_feed_seat_jit = jax.jit(mtp_feed_seat, static_argnames=("config", "query_block"),
                            donate_argnames=("seats",))


def mtp_drafts(params, mtp, seats: MTPSeats, active, num_drafts: int, *,
               config: ModelConfig):
    """([B, num_drafts] drafts, MTP state with the chained pairs appended): the first draft is
    `seats.draft`; draft k >= 2 is the argmax of MTP layer 0 fed (h', draft k - 1) of the
    previous one (`MTPDrafter.propose`): num_drafts - 1 MTP calls of one pair per seat. The
    chained pairs are speculative: `mtp_observe` forgets them. Inactive seats are not
    written (their drafts unspecified)."""
    from fo_jax.resident import mtp_step

    drafts, draft, hidden, state = [seats.draft], seats.draft, seats.hidden, seats.state
    ones = active.astype(jnp.int32)
    for _ in range(1, num_drafts):
        logits, out, state = mtp_step(params, mtp, state, hidden[:, None], draft[:, None],
                                      ones, config=config)
        draft = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        hidden = out[:, 0].astype(seats.hidden.dtype)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), state


def mtp_observe(params, mtp, seats: MTPSeats, state, hidden, tokens, count, lengths, active, *,
                config: ModelConfig) -> MTPSeats:
    """After a verification step: forget the chained pairs (each active seat's MTP length back
    to the main length n before the step, `lengths`; O(B)), then feed the pairs of the count
    [B] kept positions: hidden [B, W, E] of the W fed tokens, tokens [B, W] the tokens yielded
    after them (`draft_step_tokens`) (`MTPDrafter.observe`). One MTP call of W pairs."""
    from fo_jax.resident import ResidentState

    state = ResidentState(kv=state.kv, index_keys=state.index_keys,
                          lengths=jnp.where(active, lengths, state.lengths))
    seats = MTPSeats(state=state, draft=seats.draft, hidden=seats.hidden)
    return mtp_feed(params, mtp, seats, hidden, tokens, jnp.where(active, count, 0),
                    config=config)



class MTPDrafter:
    """Drafts from the model's multi-token-prediction layer, greedy, for `generate`: the MTP
    rule of the decode loop (`MTPSeats`, `mtp_feed`, `mtp_drafts`, `mtp_observe`) run from the
    host, step by step.

    MTP layer 0 maps (h_i, t_{i+1}) -- the main model's last hidden state at position i and the
    token after it -- to logits of t_{i+2} (`fo_jax.resident.mtp_step`). Its KV state (one
    layer, one indexer group: resident on the device) holds one pair per position the main
    model stores: `start` feeds the prompt's pairs (the last one pairs h_{T-1} with the first
    generated token), `observe` the pairs of the tokens a verification step kept. The first
    draft is the argmax at the last pair; draft k >= 2 chains, as DeepSeek does with one
    layer: the layer's own output h' and draft k - 1 are fed back as the next pair (always
    through MTP layer 0: a checkpoint's further MTP layers, if any, are loaded but unused).
    Chained pairs are speculative: `observe` rolls them back before feeding the kept pairs, so
    the state equals that of a run that never chained.
    Per step: one MTP call of W pairs (`observe`) plus W - 2 calls of one pair (`propose`),
    each one decoder layer against the layer's own cache; host reads of the drafts only.

    Attributes:
      params: the main model's parameters (embed / head when the MTP layer shares them).
      mtp: the MTP parameters (`fo_jax.checkpoints.hf.load_checkpoint(..., mtp=True)`).
      batch: the engine's batch.
      capacity: the engine's capacity (tokens per request).
      prefill_chunk: pairs per `start` call (None: the whole prompt at once).
      seats: the `MTPSeats` (None before `start`); `state`: the MTP layer's state, with the
        chained pairs of the last `propose` until the next `observe`.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, params, mtp, config, *, batch: int, capacity: int,
                 prefill_chunk: int | None = None):
        from fo_jax.model.mtp import check_mtp_params

        check_mtp_params(mtp, config)
        self.params, self.mtp, self.config = params, mtp, config
        self.batch, self.capacity, self.prefill_chunk = batch, capacity, prefill_chunk
        self.seats: MTPSeats | None = None
        self._chained = None  # the state with the last propose's chained pairs
        self._real = None  # the state's lengths before them

    @property
    def state(self):
        return self.seats.state if self._chained is None else self._chained

    def start(self, hidden, tokens: np.ndarray, lengths: np.ndarray, first) -> None:
        """After the prefill: hidden [B, T, E] of the padded prompts tokens [B, T] (lengths [B]
        real), first [B] the first generated tokens. Starts a new MTP state."""
        from fo_jax.resident import QUERY_BLOCK

        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, np.int32)
        nxt = np.zeros(tokens.shape, np.int64)
        nxt[:, :-1] = tokens[:, 1:]
        nxt[np.arange(self.batch), lengths - 1] = np.asarray(first)
        seats = MTPSeats.create(self.config, batch=self.batch, capacity=self.capacity)
        num_t = tokens.shape[1]
        chunk = num_t if self.prefill_chunk is None else int(self.prefill_chunk)
        for lo in range(0, num_t, chunk):
            hi = min(lo + chunk, num_t)
            seats = mtp_feed(self.params, self.mtp, seats, hidden[:, lo:hi],
                             jnp.asarray(nxt[:, lo:hi], jnp.int32),
                             np.clip(lengths - lo, 0, hi - lo), config=self.config,
                             query_block=QUERY_BLOCK)
        self.seats, self._chained = seats, None

    def observe(self, hidden, tokens, keep) -> None:
        """After a verification step: hidden [B, W, E] of the W fed tokens, tokens [B, W] the
        tokens generated after each (greedy or sampled; read for the kept ones only), keep [B]
        how many fed tokens were kept (0: none, the request keeps its draft)."""
        if self.seats is None:
            raise ValueError("MTPDrafter.observe before start: the generation loop calls "
                             "start after the prefill")
        state = self.state
        real = state.lengths if self._chained is None else self._real
        every = jnp.ones((self.batch,), bool)
        self.seats = mtp_observe(self.params, self.mtp, self.seats, state, hidden,
                                 jnp.asarray(tokens, jnp.int32),
                                 jnp.asarray(np.asarray(keep), jnp.int32), real, every,
                                 config=self.config)
        self._chained = None

    def propose(self, histories: Sequence[Sequence[int]], num_drafts: int) -> np.ndarray:
        """[B, num_drafts] drafts (the histories are not read: the state holds them)."""
        check_num_drafts(num_drafts)
        if self.seats is None:
            raise ValueError("MTPDrafter.propose before start: the generation loop calls "
                             "start after the prefill")
        if len(histories) != self.batch:
            raise ValueError(f"{len(histories)} histories for an MTP drafter of batch "
                             f"{self.batch}")
        if num_drafts == 0:
            return np.zeros((self.batch, 0), np.int32)
        if self._chained is None:
            self._real = jnp.copy(self.seats.state.lengths)  # the state is donated below
        seats = dataclasses.replace(self.seats, state=self.state)
        drafts, self._chained = mtp_drafts(self.params, self.mtp, seats,
                                           jnp.ones((self.batch,), bool), num_drafts,
                                           config=self.config)
        return np.asarray(jax.device_get(drafts)).astype(np.int32)


def make_drafter(name: str | None, config, *, engine=None) -> Drafter | None:
    """The drafter named `name` ("ngram" or "mtp") for a model of `config`: None for None (or
    "none", its old spelling): no drafter.

    "mtp" needs `engine`: a `fo_jax.generate.ResidentEngine` or `OffloadEngine` built with the
    model's MTP parameters (`mtp=`, from `load_checkpoint(..., mtp=True)`); an engine whose step
    does not return the hidden states the layer reads is refused with NotImplementedError.
    """
    if name is None or name == "none":
        return None
    if name not in DRAFTERS:
        raise ValueError(f"drafter={name!r} must be one of None, "
                         f"{', '.join(map(repr, DRAFTERS))} (where the drafts for the W-way "
                         "verification step come from)")
    if name == "ngram":
        return NGramDrafter()
    model = getattr(config, "name", config)
    if engine is not None and not getattr(engine, "returns_hidden", False):
        raise NotImplementedError(
            f"drafter='mtp' reads the main model's last hidden states, which the "
            f"{getattr(engine, 'name', type(engine).__name__)!r} engine's step does not return "
            "yet: use the resident engine (ResidentEngine(..., mtp=...)) or drafter='ngram'")
    mtp = getattr(engine, "mtp", None)
    if mtp is None or config.num_nextn_predict_layers < 1:
        raise ValueError(
            f"drafter='mtp' needs the multi-token-prediction layer of the model "
            f"(num_nextn_predict_layers of a DeepSeek-V3.2 / GLM-5 checkpoint); model "
            f"{model!r} has no MTP layer loaded: load it with load_checkpoint(..., mtp=True) "
            "and pass it as ResidentEngine(..., mtp=...), or use drafter='ngram' or None")
    batch = getattr(engine, "batch", None) or engine.state.batch
    return MTPDrafter(engine.params, mtp, config, batch=batch,
                      capacity=engine.capacity, prefill_chunk=engine.prefill_chunk)


__all__ = ["DRAFTERS", "Drafter", "MTPDrafter", "MTPSeats", "NGramDrafter", "make_drafter",
           "mtp_drafts", "mtp_feed", "mtp_feed_jit", "mtp_feed_seat", "mtp_feed_seat_jit",
           "mtp_observe", "ngram_drafts"]

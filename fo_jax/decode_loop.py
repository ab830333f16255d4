"""The jit-compiled decode loop: up to N decode steps, sampling included, in one program.

    step = OffloadedStep(config, offload)            # or ResidentStep(config)
    sampling = Sampling.create(B, temperature=0.7, top_p=0.9, stop_tokens=[[eos]] * B,
                               max_new_tokens=64)
    seats = Seats.create(first_tokens[B], jax.random.key(0), sampling=sampling,
                         lengths=state.lengths, capacity=state.capacity)
    out, state, seats = decode_loop(params, state, seats, 16, sampling, step=step)
    # out.tokens [B, 16] (-1 where no token was sampled), out.num_steps, out.stats
    out, state, seats = decode_loop(params, state, seats, 16, sampling, step=step,
                                    num_drafts=2, history=history[B, S])  # n-gram drafts
    # out.tokens [B, 48] (each request's tokens, then -1), out.history, out.accepted
    out, state, seats = decode_loop(params, state, seats, 16, sampling, step=step,
                                    num_drafts=2, mtp=mtp_params, mtp_seats=mtp_seats)
    # MTP drafts: mtp_seats = MTPSeats.create(...) fed the prompts' pairs (mtp_feed);
    # out.mtp_seats carries them to the next call

Public: `decode_loop`, `Seats`, `LoopOutput`, `LoopStats`, the steps
`OffloadedStep` / `ResidentStep` and the checks `check_mtp_drafting`, `check_history` (bad
drafting settings raise `ValueError`; the number of drafts: `fo_jax.config.check_num_drafts`).
The drafters' rules are `fo_jax.drafting`'s, one per kind (n-gram: `ngram_drafts`; MTP:
`MTPSeats`, `mtp_feed`, `mtp_feed_seat`, `mtp_drafts`, `mtp_observe`, re-exported here), the
same that `fo_jax.generate` drafts with.

Contracts: the tokens equal those of a Python loop of single steps bit for bit; a done request
takes no token and its state does not change; the state is donated and updated in place; one
host round trip per call; one compiled program per (step, N, shapes), so keep `n_steps` fixed.
With per-request keys a request's tokens (greedy or sampled, with or without drafts) equal
those of the same loop serving it alone, bit for bit. `logprobs=K` changes no token; with
drafts it is refused. How the loop, its drafts, MTP drafts, keys and log-probabilities work:
docs/design/engine.md, "The decode loop".
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax import resident
from fo_jax.config import ModelConfig, check_num_drafts
from fo_jax.kernels import resolve_implementation
# The MTP names beyond those the loop calls are re-exported: the engine imports them from here.
from fo_jax.drafting import (MTPSeats, NGramDrafter, mtp_drafts, mtp_feed, mtp_feed_jit,
                             mtp_feed_seat, mtp_feed_seat_jit, mtp_observe, ngram_drafts)
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import state as offload_state
from fo_jax.offload.config import OffloadConfig
from fo_jax.sampling import (Sampling, check_keys, check_logprobs, sample_tokens,
                             speculative_tokens, token_logprobs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Seats:
    """What the loop carries per request between calls.

    Attributes:
      tokens: [B] int32: each request's last sampled token (fed by the next step).
      keys: PRNG keys: [] one for the batch, or [B] one per request.
      generated: [B] int32: tokens sampled so far (counting `tokens`).
      done: [B] bool: the request takes no more steps.
    """

    tokens: jax.Array
    keys: jax.Array
    generated: jax.Array
    done: jax.Array

    @classmethod
    def create(cls, tokens, keys, *, sampling: Sampling, lengths, capacity: int,
               generated=1) -> "Seats":
        """Seats after each request sampled `tokens` [B] (by default its first token).

        A request whose token is already a stop token, that reached its max_new_tokens, or
        whose state is full (lengths >= capacity) starts done.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        batch = sampling.batch
        if tokens.shape != (batch,):
            raise ValueError(f"tokens must be [{batch}] (one last token per request), got "
                             f"shape {tokens.shape}")
        check_keys(keys, batch)
        generated = jnp.asarray(np.broadcast_to(np.asarray(generated, np.int32), (batch,)))
        lengths = jnp.asarray(lengths, jnp.int32)
        done = finished(tokens, generated, lengths, capacity, sampling)
        return cls(tokens=tokens, keys=keys, generated=generated, done=done)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


def finished(tokens, generated, lengths, capacity: int, sampling: Sampling):
    """[B] bool: the request just sampled a stop token, reached its max_new_tokens, or its
    state holds `capacity` tokens (the token just sampled cannot be fed)."""
    stop = jnp.any(tokens[:, None] == sampling.stop_tokens, axis=-1)
    return stop | (generated >= sampling.max_new_tokens) | (lengths >= capacity)


# Steps -----------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopStats:
    """Offload statistics summed over the steps of a call, on the device.

    Attributes:
      hits, tail_hits, misses: [G, B, W] int32 per group, request and way.
      union: [G, B] int32 distinct misses per group (rows copied into each of its layers).
      h2d_bytes, d2h_bytes: [B] float32 bytes moved (float32: int32 overflows at real sizes
        within a few calls; exact below 2^24 bytes per request and call).
    """

    hits: jax.Array
    tail_hits: jax.Array
    misses: jax.Array
    union: jax.Array
    h2d_bytes: jax.Array
    d2h_bytes: jax.Array

    @classmethod
    def zeros(cls, groups: int, batch: int, ways: int = 1) -> "LoopStats":
        gbw = jnp.zeros((groups, batch, ways), jnp.int32)
        return cls(hits=gbw, tail_hits=gbw, misses=gbw,
                   union=jnp.zeros((groups, batch), jnp.int32),
                   h2d_bytes=jnp.zeros((batch,), jnp.float32),
                   d2h_bytes=jnp.zeros((batch,), jnp.float32))

    def add(self, stats: offload_decode.DecodeStats) -> "LoopStats":
        return LoopStats(hits=self.hits + stats.hits, tail_hits=self.tail_hits + stats.tail_hits,
                         misses=self.misses + stats.misses, union=self.union + stats.union,
                         h2d_bytes=self.h2d_bytes + stats.h2d_bytes.astype(jnp.float32),
                         d2h_bytes=self.d2h_bytes + stats.d2h_bytes.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class OffloadedStep:
    """The offloaded decode step (`fo_jax.offload.decode.decode_step`) as the loop runs it.

    A frozen (hashable) description: the loop's program is compiled once per step setting.
    """

    config: ModelConfig
    offload: OffloadConfig
    implementation: str = "xla"
    interpret: Any = False

    def __post_init__(self):
        self.offload.validate_for(self.config)
        object.__setattr__(self, "implementation", offload_decode.check_implementation(
            self.implementation, self.interpret, self.offload))

    def check_state(self, state) -> None:
        offload_decode.check_state(state, config=self.config, offload=self.offload)

    def zero_stats(self, batch: int, ways: int = 1) -> LoopStats:
        return LoopStats.zeros(self.config.num_groups, batch, ways)

    def rollback(self, state, num_drop):
        """Forget the last num_drop [B] tokens of each request (`fo_jax.offload.state.rollback`:
        O(B), only the lengths change)."""
        return offload_state.rollback(state, num_drop)

    def __call__(self, params, state, tokens, active, return_hidden: bool = False):
        """(logits [B, W, V], state, DecodeStats) of one step; inactive requests unchanged.
        With `return_hidden`, also the last hidden states [B, W, E] (what the MTP layer
        reads; the logits are the same bit for bit)."""
        return offload_decode.decode_step(
            params, state, tokens, config=self.config, offload=self.offload, check=False,
            implementation=self.implementation, interpret=self.interpret, active=active,
            return_hidden=return_hidden)


@dataclasses.dataclass(frozen=True)
class ResidentStep:
    """The resident decode step (`fo_jax.resident.decode_step`) as the loop runs it."""

    config: ModelConfig
    implementation: str = "xla"
    interpret: Any = False

    def __post_init__(self):
        object.__setattr__(self, "implementation",
                           resolve_implementation(self.implementation, self.interpret))

    def check_state(self, state) -> None:
        if not isinstance(state, resident.ResidentState):
            raise ValueError(f"ResidentStep steps a ResidentState, got {type(state).__name__}")

    def zero_stats(self, batch: int, ways: int = 1) -> None:
        return None

    def rollback(self, state, num_drop):
        """Forget the last num_drop [B] tokens of each request (`fo_jax.resident.rollback`)."""
        return resident.rollback(state, num_drop)

    def __call__(self, params, state, tokens, active, return_hidden: bool = False):
        """(logits [B, W, V], state, None); with `return_hidden` also the last hidden states
        [B, W, E] (as OffloadedStep)."""
        logits, state, *hidden = resident.decode_step(
            params, state, tokens, config=self.config, check=False,
            implementation=self.implementation, interpret=self.interpret, active=active,
            return_hidden=return_hidden)
        return (logits, state, None, *hidden)


# The loop --------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopOutput:
    """What one call of `decode_loop` produced.

    Attributes:
      tokens: [B, N W] int32: the tokens request b sampled, in order, then -1 (W = 1 +
        num_drafts). Without drafts ([B, N]) column i is step i's token (-1 where the request
        sampled none: done before step i, or the loop stopped before it); with drafts a step
        yields 1 to W tokens per request, packed after the previous step's.
      fed: [B] int32: tokens each request appended to its state (= its sampled tokens).
      num_steps: [] int32: steps run (< N when every request was done earlier).
      stats: LoopStats summed over the steps (offloaded step; [G, B, W] per way, the rejected
        ways included), or None (resident).
      accepted, proposed: [B] int32 drafts accepted (and yielded) / proposed over the call,
        greedy and sampled requests alike (with num_drafts = 0: None).
      history: [B, S] int32 the histories with the call's tokens appended (num_drafts > 0),
        else None.
      counts: [B, N] int32 tokens request b yielded at step i (num_drafts > 0; 0 where it
        took no step), else None: a step that yields e tokens stored the e fed before them
        (what a replay of the request feeds again, `fo_jax.engine.Engine`).
      drafts: [B, N, D] int32 the drafts request b was fed at step i (num_drafts > 0;
        unspecified where it took no step), else None.
      mtp_seats: the MTPSeats after the call (MTP drafts), else None.
      logprobs, logprob_ids: with `decode_loop(..., logprobs=K)`, [B, N, K + 1] float32 /
        int32: at step i, column 0 the sampled token's log-probability (and its id,
        tokens[b, i]), columns 1..K the K most likely tokens' (`token_logprobs`: of the raw
        model distribution); unspecified where tokens[b, i] is -1. Else None.
    """

    tokens: jax.Array
    fed: jax.Array
    num_steps: jax.Array
    stats: LoopStats | None
    accepted: jax.Array | None = None
    proposed: jax.Array | None = None
    history: jax.Array | None = None
    counts: jax.Array | None = None
    drafts: jax.Array | None = None
    mtp_seats: MTPSeats | None = None
    logprobs: jax.Array | None = None
    logprob_ids: jax.Array | None = None


def decode_loop(params, state, seats: Seats, n_steps: int, sampling: Sampling, *, step,
                num_drafts: int = 0, drafter: NGramDrafter | None = None, history=None,
                mtp: dict | None = None, mtp_seats: MTPSeats | None = None,
                logprobs: int | None = None):
    """Up to `n_steps` decode steps in one program (see the module doc).

    Args:
      state: the step's state (DecodeState for OffloadedStep, ResidentState for ResidentStep);
        donated: use the returned one.
      seats: each request's last token, keys and done flag (`Seats.create`).
      n_steps: N >= 1, static (one program per N).
      sampling: per-request settings (`Sampling.create`).
      step: OffloadedStep or ResidentStep.
      num_drafts: D >= 0, static: each step feeds [last token, D drafts] as W = D + 1 ways
        (W <= config.max_ways) and keeps the drafts the model's greedy tokens confirm, or,
        at temperature > 0, the ones speculative sampling accepts (see
        `speculative_tokens`); 0: one token per step (another program).
      drafter: with num_drafts > 0, the `fo_jax.drafting.NGramDrafter` whose rule the device
        drafter (`fo_jax.drafting.ngram_drafts`) follows (default NGramDrafter()).
      history: with n-gram drafts, [B, S] int32, S = the state's capacity: row b holds the
        request's prompt and sampled tokens (lengths[b] + 1 of them: the last not yet fed);
        donated; returned with the call's tokens appended in `LoopOutput.history` (optional
        with MTP drafts: appended to the same way when given).
      mtp: MTP drafts instead of n-gram ones: the model's MTP parameters
        (`fo_jax.model.mtp`; config.num_nextn_predict_layers >= 1), with `mtp_seats`
        (`MTPSeats`: the MTP layer's state and each seat's next draft, filled with the
        prompts' pairs by `mtp_feed`; donated; returned in `LoopOutput.mtp_seats`).
      logprobs: None (default: the program computes no log-probabilities), or K >= 0, static
        (another program): each sampled token's log-probability and the K most likely
        tokens' (`LoopOutput.logprobs`, `token_logprobs`: log_softmax of the step's raw
        logits); the tokens are those of the program without them, bit for bit. Not with
        drafts (num_drafts > 0).
    Returns:
      (LoopOutput, new state, new seats).
    Work: N steps at most, each one decode step of W ways plus O(B W V log V) for sampling
    (O(B V W) when every request is greedy) and, with drafts, O(B S max_ngram) for n-gram
    drafting, or, MTP, D MTP-layer calls (D - 1 of one pair, one of W pairs; one decoder
    layer each against the layer's own cache); the host is not involved between steps.
    """
    if (not isinstance(n_steps, numbers.Integral) or isinstance(n_steps, bool)
            or n_steps < 1):
        raise ValueError(f"n_steps={n_steps!r} must be an int >= 1 (decode steps per call)")
    if not isinstance(step, (OffloadedStep, ResidentStep)):
        raise ValueError(f"step must be an OffloadedStep or a ResidentStep, got "
                         f"{type(step).__name__}")
    resident.check_live(state, "decode_loop")
    step.check_state(state)
    batch = state.batch
    for name, value in (("seats", seats.batch), ("sampling", sampling.batch)):
        if value != batch:
            raise ValueError(f"{name} hold {value} requests but the state holds {batch}: "
                             "build them for the same batch")
    check_keys(seats.keys, batch)
    check_num_drafts(num_drafts, step.config)
    check_logprobs(logprobs, step.config)
    if logprobs is not None and num_drafts:
        raise NotImplementedError(
            f"logprobs are computed by the one-token loop only, not with num_drafts="
            f"{num_drafts} (a verification step yields its tokens from several ways): pass "
            "num_drafts=0, or logprobs=None")
    if num_drafts == 0:
        if history is not None or drafter is not None:
            raise ValueError("history and drafter are read only with num_drafts > 0: pass "
                             "num_drafts, or drop them")
        if mtp is not None or mtp_seats is not None:
            raise ValueError("mtp and mtp_seats are read only with num_drafts > 0: pass "
                             "num_drafts, or drop them")
        return loop_jit(params, state, seats, sampling, n_steps=int(n_steps), step=step,
                        logprobs=None if logprobs is None else int(logprobs))
    if mtp is not None or mtp_seats is not None:
        check_mtp_drafting(mtp, step.config, drafter=drafter)
        if not isinstance(mtp_seats, MTPSeats) or mtp_seats.batch != batch or \
                mtp_seats.state.capacity != state.capacity:
            raise ValueError(f"MTP drafts need mtp_seats: an MTPSeats of {batch} seats and "
                             f"capacity {state.capacity} (MTPSeats.create, filled with the "
                             f"prompts' pairs by mtp_feed), got {type(mtp_seats).__name__}")
        if history is not None:
            check_history(history, batch, state.capacity, num_drafts)
            history = jnp.asarray(history, jnp.int32)
        return _draft_loop_jit(params, state, seats, sampling, history, mtp, mtp_seats,
                               n_steps=int(n_steps), step=step, num_drafts=int(num_drafts),
                               drafter=None)
    drafter = NGramDrafter() if drafter is None else drafter
    if not isinstance(drafter, NGramDrafter):
        raise NotImplementedError(
            f"drafts inside the decode loop come from the device n-gram drafter (a "
            f"fo_jax.drafting.NGramDrafter), got {type(drafter).__name__}; for MTP drafts "
            "pass mtp= (the MTP parameters) and mtp_seats= (an MTPSeats) instead")
    check_history(history, batch, state.capacity, num_drafts)
    return _draft_loop_jit(params, state, seats, sampling, jnp.asarray(history, jnp.int32),
                           None, None, n_steps=int(n_steps), step=step,
                           num_drafts=int(num_drafts), drafter=drafter)


def check_history(history, batch: int, width: int, num_drafts: int) -> None:
    """Raise unless history is an integer [batch, width] array."""
    if (history is None or getattr(history, "shape", None) != (batch, width)
            or not jnp.issubdtype(history.dtype, jnp.integer)):
        got = None if history is None else (f"{getattr(history, 'dtype', type(history))}"
                                            f"{list(getattr(history, 'shape', ()))}")
        raise ValueError(f"num_drafts={num_drafts} needs history: an int32 [{batch}, {width}] "
                         "array (each request's prompt and sampled tokens, the state's "
                         f"capacity wide), got {got}")


def check_mtp_drafting(mtp, config: ModelConfig, *, drafter=None) -> None:
    """Raise unless MTP drafting can run: MTP parameters of `config` (which has an MTP layer,
    num_nextn_predict_layers >= 1) and no n-gram drafter besides."""
    from fo_jax.model.mtp import check_mtp_params

    if drafter is not None:
        raise ValueError(f"drafts come from the MTP layer (mtp=...) or from a drafter "
                         f"({type(drafter).__name__}), not both: drop one")
    if config.num_nextn_predict_layers < 1:
        raise ValueError(f"MTP drafts need the model's multi-token-prediction layer, but config "
                         f"{config.name!r} has num_nextn_predict_layers="
                         f"{config.num_nextn_predict_layers}: use n-gram drafts, or a model "
                         "with an MTP layer (a DeepSeek-V3.2 / GLM-5 checkpoint)")
    if mtp is None:
        raise ValueError("MTP drafts need the MTP parameters: load them with "
                         "load_checkpoint(..., mtp=True) (or fo_jax.model.mtp.init_mtp_params)"
                         " and pass them as mtp=")
    check_mtp_params(mtp, config)


@functools.partial(jax.jit, static_argnames=("n_steps", "step", "logprobs", "together"),
                   donate_argnames=("state",))
def loop_jit(params, state, seats: Seats, sampling: Sampling, *, n_steps: int, step,
             logprobs: int | None = None, together: str | None = None):
    """The decode loop without drafts, pure and jitted (the state donated): (LoopOutput, state,
    seats). `decode_loop` validates, then runs it; the data-parallel loop
    (`fo_jax.sharded_steps`) runs it per rank. together: a mesh axis whose ranks leave the
    loop together, when every rank's requests are done (a step holding collectives over that
    axis, the all-to-all MoE: every rank must run every step); a rank done before steps
    inactively, as a rank of the data-parallel loop does after it leaves."""
    batch = seats.tokens.shape[0]
    capacity = state.capacity
    fed0 = jnp.zeros((batch,), jnp.int32)
    out0 = jnp.full((batch, n_steps), -1, jnp.int32)
    # With logprobs: [B, N, K + 1] values and ids (`token_logprobs`); else nothing carried.
    lp0 = None
    if logprobs is not None:
        lp0 = (jnp.zeros((batch, n_steps, logprobs + 1), jnp.float32),
               jnp.full((batch, n_steps, logprobs + 1), -1, jnp.int32))

    def cond(carry):
        i, _, seats, *_ = carry
        busy = ~jnp.all(seats.done)
        if together is not None:
            busy = jax.lax.psum(busy.astype(jnp.int32), together) > 0
        return (i < n_steps) & busy

    def body(carry):
        i, state, seats, out, fed, stats, lp = carry
        active = ~seats.done
        logits, state, step_stats = step(params, state, seats.tokens[:, None], active)
        nxt, keys = sample_tokens(logits[:, -1], seats.keys, sampling, active)
        nxt = jnp.where(active, nxt, -1)
        if lp is not None:
            values, ids = token_logprobs(logits[:, -1], nxt, logprobs)
            lp = (jax.lax.dynamic_update_slice(lp[0], values[:, None], (0, i, 0)),
                  jax.lax.dynamic_update_slice(lp[1], ids[:, None], (0, i, 0)))
        generated = seats.generated + active.astype(jnp.int32)
        done = seats.done | (active & finished(nxt, generated, state.lengths, capacity,
                                               sampling))
        seats = Seats(tokens=jnp.where(active, nxt, seats.tokens), keys=keys,
                      generated=generated, done=done)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        if stats is not None:
            stats = stats.add(step_stats)
        return i + 1, state, seats, out, fed + active.astype(jnp.int32), stats, lp

    carry = (jnp.asarray(0, jnp.int32), state, seats, out0, fed0, step.zero_stats(batch), lp0)
    num_steps, state, seats, out, fed, stats, lp = jax.lax.while_loop(cond, body, carry)
    values, ids = (None, None) if lp is None else lp
    return LoopOutput(tokens=out, fed=fed, num_steps=num_steps, stats=stats, logprobs=values,
                      logprob_ids=ids), state, seats


def draft_step_tokens(fed, logits, lengths, seats: Seats, sampling: Sampling, capacity: int,
                      active):
    """What one verification step yields: (tokens [B, W], count [B], keys).

    fed: [B, W] the step's tokens [last, d_1 .. d_D] at positions n .. n + D (n = lengths);
    logits: [B, W, V] theirs. The accepted drafts and the token after them
    (`speculative_tokens`: greedy requests keep the drafts their greedy tokens confirm,
    sampled ones do speculative sampling; `seats.keys` advanced as it says), with the count
    cut at max_new_tokens (generated + count <= max), at capacity (n + count <= S: every
    yielded token but the last is stored), and after the first stop token (nothing after it
    is yielded); 0 if inactive. count - 1 drafts were accepted (and yielded).
    tokens[b, j] for j >= count[b] is unspecified. O(B W (V + E)) for E stop ids, plus
    O(B W V log V) when a request samples."""
    tokens, accepted, keys = speculative_tokens(fed, logits, seats.keys, sampling, active)
    count = jnp.minimum(accepted + 1, jnp.minimum(sampling.max_new_tokens - seats.generated,
                                                  capacity - lengths))
    ways = jnp.arange(fed.shape[1], dtype=jnp.int32)[None, :]
    stops = jnp.any(tokens[:, :, None] == sampling.stop_tokens[:, None, :], axis=-1)
    stops = stops & (ways < count[:, None])
    first_stop = jnp.argmax(stops, axis=1).astype(jnp.int32)
    count = jnp.where(jnp.any(stops, axis=1), first_stop + 1, count)
    return tokens, jnp.where(active, count, 0), keys


@functools.partial(jax.jit, static_argnames=("n_steps", "step", "num_drafts", "drafter"),
                   donate_argnames=("state", "history", "mtp_seats"))
def _draft_loop_jit(params, state, seats: Seats, sampling: Sampling, history, mtp, mtp_seats,
                    *, n_steps: int, step, num_drafts: int, drafter: NGramDrafter | None):
    """The loop with drafts: n-gram ones from `history` (mtp None), or MTP ones from
    `mtp_seats` (history None, or appended to as with n-gram drafts)."""
    batch = seats.tokens.shape[0]
    width = state.capacity
    ways = num_drafts + 1
    capacity = state.capacity
    rows = jnp.arange(batch)[:, None]
    cols = jnp.arange(ways, dtype=jnp.int32)[None, :]
    zeros = jnp.zeros((batch,), jnp.int32)
    out0 = jnp.full((batch, n_steps * ways), -1, jnp.int32)
    counts0 = jnp.zeros((batch, n_steps), jnp.int32)
    drafts0 = jnp.zeros((batch, n_steps, num_drafts), jnp.int32)
    config = step.config

    def cond(carry):
        i, _, seats, *_ = carry
        return (i < n_steps) & ~jnp.all(seats.done)

    def body(carry):
        (i, state, seats, history, mtp_seats, out, counts, drafted, fed, accepted, proposed,
         stats) = carry
        active = ~seats.done
        lengths = state.lengths  # n: stored tokens; the history holds n + 1
        if mtp_seats is None:
            drafts = ngram_drafts(history, lengths + 1, num_drafts,
                                  max_ngram=drafter.max_ngram, min_ngram=drafter.min_ngram)
        else:
            drafts, chained = mtp_drafts(params, mtp, mtp_seats, active, num_drafts,
                                         config=config)
        tokens_in = jnp.concatenate([seats.tokens[:, None], drafts], axis=1)  # [B, W]
        logits, state, step_stats, *hidden = step(params, state, tokens_in, active,
                                                  return_hidden=mtp_seats is not None)
        tokens, count, keys = draft_step_tokens(tokens_in, logits, lengths, seats, sampling,
                                                capacity, active)
        # Keep the fed tokens of the yielded ones (the last yielded is fed next step).
        state = step.rollback(state, state.lengths - (lengths + count))
        if mtp_seats is not None:  # the kept pairs (h_{n+j}, tokens[j]), j < count
            mtp_seats = mtp_observe(params, mtp, mtp_seats, chained, hidden[0], tokens, count,
                                    lengths, active, config=config)
        keep = cols < count[:, None]
        if history is not None:
            history = history.at[rows, jnp.where(keep, lengths[:, None] + 1 + cols,
                                                 width)].set(tokens, mode="drop")
        out = out.at[rows, jnp.where(keep, fed[:, None] + cols, out.shape[1])].set(
            tokens, mode="drop")
        last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        generated = seats.generated + count
        done = seats.done | (active & finished(last, generated, lengths + count, capacity,
                                               sampling))
        seats = Seats(tokens=jnp.where(active, last, seats.tokens), keys=keys,
                      generated=generated, done=done)
        accepted = accepted + jnp.where(active, count - 1, 0)
        proposed = proposed + jnp.where(active, num_drafts, 0)
        if stats is not None:
            stats = stats.add(step_stats)
        counts = jax.lax.dynamic_update_slice(counts, count[:, None], (0, i))
        drafted = jax.lax.dynamic_update_slice(drafted, drafts[:, None], (0, i, 0))
        return (i + 1, state, seats, history, mtp_seats, out, counts, drafted, fed + count,
                accepted, proposed, stats)

    carry = (jnp.asarray(0, jnp.int32), state, seats, history, mtp_seats, out0, counts0,
             drafts0, zeros, zeros, zeros, step.zero_stats(batch, ways))
    (num_steps, state, seats, history, mtp_seats, out, counts, drafted, fed, accepted,
     proposed, stats) = jax.lax.while_loop(cond, body, carry)
    return LoopOutput(tokens=out, fed=fed, num_steps=num_steps, stats=stats, accepted=accepted,
                      proposed=proposed, history=history, counts=counts, drafts=drafted,
                      mtp_seats=mtp_seats), state, seats


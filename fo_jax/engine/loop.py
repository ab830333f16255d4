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

One call runs a `lax.while_loop` of decode steps: feed each request's last token, sample the
next one on the device (`sample_tokens`: the same arithmetic as `fo_jax.generate.sample`, so
the tokens equal those of a Python loop of single steps bit for bit), mark a request done on a
stop token, on its `max_new_tokens`, or when its state is full (capacity), and stop early once
every request is done. A done request takes no further token: the step runs with it inactive,
so nothing of its state changes (length, host pages, hot cache, indexer keys: see the
`active` argument of the steps). Offload statistics are summed on the device (`LoopStats`);
the host sees nothing until it reads the outputs: one round trip per call instead of one per
token.

The state is donated and carried through the loop in place (tests/engine/test_loop.py checks
the compiled loop's HLO with fo_jax.hlo_checks). One compiled program per (step, N, shapes):
`n_steps` is static, so a caller keeps it fixed and lets `max_new_tokens` end the last call.

Drafts (`num_drafts=D > 0`, an n-gram drafter on the device): each step feeds [last token, D
drafts] as W = D + 1 ways, the drafts proposed from each request's history ([B, S]: prompt and
sampled tokens, carried and returned by the loop) by `fo_jax.drafting.ngram_drafts` (the rule of
the host `NGramDrafter`, O(B S max_ngram) compares per step). A request keeps the drafts it
accepts plus one more token (`draft_step_tokens`: cut at max_new_tokens, capacity and the
first stop token; nothing after a stop token is yielded), and the state forgets the rest
(`rollback`: O(B), only lengths change). What a request accepts (`speculative_tokens`):

  * greedy (temperature 0): the longest prefix of drafts its greedy tokens confirm, then the
    next greedy token. Bitwise: a W-way step's way-0 logits differ in the last bits from a
    W = 1 step's on CPU (another program shape), so the tokens equal W = 1 greedy decoding's
    up to a near-tie of the two largest logits, as `fo_jax.generate`'s host-driven drafting
    does;
  * sampled (temperature > 0): speculative sampling (Leviathan et al. 2023, Chen et al.
    2023) for a deterministic drafter (its q a point mass at the draft d): with p the
    nucleus distribution of the way before d (temperature, then top_p: what `sample_tokens`
    samples from), d is accepted with probability p(d); the first rejected way samples p
    without d, renormalized (the residual (p - q)+); after D acceptances a bonus token is
    sampled from the last way. The tokens follow p token by token, exactly as one-token
    steps' do (the output distribution is unchanged), but they are other random draws: a
    loop with drafts does not give the tokens of a num_drafts=0 loop with the same keys, only
    tokens of the same law.

What holds exactly is that every program has the same shapes whoever sits in the other seats,
so with per-request keys a request's tokens (greedy or sampled) equal those of the same
drafting loop (or engine) serving it alone, bit for bit. Up to N W tokens per request and call.

MTP drafts (`mtp=` the model's multi-token-prediction parameters, `mtp_seats=` an `MTPSeats`):
the rule of the host `fo_jax.drafting.MTPDrafter`, on the device. The loop carries each seat's
MTP layer state (one layer: [1, B, S, D+R] KV rows, [1, B, S, N] indexer keys, one pair
(h_i, t_{i+1}) per stored position: h_i the main model's last hidden state, t_{i+1} the token
after it), its next first draft and the layer's output h' there. Each step: the first draft
is the carried one, draft k >= 2 the argmax of the MTP layer fed (h', draft k - 1) (D - 1
calls of one pair per seat: `mtp_drafts`); the main step verifies the W ways and returns their
hidden states too (the steps' `return_hidden`: the logits are the same bit for bit); the
chained pairs are forgotten (the MTP lengths set back, O(B)) and the kept pairs (hidden at the
count kept positions, the tokens yielded after them) fed in one call of W pairs, which gives
the next first draft and h' (`mtp_observe`). The drafts equal the host MTPDrafter's for the
same history (tests/engine/test_engine_mtp.py), up to the last bits of a separately compiled
program; drafts only decide how many tokens a step yields, and every MTP computation is per
seat, so a request's tokens still equal those of the same loop serving it alone, bit for bit.

Sampling keys: one key for the batch (shape []; split once per step and used for the whole
batch, as `fo_jax.generate.generate` does) or one key per request (shape [B]; each split when
its request samples, so a request's tokens do not depend on the rest of the batch). With
drafts, each step splits a request's key once as well, the step's sub-key split again into
the key of its D acceptance tests and the key of its one sampled token
(`speculative_tokens`).

Log-probabilities (`logprobs=K`, static: a program of its own, so the program without them is
unchanged): each step also returns, per request, the sampled token's log-probability and the K
most likely tokens' ids and log-probabilities ([B, N, K + 1], `token_logprobs`), computed on
the device from the logits the sampler reads. They are of the raw model distribution
(log_softmax of the logits, before temperature and top_p: vLLM's default), and reading them
changes nothing of the sampling: the tokens equal those of the program without them, bit for
bit (tests/engine/test_loop.py). One-token steps only: with drafts they are refused.
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
from fo_jax.config import ModelConfig
from fo_jax.kernels import resolve_implementation
from fo_jax.drafting import NGramDrafter, check_num_drafts, ngram_drafts
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import state as offload_state
from fo_jax.offload.config import OffloadConfig


def _check_sampling_values(temperature, top_p) -> None:
    """Raise unless every temperature is finite and >= 0 and every top_p in (0, 1]."""
    t, p = np.asarray(temperature, np.float64), np.asarray(top_p, np.float64)
    bad = np.flatnonzero(~np.isfinite(t) | (t < 0))
    if bad.size:
        raise ValueError(f"temperature={float(t[bad[0]])!r} of request {bad[0]} must be a finite "
                         "number >= 0 (0 = greedy, else the softmax temperature)")
    bad = np.flatnonzero(~(p > 0) | ~(p <= 1))
    if bad.size:
        raise ValueError(f"top_p={float(p[bad[0]])!r} of request {bad[0]} must be a number in "
                         "(0, 1] (the probability mass nucleus sampling keeps; 1 = all tokens)")


def _per_request(name: str, value, batch: int, dtype) -> np.ndarray:
    """A scalar or a sequence of `batch` values -> [B] numpy array of `dtype`."""
    arr = np.asarray(value)
    if arr.ndim == 0:
        arr = np.full((batch,), arr)
    if arr.shape != (batch,):
        raise ValueError(f"{name} must be one value or one per request ({batch}), got shape "
                         f"{arr.shape}")
    return arr.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings and stop conditions (device arrays).

    Attributes:
      temperature: [B] float32: 0 = greedy (argmax), else the softmax temperature.
      top_p: [B] float32 in (0, 1]: nucleus mass kept (ignored where greedy).
      stop_tokens: [B, E] int32: token ids that end a request (the stop token is returned,
        never fed); -1 pads rows with fewer than E.
      max_new_tokens: [B] int32: a request is done once it has sampled this many tokens (the
        one sampled from the prefill's logits included).
    """

    temperature: jax.Array
    top_p: jax.Array
    stop_tokens: jax.Array
    max_new_tokens: jax.Array

    @classmethod
    def create(cls, batch: int, *, temperature=0.0, top_p=1.0, stop_tokens=None,
               max_new_tokens=2**30) -> "Sampling":
        """Settings for `batch` requests; each argument one value for all or one per request.

        stop_tokens: None, a list of ids for all requests, or one list per request (ragged).
        Values are checked here, on the host, with messages naming the request.
        """
        if not isinstance(batch, numbers.Integral) or batch < 1:
            raise ValueError(f"batch={batch!r} must be an int >= 1")
        temperature = _per_request("temperature", temperature, batch, np.float64)
        top_p = _per_request("top_p", top_p, batch, np.float64)
        _check_sampling_values(temperature, top_p)
        max_new = _per_request("max_new_tokens", max_new_tokens, batch, np.int64)
        if np.any(max_new < 1):
            b = int(np.flatnonzero(max_new < 1)[0])
            raise ValueError(f"max_new_tokens={int(max_new[b])} of request {b} must be >= 1")
        max_new = np.minimum(max_new, 2**31 - 1)
        if stop_tokens is None:
            rows = [[] for _ in range(batch)]
        elif all(isinstance(t, numbers.Integral) for t in stop_tokens):
            rows = [list(stop_tokens)] * batch
        else:
            rows = [list(r) for r in stop_tokens]
            if len(rows) != batch:
                raise ValueError(f"stop_tokens has {len(rows)} rows, expected one per request "
                                 f"({batch}) or one list of ids for all")
        width = max([len(r) for r in rows] + [1])
        stops = np.full((batch, width), -1, np.int64)
        for b, r in enumerate(rows):
            if any(not isinstance(t, numbers.Integral) or t < 0 or t >= 2**31 for t in r):
                raise ValueError(f"stop_tokens of request {b} must be token ids >= 0, got {r}")
            stops[b, :len(r)] = r
        return cls(temperature=jnp.asarray(temperature, jnp.float32),
                   top_p=jnp.asarray(top_p, jnp.float32),
                   stop_tokens=jnp.asarray(stops, jnp.int32),
                   max_new_tokens=jnp.asarray(max_new, jnp.int32))

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]


def _is_key(keys) -> bool:
    return jnp.issubdtype(getattr(keys, "dtype", np.float32), jax.dtypes.prng_key)


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


def check_keys(keys, batch: int) -> None:
    """Raise unless `keys` is a typed PRNG key array of shape [] or [batch]."""
    if not _is_key(keys):
        raise ValueError(f"keys must be typed PRNG keys (jax.random.key(seed), or "
                         f"jax.random.split of one for one key per request), got "
                         f"{getattr(keys, 'dtype', type(keys).__name__)}")
    if keys.shape not in ((), (batch,)):
        raise ValueError(f"keys must have shape [] (one for the batch) or [{batch}] (one per "
                         f"request), got {list(keys.shape)}")


def finished(tokens, generated, lengths, capacity: int, sampling: Sampling):
    """[B] bool: the request just sampled a stop token, reached its max_new_tokens, or its
    state holds `capacity` tokens (the token just sampled cannot be fed)."""
    stop = jnp.any(tokens[:, None] == sampling.stop_tokens, axis=-1)
    return stop | (generated >= sampling.max_new_tokens) | (lengths >= capacity)


def _nucleus_logits(logits, temperature, top_p):
    """(order [B, V], kept [B, V]): rows of logits [B, V] scaled by temperature [B] (1 where
    greedy) and sorted, most likely first (`order[b, r]`: the token of rank r), with -inf past
    the nucleus (the smallest set of most likely tokens whose mass reaches top_p [B]).
    softmax(kept) is the distribution `_nucleus` samples from. O(B V log V)."""
    greedy = temperature == 0
    scaled = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    return order, jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)


def _nucleus(logits, key, temperature, top_p):
    """Rows of logits [B, V] sampled with temperature [B] and top_p [B] from one key: the
    arithmetic of `fo_jax.generate.sample` with per-row settings (greedy rows: argmax)."""
    greedy = temperature == 0
    order, kept = _nucleus_logits(logits, temperature, top_p)
    choice = jax.random.categorical(key, kept, axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)


def sample_tokens(logits, keys, sampling: Sampling, active=None):
    """Next tokens [B] from logits [B, V] on the device, and the advanced keys.

    One key for the batch ([]): split once, the sub-key samples every row: bitwise
    `fo_jax.generate.sample(logits, sub, ...)` for rows of equal settings. One key per request
    ([B]): each active request splits its own key and samples its row alone, bitwise
    `sample(logits[b:b+1], sub_b, ...)`; an inactive request's key stays. Greedy rows take the
    argmax; when every row is greedy the [B, V] sort is skipped (`lax.cond`).
    """
    batch = logits.shape[0]
    active = jnp.ones((batch,), bool) if active is None else active
    if keys.ndim == 0:
        keys, sub = jax.random.split(keys)
        sample_rows = lambda: _nucleus(logits, sub, sampling.temperature, sampling.top_p)
    else:
        split = jax.vmap(jax.random.split)(keys)  # [B, 2]
        keys = _select_keys(active, split[:, 0], keys)
        sub = split[:, 1]
        sample_rows = lambda: jax.vmap(
            lambda row, k, t, p: _nucleus(row[None], k, t[None], p[None])[0])(
                logits, sub, sampling.temperature, sampling.top_p)
    greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(jnp.any(sampling.temperature > 0), sample_rows, greedy)
    return tokens, keys


def _select_keys(active, new, old):
    """Typed keys: `new` where active, else `old` (jnp.where does not take key arrays)."""
    data = jnp.where(active[:, None], jax.random.key_data(new), jax.random.key_data(old))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))


def token_logprobs(logits, tokens, top: int):
    """(values [B, top + 1] float32, ids [B, top + 1] int32) of logits [B, V] and the tokens
    [B] sampled from them: column 0 the token's log-probability, columns 1..top the `top` most
    likely tokens' (descending; `jax.lax.top_k`, ties to the lower id). Log-probabilities of
    the raw model distribution, log_softmax(logits) in float32: before temperature and top_p,
    as vLLM returns them by default (its `raw_logprobs`), so a token's value does not depend on
    the request's sampling settings. A token < 0 (none sampled) gets an unspecified value.
    Reads the logits only: the tokens are sampled as without it. O(B V) + top-k."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[:, None], axis=-1)
    values, ids = [chosen], [tokens[:, None].astype(jnp.int32)]
    if top:
        top_values, top_ids = jax.lax.top_k(logp, top)
        values.append(top_values)
        ids.append(top_ids.astype(jnp.int32))
    return jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1)


def check_logprobs(logprobs, config: ModelConfig) -> None:
    """Raise unless `logprobs` is None or an int in [0, vocab_size] (top tokens per token)."""
    if logprobs is None:
        return
    if (not isinstance(logprobs, numbers.Integral) or isinstance(logprobs, bool)
            or not 0 <= logprobs <= config.vocab_size):
        raise ValueError(f"logprobs={logprobs!r} must be None (no log-probabilities) or an int "
                         f"in [0, vocab_size={config.vocab_size}] (the most likely tokens "
                         "returned besides the sampled one)")


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


# MTP drafts ------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPSeats:
    """What MTP drafting (`decode_loop(..., mtp=...)`) carries per seat between steps and calls.

    The rule is `fo_jax.drafting.MTPDrafter`'s: MTP layer 0 holds one pair (h_i, t_{i+1}) per
    position i the main model stores (h_i its last hidden state there, t_{i+1} the token after
    it), so between steps state.lengths equals the main state's lengths.

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
        from fo_jax.model.mtp import create_state

        return cls(state=create_state(config, batch=batch, capacity=capacity),
                   draft=jnp.zeros((batch,), jnp.int32),
                   hidden=jnp.zeros((batch, config.dim), config.jnp_dtype))

    @property
    def batch(self) -> int:
        return self.draft.shape[0]


def mtp_feed(params, mtp, seats: MTPSeats, hidden, tokens, num_new, *, config: ModelConfig,
             query_block: int | None = None) -> MTPSeats:
    """Append T pairs per seat to the MTP state (`fo_jax.model.mtp.mtp_step`): hidden [B, T, E]
    the main model's last hidden states, tokens [B, T] the tokens after them, the first
    num_new[b] real (0: the seat is not written and keeps its draft). A seat fed >= 1 pair
    takes its draft and h' at its last pair (`MTPDrafter.start` / `observe`). Pure and
    jit-able: one MTP layer over T tokens against its own cache of S rows."""
    from fo_jax.model.mtp import mtp_step

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
    from fo_jax.model.mtp import mtp_step

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
    check_drafting(num_drafts, step.config)
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
        return _loop_jit(params, state, seats, sampling, n_steps=int(n_steps), step=step,
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


def check_drafting(num_drafts, config: ModelConfig) -> None:
    """Raise unless num_drafts is an int >= 0 with W = num_drafts + 1 <= config.max_ways."""
    try:
        check_num_drafts(num_drafts)
    except ValueError:
        raise ValueError(f"num_drafts={num_drafts!r} must be an int >= 0 (draft tokens per "
                         "request and step; 0 = no drafts)") from None
    if num_drafts + 1 > config.max_ways:
        raise ValueError(
            f"num_drafts={num_drafts} makes steps of W = {num_drafts + 1} ways, but config "
            f"{config.name!r} allows at most max_ways={config.max_ways}: use num_drafts <= "
            f"{config.max_ways - 1}, or a config with max_ways >= {num_drafts + 1}")


@functools.partial(jax.jit, static_argnames=("n_steps", "step", "logprobs"),
                   donate_argnames=("state",))
def _loop_jit(params, state, seats: Seats, sampling: Sampling, *, n_steps: int, step,
              logprobs: int | None = None):
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
        return (i < n_steps) & ~jnp.all(seats.done)

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


def _speculate_row(logits, drafts, key, temperature, top_p):
    """One sampled request's verification: (tokens [W] int32, accepted [] int32) from the
    logits [W, V] of its W ways and its drafts [D] (D = W - 1; draft i + 1 was fed at way i + 1
    and is checked against way i's distribution).

    p_i = the nucleus distribution of way i (temperature, then top_p: what `_nucleus` samples
    from). Draft d_{i+1} is accepted with probability p_i(d_{i+1}) (u_i < p_i(d_{i+1}), u_i
    uniform), in order; at the first rejection, way a, the token is sampled from p_a with
    d_{a+1} removed and renormalized (the residual (p - q)+ for the point mass q of a
    deterministic drafter); after D acceptances, from p_D (the bonus token). tokens = d_1 ..
    d_a then that token (tokens[j] for j > a: unspecified). Keys: `key` splits into
    (acceptance key: the D uniforms, token key: the one categorical draw). O(W V log V)."""
    ways = logits.shape[0]
    order, kept = _nucleus_logits(logits, jnp.full((ways,), temperature),
                                  jnp.full((ways,), top_p))
    probs = jax.nn.softmax(kept, axis=-1)  # [W, V] p_i by rank (0 past the nucleus)
    p_draft = jnp.sum(jnp.where(order[:-1] == drafts[:, None], probs[:-1], 0.0), axis=-1)
    accept_key, token_key = jax.random.split(key)
    uniform = jax.random.uniform(accept_key, drafts.shape)
    accepted = jnp.sum(jnp.cumprod((uniform < p_draft).astype(jnp.int32)))
    removed = jnp.concatenate([drafts, jnp.full((1,), -1, drafts.dtype)])[accepted]
    row_order = order[accepted]
    residual = jnp.where(row_order == removed, -jnp.inf, kept[accepted])
    token = row_order[jax.random.categorical(token_key, residual)].astype(jnp.int32)
    tokens = jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)]).at[accepted].set(token)
    return tokens.astype(jnp.int32), accepted.astype(jnp.int32)


def speculative_tokens(fed, logits, keys, sampling: Sampling, active):
    """Verify one step's drafts: (tokens [B, W], accepted [B], keys), uncut (see
    `draft_step_tokens`).

    fed: [B, W] the step's tokens [last, d_1 .. d_D]; logits: [B, W, V] theirs; keys as in
    `sample_tokens`. Request b yields tokens[b, :accepted[b] + 1]: its accepted drafts, then
    one more token. A greedy request (temperature 0) accepts the longest prefix of drafts
    with d_i = g_{i-1} (g: the ways' argmax) and yields g_0 .. g_a, the tokens one-token
    steps would yield. A sampled request (temperature > 0) does speculative sampling
    (Leviathan et al. 2023, Chen et al. 2023; `_speculate_row`): draft d_i is accepted with
    probability p_{i-1}(d_i), p the nucleus distribution `sample_tokens` samples from; the
    first rejected way samples p without its draft, renormalized; after D acceptances a bonus
    token is sampled from p_D. So its tokens follow p token by token, as one-token steps'
    do (tests/engine/test_speculative.py checks the law of the first two tokens), but they
    are other random draws: not those of a num_drafts=0 loop with the same key.
    (`fo_jax.generate.generate` verifies its host drafter's drafts with this same function.)

    Keys, per step: one key per request ([B]): each active request splits its key once,
    (next key, step key), as `sample_tokens` does (an inactive request's key stays), and the
    step key splits into (acceptance key: D uniforms, token key: the one categorical draw),
    so a request's tokens depend on its own key, logits and drafts only. One key for the
    batch ([]): split once per step, (next key, step key), the step key split into B row
    keys, each used as above. A greedy request's key advances too but is not read. When
    every request is greedy, the [B, W, V] sort is skipped (`lax.cond`).
    Work: O(B W V) greedy; O(B W V log V) when a request samples."""
    batch = fed.shape[0]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, W]
    agree = (fed[:, 1:] == greedy[:, :-1]).astype(jnp.int32)
    greedy_accepted = jnp.sum(jnp.cumprod(agree, axis=1), axis=1).astype(jnp.int32)
    if keys.ndim == 0:
        keys, sub = jax.random.split(keys)
        subs = jax.random.split(sub, batch)
    else:
        split = jax.vmap(jax.random.split)(keys)  # [B, 2]
        keys = _select_keys(active, split[:, 0], keys)
        subs = split[:, 1]
    sampled = sampling.temperature > 0

    def speculate():
        tokens, accepted = jax.vmap(_speculate_row)(logits, fed[:, 1:].astype(jnp.int32), subs,
                                                    sampling.temperature, sampling.top_p)
        return (jnp.where(sampled[:, None], tokens, greedy),
                jnp.where(sampled, accepted, greedy_accepted))

    tokens, accepted = jax.lax.cond(jnp.any(sampled), speculate,
                                    lambda: (greedy, greedy_accepted))
    return tokens, accepted, keys


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

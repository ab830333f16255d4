"""The jit-compiled decode loop: up to N decode steps, sampling included, in one program.

    step = OffloadedStep(config, offload)            # or ResidentStep(config)
    sampling = Sampling.create(B, temperature=0.7, top_p=0.9, stop_tokens=[[eos]] * B,
                               max_new_tokens=64)
    seats = Seats.create(first_tokens[B], jax.random.key(0), sampling=sampling,
                         lengths=state.lengths, capacity=state.capacity)
    out, state, seats = decode_loop(params, state, seats, 16, sampling, step=step)
    # out.tokens [B, 16] (-1 where no token was sampled), out.num_steps, out.stats

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

Sampling keys: one key for the batch (shape []; split once per step and used for the whole
batch, as `fo_jax.generate.generate` does) or one key per request (shape [B]; each split when
its request samples, so a request's tokens do not depend on the rest of the batch).
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
from fo_jax.offload import decode as offload_decode
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


def _nucleus(logits, key, temperature, top_p):
    """Rows of logits [B, V] sampled with temperature [B] and top_p [B] from one key: the
    arithmetic of `fo_jax.generate.sample` with per-row settings (greedy rows: argmax)."""
    greedy = temperature == 0
    scaled = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    sorted_logits = jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, sorted_logits, axis=-1)
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

    def zero_stats(self, batch: int) -> LoopStats:
        return LoopStats.zeros(self.config.num_groups, batch)

    def __call__(self, params, state, tokens, active):
        """(logits [B, 1, V], state, DecodeStats) of one step; inactive requests unchanged."""
        return offload_decode.decode_step(
            params, state, tokens, config=self.config, offload=self.offload, check=False,
            implementation=self.implementation, interpret=self.interpret, active=active)


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

    def zero_stats(self, batch: int) -> None:
        return None

    def __call__(self, params, state, tokens, active):
        logits, state = resident.decode_step(
            params, state, tokens, config=self.config, check=False,
            implementation=self.implementation, interpret=self.interpret, active=active)
        return logits, state, None


# The loop --------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopOutput:
    """What one call of `decode_loop` produced.

    Attributes:
      tokens: [B, N] int32: the token request b sampled at step i, -1 where it sampled none
        (done before step i, or the loop stopped before it).
      fed: [B] int32: tokens each request appended to its state (= its sampled tokens).
      num_steps: [] int32: steps run (< N when every request was done earlier).
      stats: LoopStats summed over the steps (offloaded step), or None (resident).
    """

    tokens: jax.Array
    fed: jax.Array
    num_steps: jax.Array
    stats: LoopStats | None


def decode_loop(params, state, seats: Seats, n_steps: int, sampling: Sampling, *, step):
    """Up to `n_steps` decode steps of one token per request in one program (see module doc).

    Args:
      state: the step's state (DecodeState for OffloadedStep, ResidentState for ResidentStep);
        donated: use the returned one.
      seats: each request's last token, keys and done flag (`Seats.create`).
      n_steps: N >= 1, static (one program per N).
      sampling: per-request settings (`Sampling.create`).
      step: OffloadedStep or ResidentStep.
    Returns:
      (LoopOutput, new state, new seats).
    Work: N steps at most, each one decode step plus O(B V log V) for sampling (O(B V) when
    every request is greedy); the host is not involved between steps.
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
    return _loop_jit(params, state, seats, sampling, n_steps=int(n_steps), step=step)


@functools.partial(jax.jit, static_argnames=("n_steps", "step"), donate_argnames=("state",))
def _loop_jit(params, state, seats: Seats, sampling: Sampling, *, n_steps: int, step):
    batch = seats.tokens.shape[0]
    capacity = state.capacity
    fed0 = jnp.zeros((batch,), jnp.int32)
    out0 = jnp.full((batch, n_steps), -1, jnp.int32)

    def cond(carry):
        i, _, seats, _, _, _ = carry
        return (i < n_steps) & ~jnp.all(seats.done)

    def body(carry):
        i, state, seats, out, fed, stats = carry
        active = ~seats.done
        logits, state, step_stats = step(params, state, seats.tokens[:, None], active)
        nxt, keys = sample_tokens(logits[:, -1], seats.keys, sampling, active)
        nxt = jnp.where(active, nxt, -1)
        generated = seats.generated + active.astype(jnp.int32)
        done = seats.done | (active & finished(nxt, generated, state.lengths, capacity,
                                               sampling))
        seats = Seats(tokens=jnp.where(active, nxt, seats.tokens), keys=keys,
                      generated=generated, done=done)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        if stats is not None:
            stats = stats.add(step_stats)
        return i + 1, state, seats, out, fed + active.astype(jnp.int32), stats

    carry = (jnp.asarray(0, jnp.int32), state, seats, out0, fed0, step.zero_stats(batch))
    num_steps, state, seats, out, fed, stats = jax.lax.while_loop(cond, body, carry)
    return LoopOutput(tokens=out, fed=fed, num_steps=num_steps, stats=stats), state, seats

"""Text generation over either inference path, and sampling.

    engine = ResidentEngine(params, config, batch=1, capacity=512)
    engine = OffloadEngine(params, config, offload=OffloadConfig(...), batch=1)
    result = generate(engine, [prompt_ids], max_new_tokens=32, temperature=0.8, top_p=0.9,
                      key=jax.random.key(0))

An engine prefills a ragged batch of prompts (in chunks of `prefill_chunk` tokens, default
`PREFILL_CHUNK`: a long prompt never runs as one program) and then takes decode steps of one
token per request; `generate` samples (greedy at temperature 0, else temperature + top-p with a
PRNG key). With `decode_steps_per_call=N > 1` it runs N steps per compiled call instead
(`fo_jax.engine.decode_loop`: sampling on the device, the same tokens).
Offload statistics are summed on the device step by step (no host sync per step). Engines keep
each request's length on the host and refuse a step past capacity before it runs; with
`check=True` (debug; `fo-jax generate --check`) they read the whole state back after the
prefill and every step and raise `StateCheckError` on a non-finite value or a broken invariant.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax import resident
from fo_jax.config import ModelConfig, sequence_capacity_check
from fo_jax.engine.loop import (
    LoopOutput,
    OffloadedStep,
    ResidentStep,
    Sampling,
    Seats,
    decode_loop,
)
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import prefill as offload_prefill
from fo_jax.kernels import resolve_implementation
from fo_jax.offload.config import OffloadConfig, check_num_buffers
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload.state import DecodeState


class StateCheckError(RuntimeError):
    """The debug checks of an engine (`check=True`) found a bad state after a prefill or step:
    a non-finite value in stored rows or logits, or a broken invariant of the offloaded state.
    The engine keeps the state as it was found, for inspection."""


def check_sampling(temperature, top_p) -> None:
    """Raise unless temperature is a finite number >= 0 and top_p a number in (0, 1]."""
    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    if not real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 "
                         "(0 = greedy, else the softmax temperature)")
    if not real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1] (the probability mass "
                         "nucleus sampling keeps; 1 = all tokens)")


# Prompt tokens per prefill call of the engines: bounds what grows with the chunk (the logits
# [B, chunk, V], activations) and the number of compiled prefill programs; inside a chunk the
# prefill's query blocks bound the attention's temporaries.
PREFILL_CHUNK = 2048


def check_prefill_chunk(chunk) -> None:
    """Raise unless `chunk` is None or an int >= 1."""
    if chunk is not None and (not isinstance(chunk, (int, np.integer))
                              or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"prefill_chunk={chunk!r} must be an int >= 1 (prompt tokens per "
                         "prefill call), or None for the whole prompt at once")


def chunked_prefill(run, tokens: np.ndarray, lengths, chunk: int | None) -> jax.Array:
    """Prefill padded prompts [B, T] chunk by chunk; logits [B, V] of each request's last token.

    run(tokens [B, t], num_new [B]) -> logits [B, t, V] prefills one chunk (appending to the
    state); chunk None: the whole prompt at once. Requests whose prompt ended in an earlier
    chunk take 0 new tokens.
    """
    check_prefill_chunk(chunk)
    lengths = np.asarray(lengths, np.int32)
    batch, num_t = tokens.shape
    chunk = num_t if chunk is None else int(chunk)
    last = None
    for lo in range(0, num_t, chunk):
        hi = min(lo + chunk, num_t)
        logits = run(tokens[:, lo:hi], np.clip(lengths - lo, 0, hi - lo).astype(np.int32))
        end = lengths - 1 - lo  # the last token's index in this chunk
        here = jnp.asarray((end >= 0) & (end < hi - lo))[:, None]
        picked = logits[jnp.arange(batch), jnp.asarray(np.clip(end, 0, hi - lo - 1))]
        last = picked if last is None else jnp.where(here, picked, last)
    return last


def sample(logits, key, *, temperature: float, top_p: float):
    """Next tokens [B] from logits [B, V]: argmax at temperature 0, else nucleus sampling.

    Top-p keeps the smallest set of most likely tokens whose probability reaches `top_p`
    (always at least the most likely one). A NaN / infinite / negative temperature or a top_p
    outside (0, 1] is refused (`check_sampling`).
    """
    check_sampling(temperature, top_p)
    return _sample(logits, key, temperature=float(temperature), top_p=float(top_p))


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def _sample(logits, key, *, temperature: float, top_p: float):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    keep = before < top_p
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, sorted_logits, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _first_non_finite(rows, lengths) -> tuple[int, int, int] | None:
    """(u, b, t) of the first non-finite value of rows [U, B, S, X] on a stored token
    (t < lengths[b]), or None."""
    rows = np.asarray(rows).astype(np.float32)
    stored = np.arange(rows.shape[2])[None, :] < np.asarray(lengths)[:, None]  # [B, S]
    bad = np.argwhere(~np.all(np.isfinite(rows), axis=-1) & stored[None])
    return tuple(int(x) for x in bad[0]) if bad.size else None


def _check_finite(where: str, lengths, parts, logits) -> None:
    """Raise StateCheckError on a non-finite stored row of `parts` [(label, verb, rows)] or
    a non-finite logit [B, ..., V]."""
    for label, verb, rows in parts:
        hit = _first_non_finite(rows, lengths)
        if hit is not None:
            u, b, t = hit
            raise StateCheckError(f"{where}: request {b}: the {label} {u} {verb} a non-finite "
                                  f"value at token {t}")
    bad = np.argwhere(~np.isfinite(np.asarray(logits).astype(np.float32)))
    if bad.size:
        raise StateCheckError(f"{where}: request {int(bad[0][0])}: non-finite logits at "
                              f"{bad[0].tolist()}")


class _Lengths:
    """Each request's length, known on the host (no device read): steps past capacity are
    refused before they run. Decode-loop calls (`decode`) add to lengths and steps lazily: their
    counts are read from the device only when lengths or steps are next asked for."""

    _lengths = None
    _steps = 0
    _pending: tuple = ()

    def _start(self, lengths) -> None:
        self._pending = ()
        self.lengths = np.asarray(lengths).astype(np.int64)
        self.steps = 0

    def _settle(self) -> None:
        pending, self._pending = self._pending, ()
        for out in pending:
            self._lengths = self._lengths + np.asarray(out.fed)
            self._steps += int(out.num_steps)

    @property
    def lengths(self):
        self._settle()
        return self._lengths

    @lengths.setter
    def lengths(self, value) -> None:
        self._settle()
        self._lengths = value

    @property
    def steps(self) -> int:
        self._settle()
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._settle()
        self._steps = value

    def decode(self, seats: Seats, n_steps: int, sampling: Sampling) -> tuple[LoopOutput, Seats]:
        """Up to `n_steps` decode steps with on-device sampling in one program
        (`fo_jax.engine.decode_loop`): (LoopOutput, new seats). No host sync: lengths and
        step counts are read back when next asked for."""
        if self._lengths is None:
            raise ValueError(f"{type(self).__name__}.decode before prefill: prefill a batch "
                             "first")
        if self.check:
            raise ValueError("check mode reads the state back after every step: decode with "
                             "single steps (decode_steps_per_call=1)")
        out, self.state, seats = decode_loop(self.params, self.state, seats, n_steps, sampling,
                                             step=self.loop_step())
        self._pending = self._pending + (out,)
        self._add_stats(out.stats)
        return out, seats

    def _add_stats(self, stats) -> None:
        pass

    def _check_room(self, tokens) -> int:
        if self.lengths is None:
            raise ValueError(f"{type(self).__name__}.step before prefill: prefill a batch first")
        ways = int(np.shape(tokens)[1])
        need = self.lengths + ways
        worst = int(np.argmax(need))
        if need[worst] > self.capacity:
            raise ValueError(
                f"request {worst} holds {int(self.lengths[worst])} tokens; a step of {ways} "
                f"more needs {int(need[worst])} positions, beyond the engine's capacity of "
                f"{self.capacity}: build the engine with a larger capacity")
        return ways


class ResidentEngine(_Lengths):
    """The reference path: whole KV on device.

    check: debug mode: after the prefill and every step, read the state back and raise
      StateCheckError on a non-finite stored KV row, indexer key or logit.
    """

    name = "resident"

    def __init__(self, params, config: ModelConfig, *, batch: int, capacity: int,
                 implementation: str | None = None, interpret=False, check: bool = False,
                 prefill_chunk: int | None = PREFILL_CHUNK):
        check_prefill_chunk(prefill_chunk)
        self.params, self.config = params, config
        self.prefill_chunk = prefill_chunk
        self.implementation = resolve_implementation(implementation, interpret)
        self.interpret, self.check = interpret, check
        self.state = resident.ResidentState.create(config, batch=batch, capacity=capacity)
        self.lengths, self.steps = None, 0

    def loop_step(self) -> ResidentStep:
        """The step `decode` runs in its loop."""
        return ResidentStep(self.config, self.implementation, self.interpret)

    @property
    def capacity(self) -> int:
        return self.state.capacity

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray) -> jax.Array:
        """Prefill padded prompts [B, T] with `lengths` real tokens; logits of each last token.

        Starts a new batch: whatever an earlier generation left is dropped.
        """
        self.state = resident.ResidentState.create(self.config, batch=self.state.batch,
                                                   capacity=self.state.capacity)

        def run(chunk, num_new):
            logits, self.state = resident.prefill(self.params, self.state, chunk, num_new,
                                                  config=self.config)
            return logits

        last = chunked_prefill(run, tokens, lengths, self.prefill_chunk)
        self._start(lengths)
        if self.check:
            self._check_state("prefill", last)
        return last

    def step(self, tokens) -> jax.Array:
        ways = self._check_room(tokens)
        logits, self.state = resident.decode_step(
            self.params, self.state, tokens, config=self.config, check=False,
            implementation=self.implementation, interpret=self.interpret)
        self.lengths, self.steps = self.lengths + ways, self.steps + 1
        if self.check:
            self._check_state(f"decode step {self.steps}", logits)
        return logits

    def _check_state(self, where: str, logits) -> None:
        _check_finite(where, self.lengths, [("KV of layer", "holds", self.state.kv),
                                            ("indexer keys of group", "hold",
                                             self.state.index_keys)], logits)

    def device_kv_bytes(self) -> int:
        return self.state.device_bytes()

    def summary(self) -> dict:
        return {}


class OffloadEngine(_Lengths):
    """FlashOffloading end to end: the offloaded prefill (a few layer buffers, KV written back
    to host pages), the handoff, then offloaded decode steps.

    num_buffers: prefill layer buffers, default min(4, L); the prefill's rule
      (`check_num_buffers`), checked here.
    check: debug mode: after the prefill and every step, read the whole state back and raise
      StateCheckError on a non-finite stored host row, indexer key or logit, or a broken
      invariant (`fo_jax.offload.invariants.check_invariants`, with the step's selection).
    Every setting is checked on construction, before anything runs.
    """

    name = "offload"

    def __init__(self, params, config: ModelConfig, *, offload: OffloadConfig, batch: int,
                 implementation: str | None = None, interpret=False,
                 num_buffers: int | None = None, check: bool = False,
                 prefill_chunk: int | None = PREFILL_CHUNK):
        offload.validate_for(config)
        check_prefill_chunk(prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.num_buffers = check_num_buffers(
            min(4, config.num_layers) if num_buffers is None else num_buffers, config.num_layers)
        self.params, self.config, self.offload = params, config, offload
        self.implementation = offload_decode.check_implementation(implementation, interpret,
                                                                  offload)
        self.interpret, self.check = interpret, check
        self.batch = batch
        self.state: DecodeState | None = None
        self.totals = None
        self.lengths, self.steps = None, 0

    def loop_step(self) -> OffloadedStep:
        """The step `decode` runs in its loop."""
        return OffloadedStep(self.config, self.offload, self.implementation, self.interpret)

    @property
    def capacity(self) -> int:
        return self.offload.capacity

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray) -> jax.Array:
        oc = self.offload
        state = offload_prefill.PrefillState.create(
            self.config, batch=self.batch, capacity=oc.capacity, page_size=oc.page_size,
            memory_kind=oc.host_memory_kind)

        def run(chunk, num_new):
            nonlocal state
            logits, state = offload_prefill.prefill(self.params, state, chunk, num_new,
                                                    config=self.config,
                                                    num_buffers=self.num_buffers,
                                                    host_access=oc.host_access)
            return logits

        last = chunked_prefill(run, tokens, lengths, self.prefill_chunk)
        self.state = offload_prefill.to_decode_state(state, config=self.config, offload=oc)
        self.totals = None
        self._start(lengths)
        if self.check:
            self._check_state("prefill", last)
        return last

    def step(self, tokens) -> jax.Array:
        ways = self._check_room(tokens)
        logits, self.state, stats = offload_decode.decode_step(
            self.params, self.state, tokens, config=self.config, offload=self.offload,
            check=False, implementation=self.implementation, interpret=self.interpret)
        self.lengths = self.lengths + ways
        self._add_stats(stats)
        self.steps += 1
        if self.check:
            self._check_state(f"decode step {self.steps}", logits, stats.selected)
        return logits

    def _add_stats(self, stats) -> None:
        """Add a step's DecodeStats (or a loop's LoopStats) to the totals, on the device."""
        # float32 sums: int32 byte counters would overflow within a few steps at real sizes.
        counts = {name: getattr(stats, name).astype(jnp.float32).sum()
                  for name in ("hits", "tail_hits", "misses", "union", "h2d_bytes",
                               "d2h_bytes")}
        self.totals = counts if self.totals is None else jax.tree_util.tree_map(
            jnp.add, self.totals, counts)

    def _check_state(self, where: str, logits, selected=None) -> None:
        state = self.state
        num_l, batch, pages, page, width = state.host.kv.shape
        host = np.asarray(state.host.kv).reshape(num_l, batch, pages * page, width)
        _check_finite(where, self.lengths, [("host KV of layer", "holds", host),
                                            ("indexer keys of group", "hold",
                                             state.index_keys)], logits)
        try:
            check_invariants(state, config=self.config, offload=self.offload, selected=selected)
        except AssertionError as err:
            raise StateCheckError(f"{where}: invariant violated: {err}") from None

    def device_kv_bytes(self) -> int:
        return self.state.device_bytes()

    def summary(self) -> dict:
        """Hit rate and bytes moved per generated token (one host read, at the end).

        With no decode step yet (a generation of one new token) the hit rate is None and the
        counts are 0.
        """
        host_kv = self.state.host_bytes() if self.state is not None else 0
        if self.totals is None:
            return {"decode_steps": 0, "hit_rate": None, "misses": 0,
                    "h2d_bytes_per_token": 0.0, "d2h_bytes_per_token": 0.0,
                    "host_kv_bytes": host_kv}
        t = {k: float(v) for k, v in jax.device_get(self.totals).items()}
        selected = t["hits"] + t["tail_hits"] + t["misses"]
        tokens = max(self.steps * self.batch, 1)
        return {
            "decode_steps": self.steps,
            "hit_rate": (t["hits"] + t["tail_hits"]) / max(selected, 1),
            "misses": int(t["misses"]),
            "h2d_bytes_per_token": t["h2d_bytes"] / tokens,
            "d2h_bytes_per_token": t["d2h_bytes"] / tokens,
            "host_kv_bytes": host_kv,
        }


@dataclasses.dataclass
class GenerationResult:
    """Generated tokens and what it took.

    Attributes:
      tokens: [B, N] generated token ids.
      seconds: wall time of the decode loop (after prefill).
      prefill_seconds: wall time of the prefill.
      context_length: [B] tokens in each request at the end.
      device_kv_bytes: bytes of the engine's device state at the end.
      extra: engine summary (offload: hit rate, bytes moved per token, ...).
    """

    tokens: np.ndarray
    seconds: float
    prefill_seconds: float
    context_length: np.ndarray
    device_kv_bytes: int
    extra: dict

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.size / max(self.seconds, 1e-9)


def pad_prompts(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts -> (tokens [B, T] int64 padded with 0, lengths [B]).

    int64, so that an id beyond int32 reaches the vocabulary check as it is (never wrapped).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    return tokens, lengths


def check_decode_steps_per_call(n) -> None:
    """Raise unless `n` is an int >= 1."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"decode_steps_per_call={n!r} must be an int >= 1 (decode steps per "
                         "compiled call; 1 = one step per call)")


def generate(engine, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, key: jax.Array | None = None,
             on_step: Callable[[int, jax.Array, jax.Array], None] | None = None,
             progress: bool = False, decode_steps_per_call: int = 1) -> GenerationResult:
    """Prefill `prompts`, then decode `max_new_tokens` tokens per request.

    Args:
      engine: ResidentEngine or OffloadEngine (its batch must equal len(prompts)).
      temperature: 0 = greedy; > 0 samples with `top_p` nucleus filtering and `key`.
      on_step: called as on_step(step, tokens_fed [B, 1], logits [B, 1, V]) after each step
        (the side-by-side check uses it; needs decode_steps_per_call=1).
      progress: show a progress bar.
      decode_steps_per_call: N > 1 runs N steps per compiled call with on-device sampling
        (`fo_jax.engine.decode_loop`): the same tokens as N = 1 (one jitted step and one
        sampling call per token from Python), with one host dispatch per N tokens.
    Everything is validated before the engine is touched.
    """
    config = engine.config
    if max_new_tokens < 1:
        raise ValueError(f"{max_new_tokens=} must be >= 1")
    check_sampling(temperature, top_p)
    check_decode_steps_per_call(decode_steps_per_call)
    if decode_steps_per_call > 1 and on_step is not None:
        raise ValueError("on_step sees the logits of every step; a decode loop of "
                         f"decode_steps_per_call={decode_steps_per_call} keeps them on the "
                         "device: use decode_steps_per_call=1")
    if decode_steps_per_call > 1 and getattr(engine, "check", False):
        raise ValueError("check mode reads the state back after every step: use "
                         f"decode_steps_per_call=1 (got {decode_steps_per_call})")
    tokens, lengths = pad_prompts(prompts)
    resident.check_token_values(tokens, config)
    # The last sampled token is returned, never fed back: it needs no position.
    need = int(lengths.max()) + max_new_tokens - 1
    sequence_capacity_check(config, need)
    if need > engine.capacity:
        raise ValueError(f"a prompt of {int(lengths.max())} tokens plus {max_new_tokens} new "
                         f"tokens needs {need} positions; the engine holds {engine.capacity}")
    key = jax.random.key(0) if key is None else key
    start = time.perf_counter()
    logits = engine.prefill(tokens, lengths)
    key, sub = jax.random.split(key)
    next_tokens = sample(logits, sub, temperature=temperature, top_p=top_p)
    next_tokens.block_until_ready()
    prefill_seconds = time.perf_counter() - start
    out, calls = [next_tokens], []
    bar = _progress(max_new_tokens, progress)
    start = time.perf_counter()
    if decode_steps_per_call == 1:
        for step in range(max_new_tokens - 1):
            fed = next_tokens[:, None]
            logits = engine.step(fed)
            if on_step is not None:
                on_step(step, fed, logits)
            key, sub = jax.random.split(key)
            next_tokens = sample(logits[:, -1], sub, temperature=temperature, top_p=top_p)
            out.append(next_tokens)
            bar.update(1)
    elif max_new_tokens > 1:
        # Every request samples max_new_tokens tokens: the last call ends early on that count.
        sampling = Sampling.create(len(prompts), temperature=temperature, top_p=top_p,
                                   max_new_tokens=max_new_tokens)
        seats = Seats.create(next_tokens, key, sampling=sampling, lengths=engine.lengths,
                             capacity=engine.capacity)
        remaining = max_new_tokens - 1
        while remaining > 0:
            result, seats = engine.decode(seats, decode_steps_per_call, sampling)
            taken = min(remaining, decode_steps_per_call)
            calls.append(result.tokens[:, :taken])
            remaining -= taken
            bar.update(taken)
    generated = np.concatenate([np.stack([np.asarray(t) for t in out], axis=1)]
                               + [np.asarray(c) for c in calls], axis=1)
    seconds = time.perf_counter() - start
    bar.update(1)
    bar.close()
    return GenerationResult(
        tokens=generated, seconds=seconds, prefill_seconds=prefill_seconds,
        context_length=lengths + max_new_tokens - 1,
        device_kv_bytes=engine.device_kv_bytes(), extra=engine.summary())


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="tok", desc="decode", leave=False)

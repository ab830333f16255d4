"""Text generation over either inference path: a client of the decode core the serving engine
runs (the decode loop's steps and program, `fo_jax.sampling`, `fo_jax.drafting`).

    engine = ResidentEngine(params, config, batch=1, capacity=512)
    engine = OffloadEngine(params, config, offload=OffloadConfig(...), batch=1)
    result = generate(engine, [prompt_ids], max_new_tokens=32, temperature=0.8, top_p=0.9,
                      key=jax.random.key(0))

The engines (`fo_jax.batch_engines`, re-exported here) prefill a ragged batch of prompts and
step it with the decode loop's steps; `generate` samples (`fo_jax.sampling`: greedy at
temperature 0, else temperature + top-p with a PRNG key). With a drafter (`drafter="ngram"`
or `"mtp"`, `fo_jax.drafting`: the rules the decode loop drafts with) a generation verifies
W - 1 drafted tokens per step with the decode loop's rule (`fo_jax.sampling.
speculative_tokens`: greedy, the same tokens in fewer steps; sampled, speculative sampling,
tokens of the same distribution) and rolls the rejected ones back (`engine.rollback`). With
`decode_steps_per_call=N > 1` it runs N steps per compiled call instead (`fo_jax.decode_loop`:
sampling on the device, the same tokens). With `check=True` engines (debug; `fo-jax generate
--check`) the state is read back and checked after the prefill and every step
(`StateCheckError`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Callable

import jax
import numpy as np

from fo_jax import resident
from fo_jax.batch_engines import (PREFILL_CHUNK, OffloadEngine, ResidentEngine, StateCheckError,
                                  check_prefill_chunk, chunked_prefill)
from fo_jax.config import check_num_drafts, sequence_capacity_check
from fo_jax.decode_loop import Seats
from fo_jax.drafting import make_drafter
from fo_jax.sampling import Sampling, check_sampling, sample, speculative_tokens


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


def check_drafter(drafter, num_drafts, config, engine=None):
    """The drafter and W - 1 drafts per step a generation runs with: (drafter or None, n).

    drafter: None (no drafts; "none" is accepted too), "ngram", "mtp"
    (`fo_jax.drafting.make_drafter`; "mtp" needs the `engine` it drafts for) or a Drafter
    object; num_drafts: None for config.max_ways - 1 (`fo_jax.config.check_num_drafts`: a
    step of W = 1 + num_drafts ways must fit the model), at least 1 with a drafter. Any
    temperature goes with a drafter: drafts are verified greedily at temperature 0 and by
    speculative sampling above (`generate`).
    """
    if drafter == "mtp" and engine is None and config.num_nextn_predict_layers >= 1:
        pass  # checked without an engine (the CLI, before loading): built later
    elif drafter is None or isinstance(drafter, str):
        drafter = make_drafter(drafter, config, engine=engine)
    if (getattr(drafter, "needs_hidden", False) and engine is not None
            and not getattr(engine, "returns_hidden", False)):
        raise NotImplementedError(
            f"drafter {drafter.name!r} reads the main model's last hidden states, which the "
            f"{engine.name!r} engine's step does not return yet: use the resident engine")
    if drafter is None:
        if num_drafts is not None:
            raise ValueError(f"num_drafts={num_drafts!r} needs a drafter: pass "
                             "drafter='ngram' (or 'mtp'), or leave num_drafts None")
        return None, 0
    num_drafts = config.max_ways - 1 if num_drafts is None else num_drafts
    check_num_drafts(num_drafts, config)
    if num_drafts == 0:
        name = drafter if isinstance(drafter, str) else drafter.name
        raise ValueError(f"drafter={name!r} needs num_drafts >= 1 (drafts per request and "
                         "decode step): pass num_drafts, or drop drafter")
    return drafter, int(num_drafts)


_UNSET = object()  # generate's deprecated `draft=` not given


def _drafter_keyword(drafter, draft):
    """generate's `drafter`, given as `drafter=` or as its deprecated alias `draft=`."""
    if draft is _UNSET:
        return drafter
    if drafter is not None:
        raise TypeError(f"generate() got drafter={drafter!r} and draft={draft!r}: draft= is "
                        "the deprecated spelling of drafter=: pass drafter= only")
    warnings.warn("generate(draft=...) is deprecated: pass drafter= (None for no drafts)",
                  DeprecationWarning, stacklevel=3)
    return draft


def check_decode_steps_per_call(n) -> None:
    """Raise unless `n` is an int >= 1."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"decode_steps_per_call={n!r} must be an int >= 1 (decode steps per "
                         "compiled call; 1 = one step per call)")


def generate(engine, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, key: jax.Array | None = None,
             on_step: Callable[[int, jax.Array, jax.Array], None] | None = None,
             progress: bool = False, drafter=None, num_drafts: int | None = None,
             on_rollback: Callable[[int, np.ndarray], None] | None = None,
             decode_steps_per_call: int = 1,
             stop_tokens: Sequence[int] = (), draft=_UNSET) -> GenerationResult:
    """Prefill `prompts`, then decode `max_new_tokens` tokens per request.

    Args:
      engine: ResidentEngine or OffloadEngine (its batch must equal len(prompts)).
      temperature: 0 = greedy; > 0 samples with `top_p` nucleus filtering and `key`.
      on_step: called as on_step(step, tokens_fed [B, W], logits [B, W, V]) after each step
        (the side-by-side check uses it; needs decode_steps_per_call=1); W = 1 without
        drafts.
      progress: show a progress bar.
      drafter: None (no drafts), "ngram" (prompt lookup), "mtp" (the model's MTP layer: a
        ResidentEngine built with `mtp=`; `fo_jax.drafting.MTPDrafter`) or a
        `fo_jax.drafting.Drafter`, as the engine's `Engine(..., drafter=...)`.
        With a drafter, each step feeds [last token, num_drafts drafts] as W ways and
        rolls back what it does not keep (`engine.rollback`). Greedy (temperature 0): it
        keeps the longest prefix of drafts equal to the greedy tokens plus the next greedy
        token: the tokens are those of W = 1 greedy decoding (each way's logits equal a
        W = 1 step's up to float rounding, so only a near-tie of the two largest logits
        could tell them apart), in fewer steps when drafts are accepted. Sampled
        (temperature > 0): speculative sampling, the decode loop's rule
        (`fo_jax.sampling.speculative_tokens`): a draft d is accepted with probability
        p(d), p the nucleus distribution `sample` draws from at the way before it; the first
        rejection samples p without d, renormalized; after num_drafts acceptances a bonus
        token is sampled. The tokens follow the distribution of sampling without drafts,
        token by token, but are other draws than a run without drafts with the same key.
      num_drafts: drafts per step, default config.max_ways - 1.
      on_rollback: with a drafter, called as on_rollback(step, keep [B]) after each step's
        rollback (keep[b]: tokens fed to request b that were kept).
    `extra` of the result holds the drafting figures with a drafter: "tokens_per_step" (mean
    tokens generated per request and step), "accepted_drafts", "proposed_drafts".
      decode_steps_per_call: N > 1 runs N steps per compiled call with on-device sampling
        (`fo_jax.decode_loop`): the same tokens as N = 1 (one jitted step and one
        sampling call per token from Python), with one host dispatch per N tokens; not with
        a drafter.
      stop_tokens: ids that end a request (a checkpoint's EOS ids): generation ends once every
        request has sampled one (the stop token is in `tokens`; what a request that stopped
        earlier holds after its stop token is unspecified: cut it there), so `tokens` may be
        [B, n < max_new_tokens] and `context_length` counts the positions filled.
      draft: the deprecated spelling of `drafter` ("none" for None), accepted with a
        DeprecationWarning for one release; giving both is a TypeError.
    Everything is validated before the engine is touched.
    """
    drafter = _drafter_keyword(drafter, draft)
    config = engine.config
    if max_new_tokens < 1:
        raise ValueError(f"{max_new_tokens=} must be >= 1")
    check_sampling(temperature, top_p)
    drafter, num_drafts = check_drafter(drafter, num_drafts, config, engine)
    check_decode_steps_per_call(decode_steps_per_call)
    if decode_steps_per_call > 1 and on_step is not None:
        raise ValueError("on_step sees the logits of every step; a decode loop of "
                         f"decode_steps_per_call={decode_steps_per_call} keeps them on the "
                         "device: use decode_steps_per_call=1")
    if decode_steps_per_call > 1 and getattr(engine, "check", False):
        raise ValueError("check mode reads the state back after every step: use "
                         f"decode_steps_per_call=1 (got {decode_steps_per_call})")
    if decode_steps_per_call > 1 and drafter is not None:
        raise ValueError(f"decode_steps_per_call={decode_steps_per_call} runs W = 1 steps on "
                         "the device; drafts are verified step by step from the host: use "
                         "decode_steps_per_call=1 with a drafter")
    stop_tokens = tuple(int(t) for t in stop_tokens)
    if any(not 0 <= t < config.vocab_size for t in stop_tokens):
        raise ValueError(f"stop_tokens={stop_tokens} must be ids in [0, {config.vocab_size})")
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
    needs_hidden = getattr(drafter, "needs_hidden", False)
    if needs_hidden:
        logits, hidden = engine.prefill(tokens, lengths, hidden=True)
    else:
        logits = engine.prefill(tokens, lengths)
    key, sub = jax.random.split(key)
    next_tokens = sample(logits, sub, temperature=temperature, top_p=top_p)
    if needs_hidden:
        drafter.start(hidden, tokens, lengths, next_tokens)
    next_tokens.block_until_ready()
    prefill_seconds = time.perf_counter() - start
    out, calls = [next_tokens], []
    bar = _progress(max_new_tokens, progress)
    start = time.perf_counter()
    extra = {}
    stopped = np.isin(np.asarray(next_tokens), stop_tokens)
    if drafter is not None:
        generated, extra = _speculate(engine, drafter, num_drafts, prompts,
                                      np.asarray(next_tokens), max_new_tokens, on_step,
                                      on_rollback, bar, stop_tokens, temperature=temperature,
                                      top_p=top_p, key=key)
    elif decode_steps_per_call == 1:
        for step in range(max_new_tokens - 1):
            if stop_tokens and stopped.all():
                break
            fed = next_tokens[:, None]
            logits = engine.step(fed)
            if on_step is not None:
                on_step(step, fed, logits)
            key, sub = jax.random.split(key)
            next_tokens = sample(logits[:, -1], sub, temperature=temperature, top_p=top_p)
            out.append(next_tokens)
            if stop_tokens:  # a host sync only where stop tokens are asked for
                stopped |= np.isin(np.asarray(next_tokens), stop_tokens)
            bar.update(1)
    elif max_new_tokens > 1:
        # Every request samples max_new_tokens tokens (or up to a stop token): the last call
        # ends early on that count.
        sampling = Sampling.create(len(prompts), temperature=temperature, top_p=top_p,
                                   max_new_tokens=max_new_tokens,
                                   stop_tokens=list(stop_tokens) or None)
        seats = Seats.create(next_tokens, key, sampling=sampling, lengths=engine.lengths,
                             capacity=engine.capacity)
        remaining = max_new_tokens - 1
        while remaining > 0 and not (stop_tokens and bool(np.all(np.asarray(seats.done)))):
            result, seats = engine.decode(seats, decode_steps_per_call, sampling)
            taken = min(remaining, decode_steps_per_call)
            calls.append(result.tokens[:, :taken])
            remaining -= taken
            bar.update(taken)
    if drafter is None:
        generated = np.concatenate([np.stack([np.asarray(t) for t in out], axis=1)]
                                   + [np.asarray(c) for c in calls], axis=1)
    seconds = time.perf_counter() - start
    bar.update(1)
    bar.close()
    # Without stop tokens every request filled max_new_tokens - 1 positions; with them, the
    # engine's lengths say how many (a request that stopped inside a decode loop took no more).
    context = (lengths + max_new_tokens - 1 if not stop_tokens
               else np.asarray(engine.lengths).astype(lengths.dtype))
    return GenerationResult(
        tokens=generated, seconds=seconds, prefill_seconds=prefill_seconds,
        context_length=context,
        device_kv_bytes=engine.device_kv_bytes(), extra={**engine.summary(), **extra})


def _speculate(engine, drafter, num_drafts: int, prompts, first: np.ndarray,
               max_new_tokens: int, on_step, on_rollback, bar,
               stop_tokens: tuple[int, ...] = (), *, temperature: float = 0.0,
               top_p: float = 1.0, key: jax.Array | None = None) -> tuple[np.ndarray, dict]:
    """The draft-and-verify loop of `generate`: (tokens [B, N], drafting figures).

    Per step, request b (n_b tokens stored, c_b generated, the last not yet fed) is fed
    [last, d_1 .. d_D] at positions n_b .. n_b + D. Greedy (temperature 0): with g the greedy
    tokens of the W ways and a_b the longest prefix with d_i = g_i, it keeps e_b = min(a_b + 1,
    N - c_b) fed tokens and generates g_1 .. g_{e_b}: exactly the tokens W = 1 greedy decoding
    generates one per step. Sampled (temperature > 0): a_b drafts accepted and the token after
    them by speculative sampling (`fo_jax.sampling.speculative_tokens`, one key for the
    batch: `key` split once per step, as `generate` does without drafts), the same cut e_b.
    A request already done (c_b = N) keeps nothing. Ways past the engine's capacity are dropped
    (only a done request's or a rejected draft's position can be; the ways a kept token reads
    are within capacity, so their unspecified logits decide nothing): the capacity W = 1
    needs is enough. With `stop_tokens` the loop ends once every request has generated one
    (the tokens past that column are those never generated: zeros). Host work per step:
    O(B W) besides the drafter; the verification is one jitted call (the decode loop's rule),
    O(B W V) greedy, O(B W V log V) sampled.
    """
    config = engine.config
    needs_hidden = getattr(drafter, "needs_hidden", False)
    batch = len(prompts)
    generated = np.zeros((batch, max_new_tokens), np.int32)
    generated[:, 0] = first
    count = np.ones(batch, np.int64)
    rows = np.arange(batch)
    emitted, accepted_total, proposed, request_steps = 0, 0, 0, 0
    step = 0
    sampling = Sampling.create(batch, temperature=temperature, top_p=top_p)
    key = jax.random.key(0) if key is None else key  # read only when sampled
    while np.any(count < max_new_tokens):
        if stop_tokens and all(np.isin(generated[b, :count[b]], stop_tokens).any()
                               for b in range(batch)):
            generated = generated[:, :int(count.max())]
            break
        remaining = max_new_tokens - count
        histories = [np.concatenate([np.asarray(p, np.int64), generated[b, :count[b]]])
                     for b, p in enumerate(prompts)]
        drafts = np.asarray(drafter.propose(histories, num_drafts))
        if drafts.shape != (batch, num_drafts):
            raise ValueError(f"drafter {drafter.name!r} proposed drafts of shape "
                             f"{drafts.shape}, expected ({batch}, {num_drafts})")
        fed = np.concatenate([generated[rows, count - 1][:, None], drafts], axis=1)
        resident.check_token_values(fed, config)
        if needs_hidden:
            logits, hidden = engine.step(fed, drop_past_capacity=True, hidden=True)
        else:
            logits = engine.step(fed, drop_past_capacity=True)
        if on_step is not None:
            on_step(step, fed, logits)
        # The decode loop's verification, greedy and sampled alike (`speculative_tokens`).
        tokens, accepted, key = _speculative_tokens(
            np.asarray(fed, np.int32), logits, key, sampling, np.asarray(remaining > 0))
        tokens, accepted = np.asarray(tokens), np.asarray(accepted)
        keep = np.minimum(accepted + 1, remaining)
        engine.rollback(keep)
        if needs_hidden:
            # The MTP layer's pairs (h_i, t_{i+1}) of the kept positions: t_{i+1} the token
            # generated after position i.
            drafter.observe(hidden, tokens, keep)
        if on_rollback is not None:
            on_rollback(step, keep)
        for b in range(batch):
            generated[b, count[b]:count[b] + keep[b]] = tokens[b, :keep[b]]
        active = remaining > 0
        emitted += int(keep.sum())
        accepted_total += int(np.sum(keep[active] - 1))
        proposed += num_drafts * int(active.sum())
        request_steps += int(active.sum())
        bar.update(int(np.min(count + keep) - np.min(count)))
        count += keep
        step += 1
    return generated, {
        "draft": drafter.name,
        "num_drafts": num_drafts,
        "verify_steps": step,
        "tokens_per_step": emitted / max(request_steps, 1),
        "accepted_drafts": accepted_total,
        "proposed_drafts": proposed,
    }


# The decode loop's verification (one program per shape): the same rule, jitted once here.
_speculative_tokens = jax.jit(speculative_tokens)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="tok", desc="decode", leave=False)


__all__ = ["GenerationResult", "OffloadEngine", "PREFILL_CHUNK", "ResidentEngine",
           "StateCheckError", "check_decode_steps_per_call", "check_drafter",
           "check_prefill_chunk", "chunked_prefill", "generate", "pad_prompts"]

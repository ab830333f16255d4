"""Text generation over either inference path.

    engine = ResidentEngine(params, config, batch=1, capacity=512)
    engine = OffloadEngine(params, config, offload=OffloadConfig(...), batch=1)
    result = generate(engine, [prompt_ids], max_new_tokens=32, temperature=0.8, top_p=0.9,
                      key=jax.random.key(0))

An engine prefills a ragged batch of prompts (in chunks of `prefill_chunk` tokens, default
`PREFILL_CHUNK`: a long prompt never runs as one program) and then takes decode steps of one
token per request; `generate` samples (`fo_jax.sampling`: greedy at temperature 0, else
temperature + top-p with a PRNG key). With a drafter (`draft="ngram"` or `"mtp"`, `fo_jax.drafting`) a generation
verifies W - 1 drafted tokens per step and rolls the rejected ones back (`engine.rollback`):
greedy, the same tokens in fewer steps; sampled, speculative sampling (the decode loop's rule,
`fo_jax.sampling.speculative_tokens`): tokens of the same distribution. With
`decode_steps_per_call=N > 1` it runs N steps per compiled call instead
(`fo_jax.decode_loop`: sampling on the device, the same tokens).
Offload statistics are summed on the device step by step (no host sync per step). Engines keep
each request's length on the host and refuse a step past capacity before it runs; with
`check=True` (debug; `fo-jax generate --check`) they read the whole state back after the
prefill and every step and raise `StateCheckError` on a non-finite value or a broken invariant.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax import resident
from fo_jax.config import ModelConfig, sequence_capacity_check
from fo_jax.model.kv_format import load_kv_rows
from fo_jax.drafting import make_drafter
from fo_jax.decode_loop import LoopOutput, OffloadedStep, ResidentStep, Seats, decode_loop
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import prefill as offload_prefill
from fo_jax.kernels import resolve_implementation
from fo_jax.offload.config import OffloadConfig, check_num_buffers
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload import state as offload_state
from fo_jax.offload.state import DecodeState
from fo_jax.sampling import Sampling, check_sampling, sample, speculative_tokens


class StateCheckError(RuntimeError):
    """The debug checks of an engine (`check=True`) found a bad state after a prefill or step:
    a non-finite value in stored rows or logits, or a broken invariant of the offloaded state.
    The engine keeps the state as it was found, for inspection."""


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


def _first_non_finite(rows, lengths) -> tuple[int, int, int] | None:
    """(u, b, t) of the first non-finite value of rows [U, B, S, X] on a stored token
    (t < lengths[b]), or None."""
    rows = np.asarray(rows).astype(np.float32)
    stored = np.arange(rows.shape[2])[None, :] < np.asarray(lengths)[:, None]  # [B, S]
    bad = np.argwhere(~np.all(np.isfinite(rows), axis=-1) & stored[None])
    return tuple(int(x) for x in bad[0]) if bad.size else None


def _kv_values(rows, config) -> np.ndarray:
    """KV rows as the float32 values they hold (fp8_ds_mla bytes dequantized; debug checks)."""
    return np.asarray(load_kv_rows(jnp.asarray(rows), kv_lora_rank=config.kv_lora_rank))


def _check_finite(where: str, lengths, parts, logits) -> None:
    """Raise StateCheckError on a non-finite stored row of `parts` [(label, verb, rows)] or
    a non-finite logit [B, ..., V] (logits None: rows only)."""
    for label, verb, rows in parts:
        hit = _first_non_finite(rows, lengths)
        if hit is not None:
            u, b, t = hit
            raise StateCheckError(f"{where}: request {b}: the {label} {u} {verb} a non-finite "
                                  f"value at token {t}")
    if logits is None:
        return
    bad = np.argwhere(~np.isfinite(np.asarray(logits).astype(np.float32)))
    if bad.size:
        raise StateCheckError(f"{where}: request {int(bad[0][0])}: non-finite logits at "
                              f"{bad[0].tolist()}")


class _Lengths:
    """Each request's length, known on the host (no device read): steps past capacity are
    refused before they run (or, for a verification step, dropped: see `step`), and a step's
    rejected drafts are forgotten by `rollback`. Decode-loop calls (`decode`) add to lengths and
    steps lazily: their counts are read from the device only when lengths or steps are next
    asked for.

    tokens_kept: tokens fed by decode steps and kept (not rolled back), over the batch.
    """

    _lengths = None
    _steps = 0
    _tokens_kept = 0
    _pending: tuple = ()
    _before = None  # lengths before the last step, until its rollback

    def _start(self, lengths) -> None:
        self._pending = ()
        self.lengths = np.asarray(lengths).astype(np.int64)
        self.steps = 0
        self.tokens_kept = 0
        self._before = None  # lengths before the last step, until its rollback

    def _settle(self) -> None:
        pending, self._pending = self._pending, ()
        for out in pending:
            fed = np.asarray(out.fed)
            self._lengths = self._lengths + fed
            self._steps += int(out.num_steps)
            self._tokens_kept += int(fed.sum())

    @property
    def tokens_kept(self) -> int:
        self._settle()
        return self._tokens_kept

    @tokens_kept.setter
    def tokens_kept(self, value: int) -> None:
        self._settle()
        self._tokens_kept = value

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
        self._before = None  # nothing to roll back: a loop's tokens are kept
        self._pending = self._pending + (out,)
        self._add_stats(out.stats)
        return out, seats

    def _add_stats(self, stats) -> None:
        pass

    def _check_room(self, tokens, drop_past_capacity: bool = False) -> int:
        if self.lengths is None:
            raise ValueError(f"{type(self).__name__}.step before prefill: prefill a batch first")
        ways = int(np.shape(tokens)[1])
        need = self.lengths + ways
        worst = int(np.argmax(need))
        if need[worst] > self.capacity and not drop_past_capacity:
            raise ValueError(
                f"request {worst} holds {int(self.lengths[worst])} tokens; a step of {ways} "
                f"more needs {int(need[worst])} positions, beyond the engine's capacity of "
                f"{self.capacity}: build the engine with a larger capacity")
        return ways

    def _stepped(self, ways: int) -> None:
        """Host bookkeeping after a step of `ways` tokens per request (cut at capacity)."""
        self._before = self.lengths
        self.lengths = np.minimum(self.lengths + ways, self.capacity)
        self.tokens_kept += int(np.sum(self.lengths - self._before))
        self.steps += 1

    def rollback(self, keep) -> None:
        """Keep the first keep[b] tokens the last step fed request b; forget the rest.

        The verification of drafts: after a step of [last token, drafts...], keep the tokens
        whose drafts were accepted. The state afterwards equals, on every stored position, that
        of a run that fed only the kept tokens (`fo_jax.resident.rollback`,
        `fo_jax.offload.state.rollback`: O(B) work). At most one rollback per step; keep[b]
        in [0, tokens the step stored for b].
        """
        if self._before is None:
            raise ValueError(f"{type(self).__name__}.rollback needs a decode step to roll back "
                             "(one rollback per step)")
        stored = self.lengths - self._before
        keep = np.asarray(keep)
        if (keep.shape != stored.shape or not np.issubdtype(keep.dtype, np.integer)
                or np.any(keep < 0) or np.any(keep > stored)):
            raise ValueError(f"keep={keep.tolist()} must be {stored.size} ints in [0, tokens "
                             f"the last step stored] = [0, {stored.tolist()}]")
        drop = stored - keep
        self.state = self._rollback(self.state, jnp.asarray(drop.astype(np.int32)))
        self.lengths, self._before = self._before + keep, None
        self.tokens_kept -= int(np.sum(drop))
        if self.check:
            self._check_state(f"rollback after decode step {self.steps}", None)


class ResidentEngine(_Lengths):
    """The reference path: whole KV on device.

    check: debug mode: after the prefill and every step, read the state back and raise
      StateCheckError on a non-finite stored KV row, indexer key or logit.
    mtp: the model's multi-token-prediction parameters (`load_checkpoint(..., mtp=True)`), for
      `generate(..., draft="mtp")`; None: none.
    prefill / step return the last hidden states too with `hidden=True` (what the MTP drafter
    reads; the logits are the same bit for bit).
    """

    name = "resident"
    returns_hidden = True

    def __init__(self, params, config: ModelConfig, *, batch: int, capacity: int,
                 implementation: str | None = None, interpret=False, check: bool = False,
                 prefill_chunk: int | None = PREFILL_CHUNK, mtp: dict | None = None):
        check_prefill_chunk(prefill_chunk)
        if mtp is not None:
            from fo_jax.model.mtp import check_mtp_params

            check_mtp_params(mtp, config)
        self.mtp = mtp
        self.params, self.config = params, config
        self.prefill_chunk = prefill_chunk
        self.implementation = resolve_implementation(implementation, interpret)
        self.interpret, self.check = interpret, check
        self.state = resident.ResidentState.create(config, batch=batch, capacity=capacity)
        self.lengths, self.steps = None, 0
        # Eager, one O(B) op on the lengths (committed or not as the state's, so the next
        # step hits the same compiled program).
        self._rollback = resident.rollback

    def loop_step(self) -> ResidentStep:
        """The step `decode` runs in its loop."""
        return ResidentStep(self.config, self.implementation, self.interpret)

    @property
    def capacity(self) -> int:
        return self.state.capacity

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, *, hidden: bool = False):
        """Prefill padded prompts [B, T] with `lengths` real tokens; logits of each last token
        (with `hidden`: and the last hidden states [B, T, E] of every prompt position).

        Starts a new batch: whatever an earlier generation left is dropped.
        """
        self.state = resident.ResidentState.create(self.config, batch=self.state.batch,
                                                   capacity=self.state.capacity)
        hiddens = []

        def run(chunk, num_new):
            logits, self.state, *h = resident.prefill(self.params, self.state, chunk, num_new,
                                                      config=self.config, return_hidden=hidden)
            hiddens.extend(h)
            return logits

        last = chunked_prefill(run, tokens, lengths, self.prefill_chunk)
        self._start(lengths)
        if self.check:
            self._check_state("prefill", last)
        if hidden:
            return last, jnp.concatenate(hiddens, axis=1)
        return last

    def step(self, tokens, *, drop_past_capacity: bool = False, hidden: bool = False):
        """Append tokens [B, W] to every request; logits [B, W, V] (with `hidden`: logits and
        the last hidden states [B, W, E]).

        A step past capacity is refused before it runs, unless `drop_past_capacity`: then the
        tokens beyond capacity are dropped (their logits unspecified), as a verification step
        does with drafts it will roll back anyway.
        """
        ways = self._check_room(tokens, drop_past_capacity)
        logits, self.state, *h = resident.decode_step(
            self.params, self.state, tokens, config=self.config, check=False,
            implementation=self.implementation, interpret=self.interpret,
            return_hidden=hidden)
        self._stepped(ways)
        if self.check:
            self._check_state(f"decode step {self.steps}", logits)
        return (logits, h[0]) if hidden else logits

    def _check_state(self, where: str, logits) -> None:
        _check_finite(where, self.lengths, [("KV of layer", "holds",
                                             _kv_values(self.state.kv, self.config)),
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
    mtp: the model's multi-token-prediction parameters, for `generate(..., draft="mtp")`
      (as ResidentEngine); prefill / step return the last hidden states too with `hidden=True`.
    Every setting is checked on construction, before anything runs.
    """

    name = "offload"
    returns_hidden = True

    def __init__(self, params, config: ModelConfig, *, offload: OffloadConfig, batch: int,
                 implementation: str | None = None, interpret=False,
                 num_buffers: int | None = None, check: bool = False,
                 prefill_chunk: int | None = PREFILL_CHUNK, mtp: dict | None = None):
        offload.validate_for(config)
        check_prefill_chunk(prefill_chunk)
        if mtp is not None:
            from fo_jax.model.mtp import check_mtp_params

            check_mtp_params(mtp, config)
        self.mtp = mtp
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
        # Eager: one O(B) op on the lengths; the other leaves (host pages included) pass as
        # they are. Committed, so the next step hits the same compiled program.
        self._rollback = lambda state, drop: offload_state.committed(
            offload_state.rollback(state, drop))

    def loop_step(self) -> OffloadedStep:
        """The step `decode` runs in its loop."""
        return OffloadedStep(self.config, self.offload, self.implementation, self.interpret)

    @property
    def capacity(self) -> int:
        return self.offload.capacity

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, *, hidden: bool = False):
        """As ResidentEngine.prefill, offloaded (with `hidden`: and the last hidden states)."""
        oc = self.offload
        state = offload_prefill.PrefillState.create(
            self.config, batch=self.batch, capacity=oc.capacity, page_size=oc.page_size,
            memory_kind=oc.host_memory_kind)
        hiddens = []

        def run(chunk, num_new):
            nonlocal state
            logits, state, *h = offload_prefill.prefill(
                self.params, state, chunk, num_new, config=self.config,
                num_buffers=self.num_buffers, host_access=oc.host_access, return_hidden=hidden)
            hiddens.extend(h)
            return logits

        last = chunked_prefill(run, tokens, lengths, self.prefill_chunk)
        self.state = offload_prefill.to_decode_state(state, config=self.config, offload=oc)
        self.totals = None
        self._start(lengths)
        if self.check:
            self._check_state("prefill", last)
        if hidden:
            return last, jnp.concatenate(hiddens, axis=1)
        return last

    def step(self, tokens, *, drop_past_capacity: bool = False, hidden: bool = False):
        """Append tokens [B, W] to every request; logits [B, W, V] (as ResidentEngine.step;
        with `hidden`: logits and the last hidden states [B, W, E])."""
        ways = self._check_room(tokens, drop_past_capacity)
        logits, self.state, stats, *h = offload_decode.decode_step(
            self.params, self.state, tokens, config=self.config, offload=self.offload,
            check=False, implementation=self.implementation, interpret=self.interpret,
            return_hidden=hidden)
        self._stepped(ways)
        self._add_stats(stats)
        if self.check:
            # The selection check needs the length before the step: known unless cut.
            whole = bool(np.all(self.lengths - self._before == ways))
            self._check_state(f"decode step {self.steps}", logits,
                              stats.selected if whole else None)
        return (logits, h[0]) if hidden else logits

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
        # Per-request rows and keys, read through the page table: [L, B, S, D+R], [G, B, S, N].
        _check_finite(where, self.lengths, [("host KV of layer", "holds",
                                             _kv_values(state.token_rows(), self.config)),
                                            ("indexer keys of group", "hold",
                                             state.token_index_keys())], logits)
        try:
            check_invariants(state, config=self.config, offload=self.offload, selected=selected)
        except AssertionError as err:
            raise StateCheckError(f"{where}: invariant violated: {err}") from None

    def device_kv_bytes(self) -> int:
        return self.state.device_bytes()

    def summary(self) -> dict:
        """Hit rate and bytes moved per generated token (one host read, at the end).

        Counts include the rows the rejected drafts of verification steps moved; "per token"
        divides by the tokens kept.

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
        tokens = max(self.tokens_kept, 1)  # steps x batch without drafts
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


def check_draft(draft, num_drafts, config, engine=None):
    """The drafter and W - 1 drafts per step a generation runs with: (drafter or None, n).

    draft: "none", "ngram", "mtp" (`fo_jax.drafting.make_drafter`; "mtp" needs the `engine`
    it drafts for) or a Drafter object; num_drafts: None for config.max_ways - 1. Any
    temperature goes with a drafter: drafts are verified greedily at temperature 0 and by
    speculative sampling above (`generate`).
    """
    if draft == "mtp" and engine is None and config.num_nextn_predict_layers >= 1:
        drafter = "mtp"  # checked without an engine (the CLI, before loading): built later
    else:
        drafter = (make_drafter(draft, config, engine=engine) if isinstance(draft, str)
                   else draft)
    if (getattr(drafter, "needs_hidden", False) and engine is not None
            and not getattr(engine, "returns_hidden", False)):
        raise NotImplementedError(
            f"drafter {drafter.name!r} reads the main model's last hidden states, which the "
            f"{engine.name!r} engine's step does not return yet: use the resident engine")
    if drafter is None:
        if num_drafts is not None:
            raise ValueError(f"num_drafts={num_drafts!r} needs a drafter: pass draft='ngram' "
                             "(or 'mtp'), or leave num_drafts None")
        return None, 0
    most = config.max_ways - 1
    num_drafts = most if num_drafts is None else num_drafts
    if (not isinstance(num_drafts, (int, np.integer)) or isinstance(num_drafts, bool)
            or not 1 <= num_drafts <= most):
        raise ValueError(f"num_drafts={num_drafts!r} must be an int in [1, max_ways - 1 = "
                         f"{most}] of config {config.name!r} (a step verifies the current "
                         "token and its drafts as W = 1 + num_drafts ways)")
    return drafter, int(num_drafts)


def check_decode_steps_per_call(n) -> None:
    """Raise unless `n` is an int >= 1."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"decode_steps_per_call={n!r} must be an int >= 1 (decode steps per "
                         "compiled call; 1 = one step per call)")


def generate(engine, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, key: jax.Array | None = None,
             on_step: Callable[[int, jax.Array, jax.Array], None] | None = None,
             progress: bool = False, draft="none", num_drafts: int | None = None,
             on_rollback: Callable[[int, np.ndarray], None] | None = None,
             decode_steps_per_call: int = 1,
             stop_tokens: Sequence[int] = ()) -> GenerationResult:
    """Prefill `prompts`, then decode `max_new_tokens` tokens per request.

    Args:
      engine: ResidentEngine or OffloadEngine (its batch must equal len(prompts)).
      temperature: 0 = greedy; > 0 samples with `top_p` nucleus filtering and `key`.
      on_step: called as on_step(step, tokens_fed [B, W], logits [B, W, V]) after each step
        (the side-by-side check uses it; needs decode_steps_per_call=1); W = 1 without
        drafts.
      progress: show a progress bar.
      draft: "none", "ngram" (prompt lookup), "mtp" (the model's MTP layer: a ResidentEngine
        built with `mtp=`; `fo_jax.drafting.MTPDrafter`) or a `fo_jax.drafting.Drafter`.
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
        token by token, but are other draws than a draft="none" run with the same key.
      num_drafts: drafts per step, default config.max_ways - 1.
      on_rollback: with a drafter, called as on_rollback(step, keep [B]) after each step's
        rollback (keep[b]: tokens fed to request b that were kept).
    `extra` of the result holds the drafting figures with a drafter: "tokens_per_step" (mean
    tokens generated per request and step), "accepted_drafts", "proposed_drafts".
      decode_steps_per_call: N > 1 runs N steps per compiled call with on-device sampling
        (`fo_jax.engine.decode_loop`): the same tokens as N = 1 (one jitted step and one
        sampling call per token from Python), with one host dispatch per N tokens; not with
        a drafter.
      stop_tokens: ids that end a request (a checkpoint's EOS ids): generation ends once every
        request has sampled one (the stop token is in `tokens`; what a request that stopped
        earlier holds after its stop token is unspecified: cut it there), so `tokens` may be
        [B, n < max_new_tokens] and `context_length` counts the positions filled.
    Everything is validated before the engine is touched.
    """
    config = engine.config
    if max_new_tokens < 1:
        raise ValueError(f"{max_new_tokens=} must be >= 1")
    check_sampling(temperature, top_p)
    drafter, num_drafts = check_draft(draft, num_drafts, config, engine)
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
    O(B W) besides the drafter; the sampled verification is one jitted call of O(B W V log V).
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
    sampling = (Sampling.create(batch, temperature=temperature, top_p=top_p)
                if temperature > 0 else None)
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
        if sampling is None:
            tokens = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)  # [B, W]
            accepted = np.cumprod(drafts == tokens[:, :-1], axis=1).sum(axis=1)
        else:
            tokens, accepted, key = _speculative_tokens(
                jnp.asarray(fed, jnp.int32), logits, key, sampling, jnp.asarray(remaining > 0))
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

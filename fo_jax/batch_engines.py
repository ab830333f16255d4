"""Batch engines: a batch of requests prefilled together, then stepped together, one token
(or W drafted ways) per request and step, what `fo_jax.generate.generate` drives.

    engine = ResidentEngine(params, config, batch=1, capacity=512)
    engine = OffloadEngine(params, config, offload=OffloadConfig(...), batch=1)
    logits = engine.prefill(tokens, lengths)     # padded prompts [B, T]: last logits [B, V]
    logits = engine.step(tokens[:, None])        # [B, W] fed: logits [B, W, V]
    engine.rollback(keep)                        # keep the first keep[b] fed tokens
    out, seats = engine.decode(seats, 16, sampling)   # 16 steps in one program

An engine prefills a ragged batch of prompts (in chunks of `prefill_chunk` tokens, default
`PREFILL_CHUNK`: a long prompt never runs as one program) and then steps it with the decode
loop's own steps (`fo_jax.decode_loop.ResidentStep` / `OffloadedStep`: the step the engine of
`fo_jax.engine` runs), one call per step (`step`, the logits read back: what drafts verified
from the host and the side-by-side check need) or N steps per call with sampling on the
device (`decode`: `fo_jax.decode_loop.decode_loop`). Offload statistics are summed on the
device step by step (no host sync per step). Engines keep each request's length on the host
and refuse a step past capacity before it runs; with `check=True` (debug; `fo-jax generate
--check`) they read the whole state back after the prefill and every step and raise
`StateCheckError` on a non-finite value or a broken invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax import resident
from fo_jax.config import ModelConfig
from fo_jax.decode_loop import LoopOutput, OffloadedStep, ResidentStep, Seats, decode_loop
from fo_jax.kernels import resolve_implementation
from fo_jax.model.kv_format import load_kv_rows
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload import state as offload_state
from fo_jax.offload.config import OffloadConfig, check_num_buffers
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload.state import DecodeState
from fo_jax.sampling import Sampling


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
        (`fo_jax.decode_loop.decode_loop`): (LoopOutput, new seats). No host sync: lengths and
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
      `generate(..., drafter="mtp")`; None: none.
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
        self._loop_step = ResidentStep(config, self.implementation, interpret)

    def loop_step(self) -> ResidentStep:
        """The decode loop's step: what `step` runs, and `decode` in its loop."""
        return self._loop_step

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
        logits, self.state, _, *h = self._loop_step(self.params, self.state, tokens, None,
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
    mtp: the model's multi-token-prediction parameters, for `generate(..., drafter="mtp")`
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
        self._loop_step = OffloadedStep(config, offload, self.implementation, interpret)

    def loop_step(self) -> OffloadedStep:
        """The decode loop's step: what `step` runs, and `decode` in its loop."""
        return self._loop_step

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
        logits, self.state, stats, *h = self._loop_step(self.params, self.state, tokens, None,
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


__all__ = ["OffloadEngine", "PREFILL_CHUNK", "ResidentEngine", "StateCheckError",
           "check_prefill_chunk", "chunked_prefill"]

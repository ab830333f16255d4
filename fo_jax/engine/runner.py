"""The decode-loop runner: the device side of the running seats and the programs over them.

    runner = DecodeRunner(params, config, settings, kv, mtp=None)
    first, logprobs, keys = runner.first_tokens(logits, num_new, new, resumed, logprobs=None)
    runner.set_rows({b: (token, count, done)}, keys)   # the joined seats decode from here
    out = runner.decode(logprobs=None)                  # decode_steps_per_call steps, one call
    moved = runner.export_seat(req, kv.read_seat(...))  # a request leaving for another engine
    call = runner.dispatch(running, logprobs=None)      # the same, kept as an `InFlight`

It holds what the decode loop carries between calls: each seat's last token, PRNG key, count
and done flag (`fo_jax.decode_loop.Seats`), the seats' sampling settings (`Sampling`, rebuilt
only when a seat's request changes), and the drafters' state (with n-gram drafts each seat's
history, prompt + sampled tokens [seats, capacity]; with MTP drafts the MTP layer's state and
each seat's next draft, `MTPSeats`). The KV it decodes is the KV store's (`kv.state`). With
overlap it keeps the decode call dispatched and not yet read back (`in_flight`: the engine
reads it after dispatching the next one) and the device's clock (`fo_jax.engine.overlap`); its
updates of the seats are programs on the device arrays, never reads, so none of them waits for
a call in flight.

Contracts: every program has the same shapes whoever sits in the other seats, a seat's rows are
computed from its own state alone and inactive seats are never written, so a request's tokens
do not depend on the batch; the replay of a resumed request's tokens runs the programs that
computed them before (one decode step per token, or the same W-way groups with drafts), so its
KV is the one it had, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.engine.kv_store import KVStore, SeatRows, masked_rows
from fo_jax.decode_loop import MTPSeats, Seats, decode_loop, mtp_feed_seat_jit
from fo_jax.engine.overlap import DeviceClock, InFlight, watch
from fo_jax.engine.requests import RequestState
from fo_jax.engine.settings import EngineSettings
from fo_jax.sampling import Sampling, sample_tokens, token_logprobs
from fo_jax.offload.state import committed


def sampling_row(req: RequestState | None) -> tuple:
    """A seat's sampling settings: (temperature, top_p, stop token ids, max_tokens); a free
    seat's are greedy with no stop ids and 1 token."""
    if req is None:
        return (0.0, 1.0, (), 1)
    return (req.temperature, req.top_p, req.stop_token_ids, req.max_tokens)


@dataclasses.dataclass(frozen=True)
class SeatExport:
    """A decoding request leaving an engine (`Engine.export_seat`, `DecodeRunner.export_seat`).

    Attributes:
      request: its bookkeeping (prompt, tokens so far, sampling settings, times).
      kv: [L, S, D+R] its KV rows (S: the resident capacity, or the pages' tokens read from an
        offloaded engine; rows >= length unused).
      index_keys: [G, S, N] its indexer keys.
      length: tokens stored (prompt + tokens sampled - 1: the last one is not fed yet).
      token: its last sampled token; key_data: its PRNG key's data; generated: tokens sampled.
      mtp: with MTP drafts, its seat's MTP state (`DecodeRunner.save_mtp`), else None.
    """

    request: RequestState
    kv: jax.Array
    index_keys: jax.Array
    length: int
    token: int
    key_data: np.ndarray
    generated: int
    mtp: Any = None


class DecodeRunner:
    """The running seats' device state and the programs over it (see the module doc).

    Attributes:
      seats: `Seats` [B] (last token, PRNG key, tokens generated, done) of every seat.
      history: with n-gram drafts, [B, capacity] each seat's prompt + sampled tokens; else
        None.
      mtp_seats: with MTP drafts (`mtp` given), the MTP layer's state and drafts; else None.
    """

    def __init__(self, params, config: ModelConfig, settings: EngineSettings, kv: KVStore, *,
                 mtp=None):
        self.params, self.config, self.kv, self.mtp = params, config, kv, mtp
        self.batch, self.capacity = kv.seats, kv.capacity
        self.n_steps = int(settings.scheduler.decode_steps_per_call)
        self.num_drafts = int(settings.speculative.num_drafts)
        self.max_stop_ids = int(settings.requests.max_stop_ids)
        self.query_block = settings.programs.query_block
        batch = self.batch
        # Every array the programs take is committed to the device, as the programs' outputs
        # are: a mix of committed and uncommitted inputs would compile them again.
        self.seats = committed(Seats(tokens=jnp.zeros((batch,), jnp.int32),
                                     keys=jax.random.split(jax.random.key(0), batch),
                                     generated=jnp.zeros((batch,), jnp.int32),
                                     done=jnp.ones((batch,), bool)))
        self.key_shape = tuple(jax.random.key_data(jax.random.key(0)).shape)
        # With n-gram drafts: each seat's prompt + sampled tokens [seats, capacity], set at its
        # join. With MTP drafts: the MTP layer's state and each seat's next draft, fed with
        # the prompt's pairs by the prefill (`feed_mtp`).
        self.history = (committed(jnp.zeros((batch, self.capacity), jnp.int32))
                        if self.num_drafts and mtp is None else None)
        self.mtp_seats = (committed(MTPSeats.create(config, batch=batch,
                                                    capacity=self.capacity))
                          if mtp is not None else None)
        self.sampling_rows = [sampling_row(None)] * batch
        self._sampling = None  # rebuilt when a seat's request changes
        # Overlap (`fo_jax.engine.overlap`): the decode call dispatched and not read back yet,
        # the device's busy / idle clock, and outputs read outside a step (`Engine.synchronize`)
        # that the next step returns.
        self.overlap = bool(settings.scheduler.overlap)
        self.in_flight: InFlight | None = None
        self.clock = DeviceClock()
        self.carried: dict[str, list[int]] = {}

    # Sampling settings -----------------------------------------------------------------------

    def set_sampling(self, b: int, req: RequestState | None) -> None:
        """Seat b samples with `req`'s settings (None: a free seat's)."""
        self.sampling_rows[b] = sampling_row(req)
        self._sampling = None

    def sampling(self) -> Sampling:
        """The seats' sampling settings on the device (rebuilt after a change: O(B))."""
        if self._sampling is None:
            rows = self.sampling_rows
            stops = np.full((self.batch, self.max_stop_ids), -1, np.int32)
            for b, (_, _, ids, _) in enumerate(rows):
                stops[b, :len(ids)] = ids
            self._sampling = committed(Sampling(
                temperature=jnp.asarray([r[0] for r in rows], jnp.float32),
                top_p=jnp.asarray([r[1] for r in rows], jnp.float32),
                stop_tokens=jnp.asarray(stops),
                max_new_tokens=jnp.asarray([min(r[3], 2**31 - 1) for r in rows], jnp.int32)))
        return self._sampling

    # Seats -----------------------------------------------------------------------------------

    def restore(self, rows: dict) -> None:
        """Seat b decodes again from rows[b] = (last token, tokens generated, PRNG key data):
        the Seats rows of a request that joins without sampling its first token. O(B), on the
        device: nothing waits for a call in flight."""
        mask, tokens, generated, _ = self._rows({b: (t, n, False) for b, (t, n, _) in
                                                 rows.items()})
        data = np.zeros((self.batch,) + self.key_shape, np.uint32)
        for b, (_, _, key_data) in rows.items():
            data[b] = key_data
        seats = _update_seats(self.seats, mask, tokens, generated, jnp.zeros_like(mask))
        self.seats = dataclasses.replace(seats, keys=_set_keys(seats.keys, mask,
                                                               jnp.asarray(data)))

    def set_rows(self, rows: dict, keys) -> None:
        """Seat b's last token, count and done flag set to rows[b] = (token, generated,
        done), every seat's keys to `keys` (`first_tokens`). O(B), on the device."""
        mask, tokens, generated, done = self._rows(rows)
        seats = _update_seats(self.seats, mask, tokens, generated, done)
        self.seats = dataclasses.replace(seats, keys=keys)

    def set_done(self, seats) -> None:
        """The seats of `seats` are done: the loop leaves them inactive. O(B), on the
        device."""
        mask = np.zeros((self.batch,), bool)
        mask[list(seats)] = True
        self.seats = _mark_done(self.seats, jnp.asarray(mask))

    def _rows(self, rows: dict):
        """rows {b: (token, generated, done)} as [B] device arrays (mask, tokens, generated,
        done)."""
        mask = np.zeros((self.batch,), bool)
        tokens = np.zeros((self.batch,), np.int32)
        generated = np.zeros((self.batch,), np.int32)
        done = np.zeros((self.batch,), bool)
        for b, (token, count, finished) in rows.items():
            mask[b], tokens[b], generated[b], done[b] = True, token, count, finished
        return (jnp.asarray(mask), jnp.asarray(tokens), jnp.asarray(generated),
                jnp.asarray(done))

    def key_data(self, b: int) -> np.ndarray:
        """Seat b's PRNG key data (on the host)."""
        return np.asarray(jax.random.key_data(self.seats.keys[b]))

    def first_tokens(self, last, new: list[RequestState],
                     resumed: list[RequestState], *, logprobs: int | None):
        """Keys for the joining seats, and the first tokens of the new ones: each `new`
        request samples from its last prompt position's logits (last {seat: [V]}, from its
        prefill chunk) with a fresh key from its seed; each
        `resumed` one takes back the key it saved (`key_data`). Returns (first tokens [B] or
        None, log-probabilities (values, ids) or None, the seats' keys) on the host but the
        keys; the caller sets the rows (`set_rows`)."""
        batch = self.batch
        keys, first_np, lp_np = self.seats.keys, None, None
        if new:
            new_mask = np.zeros((batch,), bool)
            fresh = np.zeros((batch,) + self.key_shape, np.uint32)
            for req in new:
                new_mask[req.seat] = True
                fresh[req.seat] = np.asarray(jax.random.key_data(jax.random.key(req.seed)))
            picked = jnp.zeros((batch, self.config.vocab_size), last[new[0].seat].dtype)
            for req in new:
                picked = _set_row(picked, jnp.asarray(req.seat, jnp.int32), last[req.seat])
            # The new seats sample with their fresh keys alone, then join the other seats'
            # keys: nothing here reads the keys of a decode call still in flight.
            first, sampled, lp = _first_tokens(picked, jnp.asarray(fresh),
                                               jnp.asarray(new_mask), self.sampling(),
                                               logprobs=logprobs)
            keys = _set_keys(keys, jnp.asarray(new_mask), jax.random.key_data(sampled))
            first_np = np.asarray(first)
            lp_np = None if lp is None else jax.device_get(lp)
        if resumed:
            old_mask = np.zeros((batch,), bool)
            saved = np.zeros((batch,) + self.key_shape, np.uint32)
            for req in resumed:
                old_mask[req.seat], saved[req.seat] = True, req.key_data
            keys = _set_keys(keys, jnp.asarray(old_mask), jnp.asarray(saved))
        return first_np, lp_np, keys

    def set_history(self, joined: list[RequestState]) -> None:
        """With n-gram drafts: each joined request's seat history = its prompt + sampled
        tokens (what the device drafter looks up; the loop appends the tokens it yields).
        O(B S) copy."""
        if self.history is None or not joined:
            return
        mask = np.zeros((self.batch,), bool)
        rows = np.zeros((self.batch, self.capacity), np.int32)
        for req in joined:
            row = np.concatenate([req.prompt, np.asarray(req.tokens, np.int32)])
            mask[req.seat], rows[req.seat, :min(len(row), self.capacity)] = True, \
                row[:self.capacity]
        self.history = masked_rows(self.history, jnp.asarray(mask), jnp.asarray(rows))

    # The programs ----------------------------------------------------------------------------

    def decode(self, *, logprobs: int | None = None):
        """One decode call: `decode_steps_per_call` steps of the running seats
        (`decode_loop`), the KV store's state, the seats and the drafters' state carried on;
        its `LoopOutput` (still on the device). logprobs: the log-probabilities' K (another
        program), or None."""
        drafts = {} if not self.num_drafts else dict(num_drafts=self.num_drafts,
                                                     history=self.history)
        if self.mtp_seats is not None:
            drafts.update(mtp=self.mtp, mtp_seats=self.mtp_seats)
        if logprobs is not None:
            drafts["logprobs"] = logprobs
        kv = self.kv
        out, kv.state, self.seats = decode_loop(self.params, kv.state, self.seats,
                                                self.n_steps, self.sampling(),
                                                step=kv.step_fn, **drafts)
        if self.num_drafts:
            self.history = out.history
            if self.mtp_seats is not None:
                self.mtp_seats = out.mtp_seats
        return out

    def dispatch(self, running: list[RequestState], *, logprobs: int | None = None) -> InFlight:
        """Dispatch one decode call (`decode`) of the seats of `running` without waiting for
        it: an `InFlight` holding its outputs, the seats' requests, and the lengths and done
        flags it leaves (the lengths copied: the next program takes the state). A watcher
        notes when it is ready (`fo_jax.engine.overlap.watch`: the device's clock)."""
        out = self.decode(logprobs=logprobs)
        dispatched = time.perf_counter()  # the device cannot start it before: the Python of
        # the dispatch is host work it waits for
        lengths = self.kv.state.lengths
        call = InFlight(out, {r.seat: r for r in running},
                        lengths=jnp.copy(lengths) if self.overlap else lengths,
                        done=self.seats.done, dispatched=dispatched,
                        work=self.clock.begin(dispatched), watched=True)
        watch(out.tokens, call.mark_ready)  # with or without overlap: the same clock
        return call

    def take_in_flight(self) -> InFlight | None:
        """The call in flight (None: none), no longer held here: the caller reads it."""
        call, self.in_flight = self.in_flight, None
        return call

    def replay(self, resumed: list[RequestState]) -> int:
        """Feed each resumed request's sampled tokens but the last (their KV was dropped with
        its pages) through the decode step, the program that computed them before, one token
        per step, the other seats inactive (unchanged); the logits are not used. Prefilling
        them instead would not be bitwise: on CPU, XLA rounds a [chunk]-row matmul
        differently from a 1-row one (the KV and logits of a token differ in the last bits),
        so a resumed request could sample other tokens than its solo run. Costs: one decode
        step of the batch per replayed token of the longest replay. With drafts, the tokens
        are fed in the groups their W-way steps stored them (`_replay_groups`). Returns the
        tokens replayed."""
        if self.num_drafts:
            return self._replay_groups(resumed)
        batch, replayed = self.batch, 0
        for i in range(max(len(r.tokens) - 1 for r in resumed)):
            tokens = np.zeros((batch, 1), np.int32)
            active = np.zeros((batch,), bool)
            for req in resumed:
                if i < len(req.tokens) - 1:
                    tokens[req.seat, 0], active[req.seat] = req.tokens[i], True
            self._replay_step(tokens, active)
            replayed += int(active.sum())
        return replayed

    def _replay_step(self, tokens: np.ndarray, active: np.ndarray) -> None:
        """One replay step: tokens [seats, 1] fed to the `active` [seats] seats by the decode
        step (the logits are not used)."""
        kv = self.kv
        _, kv.state, _ = kv.step_fn(self.params, kv.state, committed(jnp.asarray(tokens)),
                                    committed(jnp.asarray(active)))

    def _replay_groups(self, resumed: list[RequestState]) -> int:
        """`replay` with drafts: request b's decode step k yielded groups[k] tokens and stored
        the groups[k] tokens fed before them; the replay feeds those again at the same ways
        of the same [seats, W] step (the rest of the W ways padded, then rolled back), so
        every stored row is computed by the program that computed it before, bit for bit (a
        W = 1 step's rows differ in the last bits on CPU). Tokens no step of this engine
        yielded (a request moved in by `Engine.import_seat`) are replayed one per step first.
        One W-way step per group of the longest replay."""
        kv, batch, ways, replayed = self.kv, self.batch, self.num_drafts + 1, 0
        groups = {id(r): [1] * (len(r.tokens) - 1 - sum(r.groups)) + r.groups for r in resumed}
        starts = {id(r): 0 for r in resumed}
        for i in range(max(len(g) for g in groups.values())):
            tokens = np.zeros((batch, ways), np.int32)
            active = np.zeros((batch,), bool)
            keep = np.zeros((batch,), np.int32)
            for req in resumed:
                if i < len(groups[id(req)]):
                    lo, n = starts[id(req)], groups[id(req)][i]
                    tokens[req.seat, :n] = req.tokens[lo:lo + n]
                    active[req.seat], keep[req.seat] = True, n
                    starts[id(req)] = lo + n
            before = np.asarray(kv.state.lengths)  # the state is donated to the step
            _, kv.state, _ = kv.step_fn(self.params, kv.state, committed(jnp.asarray(tokens)),
                                        committed(jnp.asarray(active)))
            kv.state = kv.step_fn.rollback(kv.state,
                                           kv.state.lengths - jnp.asarray(before + keep))
            replayed += int(keep.sum())
        return replayed

    # A request moving between engines (`Engine.export_seat`, `import_seat`) ----------------

    def export_seat(self, req: RequestState, rows: SeatRows) -> SeatExport:
        """The decoding request in seat `req.seat` leaving, with its KV `rows`
        (`KVStore.read_seat`): its last token, PRNG key, tokens generated and, with MTP
        drafts, its seat's MTP state (`save_mtp`). Reads one seat; changes nothing."""
        b = req.seat
        return SeatExport(request=req, kv=rows.kv, index_keys=rows.index_keys,
                          length=rows.length, token=int(self.seats.tokens[b]),
                          key_data=self.key_data(b), generated=int(self.seats.generated[b]),
                          mtp=None if self.mtp_seats is None else self.save_mtp(b))

    def import_seat(self, b: int, moved: SeatExport) -> None:
        """Seat b (its request's seat, its KV written) decodes `moved`'s request on from where
        it left: its last token, count and PRNG key, MTP state, sampling row and, with n-gram
        drafts, its history. O(B) + one seat's MTP rows."""
        self.restore({b: (moved.token, moved.generated, moved.key_data)})
        if moved.mtp is not None:
            self.restore_mtp(b, moved.mtp)
        self.set_sampling(b, moved.request)
        self.set_history([moved.request])

    # MTP drafts: each seat's MTP state -------------------------------------------------------

    def feed_mtp(self, feed, hidden) -> None:
        """Feed the prefill chunk's pairs (h_i, t_{i+1}) to the MTP state of each request of
        `feed` [(request, (prompt tokens prefilled before the chunk, tokens in it))]:
        hidden {seat: [1, T, E]} the chunk's last hidden states, t_{i+1} the next prompt token,
        or, for a prompt's last position, the first sampled token (`MTPDrafter.start`, chunk
        by chunk). One [1, prefill_chunk] MTP-layer program per request over its own seat
        (`mtp_feed_seat`). O(T) host work per request."""
        for req, (lo, n) in feed:
            b = req.seat
            row = req.prompt[lo + 1:lo + n + 1]
            if lo + n == len(req.prompt):
                row = np.concatenate([row, np.asarray(req.tokens[:1], np.int32)])
            nxt = np.zeros((1, hidden[b].shape[1]), np.int32)  # [1, prefill_chunk]
            nxt[0, :len(row)] = row
            self.mtp_seats = mtp_feed_seat_jit(
                self.params, self.mtp, self.mtp_seats, jnp.asarray(b, jnp.int32), hidden[b],
                committed(jnp.asarray(nxt)), committed(jnp.asarray([n], jnp.int32)),
                config=self.config, query_block=self.query_block)

    def start_mtp(self, started: list[RequestState], mtp_prefix) -> None:
        """MTP drafts: each admitted request's MTP state. One preempted with its pages kept, or
        after it sampled, takes back the MTP state it had (`save_mtp`: its pairs are those
        of the tokens its seat stores again, and the MTP layer's cache is never dropped,
        just saved: nothing to recompute); one that mapped a cached prefix takes its MTP rows
        from `mtp_prefix` (the prefix reuse's `MTPPrefixStore`); any other starts empty (its
        prefill feeds it)."""
        if self.mtp_seats is None:
            return
        fresh = []
        for req in started:
            if req.mtp_saved is not None:  # dropped if the prompt prefills again
                self.restore_mtp(req.seat, req.mtp_saved)
            elif req.mtp_blocks:  # its mapped prefix's MTP rows, from the cache
                self.mtp_seats = mtp_prefix.write(self.mtp_seats, req.seat, req.mtp_blocks)
            else:
                fresh.append(req.seat)
            req.mtp_saved = req.mtp_blocks = None
        if fresh:
            mask = np.zeros((self.batch,), bool)
            mask[fresh] = True
            self.mtp_seats = _reset_mtp(self.mtp_seats, committed(jnp.asarray(mask)))

    def save_mtp(self, b: int) -> tuple:
        """Seat b's MTP state on the host: (KV rows [n, D+R], indexer keys [n, N], n, next
        draft, h' [E]), n its length. O(S (D+R + N)) device-to-host copy of one layer's seat
        (1/L of the main KV of the same tokens)."""
        kv, keys, length, draft, hidden = jax.device_get(
            _mtp_seat(self.mtp_seats, jnp.asarray(b, jnp.int32)))
        n = int(length)
        return np.array(kv[:n]), np.array(keys[:n]), n, int(draft), np.asarray(hidden)

    def restore_mtp(self, b: int, saved: tuple) -> None:
        """Set seat b's MTP state to `saved` (`save_mtp`), its rows padded to the capacity."""
        kv, keys, n, draft, hidden = saved
        st = self.mtp_seats.state
        rows = np.zeros(st.kv.shape[2:], st.kv.dtype)
        rows[:n] = kv
        ik = np.zeros(st.index_keys.shape[2:], st.index_keys.dtype)
        ik[:n] = keys
        self.mtp_seats = _set_mtp_seat(self.mtp_seats, jnp.asarray(b, jnp.int32),
                                       jnp.asarray(rows), jnp.asarray(ik),
                                       jnp.asarray(n, jnp.int32), jnp.asarray(draft, jnp.int32),
                                       jnp.asarray(hidden))


@jax.jit
def _update_seats(seats: Seats, mask, tokens, generated, done) -> Seats:
    """`seats` with the last token, count and done flag of the seats of `mask` [B] set (the
    keys kept). O(B)."""
    return Seats(tokens=jnp.where(mask, tokens, seats.tokens), keys=seats.keys,
                 generated=jnp.where(mask, generated, seats.generated),
                 done=jnp.where(mask, done, seats.done))


@jax.jit
def _mark_done(seats: Seats, mask) -> Seats:
    """`seats` with the seats of `mask` [B] done. O(B)."""
    return dataclasses.replace(seats, done=seats.done | mask)


@jax.jit
def _set_keys(keys, mask, data):
    """Per-seat keys [B] with the seats of `mask` set to the key data `data` [B, ...]."""
    new = jnp.where(mask.reshape((-1,) + (1,) * (data.ndim - 1)), data,
                    jax.random.key_data(keys))
    return jax.random.wrap_key_data(new, impl=jax.random.key_impl(keys))


@functools.partial(jax.jit, donate_argnames=("rows",))
def _set_row(rows, seat, row):
    """rows [B, V] with row `seat` set to `row` [V] (in place; one program for every seat)."""
    return jax.lax.dynamic_update_index_in_dim(rows, row.astype(rows.dtype), seat, axis=0)


@functools.partial(jax.jit, static_argnames=("logprobs",))
def _first_tokens(picked, fresh, mask, sampling: Sampling, *, logprobs: int | None = None):
    """Each joining seat's first token, sampled from its last prompt position's logits
    (picked [B, V]) with a fresh key (key data `fresh` [B, ...], read where `mask`): (tokens
    [B], the keys after sampling (those of `mask` meaningful), log-probabilities). Each seat
    samples its row alone (`sample_tokens`), so a seat's token and key are those it gets
    beside any other seats. With logprobs=K (static), the tokens' and the K most likely
    tokens' log-probabilities ([B, K + 1] values and ids, `token_logprobs`), else None.
    O(B V)."""
    keys = jax.random.wrap_key_data(fresh)
    tokens, keys = sample_tokens(picked, keys, sampling, mask)
    lp = None if logprobs is None else token_logprobs(picked, tokens, logprobs)
    return tokens, keys, lp


@jax.jit
def _mtp_seat(mtp: MTPSeats, seat):
    """Seat `seat`'s MTP state: (KV rows [S, D+R], indexer keys [S, N], length, draft, h' [E])
    of the one MTP layer. O(S) rows copied."""
    st = mtp.state
    return (st.kv[0, seat], st.index_keys[0, seat], st.lengths[seat], mtp.draft[seat],
            mtp.hidden[seat])


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_mtp_seat(mtp: MTPSeats, seat, kv, keys, length, draft, hidden) -> MTPSeats:
    """`mtp` with seat `seat`'s state set (the inverse of `_mtp_seat`); donated, in place."""
    st = mtp.state
    state = dataclasses.replace(st, kv=st.kv.at[0, seat].set(kv),
                                index_keys=st.index_keys.at[0, seat].set(keys),
                                lengths=st.lengths.at[seat].set(length))
    return MTPSeats(state=state, draft=mtp.draft.at[seat].set(draft),
                    hidden=mtp.hidden.at[seat].set(hidden.astype(mtp.hidden.dtype)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_mtp(mtp: MTPSeats, mask) -> MTPSeats:
    """`mtp` with the seats of `mask` empty (length 0: nothing is read past a length). O(B)."""
    state = dataclasses.replace(mtp.state, lengths=jnp.where(mask, 0, mtp.state.lengths))
    return dataclasses.replace(mtp, state=state)


__all__ = ["DecodeRunner", "SeatExport", "sampling_row"]

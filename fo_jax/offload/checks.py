"""Invariants of the offloaded decode state, checked on the device inside compiled code.

The jittable twin of `fo_jax.offload.invariants.check_invariants` (the numpy oracle, kept
separate on purpose: it shares no code with this module, so one cannot hide the other's bug).
Value checks are `jax.experimental.checkify` checks, so they run inside `jax.jit`, `lax.scan`
and `lax.while_loop` and are functionalised by `checkify.checkify` (or `chex.chexify`, the same
transformation); shapes, dtypes and trees are checked at trace time with `chex.assert_*`.

    # Inside your own compiled loop (the checker needs an enclosing checkify):
    def body(state, tokens):
        logits, state, stats = decode_jit(params, state, tokens, ..., debug=True)
        return state, logits
    err, out = jax.jit(checkify.checkify(loop))(...)
    raise_on_error(err)

    # Or one step: decode_step(..., debug=True) raises AssertionError naming the violation.

What is checked (each failed check names the first violation: group, request, slot, token;
layer for rows), and what it costs. These are debug checks: O(G B (S + C)) for the maps, the
rest O(L B W K (D + R)), the same order as the step's own gather; never in the serving path.

  * page table: every page holding a stored token (< length) is a pool page (not -1, < F);
    host rows are read through the table.                                       O(B P)
  * maps (`check_state_jit`): slot_to_token holds -1 or a stored token (< length) whose
    token_to_slot is that slot; token_to_slot holds -1 or a slot in [0, C) whose slot_to_token
    is that token (so no slot is handed to two tokens); no token of the current tail blocks
    (position >= (n // Z) * Z) holds a slot.                                   O(G B (S + C))
  * occupancy, given the filled counts before the step (`occupancy`): the number of filled
    slots never decreases (once full, a cache stays full: evictions pair one-to-one with
    misses); with the step's `union` of misses it is at most min(C, before + union), and
    exactly that for "ring", "lru" and "clock", which take empty slots before evicting ("random" may
    evict while empties remain).                                               O(G B C)
  * selection, given the step's `selected` [G, B, W, K]: every selected token is stored
    (< length) and, after the step, resident or in the step's tail blocks.      O(G B W K)
  * rows read, for every selected token of every layer of its group: the device row it is
    read from (its hot slot, or its tail row) is finite and bitwise equal to its host row.
    This covers every row installed this step (each install is a selected miss) and no other
    slot: O(L B W K) rows, not O(C). Host rows are read by a gather on host memory (debug
    only; the serving path reads host memory only through the decode step's miss loop).
  * logits, if given: finite.                                                   O(B W V)
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fo_jax.config import ModelConfig
from fo_jax.model.kv_format import load_kv_rows
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.host import host_rows_at
from fo_jax.offload.state import DecodeState

# Policies that take empty slots before evicting: occupancy grows by exactly the misses.
FILLS_EMPTY_FIRST = ("ring", "lru", "clock")


def occupancy(slot_to_token: jax.Array) -> jax.Array:
    """[G, B] int32 filled slots per group and request, from slot_to_token [G, B, C]. O(G B C)."""
    return jnp.sum(slot_to_token >= 0, axis=-1, dtype=jnp.int32)


def _first(bad: jax.Array):
    """(any violation, index tuple of the first one in row-major order) of a bool array."""
    flat = bad.reshape(-1)
    return jnp.any(flat), jnp.unravel_index(jnp.argmax(flat), bad.shape)


def _check(bad: jax.Array, msg: str, **values) -> None:
    """checkify.check that no entry of `bad` is set. `values` (arrays broadcastable to `bad`'s
    shape: index grids, maps, lengths) are read at the first violation and formatted into
    `msg` by name."""
    found, index = _first(bad)
    fields = {name: jnp.broadcast_to(v, bad.shape)[index] for name, v in values.items()}
    checkify.check(~found, msg, **fields)


def _static_checks(state: DecodeState, config: ModelConfig, offload: OffloadConfig) -> None:
    """Shapes and dtypes of the state, at trace time (chex raises AssertionError)."""
    batch = state.hot.shape[1]
    groups, layers = config.num_groups, config.num_layers
    chex.assert_shape(state.hot, (layers, batch, offload.rows, config.kv_row_width))
    frames = state.host.kv.shape[1]
    chex.assert_shape(state.host.kv, (layers, frames, offload.page_size, config.kv_row_width))
    chex.assert_shape(state.index_keys, (groups, frames, offload.page_size,
                                         config.index_head_dim))
    chex.assert_shape(state.table, (batch, offload.num_pages))
    chex.assert_shape(state.slots.token_to_slot, (groups, batch, offload.capacity))
    chex.assert_shape(state.slots.slot_to_token, (groups, batch, offload.hot_slots))
    chex.assert_shape(state.lengths, (batch,))
    chex.assert_type([state.hot, state.host.kv], config.kv_row_dtype)
    chex.assert_type(state.index_keys, config.jnp_kv_dtype)
    chex.assert_type([state.slots.token_to_slot, state.slots.slot_to_token, state.lengths,
                      state.step, state.table], jnp.int32)


def _check_table(state: DecodeState, offload: OffloadConfig) -> None:
    """Every page holding a stored token is a pool page: O(B P)."""
    table = state.table
    batch, pages = table.shape
    frames = state.host.kv.shape[1]
    page = jnp.arange(pages)[None, :]
    stored = page * offload.page_size < state.lengths[:, None]
    _check(stored & ((table < 0) | (table >= frames)),
           "request {b}: page {p} holds stored tokens (length {n}) but its page table entry "
           "is {id}, not a pool page in [0, {f})",
           b=jnp.arange(batch)[:, None], p=page, n=state.lengths[:, None], id=table,
           f=jnp.asarray(frames))


def _check_maps(state: DecodeState, offload: OffloadConfig) -> None:
    t2s, s2t = state.slots.token_to_slot, state.slots.slot_to_token
    groups, batch, cap = t2s.shape
    c, z = offload.hot_slots, offload.page_size
    g3 = jnp.arange(groups)[:, None, None]
    b3 = jnp.arange(batch)[None, :, None]
    lengths = state.lengths[None, :, None]
    tail_start = (lengths // z) * z
    # Slots -> tokens.                                                         [G, B, C]
    tok = s2t
    filled = tok >= 0
    _check((tok < -1) | (filled & (tok >= lengths)),
           "group {g} request {b}: slot {s} holds token {t}, not a stored token (length {n})",
           g=g3, b=b3, s=jnp.arange(c), t=tok, n=lengths)
    back = t2s[g3, b3, jnp.clip(tok, 0, cap - 1)]
    _check(filled & (back != jnp.arange(c)),
           "group {g} request {b}: slot {s} holds token {t} whose token_to_slot is {back}",
           g=g3, b=b3, s=jnp.arange(c), t=tok, back=back)
    # Tokens -> slots.                                                         [G, B, S]
    slot = t2s
    resident = slot >= 0
    positions = jnp.arange(cap)
    _check((slot < -1) | (slot >= c),
           "group {g} request {b}: token {t} maps to slot {s}, outside [0, {c})",
           g=g3, b=b3, t=positions, s=slot, c=jnp.asarray(c))
    fwd = s2t[g3, b3, jnp.clip(slot, 0, c - 1)]
    _check(resident & (fwd != positions),
           "group {g} request {b}: token {t} maps to slot {s} which holds token {other}",
           g=g3, b=b3, t=positions, s=slot, other=fwd)
    _check(resident & (positions >= tail_start),
           "group {g} request {b}: token {t} of the tail blocks (from {start}) also holds "
           "slot {s}", g=g3, b=b3, t=positions, s=slot, start=tail_start)


def _check_occupancy(state: DecodeState, offload: OffloadConfig, before, union) -> None:
    after = occupancy(state.slots.slot_to_token)  # [G, B]
    groups, batch = after.shape
    g2, b2 = jnp.arange(groups)[:, None], jnp.arange(batch)[None, :]
    before = jnp.asarray(before, jnp.int32)
    chex.assert_shape(before, (groups, batch))
    _check(after < before,
           "group {g} request {b}: filled slots fell from {before} to {after} (occupancy never "
           "decreases; once full the cache stays full)",
           g=g2, b=b2, before=before, after=after)
    if union is None:
        return
    most = jnp.minimum(before + union, offload.hot_slots)
    bad = (after != most) if offload.policy in FILLS_EMPTY_FIRST else (after > most)
    _check(bad,
           "group {g} request {b}: {after} filled slots after a step that installed {union} "
           "misses into {before} filled slots: expected min(C, before + misses) = {want}",
           g=g2, b=b2, before=before, after=after, union=union, want=most)


def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _check_selection(state: DecodeState, config: ModelConfig, offload: OffloadConfig,
                     selected) -> None:
    groups, batch, ways, k = selected.shape
    c, z = offload.hot_slots, offload.page_size
    t2s = state.slots.token_to_slot
    sel = selected.reshape(groups, batch, ways * k)
    lengths = state.lengths[None, :, None]
    # The step's tail: from the length before its W new tokens.
    step_tail = ((lengths - ways) // z) * z
    g3 = jnp.arange(groups)[:, None, None]
    b3 = jnp.arange(batch)[None, :, None]
    way = jnp.arange(ways * k) // k
    chosen = sel >= 0
    _check(chosen & (sel >= lengths),
           "group {g} request {b}: way {w} selected token {t}, beyond the length {n}",
           g=g3, b=b3, w=way, t=sel, n=lengths)
    tok = jnp.clip(sel, 0, t2s.shape[-1] - 1)
    slot = t2s[g3, b3, tok]
    in_tail = tok >= step_tail
    _check(chosen & (slot < 0) & ~in_tail,
           "group {g} request {b}: way {w} selected token {t}, which after the step is neither "
           "resident (slot {s}) nor in the step's tail blocks (from {start})",
           g=g3, b=b3, w=way, t=sel, s=slot, start=step_tail)

    # Rows read: every layer of each group, its selected tokens.            [L, B, W K]
    group_of = np.repeat(np.arange(groups), [hi - lo for lo, hi in config.group_bounds])
    layers = jnp.arange(config.num_layers)[:, None, None]
    g_l = jnp.asarray(group_of)[:, None, None]
    b_l = jnp.arange(batch)[None, :, None]
    tok_l, slot_l = tok[group_of], slot[group_of]
    read = (chosen & ((slot >= 0) | in_tail))[group_of]
    tail_row = c + ((tok_l // z) % 2) * z + tok_l % z
    row = jnp.where(slot_l >= 0, slot_l, tail_row)
    got = state.hot[layers, b_l, row]  # [L, B, W K, D + R] (Y bytes in fp8_ds_mla)
    # The values the rows hold (fp8_ds_mla rows dequantized: the rows read, W K per layer).
    finite = jnp.all(jnp.isfinite(load_kv_rows(got, kv_lora_rank=config.kv_lora_rank)),
                     axis=-1)
    _check(read & ~finite,
           "layer {l} group {g} request {b}: device row {s} read for token {t} holds a "
           "non-finite value (rows below {c} are hot slots, then the tail blocks)",
           l=layers, g=g_l, b=b_l, s=row, t=tok_l, c=jnp.asarray(c))
    on_host = offload.host_memory_kind != "device"
    want = host_rows_at(state.host.kv, state.table, jnp.broadcast_to(layers, tok_l.shape),
                      jnp.broadcast_to(b_l, tok_l.shape), tok_l, on_host)
    same = jnp.all(_bits(got) == _bits(want), axis=-1)
    _check(read & ~same,
           "layer {l} group {g} request {b}: device row {s} read for token {t} differs from "
           "the token's host row (rows below {c} are hot slots, then the tail blocks)",
           l=layers, g=g_l, b=b_l, s=row, t=tok_l, c=jnp.asarray(c))


def check_state_jit(state: DecodeState, *, config: ModelConfig, offload: OffloadConfig,
                    selected=None, union=None, occupied_before=None, logits=None) -> None:
    """checkify-check every invariant of `state` on the device (see the module docstring).

    Pure and jittable: call it inside `jax.jit` / `lax.scan` / `lax.while_loop` under an
    enclosing `checkify.checkify` (or `chex.chexify`); outside one it fails at trace time, as
    every checkify check does.

    Args:
      state: the state after a step (or a handoff).
      selected: [G, B, W, K] the last step's DecodeStats.selected (enables the selection and
        row checks); union: [G, B] its DecodeStats.union (tightens occupancy).
      occupied_before: [G, B] `occupancy` of the state before that step.
      logits: the step's logits, checked finite.
    Cost: O(G B (S + C)) plus O(L B W K (D + R)) and O(B W V): debug only.
    Shapes and dtypes are asserted at trace time (AssertionError from chex).
    """
    _static_checks(state, config, offload)
    _check_table(state, offload)
    _check_maps(state, offload)
    if occupied_before is not None:
        _check_occupancy(state, offload, occupied_before, union)
    if selected is not None:
        chex.assert_rank(selected, 4)
        chex.assert_shape(selected, (config.num_groups, state.batch, None, config.index_topk))
        chex.assert_type(selected, jnp.int32)
        _check_selection(state, config, offload, selected)
    if logits is not None:
        batch, ways = logits.shape[:2]
        finite = jnp.isfinite(logits)
        _check(~finite,
               "request {b} way {w}: logit {v} is not finite",
               b=jnp.arange(batch)[:, None, None], w=jnp.arange(ways)[None, :, None],
               v=jnp.arange(logits.shape[-1]))


def check_step(before: DecodeState, after: DecodeState, stats, logits, *, config: ModelConfig,
               offload: OffloadConfig) -> None:
    """The checks of one decode step: `after` keeps `before`'s tree, shapes and dtypes (a scan
    carry and a donated state need both), then `check_state_jit` with the step's stats."""
    chex.assert_trees_all_equal_structs(before, after)
    chex.assert_trees_all_equal_shapes_and_dtypes(before, after)
    check_state_jit(after, config=config, offload=offload, selected=stats.selected,
                    union=stats.union, occupied_before=occupancy(before.slots.slot_to_token),
                    logits=logits)


def error_message(err: checkify.Error) -> str | None:
    """The first violation's message without checkify's location suffix, or None."""
    msg = err.get()
    if msg is None:
        return None
    cut = msg.rfind(" (`check` failed")
    cut = cut if cut >= 0 else msg.rfind(" (check failed at")
    return msg[:cut] if cut >= 0 else msg


def raise_on_error(err: checkify.Error) -> None:
    """Raise AssertionError (as the numpy `check_invariants` does) if `err` holds a violation."""
    msg = error_message(err)
    if msg is not None:
        raise AssertionError(f"offloaded decode state invariant violated: {msg}")


@functools.partial(jax.jit, static_argnames=("config", "offload"))
def _check_jit(state, selected, union, occupied_before, logits, *, config, offload):
    fn = functools.partial(check_state_jit, config=config, offload=offload)
    err, _ = checkify.checkify(fn, errors=checkify.user_checks)(
        state, selected=selected, union=union, occupied_before=occupied_before, logits=logits)
    return err


def check_state_on_device(state: DecodeState, *, config: ModelConfig, offload: OffloadConfig,
                          selected=None, union=None, occupied_before=None,
                          logits=None) -> None:
    """`check_state_jit` compiled on its own (one compile per config, setting and shapes);
    raise AssertionError naming the first violation. The state is not donated."""
    raise_on_error(_check_jit(state, selected, union, occupied_before, logits, config=config,
                              offload=offload))

"""The offloaded prefill of chosen seats of a batch: the engine's prefill programs.

    logits, state = prefill_seat(params, state, b, tokens[1, T], num_new[1], config=config,
                                 history_pages=h)
    logits, state = prefill_seats(params, state, seats[P], tokens[P, T], num_new[P],
                                  config=config, history_pages=h)

`prefill_seat` appends a chunk to request b alone; `prefill_seats` to the P requests of `seats`
in one program (a pack: one layer loop and one history-load schedule for the P of them). Either
runs `fo_jax.offload.prefill.prefill_forward` over a view of the batch (the seats' table rows
and lengths over the shared pools, layer buffers [n, P, S, D+R]), so the work grows with the
requests prefilling, not with the seats, and every other seat's pages, keys and length are
left as they are. Each row loads `history_pages` pages of its own history per layer (a static:
the engine packs requests whose histories fall in the same power-of-two bucket).

Contract: each row's logits, hidden states, host rows, indexer keys and length are bit for bit
those of `prefill_seat` running that request alone, and those of `fo_jax.resident.prefill_seat`
(tests/offload/test_prefill.py), as long as the matmuls compute each row independently of the
others (a pack makes their M depend on P: true of XLA:CPU; on an accelerator a property to
check, `fo_jax.resident.prefill_seats`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fo_jax.config import ModelConfig
from fo_jax.offload.prefill import (
    PREFILL_STATIC,
    PrefillState,
    prefill_arguments,
    prefill_forward,
)
from fo_jax.resident import QUERY_BLOCK, check_live, check_seat, check_seats


@functools.partial(jax.jit, static_argnames=PREFILL_STATIC, donate_argnames=("state",))
def _seat_jit(params, state: PrefillState, seat, tokens, num_new, **static):
    """`prefill_forward` of seat `seat` alone: a batch-1 view (its table row and length over
    the shared pools), its layer buffers [n, 1, S, D+R]. The seat is traced: one program for
    every seat."""
    view = dataclasses.replace(state, table=jax.lax.dynamic_slice_in_dim(state.table, seat, 1),
                               lengths=jax.lax.dynamic_slice_in_dim(state.lengths, seat, 1))
    logits, view, *hidden = prefill_forward(params, view, tokens, num_new, **static)
    lengths = jax.lax.dynamic_update_slice_in_dim(state.lengths, view.lengths, seat, axis=0)
    new_state = PrefillState(host=view.host, table=state.table, index_keys=view.index_keys,
                             lengths=lengths)
    return (logits, new_state, *hidden)


@functools.partial(jax.jit, static_argnames=PREFILL_STATIC, donate_argnames=("state",))
def _seats_jit(params, state: PrefillState, seats, tokens, num_new, **static):
    """`prefill_forward` of the P seats `seats` [P] alone: a batch-P view (their table rows and
    lengths over the shared pools), layer buffers [n, P, S, D+R]. The seats are traced: one
    program per P. A seat out of [0, B) reads a clamped seat's table row but writes nothing:
    its count is 0 (every row it would write is dropped) and the lengths' scatter drops it."""
    num_b = state.batch
    inside = (seats >= 0) & (seats < num_b)
    num_new = jnp.where(inside, num_new, 0)
    view = dataclasses.replace(state, table=jnp.take(state.table, seats, axis=0, mode="clip"),
                               lengths=jnp.take(state.lengths, seats, mode="clip"))
    logits, view, *hidden = prefill_forward(params, view, tokens, num_new, **static)
    lengths = state.lengths.at[jnp.where(inside, seats, num_b)].set(view.lengths, mode="drop")
    new_state = PrefillState(host=view.host, table=state.table, index_keys=view.index_keys,
                             lengths=lengths)
    return (logits, new_state, *hidden)


def prefill_seat(params, state: PrefillState, seat, tokens, num_new=None, *,
                 config: ModelConfig, num_buffers: int | None = None,
                 distance: int | None = None, onload_layer_map=None, dense: bool = False,
                 history_pages: int | None = None, poison: bool = False, check: bool = True,
                 host_access: str | None = None, query_block: int | None = QUERY_BLOCK,
                 return_hidden: bool = False):
    """Append a chunk of T tokens to one request of the batch, the one in seat `seat`, with
    offloaded KV; return logits [1, T, V] and the new state (with `return_hidden`: and its
    hidden states [1, T, E]).

    The program runs over that request alone: its table row and length over the shared pools,
    layer buffers [n, 1, S, D+R], `history_pages` pages of its own history loaded per layer
    (default ceil(its length / Z)); the other requests' pages, keys and lengths are left as
    they are, and the work does not grow with the batch. Bit for bit `prefill` on a batch-1
    state holding the request's table row (the same program shapes), so bit for bit
    `fo_jax.resident.prefill_seat` too.

    Args:
      seat: int in [0, B), or a traced int32 scalar (one compiled program serves every seat;
        a traced seat out of range is clamped into it).
      tokens: [1, T] int token ids (the first num_new[0] real, the rest padding).
      num_new: [1] ints, default T.
      history_pages: pages of the request's history loaded per layer (static; must cover it).
      The others: as `fo_jax.offload.prefill.prefill` (the checks read the seat's length and
        table row).
    The state is donated: use the returned one.
    Raises:
      ValueError: bad seat, shapes, token ids, capacity or schedule, before anything runs.
    """
    check_live(state, "prefill_seat")
    seat = check_seat(seat, state.batch)
    view = dataclasses.replace(state, table=jax.lax.dynamic_slice_in_dim(state.table, seat, 1),
                               lengths=jax.lax.dynamic_slice_in_dim(state.lengths, seat, 1))
    (params, _, tokens, num_new), static = prefill_arguments(
        params, view, tokens, num_new, config=config, num_buffers=num_buffers,
        distance=distance, onload_layer_map=onload_layer_map, dense=dense,
        history_pages=history_pages, poison=poison, check=check, host_access=host_access,
        query_block=query_block)
    return _seat_jit(params, state, seat, tokens, num_new, **static,
                     return_hidden=bool(return_hidden))


def prefill_seats(params, state: PrefillState, seats, tokens, num_new=None, *,
                  config: ModelConfig, num_buffers: int | None = None,
                  distance: int | None = None, onload_layer_map=None, dense: bool = False,
                  history_pages: int | None = None, poison: bool = False, check: bool = True,
                  host_access: str | None = None, query_block: int | None = QUERY_BLOCK,
                  return_hidden: bool = False):
    """Append a chunk of T tokens to each of P requests of the batch, those in `seats`, with
    offloaded KV, in one program (a pack); return logits [P, T, V] and the new state (with
    `return_hidden`: and their hidden states [P, T, E]).

    Row i runs over seat seats[i]'s table row and length, loads `history_pages` pages of its
    own history per layer (not the longest one's of another bucket: the engine packs requests
    of one history bucket) and writes its own pages, keys and length only; the other requests
    are left as they are. The layer buffers hold the P rows ([n, P, S, D+R]). Each row is bit
    for bit `prefill_seat` of that request alone (the same `history_pages`), given matmuls that
    compute each row independently of the others (module doc).

    Args:
      seats: [P] distinct ints in [0, B), or a traced int32 [P] array (one compiled program per
        (P, history_pages), whichever seats; a traced seat out of range writes nothing).
      tokens: [P, T] int token ids (row i's first num_new[i] real, the rest padding).
      num_new: [P] ints, default T.
      history_pages: pages of history loaded per layer and row (static; default: enough for
        the longest of the P; must cover it).
      The others: as `prefill_seat`.
    The state is donated: use the returned one.
    Raises:
      ValueError: bad seats, shapes, token ids, capacity or schedule, before anything runs.
    """
    check_live(state, "prefill_seats")
    seats = check_seats(seats, state.batch)
    view = dataclasses.replace(state, table=jnp.take(state.table, seats, axis=0),
                               lengths=jnp.take(state.lengths, seats))
    (params, _, tokens, num_new), static = prefill_arguments(
        params, view, tokens, num_new, config=config, num_buffers=num_buffers,
        distance=distance, onload_layer_map=onload_layer_map, dense=dense,
        history_pages=history_pages, poison=poison, check=check, host_access=host_access,
        query_block=query_block)
    return _seats_jit(params, state, seats, tokens, num_new, **static,
                      return_hidden=bool(return_hidden))


__all__ = ["prefill_seat", "prefill_seats"]

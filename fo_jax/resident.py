"""Reference inference with the whole KV cache and all indexer keys on the device.

Everything fo_jax offloads is measured against this path: the offloaded decode step must produce
the same logits bit for bit.

    state = ResidentState.create(config, batch=B, capacity=S)
    logits, state = prefill(params, state, tokens[B, T], num_new[B], config=config)
    logits, state = decode_step(params, state, tokens[B, W], config=config)

`prefill` appends a chunk (history + new chunk: chunked prefill is repeated calls); requests are
ragged (`num_new[b]` real tokens in row b, the rest padding). `prefill_seat(params, state, b,
tokens[1, T], num_new[1], ...)` appends a chunk to request b alone, its work independent of B;
`prefill_seats(params, state, seats[P], tokens[P, T], num_new[P], ...)` to the P requests of
`seats` in one program (a pack), each row as `prefill_seat` would compute it alone.
`decode_step` appends W tokens per request (the current token plus W - 1 drafts, each query
with its own top-k). All are jitted
with the state donated; the public wrappers validate shapes and values first and raise before
any state is touched.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.model.attention import dense_attention, softmax_scale, sparse_attention
from fo_jax.model.kv_format import kv_fill
from fo_jax.kernels import check_kv_format, interpret_params, resolve_implementation
from fo_jax.model.forward import forward, forward_layers, over_query_blocks, xla_select
from fo_jax.model.layers import matmul_f32, rms_norm
from fo_jax.model.mtp import block_params, stack_config

# Queries per block in prefill (selection and attention): bounds their temporaries.
QUERY_BLOCK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidentState:
    """The resident KV state of a batch.

    Attributes:
      kv: [L, B, S, D + R] kv_dtype: every layer's KV row of every position (under
        kv_format="fp8_ds_mla", [L, B, S, Y] uint8 rows: `ModelConfig.kv_row_width`).
      index_keys: [G, B, S, N] kv_dtype: every group's indexer key of every position.
      lengths: [B] int32: tokens stored per request.
    """

    kv: jax.Array
    index_keys: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, config: ModelConfig, *, batch: int, capacity: int | None = None,
               fill: float = 0.0) -> "ResidentState":
        """An empty state for `batch` requests of up to `capacity` tokens (default max_seq_len).

        `fill` is the value of unwritten rows (tests use NaN so a stray read shows; in the
        fp8_ds_mla format NaN is the byte 0xFF, `kv_fill`).
        """
        capacity = config.max_seq_len if capacity is None else capacity
        if batch < 1:
            raise ValueError(f"{batch=} must be >= 1")
        if not 1 <= capacity <= config.max_seq_len:
            raise ValueError(
                f"{capacity=} must be in [1, max_seq_len={config.max_seq_len}] of config "
                f"{config.name!r}")
        dt = config.jnp_kv_dtype
        return cls(
            kv=jnp.full((config.num_layers, batch, capacity, config.kv_row_width),
                        kv_fill(fill, config.kv_row_dtype), config.kv_row_dtype),
            index_keys=jnp.full((config.num_groups, batch, capacity, config.index_head_dim),
                                fill, dt),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.kv.shape[1]

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    def device_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


class ResidentBackend:
    """Backend of `forward` over (kv, index_keys): the whole cache on device.

    With implementation="pallas" the selection runs LIM (with no hot cache: every slot -1) and
    the attention runs CopySFA over the whole cache with no misses, so an offloaded step on the
    Pallas path can be compared bit for bit with a resident step on the same kernels.
    """

    def __init__(self, config: ModelConfig, dense: bool, implementation: str = "xla",
                 interpret=False, query_block: int | None = None):
        check_kv_format(implementation, config.kv_format)
        self.config, self.dense = config, dense
        self.implementation, self.interpret = implementation, interpret_params(interpret)
        self.query_block = query_block

    def select(self, carry, g, q, w, visible, k):
        kv, ik = carry
        if self.implementation == "pallas":
            from pallas_kernels.lim import lim

            no_slots = jnp.full(ik.shape[:3], -1, jnp.int32)
            tokens, _, _ = lim(q, w, ik, no_slots, visible.astype(jnp.int32), k=k, group=g,
                               interpret=self.interpret)
            return tokens, tokens >= 0, None
        return xla_select(ik[g], q, w, visible, k, key_block=self.query_block)

    def write_index_keys(self, carry, g, keys, write_pos):
        kv, ik = carry
        rows = jnp.arange(ik.shape[1])[:, None]
        ik = ik.at[g, rows, write_pos].set(keys.astype(ik.dtype), mode="drop")
        return kv, ik

    def index_keys(self, carry, g):
        return carry[1][g]

    def plan_group(self, carry, g, tokens, mask, slots):
        return carry, (tokens, mask)

    def attend(self, carry, l, g, plan, q_lat, q_pe, kv_new, write_pos):
        kv, ik = carry
        rows = jnp.arange(kv.shape[1])[:, None]
        kv = kv.at[l, rows, write_pos].set(kv_new, mode="drop")
        scale = softmax_scale(self.config)
        if plan is None:  # dense: the whole causal prefix of each query
            return (kv, ik), over_query_blocks(
                lambda ql, qp, wp: dense_attention(ql, qp, kv[l], causal_mask(wp, kv.shape[2]),
                                                   scale=scale),
                self.query_block, q_lat, q_pe, write_pos)
        tokens, mask = plan
        if self.implementation == "pallas":
            from pallas_kernels.copy_sfa import copy_sfa

            batch = kv.shape[1]
            none = jnp.full((batch, 1), -1, jnp.int32)
            no_host = jnp.zeros(kv.shape[:2] + (1, kv.shape[3]), kv.dtype)
            out, kv = copy_sfa(q_lat, q_pe, kv, no_host, jnp.where(mask, tokens, -1), none, none,
                               jnp.zeros((batch,), jnp.int32), scale=scale, layer=l,
                               interpret=self.interpret)
            return (kv, ik), out
        # The rows [B, Q, K, D+R] of one block of Q queries at a time.
        return (kv, ik), over_query_blocks(
            lambda ql, qp, tok, m: sparse_attention(
                ql, qp, kv[l, rows[:, :, None], jnp.where(m, tok, 0)], m, scale=scale),
            self.query_block, q_lat, q_pe, tokens, mask)


def _forward(params, state: ResidentState, tokens, num_new, *, config, dense,
             implementation="xla", interpret=False, query_block=None, return_hidden=False):
    """The resident forward over T new tokens per request, pure (jitted as `forward_jit`, the
    state donated): (logits, new state[, hidden]). `prefill` and `decode_step` validate their
    arguments, then run it; the data-parallel steps (`fo_jax.sharded_steps`) run it per rank;
    `prefill_seat` runs it over one seat's rows, `prefill_seats` over a pack of seats' rows."""
    num_t = tokens.shape[1]
    # Never past capacity, checked or not: tokens beyond the room left are padding (their KV is
    # dropped, their logits unspecified) and lengths stop at capacity.
    num_new = clamp_new(num_new, state.lengths, num_t, state.capacity)
    offsets = jnp.arange(num_t, dtype=jnp.int32)
    positions = state.lengths[:, None] + offsets[None, :]
    write_pos = jnp.where(offsets[None, :] < num_new[:, None], positions, state.capacity)
    backend = ResidentBackend(config, dense, implementation, interpret, query_block)
    logits, (kv, ik), *hidden = forward(params, tokens, positions, write_pos, backend,
                                        (state.kv, state.index_keys), config=config,
                                        dense=dense, query_block=query_block,
                                        return_hidden=return_hidden)
    new_state = ResidentState(kv=kv, index_keys=ik, lengths=state.lengths + num_new)
    return (logits, new_state, *hidden)


_STATIC = ("config", "dense", "implementation", "interpret", "query_block", "return_hidden")
forward_jit = functools.partial(jax.jit, static_argnames=_STATIC,
                                donate_argnames=("state",))(_forward)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _seat_jit(params, state: ResidentState, seat, tokens, num_new, **static):
    """`_forward` of seat `seat` alone: its rows [L, 1, S, D+R] sliced out, the [1, T] chunk
    run over them, written back in place. The seat is traced: one program for every seat."""
    def one(x, axis):
        return jax.lax.dynamic_slice_in_dim(x, seat, 1, axis=axis)

    view = ResidentState(kv=one(state.kv, 1), index_keys=one(state.index_keys, 1),
                         lengths=one(state.lengths, 0))
    logits, view, *hidden = _forward(params, view, tokens, num_new, **static)
    new_state = ResidentState(
        kv=jax.lax.dynamic_update_slice_in_dim(state.kv, view.kv, seat, axis=1),
        index_keys=jax.lax.dynamic_update_slice_in_dim(state.index_keys, view.index_keys,
                                                       seat, axis=1),
        lengths=jax.lax.dynamic_update_slice_in_dim(state.lengths, view.lengths, seat, axis=0))
    return (logits, new_state, *hidden)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _seats_jit(params, state: ResidentState, seats, tokens, num_new, **static):
    """`_forward` of the P seats `seats` [P] alone: their rows [L, P, S, D+R] gathered, the
    [P, T] chunk run over them, scattered back in place. The seats are traced: one program per
    P. A seat out of [0, B) reads a clamped seat's rows and writes nothing: its count is 0 (no
    row written) and the scatters drop it."""
    num_b = state.batch
    inside = (seats >= 0) & (seats < num_b)
    num_new = jnp.where(inside, num_new, 0)
    where = jnp.where(inside, seats, num_b)  # out of range: dropped by every scatter

    def take(x, axis):
        return jnp.take(x, seats, axis=axis, mode="clip")

    view = ResidentState(kv=take(state.kv, 1), index_keys=take(state.index_keys, 1),
                         lengths=take(state.lengths, 0))
    logits, view, *hidden = _forward(params, view, tokens, num_new, **static)
    new_state = ResidentState(
        kv=state.kv.at[:, where].set(view.kv, mode="drop"),
        index_keys=state.index_keys.at[:, where].set(view.index_keys, mode="drop"),
        lengths=state.lengths.at[where].set(view.lengths, mode="drop"))
    return (logits, new_state, *hidden)


def prefill(params, state: ResidentState, tokens, num_new=None, *, config: ModelConfig,
            dense: bool = False, check: bool = True, query_block: int | None = QUERY_BLOCK,
            return_hidden: bool = False):
    """Append a chunk of T tokens per request; return logits [B, T, V] and the new state
    (with `return_hidden`: logits, state, and the last hidden state [B, T, E] before the final
    norm, `fo_jax.model.forward`; the logits are the same bit for bit).

    Args:
      tokens: [B, T] int token ids (row b's first num_new[b] entries are real, the rest padding).
      num_new: [B] ints, default T for every request.
      dense: attend to the whole causal prefix (the dense model) instead of the top-k.
      check: validate device token ids, counts and capacity against concrete values (a
        device-to-host read of `state.lengths`); shapes are always validated.
      query_block: selection and attention run over blocks of this many queries, so their
        temporaries (indexer scores [B, Q, S], gathered rows [B, Q, K, D+R]) are bounded by the
        block, not by T; None: all T at once. Results differ only by float rounding (the
        offloaded prefill with the same query_block is bitwise equal).
    Token ids given on the host (lists, numpy) are always range-checked, in numpy, before any
    cast. Under an outer `jax.jit` / `lax.scan` the value checks of traced inputs are skipped;
    whatever the inputs, nothing is written past capacity (tokens beyond it are dropped).
    The state is donated: use the returned one.
    """
    args, static = _prefill_arguments(params, state, tokens, num_new, config=config,
                                      dense=dense, check=check, query_block=query_block)
    return forward_jit(*args, **static, return_hidden=bool(return_hidden))


def prefill_seat(params, state: ResidentState, seat, tokens, num_new=None, *,
                 config: ModelConfig, dense: bool = False, check: bool = True,
                 query_block: int | None = QUERY_BLOCK, return_hidden: bool = False):
    """Append a chunk of T tokens to one request of the batch, the one in seat `seat`; return
    logits [1, T, V] and the new state (with `return_hidden`: and its hidden states [1, T, E]).

    The other requests' rows and lengths are left as they are, and the work does not grow
    with the batch: the program runs the [1, T] chunk over the seat's own rows (copied out
    and back in place, O(L S (D+R))). Its results are bit for bit those of `prefill` on a
    batch-1 state holding the seat's rows (the same program shapes), so a request prefilled
    seat by seat gets the same KV and logits whoever sits in the other seats.

    Args:
      seat: int in [0, B), or a traced int32 scalar (the seat is an argument of the program,
        not a static: one compiled program serves every seat; a traced seat out of range is
        clamped into it).
      tokens: [1, T] int token ids (the first num_new[0] real, the rest padding).
      num_new: [1] ints, default T.
      dense, check, query_block: as `prefill` (the checks read the seat's length).
    The state is donated: use the returned one.
    """
    check_live(state, "prefill_seat")
    seat = check_seat(seat, state.batch)
    view = ResidentState(
        kv=jax.ShapeDtypeStruct((state.kv.shape[0], 1) + state.kv.shape[2:], state.kv.dtype),
        index_keys=jax.ShapeDtypeStruct(
            (state.index_keys.shape[0], 1) + state.index_keys.shape[2:],
            state.index_keys.dtype),
        lengths=jax.lax.dynamic_slice_in_dim(state.lengths, seat, 1) if check else
        jax.ShapeDtypeStruct((1,), state.lengths.dtype))
    (params, _, tokens, num_new), static = _prefill_arguments(
        params, view, tokens, num_new, config=config, dense=dense, check=check,
        query_block=query_block)
    return _seat_jit(params, state, seat, tokens, num_new, **static,
                     return_hidden=bool(return_hidden))


def prefill_seats(params, state: ResidentState, seats, tokens, num_new=None, *,
                  config: ModelConfig, dense: bool = False, check: bool = True,
                  query_block: int | None = QUERY_BLOCK, return_hidden: bool = False):
    """Append a chunk of T tokens to each of P requests of the batch, those in `seats`, in one
    program (a pack); return logits [P, T, V] and the new state (with `return_hidden`: and
    their hidden states [P, T, E]).

    Row i is computed over seat seats[i]'s own rows and length and written back to that seat
    only; the other seats are left as they are, and the work grows with P, not with the batch.
    Each row's logits, hidden states, KV rows, indexer keys and length are bit for bit those
    of `prefill_seat` running that request alone, as long as the program's matmuls compute
    each row independently of the others: the pack makes their M (P T tokens) depend on P.
    XLA:CPU does (tests/test_resident.py checks it); on an accelerator it is a property to
    check, which is why the engine's `prefill_batch=1` runs one request per program.

    Args:
      seats: [P] distinct ints in [0, B), or a traced int32 [P] array (one compiled program per
        P, whichever seats; a traced seat out of range reads a clamped seat and writes
        nothing, so a padding row can never touch a seat).
      tokens: [P, T] int token ids (row i's first num_new[i] real, the rest padding).
      num_new: [P] ints, default T.
      dense, check, query_block: as `prefill` (the checks read the seats' lengths).
    The state is donated: use the returned one.
    """
    check_live(state, "prefill_seats")
    seats = check_seats(seats, state.batch)
    num_p = seats.shape[0]
    view = ResidentState(
        kv=jax.ShapeDtypeStruct((state.kv.shape[0], num_p) + state.kv.shape[2:],
                                state.kv.dtype),
        index_keys=jax.ShapeDtypeStruct(
            (state.index_keys.shape[0], num_p) + state.index_keys.shape[2:],
            state.index_keys.dtype),
        lengths=jnp.take(state.lengths, seats) if check else
        jax.ShapeDtypeStruct((num_p,), state.lengths.dtype))
    (params, _, tokens, num_new), static = _prefill_arguments(
        params, view, tokens, num_new, config=config, dense=dense, check=check,
        query_block=query_block)
    return _seats_jit(params, state, seats, tokens, num_new, **static,
                      return_hidden=bool(return_hidden))


def check_seats(seats, batch: int):
    """`seats` as an int32 [P] array (P >= 1); concrete ones must be distinct ints in
    [0, batch) (ValueError): each row of a pack writes its own seat."""
    if isinstance(seats, jax.Array) and not is_concrete(seats):
        if seats.ndim != 1 or seats.shape[0] < 1 or not jnp.issubdtype(seats.dtype,
                                                                        jnp.integer):
            raise ValueError(f"seats must be a [P] integer array (P >= 1), got "
                             f"{seats.dtype}{list(seats.shape)}")
        return seats.astype(jnp.int32)
    value = np.asarray(seats)
    if value.ndim != 1 or value.size < 1 or not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"seats={seats!r} must be a non-empty list of ints (one seat per row "
                         "of tokens)")
    outside = value[(value < 0) | (value >= batch)]
    if outside.size:
        raise ValueError(f"seats={value.tolist()} holds {int(outside[0])}: every seat must be "
                         f"an int in [0, {batch}) (a seat of the batch)")
    if np.unique(value).size != value.size:
        raise ValueError(f"seats={value.tolist()} names a seat twice: each row of a pack "
                         "writes its own seat")
    return jnp.asarray(value.astype(np.int32))


def check_seat(seat, batch: int):
    """`seat` as an int32 scalar; a concrete one must be an int in [0, batch) (ValueError)."""
    if isinstance(seat, jax.Array) and not is_concrete(seat):
        if seat.shape != () or not jnp.issubdtype(seat.dtype, jnp.integer):
            raise ValueError(f"seat must be an integer scalar, got {seat.dtype}{list(seat.shape)}")
        return seat.astype(jnp.int32)
    value = np.asarray(seat)
    if (value.shape != () or not np.issubdtype(value.dtype, np.integer)
            or not 0 <= int(value) < batch):
        raise ValueError(f"seat={seat!r} must be an int in [0, {batch}) (a seat of the batch)")
    return jnp.asarray(int(value), jnp.int32)


def lower_prefill(params, state: ResidentState, tokens, num_new=None, *, config: ModelConfig,
                  dense: bool = False, check: bool = True,
                  query_block: int | None = QUERY_BLOCK):
    """The program `prefill` runs with these arguments, lowered (donation included): for
    checks of its compiled HLO and `memory_analysis()`. Same arguments and checks as `prefill`;
    nothing runs and nothing is donated."""
    args, static = _prefill_arguments(params, state, tokens, num_new, config=config,
                                      dense=dense, check=check, query_block=query_block)
    return forward_jit.lower(*args, **static)


def _prefill_arguments(params, state, tokens, num_new, *, config, dense, check, query_block):
    """Validate `prefill`'s arguments: (positional args, static kwargs) of `forward_jit`."""
    check_live(state, "prefill")
    tokens, num_t = prepare_tokens(tokens, state.batch, config, check=check)
    num_new = (jnp.full((state.batch,), num_t, jnp.int32) if num_new is None
               else jnp.asarray(num_new, jnp.int32))
    if num_new.shape != (state.batch,):
        raise ValueError(f"num_new has shape {num_new.shape}, expected ({state.batch},) "
                         "(one count per request)")
    check_query_block(query_block)
    if check:
        _check_values(tokens, num_new, state, config)
    return (params, state, tokens, num_new), dict(
        config=config, dense=dense,
        query_block=None if query_block is None else int(query_block))


def decode_step(params, state: ResidentState, tokens, *, config: ModelConfig,
                dense: bool = False, check: bool = True, implementation: str | None = None,
                interpret=False, active=None, return_hidden: bool = False):
    """One decode step of W query tokens per request: logits [B, W, V] and the new state
    (with `return_hidden`: logits, state, last hidden state [B, W, E], as `prefill`).

    tokens: [B, W], W <= config.max_ways (the current token and W - 1 draft tokens); all W are
    appended. Jitted with the state donated; one trace per (B, W).
    implementation: "xla", "pallas" (LIM + CopySFA kernels; `interpret=True` off TPU) or None
    (by backend): see fo_jax.kernels.
    check: validate token ids (on the device: a device-to-host read) and capacity (a read of
    `state.lengths`); host token ids are always checked, traced values never (the step composes
    under `jax.jit`, `lax.scan` and `lax.while_loop`). Unchecked, a request never grows past
    capacity: tokens beyond it are dropped.
    active: [B] bool, default all True: an inactive request (finished, or an empty seat) takes
    no token: nothing of its state is written and its length stays (its logits are unspecified).
    """
    implementation = resolve_implementation(implementation, interpret)
    check_live(state, "decode_step")
    tokens, num_w = prepare_tokens(tokens, state.batch, config, check=check)
    if num_w > config.max_ways:
        raise ValueError(f"decode_step got W={num_w} query tokens per request, but "
                         f"config {config.name!r} allows at most max_ways={config.max_ways}")
    num_new = jnp.full((state.batch,), num_w, jnp.int32)
    active = check_active(active, state.batch)
    if active is not None:
        num_new = jnp.where(active, num_new, 0)
    if check:
        _check_values(tokens, num_new, state, config)
    if implementation == "pallas" and dense:
        raise ValueError("dense=True attends to every token: there is no selection for the "
                         "Pallas kernels to run; use implementation='xla'")
    return forward_jit(params, state, tokens, num_new, config=config,
                       dense=dense, implementation=implementation,
                       interpret=interpret_params(interpret),
                       return_hidden=bool(return_hidden))


def rollback(state: ResidentState, num_drop) -> ResidentState:
    """Forget the last num_drop[b] tokens of each request: the rejected drafts of the last
    decode step (at most the W tokens it appended). Pure and jit-able; O(B) work.

    Only `lengths` changes. The rows the dropped tokens wrote (KV [L, B, S, D+R] and indexer
    keys [G, B, S, N] at positions >= the new length) stay as garbage that nothing reads: every
    selection, mask and attention sees positions < length or the step's own new positions, and
    a later step writes its tokens' rows before any query can see them. So the state equals,
    on every stored position, that of a run that never fed the dropped tokens.
    num_drop: [B] ints in [0, lengths[b]] (clipped into it).
    """
    num_drop = jnp.clip(jnp.asarray(num_drop, jnp.int32), 0, state.lengths)
    return dataclasses.replace(state, lengths=state.lengths - num_drop)


def check_active(active, batch: int):
    """None, or `active` as a [B] bool array; raises ValueError on another shape or dtype."""
    if active is None:
        return None
    if not isinstance(active, jax.Array):
        active = np.asarray(active)
    if active.shape != (batch,) or active.dtype != np.bool_:
        raise ValueError(f"active must be a [{batch}] bool array (one flag per request: False "
                         f"= the request takes no token), got {active.dtype}{list(active.shape)}")
    return jnp.asarray(active)


def check_query_block(query_block) -> None:
    """Raise unless `query_block` is None or an int >= 1."""
    if query_block is None:
        return
    if (not isinstance(query_block, (int, np.integer)) or isinstance(query_block, bool)
            or query_block < 1):
        raise ValueError(f"query_block={query_block!r} must be an int >= 1 (queries per "
                         "block), or None for all queries at once")


def causal_mask(write_pos, capacity: int):
    """[B, T, S] bool: query t sees positions <= write_pos[b, t]; padding queries (write_pos
    out of range) see nothing, so unwritten rows stay out."""
    positions = jnp.arange(capacity)
    return ((positions[None, None, :] <= write_pos[..., None])
            & (write_pos < capacity)[..., None])


def check_token_batch(tokens, batch: int) -> int:
    """Static checks of a [B, T] token batch for a state of `batch` requests; returns T."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, T], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    if tokens.shape[0] != batch:
        raise ValueError(f"tokens have batch {tokens.shape[0]} but the state holds "
                         f"{batch} requests: pass one row per request")
    if tokens.shape[1] < 1:
        raise ValueError("tokens must hold at least one token per request")
    return tokens.shape[1]


def check_token_values(tokens, config) -> None:
    """Raise if any token id is outside [0, vocab_size)."""
    host = np.asarray(tokens)
    bad = np.argwhere((host < 0) | (host >= config.vocab_size))
    if bad.size:
        b, t = bad[0]
        raise ValueError(f"token id {int(host[b, t])} at [{b}, {t}] is outside the vocabulary "
                         f"[0, {config.vocab_size}) of config {config.name!r}")


def check_capacity(lengths, num_new, capacity: int, config, *, what: str = "the state's") -> None:
    """Raise if any request would grow past `capacity` (or max_seq_len) positions."""
    lengths, num_new = np.asarray(lengths), np.asarray(num_new)
    if np.any(num_new < 0):
        raise ValueError(f"num_new must be >= 0, got {num_new.tolist()}")
    need = lengths + num_new
    worst = int(np.argmax(need))
    limit = min(capacity, config.max_seq_len)
    if need[worst] > limit:
        raise ValueError(
            f"request {worst} would hold {int(need[worst])} tokens, beyond {what} capacity "
            f"of {capacity} (max_seq_len={config.max_seq_len} of config {config.name!r}); "
            "create the state with a larger capacity or shorten the input")


def _check_values(tokens, num_new, state, config) -> None:
    """Counts and capacity, on concrete values only (tokens: see `prepare_tokens`)."""
    if not is_concrete(num_new):
        return
    if np.any(np.asarray(num_new) > tokens.shape[1]):
        raise ValueError(f"num_new={np.asarray(num_new).tolist()} exceeds the chunk width "
                         f"{tokens.shape[1]}")
    if is_concrete(state.lengths):
        check_capacity(state.lengths, num_new, state.capacity, config)


def is_concrete(x) -> bool:
    """Whether `x` has values now (not a tracer of an outer jit, scan or while_loop)."""
    return not isinstance(x, jax.core.Tracer)


def prepare_tokens(tokens, batch: int, config, *, check: bool = True) -> tuple[jax.Array, int]:
    """Validate a [B, T] token batch; return (tokens as int32, T).

    Token ids are range-checked before any cast (a cast to int32 would wrap 2**32 + 5 to 5):
    ids given on the host (lists, numpy) always, in numpy; device arrays with `check` (a
    device-to-host read); traced ids never (their values do not exist yet).
    """
    if not isinstance(tokens, jax.Array):
        tokens = np.asarray(tokens)
    num_t = check_token_batch(tokens, batch)
    if is_concrete(tokens) and (check or isinstance(tokens, np.ndarray)):
        check_token_values(tokens, config)
    if isinstance(tokens, np.ndarray):  # cast in numpy: the values are known to fit int32
        return jnp.asarray(tokens.astype(np.int32)), num_t
    return tokens.astype(jnp.int32), num_t


def check_live(state, where: str) -> None:
    """Raise if `state` was donated to an earlier call (its arrays are deleted)."""
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array) and is_concrete(leaf) and leaf.is_deleted():
            raise ValueError(
                f"{where}: the state was donated to an earlier call (its arrays are deleted): "
                "use the state that call returned, e.g. `logits, state = decode_step(params, "
                "state, ...)`")


def clamp_new(num_new, lengths, num_t: int, capacity: int):
    """num_new [B] cut to [0, min(T, capacity - lengths)]: inside a compiled step, so that no
    write goes past capacity and lengths never exceed it, whatever was checked."""
    room = jnp.maximum(capacity - lengths, 0)
    return jnp.clip(num_new, 0, jnp.minimum(num_t, room)).astype(jnp.int32)


# The multi-token-prediction layer (`fo_jax.model.mtp`) as a drafter: its step over its own
# resident cache of one layer.

@functools.partial(jax.jit, static_argnames=("config", "depth", "query_block"),
                   donate_argnames=("state",))
def mtp_step(params: dict, mtp: dict, state, hidden, tokens, num_new, *, config: ModelConfig,
             depth: int = 0, query_block: int | None = None):
    """Run MTP layer `depth` on T new (hidden, next token) pairs per request.

    Args:
      params: the main model's parameters (its embed / head are used unless `mtp` has its own).
      mtp: the MTP parameters (`fo_jax.model.mtp.mtp_param_shapes`).
      state: the layer's `ResidentState` (one layer, one indexer group: `create_mtp_state`),
        donated; pair j of request b goes to position state.lengths[b] + j.
      hidden: [B, T, E] the main model's last hidden states h_i (before the final norm).
      tokens: [B, T] int32 the tokens t_{i+1} that follow them.
      num_new: [B] int32: the first num_new[b] pairs of row b are real, the rest padding
        (their KV dropped, their outputs unspecified); lengths stop at capacity.
    Returns:
      (logits [B, T, V] float32: the predictions of t_{i+2}; h' [B, T, E]: the layer's output,
      the hidden state a chained draft feeds back in; the new state).
    Work: one decoder layer over T tokens against the layer's own cache of S rows (plus the
    [B, T, 2E] x [2E, E] projection and the [B, T, E] x [E, V] head).
    """
    sc = stack_config(config, 1)
    p = block_params(mtp, depth)
    embed = mtp["embed"][depth] if "embed" in mtp else params["embed"]
    head = mtp["head"][depth] if "head" in mtp else params["head"]
    eps = config.norm_eps
    e = rms_norm(embed[tokens], p["enorm"][0], eps)
    h = rms_norm(hidden.astype(e.dtype), p["hnorm"][0], eps)
    x = jnp.concatenate([e, h], axis=-1) @ p["eh_proj"][0]
    num_t = tokens.shape[1]
    num_new = clamp_new(num_new, state.lengths, num_t, state.capacity)
    offsets = jnp.arange(num_t, dtype=jnp.int32)
    positions = state.lengths[:, None] + offsets[None, :]
    write_pos = jnp.where(offsets[None, :] < num_new[:, None], positions, state.capacity)
    backend = ResidentBackend(sc, False, "xla", False, query_block)
    out, (kv, ik) = forward_layers(p, x, positions, write_pos, backend,
                                   (state.kv, state.index_keys), config=sc,
                                   query_block=query_block)
    logits = matmul_f32(rms_norm(out, p["head_norm"][0], eps), head)
    return logits, out, ResidentState(kv=kv, index_keys=ik, lengths=state.lengths + num_new)


def create_mtp_state(config: ModelConfig, *, batch: int, capacity: int):
    """An empty KV state of one MTP layer: [1, B, S, D + R] rows, [1, B, S, N] indexer keys
    (one layer of the main model's resident cache), on the device."""
    return ResidentState.create(stack_config(config, 1), batch=batch, capacity=capacity)

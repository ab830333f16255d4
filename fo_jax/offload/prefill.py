"""The offloaded prefill: the authoritative KV in host pages, a few full-layer device buffers.

    state = PrefillState.create(config, batch=B, capacity=S, page_size=Z)
    logits, state = prefill(params, state, tokens[B, T], num_new[B], config=config,
                            num_buffers=4, distance=1)
    decode_state = to_decode_state(state, config=config, offload=offload)

`prefill` appends a chunk of tokens per request with the KV of only `num_buffers` layers on the
device (`[n, B, S, D+R]`: buffer 0 holds layer 0, the others rotate over the later layers); the
host KV `[L, F, Z, D+R]` and the indexer keys `[G, F, Z, N]` are pools addressed through the
state's page table `[B, P]` (`PrefillState.create` builds the identity table by default). At
each layer the chunk's rows are written back to host pages and the layers of
`onload_layer_map[i]` (or the `distance` schedule) are prefetched; a map that loads a buffer
whose layer is not yet done, a layer twice or never, is a ValueError before tracing.
`to_decode_state` hands the result to the offloaded decode step without putting all layers on
the device. The engine's programs over chosen seats of the batch (`prefill_seat`,
`prefill_seats`: each request over its own table row and history, work independent of B) are in
`fo_jax.offload.seat_prefill`.

Contract: results are bit for bit those of `fo_jax.resident.prefill` (the same logits for real
tokens, host pages equal to the resident KV, the same indexer keys; tests/offload/
test_prefill.py), under every `host_access`; the state is donated; `history_pages` is static
(one compiled program per value); rows of a buffer past the loaded history are never read
(`poison=True` sets them to NaN to show it).

Design (the buffer rotation, the five steps of a layer, in-place loads, scheduling points):
docs/design/offloaded-prefill.md.
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
from fo_jax.model.forward import forward, over_query_blocks, xla_select
from fo_jax.offload.config import (
    MEMORY_KINDS,
    OffloadConfig,
    check_num_buffers,
    default_host_access,
)
from fo_jax.offload.host import (
    check_host_access,
    host_gather_rows,
    in_host_memory,
    load_history,
    write_back_rows,
)
from fo_jax.offload.layer_schedule import (
    OnloadLayerMap,
    buffer_of_layer,
    default_onload_layer_map,
    normalize_onload_layer_map,
)
from fo_jax.offload.state import (
    CacheSlots,
    DecodeState,
    HostPages,
    check_table,
    check_table_covers,
    committed,
    host_sharding,
    initial_layout,
    make_table,
    pool_to_tokens,
    read_back,
    read_pool_keys,
    to_memory_kind,
    write_pool_keys,
)
from fo_jax.resident import (
    QUERY_BLOCK,
    causal_mask,
    check_capacity,
    check_live,
    check_query_block,
    clamp_new,
    is_concrete,
    prepare_tokens,
)

# Schedule -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefillSchedule:
    """The static prefetch plan of one offloaded prefill (a static argument of the jit).

    Attributes:
      num_layers: L.
      num_buffers: n device layer buffers (buffer 0 pinned to layer 0, n - 1 rotating).
      onload_layer_map: L tuples: entry i lists the layers loaded at the end of layer i.
    """

    num_layers: int
    num_buffers: int
    onload_layer_map: OnloadLayerMap

    @classmethod
    def create(cls, num_layers: int, num_buffers: int = 4, *, distance: int | None = None,
               onload_layer_map=None) -> "PrefillSchedule":
        """Validate a schedule; raises ValueError (naming the layer and the buffer) if invalid.

        Args:
          num_layers: L.
          num_buffers: n in [min(2, L), L] (`check_num_buffers`, the planner's rule too).
          distance: prefetch distance d (default 1): layer 0 loads layers 1 .. d, layer i >= 1
            loads layer i + d (`default_onload_layer_map`). Needs d <= n - 2 (or d = 1): a larger
            d gives no more overlap and is rejected rather than silently capped.
          onload_layer_map: an explicit map in any form `normalize_onload_layer_map` accepts
            (dict {i: j or (j, ...)} or a sequence of length L); exclusive with `distance`.
        """
        num_buffers = check_num_buffers(num_buffers, num_layers)
        if onload_layer_map is not None:
            if distance is not None:
                raise ValueError("give either distance or onload_layer_map, not both")
            schedule = normalize_onload_layer_map(onload_layer_map, num_layers, num_buffers)
        else:
            distance = 1 if distance is None else distance
            limit = max(1, num_buffers - 2)
            if not isinstance(distance, int) or isinstance(distance, bool) or not (
                    1 <= distance <= limit):
                raise ValueError(
                    f"distance={distance!r} must be an int in [1, {limit}] with "
                    f"num_buffers={num_buffers}: a distance d needs d + 2 buffers (layer 0, the "
                    "layer computing, d layers loading); use more buffers or pass an explicit "
                    "onload_layer_map")
            schedule = default_onload_layer_map(num_layers, distance, num_buffers)
            schedule = normalize_onload_layer_map(schedule, num_layers, num_buffers)
        return cls(num_layers=num_layers, num_buffers=num_buffers, onload_layer_map=schedule)

    @property
    def max_loads(self) -> int:
        """M: the most loads any layer issues."""
        return max((len(t) for t in self.onload_layer_map), default=0)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(loads [L, M], buffers [L, M]) int32: what layer i loads into which buffer, -1 none."""
        width = self.max_loads
        loads = np.full((self.num_layers, width), -1, np.int32)
        buffers = np.full((self.num_layers, width), -1, np.int32)
        for i, targets in enumerate(self.onload_layer_map):
            for m, j in enumerate(targets):
                loads[i, m], buffers[i, m] = j, buffer_of_layer(j, self.num_buffers)
        return loads, buffers


# State ----------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillState:
    """What the offloaded prefill reads and writes between chunks.

    Attributes:
      host: HostPages, kv [L, F, Z, D + R] kv_dtype (or [L, F, Z, Y] uint8 fp8_ds_mla rows,
        `ModelConfig.kv_row_width`) in `pinned_host` memory (the
        authoritative KV, a pool of F pages; token t of request b, layer l at
        kv[l, table[b, t // Z], t % Z]).
      table: [B, P] int32 page table into both pools (-1: page not held); S = P * Z.
      index_keys: [G, F, Z, N] kv_dtype on the device, the indexer-key pool.
      lengths: [B] int32 tokens stored per request.
    """

    host: HostPages
    table: jax.Array
    index_keys: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, config: ModelConfig, *, batch: int, capacity: int | None = None,
               page_size: int = 16, fill: float = 0.0,
               memory_kind: str = "pinned_host", num_frames: int | None = None,
               table=None) -> "PrefillState":
        """An empty state; host pages are built in host memory (never all on the device).

        `fill` is the value of unwritten rows (tests use NaN so a stray read shows);
        `memory_kind` "device" is for Pallas interpret mode only (a jit holding an interpret-mode
        kernel and a host-memory array fails in JAX). `num_frames` (F, default B P) pages in
        the pools, `table` [B, P] int32 the page table (default the identity, table[b, p] =
        b P + p; see `fo_jax.offload.state.check_table`).
        """
        capacity = config.max_seq_len if capacity is None else capacity
        if batch < 1:
            raise ValueError(f"{batch=} must be >= 1")
        if not 1 <= capacity <= config.max_seq_len:
            raise ValueError(f"{capacity=} must be in [1, max_seq_len={config.max_seq_len}] of "
                             f"config {config.name!r}")
        if page_size < 1 or capacity % page_size:
            raise ValueError(f"{capacity=} must be a multiple of {page_size=} (>= 1)")
        if memory_kind not in MEMORY_KINDS:
            raise ValueError(f"{memory_kind=}; choose one of {MEMORY_KINDS}")
        dt = config.jnp_kv_dtype
        table, num_frames = make_table(table, num_frames, batch=batch,
                                       num_pages=capacity // page_size)
        shape = (config.num_layers, num_frames, page_size, config.kv_row_width)
        host = jax.device_put(np.full(shape, kv_fill(fill, config.kv_row_dtype),
                                      config.kv_row_dtype), host_sharding(memory_kind))
        return cls(
            host=HostPages(kv=host),
            table=jnp.asarray(table),
            index_keys=jnp.full((config.num_groups, num_frames, page_size,
                                 config.index_head_dim), fill, dt),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.host.page_size

    @property
    def num_frames(self) -> int:
        return self.host.num_frames

    def token_rows(self) -> np.ndarray:
        """[L, B, S, D + R] numpy: every request's host rows read through the table (debug
        reads, O(L B S); pages not held read as NaN, bytes 0xFF in fp8_ds_mla)."""
        return np.asarray(pool_to_tokens(jnp.asarray(read_back(self.host.kv)), self.table,
                                         jnp.nan))

    def token_index_keys(self) -> np.ndarray:
        """[G, B, S, N] numpy: every request's indexer keys read through the table."""
        return np.asarray(pool_to_tokens(self.index_keys, self.table, jnp.nan))

    @property
    def page_size(self) -> int:
        return self.host.page_size


def layer_bytes(config: ModelConfig, *, batch: int, capacity: int) -> int:
    """Bytes of one full-layer KV buffer: B * S * kv_row_bytes (the prefill holds n of them)."""
    return batch * capacity * config.kv_row_bytes


# The backend ----------------------------------------------------------------------------------


class OffloadPrefillBackend:
    """Backend of `forward` over (layer buffers, binding table, host pages, indexer keys).

    carry = {"buffers": [n, B, S, D+R], "binding": [n] int32, "host": [L, F, Z, D+R],
             "index_keys": [G, F, Z, N]}; both pools are read and written through `table`
    [B, P] (the buffers are per request: [B, S]).
    """

    def __init__(self, config: ModelConfig, dense: bool, schedule: PrefillSchedule, *,
                 history_pages: int, poison: bool, on_host: bool, access: str = "gather",
                 query_block: int | None = None, table=None):
        self.config, self.dense, self.schedule = config, dense, schedule
        self.table = table
        self.query_block = query_block
        self.history_pages, self.poison, self.on_host = history_pages, poison, on_host
        self.access = access

    def write_index_keys(self, carry, g, keys, write_pos):
        ik = write_pool_keys(carry["index_keys"], self.table, g, keys, write_pos)
        return {**carry, "index_keys": ik}

    def index_keys(self, carry, g):
        return read_pool_keys(carry["index_keys"], self.table, g)

    def select(self, carry, g, q, w, visible, k):
        # The group's keys read through the table ([B, S, N]: the keys the indexer reads).
        return xla_select(read_pool_keys(carry["index_keys"], self.table, g), q, w, visible, k,
                          key_block=self.query_block)

    def plan_group(self, carry, g, tokens, mask, slots=None):
        return carry, (tokens, mask)

    def load(self, carry, layer, buffer, *, when=True):
        """Load `layer`'s history into `buffer` and bind it, if `when` (all may be traced).

        The buffers are updated in place: only the loaded rows pass through a `lax.cond` (the
        host read runs only when `when`), and one `dynamic_update_slice` of [B, rows, D+R]
        writes them, or writes the target's own rows back when nothing loads. No branch
        holds or returns the [n, B, S, D+R] buffers (that made XLA copy them whole).
        """
        buffers, binding = carry["buffers"], carry["binding"]
        num_b, batch, cap, width = buffers.shape
        when = jnp.asarray(when)
        target = jnp.where(when, buffer, 0).astype(jnp.int32)
        loaded = self.history_pages * carry["host"].shape[2]  # rows of the history pages
        span = loaded
        if self.poison:
            span = cap  # rows past the history are set to NaN: a stray read shows
        if span:
            old = jax.lax.dynamic_slice(buffers, (target, 0, 0, 0), (1, batch, span, width))[0]
            if self.history_pages:
                def read(layer):
                    return load_history(carry["host"], self.table, layer,
                                        history_pages=self.history_pages, on_host=self.on_host,
                                        access=self.access).astype(buffers.dtype)

                def skip(layer):
                    return jnp.zeros((batch, loaded, width), buffers.dtype)

                rows = jax.lax.cond(when, read, skip, jnp.maximum(layer, 0))
            else:
                rows = jnp.zeros((batch, 0, width), buffers.dtype)
            if span > loaded:
                rows = jnp.concatenate(
                    [rows, jnp.full((batch, span - loaded, width),
                                    kv_fill(jnp.nan, buffers.dtype), buffers.dtype)],
                    axis=1)
            rows = jnp.where(when, rows, old)
            buffers = jax.lax.dynamic_update_slice(buffers, rows[None], (target, 0, 0, 0))
        binding = binding.at[jnp.where(when, buffer, num_b)].set(layer, mode="drop")
        return {**carry, "buffers": buffers, "binding": binding}

    def attend(self, carry, l, g, plan, q_lat, q_pe, kv_new, write_pos):
        buffers, binding = carry["buffers"], carry["binding"]
        # (1) layer l's buffer, from the binding table.
        b = jnp.argmax(binding == l).astype(jnp.int32)
        rows = jnp.arange(buffers.shape[1])[:, None]
        # (2) the chunk's new rows, in place.
        buffers = buffers.at[b, rows, write_pos].set(kv_new, mode="drop")
        # (3) attention over history + chunk: the resident path's own math.
        scale = softmax_scale(self.config)
        # Over blocks of query_block queries, as the resident path does.
        if plan is None:
            layer_kv = jax.lax.dynamic_index_in_dim(buffers, b, keepdims=False)
            out = over_query_blocks(
                lambda ql, qp, wp: dense_attention(ql, qp, layer_kv,
                                                   causal_mask(wp, buffers.shape[2]),
                                                   scale=scale),
                self.query_block, q_lat, q_pe, write_pos)
        else:
            tokens, mask = plan
            out = over_query_blocks(
                lambda ql, qp, tok, m: sparse_attention(
                    ql, qp, buffers[b, rows[:, :, None], jnp.where(m, tok, 0)], m, scale=scale),
                self.query_block, q_lat, q_pe, tokens, mask)
        # The loads below update the buffers in place: order them after the reads of this
        # layer's attention, or XLA's copy insertion copies the whole [n, B, S, D+R] buffers.
        buffers, out = jax.lax.optimization_barrier((buffers, out))
        # (4) write back the chunk's rows of layer l.
        host = write_back_rows(carry["host"], self.table, l, kv_new, write_pos,
                               on_host=self.on_host, access=self.access)
        carry = {**carry, "buffers": buffers, "host": host}
        # (5) prefetch onload_layer_map[l] into free buffers.
        loads, targets = (jnp.asarray(t) for t in self.schedule.tables())
        for m in range(self.schedule.max_loads):
            layer, buffer = loads[l, m], targets[l, m]
            carry = self.load(carry, layer, buffer, when=layer >= 0)
        return carry, out


def prefill_forward(params, state: PrefillState, tokens, num_new, *, config: ModelConfig,
             dense: bool, schedule: PrefillSchedule, history_pages: int, poison: bool,
             on_host: bool, host_access: str = "gather", query_block: int | None = None,
             return_hidden: bool = False):
    """The offloaded prefill of one chunk, pure (jitted as `prefill_jit`, the state donated;
    arguments from `prefill_arguments`): (logits, new state[, hidden]). `prefill` validates,
    then runs it; the data-parallel prefill (`fo_jax.sharded_steps`) runs it per rank;
    `fo_jax.offload.seat_prefill` runs it over one seat's batch-1 view, or a pack of seats'."""
    batch, num_t = tokens.shape
    cap = state.capacity
    # Never past capacity, checked or not: tokens beyond it are padding (dropped).
    num_new = clamp_new(num_new, state.lengths, num_t, cap)
    offsets = jnp.arange(num_t, dtype=jnp.int32)
    positions = state.lengths[:, None] + offsets[None, :]
    write_pos = jnp.where(offsets[None, :] < num_new[:, None], positions, cap)
    backend = OffloadPrefillBackend(config, dense, schedule, history_pages=history_pages,
                                    poison=poison, on_host=on_host, access=host_access,
                                    query_block=query_block, table=state.table)
    width, row_dtype = config.kv_row_width, config.kv_row_dtype
    carry = {
        "buffers": jnp.full((schedule.num_buffers, batch, cap, width),
                            kv_fill(jnp.nan if poison else 0.0, row_dtype), row_dtype),
        "binding": jnp.full((schedule.num_buffers,), -1, jnp.int32),
        "host": state.host.kv,
        "index_keys": state.index_keys,
    }
    carry = backend.load(carry, 0, 0)  # buffer 0: layer 0, for the whole prefill
    logits, carry, *hidden = forward(params, tokens, positions, write_pos, backend, carry,
                                     config=config, dense=dense, query_block=query_block,
                                     return_hidden=return_hidden)
    new_state = PrefillState(host=HostPages(kv=carry["host"]), table=state.table,
                             index_keys=carry["index_keys"], lengths=state.lengths + num_new)
    return (logits, new_state, *hidden)


PREFILL_STATIC = ("config", "dense", "schedule", "history_pages", "poison", "on_host",
                  "host_access", "query_block", "return_hidden")
prefill_jit = functools.partial(jax.jit, static_argnames=PREFILL_STATIC,
                                donate_argnames=("state",))(prefill_forward)


def history_pages_for(lengths, page_size: int, num_pages: int) -> int:
    """Pages to load per layer: ceil(max(lengths) / Z), at most P (0 for a new batch)."""
    longest = int(np.max(np.asarray(lengths), initial=0))
    return min(num_pages, -(-longest // page_size))


def prefill(params, state: PrefillState, tokens, num_new=None, *, config: ModelConfig,
            num_buffers: int | None = None, distance: int | None = None, onload_layer_map=None,
            dense: bool = False, history_pages: int | None = None, poison: bool = False,
            check: bool = True, host_access: str | None = None,
            query_block: int | None = QUERY_BLOCK, return_hidden: bool = False):
    """Append a chunk of T tokens per request with offloaded KV; (logits [B, T, V], new state)
    (with `return_hidden`: and the last hidden states [B, T, E] before the final norm, as
    `fo_jax.resident.prefill`; the logits are the same bit for bit).

    Args:
      state: PrefillState (donated: use the returned one).
      tokens: [B, T] int token ids (row b's first num_new[b] entries are real, the rest padding;
        logits of padding entries are unspecified).
      num_new: [B] ints, default T for every request.
      num_buffers: n device layer buffers in [min(2, L), L]; default min(4, L).
      distance, onload_layer_map: the prefetch schedule (see `PrefillSchedule.create`); default
        distance 1.
      dense: attend to the whole causal prefix (the dense model) instead of the top-k.
      history_pages: pages of history loaded per layer (static); default
        `history_pages_for(state.lengths, ...)`, which reads `state.lengths` (all P pages when
        the lengths are traced, under an outer jit: pass it to load less); must cover the
        longest history.
      poison: NaN in buffer rows past the loaded history (tests: a stray read shows).
      check: validate device token ids, counts and capacity against concrete values (reads
        `state.lengths`); host token ids are always checked (in numpy, before any cast), traced
        values never. Checked or not, nothing is written past capacity (tokens beyond it are
        dropped in the program).
      host_access: how history pages are loaded and the chunk's rows written back, "gather",
        "slices" or "ffi" (see fo_jax.offload.host; the same bits either way); None:
        `default_host_access()`. A prefill feeding an offloaded decode should use its
        `OffloadConfig.host_access` (the offloaded engine does).
      query_block: selection and attention run over blocks of this many queries (temporaries
        bounded by the block, not by T; see `fo_jax.resident.prefill`); None: all T at once.
    Raises:
      ValueError: bad shapes, token ids, capacity or schedule, before anything runs.
    """
    args, static = prefill_arguments(
        params, state, tokens, num_new, config=config, num_buffers=num_buffers,
        distance=distance, onload_layer_map=onload_layer_map, dense=dense,
        history_pages=history_pages, poison=poison, check=check, host_access=host_access,
        query_block=query_block)
    return prefill_jit(*args, **static, return_hidden=bool(return_hidden))


def lower_prefill(params, state: PrefillState, tokens, num_new=None, *, config: ModelConfig,
                  num_buffers: int | None = None, distance: int | None = None,
                  onload_layer_map=None, dense: bool = False, history_pages: int | None = None,
                  poison: bool = False, check: bool = True, host_access: str | None = None,
                  query_block: int | None = QUERY_BLOCK):
    """The program `prefill` runs with these arguments, lowered (donation included): for
    checks of its compiled HLO and `memory_analysis()`. Same arguments and checks as `prefill`;
    nothing runs and nothing is donated."""
    args, static = prefill_arguments(
        params, state, tokens, num_new, config=config, num_buffers=num_buffers,
        distance=distance, onload_layer_map=onload_layer_map, dense=dense,
        history_pages=history_pages, poison=poison, check=check, host_access=host_access,
        query_block=query_block)
    return prefill_jit.lower(*args, **static)


def prefill_arguments(params, state: PrefillState, tokens, num_new, *, config: ModelConfig,
                      num_buffers, distance, onload_layer_map, dense, history_pages, poison,
                      check, host_access, query_block):
    """Validate `prefill`'s arguments: (positional args, static kwargs) of `prefill_jit`."""
    check_query_block(query_block)
    host_access = default_host_access() if host_access is None else host_access
    check_host_access(host_access)
    if num_buffers is None:
        num_buffers = min(4, config.num_layers)
    schedule = PrefillSchedule.create(config.num_layers, num_buffers, distance=distance,
                                      onload_layer_map=onload_layer_map)
    check_live(state, "prefill")
    tokens, num_t = prepare_tokens(tokens, state.batch, config, check=check)
    num_new = (jnp.full((state.batch,), num_t, jnp.int32) if num_new is None
               else jnp.asarray(num_new, jnp.int32))
    if num_new.shape != (state.batch,):
        raise ValueError(f"num_new has shape {num_new.shape}, expected ({state.batch},) "
                         "(one count per request)")
    num_pages = state.table.shape[1]
    check_table(state.table, batch=state.batch, num_pages=num_pages,
                num_frames=state.num_frames, values=check and is_concrete(state.lengths),
                lengths=np.asarray(state.lengths) if is_concrete(state.lengths) else None,
                page_size=state.page_size)
    if tuple(state.index_keys.shape) != (config.num_groups, state.num_frames, state.page_size,
                                         config.index_head_dim):
        raise ValueError(f"state.index_keys has shape {tuple(state.index_keys.shape)}, expected "
                         f"[G, F, Z, N] = {(config.num_groups, state.num_frames, state.page_size,
                                           config.index_head_dim)} (the key pool shares the "
                         "host pool's pages)")
    known = is_concrete(state.lengths)
    if check and is_concrete(num_new):
        if np.any(np.asarray(num_new) > num_t):
            raise ValueError(f"num_new={np.asarray(num_new).tolist()} exceeds the chunk width "
                             f"{num_t}")
        if known:
            check_capacity(state.lengths, num_new, state.capacity, config)
            if is_concrete(state.table):
                check_table_covers(state.table, np.asarray(state.lengths) + np.asarray(num_new),
                                   state.page_size)
    if history_pages is None:
        history_pages = (history_pages_for(state.lengths, state.page_size, num_pages) if known
                         else num_pages)
    elif (check and known
          and history_pages < history_pages_for(state.lengths, state.page_size, num_pages)):
        raise ValueError(f"{history_pages=} does not cover the longest history "
                         f"({int(np.max(np.asarray(state.lengths)))} tokens)")
    if not 0 <= history_pages <= num_pages:
        raise ValueError(f"{history_pages=} must be in [0, {num_pages}]")
    return (params, state, tokens, num_new), dict(
        config=config, dense=dense, schedule=schedule, history_pages=int(history_pages),
        poison=poison, on_host=in_host_memory(state.host.kv), host_access=host_access,
        query_block=None if query_block is None else int(query_block))


# Handoff to the offloaded decode path ----------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("chunk", "on_host", "access"))
def gather_hot(host_kv, table, tokens, fill, *, chunk: int, on_host: bool, access: str):
    """hot [L, B, M, D+R]: row m of request b is token tokens[b, m] of each layer, or fill."""
    num_l = host_kv.shape[0]
    batch, size = tokens.shape
    count = jnp.full((batch,), size, jnp.int32)

    def one_layer(layer):
        rows = host_gather_rows(host_kv, table, layer, tokens, count, chunk=chunk,
                                on_host=on_host, access=access)
        return jnp.where((tokens >= 0)[..., None], rows, fill.astype(rows.dtype))

    return jax.lax.map(one_layer, jnp.arange(num_l, dtype=jnp.int32))


@jax.jit
def clear_unstored(pool, table, lengths, fill):
    """The key pool [G, F, Z, N] with every position >= length of a held page set to `fill`
    (what `DecodeState.from_resident` stores there); pages no request holds are left as they
    are. O(G F Z N): the handoff's one pass."""
    batch, pages = table.shape
    page = pool.shape[2]
    positions = jnp.arange(pages * page).reshape(pages, page)
    unstored = positions[None] >= lengths[:, None, None]  # [B, P, Z]
    frames = jnp.where(table >= 0, table, pool.shape[1])
    clear = jnp.zeros(pool.shape[1:3], bool).at[frames].set(unstored, mode="drop")  # [F, Z]
    return jnp.where(clear[None, :, :, None], fill, pool)


def to_decode_state(state: PrefillState, *, config: ModelConfig, offload: OffloadConfig,
                    fill: float = 0.0) -> DecodeState:
    """Hand a prefilled batch to the offloaded decode path without putting all layers on device.

    Builds the same `DecodeState` as `DecodeState.from_resident(kv, ...)` would from the resident
    KV (same hot-cache rows, tail blocks, slot maps and policy state), gathering only the hot and
    tail rows ([L, B, C + 2Z, D+R], the decode state's own size) from host pages. The host pages
    are reused as they are (the same buffer when the memory kinds match: the first decode step
    donates it, after which the PrefillState must not be used); rows past each request's length
    keep what the prefill state was created with, so use the same `fill` for both. Needs offload.page_size and offload.capacity
    equal to the prefill state's page size and capacity.
    """
    offload.validate_for(config)
    check_live(state, "to_decode_state")
    if (offload.page_size, offload.capacity) != (state.page_size, state.capacity):
        raise ValueError(
            f"offload page_size={offload.page_size}, capacity={offload.capacity} must equal the "
            f"prefill state's page_size={state.page_size}, capacity={state.capacity}: the host "
            "pages are handed over as they are")
    lengths_np = np.asarray(state.lengths).astype(np.int32)
    check_table_covers(state.table, lengths_np, offload.page_size)
    index_keys = clear_unstored(state.index_keys, state.table, jnp.asarray(lengths_np),
                                jnp.asarray(fill, state.index_keys.dtype))
    host = state.host.kv
    if host.sharding.memory_kind != offload.host_memory_kind:
        host = to_memory_kind(host, offload.host_memory_kind)

    # The same placement as DecodeState.from_resident; rows gathered from host pages.
    row_tok, slots, policy = initial_layout(config, offload, lengths_np)
    hot = gather_hot(host, state.table, jnp.asarray(row_tok),
                     jnp.asarray(kv_fill(fill, host.dtype), host.dtype),
                     chunk=offload.miss_chunk, on_host=in_host_memory(host),
                     access=offload.host_access)
    return committed(DecodeState(host=HostPages(kv=host), table=state.table, hot=hot,
                                 index_keys=index_keys,
                                 slots=slots, policy=policy, lengths=jnp.asarray(lengths_np),
                                 step=jnp.asarray(1, jnp.int32)))


def join_seats(state: DecodeState, joined, *, config: ModelConfig, offload: OffloadConfig,
               fill: float = 0.0) -> DecodeState:
    """Hand the seats marked in `joined` [B] bool, just prefilled into `state`'s host pages and
    indexer keys, to the decode path; every other seat keeps its hot rows, maps and policy.

    A joined seat gets what `to_decode_state` gives a prefilled batch for its length: its tail
    blocks, its most recent tokens in hot slots 0, 1, ..., fresh maps and policy state (the
    previous occupant's are dropped). Reads the joined seats' C + 2Z rows per layer from host
    pages; the merge with the other seats is O(L B (C + 2Z)) device work (a select over the hot
    rows, maps and policy state), independent of S. The state is not donated.
    """
    offload.validate_for(config)
    joined = np.asarray(joined, bool)
    if joined.shape != (state.batch,):
        raise ValueError(f"joined must be [{state.batch}] bools (one per seat), got shape "
                         f"{joined.shape}")
    lengths_np = np.asarray(state.lengths).astype(np.int32)
    row_tok, slots, policy = initial_layout(config, offload, lengths_np)
    row_tok = np.where(joined[:, None], row_tok, -1)  # read the joined seats' rows only
    host = state.host.kv
    hot = gather_hot(host, state.table, jnp.asarray(row_tok),
                     jnp.asarray(kv_fill(fill, host.dtype), host.dtype),
                     chunk=offload.miss_chunk, on_host=in_host_memory(host),
                     access=offload.host_access)
    old = (state.hot, state.slots, state.policy)
    hot, slots, merged = _merge_seats(old, (hot, slots, policy), jnp.asarray(joined))
    return dataclasses.replace(state, hot=hot, slots=slots,
                               policy=dataclasses.replace(merged, key=state.policy.key))


@jax.jit
def _merge_seats(old, new, seat):
    """`new` where `seat` [B], else `old`, leaf by leaf along the batch axis (axis 1 of every
    hot-row, map and policy array); empty leaves (an unused policy's) stay."""

    def pick(n, o):
        if n.size == 0 or n.ndim < 2:
            return o
        shape = [1] * n.ndim
        shape[1] = -1
        return jnp.where(seat.reshape(shape), n, o)

    return jax.tree_util.tree_map(pick, new, old)


__all__ = [
    "OffloadPrefillBackend",
    "PREFILL_STATIC",
    "PrefillSchedule",
    "PrefillState",
    "history_pages_for",
    "join_seats",
    "layer_bytes",
    "load_history",
    "lower_prefill",
    "prefill",
    "prefill_forward",
    "prefill_jit",
    "to_decode_state",
    "write_back_rows",
]

"""The offloaded decode step: a pure function over (hot cache, cache slots, host pages).

    logits, state, stats = decode_step(params, state, tokens[B, W], config=..., offload=...)

Per indexer group: the group's indexer scores every token and selects each way's top-k with
the resident path's own `select_topk`; `manage_group` turns the selections into a plan (hits,
tail tokens, the misses' union, their victim slots). Per layer of the group (`gather_attend`,
the CopySFA logic): the step's new KV row goes into the tail block, the misses are copied from
host pages into their victim slots (only the missed rows cross to the device), every selected
row is gathered from the layer's device rows in the selection's canonical order, and the
model's own `sparse_attention` combines them. After the layer loop the step's new rows are
written through to host pages (only the new rows cross back). Both host accesses live in
`fo_jax.offload.host`, in the way `OffloadConfig.host_access` chooses.

Host KV [L, F, Z, D+R] and indexer keys [G, F, Z, N] are pools addressed by the state's page
table [B, P] (fo_jax.offload.state): the misses, the write-through and the new indexer keys go
through it, and the selection reads each request's keys through it ([B, S, N] per group, the
keys the indexer reads anyway). The compiled step sees pools and table only: changing the
table's contents never recompiles.

Logits are bit for bit those of `fo_jax.resident.decode_step`: both gather the same rows in the
same order and run the same math.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fo_jax.config import ModelConfig
from fo_jax.model.attention import softmax_scale, sparse_attention
from fo_jax.kernels import check_kv_format, interpret_params, resolve_implementation
from fo_jax.model.forward import forward, xla_select
from fo_jax.model.indexer import indexer_scores, select_topk
from fo_jax.offload import checks
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.host import host_gather_rows, host_write_rows, memory_kind
from fo_jax.offload.manage import GroupPlan, manage_group
from fo_jax.offload.state import (
    CacheSlots,
    DecodeState,
    HostPages,
    PolicyState,
    check_table,
    check_table_covers,
    read_pool_keys,
    write_pool_keys,
)
from fo_jax.resident import (
    check_active,
    check_capacity,
    check_live,
    clamp_new,
    is_concrete,
    prepare_tokens,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
    """What one step did, as arrays (a loop can sum them without a host sync).

    Attributes:
      hits, tail_hits, misses: [G, B, W] per group, request and way.
      union: [G, B] distinct misses per group (rows copied into each layer of the group).
      h2d_bytes: [B] host-to-device bytes (misses x layers x row bytes).
      d2h_bytes: [B] device-to-host bytes (new rows written through).
      selected: [G, B, W, K] the tokens each way selected (canonical order, -1 padding).
      scores: [G, B, W, S] float32 indexer scores of every token (-inf where the way cannot see
        it), only from `decode_step(..., scores=True)` (traces); else None.
    """

    hits: jax.Array
    tail_hits: jax.Array
    misses: jax.Array
    union: jax.Array
    h2d_bytes: jax.Array
    d2h_bytes: jax.Array
    selected: jax.Array
    scores: jax.Array | None = None


def gather_attend(hot, host_kv, table, layer, plan: GroupPlan, q_lat, q_pe, *, scale: float,
                  chunk: int, on_host: bool, access: str = "gather"):
    """CopySFA logic for one layer, in XLA: install the misses, gather, attend.

    Args:
      hot: [L, B, C + 2Z, D+R] device rows of every layer (new tokens already in the tail).
      host_kv: [L, F, Z, D+R] host pool.
      table: [B, P] page table.
      layer: [] int.
      plan: the group's plan.
      q_lat: [B, W, H, D].
      q_pe: [B, W, H, R].
      access: how the misses leave host pages (fo_jax.offload.host).
    Returns:
      The pair (hot with every miss of this layer written into its victim slot,
      out [B, W, H, D] float32).

    Touches ceil(max over the batch of misses / chunk) * chunk host rows per request ("gather";
    "slices": exactly the misses) and W K + M device rows: scatters and gathers
    index the full array directly, so no layer-sized slice is copied.
    """
    batch, rows_total = hot.shape[1], hot.shape[2]
    b2 = jnp.arange(batch)[:, None]
    fetched = host_gather_rows(host_kv, table, layer, plan.miss_tokens, plan.num_miss, chunk=chunk,
                               on_host=on_host, access=access)
    hot = hot.at[layer, b2, jnp.where(plan.victims >= 0, plan.victims, rows_total)].set(
        fetched, mode="drop")
    gathered = hot[layer, b2[:, :, None], plan.read_row]
    return hot, sparse_attention(q_lat, q_pe, gathered, plan.mask, scale=scale)


class OffloadBackend:
    """Backend of `forward` over the decode state (see fo_jax.model.forward)."""

    def __init__(self, config: ModelConfig, offload: OffloadConfig, host_kv, tail_start, step,
                 implementation: str = "xla", interpret=False, active=None,
                 keep_scores: bool = False, table=None):
        check_kv_format(implementation, config.kv_format)
        self.config, self.offload = config, offload
        # [B] bool or None: a request that is not active selects nothing, so its hot cache,
        # slot maps and policy state stay as they are (see `decode_step`).
        self.active = active
        # keep_scores: every group's indexer scores [B, W, S] (traces), in group order.
        self.keep_scores, self.group_scores = keep_scores, []
        self.host_kv, self.tail_start, self.step = host_kv, tail_start, step
        self.table = table  # [B, P] int32: both pools are read and written through it
        self.implementation, self.interpret = implementation, interpret
        self.on_host = offload.host_memory_kind != "device"
        # (GroupStats, selection) of each group, in group order. plan_group runs at trace time
        # outside the layer loops, so the stats need not ride in any loop carry.
        self.group_stats: list = []

    def write_index_keys(self, carry, g, keys, write_pos):
        ik = carry["index_keys"]
        return {**carry, "index_keys": write_pool_keys(ik, self.table, g, keys, write_pos)}

    def index_keys(self, carry, g):
        return read_pool_keys(carry["index_keys"], self.table, g)

    def select(self, carry, g, q, w, visible, k):
        if self.keep_scores or self.implementation != "pallas":
            # The group's keys of every request, read through the table: [B, S, N], O(B S N)
            # per step, the keys the indexer reads anyway.
            keys = read_pool_keys(carry["index_keys"], self.table, g)
        if self.keep_scores:
            # The same scores and rule as xla_select; kept (-inf where not visible).
            scores = indexer_scores(q, w, keys)
            allowed = jnp.arange(scores.shape[-1])[None, None, :] < visible[..., None]
            self.group_scores.append(jnp.where(allowed, scores, -jnp.inf))
            if self.implementation != "pallas":
                tokens, mask = select_topk(scores, visible, k)
                return tokens, mask, None
        if self.implementation == "pallas":
            from pallas_kernels.lim import lim

            # LIM: scores and the slot lookup in one pass over the group's keys and map; the
            # keys are DMA'd page by page from the key pool through the scalar-prefetched
            # page table.
            tokens, slots, _ = lim(q, w, carry["index_keys"], carry["slots"][0],
                                   visible.astype(jnp.int32), k=k, group=g,
                                   page_table=self.table, interpret=self.interpret)
            return tokens, tokens >= 0, slots
        return xla_select(keys, q, w, visible, k)

    def plan_group(self, carry, g, tokens, mask, slots):
        oc = self.offload
        if self.active is not None:
            mask = mask & self.active[:, None, None]
        plan, stats, slots, policy = manage_group(
            tokens, mask, carry["slots"], carry["policy"], g, self.tail_start, self.step,
            policy=oc.policy, hot_slots=oc.hot_slots, page_size=oc.page_size, looked_up=slots)
        if self.active is not None:  # an inactive request selected nothing
            tokens = jnp.where(self.active[:, None, None], tokens, -1)
        self.group_stats.append((stats, tokens))
        return {**carry, "slots": slots, "policy": policy}, plan

    def attend(self, carry, l, g, plan, q_lat, q_pe, kv_new, write_pos):
        oc = self.offload
        hot = carry["hot"]
        rows = jnp.arange(hot.shape[1])[:, None]
        tail_row = oc.hot_slots + ((write_pos // oc.page_size) % 2) * oc.page_size \
            + write_pos % oc.page_size
        # A position past capacity (write_pos = S: dropped by `decode_jit`) writes nothing.
        tail_row = jnp.where(write_pos < oc.capacity, tail_row, oc.rows)
        hot = hot.at[l, rows, tail_row].set(kv_new, mode="drop")
        if self.implementation == "pallas":
            from pallas_kernels.copy_sfa import copy_sfa

            # CopySFA: hits from the hot cache, misses from host pages straight into their
            # victim slots and the attention workspace, in the canonical order.
            # The misses are read through the page table (scalar-prefetched page ids).
            out, hot = copy_sfa(q_lat, q_pe, hot, self.host_kv,
                                jnp.where(plan.mask, plan.read_row, -1),
                                plan.miss_tokens, plan.victims, plan.num_miss,
                                scale=softmax_scale(self.config), layer=l,
                                page_table=self.table, interpret=self.interpret)
            return {**carry, "hot": hot}, out
        hot, out = gather_attend(hot, self.host_kv, self.table, l, plan, q_lat, q_pe,
                                 scale=softmax_scale(self.config), chunk=oc.miss_chunk,
                                 on_host=self.on_host, access=oc.host_access)
        return {**carry, "hot": hot}, out


@functools.partial(jax.jit, static_argnames=("config", "offload", "implementation", "interpret",
                                             "debug", "scores", "return_hidden"),
                   donate_argnames=("state",))
def decode_jit(params, state: DecodeState, tokens, active=None, *, config: ModelConfig,
               offload: OffloadConfig, implementation: str = "xla", interpret=False,
               debug: bool = False, scores: bool = False, return_hidden: bool = False):
    """The step, pure. With `debug`, the invariants of fo_jax.offload.checks are checkified
    after the step (O(G B (S + C)) more work): trace it under `checkify.checkify`. With
    `scores`, stats.scores holds every group's indexer scores [G, B, W, S].
    active: [B] bool or None (all): see `decode_step`."""
    batch, ways = tokens.shape
    offsets = jnp.arange(ways, dtype=jnp.int32)
    positions = state.lengths[:, None] + offsets[None, :]
    # Never past capacity, checked or not: a token beyond it is dropped (no KV, index key or
    # host row written; its logits unspecified) and lengths stop at S. An inactive request
    # takes no token at all, the same way.
    want = jnp.full((batch,), ways, jnp.int32)
    if active is not None:
        want = jnp.where(active, want, 0)
    num_new = clamp_new(want, state.lengths, ways, offload.capacity)
    write_pos = jnp.where(offsets[None, :] < num_new[:, None], positions, offload.capacity)
    tail_start = (state.lengths // offload.page_size) * offload.page_size
    backend = OffloadBackend(config, offload, state.host.kv, tail_start, state.step,
                             implementation, interpret, active, keep_scores=scores,
                             table=state.table)
    p = state.policy
    carry = {
        "hot": state.hot,
        "index_keys": state.index_keys,
        "slots": (state.slots.token_to_slot, state.slots.slot_to_token),
        "policy": (p.stamp, p.hand, p.last_used, p.ref, p.key),
    }
    logits, carry, *hidden = forward(params, tokens, positions, write_pos, backend, carry,
                                     config=config, return_hidden=return_hidden)
    # Write the step's new rows through to host pages (only them).
    z = offload.page_size
    tail_row = offload.hot_slots + ((positions // z) % 2) * z + positions % z
    new_rows = carry["hot"][:, jnp.arange(batch)[:, None], tail_row]  # [L, B, W, D+R]
    host_kv = host_write_rows(state.host.kv, state.table, new_rows, write_pos,
                              on_host=offload.host_memory_kind != "device",
                              access=offload.host_access)
    stamp, hand, last_used, ref, key = carry["policy"]
    new_state = DecodeState(
        host=HostPages(kv=host_kv),
        table=state.table,
        hot=carry["hot"],
        index_keys=carry["index_keys"],
        slots=CacheSlots(*carry["slots"]),
        policy=PolicyState(stamp=stamp, hand=hand, last_used=last_used, ref=ref, key=key),
        lengths=state.lengths + num_new,
        step=state.step + 1,
    )
    group_stats = [s for s, _ in backend.group_stats]
    row_bytes = config.kv_row_bytes
    layers_per_group = jnp.asarray([hi - lo for lo, hi in config.group_bounds], jnp.int32)
    union = jnp.stack([s.union for s in group_stats])  # [G, B]
    stats = DecodeStats(
        hits=jnp.stack([s.hits for s in group_stats]),
        tail_hits=jnp.stack([s.tail_hits for s in group_stats]),
        misses=jnp.stack([s.misses for s in group_stats]),
        union=union,
        h2d_bytes=jnp.sum(union * layers_per_group[:, None], axis=0) * row_bytes,
        d2h_bytes=num_new * (config.num_layers * row_bytes),
        selected=jnp.stack([t for _, t in backend.group_stats]),
        scores=jnp.stack(backend.group_scores) if scores else None,
    )
    if debug:
        checks.check_step(state, new_state, stats, logits, config=config, offload=offload)
    return (logits, new_state, stats, *hidden)


@functools.partial(jax.jit, static_argnames=("config", "offload", "implementation", "interpret",
                                             "scores", "return_hidden"),
                   donate_argnames=("state",))
def _decode_checked(params, state: DecodeState, tokens, active=None, *, config: ModelConfig,
                    offload: OffloadConfig, implementation: str, interpret, scores=False,
                    return_hidden=False):
    """`decode_jit` with debug checks, functionalised: (checkify.Error, step outputs)."""
    step = functools.partial(decode_jit, config=config, offload=offload,
                             implementation=implementation, interpret=interpret, debug=True,
                             scores=scores, return_hidden=return_hidden)
    return checkify.checkify(step, errors=checkify.user_checks)(params, state, tokens, active)


def check_state(state: DecodeState, *, config: ModelConfig, offload: OffloadConfig) -> None:
    """Raise ValueError unless `state` was built for this config and offload setting.

    Static (shape, dtype, memory kind) checks only (`decode_step(check=True)` checks the page
    table's values): a state stepped with another setting would read the wrong tail rows and
    maps without any error.
    """
    offload.validate_for(config)
    batch = state.batch
    frames = state.host.kv.shape[1]  # F: pages in the pools, any size
    check_table(state.table, batch=batch, num_pages=offload.num_pages, num_frames=frames,
                values=False)
    expect = {
        "hot": (state.hot.shape, (config.num_layers, batch, offload.rows,
                                  config.kv_row_width)),
        "host.kv": (state.host.kv.shape, (config.num_layers, frames, offload.page_size,
                                          config.kv_row_width)),
        "index_keys": (state.index_keys.shape, (config.num_groups, frames, offload.page_size,
                                                config.index_head_dim)),
        "slots.token_to_slot": (state.slots.token_to_slot.shape,
                                (config.num_groups, batch, offload.capacity)),
        "slots.slot_to_token": (state.slots.slot_to_token.shape,
                                (config.num_groups, batch, offload.hot_slots)),
        "policy.last_used": (state.policy.last_used.shape,
                             (config.num_groups, batch,
                              offload.hot_slots if offload.policy == "lru" else 0)),
        "policy.ref": (state.policy.ref.shape,
                       (config.num_groups, batch,
                        offload.hot_slots if offload.policy == "clock" else 0)),
    }
    for name, (got, want) in expect.items():
        if tuple(got) != want:
            raise ValueError(
                f"state.{name} has shape {tuple(got)}, expected {want} for config "
                f"{config.name!r} and {offload}: build the state with the same settings "
                "(DecodeState.from_resident / to_decode_state) that step it")
    for name, leaf in (("hot", state.hot), ("host.kv", state.host.kv)):
        if leaf.dtype != config.kv_row_dtype:
            raise ValueError(
                f"state.{name} is {leaf.dtype}, expected {config.kv_row_dtype} (kv_format="
                f"{config.kv_format!r}, kv_dtype={config.kv_dtype!r}): build the state with the "
                "config that steps it")
    kind = memory_kind(state.host.kv)
    if kind is not None and kind != offload.host_memory_kind:
        raise ValueError(f"host pages live in memory kind {kind!r} but the offload setting says "
                         f"{offload.host_memory_kind!r}")


def check_implementation(implementation: str | None, interpret, offload: OffloadConfig) -> str:
    """The implementation the offloaded step runs; raises if it cannot run with `offload`."""
    implementation = resolve_implementation(implementation, interpret)
    if implementation == "pallas" and interpret and offload.host_memory_kind != "device":
        raise NotImplementedError(
            "the Pallas kernels in interpret mode cannot share a jit with a host-memory array "
            "(a JAX bug); use OffloadConfig(host_memory_kind='device') under interpret mode")
    return implementation


def decode_step(params, state: DecodeState, tokens, *, config: ModelConfig,
                offload: OffloadConfig, check: bool = True, implementation: str | None = None,
                interpret=False, debug: bool = False, active=None, scores: bool = False,
                return_hidden: bool = False):
    """One offloaded decode step: (logits [B, W, V], new state, DecodeStats); with
    `return_hidden` also the last hidden states [B, W, E] before the final norm (what the MTP
    drafter reads; the logits are the same bit for bit).

    tokens: [B, W] with W <= config.max_ways. The state is donated: use the returned one.
    implementation: "xla", "pallas" (LIM + CopySFA; off TPU only with `interpret`, and then the
    host pages must be in "device" memory kind: a jit mixing an interpret-mode kernel with a
    host-memory array fails in JAX) or None (by backend): see fo_jax.kernels.
    Shapes (and host token ids, in numpy before any cast) are always validated; with `check`,
    device token ids, host capacity and the page table are validated against concrete values
    too (a read of `state.lengths` and of the [B, P] table: ids in [-1, F), no pool page held
    twice, and every page the step writes held). Errors are raised before any state changes.
    Traced values (the step under an outer `jax.jit`, `lax.scan` or `lax.while_loop`) get the
    static checks only; checked or not, no request grows past capacity (tokens beyond it are
    dropped in the program).
    debug: check the state's invariants on the device after the step (fo_jax.offload.checks:
    maps, occupancy, selection, rows read, finite logits; O(G B (S + C)) more work, a second
    compiled program) and raise AssertionError naming the first violation (the input state is
    donated either way). Under an outer trace the checks are traced into the caller's program:
    wrap it in `checkify.checkify` (or `chex.chexify`) to see them.
    active: [B] bool, default all True. An inactive request (a finished one, an empty seat)
    takes no token and its state does not change: nothing is written to its hot cache, tail,
    indexer keys, slot maps, policy state or host pages and its length stays (the step still
    computes its row: O(1) of the batch's work; its logits are unspecified and its stats 0).
    The state's step counter and the random policy's key are the batch's and advance anyway.
    scores: also return every group's indexer scores in `stats.scores` [G, B, W, S] float32
    (traces of fo_jax.traces; the same selection, one more [G, B, W, S] output per step).
    """
    implementation = check_implementation(implementation, interpret, offload)
    check_live(state, "decode_step")
    tokens, ways = prepare_tokens(tokens, state.batch, config, check=check)
    active = check_active(active, state.batch)
    if ways > config.max_ways:
        raise ValueError(f"decode_step got W={ways} query tokens per request; config "
                         f"{config.name!r} allows 1 to max_ways={config.max_ways}")
    check_state(state, config=config, offload=offload)
    if check and is_concrete(state.lengths):
        taken = np.full(state.batch, ways)
        if active is not None and is_concrete(active):
            taken = np.where(np.asarray(active), taken, 0)
        check_capacity(state.lengths, taken, state.capacity, config, what="the host pages'")
        if is_concrete(state.table):
            check_table(state.table, batch=state.batch, num_pages=offload.num_pages,
                        num_frames=state.num_frames, lengths=np.asarray(state.lengths),
                        page_size=offload.page_size)
            check_table_covers(state.table, np.asarray(state.lengths) + taken, offload.page_size)
    if debug and is_concrete(state.lengths):
        err, out = _decode_checked(params, state, tokens, active, config=config, offload=offload,
                                   implementation=implementation,
                                   interpret=interpret_params(interpret), scores=scores,
                                   return_hidden=bool(return_hidden))
        checks.raise_on_error(err)
        return out
    return decode_jit(params, state, tokens, active, config=config, offload=offload, debug=debug,
                      implementation=implementation, interpret=interpret_params(interpret),
                      scores=scores, return_hidden=bool(return_hidden))

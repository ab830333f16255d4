"""One seat per data-parallel rank: the seat prefill and join steps of the sharded serving
engine (`fo_jax.engine.sharded.ShardedEngine`).

    logits, state = sharded_prefill_seats(params, state, seats, tokens, num_new, mesh=mesh,
                                          config=config)        # one chunk, one seat per rank
    state = sharded_join_seats(state, joined, mesh=mesh, config=config, offload=offload)

    sharded_prefill_seats     the single-device seat prefill (`fo_jax.resident.prefill_seat`,
                              paged `fo_jax.offload.seat_prefill.prefill_seat`) on every rank
    sharded_join_seats        `fo_jax.offload.prefill.join_seats` on every rank's pool shard

Built as the batch steps of `fo_jax.sharded_steps` are (shard_map over `data`, the experts
dispatched as there), bit for bit the single-device seat step on each rank's shard (tiles MoE
path). The design in full: docs/guides/many-devices.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fo_jax import resident
from fo_jax.config import ModelConfig
from fo_jax.distributed import local_values
from fo_jax.model.kv_format import kv_fill
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload import seat_prefill
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState
from fo_jax.sharded_steps import (data_parallel, dispatching, hashable_rules, host_view,
                                  place_batch, put_sharded)
from fo_jax.sharding import (DATA, LAYOUTS, check_divides, check_sharded_tables, host_values,
                             logical_spec, shardings, specs, step_param_specs)


@functools.lru_cache(maxsize=16)
def _seat_prefill_program(mesh: Mesh, paged: bool, statics: tuple, rules_key):
    """jit(shard_map) of one prefill chunk per rank, for (params, state, seat [D], tokens
    [D, T], num_new [D]): rank r runs the single-device seat prefill
    (`fo_jax.resident.prefill_seat`, or paged `fo_jax.offload.seat_prefill.prefill_seat`: its
    pure program, the [1, T] chunk run over its seat's rows or pages alone) on its own shard with
    seat[r] (a rank-local seat), tokens[r] and num_new[r]; the state is donated and keeps its
    shardings."""
    rules = dict(rules_key) if rules_key is not None else None
    kwargs = dict(statics)
    prefill_seat = seat_prefill.prefill_seat if paged else resident.prefill_seat

    def body(params, state, seat, tokens, num_new):
        return prefill_seat(dispatching(params, mesh, rules), state, seat[0], tokens, num_new,
                            check=False, **kwargs)

    def run(params, state, seat, tokens, num_new):
        rank = logical_spec(LAYOUTS["per_request"], mesh, rules)
        in_specs = (step_param_specs(params, mesh, rules), specs(state, mesh, rules), rank,
                    logical_spec(LAYOUTS["tokens"], mesh, rules), rank)
        out_specs = (logical_spec(LAYOUTS["logits"], mesh, rules), specs(state, mesh, rules))
        logits, new_state = data_parallel(body, mesh, in_specs, out_specs)(
            params, state, seat, tokens, num_new)
        new_state = jax.tree.map(jax.lax.with_sharding_constraint, new_state,
                                 shardings(state, mesh, rules))
        return logits, new_state

    return jax.jit(run, donate_argnums=(1,))


def sharded_prefill_seats(params, state, seats, tokens, num_new, *, mesh: Mesh,
                          config: ModelConfig, query_block: int | None = resident.QUERY_BLOCK,
                          check: bool = True, rules=None, history_pages: int | None = None,
                          num_buffers: int | None = None, host_access: str | None = None):
    """One prefill chunk of one seat per data-parallel rank, in one program: rank r appends
    the first num_new[r] of tokens[r] to its seat seats[r] (rank-local: global seat r B/D +
    seats[r]) by the single-device seat prefill on its own shard (shard_map over `data`):
    `fo_jax.resident.prefill_seat` of a ResidentState, or, paged,
    `fo_jax.offload.prefill.prefill_seat` of a PrefillState over the rank's own pool shard
    (`history_pages`, required: one static size for every rank; `num_buffers`, `host_access`
    as there). A rank with num_new[r] = 0 writes nothing; its row still runs (under
    `ALL_TO_ALL_RULES` every rank takes part in every MoE layer's all-to-alls).

    state: placed by `shard_state` (donated). seats, num_new: [D] ints; tokens: [D, T] token
    ids. Returns (logits [D, T, V]: row r rank r's seat's, its padding positions unspecified;
    new state). Each rank's logits and KV are bit for bit those of its `prefill_seat` on its
    shard alone (tiles MoE path; tests/engine/sharded_engine_cases.py). With `check`, ids,
    counts, capacity and (paged) each rank's page table are validated against concrete values
    (a read of the lengths and table)."""
    resident.check_live(state, "sharded_prefill_seats")
    ranks = check_divides(state, mesh)
    per_rank = state.batch // ranks
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] != ranks:
        raise ValueError(f"tokens must be [D = {ranks}, T] (one chunk per data-parallel rank), "
                         f"got shape {tokens.shape}")
    seats, num_new = (np.asarray(x) for x in (seats, num_new))
    for name, x, high in (("seats", seats, per_rank - 1), ("num_new", num_new, tokens.shape[1])):
        if (x.shape != (ranks,) or not np.issubdtype(x.dtype, np.integer)
                or np.any(x < 0) or np.any(x > high)):
            raise ValueError(f"{name} must be [D = {ranks}] ints in [0, {high}], got "
                             f"{x.tolist()}")
    resident.check_token_values(tokens, config)
    resident.check_query_block(query_block)
    if check and resident.is_concrete(state.lengths):
        lengths = np.asarray(host_values(state.lengths))
        resident.check_capacity(lengths[np.arange(ranks) * per_rank + seats], num_new,
                                state.capacity, config)
    paged = isinstance(state, offload_prefill.PrefillState)
    if paged and history_pages is None:
        raise ValueError("a paged state's seat prefill needs history_pages (pages of history "
                         "each rank loads: one static size for every rank)")
    if not paged and (history_pages, num_buffers, host_access) != (None, None, None):
        raise ValueError("history_pages, num_buffers and host_access apply to a paged state "
                         "(a PrefillState)")
    if check and paged and resident.is_concrete(state.lengths):
        taken = np.zeros((state.batch,), np.int32)
        taken[np.arange(ranks) * per_rank + seats] = num_new
        check_sharded_tables(host_view(state), mesh, taken)
    statics = (("config", config),
               ("query_block", None if query_block is None else int(query_block)))
    if paged:
        statics += (("history_pages", int(history_pages)), ("num_buffers", num_buffers),
                    ("host_access", host_access))
    program = _seat_prefill_program(mesh, paged, statics, hashable_rules(rules))
    place = lambda x, axes: place_batch(x.astype(np.int32), axes, mesh, rules)  # noqa: E731
    return program(params, state, place(seats, LAYOUTS["per_request"]),
                   place(tokens, LAYOUTS["tokens"]), place(num_new, LAYOUTS["per_request"]))


@functools.lru_cache(maxsize=16)
def _gather_hot_program(mesh: Mesh, chunk: int, on_host: bool, access: str):
    """jit(shard_map) of `fo_jax.offload.prefill.gather_hot` per rank: the hot and tail rows
    [L, B/D, C + 2Z, D+R] of the rank's seats from its own host pages."""
    batch = P(DATA)

    def body(host_kv, table, row_tok, row_fill):
        return offload_prefill.gather_hot(host_kv, table, row_tok, row_fill, chunk=chunk,
                                          on_host=on_host, access=access)

    return jax.jit(data_parallel(body, mesh, (P(None, DATA), batch, batch, P()),
                                  P(None, DATA)))


@jax.jit
def _merge_joined(old, new, joined):
    """`new` where `joined` [B], else `old`, leaf by leaf along the batch axis (axis 1 of the
    hot rows, maps and policy arrays); empty or batch-less leaves keep `old`'s."""
    def pick(n, o):
        if n.size == 0 or n.ndim < 2:
            return o
        shape = [1] * n.ndim
        shape[1] = -1
        return jnp.where(joined.reshape(shape), n, o)

    return jax.tree.map(pick, new, old)


def sharded_join_seats(state: DecodeState, joined, *, mesh: Mesh, config: ModelConfig,
                       offload: OffloadConfig, fill: float = 0.0, rules=None) -> DecodeState:
    """`fo_jax.offload.prefill.join_seats` of a sharded DecodeState: the seats marked in
    `joined` [B] bool, just prefilled into their rank's host pages, get their hot and tail rows
    (gathered by each rank from its own pool shard), fresh maps and policy state for their
    length; every other seat keeps its own. The same values as `join_seats` on each rank's
    state alone (a gather and a select: exact). A read of the lengths (across processes, of
    this process's own seats: no collective; `joined` marks its own seats only); the state is
    not donated."""
    offload.validate_for(config)
    check_divides(state, mesh)
    joined = np.asarray(joined, bool)
    if joined.shape != (state.batch,):
        raise ValueError(f"joined must be [{state.batch}] bools (one per seat), got shape "
                         f"{joined.shape}")
    if state.lengths.is_fully_addressable:
        lengths = np.asarray(host_view(state).lengths).astype(np.int32)
    else:  # across processes: this process's seats' lengths only (the joined seats are its
        # own; the others' rows are neither read nor used)
        lengths = local_values(state.lengths, 0).astype(np.int32)
    row_tok, slots, policy = offload_prefill.initial_layout(config, offload, lengths)
    row_tok = np.where(joined[:, None], row_tok, -1)  # read the joined seats' rows only
    host = state.host.kv
    program = _gather_hot_program(mesh, offload.miss_chunk,
                                  host.sharding.memory_kind not in (None, "device"),
                                  offload.host_access)
    hot = program(host, state.table, place_batch(row_tok, LAYOUTS["per_request"] + (None,), mesh,
                                            rules),
                  put_sharded(np.asarray(kv_fill(fill, host.dtype), host.dtype),
                       NamedSharding(mesh, P())))
    placed = shardings(state, mesh, rules)
    new = jax.tree.map(put_sharded, (slots, policy), (placed.slots, placed.policy))
    hot, new_slots, new_policy = _merge_joined((state.hot, state.slots, state.policy),
                                               (hot, *new), put_sharded(joined, NamedSharding(
                                                   mesh, logical_spec(("batch",), mesh, rules))))
    out = dataclasses.replace(state, hot=hot, slots=new_slots,
                              policy=dataclasses.replace(new_policy, key=state.policy.key))
    return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s else put_sharded(x, s),
                        out, placed)

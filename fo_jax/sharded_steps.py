"""The data-parallel steps: the single-device steps run on every rank of a mesh's `data` axis.

    mesh = make_mesh(8)                                  # fo_jax.sharding: the mesh and rules
    state = shard_state(state, mesh)
    logits, state, stats = sharded_decode_step(params, state, tokens, mesh=mesh,
                                               config=config, offload=offload)

    sharded_decode_step (+ lower_sharded_decode_step), sharded_resident_decode_step,
    sharded_decode_loop, sharded_prefill, sharded_to_decode_state                steps
    DataParallelOffloadEngine                  fo_jax.batch_engines' OffloadEngine over them
    data_parallel, dispatching, place_batch, put_sharded, host_view, hashable_rules
                                the shard_map and placement pieces the steps are built from
                                (also those of `fo_jax.sharded_seats`: one seat per rank)

Each step wraps the single-device step's pure program in `shard_map` over `data`: every rank
runs it on its B/D requests and F/D frames, in one compiled program for all ranks, with no
collective on the cache. With expert parallelism (`make_mesh(n, expert=e)`) the experts'
weights stay split over `expert`, and one exact all-reduce per MoE layer is the program's only
collective. With `rules=ALL_TO_ALL_RULES` (`fo_jax.sharding.expert_mesh(n, expert=n)`) the
experts are split over `data` itself: every rank holds its own requests, cache and host pool
and 1/D of the experts, and each MoE layer's three all-to-alls (rows, expert ids, outputs:
`fo_jax.model.moe.moe_all_to_all`) are the program's only collectives; the decode loop's ranks
then leave it together (every rank takes part in every step's all-to-alls). Where every array
goes is `fo_jax.sharding`'s.

Contracts: logits, stats and states are bit for bit those of the single-device step run on
each rank's requests and pool shard (expert parallelism of either layout included, on the
tiles MoE path; ragged_dot: to rounding); against one device running
all B requests they agree to rounding only. Weights split over `model` are gathered at the
step's entry (no tensor-parallel step). FP8 weights (`Fp8Weight`) go as the weights they stand
for, values and block scales alike; the KV format (`ModelConfig.kv_format`, fp8_ds_mla's uint8
rows included) is the config's, in every step and the handoff. The design in full:
docs/guides/many-devices.md.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fo_jax import batch_engines, decode_loop, resident
from fo_jax.config import ModelConfig
from fo_jax.decode_loop import LoopOutput
from fo_jax.model.kv_format import kv_fill
from fo_jax.model.moe import AllToAllExperts
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload import seat_prefill
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState, read_back
from fo_jax.sampling import check_keys, check_logprobs
from fo_jax.sharding import (DATA, LAYOUTS, TABLES, check_divides, check_sharded_tables,
                             data_size, experts_over_data, host_values, logical_spec,
                             shard_state, shardings, specs, step_param_specs)


def data_parallel(body, mesh: Mesh, in_specs, out_specs):
    """`body` run by every data-parallel rank on its shard: shard_map over all mesh axes (the
    model / expert axes see replicated operands, but for what `in_specs` splits over them: the
    steps split the MoE experts over `expert`, `step_param_specs`).

    check_vma=False: the single-device steps' loops carry values that become rank-varying
    (jax's varying-axis check would ask for `pcast`s inside them); the only outputs declared
    replicated (the step counter, the random policy's key) are computed from replicated inputs
    alone, so they are equal on every rank.

    Zero-sized operands and results do not cross the shard_map (see `run`): `body` still sees
    and returns them, with their per-rank shapes."""
    def run(*args):
        leaves, treedef = jax.tree.flatten(args)
        leaf_specs = _leaf_specs(in_specs, args)
        full = [i for i, x in enumerate(leaves) if 0 not in np.shape(x)]
        # Zero-sized operands (the policy fields a policy does not use, [G, B, 0]) stay out of
        # the shard_map: each rank rebuilds its (empty) shard as a constant, and empty results
        # are built outside it. jax 0.11.2's Shardy segfaults compiling a shard_map with a
        # zero-sized operand or result (ManualComputationUnusedInputsPattern, CPU; jax 0.12
        # compiles it). They hold no values: the step's results are unchanged.
        empties = {i: (_shard_shape(np.shape(x), leaf_specs[i], mesh), x.dtype)
                   for i, x in enumerate(leaves) if 0 in np.shape(x)}

        def whole_body(*given):
            local = dict(zip(full, given))
            return body(*jax.tree.unflatten(treedef, [
                local[i] if i in local else jnp.zeros(*empties[i]) for i in range(len(leaves))]))

        in_full = tuple(leaf_specs[i] for i in full)
        out_shapes = jax.eval_shape(jax.shard_map(  # global shapes; tracing it is safe
            whole_body, mesh=mesh, in_specs=in_full, out_specs=out_specs, check_vma=False),
            *(leaves[i] for i in full))
        out_leaves, out_def = jax.tree.flatten(out_shapes)
        out_leaf_specs = _leaf_specs(out_specs, out_shapes)
        kept = [i for i, x in enumerate(out_leaves) if 0 not in x.shape]

        def kept_body(*given):
            outs = jax.tree.leaves(whole_body(*given))
            return tuple(outs[i] for i in kept)

        got = jax.shard_map(kept_body, mesh=mesh, in_specs=in_full,
                            out_specs=tuple(out_leaf_specs[i] for i in kept),
                            check_vma=False)(*(leaves[i] for i in full))
        got = dict(zip(kept, got))
        return jax.tree.unflatten(out_def, [
            got[i] if i in got else jnp.zeros(x.shape, x.dtype) for i, x in enumerate(out_leaves)])

    return run


def dispatching(params, mesh: Mesh, rules):
    """The weights a rank's step sees: with the experts split over `data`
    (`fo_jax.sharding.ALL_TO_ALL_RULES`) the MoE stacks are marked `AllToAllExperts`, so each
    MoE layer sends its rows to the experts' owners over `data` (`fo_jax.model.moe`)."""
    if experts_over_data(mesh, rules) and "moe" in params:
        return {**params, "moe": AllToAllExperts(params["moe"], DATA)}
    return params


def _leaf_specs(spec_tree, tree) -> list:
    """The PartitionSpec of every leaf of `tree`, in flatten order: `spec_tree` is a prefix of
    `tree` (a spec for a whole subtree, as shard_map takes them)."""
    per_leaf = jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub), spec_tree,
                            tree, is_leaf=lambda s: isinstance(s, P) or s is None)
    return jax.tree.leaves(per_leaf, is_leaf=lambda s: isinstance(s, P))


def _axes_size(name, mesh: Mesh) -> int:
    names = () if name is None else (name,) if isinstance(name, str) else tuple(name)
    return int(np.prod([mesh.shape[n] for n in names], dtype=np.int64))


def _shard_shape(shape, spec: P, mesh: Mesh) -> tuple:
    """The shape of each rank's shard of an array of `shape` split by `spec`."""
    return tuple(n // _axes_size(spec[i] if i < len(spec) else None, mesh)
                 for i, n in enumerate(shape))


def _out_specs(out, mesh: Mesh, rules):
    """Specs of a step's outputs (logits, state, stats, hidden...): states and stats by
    LAYOUTS, [B, T, X] arrays (logits, hidden states) split over the batch."""
    return tuple(specs(x, mesh, rules) if type(x).__name__ in LAYOUTS
                 else logical_spec(LAYOUTS["logits"], mesh, rules) for x in out)


@functools.lru_cache(maxsize=64)
def _program(mesh: Mesh, step, statics: tuple, has_extra: bool, rules_key):
    """jit(shard_map(step)) for (params, state, tokens [B, T], extra [B] or None): every rank
    runs `step(params, state, tokens, extra, **statics)` on its shard; the state is donated and
    keeps its shardings and memory kinds. One compiled program per (mesh, step, statics) and
    shapes, as the single-device steps."""
    rules = dict(rules_key) if rules_key is not None else None
    kwargs = dict(statics)

    def body(params, state, tokens, extra):
        return step(dispatching(params, mesh, rules), state, tokens, extra, **kwargs)

    def run(params, state, tokens, extra):
        in_specs = (step_param_specs(params, mesh, rules), specs(state, mesh, rules),
                    logical_spec(LAYOUTS["tokens"], mesh, rules),
                    logical_spec(LAYOUTS["per_request"], mesh, rules) if has_extra else None)
        out_specs = _out_specs(jax.eval_shape(body, params, state, tokens, extra), mesh, rules)
        out = data_parallel(body, mesh, in_specs, out_specs)(params, state, tokens, extra)
        # The new state keeps the input's shardings: host pages stay in host memory.
        new_state = jax.tree.map(jax.lax.with_sharding_constraint, out[1],
                                 shardings(state, mesh, rules))
        return (out[0], new_state, *out[2:])

    return jax.jit(run, donate_argnums=(1,))


def _offload_decode(params, state, tokens, active, **statics):
    return offload_decode.decode_jit(params, state, tokens, active, **statics)


def _resident_decode(params, state, tokens, num_new, **statics):
    return resident.forward_jit(params, state, tokens, num_new, dense=False, **statics)


def _offload_prefill(params, state, tokens, num_new, **statics):
    return offload_prefill.prefill_jit(params, state, tokens, num_new, **statics)


def place_batch(x, axes, mesh: Mesh, rules):
    """`x` ([B, ...] tokens, counts or flags: numpy or a jax array) split over the batch."""
    return None if x is None else put_sharded(x, NamedSharding(mesh,
                                                             logical_spec(axes, mesh, rules)))


def put_sharded(x, sharding: NamedSharding):
    """`x` placed with `sharding`. Host values (numpy, or an array on one device) are the whole
    array, alike on every process: with a mesh spanning processes each process places the
    shards of its own devices (`make_array_from_callback`; nothing crosses processes); a global
    array is resharded. PRNG keys go as their key data."""
    if (not sharding.is_fully_addressable and isinstance(x, jax.Array)
            and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)):
        data = jax.random.key_data(x)
        spec = tuple(sharding.spec) + (None,) * (data.ndim - len(sharding.spec))
        return jax.random.wrap_key_data(
            put_sharded(data, NamedSharding(sharding.mesh, P(*spec))), impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(read_back(x)) if isinstance(x, jax.Array) else np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def host_view(state):
    """`state` with its lengths (and page table) as host values (`host_values`), for the value
    checks and static sizes computed from them; the programs take the state itself."""
    if not resident.is_concrete(state.lengths):
        return state
    view = dataclasses.replace(state, lengths=host_values(state.lengths))
    if type(state).__name__ in TABLES:
        view = dataclasses.replace(view, table=host_values(state.table))
    return view


def _checked_tokens(tokens, check: bool):
    """Token ids to validate on the host: a global array spanning processes is read whole
    (`host_values`) when checked; otherwise the tokens as given."""
    if check and isinstance(tokens, jax.Array) and resident.is_concrete(tokens):
        return host_values(tokens) if not tokens.is_fully_addressable else tokens
    return tokens


def _host_tokens(given, tokens):
    """Token ids as given on the host (numpy int32, already range-checked by
    `prepare_tokens`) when they came from the host: numpy is split over the devices without a
    slicing program; device arrays stay on the device."""
    return tokens if isinstance(given, jax.Array) else np.asarray(given).astype(np.int32)


def hashable_rules(rules):
    """`rules` as a hashable key of the compiled-program caches (None stays None)."""
    return None if rules is None else tuple(sorted(rules.items()))


def _decode_arguments(params, state: DecodeState, tokens, *, mesh: Mesh, config: ModelConfig,
                      offload: OffloadConfig, active, check: bool, implementation: str,
                      scores: bool, rules):
    """Validate `sharded_decode_step`'s arguments: (program, positional args)."""
    tokens = given = _checked_tokens(tokens, check)
    tokens, ways = resident.prepare_tokens(tokens, state.batch, config, check=check)
    if ways > config.max_ways:
        raise ValueError(f"sharded_decode_step got W={ways} query tokens per request; config "
                         f"{config.name!r} allows 1 to max_ways={config.max_ways}")
    resident.check_live(state, "sharded_decode_step")
    implementation = offload_decode.check_implementation(implementation, False, offload)
    offload_decode.check_state(state, config=config, offload=offload)
    check_divides(state, mesh)
    active = resident.check_active(active, state.batch)
    if check and resident.is_concrete(state.lengths):
        view = host_view(state)
        taken = np.full(state.batch, ways)
        if active is not None:
            taken = np.where(np.asarray(host_values(active)), taken, 0)
        resident.check_capacity(view.lengths, taken, state.capacity, config,
                                what="the host pages'")
        check_sharded_tables(view, mesh, taken)
    statics = (("config", config), ("offload", offload), ("implementation", implementation),
               ("scores", bool(scores)))
    program = _program(mesh, _offload_decode, statics, active is not None, hashable_rules(rules))
    return program, (params, state,
                     place_batch(_host_tokens(given, tokens), LAYOUTS["tokens"], mesh, rules),
                     place_batch(active, LAYOUTS["per_request"], mesh, rules))


def sharded_decode_step(params, state: DecodeState, tokens, *, mesh: Mesh, config: ModelConfig,
                        offload: OffloadConfig, active=None, check: bool = True,
                        implementation: str | None = None, scores: bool = False, rules=None):
    """The offloaded decode step (`fo_jax.offload.decode.decode_step`), data-parallel over the
    mesh's `data` axis: (logits [B, W, V], new state, DecodeStats), all split over `data`.

    state: a DecodeState placed by `shard_state` (rank-local page ids; donated: use the
    returned one). Each rank steps its B/D requests over its own pool shard of F/D pages: the
    per-rank work and host traffic of the single-device step at batch B/D, and no
    cross-device traffic for the cache. Static checks as `decode_step`; with `check`, token
    ids, capacity and each rank's page table are validated against concrete values (reads of
    the tokens, lengths and table). active: [B] bool, as `decode_step`. implementation: as
    `decode_step` (None: by backend); only "xla" is tested under the mesh (tests/sharding/).
    """
    program, args = _decode_arguments(params, state, tokens, mesh=mesh, config=config,
                                      offload=offload, active=active, check=check,
                                      implementation=implementation, scores=scores, rules=rules)
    return program(*args)


def lower_sharded_decode_step(params, state: DecodeState, tokens, *, mesh: Mesh,
                              config: ModelConfig, offload: OffloadConfig, active=None,
                              implementation: str | None = None, rules=None):
    """The program `sharded_decode_step` runs, lowered (nothing runs, nothing is donated): for
    checks of its shardings, memory kinds and HLO."""
    program, args = _decode_arguments(params, state, tokens, mesh=mesh, config=config,
                                      offload=offload, active=active, check=False,
                                      implementation=implementation, scores=False, rules=rules)
    return program.lower(*args)


def sharded_resident_decode_step(params, state: resident.ResidentState, tokens, *, mesh: Mesh,
                                 config: ModelConfig, active=None, check: bool = True,
                                 rules=None):
    """The resident decode step (`fo_jax.resident.decode_step`, XLA), data-parallel over
    `data`: (logits [B, W, V], new state). state: a ResidentState placed by `shard_state`
    (donated); each rank holds the KV [L, B/D, S, D+R] of its requests."""
    tokens = given = _checked_tokens(tokens, check)
    tokens, ways = resident.prepare_tokens(tokens, state.batch, config, check=check)
    if ways > config.max_ways:
        raise ValueError(f"sharded_resident_decode_step got W={ways} query tokens per request,"
                         f" but config {config.name!r} allows at most "
                         f"max_ways={config.max_ways}")
    resident.check_live(state, "sharded_resident_decode_step")
    check_divides(state, mesh)
    active = resident.check_active(active, state.batch)
    num_new = np.full(state.batch, ways, np.int32)
    if active is not None:
        num_new = np.where(np.asarray(host_values(active)), num_new, 0).astype(np.int32)
    if check and resident.is_concrete(state.lengths):
        resident.check_capacity(host_values(state.lengths), num_new, state.capacity, config)
    statics = (("config", config), ("implementation", "xla"))
    program = _program(mesh, _resident_decode, statics, True, hashable_rules(rules))
    return program(params, state,
                   place_batch(_host_tokens(given, tokens), LAYOUTS["tokens"], mesh, rules),
                   place_batch(num_new, LAYOUTS["per_request"], mesh, rules))


def _batch_specs(tree, mesh: Mesh, rules, axis_of):
    """A PartitionSpec per leaf of `tree`: its batch axis (`axis_of(leaf)`, None for none) split
    over `data`, every other axis whole."""
    data = logical_spec(("batch",), mesh, rules)[0]

    def one(x):
        axis = axis_of(x)
        return P() if axis is None else P(*([None] * axis + [data]))

    return jax.tree.map(one, tree)


def _loop_specs(mesh: Mesh, rules, seats, sampling, out):
    """Specs of the decode loop's per-request pytrees: Seats and Sampling leaves are [B, ...]
    (a [] key, one for the batch, is replicated), LoopOutput's tokens [B, N], fed [B],
    per-rank step counts [D] and log-probabilities [B, N, K + 1], LoopStats [G, B, ...] or
    [B]."""
    first = lambda x: 0 if np.ndim(x) else None  # noqa: E731
    stats_axis = lambda x: 1 if np.ndim(x) >= 2 else 0  # noqa: E731
    out_specs = LoopOutput(
        tokens=_batch_specs(out.tokens, mesh, rules, first),
        fed=_batch_specs(out.fed, mesh, rules, first),
        num_steps=_batch_specs(out.num_steps, mesh, rules, first),
        stats=None if out.stats is None else _batch_specs(out.stats, mesh, rules, stats_axis),
        logprobs=_batch_specs(out.logprobs, mesh, rules, first),
        logprob_ids=_batch_specs(out.logprob_ids, mesh, rules, first))
    return (_batch_specs(seats, mesh, rules, first), _batch_specs(sampling, mesh, rules, first),
            out_specs)


@functools.lru_cache(maxsize=16)
def _loop_program(mesh: Mesh, step, n_steps: int, rules_key, logprobs: int | None = None):
    """jit(shard_map(decode loop)) for (params, state, seats, sampling): every rank runs the
    single-device loop (`fo_jax.decode_loop.loop_jit`, with `logprobs`) on its requests, its
    while_loop ending when its own requests are done (all-to-all layout: when every rank's
    are); the state is donated and keeps its shardings."""
    rules = dict(rules_key) if rules_key is not None else None

    offloaded = isinstance(step, decode_loop.OffloadedStep)
    together = DATA if experts_over_data(mesh, rules) else None

    def body(params, state, seats, sampling, together=together):
        out, state, seats = decode_loop.loop_jit(
            dispatching(params, mesh, rules), state, seats, sampling, n_steps=n_steps,
            step=step, logprobs=logprobs, together=together)
        # The values every rank holds alike (the step counter, the random policy's key) may
        # differ here: each rank left its loop after its own number of steps.
        counters = (state.step[None], state.policy.key[None]) if offloaded else ()
        return dataclasses.replace(out, num_steps=out.num_steps[None]), state, seats, counters

    def run(params, state, seats, sampling):
        # Shapes only, outside the shard_map (no mesh axis to sum the ranks' flags over).
        shapes = jax.eval_shape(functools.partial(body, together=None), params, state, seats,
                                sampling)
        seat_specs, sampling_specs, out_specs = _loop_specs(mesh, rules, seats, sampling,
                                                            shapes[0])
        state_specs = specs(state, mesh, rules)
        per_rank = jax.tree.map(lambda _: logical_spec(("batch",), mesh, rules), shapes[3])
        out, new_state, new_seats, counters = data_parallel(
            body, mesh, (step_param_specs(params, mesh, rules), state_specs, seat_specs,
                         sampling_specs),
            (out_specs, state_specs, seat_specs, per_rank))(params, state, seats, sampling)
        # The call took as many steps as its busiest rank (the ranks run side by side); every
        # rank's step counter and random-policy key become the busiest rank's: what its own
        # loop would hold after inactive steps up to that count (an inactive step changes
        # nothing else), so the replicated values stay equal on every rank.
        busiest = jnp.argmax(out.num_steps)
        if offloaded:
            steps, keys = counters
            new_state = dataclasses.replace(
                new_state, step=steps[busiest],
                policy=dataclasses.replace(new_state.policy, key=keys[busiest]))
        new_state = jax.tree.map(jax.lax.with_sharding_constraint, new_state,
                                 shardings(state, mesh, rules))
        return (dataclasses.replace(out, num_steps=out.num_steps[busiest]), new_state,
                new_seats)

    return jax.jit(run, donate_argnums=(1,))


def sharded_decode_loop(params, state, seats, n_steps: int, sampling, *, mesh: Mesh, step,
                        rules=None, logprobs: int | None = None):
    """`fo_jax.decode_loop.decode_loop`, data-parallel over `data`: up to `n_steps` decode steps
    with on-device sampling in one program, each rank looping over its B/D requests and its
    pool shard (offloaded) or KV shard (resident) and leaving its loop when its own requests
    are done (no collective inside the loop; under `ALL_TO_ALL_RULES` the MoE layers'
    all-to-alls, and the ranks leave together when all are done). (LoopOutput, new state,
    new seats), split over
    `data`; `num_steps` is the busiest rank's, and so are the state's step counter and random
    policy key (values every rank holds alike: each rank's are what its loop would hold after
    inactive steps up to that count). state: placed by `shard_state` (donated); seats, sampling: as
    `decode_loop` (numpy or jax arrays; split over `data` here). step: `OffloadedStep` or
    `ResidentStep`, XLA implementation. logprobs: as `decode_loop` (K, or None: none computed;
    `LoopOutput.logprobs` / `logprob_ids` [B, N, K + 1] split over `data`). Each rank's tokens,
    log-probabilities, stats and state are bit for bit those of `decode_loop` run on its
    requests alone, followed by inactive steps up to the busiest rank's count (tests/sharding/,
    tests/engine/sharded_engine_cases.py)."""
    if (not isinstance(n_steps, numbers.Integral) or isinstance(n_steps, bool)
            or n_steps < 1):
        raise ValueError(f"n_steps={n_steps!r} must be an int >= 1 (decode steps per call)")
    if not isinstance(step, (decode_loop.OffloadedStep, decode_loop.ResidentStep)):
        raise ValueError(f"step must be an OffloadedStep or a ResidentStep, got "
                         f"{type(step).__name__}")
    if step.implementation != "xla":
        raise ValueError(f"sharded_decode_loop runs the XLA step; got implementation="
                         f"{step.implementation!r}: build the step with implementation='xla'")
    resident.check_live(state, "sharded_decode_loop")
    step.check_state(state)
    check_divides(state, mesh)
    for name, value in (("seats", seats.batch), ("sampling", sampling.batch)):
        if value != state.batch:
            raise ValueError(f"{name} hold {value} requests but the state holds "
                             f"{state.batch}: build them for the same batch")
    check_keys(seats.keys, state.batch)
    check_logprobs(logprobs, step.config)
    program = _loop_program(mesh, step, int(n_steps), hashable_rules(rules),
                            None if logprobs is None else int(logprobs))
    seat_specs, sampling_specs, _ = _loop_specs(
        mesh, rules, seats, sampling, decode_loop.LoopOutput(None, None, None, None))
    place = lambda tree, tree_specs: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, tree_specs)
    return program(params, state, place(seats, seat_specs), place(sampling, sampling_specs))


def sharded_prefill(params, state, tokens, num_new=None, *, mesh: Mesh, config: ModelConfig,
                    num_buffers: int | None = None, distance: int | None = None,
                    history_pages: int | None = None, check: bool = True,
                    host_access: str | None = None, query_block: int | None = None, rules=None):
    """The offloaded prefill (`fo_jax.offload.prefill.prefill`), data-parallel over `data`:
    (logits [B, T, V], new PrefillState). state: a PrefillState placed by `shard_state`
    (rank-local page ids; donated). Each rank runs the layer buffers [n, B/D, S, D+R] of its
    requests and reads and writes only its own pool shard; `history_pages` (default from the
    longest history of the whole batch) is one static size for all ranks: one program."""
    resident.check_live(state, "sharded_prefill")
    check_divides(state, mesh)
    tokens = given = _checked_tokens(tokens, check)
    view = host_view(state)  # the static sizes (history_pages) from the whole batch
    args, static = offload_prefill.prefill_arguments(
        params, view, tokens, host_values(num_new), config=config, num_buffers=num_buffers,
        distance=distance, onload_layer_map=None, dense=False, history_pages=history_pages,
        poison=False, check=False, host_access=host_access, query_block=query_block)
    _, _, tokens, num_new = args
    num_new = host_values(num_new)
    if check:
        resident.check_token_values(tokens, config)
        if resident.is_concrete(state.lengths):
            if np.any(np.asarray(num_new) > tokens.shape[1]):
                raise ValueError(f"num_new={np.asarray(num_new).tolist()} exceeds the chunk "
                                 f"width {tokens.shape[1]}")
            resident.check_capacity(view.lengths, num_new, state.capacity, config)
            check_sharded_tables(view, mesh, np.asarray(num_new))
    program = _program(mesh, _offload_prefill, tuple(sorted(static.items())), True,
                       hashable_rules(rules))
    return program(params, state,
                   place_batch(_host_tokens(given, tokens), LAYOUTS["tokens"], mesh, rules),
                   place_batch(np.asarray(num_new), LAYOUTS["per_request"], mesh, rules))


@functools.lru_cache(maxsize=16)
def _handoff_program(mesh: Mesh, chunk: int, on_host: bool, access: str):
    """jit(shard_map) of the prefill -> decode handoff's two passes, per rank: the key pool's
    unstored rows cleared, the hot and tail rows gathered from the rank's own host pages."""
    batch, frames = P(DATA), P(None, DATA)

    def body(host_kv, index_keys, table, lengths, row_tok, key_fill, row_fill):
        keys = offload_prefill.clear_unstored(index_keys, table, lengths, key_fill)
        hot = offload_prefill.gather_hot(host_kv, table, row_tok, row_fill, chunk=chunk,
                                         on_host=on_host, access=access)
        return keys, hot

    return jax.jit(data_parallel(body, mesh, (frames, frames, batch, batch, batch, P(), P()),
                                  (frames, P(None, DATA))))


def sharded_to_decode_state(state, *, mesh: Mesh, config: ModelConfig,
                            offload: OffloadConfig, fill: float = 0.0,
                            rules=None) -> DecodeState:
    """`fo_jax.offload.prefill.to_decode_state` of a sharded PrefillState: the same DecodeState,
    sharded (rank-local page ids kept), each rank gathering the hot and tail rows
    [L, B/D, C + 2Z, D+R] of its requests from its own host pages. The host pages are handed
    over as they are (the first decode step donates them)."""
    offload.validate_for(config)
    resident.check_live(state, "sharded_to_decode_state")
    if (offload.page_size, offload.capacity) != (state.page_size, state.capacity):
        raise ValueError(
            f"offload page_size={offload.page_size}, capacity={offload.capacity} must equal the "
            f"prefill state's page_size={state.page_size}, capacity={state.capacity}: the host "
            "pages are handed over as they are")
    check_divides(state, mesh)
    view = host_view(state)
    lengths = np.asarray(view.lengths).astype(np.int32)
    check_sharded_tables(view, mesh, np.zeros_like(lengths))
    row_tok, slots, policy = offload_prefill.initial_layout(config, offload, lengths)
    program = _handoff_program(mesh, offload.miss_chunk,
                               state.host.kv.sharding.memory_kind not in (None, "device"),
                               offload.host_access)
    place = lambda x: place_batch(x, LAYOUTS["per_request"] + (None,), mesh, rules)  # noqa: E731
    scalar = lambda x, dtype: put_sharded(np.asarray(x, dtype),  # noqa: E731
                                          NamedSharding(mesh, P()))
    rows = state.host.kv.dtype  # the KV rows' own fill: bytes for fp8_ds_mla rows (`kv_fill`)
    keys, hot = program(state.host.kv, state.index_keys, state.table, state.lengths,
                        place(row_tok), scalar(fill, state.index_keys.dtype),
                        scalar(kv_fill(fill, rows), rows))
    out = DecodeState(host=state.host, table=state.table, hot=hot, index_keys=keys,
                      slots=slots, policy=policy, lengths=state.lengths,
                      step=np.asarray(1, np.int32))
    placed = shardings(out, mesh, rules)
    # The maps and policy state were built on this host from the whole batch's lengths
    # (alike on every process): each process places its own devices' shards.
    return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s
                        else put_sharded(x, s), out, placed)


class DataParallelOffloadEngine(batch_engines.OffloadEngine):
    """`fo_jax.batch_engines.OffloadEngine` data-parallel over a mesh's `data` axis: the
    prefill, the handoff and every decode step run on each rank's B/D requests and pool shard
    (`sharded_prefill`, `sharded_to_decode_state`, `sharded_decode_step`, and
    `sharded_decode_loop` for decode_steps_per_call > 1). XLA implementation; no drafts, no
    debug checks. rules: `fo_jax.sharding`'s (None: `RULES`; `ALL_TO_ALL_RULES` with params
    placed by them: the MoE experts split over the data ranks, rows exchanged by
    all-to-all)."""

    def __init__(self, params, config: ModelConfig, *, mesh: Mesh, offload: OffloadConfig,
                 batch: int, num_buffers: int | None = None,
                 prefill_chunk: int | None = batch_engines.PREFILL_CHUNK, rules=None):
        super().__init__(params, config, offload=offload, batch=batch, implementation="xla",
                         num_buffers=num_buffers, prefill_chunk=prefill_chunk)
        if batch % data_size(mesh):
            raise ValueError(f"batch={batch} must be a multiple of the data axis size "
                             f"{data_size(mesh)} (every device runs batch / devices requests)")
        self.mesh = mesh
        self.rules = rules

    def prefill(self, tokens, lengths, *, hidden: bool = False):
        if hidden:
            raise NotImplementedError("the data-parallel engine returns no hidden states "
                                      "(MTP drafts run on one device)")
        oc = self.offload
        state = shard_state(offload_prefill.PrefillState.create(
            self.config, batch=self.batch, capacity=oc.capacity, page_size=oc.page_size,
            memory_kind=oc.host_memory_kind), self.mesh, self.rules)

        def run(chunk, num_new):
            nonlocal state
            logits, state = sharded_prefill(self.params, state, chunk, num_new, mesh=self.mesh,
                                            config=self.config, num_buffers=self.num_buffers,
                                            host_access=oc.host_access,
                                            query_block=offload_prefill.QUERY_BLOCK,
                                            rules=self.rules)
            return logits

        last = batch_engines.chunked_prefill(run, tokens, lengths, self.prefill_chunk)
        self.state = sharded_to_decode_state(state, mesh=self.mesh, config=self.config,
                                             offload=oc, rules=self.rules)
        self.totals = None
        self._start(lengths)
        return last

    def rollback(self, keep) -> None:
        raise NotImplementedError("the data-parallel engine does not verify drafts (no "
                                  "rollback): generate without a drafter (drafter=None)")

    def decode(self, seats, n_steps: int, sampling):
        """Up to `n_steps` decode steps with on-device sampling in one data-parallel program
        (`sharded_decode_loop`): (LoopOutput, new seats), as `OffloadEngine.decode`."""
        if self._lengths is None:
            raise ValueError(f"{type(self).__name__}.decode before prefill: prefill a batch "
                             "first")
        out, self.state, seats = sharded_decode_loop(self.params, self.state, seats, n_steps,
                                                     sampling, mesh=self.mesh,
                                                     step=self.loop_step(), rules=self.rules)
        self._before = None  # nothing to roll back: a loop's tokens are kept
        self._pending = self._pending + (out,)
        self._add_stats(out.stats)
        return out, seats

    def step(self, tokens, *, drop_past_capacity: bool = False, hidden: bool = False):
        if hidden:
            raise NotImplementedError("the data-parallel engine returns no hidden states")
        ways = self._check_room(tokens, drop_past_capacity)
        logits, self.state, stats = sharded_decode_step(
            self.params, self.state, tokens, mesh=self.mesh, config=self.config,
            offload=self.offload, check=False, rules=self.rules)
        self._stepped(ways)
        self._add_stats(stats)
        return logits

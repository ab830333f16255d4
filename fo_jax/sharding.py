"""Many devices: mesh axes and the logical -> mesh sharding rules (the data-parallel steps that
use them are `fo_jax.sharded_steps`).

    mesh = make_mesh(8)                                  # axes (data, model, expert) = (8, 1, 1)
    state = shard_state(state, mesh)             # DecodeState, PrefillState or ResidentState
    params = shard_params(params, mesh)                  # replicated unless model / expert > 1

Mesh axes: `data` splits requests (the batch B) and the page pools (the frame axis F); `model`
and `expert` split weights (attention heads and the vocabulary over `model`, MoE experts over
`expert`); both have size 1 unless asked for, so weights are replicated by default. An FP8
weight (`fo_jax.model.linear.Fp8Weight`: e4m3 values and float32 block scales) is split as the
weight it stands for, its block scales along the same axes (a device holds the scales of its own
blocks); a mesh whose split would leave part of a block on a device is refused
(`check_fp8_split`) before anything is placed.
`ALL_TO_ALL_RULES` split the MoE experts over `data` instead: every rank holds its own requests
and pool and 1/D of the experts, and the MoE layers exchange rows by all-to-all
(`expert_mesh(n, expert=n)`: the mesh and rules of that layout).

`LAYOUTS` names the logical axes of every array of every state (decode, prefill, resident, the
decode stats) and of the weights; `RULES` maps logical axes to mesh axes. These two tables are
the only place that knows where the batch axis of an array is (axis 1 of the per-request caches
and maps, axis 0 of `lengths` and of the page table; none for `step` and the random policy's
key, which every rank holds and advances alike) and which arrays live in host memory (the host
pages, `HOST_ARRAYS`: sharded like the rest, with the state's memory kind, `pinned_host`).

One host pool per data-parallel rank (as vLLM's HiSparse keeps one per replica): rank r holds
frames [r F/D, (r + 1) F/D) of the host KV [L, F, Z, D+R] and of the indexer-key pool
[G, F, Z, N], and seats [r B/D, (r + 1) B/D). A sharded state's page table holds rank-local
frame ids (frame f of rank r is global frame r F/D + f): inside the step each rank sees only its
own pool shard and table rows, so its misses, host reads, write-through and page management
never leave it. `shard_state` converts a single-device state's global ids into local ones (and
refuses a table whose seat names a frame of another rank's shard); `unshard_state` converts back.

    make_mesh, logical_spec, specs, shardings, param_specs, check_fp8_split,
    shard_params, step_param_specs, experts_over_data, expert_mesh        placement
    shard_state, unshard_state, local_table, global_table,
    check_sharded_tables, check_divides, host_values                      states
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fo_jax.model.linear import Fp8Weight, is_fp8
from fo_jax.model.moe import EXPERT_AXIS
from fo_jax.offload.host import memory_kind
from fo_jax.offload.state import DecodeState, check_table, check_table_covers, read_back

DATA, MODEL, EXPERT = "data", "model", EXPERT_AXIS
MESH_AXES = (DATA, MODEL, EXPERT)

# Logical axis -> mesh axis (absent or None: replicated).
RULES = {
    "batch": DATA,     # requests: seats of caches, maps, tables, lengths, tokens, logits
    "frames": DATA,    # pages of the host KV pool and of the indexer-key pool
    "heads": MODEL,    # attention heads (weights)
    "vocab": MODEL,    # embedding and output head rows / columns
    "experts": EXPERT,  # MoE routed experts
}
# Data-parallel attention with expert-parallel MoE on the same devices: the routed experts are
# split over `data` too, so every data rank holds its own requests, KV and host pool and 1/D
# of the experts; each MoE layer sends (token, expert) rows to the experts' owners and back by
# all-to-all (`fo_jax.model.moe.moe_all_to_all`). With RULES (the experts over `expert`) a
# data rank's tokens and attention are replicated over its `expert` devices instead.
ALL_TO_ALL_RULES = {**RULES, "experts": DATA}
EXPERT_LAYOUTS = ("all-to-all", "replicated")

# Logical axes of every array, by pytree type and field path (None: an axis no rule shards).
LAYOUTS = {
    "DecodeState": {
        "host.kv": (None, "frames", None, None),             # [L, F, Z, D+R] host memory
        "table": ("batch", None),                             # [B, P]
        "hot": (None, "batch", None, None),                   # [L, B, C+2Z, D+R]
        "index_keys": (None, "frames", None, None),           # [G, F, Z, N]
        "slots.token_to_slot": (None, "batch", None),         # [G, B, S]
        "slots.slot_to_token": (None, "batch", None),         # [G, B, C]
        "policy.stamp": (None, "batch", None),                # [G, B, C]
        "policy.hand": (None, "batch"),                       # [G, B]
        "policy.last_used": (None, "batch", None),            # [G, B, C] or [G, B, 0]
        "policy.ref": (None, "batch", None),                  # [G, B, C] or [G, B, 0]
        "policy.key": (None,),                                # [2] uint32, every rank alike
        "lengths": ("batch",),                                # [B]
        "step": (),                                           # []
    },
    "PrefillState": {
        "host.kv": (None, "frames", None, None),              # [L, F, Z, D+R] host memory
        "table": ("batch", None),                             # [B, P]
        "index_keys": (None, "frames", None, None),           # [G, F, Z, N]
        "lengths": ("batch",),                                # [B]
    },
    "ResidentState": {
        "kv": (None, "batch", None, None),                    # [L, B, S, D+R]
        "index_keys": (None, "batch", None, None),            # [G, B, S, N]
        "lengths": ("batch",),                                # [B]
    },
    "DecodeStats": {
        "hits": (None, "batch", None),                        # [G, B, W]
        "tail_hits": (None, "batch", None),
        "misses": (None, "batch", None),
        "union": (None, "batch"),                             # [G, B]
        "h2d_bytes": ("batch",),                              # [B]
        "d2h_bytes": ("batch",),
        "selected": (None, "batch", None, None),              # [G, B, W, K]
        "scores": (None, "batch", None, None),                # [G, B, W, S]
    },
    "tokens": ("batch", None),                                # [B, T]
    "per_request": ("batch",),                                # [B]: num_new, active
    "logits": ("batch", None, None),                          # [B, T, V] (V whole per rank)
    "hidden": ("batch", None, None),                          # [B, T, E]
    # Weights (fo_jax.model.dsa.init_params names); every other weight is replicated. An FP8
    # weight's values [..., I, O] and block scales [..., I / bI, O / bO] both take its entry.
    "params": {
        "embed": ("vocab", None),                             # [V, E]
        "head": (None, "vocab"),                              # [E, V]
        "layers.wq_b": (None, None, "heads"),                 # [L, q_lora, H (dn + dr)]
        "layers.wkv_b": (None, None, "heads"),                # [L, kv_lora, H (dn + dv)]
        "layers.wo": (None, "heads", None),                   # [L, H dv, E]
        # moe.gate [L', E, X] and gate_bias [L', X] are replicated: routing needs all X
        # scores of a token on every device (an expert-parallel step splits only the experts).
        "moe.w1": (None, "experts", None, None),              # [L', X, E, F']
        "moe.w2": (None, "experts", None, None),              # [L', X, F', E]
        "moe.w3": (None, "experts", None, None),              # [L', X, E, F']
    },
}

# Arrays in host memory (they keep the state's memory kind, `pinned_host` for real offload).
HOST_ARRAYS = {("DecodeState", "host.kv"), ("PrefillState", "host.kv")}
# Arrays indexed by rank-local frame ids in a sharded state.
TABLES = {"DecodeState", "PrefillState"}


# Meshes -----------------------------------------------------------------------------------------


def make_mesh(num_devices: int | None = None, *, model: int = 1, expert: int = 1,
              devices=None) -> Mesh:
    """A mesh of `num_devices` devices (default all) with axes (data, model, expert) of sizes
    (num_devices / (model expert), model, expert).

    On a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before jax starts)
    simulates 8 devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    num_devices = len(devices) if num_devices is None else num_devices
    if not isinstance(num_devices, int) or not 1 <= num_devices <= len(devices):
        raise ValueError(f"num_devices={num_devices!r} must be in [1, {len(devices)}] (the "
                         "devices jax sees; on a CPU set XLA_FLAGS=--xla_force_host_platform_"
                         "device_count=N before jax starts to simulate N)")
    if model < 1 or expert < 1 or num_devices % (model * expert):
        raise ValueError(f"{model=} x {expert=} must divide {num_devices=} (the data axis gets "
                         "the rest)")
    shape = (num_devices // (model * expert), model, expert)
    return Mesh(np.asarray(devices[:num_devices], dtype=object).reshape(shape), MESH_AXES)


def expert_mesh(num_devices: int, *, expert: int, layout: str = "all-to-all",
                devices=None) -> tuple[Mesh, dict]:
    """(mesh, rules) of `num_devices` devices with the MoE experts split over `expert` of them.

    layout "all-to-all": attention data-parallel on every device and the experts split over
    the same devices (`ALL_TO_ALL_RULES`; a mesh of data = num_devices, so `expert` must be
    num_devices); "replicated": `make_mesh(num_devices, expert=expert)` with `RULES` (a data
    rank's tokens, cache and attention replicated over its `expert` devices, one all-reduce of
    expert rows per MoE layer)."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {EXPERT_LAYOUTS}")
    if layout == "replicated":
        return make_mesh(num_devices, expert=expert, devices=devices), dict(RULES)
    if expert != num_devices:
        raise ValueError(f"the all-to-all expert layout splits the experts over every device "
                         f"(each holds its own requests and 1/{num_devices} of the experts): "
                         f"expert={expert} must equal num_devices={num_devices}, or use the "
                         "replicated layout for experts over a part of the devices")
    return make_mesh(num_devices, devices=devices), dict(ALL_TO_ALL_RULES)


def data_size(mesh: Mesh) -> int:
    """Data-parallel ranks D of `mesh`."""
    return int(mesh.shape[DATA])


def logical_spec(axes, mesh: Mesh, rules=None) -> P:
    """The PartitionSpec of an array with logical axes `axes` (one name or None per axis) on
    `mesh`: each axis goes to its rule's mesh axis, if `mesh` has that axis; trailing
    unsharded axes are left out."""
    rules = RULES if rules is None else rules
    names = [rules.get(a) if a is not None and rules.get(a) in mesh.axis_names else None
             for a in axes]
    while names and names[-1] is None:  # the form jit gives its outputs: P(None, 'data')
        names.pop()  # (P(None, 'data', None) would be another jit cache entry: a recompile)
    return P(*names)


def _names(path) -> str:
    """'host.kv' for the pytree path of state.host.kv, 'layers.wo' for params['layers']['wo']."""
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def _layout(kind: str, name: str):
    table = LAYOUTS[kind]
    if name not in table:
        raise ValueError(f"{kind}.{name} has no entry in fo_jax.sharding.LAYOUTS: add its "
                         "logical axes there")
    return table[name]


def specs(tree, mesh: Mesh, rules=None):
    """PartitionSpecs of every array of a DecodeState, PrefillState, ResidentState or
    DecodeStats (the same pytree with a PartitionSpec per leaf), from LAYOUTS and RULES."""
    kind = type(tree).__name__
    if kind not in LAYOUTS:
        raise ValueError(f"no layout for {kind}: expected one of DecodeState, PrefillState, "
                         "ResidentState, DecodeStats")
    return jax.tree_util.tree_map_with_path(
        lambda path, x: logical_spec(_layout(kind, _names(path)), mesh, rules), tree)


def shardings(tree, mesh: Mesh, rules=None):
    """NamedShardings of every array of a state (see `specs`); host pages keep their memory
    kind (`pinned_host`), everything else is in device memory. An empty array (the policy
    fields a policy does not use, [G, B, 0]) is replicated: jit returns it so whatever it is
    given, and a step's output must be placed as its input to reuse the compiled program."""
    kind = type(tree).__name__

    def one(path, x, spec):
        if 0 in np.shape(x):
            spec = P()
        memory = None
        if (kind, _names(path)) in HOST_ARRAYS:
            memory = memory_kind(x) or "pinned_host"  # arrays and tracers alike
        return NamedSharding(mesh, spec, memory_kind=memory)

    return jax.tree_util.tree_map_with_path(one, tree, specs(tree, mesh, rules))


def param_specs(params, mesh: Mesh, rules=None):
    """PartitionSpecs of the weights: LAYOUTS["params"] by name, the rest replicated.

    An FP8 weight (`fo_jax.model.linear.Fp8Weight`) gets an Fp8Weight of two specs, both the
    spec of the weight it stands for: its e4m3 values q [..., I, O] split as that weight, its
    block scales [..., I / bI, O / bO] split along the same axes, so a device holds the scales
    of exactly the blocks it holds. Raises ValueError, before anything is placed, for a split
    axis its mesh axis does not divide, and for an FP8 weight whose split would cut a scale
    block (an I or O per device that is not a multiple of bI or bO: `check_fp8_split`)."""
    table = LAYOUTS["params"]

    def one(path, x):
        name = _names(path)
        spec = logical_spec(table.get(name, (None,) * len(np.shape(x))), mesh, rules)
        for size, axis in zip(np.shape(x), spec):
            if axis is not None and size % mesh.shape[axis]:
                raise ValueError(f"weight {name} {tuple(np.shape(x))} cannot be split over "
                                 f"mesh axis {axis!r} of size {mesh.shape[axis]}: use a mesh "
                                 "whose axis size divides it, or map its logical axis to None "
                                 "in the rules")
        if is_fp8(x):
            check_fp8_split(name, x, spec, mesh)
            return dataclasses.replace(x, q=spec, scale_inv=spec)
        return spec

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_fp8)


def check_fp8_split(name: str, w: Fp8Weight, spec: P, mesh: Mesh) -> None:
    """Raise ValueError when `spec` splits the in or out axis of the FP8 weight `w` so that a
    device's part is not a whole number of its scale blocks (bI or bO values): its block scales
    could not be split with it. The error names the weight, the axis, the mesh axis and its
    devices, and the device counts that would leave whole blocks."""
    shape, ndim = w.shape, w.ndim
    for axis_index, block, what in ((ndim - 2, w.block[0], "in"), (ndim - 1, w.block[1], "out")):
        axis = spec[axis_index] if axis_index < len(spec) else None
        if axis is None:
            continue
        size, devices = shape[axis_index], int(mesh.shape[axis])
        if (size // devices) % block == 0:
            continue
        blocks = size // block if size % block == 0 else 0  # a partial last block: no split
        whole = [n for n in range(1, blocks + 1) if blocks % n == 0] or [1]
        raise ValueError(
            f"FP8 weight {name} {tuple(shape)}: splitting its {what} axis ({size} values, "
            f"scale blocks of {block}) over mesh axis {axis!r} of {devices} devices gives "
            f"{size // devices} values per device, not a whole number of blocks: the block "
            f"scales cannot be split with it. Use a mesh whose {axis!r} axis has one of "
            f"{whole} devices, or map its logical axis to None in the rules (replicated)")


# Weights a data-parallel step keeps split inside its shard_map (when the rules put their
# "experts" axis on the mesh's `expert` axis): the MoE experts (`fo_jax.model.moe.moe_mlp` runs
# expert-parallel on a slice of them). Every other weight is gathered at the step's entry.
EXPERT_PARALLEL = ("moe.w1", "moe.w2", "moe.w3")


def experts_over_data(mesh: Mesh, rules=None) -> bool:
    """Whether `rules` split the MoE experts over the `data` axis of `mesh` (of size > 1):
    the all-to-all layout (`ALL_TO_ALL_RULES`)."""
    rules = RULES if rules is None else rules
    return rules.get("experts") == DATA and data_size(mesh) > 1


def step_param_specs(params, mesh: Mesh, rules=None):
    """PartitionSpecs of the weights inside a data-parallel step's shard_map: the MoE experts
    (`EXPERT_PARALLEL`) split over `expert` (or over `data`, `ALL_TO_ALL_RULES`) as
    `param_specs` stores them, when the rules map them there (to any other mesh axis, or with
    that axis of size 1: whole); every other weight whole (replicated: those stored split over
    `model` are gathered at the step's entry). An FP8 weight's values and block scales alike
    (an Fp8Weight of two specs)."""
    stored = param_specs(params, mesh, rules)
    kept = {None, DATA} if experts_over_data(mesh, rules) else {None, EXPERT}

    def one(path, spec):
        inner = spec.q if is_fp8(spec) else spec
        if not (_names(path) in EXPERT_PARALLEL and set(inner) <= kept):
            inner = P()
        return dataclasses.replace(spec, q=inner, scale_inv=inner) if is_fp8(spec) else inner

    return jax.tree_util.tree_map_with_path(
        one, stored, is_leaf=lambda s: isinstance(s, P) or is_fp8(s))


def shard_params(params, mesh: Mesh, rules=None):
    """The weights placed on `mesh` by the rules (replicated where the mesh's model / expert
    axes have size 1). With a mesh spanning processes every process passes the same weights
    (not checked) and places its own devices' shards from its copy (nothing crosses
    processes)."""
    def put(x, spec):
        placed = NamedSharding(mesh, spec)
        if placed.is_fully_addressable:
            return jax.device_put(x, placed)
        host = np.asarray(read_back(x))
        return jax.make_array_from_callback(host.shape, placed, lambda index: host[index])

    return jax.tree.map(put, params, param_specs(params, mesh, rules))


# States ----------------------------------------------------------------------------------------


def check_divides(state, mesh: Mesh) -> int:
    """The data axis size D, after checking that it divides the batch and the pool (every rank
    holds B / D seats and F / D pages)."""
    ranks = data_size(mesh)
    batch = state.lengths.shape[0]
    if batch % ranks:
        raise ValueError(f"batch B={batch} must be a multiple of the data axis size {ranks} "
                         "(every rank holds B / D seats): pad the batch with inactive seats")
    if type(state).__name__ in TABLES and state.host.kv.shape[1] % ranks:
        raise ValueError(f"the pool has F={state.host.kv.shape[1]} pages, not a multiple of the "
                         f"data axis size {ranks} (every rank holds F / D pages)")
    return ranks


def local_table(table, *, num_frames: int, ranks: int) -> np.ndarray:
    """[B, P] rank-local frame ids of a global page table (ids of the whole pool of F pages):
    seat b of rank r = b // (B / D) must name only frames [r F/D, (r + 1) F/D)."""
    ids = np.asarray(table)
    per_rank, frames = ids.shape[0] // ranks, num_frames // ranks
    rank = (np.arange(ids.shape[0]) // per_rank)[:, None]
    own = (ids < 0) | (ids // frames == rank)
    if not own.all():
        b, p = np.argwhere(~own)[0]
        raise ValueError(f"page table entry [{b}, {p}] = {ids[b, p]} names a frame of rank "
                         f"{ids[b, p] // frames}'s pool shard, but seat {b} belongs to rank "
                         f"{b // per_rank} (frames [{rank[b, 0] * frames}, "
                         f"{(rank[b, 0] + 1) * frames})): give each seat pages of its own "
                         "rank's shard")
    return np.where(ids >= 0, ids - rank * frames, -1).astype(np.int32)


def global_table(table, *, num_frames: int, ranks: int) -> np.ndarray:
    """[B, P] global frame ids of a sharded state's rank-local table (`local_table` undone)."""
    ids = np.asarray(table)
    per_rank, frames = ids.shape[0] // ranks, num_frames // ranks
    rank = (np.arange(ids.shape[0]) // per_rank)[:, None]
    return np.where(ids >= 0, ids + rank * frames, -1).astype(np.int32)


def shard_state(state, mesh: Mesh, rules=None):
    """A single-device DecodeState, PrefillState or ResidentState placed on `mesh`: every array
    with its NamedSharding (`shardings`), the page table converted to rank-local frame ids
    (`local_table`; O(B P) host work). The arrays are copied through host memory (a one-off
    O(state) copy; the input state is left as it was). Raises ValueError when B or F is not a
    multiple of the data axis size, or when a seat names a frame of another rank's pool
    shard."""
    ranks = check_divides(state, mesh)
    if type(state).__name__ in TABLES:
        state = dataclasses.replace(state, table=jnp.asarray(
            local_table(state.table, num_frames=state.host.kv.shape[1], ranks=ranks)))
    # Through numpy: the sharded state owns its buffers (stepping, hence donating, the input
    # later deletes nothing of it), and no slicing program is compiled per array shape.
    return jax.tree.map(lambda x, s: jax.device_put(read_back(x), s), state,
                        shardings(state, mesh, rules))


def unshard_state(state, mesh: Mesh):
    """A sharded state back on one device (the first), with global frame ids: for debug
    reads, invariants and comparisons. O(every array): debug only."""
    device = jax.devices()[0]

    def one(x):
        kind = getattr(x.sharding, "memory_kind", None)
        if kind not in (None, "device"):  # host arrays move through device memory (read_back)
            x = jax.device_put(x, x.sharding.with_memory_kind("device"))
            return jax.device_put(jax.device_put(x, device),
                                  jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
        return jax.device_put(x, device)

    out = jax.tree.map(one, state)
    if type(state).__name__ in TABLES:
        table = global_table(out.table, num_frames=out.host.kv.shape[1],
                             ranks=data_size(mesh))
        out = dataclasses.replace(out, table=jax.device_put(jnp.asarray(table), device))
    return out


def check_sharded_tables(state, mesh: Mesh, num_new) -> None:
    """Value checks of a sharded state's rank-local page tables (a read of the [B, P] table and
    the lengths): each rank's rows are a valid table of its own pool shard that holds the pages
    the next `num_new` [B] tokens need (`fo_jax.offload.state.check_table`)."""
    ranks = data_size(mesh)
    ids, lengths = np.asarray(host_values(state.table)), np.asarray(host_values(state.lengths))
    per_rank, frames = ids.shape[0] // ranks, state.host.kv.shape[1] // ranks
    for r in range(ranks):
        rows = slice(r * per_rank, (r + 1) * per_rank)
        try:
            check_table(ids[rows], batch=per_rank, num_pages=ids.shape[1], num_frames=frames,
                        lengths=lengths[rows], page_size=state.host.page_size)
            check_table_covers(ids[rows], lengths[rows] + np.asarray(num_new)[rows],
                               state.host.page_size)
        except ValueError as err:
            raise ValueError(f"data-parallel rank {r} (seats {rows.start}..{rows.stop - 1}, "
                             f"rank-local frame ids): {err}") from None


def host_values(x):
    """The values of a small array (lengths, page table, token ids, flags) on this host. A
    global array of a mesh spanning processes has rows no process holds: every process's rows
    are gathered to every process (`process_allgather`: a collective, made by every process at
    the same point, since every process runs the same calls). O(array) host traffic."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x if x is None or isinstance(x, np.ndarray) else np.asarray(x)

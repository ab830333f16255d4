"""Mixture-of-experts MLP of DeepSeek-V3.2 / GLM-5, with its dense-mask reference.

Routing (`route`; the DeepSeek-V3.2 reference `Gate` with sigmoid scores):

    scores = sigmoid(h @ gate)                      [N, X] float32 (N tokens, X experts)
    biased = scores + gate_bias                     (e_score_correction_bias: selection only)
    n_group > 1: a group's score is the sum of its two best biased scores; experts outside the
        topk_group best groups get -inf
    experts = top-k(biased)                         [N, K'] (K' = num_experts_per_tok)
    weights = scores[experts]  (/ their sum if norm_topk_prob)  * routed_scaling_factor

Ties go to the lower index (group or expert), in `route` (`jax.lax.top_k`) and in the reference
(stable sort) alike.

Experts (`moe_mlp`): each routed expert is a SwiGLU of width M = moe_hidden; a token's output is
sum_k weights[k] * expert_{experts[k]}(h) in float32, plus the shared experts' SwiGLU (width
n_shared_experts * M), cast back to h's dtype. `moe_mlp` sorts the N * K' (token, expert) pairs
by expert and runs the expert matmuls over the sorted rows, as `jax.lax.ragged_dot` (GPU, TPU:
XLA's grouped matmul) or as a loop over row tiles of one expert each (CPU, where XLA expands
ragged_dot into a dense product over all experts): compute scales with tokens x top-k, not
with X.
`moe_mlp_reference` runs every expert on every token with dense masks (X times the work; tests).

Expert parallelism, two ways (inside a `shard_map`; `fo_jax.sharded_steps` sets them up):
  * replicated tokens (p holds a slice of the experts, the tokens are alike on every device of
    `EXPERT_AXIS`): every device computes its experts' rows, one all-reduce joins them;
  * all-to-all (p is an `AllToAllExperts`: the tokens *and* the experts are split over its
    axis, every device holding its own requests): each device sends every (token, expert) row
    to the device owning the expert and gets the outputs back, two all-to-alls of rows (and one
    of expert ids) per layer, buffers sized so that no row is ever dropped (`moe_all_to_all`).

Parameters of one MoE layer (a slice of the [L_moe, ...] stacks, see `fo_jax.model.dsa`):
    gate [E, X]  gate_bias [X] (float32)  w1 [X, E, M]  w2 [X, M, E]  w3 [X, E, M]
    shared_w1 [E, Ms]  shared_w2 [Ms, E]  shared_w3 [E, Ms]   (Ms = n_shared_experts * M; only
                                                               when n_shared_experts > 0)
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from fo_jax.model.layers import F32, matmul_f32, swiglu_mlp
from fo_jax.model.linear import is_fp8, linear, ragged_linear


def route(h: jax.Array, gate: jax.Array, gate_bias: jax.Array, *, config):
    """Routing weights [N, K'] float32 and experts [N, K'] int32 of tokens h [N, E].

    Touches h @ gate ([N, X] scores) and a few [N, X] temporaries.
    """
    scores = jax.nn.sigmoid(matmul_f32(h, gate))  # [N, X]
    biased = scores + gate_bias.astype(F32)
    num_n, num_x = scores.shape
    if config.n_group > 1:
        grouped = biased.reshape(num_n, config.n_group, num_x // config.n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_group]
        _, best = jax.lax.top_k(group_score, config.topk_group)  # [N, topk_group]
        keep = jnp.any(best[..., None] == jnp.arange(config.n_group), axis=-2)  # [N, n_group]
        biased = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(num_n, num_x)
    _, experts = jax.lax.top_k(biased, config.num_experts_per_tok)
    return _weights(scores, experts, config), experts.astype(jnp.int32)


def _weights(scores, experts, config):
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * jnp.float32(config.routed_scaling_factor)


IMPLEMENTATIONS = ("ragged_dot", "tiles")
# The mesh axis an expert-parallel `moe_mlp` sums over (fo_jax.sharding.EXPERT is this name).
EXPERT_AXIS = "expert"
TILE_ROWS = 8


def resolve_implementation(implementation: str | None) -> str:
    """`implementation`, or for None the one for the default backend: XLA lowers
    `jax.lax.ragged_dot` to a grouped matmul on GPU and TPU, but on CPU to a dense product
    over all X experts, so CPU takes "tiles"."""
    if implementation is None:
        return "tiles" if jax.default_backend() == "cpu" else "ragged_dot"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"MoE implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS} (or None: chosen by backend)")
    return implementation


def moe_mlp(h: jax.Array, p: Mapping, *, config, implementation: str | None = None) -> jax.Array:
    """The MoE MLP of tokens h [..., E] with one layer's parameters p; same shape and dtype.

    Flattens h to N tokens, routes them (`route`), sorts the N * K' (token, expert) pairs by
    expert (group sizes [X]) and runs the SwiGLU experts over those N * K' rows
    ([N K', E] -> [N K', M] -> [N K', E]); the rows go back to (token, k) order, are weighted
    and summed over k in float32.

    implementation: "ragged_dot" (three `jax.lax.ragged_dot`s over the sorted rows) or "tiles"
    (a loop over tiles of `TILE_ROWS` rows of one expert each: at most
    ceil(N K' / TILE_ROWS) + min(X, N K') tiles, each reading one expert's weights); None picks
    by backend (`resolve_implementation`).

    Expert parallelism: given a slice of the experts (p["w1"] [X_l, E, M] with X_l <
    n_routed_experts; w2, w3 alike), `moe_mlp` must run inside a `shard_map` whose mesh axis
    `EXPERT_AXIS` splits the experts in order (device i holds experts [i X_l, (i + 1) X_l)) and
    replicates h, gate and gate_bias. Routing is then computed whole on every device (it needs
    all X scores); each device computes only the rows of its own experts (`expert_rows`: the
    others are -0.0) and one `jax.lax.psum` over `EXPERT_AXIS` of the [N K', E] rows joins
    them; the weighted sum over k and the shared experts follow as without a mesh. Every row
    has one owner and x + (-0.0) == x for every x (a +0.0 filler would turn a -0.0 row into
    +0.0), so the sum is exact in any order: the joined rows are the owners' rows. Per device:
    X_l experts' weights, the tiles of its own rows, one all-reduce of N K' E values per layer.

    Given an `AllToAllExperts` slice instead, h is this device's own tokens (they differ from
    device to device) and the rows go to the experts' owners and back (`moe_all_to_all`);
    the weighted sum and the shared experts follow alike.
    """
    shape = h.shape
    x = h.reshape(-1, shape[-1])  # [N, E]
    weights, experts = route(x, p["gate"], p["gate_bias"], config=config)
    num_n, top = experts.shape
    num_local = p["w1"].shape[0]
    if num_local == config.n_routed_experts:  # every expert here (all-to-all or not)
        back = expert_rows(x, experts, p, implementation=implementation)
    elif isinstance(p, AllToAllExperts):
        back = moe_all_to_all(x, experts, p, config=config, implementation=implementation)
    else:
        if config.n_routed_experts % num_local:
            raise ValueError(f"p['w1'] holds {num_local} experts, which does not divide "
                             f"n_routed_experts={config.n_routed_experts}: give moe_mlp all "
                             "the experts, or an equal slice of them per device of the "
                             f"{EXPERT_AXIS!r} mesh axis")
        first = jax.lax.axis_index(EXPERT_AXIS) * num_local
        back = jax.lax.psum(expert_rows(x, experts, p, first=first,
                                        implementation=implementation), EXPERT_AXIS)
    y = jnp.sum(back.reshape(num_n, top, -1).astype(F32) * weights[..., None], axis=1)
    return _add_shared(y, x, p, config).reshape(shape)


def expert_rows(x: jax.Array, experts: jax.Array, p: Mapping, *, first=None,
                implementation: str | None = None) -> jax.Array:
    """The routed experts' outputs [N K', E] of tokens x [N, E] routed to `experts` [N K'], in
    (token, k) order, before the routing weights.

    first: None when p holds every expert (w1 [X, E, M]); else the id of p's first expert (an
    int or a traced scalar): p holds experts [first, first + X_l) and only their rows are
    computed, the others' rows are -0.0 (see `moe_mlp`: a sum over the slices is exact).

    The (token, k) pairs are sorted by expert (stably: an expert's rows in (token, k) order),
    the pairs of experts outside p's slice last, and p's experts run over their rows. On the
    tiles path each expert's rows start a new tile, so every tile holds the same rows (and the
    same zero padding) whichever slice of experts p holds: a row's arithmetic is the same, and
    work scales with the slice's rows (tiles past them are skipped). On the ragged_dot path the
    rows and weights are the same too, but the grouped matmul has another shape (X_l groups at
    other row offsets), which XLA may block differently: equal to rounding, not promised bit
    for bit.

    FP8 experts (`Fp8Weight`) take the tiles path unless "ragged_dot" is asked for: a tile
    multiplies by one expert's FP8 weights (`linear`: XLA's FP8 dot on GPU), where the grouped
    matmul would dequantize every expert of the layer first (`ragged_linear`).
    """
    num_local = p["w1"].shape[0]
    top = experts.shape[-1]
    flat = experts.reshape(-1)  # [N K']
    if first is None:
        key = flat
    else:
        mine = (flat >= first) & (flat < first + num_local)  # [N K']: rows of p's experts
        key = jnp.where(mine, flat - first, num_local)  # the others sort last
    back = _sorted_expert_rows(x, jnp.arange(flat.shape[0]) // top, key, p,
                               partial=first is not None, implementation=implementation)
    if first is not None:
        back = jnp.where(mine[:, None], back, jnp.array(-0.0, back.dtype))
    return back


def _sorted_expert_rows(x, source, key, p, *, partial: bool, implementation):
    """The outputs [R, E] of rows x[source] ([R] ids into x [N, E]) through p's experts `key`
    [R] (in [0, X_l]; X_l, with `partial`: a row of no expert of p, output unspecified): the
    rows sorted stably by expert, run (`expert_rows`), and put back in the given order."""
    if implementation is None and is_fp8(p["w1"]):
        implementation = "tiles"
    implementation = resolve_implementation(implementation)
    num_local = p["w1"].shape[0]
    if partial:
        sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    else:
        sizes = jnp.bincount(key, length=num_local).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)  # rows sorted by expert
    rows = x[source[order]]  # [R, E]
    if implementation == "ragged_dot":
        up = ragged_linear(rows, p["w1"], sizes)
        lin = ragged_linear(rows, p["w3"], sizes)
        act = (jax.nn.silu(up.astype(F32)) * lin.astype(F32)).astype(x.dtype)
        down = ragged_linear(act, p["w2"], sizes)  # [R, E], sorted by expert
    else:
        down = _expert_tiles(rows, key[order], sizes, p, partial=partial)
    return jnp.zeros_like(down).at[order].set(down, unique_indices=True)  # the given order


@jax.tree_util.register_pytree_node_class
class AllToAllExperts(Mapping):
    """MoE weights (one layer's, or the [L', ...] stacks) of which this device holds a slice
    of the routed experts, inside a `shard_map` whose mesh axis `axis` splits the tokens and
    the experts alike: device i of `axis` holds experts [i X_l, (i + 1) X_l) and its own
    tokens. `moe_mlp` given such weights dispatches rows by all-to-all (`moe_all_to_all`).

    A mapping of the same names as the weights dict it wraps (a pytree whose static part is
    the names and `axis`: `layer_slice` and jit keep it)."""

    def __init__(self, weights: Mapping, axis: str):
        self.weights = dict(weights)
        self.axis = axis

    def __getitem__(self, name):
        return self.weights[name]

    def __iter__(self):
        return iter(self.weights)

    def __len__(self):
        return len(self.weights)

    def tree_flatten(self):
        names = tuple(sorted(self.weights))
        return tuple(self.weights[n] for n in names), (names, self.axis)

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, axis = aux
        return cls(dict(zip(names, children)), axis)


def all_to_all_capacity(num_tokens: int, *, top: int, num_local: int) -> int:
    """Rows one device sends to each device per MoE layer: num_tokens min(K', X_l). A token's
    K' experts are distinct, and a device owns X_l of them, so a token sends it at most
    min(K', X_l) rows: buffers of this size never drop a row, whatever the routing."""
    return num_tokens * min(top, num_local)


def moe_all_to_all(x: jax.Array, experts: jax.Array, p: AllToAllExperts, *, config,
                   implementation: str | None = None) -> jax.Array:
    """The routed experts' rows [N K', E] of this device's tokens x [N, E] (routed to
    `experts` [N, K'], global ids), in (token, k) order, computed by the experts' owners.

    With D devices on `p.axis` and X_l = X / D experts each, rows go to the owner of their
    expert (expert e: device e // X_l) in buffers of C = `all_to_all_capacity` rows per device
    (the pairs for one owner in (token, k) order, then padding):

        send rows [D C, E], expert ids [D C] (local ids; X_l marks padding)
        all_to_all (tiled, over p.axis): device d gets every device's C rows for it [D C, E]
        the owner runs its experts over the rows it got (`expert_rows`' sort and tiles;
            padding rows belong to no expert and cost no tile)
        all_to_all back: each device gets its rows' outputs in the slots it sent them from

    Three all-to-alls per layer (rows, ids, outputs); per device 2 D C E values sent and
    received, D C E for each buffer. Nothing is dropped: C is the worst case (every token's
    rows at one owner). Each row's arithmetic is that of the single-device path (the same
    expert, the same tile shape, a row's output independent of its tile's other rows on the
    tiles path), so the outputs are bit for bit those of `expert_rows` with every expert;
    ragged_dot runs grouped matmuls of other shapes (equal to rounding).
    """
    axis = p.axis
    num_n, top = experts.shape
    num_local = p["w1"].shape[0]
    ranks = config.n_routed_experts // num_local
    if config.n_routed_experts % num_local:
        raise ValueError(f"p['w1'] holds {num_local} experts, which does not divide "
                         f"n_routed_experts={config.n_routed_experts}: split the experts "
                         f"evenly over the {axis!r} mesh axis")
    cap = all_to_all_capacity(num_n, top=top, num_local=num_local)
    flat = experts.reshape(-1)  # [N K']
    owner = flat // num_local
    # Each pair's place among the pairs for the same owner, in (token, k) order.
    order = jnp.argsort(owner, stable=True)
    counts = jnp.bincount(owner, length=ranks)
    starts = jnp.cumsum(counts) - counts
    place = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.shape[0]) - starts[owner[order]],
                                               unique_indices=True)
    slot = owner * cap + place  # [N K'] in [0, D C): distinct
    send = jnp.zeros((ranks * cap, x.shape[-1]), x.dtype).at[slot].set(
        x[jnp.arange(flat.shape[0]) // top], unique_indices=True)
    ids = jnp.full((ranks * cap,), num_local, jnp.int32).at[slot].set(
        flat - owner * num_local, unique_indices=True)
    got = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [D C, E]: rows for my experts
    got_ids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True)
    out = _sorted_expert_rows(got, jnp.arange(ranks * cap), got_ids, p.weights, partial=True,
                              implementation=implementation)
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # my rows' outputs, as sent
    return back[slot]


def _expert_tiles(rows, row_expert, sizes, p, *, partial: bool = False):
    """The experts' SwiGLU of `rows` [R, E] sorted by expert (`row_expert` [R], `sizes` [X]).

    Each expert's rows are padded to whole tiles of b = TILE_ROWS; a loop over
    ceil(R / b) + min(X, R) tiles multiplies each used tile [b, E] by its expert's weights (the
    unused ones, past the traced count of used tiles, do nothing). Padding rows read row R
    (zeros) and are dropped. `partial`: rows past sum(sizes) (row_expert = X: experts p does not
    hold) are in no tile and come out unspecified.
    """
    num_r, width = rows.shape
    num_x = sizes.shape[0]
    b = TILE_ROWS
    tiles_per = (sizes + b - 1) // b  # [X]
    tile_end = jnp.cumsum(tiles_per)  # [X]
    first_row = jnp.cumsum(sizes) - sizes  # [X]
    first_slot = (tile_end - tiles_per) * b  # [X]: padded position of each expert's first row
    max_tiles = -(-num_r // b) + min(num_x, num_r)
    if partial:  # the other experts' rows go to distinct slots past the end (dropped)
        held = row_expert < num_x
        e = jnp.minimum(row_expert, num_x - 1)
        slot = jnp.where(held, first_slot[e] + jnp.arange(num_r) - first_row[e],
                         max_tiles * b + jnp.arange(num_r))
        source = jnp.full((max_tiles * b,), num_r, jnp.int32).at[slot].set(
            jnp.arange(num_r, dtype=jnp.int32), unique_indices=True, mode="drop")
    else:
        slot = first_slot[row_expert] + jnp.arange(num_r) - first_row[row_expert]  # [R]
        source = jnp.full((max_tiles * b,), num_r, jnp.int32).at[slot].set(
            jnp.arange(num_r, dtype=jnp.int32), unique_indices=True)
    padded = jnp.concatenate([rows, jnp.zeros((1, width), rows.dtype)])[source]
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(max_tiles), side="right")

    def tile(t, out):
        e = tile_expert[t]
        xt = jax.lax.dynamic_slice_in_dim(padded, t * b, b)  # [b, E]
        up = jax.nn.silu(linear(xt, p["w1"][e]).astype(F32))
        act = (up * linear(xt, p["w3"][e]).astype(F32)).astype(rows.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, linear(act, p["w2"][e]), t * b, 0)

    # A static trip count (a scan: reverse-differentiable) whose unused tiles skip the work.
    used = tile_end[-1]
    out = jax.lax.fori_loop(
        0, max_tiles, lambda t, out: jax.lax.cond(t < used, tile, lambda t, out: out, t, out),
        jnp.zeros((max_tiles * b, width), rows.dtype))
    if partial:
        return out.at[slot].get(mode="fill", fill_value=0)
    return out[slot]


def _add_shared(y, x, p, config):
    if config.n_shared_experts:
        y = y + swiglu_mlp(x, p["shared_w1"], p["shared_w2"], p["shared_w3"]).astype(F32)
    return y.astype(x.dtype)


def route_reference(h: jax.Array, gate: jax.Array, gate_bias: jax.Array, *, config):
    """`route` by sorting: stable descending sorts pick the groups and the experts."""
    scores = jax.nn.sigmoid(jnp.matmul(h.astype(F32), gate.astype(F32),
                                       precision=jax.lax.Precision.HIGHEST))
    biased = scores + gate_bias.astype(F32)
    num_n, num_x = scores.shape
    per_group = num_x // config.n_group
    if config.n_group > 1:
        grouped = biased.reshape(num_n, config.n_group, per_group)
        best_two = jnp.sort(grouped, axis=-1)[..., -2:]
        group_score = best_two[..., 1] + best_two[..., 0]
        rank = jnp.argsort(-group_score, axis=-1, stable=True)[:, :config.topk_group]
        keep = jnp.zeros((num_n, config.n_group), bool)
        keep = keep.at[jnp.arange(num_n)[:, None], rank].set(True)
        allowed = jnp.repeat(keep, per_group, axis=-1)
        biased = jnp.where(allowed, biased, -jnp.inf)
    experts = jnp.argsort(-biased, axis=-1, stable=True)[:, :config.num_experts_per_tok]
    return _weights(scores, experts, config), experts.astype(jnp.int32)


def moe_mlp_reference(h: jax.Array, p: dict, *, config) -> jax.Array:
    """`moe_mlp` the obvious way: every expert on every token, masked by the routing."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    weights, experts = route_reference(x, p["gate"], p["gate_bias"], config=config)
    y = jnp.zeros(x.shape, F32)
    for e in range(config.n_routed_experts):
        coef = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=-1)  # [N]
        up = jax.nn.silu(linear(x, p["w1"][e]).astype(F32))
        act = (up * linear(x, p["w3"][e]).astype(F32)).astype(x.dtype)
        y = y + coef[:, None] * linear(act, p["w2"][e]).astype(F32)
    return _add_shared(y, x, p, config).reshape(shape)

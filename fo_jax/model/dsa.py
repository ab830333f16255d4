"""The DSA model's parameters: a Flax NNX module with per-layer weights stacked on a layer axis.

`DSAModel(config, rngs=nnx.Rngs(seed))` owns the parameters; `model.params()` returns them as a
plain nested dict of arrays, the pytree every pure function of fo_jax takes:

    embed        [V, E]
    norm         [E]                 final RMSNorm
    head         [E, V]
    layers/      stacked on L:
      attn_norm [L, E]  wq_a [L, E, Q]  q_norm [L, Q]  wq_b [L, Q, H*(nope+R)]
      wkv_a [L, E, D+R] kv_norm [L, D]  wkv_b [L, D, H*(nope+v)]  wo [L, H*v, E]
      ffn_norm [L, E]   w1 [L, E, F]    w2 [L, F, E]   w3 [L, E, F]
    indexer/     stacked on G (one per group):
      wq_b [G, Q, I*N]  wk [G, E, N]  k_norm_w [G, N]  k_norm_b [G, N]  weights_proj [G, E, I]

With MoE layers (`config.moe`), `layers/` keeps no w1 / w2 / w3; the first L_d =
`first_k_dense_replace` layers' dense MLP and the other L_m = L - L_d layers' experts are two
more stacks (an empty one is left out):

    dense_mlp/   w1 [L_d, E, F]  w2 [L_d, F, E]  w3 [L_d, E, F]
    moe/         gate [L_m, E, X]  gate_bias [L_m, X] (float32)
                 w1 [L_m, X, E, M]  w2 [L_m, X, M, E]  w3 [L_m, X, E, M]
                 shared_w1 [L_m, E, Ms]  shared_w2 [L_m, Ms, E]  shared_w3 [L_m, E, Ms]
                 (Ms = n_shared_experts * M; only when n_shared_experts > 0)

Matrices are stored [in, out] (x @ w); safetensors files use the DeepSeek reference checkpoint's
[out, in] layout and names (see fo_jax.weights). The projections (`FP8_PARAMS`) may instead be
`fo_jax.model.linear.Fp8Weight`s of the same shape (e4m3 values + float32 block scales: an FP8
checkpoint, `quantize_params`, `init_fp8_params`); every use of them goes through `linear`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from fo_jax.config import ModelConfig
from fo_jax.model.linear import Fp8Weight


def param_shapes(config: ModelConfig) -> dict:
    """Shapes of every parameter, as the nested dict `DSAModel.params()` returns."""
    c = config
    num_l, num_g = c.num_layers, c.num_groups
    q_dim = c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    shapes = {
        "embed": (c.vocab_size, c.dim),
        "norm": (c.dim,),
        "head": (c.dim, c.vocab_size),
        "layers": {
            "attn_norm": (num_l, c.dim),
            "wq_a": (num_l, c.dim, c.q_lora_rank),
            "q_norm": (num_l, c.q_lora_rank),
            "wq_b": (num_l, c.q_lora_rank, q_dim),
            "wkv_a": (num_l, c.dim, c.kv_width),
            "kv_norm": (num_l, c.kv_lora_rank),
            "wkv_b": (num_l, c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)),
            "wo": (num_l, c.num_heads * c.v_head_dim, c.dim),
            "ffn_norm": (num_l, c.dim),
            "w1": (num_l, c.dim, c.mlp_hidden),
            "w2": (num_l, c.mlp_hidden, c.dim),
            "w3": (num_l, c.dim, c.mlp_hidden),
        },
        "indexer": {
            "wq_b": (num_g, c.q_lora_rank, c.index_n_heads * c.index_head_dim),
            "wk": (num_g, c.dim, c.index_head_dim),
            "k_norm_w": (num_g, c.index_head_dim),
            "k_norm_b": (num_g, c.index_head_dim),
            "weights_proj": (num_g, c.dim, c.index_n_heads),
        },
    }
    if not c.moe:
        return shapes
    dense = {name: shapes["layers"].pop(name)[1:] for name in ("w1", "w2", "w3")}
    if c.num_dense_layers:
        shapes["dense_mlp"] = {name: (c.num_dense_layers,) + s for name, s in dense.items()}
    if c.num_moe_layers:
        num_m, num_x, m = c.num_moe_layers, c.n_routed_experts, c.moe_hidden
        moe = {
            "gate": (num_m, c.dim, num_x), "gate_bias": (num_m, num_x),
            "w1": (num_m, num_x, c.dim, m), "w2": (num_m, num_x, m, c.dim),
            "w3": (num_m, num_x, c.dim, m),
        }
        if c.n_shared_experts:
            ms = c.n_shared_experts * m
            moe.update(shared_w1=(num_m, c.dim, ms), shared_w2=(num_m, ms, c.dim),
                       shared_w3=(num_m, c.dim, ms))
        shapes["moe"] = moe
    return shapes


def param_dtype(path: tuple[str, ...], config: ModelConfig):
    """The dtype of the parameter at `path` (names from the root): the routers' correction
    bias is float32 (as the reference keeps it), everything else `config.dtype`."""
    return jnp.float32 if path[-1] == "gate_bias" else config.jnp_dtype


# The parameters that may be held in FP8 (`Fp8Weight`): (stack, name) of the projections, every
# use of which is a `fo_jax.model.linear.linear` (or, wkv_b, a `dequantize`); under "mtp" too.
# The routers, the head, the embedding, norms and the indexer's weights_proj stay as they are.
FP8_PARAMS = frozenset(
    [("layers", n) for n in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w1", "w2", "w3")]
    + [("dense_mlp", n) for n in ("w1", "w2", "w3")]
    + [("moe", n) for n in ("w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3")]
    + [("indexer", "wq_b"), ("indexer", "wk")])


def param_bytes(config: ModelConfig, *, fp8_block: tuple[int, int] | None = None,
                names=None) -> int:
    """Bytes of every parameter of `config` (`param_dtype`), from the shapes alone: what
    `init_params` would allocate, known before allocating anything. With `fp8_block` (bI, bO),
    the `FP8_PARAMS` as `Fp8Weight`s in blocks of that shape (what `quantize_params` or an
    FP8 checkpoint loaded with weights="fp8" holds): 1 byte per value plus 4 per block
    (partial last blocks counted whole). names: only the parameters whose key paths
    (("moe", "w1"), ...) are in it (None: all)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))[0]
    count = 0
    for path, shape in leaves:
        keys = tuple(k.key for k in path)
        if names is not None and keys not in names:
            continue
        size = 1
        for n in shape:
            size *= n
        if fp8_block is not None and keys[-2:] in FP8_PARAMS:
            blocks = 1
            for n in shape[:-2] + tuple(-(-n // b) for n, b in zip(shape[-2:], fp8_block)):
                blocks *= n
            count += size + 4 * blocks
            continue
        count += size * jnp.dtype(param_dtype(keys, config)).itemsize
    return count


def init_fp8_params(config: ModelConfig, key: jax.Array,
                    block: tuple[int, int] = (128, 128)) -> dict:
    """Random parameters with the `FP8_PARAMS` as `Fp8Weight`s, drawn on the device one
    matrix at a time: the values `quantize_params(init_params(config, key), block)` would
    hold in law (normal(0, fan_in^-0.5), then FP8 with amax / 448 block scales), but at most one
    float32 matrix of temporaries per stack, not the whole model in bfloat16 (a real-width MoE
    layer's experts are 22 GB in bfloat16, 11 GB in FP8). Leaf i draws with the i-th of
    `split(key, number of leaves)`, matrix j of an FP8 stack with the j-th of `split` of
    that. One compiled program."""
    treedef, specs = _leaf_specs(config)
    leaves = jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))[0]
    fp8 = tuple(tuple(k.key for k in path)[-2:] in FP8_PARAMS for path, _ in leaves)
    return jax.tree_util.tree_unflatten(treedef, _draw_fp8_leaves(specs, fp8, tuple(block), key))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _draw_fp8_leaves(specs: tuple, fp8: tuple, block: tuple, key: jax.Array) -> list:
    keys = jax.random.split(key, len(specs))
    out = []
    for spec, is_fp8, leaf_key in zip(specs, fp8, keys):
        if not is_fp8:
            out.append(_draw_leaves((spec,), leaf_key)[0])
            continue
        _, shape, _ = spec
        count = 1
        for n in shape[:-2]:
            count *= n

        def one(k, shape=shape):
            w = jax.random.normal(k, shape[-2:], jnp.float32) * shape[-2] ** -0.5
            q = Fp8Weight.quantize(w, block)
            return q.q, q.scale_inv

        q, scale = jax.lax.map(one, jax.random.split(leaf_key, count))
        out.append(Fp8Weight(q.reshape(shape), scale.reshape(shape[:-2] + scale.shape[1:]),
                             block))
    return out


def quantize_params(params: dict, block: tuple[int, int] = (128, 128),
                    scale_fmt: str | None = None) -> dict:
    """`params` with the `FP8_PARAMS` stacks as `Fp8Weight`s of `block` (bI, bO) blocks
    (`Fp8Weight.quantize`: scales amax / 448), the rest as it is: random FP8 weights from
    `init_params`, or the shapes of an FP8 model under `jax.eval_shape`. Touches every
    quantized weight once."""
    def convert(path, leaf):
        keys = tuple(k.key for k in path)
        if keys[-2:] in FP8_PARAMS:
            return Fp8Weight.quantize(leaf, block, scale_fmt)
        return leaf

    return jax.tree_util.tree_map_with_path(convert, params)


_ONES = {"norm", "attn_norm", "q_norm", "kv_norm", "ffn_norm", "k_norm_w"}
_ZEROS = {"k_norm_b", "gate_bias"}

# Compiled init programs by (leaf specs, key type, key sharding): kept here, not in jax's caches,
# so that one survives `jax.clear_caches()` and serves every later config of the same shapes
# (a test suite clears the caches after each module). A few programs at most; the oldest goes.
_INIT_PROGRAMS: dict = {}
_MAX_INIT_PROGRAMS = 8


def _leaf_specs(config: ModelConfig):
    """(treedef, ((kind, shape, dtype name), ...)) of `param_shapes(config)`; kind is "ones",
    "zeros", "embed" (unit normal) or "matrix" (normal scaled by fan_in^-0.5)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    specs = []
    for path, shape in leaves:
        name = path[-1].key
        kind = ("ones" if name in _ONES else "zeros" if name in _ZEROS
                else "embed" if name == "embed" else "matrix")
        dtype = jnp.dtype(param_dtype(tuple(k.key for k in path), config)).name
        specs.append((kind, shape, dtype))
    return treedef, tuple(specs)


def _draw_leaves(specs: tuple, key: jax.Array) -> list:
    """The leaves of `specs` in order: leaf i draws with the i-th of `split(key, len(specs))`.
    Touches every parameter once ([sum of the leaves' sizes])."""
    keys = jax.random.split(key, len(specs))
    out = []
    for (kind, shape, dtype), leaf_key in zip(specs, keys):
        if kind == "ones":
            value = jnp.ones(shape, dtype)
        elif kind == "zeros":
            value = jnp.zeros(shape, dtype)
        elif kind == "embed":
            value = jax.random.normal(leaf_key, shape, dtype)
        else:
            value = jax.random.normal(leaf_key, shape, dtype) * shape[-2] ** -0.5
        out.append(value)
    return out


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random parameters: normal(0, fan_in^-0.5) matrices, unit norms, zero biases.

    The leaves of `param_shapes(config)` in flattening order draw with the keys of
    `jax.random.split(key, number of leaves)`. One compiled program draws them all (its values
    are bit for bit those of drawing each leaf eagerly); it is kept for later calls with the
    same shapes and key type. Under a trace (jit, eval_shape) the draws are traced inline."""
    treedef, specs = _leaf_specs(config)
    if isinstance(key, jax.core.Tracer) or not isinstance(key, jax.Array):
        return jax.tree_util.tree_unflatten(treedef, _draw_leaves(specs, key))
    cache_key = (specs, key.shape, key.dtype, key.sharding,
                 jax.config.jax_threefry_partitionable, jax.config.jax_enable_x64)
    program = _INIT_PROGRAMS.get(cache_key)
    if program is None:
        program = jax.jit(_draw_leaves, static_argnums=0).lower(specs, key).compile()
        if len(_INIT_PROGRAMS) >= _MAX_INIT_PROGRAMS:
            _INIT_PROGRAMS.pop(next(iter(_INIT_PROGRAMS)))
        _INIT_PROGRAMS[cache_key] = program
    return jax.tree_util.tree_unflatten(treedef, program(key))


class _Stack(nnx.Module):
    """A group of stacked parameters (one nnx.Param per name)."""

    def __init__(self, arrays: dict):
        for name, value in arrays.items():
            setattr(self, name, nnx.Param(value))


class DSAModel(nnx.Module):
    """Parameters of a DSA model; the forward passes are the pure functions of fo_jax.resident
    (whole KV on device) and fo_jax.offload (KV in host memory), which take `self.params()`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        params = init_params(config, rngs.params())
        self.embed = nnx.Param(params["embed"])
        self.norm = nnx.Param(params["norm"])
        self.head = nnx.Param(params["head"])
        self.layers = _Stack(params["layers"])
        self.indexer = _Stack(params["indexer"])
        for name in ("dense_mlp", "moe"):
            if name in params:
                setattr(self, name, _Stack(params[name]))

    def params(self) -> dict:
        """The parameters as a plain nested dict of arrays (see the module docstring)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def load_params(self, params: dict) -> None:
        """Replace the parameters by `params` (same structure and shapes)."""
        check_params(params, self.config)
        state = nnx.state(self, nnx.Param)
        nnx.replace_by_pure_dict(state, params)
        nnx.update(self, state)


def check_params(params: dict, config: ModelConfig) -> None:
    """Raise ValueError naming the first parameter whose presence or shape is wrong."""
    expected = param_shapes(config)

    def walk(exp, got, prefix):
        if not isinstance(got, dict):
            raise ValueError(f"params{prefix}: expected a dict, got {type(got).__name__}")
        missing = sorted(set(exp) - set(got))
        extra = sorted(set(got) - set(exp))
        if missing or extra:
            raise ValueError(f"params{prefix}: missing {missing}, unexpected {extra}")
        for name, shape in exp.items():
            if isinstance(shape, dict):
                walk(shape, got[name], f"{prefix}/{name}")
            elif tuple(got[name].shape) != shape:
                raise ValueError(
                    f"params{prefix}/{name}: expected shape {shape} for config "
                    f"{config.name!r}, got {tuple(got[name].shape)}"
                )

    walk(expected, params, "")


def layer_slice(params: Mapping, index) -> Mapping:
    """One layer's parameters (index may be traced: a dynamic slice of each stacked array), of
    the same pytree type (a dict, or `fo_jax.model.moe.AllToAllExperts`)."""
    return jax.tree_util.tree_map(lambda a: a[index], params)

"""Save and load DSA parameters as safetensors, under the DeepSeek-V3.2 reference names.

Names follow the DeepSeek-V3.2 reference inference code (after its checkpoint conversion), so a
converted real checkpoint (dense MLP layers) maps onto `DSAModel.params()`:

    embed.weight [V, E]              norm.weight [E]              head.weight [V, E]
    layers.{l}.attn_norm.weight      layers.{l}.ffn_norm.weight
    layers.{l}.attn.wq_a.weight      layers.{l}.attn.q_norm.weight    layers.{l}.attn.wq_b.weight
    layers.{l}.attn.wkv_a.weight     layers.{l}.attn.kv_norm.weight   layers.{l}.attn.wkv_b.weight
    layers.{l}.attn.wo.weight
    layers.{l}.ffn.w1.weight  layers.{l}.ffn.w2.weight  layers.{l}.ffn.w3.weight
    layers.{i}.attn.indexer.{wq_b, wk, weights_proj}.weight, .k_norm.weight, .k_norm.bias
        (i = the first layer of each indexer group: the layer that owns the group's indexer)

Linear weights are stored [out, in] as in the reference (fo_jax keeps [in, out]); the round trip
is bitwise.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from fo_jax.config import ModelConfig
from fo_jax.model.dsa import check_params

_LAYER = {
    "attn_norm": ("attn_norm.weight", False),
    "ffn_norm": ("ffn_norm.weight", False),
    "wq_a": ("attn.wq_a.weight", True),
    "q_norm": ("attn.q_norm.weight", False),
    "wq_b": ("attn.wq_b.weight", True),
    "wkv_a": ("attn.wkv_a.weight", True),
    "kv_norm": ("attn.kv_norm.weight", False),
    "wkv_b": ("attn.wkv_b.weight", True),
    "wo": ("attn.wo.weight", True),
    "w1": ("ffn.w1.weight", True),
    "w2": ("ffn.w2.weight", True),
    "w3": ("ffn.w3.weight", True),
}
_INDEXER = {
    "wq_b": ("attn.indexer.wq_b.weight", True),
    "wk": ("attn.indexer.wk.weight", True),
    "k_norm_w": ("attn.indexer.k_norm.weight", False),
    "k_norm_b": ("attn.indexer.k_norm.bias", False),
    "weights_proj": ("attn.indexer.weights_proj.weight", True),
}
_TOP = {"embed": ("embed.weight", False), "norm": ("norm.weight", False),
        "head": ("head.weight", True)}


def to_checkpoint(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Flat {reference name: numpy array} of `params`."""
    check_params(params, config)
    out = {}

    def put(name, value, transpose):
        value = np.asarray(value)
        out[name] = np.ascontiguousarray(value.T if transpose else value)

    for key, (name, transpose) in _TOP.items():
        put(name, params[key], transpose)
    for l in range(config.num_layers):
        for key, (name, transpose) in _LAYER.items():
            put(f"layers.{l}.{name}", params["layers"][key][l], transpose)
    for g, first in enumerate(config.indexer_layers):
        for key, (name, transpose) in _INDEXER.items():
            put(f"layers.{first}.{name}", params["indexer"][key][g], transpose)
    return out


def from_checkpoint(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict:
    """`DSAModel.params()`-shaped dict from reference-named tensors; clear error if one is
    missing or mis-shaped."""
    def get(name, transpose):
        if name not in tensors:
            raise ValueError(f"checkpoint has no tensor {name!r} (config {config.name!r}: "
                             f"{config.num_layers} layers, indexers at {config.indexer_layers})")
        value = tensors[name]
        return value.T if transpose else value

    params = {key: jnp.asarray(get(name, t)) for key, (name, t) in _TOP.items()}
    params["layers"] = {
        key: jnp.asarray(np.stack([get(f"layers.{l}.{name}", t)
                                   for l in range(config.num_layers)]))
        for key, (name, t) in _LAYER.items()
    }
    params["indexer"] = {
        key: jnp.asarray(np.stack([get(f"layers.{first}.{name}", t)
                                   for first in config.indexer_layers]))
        for key, (name, t) in _INDEXER.items()
    }
    check_params(params, config)
    return params


def save_params(path: str | os.PathLike, params: dict, config: ModelConfig) -> None:
    """Write `params` to a safetensors file (config name and shapes in its metadata)."""
    tensors = to_checkpoint(params, config)
    save_file(tensors, str(path), metadata={"format": "fo_jax", "config": config.name})


def load_params(path: str | os.PathLike, config: ModelConfig) -> dict:
    """Read a safetensors file written by `save_params` (or converted from the reference)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no weights file at {path}")
    return from_checkpoint(load_file(str(path)), config)


def params_equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two parameter trees."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb))

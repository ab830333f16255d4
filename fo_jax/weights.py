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

MoE models add, for each MoE layer l (see `fo_jax.checkpoints.names`, which holds both this
format and the Hugging Face one):

    layers.{l}.ffn.gate.weight [X, E]   layers.{l}.ffn.gate.bias [X]
    layers.{l}.ffn.experts.{e}.{w1, w2, w3}.weight   layers.{l}.ffn.shared_experts.{w1, w2, w3}.weight

Linear weights are stored [out, in] as in the reference (fo_jax keeps [in, out]); the round trip
is bitwise. Hugging Face checkpoint directories: `fo_jax.checkpoints`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from fo_jax.checkpoints.names import tensor_names
from fo_jax.config import ModelConfig
from fo_jax.model.dsa import check_params

def to_checkpoint(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Flat {reference name: numpy array} of `params`."""
    check_params(params, config)
    out = {}
    for name, slot in tensor_names(config, "reference").items():
        leaf = params
        for key in slot.path:
            leaf = leaf[key]
        value = np.asarray(leaf[slot.index])
        out[name] = np.ascontiguousarray(value.T if slot.transpose else value)
    return out


def from_checkpoint(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict:
    """`DSAModel.params()`-shaped dict from reference-named tensors; clear error if one is
    missing or mis-shaped."""
    names = tensor_names(config, "reference")
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"checkpoint has no tensor {missing[0]!r} (config {config.name!r}: "
                         f"{config.num_layers} layers, indexers at {config.indexer_layers})")
    flat = {}
    for name, slot in names.items():
        value = tensors[name]
        value = value.T if slot.transpose else value
        if not slot.index:
            flat[slot.path] = value
            continue
        flat.setdefault(slot.path, {})[slot.index] = value
    params: dict = {}
    for path, value in flat.items():
        if isinstance(value, dict):
            value = _stack(value)
        target = params
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = jnp.asarray(value)
    check_params(params, config)
    return params


def _stack(pieces: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
    """One array from {index tuple: piece} covering a full grid of leading indices."""
    depth = len(next(iter(pieces)))
    if depth == 1:
        return np.stack([pieces[(i,)] for i in range(len(pieces))])
    outer = sorted({k[0] for k in pieces})
    return np.stack([_stack({k[1:]: v for k, v in pieces.items() if k[0] == i}) for i in outer])


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

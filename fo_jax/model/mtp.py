"""The multi-token-prediction (MTP) layers of DeepSeek-V3.2 / GLM-5, run as a drafter.

A checkpoint with `num_nextn_predict_layers = n` stores n MTP layers after the L main layers
(HF names `model.layers.{L + k}.…`). MTP layer k maps the main model's last hidden state h_i
(after the last layer, before the final norm) and the token t_{i+1} that follows position i to
a prediction of t_{i+2}:

    x   = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))       [B, T, 2E] @ [2E, E]
    h'  = one decoder layer (MLA attention + indexer, MoE or dense MLP) on x, at position i
    logits = shared_head.head(shared_head.norm(h'))                  [B, T, V] float32

(DeepSeek-V3 report, section 2.2; the position of the pair (h_i, t_{i+1}) is i, as SGLang's
and vLLM's EAGLE-style MTP drafting feed it). The layer attends over its own KV cache of the
earlier pairs: a `fo_jax.resident.ResidentState` of one layer and one indexer group, resident
on the device ([1, B, S, D + R] KV rows and [1, B, S, N] indexer keys: one main layer's worth,
small next to the main cache, so never offloaded); the step is `fo_jax.resident.mtp_step`.

Parameters (`mtp_param_shapes`): the main layers' stacks for n layers ("layers", "indexer",
and "moe" or the dense MLP as the main model keeps it; every MTP layer is a MoE layer when the
model has experts, as layer L >= first_k_dense_replace is), plus
  enorm, hnorm, head_norm [n, E]; eh_proj [n, 2E, E];
  embed [n, V, E] and head [n, E, V] only where the checkpoint stores the layer's own copy
  (DeepSeek's index lists `embed_tokens` and `shared_head.head` under the MTP layer; a
  checkpoint without them shares the main model's `embed` / `head`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fo_jax.config import ModelConfig
from fo_jax.model.dsa import init_params, param_shapes

# Parameters of an MTP layer beyond a decoder layer's; the optional own copies of embed/head.
EXTRA = ("enorm", "hnorm", "head_norm", "eh_proj")
SHARED = ("embed", "head")


def stack_config(config: ModelConfig, num_layers: int | None = None) -> ModelConfig:
    """The config of `num_layers` (default num_nextn_predict_layers) MTP layers as a model of
    their own: each its own indexer group, all MoE when `config` has experts."""
    n = config.num_nextn_predict_layers if num_layers is None else num_layers
    if n < 1:
        raise ValueError(f"model {config.name!r} has num_nextn_predict_layers="
                         f"{config.num_nextn_predict_layers}: no multi-token-prediction layer")
    return dataclasses.replace(
        config, name=f"{config.name}-mtp", num_layers=n, indexer_layers=tuple(range(n)),
        first_k_dense_replace=0, num_nextn_predict_layers=0)


def mtp_param_shapes(config: ModelConfig, *, own_embed: bool = False,
                     own_head: bool = False) -> dict:
    """Shapes of the MTP parameters of `config` (see the module docstring)."""
    sc = stack_config(config)
    n, e = sc.num_layers, config.dim
    shapes = param_shapes(sc)
    for name in ("embed", "norm", "head"):
        shapes.pop(name)
    shapes.update(enorm=(n, e), hnorm=(n, e), head_norm=(n, e), eh_proj=(n, 2 * e, e))
    if own_embed:
        shapes["embed"] = (n, config.vocab_size, e)
    if own_head:
        shapes["head"] = (n, e, config.vocab_size)
    return shapes


def init_mtp_params(config: ModelConfig, key: jax.Array, *, own_embed: bool = False,
                    own_head: bool = False) -> dict:
    """Random MTP parameters (the rules of `fo_jax.model.dsa.init_params`)."""
    sc = stack_config(config)
    k_layers, k_proj, k_embed, k_head = jax.random.split(key, 4)
    out = init_params(sc, k_layers)
    for name in ("embed", "norm", "head"):
        out.pop(name)
    n, e, dtype = sc.num_layers, config.dim, config.jnp_dtype
    for name in ("enorm", "hnorm", "head_norm"):
        out[name] = jnp.ones((n, e), dtype)
    out["eh_proj"] = jax.random.normal(k_proj, (n, 2 * e, e), dtype) * (2 * e) ** -0.5
    if own_embed:
        out["embed"] = jax.random.normal(k_embed, (n, config.vocab_size, e), dtype)
    if own_head:
        out["head"] = jax.random.normal(k_head, (n, e, config.vocab_size), dtype) * e ** -0.5
    return out


def check_mtp_params(mtp: dict, config: ModelConfig) -> None:
    """Raise ValueError naming the first MTP parameter whose presence or shape is wrong."""
    if not isinstance(mtp, dict):
        raise ValueError(f"MTP params: expected a dict, got {type(mtp).__name__}")
    expected = mtp_param_shapes(config, own_embed="embed" in mtp, own_head="head" in mtp)

    def walk(exp, got, prefix):
        missing = sorted(set(exp) - set(got))
        extra = sorted(set(got) - set(exp))
        if missing or extra:
            raise ValueError(f"MTP params{prefix}: missing {missing}, unexpected {extra}")
        for name, shape in exp.items():
            if isinstance(shape, dict):
                walk(shape, got[name], f"{prefix}/{name}")
            elif tuple(got[name].shape) != shape:
                raise ValueError(f"MTP params{prefix}/{name}: expected shape {shape} for "
                                 f"config {config.name!r}, got {tuple(got[name].shape)}")

    walk(expected, mtp, "")


def block_params(mtp: dict, depth: int) -> dict:
    """MTP layer `depth` as the stacks of a one-layer model (leading axis of size 1)."""
    return jax.tree_util.tree_map(lambda a: a[depth:depth + 1], mtp)

"""The DSA model: MLA attention, the lightning indexer, MoE, the layer loop, linear layers over
plain or FP8 weights."""

from fo_jax.model.attention import dense_attention, sparse_attention
from fo_jax.model.dsa import (DSAModel, check_params, init_fp8_params, init_params, param_shapes,
                              quantize_params)
from fo_jax.model.forward import forward
from fo_jax.model.indexer import indexer_scores, select_topk
from fo_jax.model.linear import Fp8Weight, linear
from fo_jax.model.moe import moe_mlp, moe_mlp_reference

__all__ = [
    "DSAModel",
    "Fp8Weight",
    "check_params",
    "dense_attention",
    "forward",
    "indexer_scores",
    "init_fp8_params",
    "init_params",
    "linear",
    "moe_mlp",
    "moe_mlp_reference",
    "param_shapes",
    "quantize_params",
    "select_topk",
    "sparse_attention",
]

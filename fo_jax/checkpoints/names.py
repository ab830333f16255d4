"""Checkpoint tensor names -> places in fo_jax's stacked parameters, for two formats.

"hf": Hugging Face DeepSeek-V3.2 / GLM-5 checkpoints (`model.layers.{l}.self_attn.q_a_proj.weight`,
    `model.layers.{l}.mlp.experts.{e}.gate_proj.weight`, ...).
"reference": the DeepSeek-V3.2 reference inference code's names after its convert.py
    (`layers.{l}.attn.wq_a.weight`, `layers.{l}.ffn.experts.{e}.w1.weight`, ...).

Both store matrices [out, in] (fo_jax keeps [in, out]: `Slot.transpose`); the indexer's
tensors sit in the first layer of each indexer group; MoE tensors of layer l go to index
l - first_k_dense_replace of the `moe/` stacks, expert e to index e of the expert axis.
"""

from __future__ import annotations

import dataclasses

from fo_jax.config import ModelConfig

FORMATS = ("hf", "reference")

# fo_jax name -> (hf name, reference name, transpose), for the per-layer attention tensors.
_ATTN = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight", False),
    "ffn_norm": ("post_attention_layernorm.weight", "ffn_norm.weight", False),
    "wq_a": ("self_attn.q_a_proj.weight", "attn.wq_a.weight", True),
    "q_norm": ("self_attn.q_a_layernorm.weight", "attn.q_norm.weight", False),
    "wq_b": ("self_attn.q_b_proj.weight", "attn.wq_b.weight", True),
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", "attn.wkv_a.weight", True),
    "kv_norm": ("self_attn.kv_a_layernorm.weight", "attn.kv_norm.weight", False),
    "wkv_b": ("self_attn.kv_b_proj.weight", "attn.wkv_b.weight", True),
    "wo": ("self_attn.o_proj.weight", "attn.wo.weight", True),
}
_INDEXER = {
    "wq_b": ("self_attn.indexer.wq_b.weight", "attn.indexer.wq_b.weight", True),
    "wk": ("self_attn.indexer.wk.weight", "attn.indexer.wk.weight", True),
    "k_norm_w": ("self_attn.indexer.k_norm.weight", "attn.indexer.k_norm.weight", False),
    "k_norm_b": ("self_attn.indexer.k_norm.bias", "attn.indexer.k_norm.bias", False),
    "weights_proj": ("self_attn.indexer.weights_proj.weight",
                     "attn.indexer.weights_proj.weight", True),
}
# SwiGLU matrices: fo_jax w1 / w2 / w3 = HF gate_proj / down_proj / up_proj.
_SWIGLU = {"w1": ("gate_proj", "w1"), "w2": ("down_proj", "w2"), "w3": ("up_proj", "w3")}
_TOP = {
    "embed": ("model.embed_tokens.weight", "embed.weight", False),
    "norm": ("model.norm.weight", "norm.weight", False),
    "head": ("lm_head.weight", "head.weight", True),
}


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: params[path[0]][path[1]]...[index], its last two axes
    swapped if `transpose` ([out, in] -> [in, out])."""

    path: tuple[str, ...]
    index: tuple[int, ...]
    transpose: bool


def tensor_names(config: ModelConfig, fmt: str = "hf") -> dict[str, Slot]:
    """{checkpoint name: Slot} of every tensor `config`'s parameters are made of."""
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format {fmt!r} is not one of {FORMATS}")
    hf = fmt == "hf"
    layer = "model.layers.{}." if hf else "layers.{}."
    mlp = "mlp." if hf else "ffn."
    out = {}
    for key, (h, r, t) in _TOP.items():
        out[h if hf else r] = Slot((key,), (), t)
    for l in range(config.num_layers):
        pre = layer.format(l)
        for key, (h, r, t) in _ATTN.items():
            out[pre + (h if hf else r)] = Slot(("layers", key), (l,), t)
        if l < config.num_dense_layers:
            stack = "dense_mlp" if config.moe else "layers"
            for key, (h, r) in _SWIGLU.items():
                out[f"{pre}{mlp}{h if hf else r}.weight"] = Slot((stack, key), (l,), True)
            continue
        m = l - config.num_dense_layers
        out[f"{pre}{mlp}gate.weight"] = Slot(("moe", "gate"), (m,), True)
        bias = "gate.e_score_correction_bias" if hf else "gate.bias"
        out[f"{pre}{mlp}{bias}"] = Slot(("moe", "gate_bias"), (m,), False)
        for e in range(config.n_routed_experts):
            for key, (h, r) in _SWIGLU.items():
                out[f"{pre}{mlp}experts.{e}.{h if hf else r}.weight"] = Slot(
                    ("moe", key), (m, e), True)
        if config.n_shared_experts:
            for key, (h, r) in _SWIGLU.items():
                out[f"{pre}{mlp}shared_experts.{h if hf else r}.weight"] = Slot(
                    ("moe", "shared_" + key), (m,), True)
    for g, first in enumerate(config.indexer_layers):
        pre = layer.format(first)
        for key, (h, r, t) in _INDEXER.items():
            out[pre + (h if hf else r)] = Slot(("indexer", key), (g,), t)
    return out


def mtp_layer(name: str, config: ModelConfig, fmt: str = "hf") -> bool:
    """Whether `name` belongs to a multi-token-prediction layer (layers L .. L + n - 1)."""
    prefix = "model.layers." if fmt == "hf" else "layers."
    if not name.startswith(prefix):
        return False
    number = name[len(prefix):].split(".", 1)[0]
    return number.isdigit() and (
        config.num_layers <= int(number) < config.num_layers + config.num_nextn_predict_layers)


# fo_jax MTP parameter name -> hf name under the MTP layer's prefix, transpose.
_MTP_EXTRA = {
    "enorm": ("enorm.weight", False),
    "hnorm": ("hnorm.weight", False),
    "eh_proj": ("eh_proj.weight", True),
    "head_norm": ("shared_head.norm.weight", False),
}
# The MTP layer's own copies of the embedding and the head (optional in a checkpoint).
MTP_SHARED = {
    "embed": ("embed_tokens.weight", False),
    "head": ("shared_head.head.weight", True),
}


def mtp_tensor_names(config: ModelConfig, *, own_embed: bool = False,
                     own_head: bool = False) -> dict[str, Slot]:
    """{HF name: Slot} of the multi-token-prediction layers' tensors (layers L .. L + n - 1).

    Slots point into `{"mtp": mtp_params}` (`fo_jax.model.mtp.mtp_param_shapes`): MTP layer k
    is index k of every stack. A decoder layer's tensors keep their main-layer names under
    `model.layers.{L + k}.`; the rest are `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and,
    where the checkpoint stores them, `embed_tokens` and `shared_head.head`.
    """
    from fo_jax.model.mtp import stack_config

    sc = stack_config(config)
    base = config.num_layers
    out = {}
    top = {h for h, _, _ in _TOP.values()}
    for name, slot in tensor_names(sc, "hf").items():
        if name in top:
            continue
        rest = name[len("model.layers."):]
        number, tail = rest.split(".", 1)
        out[f"model.layers.{base + int(number)}.{tail}"] = Slot(("mtp",) + slot.path,
                                                                 slot.index, slot.transpose)
    extra = dict(_MTP_EXTRA)
    if own_embed:
        extra["embed"] = MTP_SHARED["embed"]
    if own_head:
        extra["head"] = MTP_SHARED["head"]
    for k in range(sc.num_layers):
        for key, (h, t) in extra.items():
            out[f"model.layers.{base + k}.{h}"] = Slot(("mtp", key), (k,), t)
    return out

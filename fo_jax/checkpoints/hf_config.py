"""`ModelConfig` from a Hugging Face config.json of DeepSeek-V3.2 or GLM-5 (`GlmMoeDsa`).

Every field of the two architectures is either mapped onto a `ModelConfig` field, checked to
have the one value fo_jax implements, or listed as not changing the forward pass (token ids,
training-only settings, bookkeeping). Any other field is refused by name: fo_jax cannot know
what an unknown field does to the math (`ignore_fields` accepts named ones explicitly).

Mapped fields (config.json -> ModelConfig):
    vocab_size, hidden_size -> dim, num_hidden_layers -> num_layers, num_attention_heads ->
    num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
    intermediate_size -> mlp_hidden, index_n_heads, index_head_dim, index_topk,
    max_position_embeddings -> max_seq_len (unless given), rms_norm_eps -> norm_eps,
    rope_theta (or rope_parameters.rope_theta), YaRN from rope_scaling / rope_parameters
    (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale_all_dim; mscale
    must equal mscale_all_dim, both > 0), indexer_rope_interleave -> index_rope_interleave (default:
    halves for DeepSeek-V3.2, as its reference; interleaved pairs for GLM-5, as transformers'
    GlmMoeDsa, whose config.json does not hold the field), indexer sharing (GLM: indexer_types, or
    index_topk_pattern, or index_topk_freq / index_skip_topk_offset) -> indexer_layers,
    MoE: n_routed_experts, num_experts_per_tok, moe_intermediate_size -> moe_hidden,
    n_shared_experts, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
    first_k_dense_replace; num_nextn_predict_layers (recorded); torch_dtype / dtype -> dtype.
FP8 checkpoints (`quantization_config`) are described by `hf_quantization`, not the config.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fo_jax.config import ModelConfig

ARCHITECTURES = {"DeepseekV32ForCausalLM": "deepseek_v32",
                 "GlmMoeDsaForCausalLM": "glm_moe_dsa"}

# Fields with no effect on the forward pass fo_jax runs.
NO_MATH = frozenset({
    "_name_or_path", "auto_map", "transformers_version", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout", "aux_loss_alpha",
    "seq_aux", "ep_size", "pretraining_tp", "keys_to_ignore_at_inference", "output_router_logits",
    "router_aux_loss_coef", "index_share_for_mtp_iteration", "head_dim", "qk_head_dim",
    "num_key_value_heads", "layer_types", "mlp_layer_types", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "hidden_act", "scoring_func", "topk_method", "moe_layer_freq",
    "rope_interleave", "quantization_config", "model_type", "architectures", "rope_scaling",
    "rope_parameters", "indexer_types", "index_topk_pattern", "index_topk_freq",
    "index_skip_topk_offset", "torch_dtype", "dtype", "moe_router_dtype",
})
# Fields checked to hold the one value fo_jax implements (the default when absent).
REQUIRED = {
    "hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "moe_layer_freq": 1, "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "rope_interleave": True, "moe_router_dtype": "float32",
}
# config.json field -> ModelConfig field, copied as they are.
MAPPED = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "intermediate_size": "mlp_hidden", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "rms_norm_eps": "norm_eps", "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_hidden",
    "n_shared_experts": "n_shared_experts", "n_group": "n_group", "topk_group": "topk_group",
    "norm_topk_prob": "norm_topk_prob", "routed_scaling_factor": "routed_scaling_factor",
    "first_k_dense_replace": "first_k_dense_replace",
    "num_nextn_predict_layers": "num_nextn_predict_layers",
    "indexer_rope_interleave": "index_rope_interleave",
}
ALIASES = ("num_local_experts", "num_experts")
_ROPE_KEYS = frozenset({"type", "rope_type", "factor", "original_max_position_embeddings",
                        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "rope_theta"})
_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def read_hf_config(config: dict | str | os.PathLike) -> dict:
    """The config.json dict: `config` itself, or read from a file or a checkpoint directory."""
    if isinstance(config, dict):
        return dict(config)
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        return json.load(f)


def config_from_hf(config: dict | str | os.PathLike, *, name: str | None = None,
                   max_seq_len: int | None = None, max_ways: int = 4,
                   dtype: str | None = None, kv_dtype: str = "bfloat16",
                   index_fp8: bool = True, ignore_fields: tuple[str, ...] = ()) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face config.json (dict, file or checkpoint directory).

    Args:
      config: the config.json contents, its path, or the checkpoint directory holding it.
      name: the config's name (default: `_name_or_path`, else the model type).
      max_seq_len: the context capacity (default: max_position_embeddings).
      max_ways, kv_dtype, index_fp8: fo_jax settings config.json does not hold (index_fp8:
        the reference indexer's FP8 rounding of q / k).
      dtype: parameters and activations (default: torch_dtype / dtype, else bfloat16).
      ignore_fields: unknown fields to accept anyway (you vouch they leave the math alone).
    Raises:
      ValueError naming the field: an unsupported architecture, an unknown field, or a field
      whose value fo_jax does not implement.
    """
    hf = read_hf_config(config)
    for alias in ALIASES:  # older spellings of n_routed_experts (transformers' attribute_map)
        if alias in hf:
            value = hf.pop(alias)
            if hf.setdefault("n_routed_experts", value) != value:
                raise ValueError(f"config.json {alias}={value} contradicts n_routed_experts="
                                 f"{hf['n_routed_experts']}")
    arch = hf.get("architectures") or []
    if len(arch) != 1 or arch[0] not in ARCHITECTURES:
        raise ValueError(f"config.json architectures={arch!r}: fo_jax loads exactly one of "
                         f"{sorted(ARCHITECTURES)}")
    model_type = hf.get("model_type", ARCHITECTURES[arch[0]])
    if model_type != ARCHITECTURES[arch[0]]:
        raise ValueError(f"config.json model_type={model_type!r} does not match architecture "
                         f"{arch[0]!r} (expected {ARCHITECTURES[arch[0]]!r})")
    unknown = sorted(set(hf) - NO_MATH - set(MAPPED) - {"max_position_embeddings",
                                                        "rope_theta"} - set(ignore_fields))
    if unknown:
        raise ValueError(
            f"config.json fields {unknown} are not implemented by fo_jax and may change the "
            "model's math; if they do not, pass ignore_fields=(...) naming them")
    for field, want in REQUIRED.items():
        if field in hf and hf[field] != want:
            raise ValueError(f"config.json {field}={hf[field]!r} is not supported: fo_jax "
                             f"implements {field}={want!r}")
    if hf.get("q_lora_rank") is None:
        raise ValueError("config.json q_lora_rank=None (a full-rank query projection) is not "
                         "supported: fo_jax needs the low-rank query the indexer reads")
    if hf.get("num_key_value_heads", hf.get("num_attention_heads")) != hf.get(
            "num_attention_heads"):
        raise ValueError(f"config.json num_key_value_heads={hf['num_key_value_heads']} must "
                         f"equal num_attention_heads={hf.get('num_attention_heads')} (MLA)")
    fields: dict[str, Any] = {MAPPED[k]: v for k, v in hf.items() if k in MAPPED}
    # transformers' GlmMoeDsa indexer always rotates interleaved pairs and its config.json has
    # no such field; DeepSeek-V3.2's rotates halves (as its reference).
    fields.setdefault("index_rope_interleave", model_type == "glm_moe_dsa")
    fields.update(_rope_fields(hf))
    num_layers = hf["num_hidden_layers"]
    fields["indexer_layers"] = _indexer_layers(hf, num_layers)
    _check_mlp_layer_types(hf, num_layers)
    dtype = dtype or _DTYPES.get(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    if dtype is None:
        raise ValueError(f"config.json torch_dtype={hf.get('torch_dtype') or hf.get('dtype')!r}"
                         f" is not supported; pass dtype= one of {sorted(_DTYPES)}")
    if not fields.get("n_routed_experts"):
        for key in ("num_experts_per_tok", "moe_hidden", "n_shared_experts",
                    "first_k_dense_replace"):
            fields.pop(key, None)
    max_seq_len = max_seq_len or hf.get("max_position_embeddings", 4096)
    if fields.get("rope_factor", 1.0) > 1 and max_seq_len <= fields["rope_original_seq_len"]:
        raise ValueError(
            f"max_seq_len={max_seq_len} <= original_max_position_embeddings="
            f"{fields['rope_original_seq_len']}: fo_jax (as the DeepSeek reference) applies YaRN "
            "only to contexts longer than the original one, Hugging Face at every length; "
            "choose max_seq_len > original_max_position_embeddings")
    return ModelConfig(
        name=name or hf.get("_name_or_path") or model_type,
        max_seq_len=max_seq_len,
        max_ways=max_ways, dtype=dtype, kv_dtype=kv_dtype, index_fp8=index_fp8, **fields)


def _rope_fields(hf: dict) -> dict:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    extra = sorted(set(scaling) - _ROPE_KEYS)
    if extra:
        raise ValueError(f"config.json rope_scaling fields {extra} are not implemented by "
                         "fo_jax")
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "yarn":
        raise ValueError(f"config.json rope_scaling type={kind!r} is not supported: fo_jax "
                         "implements 'default' and 'yarn'")
    # Hugging Face scales cos / sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    # when both are set and nonzero, else by 0.1 ln(factor) + 1; fo_jax (as the reference)
    # never scales them, which is the first case with mscale == mscale_all_dim.
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not mscale or mscale != mscale_all:
        raise ValueError(
            f"config.json rope_scaling mscale={mscale}, mscale_all_dim={mscale_all}: fo_jax "
            "implements YaRN with mscale == mscale_all_dim > 0 (DeepSeek-V3.2: 1.0, 1.0); "
            "other values scale cos / sin, which it does not implement")
    original = int(scaling.get("original_max_position_embeddings", 4096))
    out.update(rope_factor=float(scaling["factor"]), rope_original_seq_len=original,
               rope_beta_fast=float(scaling.get("beta_fast", 32.0)),
               rope_beta_slow=float(scaling.get("beta_slow", 1.0)),
               rope_mscale=float(mscale_all))
    return out


def _indexer_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """The layers that run their own indexer ("full"); the others reuse the last one's top-k."""
    kinds = hf.get("indexer_types")
    pattern = hf.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if kinds is None and ("index_topk_freq" in hf or "index_skip_topk_offset" in hf):
        freq = max(int(hf.get("index_topk_freq") or 1), 1)
        offset = int(hf.get("index_skip_topk_offset", 2) or 0)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(num_layers)]
    if kinds is None:
        return tuple(range(num_layers))
    kinds = list(kinds)
    if len(kinds) != num_layers or set(kinds) - {"full", "shared"}:
        raise ValueError(f"config.json indexer_types={kinds!r} must give 'full' or 'shared' for "
                         f"each of the {num_layers} layers")
    if kinds[0] != "full":
        raise ValueError("config.json indexer_types: layer 0 must be 'full' (it has no earlier "
                         "indexer to share)")
    return tuple(i for i, kind in enumerate(kinds) if kind == "full")


def _check_mlp_layer_types(hf: dict, num_layers: int) -> None:
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return
    dense = hf.get("first_k_dense_replace", 0) if hf.get("n_routed_experts") else num_layers
    want = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    if list(kinds) != want:
        raise ValueError(f"config.json mlp_layer_types={list(kinds)!r}: fo_jax implements "
                         f"the first first_k_dense_replace={dense} layers dense and the rest "
                         f"MoE ({want!r})")


def hf_quantization(config: dict | str | os.PathLike) -> tuple[int, int] | None:
    """The FP8 block (rows, cols) of a checkpoint's `quantization_config`, None if unquantised.

    Supported: quant_method "fp8", fmt "e4m3", weight_block_size [128, 128] (any block shape
    is read), activation_scheme "dynamic" (activations are not quantised by fo_jax).
    """
    hf = read_hf_config(config)
    q = hf.get("quantization_config")
    if not q:
        return None
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    if method != "fp8" or fmt != "e4m3":
        raise ValueError(f"config.json quantization_config quant_method={method!r}, fmt={fmt!r}"
                         " is not supported: fo_jax reads FP8 e4m3 block-scaled weights "
                         "(quant_method 'fp8', fmt 'e4m3')")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"config.json quantization_config weight_block_size={block!r}: "
                         "expected [rows, cols] (DeepSeek: [128, 128])")
    return int(block[0]), int(block[1])

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
    must equal mscale_all_dim, both > 0; absent or null, they take transformers' values:
    original_max_position_embeddings = max_position_embeddings, factor =
    max_position_embeddings / original_max_position_embeddings, beta_fast 32, beta_slow 1),
    indexer_rope_interleave -> index_rope_interleave (default: halves for DeepSeek-V3.2, as its
    reference; interleaved pairs for GLM-5, as transformers' GlmMoeDsa, whose config.json does
    not hold the field), indexer sharing (GLM: indexer_types, or index_topk_pattern, or
    index_topk_freq / index_skip_topk_offset) -> indexer_layers,
    MoE: n_routed_experts, num_experts_per_tok, moe_intermediate_size -> moe_hidden,
    n_shared_experts, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
    first_k_dense_replace; num_nextn_predict_layers (recorded); torch_dtype / dtype -> dtype.
FP8 checkpoints (`quantization_config`) are described by `hf_quantization` (the block) and
`hf_scale_fmt` (the activations' scale format), not the config.

Checked before anything is built, each refusal one line naming the file and the field (what
came, what was expected): the file must hold a JSON object, the sizes in NEEDED must be there
(fo_jax does not guess them), every mapped value must have its type and range (an int >= 1 for
sizes, >= 0 for counts, a finite number > 0 for eps, scales and rope_theta, true / false for
flags), and what `ModelConfig` refuses (an index_head_dim not a power of two, ...) is reported
with the file, in config.json's names.
"""

from __future__ import annotations

import json
import math
import os
import re
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
# The sizes every config.json must give (no default that could be right for a checkpoint).
NEEDED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "intermediate_size", "index_n_heads", "index_head_dim", "index_topk")
# The type (and range) of each mapped number; MoE-only ones are checked when the model has MoE.
_KINDS = {
    **{key: "size" for key in NEEDED + ("max_position_embeddings",)},
    **{key: "count" for key in ("n_routed_experts", "num_experts_per_tok",
                                "moe_intermediate_size", "n_shared_experts", "n_group",
                                "topk_group", "first_k_dense_replace",
                                "num_nextn_predict_layers")},
    **{key: "positive" for key in ("rms_norm_eps", "routed_scaling_factor", "rope_theta")},
    "norm_topk_prob": "bool", "indexer_rope_interleave": "bool",
}
MAX_LAYERS = 4096  # num_hidden_layers above this is refused as a typo, not built
_MOE_ONLY = ("num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
             "first_k_dense_replace")
_EXPECTED = {"size": "an int >= 1", "count": "an int >= 0", "count?": "an int >= 0 or null",
             "positive": "a finite number > 0", "number": "a finite number",
             "factor": "a finite number >= 1", "bool": "true or false"}


def read_json(path: str | os.PathLike,
              expected: str = 'config fields ({"architectures": [...], ...})') -> dict:
    """The JSON object in file `path`; ValueError naming the file if it is not one (`expected`
    says what it should hold)."""
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object of {expected}, got a "
                         f"{type(value).__name__}")
    return value


def _read(config: dict | str | os.PathLike) -> tuple[dict, str]:
    """(the config.json dict, how messages name it: its path, or "config.json" for a dict)."""
    if isinstance(config, dict):
        return dict(config), "config.json"
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    return read_json(path), path


def read_hf_config(config: dict | str | os.PathLike) -> dict:
    """The config.json dict: `config` itself, or read from a file or a checkpoint directory
    (ValueError naming the file if it is not a JSON object)."""
    return _read(config)[0]


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
      ValueError naming the file and the field (one line: what came, what was expected): an
      unsupported architecture, an unknown field, a missing size (NEEDED), a value of the wrong
      type or range, or a value fo_jax does not implement.
    """
    hf, where = _read(config)
    for alias in ALIASES:  # older spellings of n_routed_experts (transformers' attribute_map)
        if alias in hf:
            value = hf.pop(alias)
            if hf.setdefault("n_routed_experts", value) != value:
                raise ValueError(f"{where} {alias}={value} contradicts n_routed_experts="
                                 f"{hf['n_routed_experts']}")
    arch = hf.get("architectures") or []
    if not (isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str)
            and arch[0] in ARCHITECTURES):
        raise ValueError(f"{where} architectures={_show(arch)}: fo_jax loads exactly one of "
                         f"{sorted(ARCHITECTURES)}")
    model_type = hf.get("model_type", ARCHITECTURES[arch[0]])
    if model_type != ARCHITECTURES[arch[0]]:
        raise ValueError(f"{where} model_type={_show(model_type)} does not match architecture "
                         f"{arch[0]!r} (expected {ARCHITECTURES[arch[0]]!r})")
    unknown = sorted(set(hf) - NO_MATH - set(MAPPED) - {"max_position_embeddings",
                                                        "rope_theta"} - set(ignore_fields))
    if unknown:
        raise ValueError(
            f"{where} fields {unknown} are not implemented by fo_jax and may change the "
            "model's math; if they do not, pass ignore_fields=(...) naming them")
    for field, want in REQUIRED.items():
        if field in hf and (type(hf[field]) is not type(want) or hf[field] != want):
            raise ValueError(f"{where} {field}={_show(hf[field])} is not supported: fo_jax "
                             f"implements {field}={want!r}")
    missing = sorted(set(NEEDED) - set(hf))
    if missing:
        raise ValueError(f"{where} lacks {missing}: fo_jax builds the model from these sizes "
                         "and does not guess them; add them as the checkpoint's own config.json "
                         "gives them")
    if hf["q_lora_rank"] is None:
        raise ValueError(f"{where} q_lora_rank=None (a full-rank query projection) is not "
                         "supported: fo_jax needs the low-rank query the indexer reads")
    moe = bool(hf.get("n_routed_experts"))
    for key, kind in _KINDS.items():
        if key in hf and (moe or key not in _MOE_ONLY):
            _check(where, key, hf[key], kind)
    if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        raise ValueError(f"{where} num_key_value_heads={_show(hf['num_key_value_heads'])} must "
                         f"equal num_attention_heads={hf['num_attention_heads']} (MLA)")
    fields: dict[str, Any] = {MAPPED[k]: v for k, v in hf.items() if k in MAPPED}
    # transformers' GlmMoeDsa indexer always rotates interleaved pairs and its config.json has
    # no such field; DeepSeek-V3.2's rotates halves (as its reference).
    fields.setdefault("index_rope_interleave", model_type == "glm_moe_dsa")
    fields.update(_rope_fields(hf, where))
    num_layers = hf["num_hidden_layers"]
    if num_layers > MAX_LAYERS:  # per-layer tables are built below: 10**9 would hang here
        raise ValueError(f"{where} num_hidden_layers={num_layers} is above {MAX_LAYERS}: no "
                         "DSA model has that many (DeepSeek-V3.2 has 61, GLM-5.2 78); check "
                         "the value")
    fields["indexer_layers"] = _indexer_layers(hf, num_layers, where)
    _check_mlp_layer_types(hf, num_layers, where)
    stored = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    dtype = dtype or (_DTYPES.get(stored) if isinstance(stored, str) else None)
    if dtype is None:
        raise ValueError(f"{where} torch_dtype={_show(stored)} is not supported; pass dtype= "
                         f"one of {sorted(_DTYPES)}")
    if not moe:
        for key in ("num_experts_per_tok", "moe_hidden", "n_shared_experts",
                    "first_k_dense_replace"):
            fields.pop(key, None)
    max_seq_len = max_seq_len or hf.get("max_position_embeddings", 4096)
    if fields.get("rope_factor", 1.0) > 1 and max_seq_len <= fields["rope_original_seq_len"]:
        raise ValueError(
            f"{where}: max_seq_len={max_seq_len} <= original_max_position_embeddings="
            f"{fields['rope_original_seq_len']}: fo_jax (as the DeepSeek reference) applies "
            "YaRN only to contexts longer than the original one, Hugging Face at every length; "
            "choose max_seq_len > original_max_position_embeddings")
    if name is None:  # _name_or_path is bookkeeping: used only if it is a name
        stored = hf.get("_name_or_path")
        name = stored if isinstance(stored, str) and stored else model_type
    try:
        return ModelConfig(name=name, max_seq_len=max_seq_len, max_ways=max_ways, dtype=dtype,
                           kv_dtype=kv_dtype, index_fp8=index_fp8, **fields)
    except ValueError as err:  # a relation between fields: say it in config.json's names
        renamed = [f"{field} is config.json's {key}" for key, field in MAPPED.items()
                   if key != field and re.search(rf"\b{field}\b", str(err))]
        raise ValueError(f"{where}: {err}" + (f" ({', '.join(renamed)})" if renamed else "")
                         ) from None


def _show(value) -> str:
    """repr(value), cut to 80 characters (messages stay one short line)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _valid(value, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "count?" and value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind in ("size", "count", "count?"):
        return isinstance(value, int) and value >= (1 if kind == "size" else 0)
    if not math.isfinite(value):
        return False
    return {"number": True, "positive": value > 0, "factor": value >= 1}[kind]


def _check(where: str, key: str, value, kind: str) -> None:
    """ValueError naming `key` unless `value` is of `kind` (see _EXPECTED)."""
    if not _valid(value, kind):
        raise ValueError(f"{where} {key}={_show(value)} must be {_EXPECTED[kind]}, got a "
                         f"{type(value).__name__}")


def _rope_fields(hf: dict, where: str) -> dict:
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get(key) or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"{where} {key}={_show(scaling)} must be an object "
                         '({"rope_type": "yarn", "factor": ...} or {"rope_type": "default"})')
    extra = sorted(set(scaling) - _ROPE_KEYS)
    if extra:
        raise ValueError(f"{where} {key} fields {extra} are not implemented by fo_jax")
    if "rope_theta" in scaling:
        _check(where, f"{key}.rope_theta", scaling["rope_theta"], "positive")
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "yarn":
        raise ValueError(f"{where} {key} type={_show(kind)} is not supported: fo_jax "
                         "implements 'default' and 'yarn'")
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if scaling.get(name) is not None:
            _check(where, f"{key}.{name}", scaling[name], "number")
    # Hugging Face scales cos / sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    # when both are set and nonzero, else by 0.1 ln(factor) + 1; fo_jax (as the reference)
    # never scales them, which is the first case with mscale == mscale_all_dim.
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not mscale or mscale != mscale_all:
        raise ValueError(
            f"{where} {key} mscale={mscale}, mscale_all_dim={mscale_all}: fo_jax "
            "implements YaRN with mscale == mscale_all_dim > 0 (DeepSeek-V3.2: 1.0, 1.0); "
            "other values scale cos / sin, which it does not implement")
    # As transformers (RotaryEmbeddingConfigMixin, _compute_yarn_parameters): an absent
    # original_max_position_embeddings is max_position_embeddings, a null factor is
    # max_position_embeddings / original_max_position_embeddings, a null beta its default.
    longest = hf.get("max_position_embeddings", 4096)
    original = scaling.get("original_max_position_embeddings", longest)
    _check(where, f"{key}.original_max_position_embeddings", original, "size")
    if "factor" not in scaling:
        raise ValueError(f"{where} {key} has no factor: YaRN needs one (as in transformers; "
                         "null derives it as max_position_embeddings / "
                         "original_max_position_embeddings)")
    factor = scaling["factor"]
    if factor is None:
        factor = longest / original
        if factor < 1:
            raise ValueError(
                f"{where} {key}.factor=None derives max_position_embeddings / "
                f"original_max_position_embeddings = {longest} / {original} = {factor}, which "
                "must be >= 1 (YaRN stretches the original context)")
    _check(where, f"{key}.factor", factor, "factor")
    out.update(rope_factor=float(factor), rope_original_seq_len=original,
               rope_beta_fast=float(scaling.get("beta_fast") or 32.0),
               rope_beta_slow=float(scaling.get("beta_slow") or 1.0),
               rope_mscale=float(mscale_all))
    return out


def _indexer_layers(hf: dict, num_layers: int, where: str) -> tuple[int, ...]:
    """The layers that run their own indexer ("full"); the others reuse the last one's top-k."""
    kinds = hf.get("indexer_types")
    pattern = hf.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        if not isinstance(pattern, str):
            raise ValueError(f"{where} index_topk_pattern={_show(pattern)} must be a string of "
                             f"'F' (full) and 'S' (shared), one per layer ({num_layers})")
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if kinds is None and ("index_topk_freq" in hf or "index_skip_topk_offset" in hf):
        for key in ("index_topk_freq", "index_skip_topk_offset"):
            _check(where, key, hf.get(key), "count?")
        freq = max(hf.get("index_topk_freq") or 1, 1)
        offset = hf.get("index_skip_topk_offset", 2) or 0
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(num_layers)]
    if kinds is None:
        return tuple(range(num_layers))
    if (not isinstance(kinds, list) or len(kinds) != num_layers
            or not all(kind in ("full", "shared") for kind in kinds)):
        raise ValueError(f"{where} indexer_types={_show(kinds)} must give 'full' or 'shared' "
                         f"for each of the {num_layers} layers")
    if kinds[0] != "full":
        raise ValueError(f"{where} indexer_types: layer 0 must be 'full' (it has no earlier "
                         "indexer to share)")
    return tuple(i for i, kind in enumerate(kinds) if kind == "full")


def indexer_fields(hf: dict) -> str:
    """The config.json fields that place the indexers, as "key=value, ..." (for messages)."""
    for key in ("indexer_types", "index_topk_pattern"):
        if hf.get(key) is not None:
            return f"{key}={_show(hf[key])}"
    if "index_topk_freq" in hf or "index_skip_topk_offset" in hf:
        return ", ".join(f"{key}={hf[key]!r}" if key in hf else f"{key}={default} (default)"
                         for key, default in (("index_topk_freq", 1),
                                              ("index_skip_topk_offset", 2)))
    return ("none of indexer_types, index_topk_pattern, index_topk_freq (an indexer in every "
            "layer)")


def _check_mlp_layer_types(hf: dict, num_layers: int, where: str) -> None:
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return
    dense = hf.get("first_k_dense_replace", 0) if hf.get("n_routed_experts") else num_layers
    want = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    if kinds != want:
        raise ValueError(f"{where} mlp_layer_types={_show(kinds)}: fo_jax implements the "
                         f"first first_k_dense_replace={dense} layers dense and the rest MoE "
                         f"({_show(want)})")


def hf_quantization(config: dict | str | os.PathLike) -> tuple[int, int] | None:
    """The FP8 block (rows, cols) of a checkpoint's `quantization_config`, None if unquantised.

    Supported: quant_method "fp8", fmt "e4m3", weight_block_size [128, 128] (any block shape
    is read), activation_scheme "dynamic" (activations are not quantised by fo_jax).
    """
    hf, where = _read(config)
    q = hf.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{where} quantization_config={_show(q)} must be an object "
                         '({"quant_method": "fp8", "weight_block_size": [128, 128], ...})')
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    if method != "fp8" or fmt != "e4m3":
        raise ValueError(f"{where} quantization_config quant_method={_show(method)}, fmt="
                         f"{_show(fmt)} is not supported: fo_jax reads FP8 e4m3 block-scaled "
                         "weights (quant_method 'fp8', fmt 'e4m3')")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(_valid(n, "size") for n in block)):
        raise ValueError(f"{where} quantization_config weight_block_size={_show(block)}: "
                         "expected [rows, cols], two ints >= 1 (DeepSeek: [128, 128])")
    return block[0], block[1]


SCALE_FORMATS = (None, "ue8m0")


def hf_scale_fmt(config: dict | str | os.PathLike) -> str | None:
    """The activation scale format of an FP8 checkpoint's `quantization_config`: None (scales
    amax / 448) or "ue8m0" (powers of two, DeepSeek-V3.2's); None when unquantised."""
    hf, where = _read(config)
    q = hf.get("quantization_config")
    if not q or not isinstance(q, dict):
        return None
    fmt = q.get("scale_fmt")
    if fmt not in SCALE_FORMATS:
        raise ValueError(f"{where} quantization_config scale_fmt={_show(fmt)} is not supported: "
                         f"expected one of {SCALE_FORMATS} (absent: null)")
    return fmt

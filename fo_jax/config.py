"""Model configuration: one frozen dataclass, validated on creation, and named presets.

`ModelConfig` describes a DeepSeek-V3.2-style sparse-attention ("DSA") model: MLA attention with a
compressed KV row of `kv_lora_rank + qk_rope_head_dim` values per token and layer, a lightning
indexer that picks `index_topk` tokens per query, and indexer sharing across groups of
consecutive layers (GLM-5.2 style).

Presets:
  * `tiny`: tests (4 layers, 2 indexer groups, top-k 16, widths of a few dozen).
  * `trained-small`: the shapes `experiments/training/train.py` trains (a 2048-id byte-level BPE,
    4 layers, width 256, 2 indexer groups, top-k 128, trained on 2048-token windows).
  * `small`: CPU benchmarks (wide enough that indexer and attention costs are realistic
    relative to each other, long context).
  * `deepseek_v32`, `glm5`, `glm52`: the real shapes, used for planning and shape checks only
    (no weights ship with the project).
  * `deepseek_v32_width`: DeepSeek-V3.2's widths with 4 layers (1 dense, 3 MoE), for real-width
    runs on an accelerator with random FP8 weights.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16", "float16")
KV_FORMATS = ("bf16", "fp8_ds_mla")
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a DSA model.

    Attributes:
      name: preset name (for messages and reports).
      vocab_size: V.
      dim: E, the residual width.
      num_layers: L.
      num_heads: H, attention heads.
      q_lora_rank: rank of the query low-rank state (the indexer reads it too).
      kv_lora_rank: D, the latent width stored in the cache (512 in the real models).
      qk_nope_head_dim: per-head query/key width without RoPE.
      qk_rope_head_dim: R, the RoPE key width stored in the cache (64 in the real models).
      v_head_dim: per-head value width after up-projection.
      mlp_hidden: hidden width of the (dense, SwiGLU) MLP.
      index_n_heads: I, indexer heads.
      index_head_dim: N, indexer head width (a power of two: the Hadamard rotation needs it).
      index_topk: K, tokens each query attends to.
      indexer_layers: the first layer of each indexer group, strictly increasing, starting at 0.
        Layer l belongs to the last group whose first layer is <= l, and attends to that group's
        top-k. `tuple(range(L))` is one indexer per layer (DeepSeek-V3.2).
      max_seq_len: S, the context capacity of a request.
      max_ways: the largest W a decode step accepts (multi-token prediction: 1 + drafts).
      dtype: parameters and activations.
      kv_dtype: the KV cache (in the "bf16" kv_format) and the indexer keys.
      kv_format: how a KV row is stored: "bf16", D + R values in kv_dtype; "fp8_ds_mla",
        DeepSeek's FP8 layout, D float8_e4m3fn latent values, D / min(128, D) float32
        power-of-two scales and R bfloat16 RoPE values in one uint8 row of `kv_row_width`
        bytes (656 at D = 512, R = 64; fo_jax.model.kv_format). The indexer keys stay kv_dtype.
      index_fp8: simulate FP8 (e4m3) indexer q/k with power-of-two scales per 128 values.
      rope_theta: RoPE base.
      norm_eps: RMSNorm / LayerNorm epsilon.
      index_rope_interleave: the indexer rotates interleaved pairs (2i, 2i+1) like MLA (GLM-5,
        `indexer_rope_interleave` in its config.json) instead of halves (i, i + R/2)
        (DeepSeek-V3.2's reference indexer).
      rope_factor: YaRN factor s (1.0: plain RoPE). YaRN applies iff s > 1 and
        max_seq_len > rope_original_seq_len (`yarn_active`), as in the DeepSeek reference.
      rope_original_seq_len, rope_beta_fast, rope_beta_slow, rope_mscale: the other YaRN
        parameters (reference `ModelArgs`: original_seq_len, beta_fast, beta_slow, mscale;
        Hugging Face `rope_scaling`: original_max_position_embeddings, beta_fast, beta_slow,
        mscale_all_dim). Under YaRN both RoPEs (MLA and indexer) use the rescaled frequencies and
        the attention scale is multiplied by (0.1 * rope_mscale * ln(rope_factor) + 1)^2.
      n_routed_experts: X, routed experts of each MoE layer; 0 (the default) makes every layer's
        MLP dense (SwiGLU of width `mlp_hidden`).
      num_experts_per_tok: experts each token is routed to (the MoE top-k).
      moe_hidden: hidden width of each routed expert (`moe_intermediate_size`).
      n_shared_experts: experts every token goes through; one SwiGLU of width
        `n_shared_experts * moe_hidden`.
      n_group, topk_group: group-limited routing: the X experts form `n_group` groups of
        consecutive experts and a token picks its experts from its `topk_group` best groups.
      norm_topk_prob: divide the chosen experts' sigmoid scores by their sum.
      routed_scaling_factor: multiplies the routed experts' weights.
      first_k_dense_replace: the first this many layers keep a dense MLP; the others are MoE.
      num_nextn_predict_layers: multi-token-prediction layers stored with the checkpoint
        (recorded; the forward passes do not run them).
    """

    name: str
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mlp_hidden: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_layers: tuple[int, ...]
    max_seq_len: int
    max_ways: int = 4
    dtype: str = "float32"
    kv_dtype: str = "bfloat16"
    kv_format: str = "bf16"
    index_fp8: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    index_rope_interleave: bool = False
    rope_factor: float = 1.0
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_hidden: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0

    def __post_init__(self):
        # Normalise lists given by callers into tuples (frozen dataclass: object.__setattr__).
        object.__setattr__(self, "indexer_layers", tuple(int(x) for x in self.indexer_layers))
        positive = (
            "vocab_size", "dim", "num_layers", "num_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mlp_hidden", "index_n_heads",
            "index_head_dim", "index_topk", "max_seq_len", "max_ways",
        )
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        for field in ("dtype", "kv_dtype"):
            if getattr(self, field) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{field}={getattr(self, field)!r} is not supported; "
                    f"use one of {_DTYPES}"
                )
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"ModelConfig.kv_format={self.kv_format!r} is not supported; use "
                             f"one of {KV_FORMATS}")
        if self.kv_format == "fp8_ds_mla":
            d = self.kv_lora_rank
            if d > 128 and d % 128:
                raise ValueError(
                    f"kv_format='fp8_ds_mla' needs kv_lora_rank % 128 == 0 when kv_lora_rank > "
                    f"128 (one float32 scale per 128 latent values), got kv_lora_rank={d}; use "
                    f"{(d // 128) * 128} or {(d // 128 + 1) * 128}, or kv_format='bf16'")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE pairs)")
        n = self.index_head_dim
        if n & (n - 1):
            raise ValueError(
                f"index_head_dim={n} must be a power of two (the indexer's Hadamard rotation "
                f"needs one); try {1 << max(n.bit_length() - 1, 0)} or {1 << n.bit_length()}"
            )
        if self.qk_rope_head_dim > n:
            raise ValueError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be <= index_head_dim={n}: the "
                "indexer rotates its first qk_rope_head_dim dims"
            )
        layers = self.indexer_layers
        if not layers or layers[0] != 0:
            raise ValueError(f"indexer_layers={layers} must start with layer 0")
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ValueError(f"indexer_layers={layers} must be strictly increasing")
        if layers[-1] >= self.num_layers:
            raise ValueError(
                f"indexer_layers={layers} names layer {layers[-1]} but num_layers={self.num_layers}"
            )
        if self.max_seq_len >= INT32_MAX // max(self.max_ways, 1):
            raise ValueError(f"max_seq_len={self.max_seq_len} overflows int32 token indices")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be > 0")
        self._check_rope()
        self._check_moe()

    def _check_moe(self) -> None:
        for field in ("n_routed_experts", "num_experts_per_tok", "moe_hidden", "n_shared_experts",
                      "first_k_dense_replace", "num_nextn_predict_layers", "n_group",
                      "topk_group"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{field} must be an int >= 0, got {value!r}")
        if not self.moe:
            moe_only = ("num_experts_per_tok", "moe_hidden", "n_shared_experts",
                        "first_k_dense_replace")
            set_ = [f"{f}={getattr(self, f)}" for f in moe_only if getattr(self, f)]
            if set_:
                raise ValueError(
                    f"{', '.join(set_)} describe MoE layers but n_routed_experts=0 (every MLP "
                    "dense); set n_routed_experts > 0 or leave these at 0")
            return
        x, k = self.n_routed_experts, self.num_experts_per_tok
        if self.moe_hidden < 1:
            raise ValueError(f"moe_hidden={self.moe_hidden} must be >= 1 with "
                             f"n_routed_experts={x}")
        if self.n_group < 1 or x % self.n_group:
            raise ValueError(f"n_group={self.n_group} must be >= 1 and divide "
                             f"n_routed_experts={x}")
        per_group = x // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(
                f"n_group={self.n_group} leaves {per_group} expert per group; group-limited "
                "routing scores a group by its two best experts, so each group needs >= 2")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group="
                             f"{self.n_group}]")
        if not 1 <= k <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={k} must be in [1, {self.topk_group * per_group}] (the "
                f"experts of topk_group={self.topk_group} groups of {per_group})")
        if self.first_k_dense_replace > self.num_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be <= "
                             f"num_layers={self.num_layers}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor={self.routed_scaling_factor} must be > 0")

    def _check_rope(self) -> None:
        if not self.rope_theta > 1:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 1")
        if not self.rope_factor >= 1:
            raise ValueError(f"rope_factor={self.rope_factor} must be >= 1 (1.0 turns YaRN off)")
        n = self.rope_original_seq_len
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"rope_original_seq_len must be a positive int, got {n!r}")
        if not self.rope_beta_fast > self.rope_beta_slow > 0:
            raise ValueError(
                f"YaRN needs rope_beta_fast > rope_beta_slow > 0, got "
                f"rope_beta_fast={self.rope_beta_fast}, rope_beta_slow={self.rope_beta_slow}")
        if not self.rope_mscale >= 0:
            raise ValueError(f"rope_mscale={self.rope_mscale} must be >= 0")

    # Derived sizes ----------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        """G: the number of indexer groups (indexer layers)."""
        return len(self.indexer_layers)

    @property
    def group_bounds(self) -> tuple[tuple[int, int], ...]:
        """(first layer, end layer) of each group; layers [first, end) share one top-k."""
        ends = self.indexer_layers[1:] + (self.num_layers,)
        return tuple(zip(self.indexer_layers, ends))

    @property
    def layer_group(self) -> tuple[int, ...]:
        """The group of each layer."""
        out = []
        for g, (lo, hi) in enumerate(self.group_bounds):
            out += [g] * (hi - lo)
        return tuple(out)

    @property
    def moe(self) -> bool:
        """Whether the model has MoE layers (n_routed_experts > 0)."""
        return self.n_routed_experts > 0

    @property
    def num_dense_layers(self) -> int:
        """Layers [0, num_dense_layers) have a dense MLP, the others (if any) are MoE."""
        return self.first_k_dense_replace if self.moe else self.num_layers

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def mlp_ranges(self, lo: int, hi: int) -> tuple[tuple[int, int, bool], ...]:
        """Layers [lo, hi) cut into runs of one MLP kind: ((start, end, is_moe), ...), empty
        runs left out (dense layers come first)."""
        cut = min(max(self.num_dense_layers, lo), hi)
        runs = ((lo, cut, False), (cut, hi, True))
        return tuple(r for r in runs if r[0] < r[1])

    @property
    def yarn_active(self) -> bool:
        """YaRN rescales RoPE: a factor > 1 and a context longer than the original one."""
        return self.rope_factor > 1.0 and self.max_seq_len > self.rope_original_seq_len

    @property
    def kv_width(self) -> int:
        """D + R: values stored per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def jnp_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def jnp_kv_dtype(self) -> Any:
        return jnp.dtype(self.kv_dtype)

    @property
    def kv_row_width(self) -> int:
        """The last axis of a stored KV row: D + R values ("bf16"), or
        Y = D + 4 D / min(128, D) + 2 R bytes ("fp8_ds_mla": 656 at D = 512, R = 64)."""
        if self.kv_format == "fp8_ds_mla":
            d = self.kv_lora_rank
            return d + 4 * (d // min(128, d)) + 2 * self.qk_rope_head_dim
        return self.kv_width

    @property
    def kv_row_dtype(self) -> Any:
        """The dtype of stored KV rows: kv_dtype ("bf16") or uint8 ("fp8_ds_mla")."""
        return jnp.dtype(jnp.uint8) if self.kv_format == "fp8_ds_mla" else self.jnp_kv_dtype

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's KV row in one layer (1,152 in bf16, 656 in fp8_ds_mla at real
        size)."""
        return self.kv_row_width * self.kv_row_dtype.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers: L * kv_row_bytes."""
        return self.num_layers * self.kv_row_bytes

    @property
    def index_bytes_per_token(self) -> int:
        """Indexer-key bytes of one token over all groups: G * N * bytes."""
        return self.num_groups * self.index_head_dim * self.jnp_kv_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """kappa = L * kv_row_bytes + G * N * bytes_per_elem."""
        return self.kv_bytes_per_token + self.index_bytes_per_token

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def balanced_groups(num_layers: int, num_groups: int) -> tuple[int, ...]:
    """First layers of `num_groups` consecutive groups whose sizes differ by at most one.

    Larger groups come first: 78 layers in 21 groups -> 15 groups of 4, then 6 of 3.
    """
    if not 1 <= num_groups <= num_layers:
        raise ValueError(f"{num_groups=} must be in [1, {num_layers=}]")
    base, extra = divmod(num_layers, num_groups)
    starts, at = [], 0
    for g in range(num_groups):
        starts.append(at)
        at += base + (1 if g < extra else 0)
    return tuple(starts)


# The MoE of DeepSeek-V3.2 and GLM-5 (their config.json): n_routed_experts 256,
# num_experts_per_tok 8, moe_intermediate_size 2048, n_shared_experts 1, first_k_dense_replace 3,
# routed_scaling_factor 2.5, norm_topk_prob true.
_REAL_MOE = dict(n_routed_experts=256, num_experts_per_tok=8, moe_hidden=2048,
                 n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
                 norm_topk_prob=True)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, dim=64, num_layers=4, num_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mlp_hidden=128, index_n_heads=4, index_head_dim=16, index_topk=16,
        indexer_layers=(0, 2), max_seq_len=1024, max_ways=4,
    ),
    # tiny with MoE layers (8 routed experts of 32, 2 per token, one shared expert, the first
    # layer dense): the expert-parallel tests and runs on simulated devices.
    "tiny_moe": ModelConfig(
        name="tiny_moe", vocab_size=256, dim=64, num_layers=4, num_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mlp_hidden=128, index_n_heads=4, index_head_dim=16, index_topk=16,
        indexer_layers=(0, 2), max_seq_len=1024, max_ways=4, n_routed_experts=8,
        num_experts_per_tok=2, moe_hidden=32, n_shared_experts=1, first_k_dense_replace=1,
    ),
    "small": ModelConfig(
        name="small", vocab_size=1024, dim=512, num_layers=4, num_heads=8, q_lora_rank=256,
        kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        mlp_hidden=1024, index_n_heads=8, index_head_dim=64, index_topk=512,
        indexer_layers=(0, 2), max_seq_len=131072, max_ways=4,
    ),
    # The model `experiments/training/train.py` trains on 2 CPU cores (fo_jax.training): BPE tokens,
    # 4 layers in 2 indexer groups, top-k 128 of a 2048-token training context (4x room).
    "trained-small": ModelConfig(
        name="trained-small", vocab_size=2048, dim=256, num_layers=4, num_heads=4,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=64, mlp_hidden=768, index_n_heads=4, index_head_dim=64, index_topk=128,
        indexer_layers=(0, 2), max_seq_len=8192, max_ways=4, kv_dtype="bfloat16",
    ),
    # DeepSeek-V3.2: 61 layers, one indexer per layer, MLA 512 + 64, 64 indexer heads of 128;
    # YaRN as its config.json (factor 40 over 4096 original positions, beta 32 / 1, mscale 1);
    # 3 dense layers, then 58 MoE layers of 256 routed experts of 2048 (8 per token, from the
    # 4 best of 8 groups) and one shared expert: 671 B parameters.
    "deepseek_v32": ModelConfig(
        name="deepseek_v32", vocab_size=129280, dim=7168, num_layers=61, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mlp_hidden=18432, index_n_heads=64, index_head_dim=128,
        index_topk=2048, indexer_layers=tuple(range(61)), max_seq_len=163840,
        dtype="bfloat16", kv_dtype="bfloat16", index_fp8=True,
        rope_factor=40.0, rope_original_seq_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
        rope_mscale=1.0, **_REAL_MOE, n_group=8, topk_group=4,
    ),
    # GLM-5: 78 layers of MLA 512 + 64 with an indexer in every layer; the indexer's RoPE is
    # interleaved (`indexer_rope_interleave: true`); 3 dense layers, then 75 MoE layers of 256
    # routed experts of 2048 (8 per token, no groups) and one shared expert: 744 B parameters.
    "glm5": ModelConfig(
        name="glm5", vocab_size=154880, dim=6144, num_layers=78, num_heads=64,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, mlp_hidden=12288, index_n_heads=32, index_head_dim=128,
        index_topk=2048, indexer_layers=tuple(range(78)), max_seq_len=1_048_576,
        dtype="bfloat16", kv_dtype="bfloat16", index_fp8=True, index_rope_interleave=True,
        **_REAL_MOE,
    ),
    # GLM-5.2: as GLM-5, but 21 indexer layers shared by groups of consecutive layers.
    "glm52": ModelConfig(
        name="glm52", vocab_size=154880, dim=6144, num_layers=78, num_heads=64,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, mlp_hidden=12288, index_n_heads=32, index_head_dim=128,
        index_topk=2048, indexer_layers=balanced_groups(78, 21), max_seq_len=1_048_576,
        dtype="bfloat16", kv_dtype="bfloat16", index_fp8=True, index_rope_interleave=True,
        **_REAL_MOE,
    ),
}


# DeepSeek-V3.2 at its real width with 4 of its 61 layers (1 dense, 3 MoE: 256 experts of
# 2048, k = 2048, an indexer per layer): the accelerator's real-width runs
# (experiments/decode/real_width.py, random FP8 weights from `fo_jax.model.dsa.init_fp8_params`).
PRESETS["deepseek_v32_width"] = PRESETS["deepseek_v32"].replace(
    name="deepseek_v32_width", num_layers=4, indexer_layers=(0, 1, 2, 3),
    first_k_dense_replace=1, max_ways=1)
# Presets whose random weights (`fo-jax generate --model NAME`) are FP8 (38.9 GB, not 74 GB).
FP8_PRESETS = frozenset({"deepseek_v32_width"})


def get_config(name: str) -> ModelConfig:
    """The preset called `name`; a clear error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None


def check_num_drafts(num_drafts, config: ModelConfig | None = None) -> None:
    """Raise unless `num_drafts` (draft tokens per request and decode step) is an int >= 0 and,
    given `config`, a step of W = num_drafts + 1 ways fits it (W <= config.max_ways).

    The one range check of the number of drafts: `fo_jax.generate.generate`, the drafting flags
    (`fo_jax.flags.drafting`), the engine's settings, the decode loop and the drafters call it
    (a drafter's own rule, such as needing num_drafts >= 1, is theirs)."""
    if (not isinstance(num_drafts, numbers.Integral) or isinstance(num_drafts, bool)
            or num_drafts < 0):
        raise ValueError(f"num_drafts={num_drafts!r} must be an int >= 0 (draft tokens per "
                         "request and step; 0 = no drafts)")
    if config is not None and num_drafts + 1 > config.max_ways:
        raise ValueError(
            f"num_drafts={num_drafts} makes steps of W = {num_drafts + 1} ways, but config "
            f"{config.name!r} allows at most max_ways={config.max_ways}: use num_drafts <= "
            f"{config.max_ways - 1}, or a config with max_ways >= {num_drafts + 1}")


def sequence_capacity_check(config: ModelConfig, needed: int) -> None:
    """Raise if a request needs more than `max_seq_len` positions."""
    if needed > config.max_seq_len:
        raise ValueError(
            f"context of {needed} tokens exceeds max_seq_len={config.max_seq_len} of "
            f"config {config.name!r}; shorten the prompt / max_new_tokens or raise max_seq_len"
        )


"""Golden outputs of Hugging Face `transformers` for tiny DeepSeek-V3.2 / GLM-5 checkpoints.

A one-off developer script (never run by CI: it needs torch and transformers, which fo_jax does
not). It builds three tiny random checkpoints with the `transformers` model classes, runs them on
a fixed 40-token prompt in float32 (eager attention, CPU), and writes each as a fixture under
tests/fixtures/parity/<name>/:

    config.json, model.safetensors    the checkpoint, config.json as `save_pretrained` writes
                                      it plus num_nextn_predict_layers, tensors in the Hub
                                      layout (what `save_pretrained` writes too: one tensor per
                                      expert and matrix), plus a multi-token-prediction layer L
                                      that `transformers` ignores and fo_jax must skip
    golden.npz                        prompt [T] int32, prefill_logits [T, V] float32,
                                      decode_logits [N, V] float32 (N = 20 greedy steps),
                                      greedy [N + 1] int32 (argmax of the prefill's last logits,
                                      then of each step's; step i feeds greedy[i]),
                                      topk [G, T + N, K] int32 (each full indexer layer's
                                      selection per query, ascending, -1 padding: fo_jax's
                                      canonical order), topk_gap [G, T + N] float32 ((k-th -
                                      (k+1)-th indexer score) / the row's largest |score|, +inf
                                      when every visible token is selected: a selection is only
                                      defined where this is > 0)

Fixtures:
  deepseek_v32      DeepseekV32ForCausalLM: 3 layers (1 dense, 2 MoE: 8 experts in 2 groups,
                    top-2 of the best group, a shared expert), YaRN RoPE (factor 4 over 64
                    positions), index_topk 8 on a 40-token prompt.
  glm_moe_dsa       GlmMoeDsaForCausalLM: 4 layers, indexers shared in groups of two
                    (indexer_types full, shared, full, shared), rms_norm_eps 1e-5 (used
                    by every RMSNorm: see `lowrank_norms_use_config_eps`).
  deepseek_v32_fp8  a deepseek_v32-shaped model whose projections (attention, indexer wq_b /
                    wk, experts, dense MLP) are stored float8 e4m3 with 16 x 16 block scales
                    (`quantization_config`); its golden outputs come from `transformers`
                    loading that directory (it dequantises on a CPU).

Each fixture takes the first seed (from SEED) whose top-k selections are all separated by at
least MIN_GAP, so that neither the golden logits nor the selections depend on tie order.
Made with torch 2.14.1 and transformers 5.24.0.

Weights are drawn at unit scale (normal(0, fan_in^-0.5) matrices, normal(0, 1) embeddings,
norms 1 + 0.1 normal, router biases 0.1 normal) rather than transformers' 0.02 init, so that
logits are far from uniform, routing and top-k choices are well separated and a mismatch shows.

Run (a separate virtual environment; fo_jax's own is not needed):

    python -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install torch transformers accelerate \\
        safetensors numpy
    /tmp/tfenv/bin/python -m experiments.training.make_parity_fixtures --out tests/fixtures/parity

tests/checkpoints/test_parity.py compares fo_jax against these files.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

PROMPT_LEN = 40
DECODE_STEPS = 20
SEED = 0
# Every top-k must be defined with room to spare: k-th minus (k+1)-th indexer score at least
# this fraction of the row's largest |score| (fo_jax's float32 rounding moves scores ~1e-6).
MIN_GAP = 1e-4

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_topk=8, index_n_heads=16, index_head_dim=32, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)


def deepseek_config():
    return transformers.DeepseekV32Config(
        **COMMON, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def glm_config():
    return transformers.GlmMoeDsaConfig(
        **COMMON, num_hidden_layers=4, first_k_dense_replace=1, n_group=1, topk_group=1,
        rms_norm_eps=1e-5, indexer_types=["full", "shared", "full", "shared"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def randomize(model, gen: torch.Generator) -> None:
    """Unit-scale random weights (see the module docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if name.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def lowrank_norms_use_config_eps(model) -> None:
    """The attention's q_a / kv_a RMSNorms with the config's rms_norm_eps.

    transformers (5.24) builds them with a hard-coded 1e-6 (`DeepseekV32RMSNorm(q_lora_rank)`,
    a habit of its DeepSeek-V3 port, where rms_norm_eps is 1e-6 anyway), and GlmMoeDsa inherits
    it although GLM-5's rms_norm_eps is 1e-5. The inference engines that serve these
    checkpoints (vLLM, SGLang: `RMSNorm(kv_lora_rank, eps=config.rms_norm_eps)`) and fo_jax use
    rms_norm_eps for every RMSNorm, so the golden outputs do too. For DeepSeek-V3.2 (1e-6)
    nothing changes; on the GLM fixture transformers' own eps moves the logits by ~6e-5.
    """
    eps = model.config.rms_norm_eps
    for name, module in model.named_modules():
        if name.endswith(("q_a_layernorm", "kv_a_layernorm")):
            module.variance_epsilon = eps


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the Hub checkpoints' names: packed experts
    (`experts.gate_up_proj` [X, 2M, E], `experts.down_proj` [X, E, M]) split into one
    `experts.{e}.{gate,up,down}_proj.weight` per expert."""
    out = {}
    state = model.state_dict()
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = t[e, :half].clone()
                out[f"{pre}{e}.up_proj.weight"] = t[e, half:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.detach().clone().contiguous()
    return out


def add_mtp_layer(tensors: dict, num_layers: int, gen: torch.Generator) -> None:
    """A multi-token-prediction layer L (as the Hub checkpoints hold one): the last layer's
    tensors renamed to layer L, plus the MTP's own enorm / hnorm / eh_proj / shared_head."""
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last):]] = torch.randn(tensors[name].shape, generator=gen)
    dim = tensors["model.norm.weight"].shape[0]
    tensors[mtp + "enorm.weight"] = torch.ones(dim)
    tensors[mtp + "hnorm.weight"] = torch.ones(dim)
    tensors[mtp + "eh_proj.weight"] = torch.randn((dim, 2 * dim), generator=gen)
    tensors[mtp + "shared_head.norm.weight"] = torch.ones(dim)


class TopkRecorder:
    """Records each indexer call's scores and top-k (torch.Tensor.topk patched during it)."""

    def __init__(self, model):
        self.calls: list[tuple[int, torch.Tensor]] = []
        self._active = None
        self._topk = torch.Tensor.topk
        recorder = self

        def topk(tensor, k, *args, **kwargs):
            result = recorder._topk(tensor, k, *args, **kwargs)
            if recorder._active is not None:
                recorder.calls.append((recorder._active, tensor.detach().clone()))
            return result

        torch.Tensor.topk = topk
        for name, module in model.named_modules():
            if name.endswith("self_attn.indexer") and module is not None:
                layer = int(name.split(".")[2])
                module.register_forward_pre_hook(
                    lambda m, a, kw=None, layer=layer: setattr(recorder, "_active", layer))
                module.register_forward_hook(
                    lambda m, a, o: setattr(recorder, "_active", None))

    def close(self):
        torch.Tensor.topk = self._topk

    def take(self) -> dict[int, torch.Tensor]:
        """{layer: scores [S, T] of batch row 0} of the calls since the last take."""
        out = {layer: scores[0] for layer, scores in self.calls}
        self.calls = []
        return out


def selections(scores: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """fo_jax's canonical top-k of each query row of `scores` [S, T] (query s sees tokens
    0 .. s; transformers masks the others with a large negative number, not -inf):
    (tokens [S, K] ascending with -1 padding, gap [S] = (k-th - (k+1)-th score) / the row's
    largest |score|, +inf where at most k tokens are visible)."""
    num_s, num_t = scores.shape
    tokens = np.full((num_s, k), -1, np.int32)
    gap = np.full((num_s,), np.inf, np.float32)
    for s in range(num_s):
        row = scores[s].double().numpy()
        visible = np.arange(s + 1)
        order = visible[np.argsort(-row[visible], kind="stable")]
        chosen = np.sort(order[:k])
        tokens[s, :len(chosen)] = chosen
        if len(visible) > k:
            gap[s] = (row[order[k - 1]] - row[order[k]]) / max(np.abs(row[visible]).max(), 1e-30)
    return tokens, gap


def run_golden(model, prompt: np.ndarray) -> dict:
    """Prefill + DECODE_STEPS greedy steps with the transformers cache, float32."""
    config = model.config
    full = [i for i in range(config.num_hidden_layers)
            if getattr(config, "indexer_types", None) is None
            or config.indexer_types[i] == "full"]
    recorder = TopkRecorder(model)
    try:
        with torch.no_grad():
            out = model(torch.tensor(prompt[None], dtype=torch.long), use_cache=True)
            cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
            prefill = out.logits[0].float().numpy()
            picks = {l: [s] for l, s in recorder.take().items()}
            greedy = [int(np.argmax(prefill[-1]))]
            decode = []
            for _ in range(DECODE_STEPS):
                out = model(torch.tensor([[greedy[-1]]], dtype=torch.long), cache=cache,
                            use_cache=True)
                cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
                logits = out.logits[0, -1].float().numpy()
                decode.append(logits)
                greedy.append(int(np.argmax(logits)))
                for l, s in recorder.take().items():
                    picks[l].append(s)
    finally:
        recorder.close()
    if sorted(picks) != full:
        raise RuntimeError(f"indexer calls at layers {sorted(picks)}, expected {full}")
    k = config.index_topk
    tokens, gaps = [], []
    for l in full:
        total = PROMPT_LEN + DECODE_STEPS
        rows = torch.full((total, total), -math.inf)
        rows[:PROMPT_LEN, :PROMPT_LEN] = picks[l][0]
        for i, s in enumerate(picks[l][1:]):
            rows[PROMPT_LEN + i, : s.shape[-1]] = s[0]
        t, g = selections(rows, k)
        tokens.append(t)
        gaps.append(g)
    return dict(prompt=prompt.astype(np.int32), prefill_logits=prefill,
                decode_logits=np.stack(decode).astype(np.float32),
                greedy=np.asarray(greedy, np.int32), topk=np.stack(tokens),
                topk_gap=np.stack(gaps).astype(np.float32))


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [O, I], scale_inv [ceil(O/b), ceil(I/b)] float32): w ~ q * scale_inv."""
    rows, cols = w.shape
    nb_r, nb_c = -(-rows // block), -(-cols // block)
    scale = torch.empty(nb_r, nb_c)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nb_r):
        for j in range(nb_c):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(
                torch.float8_e4m3fn)
    return q, scale


FP8_SKIP = ("embed_tokens", "lm_head", "norm", "layernorm", "gate.weight", "indexer.k_norm",
            "indexer.weights_proj", "e_score_correction_bias")


def write_fixture(out: pathlib.Path, model, tensors: dict, extra_config: dict,
                  golden: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # config.json as `save_pretrained` writes it, plus the fields transformers does not model.
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.update(extra_config, dtype="float32")  # what save_pretrained of this model writes
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    np.savez_compressed(out / "golden.npz", **golden)


def reload_logits(cls, directory: pathlib.Path, prompt: np.ndarray, *,
                  config_eps: bool = True) -> np.ndarray:
    model = cls.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if config_eps:
        lowrank_norms_use_config_eps(model)
    with torch.no_grad():
        return model(torch.tensor(prompt[None], dtype=torch.long)).logits[0].numpy()


def build(name: str, out_root: pathlib.Path) -> None:
    """Write fixture `name`, with the first seed from SEED on whose top-k are all defined."""
    for seed in range(SEED, SEED + 20):
        if build_seed(name, out_root, seed):
            return
    raise RuntimeError(f"{name}: no seed gave well-separated top-k selections")


def build_seed(name: str, out_root: pathlib.Path, seed: int) -> bool:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name.startswith("deepseek_v32"):
        cls, config = transformers.DeepseekV32ForCausalLM, deepseek_config()
    else:
        cls, config = transformers.GlmMoeDsaForCausalLM, glm_config()
    config._attn_implementation = "eager"
    model = cls(config).float().eval()
    randomize(model, gen)
    lowrank_norms_use_config_eps(model)
    prompt = np.random.default_rng(seed).integers(2, config.vocab_size, PROMPT_LEN)
    tensors = hub_state_dict(model)
    add_mtp_layer(tensors, config.num_hidden_layers, gen)
    extra = {"num_nextn_predict_layers": 1}
    out = out_root / name
    if name.endswith("_fp8"):
        # Every width here is a multiple of 16, so the blocks tile each matrix exactly:
        # transformers (5.24) derives the block from the scale grid (rows // grid rows),
        # which is wrong for a ragged last block (a 48-row matrix in blocks of 32 dequantises
        # with 24-row blocks), while the DeepSeek reference (`Linear`'s ceil(out / 128) x
        # ceil(in / 128) scale grid, read per 128-block by its `fp8_gemm`) and fo_jax use the
        # configured block with a partial last one (DeepSeek-V3.2's kv_a_proj_with_mqa has
        # 576 rows: 4.5 blocks).
        block = 16
        for key in [k for k in tensors if k.endswith(".weight") and tensors[k].ndim == 2
                    and not any(s in k for s in FP8_SKIP)]:
            tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(tensors[key], block)
        extra["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                        "activation_scheme": "dynamic",
                                        "weight_block_size": [block, block]}
        with tempfile.TemporaryDirectory() as tmp:
            write_fixture(pathlib.Path(tmp), model, tensors, extra, {})
            model = cls.from_pretrained(tmp, dtype=torch.float32,
                                        attn_implementation="eager").eval()
            lowrank_norms_use_config_eps(model)
    golden = run_golden(model, prompt)
    if np.min(golden["topk_gap"]) < MIN_GAP:
        print(f"{name}, seed {seed}: a top-k gap of {np.min(golden['topk_gap']):.3g}; next seed")
        return False
    write_fixture(out, model, tensors, extra, golden)
    if not name.endswith("_fp8"):
        # The directory must load back into transformers as the same model (names right).
        again = reload_logits(cls, out, prompt)
        if not np.array_equal(again, golden["prefill_logits"]):
            raise RuntimeError(f"{name}: transformers reloads {out} with other logits "
                               f"(max diff {np.abs(again - golden['prefill_logits']).max()})")
        own = reload_logits(cls, out, prompt, config_eps=False)
        print(f"{name}: transformers' own q_a / kv_a eps (1e-6) moves the prefill logits by "
              f"{np.abs(own - golden['prefill_logits']).max():.3g}")
    sizes = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {sizes / 1024:.0f} KiB, greedy {golden['greedy'].tolist()}, "
          f"top-k rows with more than k visible tokens: "
          f"{int(np.isfinite(golden['topk_gap']).sum())} of {golden['topk_gap'].size}, "
          f"smallest k-th to (k+1)-th gap "
          f"{np.min(golden['topk_gap']):.3g} (seed {seed})")
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="tests/fixtures/parity")
    p.add_argument("--only", nargs="*", default=["deepseek_v32", "glm_moe_dsa",
                                                  "deepseek_v32_fp8"])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name in args.only:
        build(name, pathlib.Path(args.out))


if __name__ == "__main__":
    main()

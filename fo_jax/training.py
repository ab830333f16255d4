"""Training a small DSA model: corpus, byte tokenizer, training forward, the DeepSeek-V3.2 recipe.

Corpus (`stdlib_files`, `split_files`, `load_split`): the `.py` sources of the Python standard
library of the running interpreter (`sysconfig.get_paths()["stdlib"]`; PSF License Version 2),
split into train / held-out by a hash of each file's path relative to the stdlib root
(deterministic, no overlap); a split's documents are concatenated with a separator token
between them. Tokens: a byte-level BPE (fo_jax.tokenizer, `train_bpe`) or bytes (`encode` /
`decode`: ids 0-255, SEP 256, vocab 260). Losses are in bits per byte either way (nats of the
targets / ln 2 / the bytes those targets stand for).

Recipe (DeepSeek-V3.2, small scale), as `train_forward` + `losses`:
  * stage "dense": every layer attends to the whole causal prefix; LM cross-entropy trains the
    model. On the side each group's indexer is trained by KL(p || q): p[t, s] = the dense
    attention probabilities summed over heads and over the group's layers, L1-normalised (a
    stop-gradient target), q = softmax of the indexer scores over the causal keys. The indexer's
    inputs (the group's first normed hidden state and query low-rank state) are stop-gradient,
    so the indexer loss moves indexer parameters only, and the LM loss never reaches them.
  * stage "sparse": each layer attends to the top-k tokens of its group's indexer (the
    project's selection rule, `select_topk`); the indexer KL is restricted to the selected set
    (p and q renormalised over it).
Contract: the training forward computes exactly what `fo_jax.resident.prefill` computes
(dense=True for stage "dense"; the top-k for "sparse") on a batch starting at position 0, so
trained weights mean the same thing at inference (tests/test_train.py checks the logits).
Why this corpus and tokenizer, the run that trained the embedded model, and its results:
docs/guides/training.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fo_jax.config import ModelConfig
from fo_jax.model.attention import (attention_inputs, attention_output, query_lowrank,
                                    softmax_scale)
from fo_jax.model.dsa import layer_slice
from fo_jax.model.forward import feed_forward
from fo_jax.model.indexer import indexer_keys, indexer_queries, indexer_scores, select_topk
from fo_jax.model.layers import F32, matmul_f32, rms_norm
from fo_jax.tokenizer import BYTE_SEP, BYTE_VOCAB, ByteTokenizer

SEP = BYTE_SEP
VOCAB_SIZE = BYTE_VOCAB
STAGES = ("dense", "sparse")
LN2 = math.log(2.0)


# Corpus and tokenizer ---------------------------------------------------------------------------

def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as uint16 token ids 0-255 (fo_jax.tokenizer.ByteTokenizer)."""
    return ByteTokenizer().encode(text).astype(np.uint16)


def decode(tokens) -> str:
    """Byte token ids back to text (fo_jax.tokenizer.ByteTokenizer: SEP as a blank line)."""
    return ByteTokenizer().decode(tokens)


def is_held_out(relative_path: str, held_out_fraction: float = 0.05) -> bool:
    """A file is held out iff sha256 of its relative path (posix) falls in the first
    `held_out_fraction` of the hash range: deterministic across machines and runs."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < held_out_fraction


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """Relative paths (posix, sorted) of the `.py` files under the stdlib root, skipping
    site-packages and test data trees of other packages."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        out.append(rel)
    return sorted(out)


def split_files(files: list[str], held_out_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, held_out) relative paths, each sorted; disjoint, together all `files`."""
    files = sorted(set(files))
    held = [f for f in files if is_held_out(f, held_out_fraction)]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def _read_files(files: list[str], root, max_bytes: int | None) -> list[bytes]:
    """The readable files' bytes, in order; stops once `max_bytes` bytes were read."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for rel in files:
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        out.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if not out:
        raise ValueError(f"no readable files among {len(files)} under {root}")
    return out


def load_texts(files: list[str], root: str | os.PathLike | None = None,
               max_bytes: int | None = None) -> list[str]:
    """The files' text (UTF-8, undecodable bytes replaced), in order; stops once `max_bytes`
    bytes were read (smoke runs)."""
    return [data.decode("utf-8", errors="replace") for data in _read_files(files, root, max_bytes)]


def load_split(files: list[str], root: str | os.PathLike | None = None,
               max_bytes: int | None = None, tokenizer=None) -> np.ndarray:
    """The files' tokens concatenated, the separator before each document: a uint16 stream.

    tokenizer: a fo_jax.tokenizer tokenizer; None is bytes (ids 0-255, SEP).
    max_bytes: stop once this many bytes were read (smoke runs)."""
    if tokenizer is not None and tokenizer.kind != "bytes":
        if tokenizer.vocab_size > 2**16:
            raise ValueError(f"vocab_size {tokenizer.vocab_size} does not fit a uint16 stream")
        docs = tokenizer.encode_batch(load_texts(files, root, max_bytes))
        sep = np.array([tokenizer.sep], np.uint16)
    else:
        docs = [np.frombuffer(data, np.uint8) for data in _read_files(files, root, max_bytes)]
        sep = np.array([SEP], np.uint16)
    return np.concatenate([part for d in docs for part in (sep, d.astype(np.uint16))])


def sample_batch(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator):
    """[batch, length + 1] int32 windows at uniform random offsets of the stream."""
    if len(stream) < length + 2:
        raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window of "
                         f"{length + 1}; use a shorter --seq-len or more data")
    starts = rng.integers(0, len(stream) - length - 1, size=batch)
    return np.stack([stream[s:s + length + 1] for s in starts]).astype(np.int32)


def eval_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """[count, length + 1] int32 windows evenly spaced over the stream (fixed: comparable
    across evaluations)."""
    span = len(stream) - length - 1
    if span < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window "
                         f"of {length + 1}")
    starts = np.linspace(0, span - 1, count).astype(np.int64)
    return np.stack([stream[s:s + length + 1] for s in starts]).astype(np.int32)


# Training forward ---------------------------------------------------------------------------------

def _attention_probs(q_lat, q_pe, c_kv, k_pe, mask, scale, spec_logits):
    """Softmax probabilities of MLA attention (the math of `fo_jax.model.attention`).

    spec_logits: einsum specs for the dense ([B, T, S] keys) or gathered ([B, T, K] keys) case.
    Returns probs [B, T, H, S or K] float32, 0 outside the mask.
    """
    nope_spec, pe_spec = spec_logits
    logits = (jnp.einsum(nope_spec, q_lat, c_kv) + jnp.einsum(pe_spec, q_pe, k_pe)) * scale
    m = mask[:, :, None, :]
    logits = jnp.where(m, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(m, jnp.exp(logits - peak), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)


def train_forward(params: dict, tokens: jax.Array, *, config: ModelConfig, stage: str):
    """Logits and indexer statistics of a [B, T] batch at positions 0 .. T - 1, differentiable.

    Per group g: the indexer keys [B, T, N] and queries [B, T, I, N] from stop-gradient inputs,
    scores [B, T, T]; "sparse" selects the top-k [B, T, K] (canonical order, `select_topk`).
    Per layer: attention [B, T, H, T] over the causal prefix ("dense") or over the selected set
    ("sparse", as a mask: the softmax over exactly the K selected rows, summed in another order
    than the inference paths' gather). KV rows and indexer keys are rounded to kv_dtype as the
    caches of the inference paths store them.

    Returns:
      logits [B, T, V] float32;
      per group a dict: "scores" [B, T, T] indexer scores, "target" [B, T, T] the attention
      probabilities summed over the group's heads and layers (stop-gradient, not normalised),
      "mask" [B, T, T] bool: the causal prefix ("dense") or the selected set ("sparse", so the
      indexer's KL is restricted to it).
    """
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} must be one of {STAGES}")
    if config.kv_format != "bf16":
        raise NotImplementedError(
            f"training runs with kv_format='bf16', got {config.kv_format!r} (its rows are "
            "quantized bytes, with no gradient): train with config.replace(kv_format='bf16') "
            "and serve the trained weights with the FP8 cache")
    batch, num_t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(num_t, dtype=jnp.int32), (batch, num_t))
    causal = jnp.arange(num_t)[None, :] <= jnp.arange(num_t)[:, None]  # [T, S]
    causal = jnp.broadcast_to(causal, (batch, num_t, num_t))
    scale = softmax_scale(config)
    d = config.kv_lora_rank
    kv_dt = config.jnp_kv_dtype
    x = params["embed"][tokens]
    layers = params["layers"]
    stats = []
    for g, (lo, hi) in enumerate(config.group_bounds):
        first = layer_slice(layers, lo)
        ip = layer_slice(params["indexer"], g)
        h = jax.lax.stop_gradient(rms_norm(x, first["attn_norm"], config.norm_eps))
        qr = jax.lax.stop_gradient(query_lowrank(first, h, config=config))
        keys = indexer_keys(ip, h, positions, config=config).astype(kv_dt).astype(F32)
        q_i, w_i = indexer_queries(ip, qr, h, positions, config=config)
        scores = indexer_scores(q_i, w_i, keys)  # [B, T, T]
        if stage == "sparse":
            selected, sel_mask = select_topk(jax.lax.stop_gradient(scores), positions + 1,
                                             config.index_topk)
            # The selected set as a [B, T, S] mask: attention over it is attention over the
            # K gathered rows (the same softmax and sum), as dense matmuls: on CPU the gather
            # [B, T, K, D+R] and its scatter-add gradient cost ~3x more than T-wide matmuls.
            mask = jnp.zeros((batch, num_t, num_t), bool).at[
                jnp.arange(batch)[:, None, None], jnp.arange(num_t)[None, :, None],
                jnp.where(sel_mask, selected, num_t)].set(True, mode="drop")
        else:
            mask = causal
        target = jnp.zeros(scores.shape, F32)
        for l in range(lo, hi):
            lp = layer_slice(layers, l)
            h = rms_norm(x, lp["attn_norm"], config.norm_eps)
            qr = query_lowrank(lp, h, config=config)
            q_lat, q_pe, kv_new = attention_inputs(lp, h, qr, positions, config=config)
            rows = kv_new.astype(F32)
            probs = _attention_probs(q_lat, q_pe, rows[..., :d], rows[..., d:], mask,
                                     scale, ("bthd,bsd->bths", "bthr,bsr->bths"))
            out_lat = jnp.einsum("bths,bsd->bthd", probs, rows[..., :d])
            target = target + jax.lax.stop_gradient(jnp.sum(probs, axis=2))
            x = x + attention_output(lp, out_lat, config=config)
            h = rms_norm(x, lp["ffn_norm"], config.norm_eps)
            x = x + feed_forward(params, l, h, config=config,
                                 is_moe=l >= config.num_dense_layers)
        stats.append({"scores": scores, "target": target, "mask": mask})
    x = rms_norm(x, params["norm"], config.norm_eps)
    return matmul_f32(x, params["head"]), stats


def indexer_kl(scores: jax.Array, target: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over queries of KL(p || q), p = target / sum(target) (L1 over the mask), q =
    softmax(scores) over the mask; queries with an empty mask count 0. Shapes [B, T, S'].

    Terms with p = 0 contribute 0 (0 log 0 = 0)."""
    target = jnp.where(mask, target, 0.0)
    total = jnp.sum(target, axis=-1, keepdims=True)
    p = target / jnp.where(total > 0, total, 1.0)
    logits = jnp.where(mask, scores, -jnp.inf)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    shifted = jnp.where(mask, scores - peak, 0.0)
    log_z = jnp.log(jnp.sum(jnp.where(mask, jnp.exp(shifted), 0.0), axis=-1, keepdims=True)
                    + 1e-30)
    log_q = shifted - log_z
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    kl = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
    return jnp.mean(kl)


def losses(params: dict, batch: jax.Array, *, config: ModelConfig, stage: str):
    """(lm, indexer): LM cross-entropy in nats per token of batch[:, 1:] given batch[:, :-1],
    and the indexer KL averaged over groups."""
    logits, stats = train_forward(params, batch[:, :-1], config=config, stage=stage)
    lm = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))
    idx = sum(indexer_kl(s["scores"], s["target"], s["mask"]) for s in stats) / len(stats)
    return lm, idx


# Optimiser and steps ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of a training run (both stages share one schedule)."""

    dense_steps: int
    sparse_steps: int
    batch: int
    seq_len: int
    peak_lr: float = 3e-3
    warmup_steps: int = 50
    end_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    indexer_weight: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1")
        if self.dense_steps < 0 or self.sparse_steps < 0 or self.total_steps < 1:
            raise ValueError(f"dense_steps={self.dense_steps}, sparse_steps="
                             f"{self.sparse_steps}: both must be >= 0 and their sum >= 1")

    @property
    def total_steps(self) -> int:
        return self.dense_steps + self.sparse_steps


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW (b2 0.95) with linear warm-up and cosine decay to end_lr_fraction * peak, after
    clipping the global gradient norm. Norm weights and biases are not decayed."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.peak_lr, min(tc.warmup_steps, max(tc.total_steps - 1, 1)),
        max(tc.total_steps, 2), tc.peak_lr * tc.end_lr_fraction)

    def decay_mask(params):
        return jax.tree_util.tree_map(lambda a: a.ndim >= 2 and a.shape[-1] > 1, params)

    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask))


@functools.partial(jax.jit, static_argnames=("config", "stage", "optimizer", "indexer_weight"))
def train_step(params, opt_state, batch, *, config, stage, optimizer, indexer_weight=1.0):
    """One optimiser step on batch [B, T + 1]: returns params, opt_state, (lm, indexer, gnorm)."""
    def total(p):
        lm, idx = losses(p, batch, config=config, stage=stage)
        return lm + indexer_weight * idx, (lm, idx)

    grads, (lm, idx) = jax.grad(total, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, (lm, idx, _global_norm(grads))


def _global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of every leaf (optax renamed its helper across versions)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(F32))) for x in jax.tree_util.tree_leaves(tree)))


@functools.partial(jax.jit, static_argnames=("config", "stage"))
def eval_losses(params, batch, *, config, stage):
    """(lm nats per token, indexer KL) of one batch, no gradients."""
    return losses(params, batch, config=config, stage=stage)


def evaluate(params, windows: np.ndarray, *, config: ModelConfig, stage: str,
             batch: int = 4, token_bytes: np.ndarray | None = None) -> dict:
    """Held-out loss of `windows` [N, T + 1]: {"bits_per_byte", "nats", "indexer_kl"}.

    nats: per token. bits_per_byte: the targets' nats / ln 2 / the bytes they stand for
    (`token_bytes[id]`, the tokenizer's; None: one byte per token, SEP counted as one byte)."""
    lms, kls = [], []
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        lm, kl = eval_losses(params, jnp.asarray(chunk), config=config, stage=stage)
        lms.append(float(lm) * len(chunk))
        kls.append(float(kl) * len(chunk))
    nats = sum(lms) / len(windows)
    bytes_per_token = (1.0 if token_bytes is None
                       else float(np.mean(np.asarray(token_bytes)[windows[:, 1:]])))
    return {"bits_per_byte": nats / LN2 / bytes_per_token, "nats": nats,
            "bytes_per_token": bytes_per_token, "indexer_kl": sum(kls) / len(windows)}


def save_run_config(path: str | os.PathLike, config: ModelConfig, tc: TrainConfig,
                    extra: dict | None = None, tokenizer=None) -> None:
    """The model and training configuration as JSON next to the weights (tokenizer: its
    description; None is bytes)."""
    described = (tokenizer.describe() if tokenizer is not None
                 else {"kind": "bytes", "sep": SEP, "vocab_size": VOCAB_SIZE})
    payload = {"model": dataclasses.asdict(config), "train": dataclasses.asdict(tc),
               "tokenizer": described,
               "corpus": "Python standard library .py sources (PSF License)"}
    payload.update(extra or {})
    pathlib.Path(path).write_text(json.dumps(payload, indent=2, default=list) + "\n")


def load_run(directory: str | os.PathLike, stage: str = "sparse") -> tuple[ModelConfig, dict]:
    """(config, params) of a run written by experiments/training/train.py: `config.json` and
    `{stage}.safetensors` in `directory`."""
    from fo_jax.weights import load_params

    directory = pathlib.Path(directory)
    meta_path = directory / "config.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no config.json in {directory} (expected a training run's "
                                "output directory)")
    fields = json.loads(meta_path.read_text())["model"]
    config = ModelConfig(**fields)
    return config, load_params(directory / f"{stage}.safetensors", config)


def params_finite(params: dict) -> bool:
    """Every parameter finite (no NaN / inf)."""
    return all(bool(np.all(np.isfinite(np.asarray(x, np.float32))))
               for x in jax.tree_util.tree_leaves(params))

"""Model directories, and the trained model that ships inside the package.

A model directory (what `experiments/training/train.py` writes, and what `fo-jax generate
--model-dir` reads) holds:

    config.json          {"model": ModelConfig fields, "tokenizer": {...}, ...}
    model.safetensors    the weights (fo_jax names, fo_jax.weights); a training run's directory
                         has {dense,sparse}.safetensors instead, and "sparse" is read
    tokenizer.json       a byte-level BPE (fo_jax.tokenizer); absent for byte models

The embedded model (`EMBEDDED_DIR`, preset `trained-small`) is a training run of
`experiments/training/train.py` on the Python standard library's sources, its weights rounded to
bfloat16 (8.8 MB) and read back as the config's dtype (float32): `fo-jax generate` runs it by
default and prints Python-like text. Its held-out losses and training settings are in its
config.json ("trained"); the run and its results: docs/guides/training.md.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.tokenizer import load_tokenizer

EMBEDDED_NAME = "trained-small"
EMBEDDED_DIR = pathlib.Path(__file__).parent / "assets" / EMBEDDED_NAME
WEIGHTS_FILE = "model.safetensors"


def read_config(directory: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a model directory's config.json ("model" fields)."""
    directory = pathlib.Path(directory)
    path = directory / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {directory}: a model directory holds "
                                "config.json, model.safetensors (or a training run's "
                                "sparse.safetensors) and, for BPE models, tokenizer.json")
    meta = json.loads(path.read_text())
    if "model" not in meta:
        raise ValueError(f"{path} has no \"model\" section (fo_jax ModelConfig fields); got keys "
                         f"{sorted(meta)[:8]}: is this a Hugging Face checkpoint directory?")
    fields = dict(meta["model"])
    for key, value in fields.items():  # JSON has lists where the config has tuples
        if isinstance(value, list):
            fields[key] = tuple(value)
    return ModelConfig(**fields)


def weights_path(directory: str | os.PathLike, stage: str | None = None) -> pathlib.Path:
    """model.safetensors, else the training run's `{stage or "sparse"}.safetensors`."""
    directory = pathlib.Path(directory)
    if stage is None and (directory / WEIGHTS_FILE).exists():
        return directory / WEIGHTS_FILE
    path = directory / f"{stage or 'sparse'}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {path.name} in {directory}")
    return path


def load_model_dir(directory: str | os.PathLike, stage: str | None = None):
    """(config, params, tokenizer) of a model directory; parameters in the config's dtype
    (bfloat16 files are widened exactly)."""
    from fo_jax.weights import from_checkpoint

    from safetensors.numpy import load_file

    config = read_config(directory)
    tokenizer = load_tokenizer(directory)
    needed = 256 if tokenizer.kind == "bytes" else tokenizer.vocab_size  # bytes: SEP optional
    if needed > config.vocab_size:
        raise ValueError(f"{directory}: the {tokenizer.kind} tokenizer needs {needed} ids but "
                         f"the model has vocab_size={config.vocab_size}")
    tensors = load_file(str(weights_path(directory, stage)))
    dtype = np.dtype(jnp.dtype(config.dtype))
    tensors = {k: v.astype(dtype) if v.dtype != dtype else v for k, v in tensors.items()}
    return config, from_checkpoint(tensors, config), tokenizer


def save_model_dir(directory: str | os.PathLike, config: ModelConfig, params: dict, tokenizer,
                   *, dtype: str = "bfloat16", extra: dict | None = None) -> pathlib.Path:
    """Write a model directory: weights rounded to `dtype`, config.json, tokenizer.json."""
    import dataclasses

    from safetensors.numpy import save_file

    from fo_jax.weights import to_checkpoint

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = to_checkpoint(params, config)
    cast = np.dtype(jnp.dtype(dtype))
    tensors = {k: np.ascontiguousarray(np.asarray(jnp.asarray(v).astype(cast)))
               for k, v in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE),
              metadata={"format": "fo_jax", "config": config.name, "dtype": dtype})
    meta = {"model": dataclasses.asdict(config), "tokenizer": tokenizer.describe(),
            "weights_dtype": dtype, **(extra or {})}
    (directory / "config.json").write_text(json.dumps(meta, indent=2, default=list) + "\n")
    if tokenizer.kind == "bpe":
        tokenizer.save(directory / "tokenizer.json")
    return directory


def embedded_available() -> bool:
    return (EMBEDDED_DIR / WEIGHTS_FILE).exists()


def load_embedded():
    """(config, params, tokenizer) of the trained model shipped with the package."""
    if not embedded_available():
        raise FileNotFoundError(f"the embedded model is missing from {EMBEDDED_DIR} (a broken "
                                "install?); run with --model tiny for random weights")
    return load_model_dir(EMBEDDED_DIR)

"""Which model a command runs: its config, a loader of its weights and its tokenizer, from
the model flags (`fo_jax.flags.ModelArgs`: `--model` / `--model-dir` / `--weights`, ...), and
the memory check before any weight is read.

The `fo-jax` commands (`fo_jax.cli`) and the server (`fo_jax.server.serve`) resolve models
here, reading only config and tokenizer files: the embedded model and model directories come
with weights (`load()` reads them, after `check_param_memory`), a preset gets random weights.
"""

from __future__ import annotations

from fo_jax.flags import DEFAULT_MODEL, ModelArgs


def format_bytes(n: float) -> str:
    """`n` bytes for a person: "1.50 GB", "12.00 kB", "7 B"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def model_dir_config(directory):
    """(ModelConfig, "hf" or "fo_jax") of a --model-dir: a Hugging Face checkpoint's
    config.json ("architectures") or a fo_jax model directory's ("model")."""
    import pathlib

    from fo_jax import embedded
    from fo_jax.checkpoints import config_from_hf
    from fo_jax.checkpoints.hf_config import read_json

    path = pathlib.Path(directory) / "config.json"
    if not path.exists():
        return embedded.read_config(directory), "fo_jax"  # raises, naming what is missing
    meta = read_json(path)  # ValueError naming the file unless a JSON object
    if "model" in meta:
        return embedded.read_config(directory), "fo_jax"
    if "architectures" in meta:
        return config_from_hf(path), "hf"  # errors name the file
    raise ValueError(f"{path} has neither a \"model\" section (a fo_jax model directory) nor "
                     "\"architectures\" (a Hugging Face checkpoint); got keys "
                     f"{sorted(meta)[:8]}")


def checkpoint_bytes(directory, kind: str) -> int:
    """Bytes of a model directory's weight files: the safetensors index's total_size, else
    the files' sizes."""
    import os
    import pathlib

    from fo_jax import embedded
    from fo_jax.checkpoints.hf import INDEX, SINGLE, shard_files
    from fo_jax.checkpoints.hf_config import read_json

    directory = pathlib.Path(directory)
    if kind == "fo_jax":
        return os.path.getsize(embedded.weights_path(directory))
    if (directory / INDEX).exists():
        shards = shard_files(directory)  # ValueError naming the index unless well formed
        meta = read_json(directory / INDEX).get("metadata") or {}
        if not isinstance(meta, dict):
            raise ValueError(f"{directory / INDEX}: metadata={meta!r:.40} must be an object "
                             '({"total_size": bytes})')
        total = meta.get("total_size")
        if total is None:
            return sum(os.path.getsize(directory / f) for f in shards)
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise ValueError(f"{directory / INDEX}: metadata.total_size={total!r:.40} must be "
                             "an int >= 0 (bytes)")
        return total
    return os.path.getsize(directory / SINGLE)


def available_bytes() -> float | None:
    """Host memory available now (Linux /proc/meminfo MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_param_memory(config, max_param_gb: float | None, *, state_bytes: int = 0,
                       state: str = "") -> None:
    """Refuse a model whose parameters would not fit, before any is allocated; with
    `state_bytes`, also parameters + that state (`state` says what it is) above half of the
    available memory."""
    from fo_jax.config import FP8_PRESETS
    from fo_jax.model.dsa import param_bytes

    fp8 = config.name in FP8_PRESETS  # its random weights are FP8 (`random_params`)
    need = param_bytes(config, fp8_block=(128, 128) if fp8 else None)
    held = "FP8 projections" if fp8 else config.dtype
    available = available_bytes()
    if max_param_gb is not None:
        if not max_param_gb > 0:
            raise ValueError(f"--max-param-gb must be > 0, got {max_param_gb}")
        limit, what = max_param_gb * 1e9, f"--max-param-gb={max_param_gb}"
    elif available is not None:
        limit = available / 2
        what = f"half of the available memory ({format_bytes(limit)}; --max-param-gb to change)"
    else:
        limit = None
    if limit is not None and need > limit:
        raise ValueError(
            f"the parameters of {config.name!r} take {format_bytes(need)} ({held}), above "
            f"{what}: `fo-jax generate` runs models that fit this machine (--model tiny or "
            f"small); to size a deployment run `fo-jax plan --model {config.name} --context N`")
    if state_bytes and available is not None and need + state_bytes > available / 2:
        raise ValueError(
            f"{state} ({format_bytes(state_bytes)}) take {format_bytes(need + state_bytes)} with "
            f"the parameters, above half of the available memory ({format_bytes(available / 2)})"
            ": lower --batch, --max-new-tokens or the prompt's length")


def random_params(config, seed: int) -> dict:
    """A preset's random weights: FP8 projections for the `FP8_PRESETS` (drawn on the device
    one matrix at a time), else `init_params` in the config's dtype."""
    import jax

    from fo_jax.config import FP8_PRESETS
    from fo_jax.model import dsa

    if config.name in FP8_PRESETS:
        return dsa.init_fp8_params(config, jax.random.key(seed))
    return dsa.init_params(config, jax.random.key(seed))


def with_kv_format(config, kv_format: str | None):
    """`config` with its KV rows stored as --kv-format says (`ModelConfig.kv_format`: "bf16"
    or "fp8_ds_mla"); None keeps the model's own. The weights are the same in either format.

    Raises:
      ValueError: the model's widths do not fit the format, naming the flag.
    """
    if kv_format is None or kv_format == config.kv_format:
        return config
    try:
        return config.replace(kv_format=kv_format)
    except ValueError as err:
        raise ValueError(f"--kv-format {kv_format}: {err}") from None


def resolve_model(args: ModelArgs):
    """(config, load weights or None, tokenizer or None) of the model flags `args`, reading
    only config and tokenizer files: the embedded model and model directories come with
    weights (`load()` reads them, after the memory check) and a tokenizer; a preset gets random
    weights (or --weights) and the byte tokenizer. The config stores its KV rows as
    --kv-format says (`with_kv_format`).

    Raises:
      ValueError: flags that do not go together, or files that are missing or malformed,
        naming the flag or the file.
    """
    if not isinstance(args, ModelArgs):
        raise TypeError(f"resolve_model takes a fo_jax.flags.ModelArgs "
                        f"(ModelArgs.from_cli_args), got {type(args).__name__}")
    config, load, tokenizer = _resolve_model(args)
    return with_kv_format(config, args.kv_format), load, tokenizer


def _resolve_model(args: ModelArgs):
    """`resolve_model` before --kv-format."""
    import functools

    from fo_jax import embedded
    from fo_jax.config import get_config
    from fo_jax.tokenizer import load_tokenizer

    fp8 = args.checkpoint_weights
    if args.model_dir is not None:
        if args.model is not None or args.weights is not None:
            raise ValueError("--model-dir brings its own config and weights: drop --model / "
                             "--weights")
        config, kind = model_dir_config(args.model_dir)
        if kind == "fo_jax" and fp8 is not None:
            raise ValueError(f"--checkpoint-weights {fp8}: {args.model_dir} is a fo_jax model "
                             "directory; the flag applies to a Hugging Face checkpoint's FP8 "
                             "weights")
        if kind == "fo_jax":
            return (config, functools.partial(embedded.load_model_dir, args.model_dir),
                    load_tokenizer(args.model_dir))
        from fo_jax.checkpoints import load_checkpoint
        from fo_jax.checkpoints.hf import resolve_weights

        tokenizer = load_tokenizer(args.model_dir)
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"{args.model_dir}: tokenizer.json has {tokenizer.vocab_size} ids "
                             f"but config.json vocab_size={config.vocab_size}")
        return (config, functools.partial(load_checkpoint, args.model_dir, config,
                                          progress=not args.no_progress,
                                          weights=resolve_weights(fp8, args.model_dir)),
                tokenizer)
    if fp8 is not None:
        raise ValueError(f"--checkpoint-weights {fp8} applies to a Hugging Face checkpoint's "
                         "FP8 weights: add --model-dir")
    name = DEFAULT_MODEL if args.model is None else args.model
    if name == DEFAULT_MODEL and args.weights is None:
        if not embedded.embedded_available():
            embedded.load_embedded()  # raises, naming what is missing
        return (embedded.read_config(embedded.EMBEDDED_DIR), embedded.load_embedded,
                load_tokenizer(embedded.EMBEDDED_DIR))
    config = get_config(name)
    if name == DEFAULT_MODEL:  # its own weights file: its BPE tokenizer still applies
        return config, None, load_tokenizer(embedded.EMBEDDED_DIR)
    return config, None, None

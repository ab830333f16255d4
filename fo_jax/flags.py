"""The `fo-jax` flags: their values, checked as argparse parses them (`type=`), and the flags
every command that runs a model shares, written once.

    parser.add_argument("--port", type=flags.port, default=8000)
    parser.add_argument("--host-pool-gb", type=flags.gigabytes, default=None)
    ModelArgs.add_cli_args(parser)            # --model, --model-dir, --weights, --kv-format, ...
    add_drafting_args(parser)                 # --drafter, --num-drafts
    model_args = ModelArgs.from_cli_args(parser.parse_args())
    drafter, num_drafts = drafting(args.drafter, args.num_drafts, config)

Each type takes the flag's text and returns its value or raises `argparse.ArgumentTypeError`
saying what was expected and what came, so that a bad one stops the command at once (exit 2,
the flag named: "argument --port: ...") instead of after the model is built, or not at all (a
port of 70000 listened on 4464). `check_output_path` is the library's check of a file it will
append to (`fo_jax.engine.metrics.MetricsLog`); `output_path` is the same as a type.

`generate`, `serve` and `bench-serve` take one vocabulary: the model flags (`ModelArgs`, which
`fo_jax.resolve.resolve_model` reads) and the drafting flags (`add_drafting_args`, resolved by
`drafting`: `--drafter ngram|mtp` with `--num-drafts D`, D checked against the model by
`fo_jax.config.check_num_drafts`, the rule `generate` and the engine check too). Nothing here
imports the rest of fo_jax but `fo_jax.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from fo_jax.config import KV_FORMATS, check_num_drafts

SEED_MAX = 2**63 - 2  # jax.random.key takes an int64; a preset's random MTP layer uses seed + 1


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None


def port(text: str) -> int:
    """A TCP port: an int in [1, 65535]."""
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port: give an int in "
                                         "[1, 65535]")
    return value


def seed(text: str) -> int:
    """A random seed: an int in [0, 2**63 - 2]."""
    value = _int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{value} is not a seed: give an int in "
                                         "[0, 2**63 - 2]")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be an int >= 0")
    return value


def seconds(text: str) -> float:
    """A duration: a finite number of seconds >= 0."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number of seconds >= 0")
    return value


def _size(text: str, unit: str, scale: float) -> float:
    value = _number(text)
    if not (math.isfinite(value * scale) and value > 0):
        raise argparse.ArgumentTypeError(f"{value} must be a size in {unit}: a finite number "
                                         "> 0")
    return value


def gigabytes(text: str) -> float:
    """A size in GB (1e9 bytes): a finite number > 0 (whose bytes are finite too)."""
    return _size(text, "GB", 1e9)


def megabytes(text: str) -> float:
    """A size in MB (1e6 bytes): a finite number > 0."""
    return _size(text, "MB", 1e6)


def check_output_path(path) -> None:
    """Raise ValueError unless `path` names a file that can be created or appended to: its
    folder exists and is writable, and it is not a folder itself. Creates nothing."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory: give a file path")
    if not os.path.isdir(folder):
        raise ValueError(f"{path}: the directory {folder} does not exist: create it first")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{path}: the file cannot be written (permissions)")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: the directory {folder} cannot be written (permissions)")


def output_path(text: str) -> str:
    """A file to write or append to (`check_output_path`)."""
    try:
        check_output_path(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


# The model flags ------------------------------------------------------------------------------

DEFAULT_MODEL = "trained-small"


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Which model a command runs and how it is loaded: one field per flag (`add_cli_args`
    gives each its help). `fo_jax.resolve.resolve_model` turns them into the model's config,
    a loader of its weights and its tokenizer.

    Attributes:
      model: a preset name, or None for `DEFAULT_MODEL` (the model shipped with the package).
      model_dir: a model directory (fo_jax or Hugging Face), or None.
      weights: safetensors weights for a `model` preset, or None for random ones.
      checkpoint_weights: "fp8" or "dequantize": a Hugging Face checkpoint's FP8 weights.
      kv_format: how KV rows are stored ("bf16", "fp8_ds_mla"), or None for the model's own.
      seed: the random weights of a preset (and, in `generate`, the sampling seed).
      max_param_gb: refuse parameters above this many GB (None: half the available memory).
      no_progress: no progress bars while loading (and generating).
    """

    model: str | None = None
    model_dir: str | None = None
    weights: str | None = None
    checkpoint_weights: str | None = None
    kv_format: str | None = None
    seed: int = 0
    max_param_gb: float | None = None
    no_progress: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *,
                     seed_help: str = "random weights of a --model preset") -> None:
        """Add the model flags to `parser` (`seed_help`: what --seed seeds in this command)."""
        parser.add_argument("--model", default=None,
                            help=f"{DEFAULT_MODEL} (default: the trained model shipped with the "
                                 "package) or a preset run with random weights (tiny, small) "
                                 "or --weights")
        parser.add_argument("--model-dir", default=None,
                            help="a model directory: config.json, model.safetensors (or a "
                                 "training run's sparse.safetensors), tokenizer.json; or a "
                                 "Hugging Face checkpoint of DeepseekV32ForCausalLM / "
                                 "GlmMoeDsaForCausalLM (config.json, safetensors shards, "
                                 "tokenizer.json, tokenizer_config.json, "
                                 "generation_config.json)")
        parser.add_argument("--weights", default=None,
                            help="safetensors weights for a --model preset (default: random)")
        parser.add_argument("--checkpoint-weights", default=None, choices=("fp8", "dequantize"),
                            help="a Hugging Face --model-dir's FP8 weights: fp8 keeps them FP8 "
                                 "(1 byte a weight plus its block scales, multiplied in FP8), "
                                 "dequantize converts them to the model's dtype on load "
                                 "(default: fp8 for a checkpoint with a quantization_config)")
        parser.add_argument("--kv-format", default=None, choices=KV_FORMATS,
                            help="how KV rows are stored, resident and offloaded alike: bf16, "
                                 "or fp8_ds_mla (DeepSeek's 656-byte FP8 rows at real size) "
                                 "(default: the model's own, bf16 for the presets and the "
                                 "embedded model)")
        parser.add_argument("--seed", type=seed, default=0, help=seed_help)
        parser.add_argument("--max-param-gb", type=float, default=None,
                            help="refuse a model whose parameters exceed this many GB "
                                 "(default: half of the available memory)")
        parser.add_argument("--no-progress", action="store_true")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ModelArgs":
        """The model flags of parsed `args` (a parser given `add_cli_args`; other flags are
        left alone)."""
        values = vars(args)
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


# The drafting flags ---------------------------------------------------------------------------

DRAFTERS = ("ngram", "mtp")


class _DeprecatedDraft(argparse.Action):
    """`--draft none|ngram|mtp`, the old spelling of `--drafter` (`none`: no drafter): sets
    --drafter and says so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"fo-jax: warning: --draft is deprecated: use --drafter {values}"
              if values != "none" else "fo-jax: warning: --draft is deprecated: drop "
              "--draft none (no drafter is the default)", file=sys.stderr)
        namespace.drafter = None if values == "none" else values


def add_drafting_args(parser: argparse.ArgumentParser) -> None:
    """Add the speculative-decoding flags to `parser`: --drafter, --num-drafts (and the
    hidden, deprecated --draft). `drafting` resolves them against the model."""
    parser.add_argument("--drafter", default=None, choices=DRAFTERS,
                        help="speculative decoding: drafts from prompt lookup in each "
                             "request's history (ngram) or the model's MTP layer (mtp: a "
                             "--model-dir Hugging Face checkpoint with "
                             "num_nextn_predict_layers >= 1; a preset's random weights get a "
                             "random one), verified by W-way decode steps; at temperature 0 "
                             "the tokens are those of decoding without drafts, above it "
                             "speculative sampling draws tokens of the same distribution "
                             "(default: none; ngram with --num-drafts)")
    parser.add_argument("--num-drafts", type=non_negative_int, default=None,
                        help="drafts per request and decode step (default: with --drafter, "
                             "the model's max_ways - 1; else 0, no drafts)")
    parser.add_argument("--draft", action=_DeprecatedDraft, dest="drafter",
                        choices=("none",) + DRAFTERS, help=argparse.SUPPRESS)


def drafting(drafter: str | None, num_drafts: int | None, config) -> tuple[str | None, int]:
    """(drafter or None, drafts per step) of the --drafter and --num-drafts flags for a model
    of `config`: --num-drafts defaults to the model's max_ways - 1 with a drafter, 0 without;
    --num-drafts D >= 1 alone drafts with ngram. D is checked against the model
    (`fo_jax.config.check_num_drafts`: W = D + 1 <= config.max_ways).

    Raises:
      ValueError: a drafter with --num-drafts 0, an unknown drafter, or a D the model's steps
        cannot verify, naming the flags.
    """
    if drafter is not None and drafter not in DRAFTERS:
        raise ValueError(f"--drafter {drafter}: choose one of {', '.join(DRAFTERS)}")
    if drafter is None:
        if not num_drafts:
            return None, 0
        drafter = "ngram"
    elif num_drafts is None:
        num_drafts = config.max_ways - 1
    elif num_drafts < 1:
        raise ValueError(f"--drafter {drafter} needs --num-drafts >= 1")
    try:
        check_num_drafts(num_drafts, config)
    except ValueError as err:
        raise ValueError(f"--num-drafts {num_drafts}: {err}") from None
    return drafter, num_drafts


__all__ = ["DEFAULT_MODEL", "DRAFTERS", "ModelArgs", "SEED_MAX", "add_drafting_args",
           "check_output_path", "drafting", "gigabytes", "megabytes", "non_negative_int",
           "output_path", "port", "seconds", "seed"]

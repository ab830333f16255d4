"""Values of the `fo-jax` flags, checked as argparse parses them (`type=`), so that a bad one
stops the command at once (exit 2, the flag named: "argument --port: ...") instead of after
the model is built, or not at all (a port of 70000 listened on 4464).

    parser.add_argument("--port", type=flags.port, default=8000)
    parser.add_argument("--host-pool-gb", type=flags.gigabytes, default=None)

Each type takes the flag's text and returns its value or raises `argparse.ArgumentTypeError`
saying what was expected and what came. `check_output_path` is the library's check of a file
it will append to (`fo_jax.engine.metrics.MetricsLog`); `output_path` is the same as a type.
Nothing here imports the rest of fo_jax.
"""

from __future__ import annotations

import argparse
import math
import os

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


__all__ = ["SEED_MAX", "check_output_path", "gigabytes", "megabytes", "non_negative_int",
           "output_path", "port", "seconds", "seed"]

"""The serving engine over the pure decode steps.

`fo_jax.engine.loop`: the jit-compiled decode loop (`decode_loop`): up to N decode steps with
on-device sampling, stop checks and summed statistics in one program.
`fo_jax.engine.engine`: continuous batching over seats (`Engine`).
"""

from fo_jax.engine.engine import Engine, RequestOutput

from fo_jax.engine.loop import (
    LoopOutput,
    LoopStats,
    OffloadedStep,
    ResidentStep,
    Sampling,
    Seats,
    decode_loop,
    sample_tokens,
)

__all__ = ["Engine", "RequestOutput", "LoopOutput", "LoopStats", "OffloadedStep", "ResidentStep", "Sampling", "Seats",
           "decode_loop", "sample_tokens"]

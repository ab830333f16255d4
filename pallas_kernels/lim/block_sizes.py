"""Tuning knobs of the LIM kernel."""

from __future__ import annotations

import dataclasses

# Mosaic TPU tiles the last two dims of a VMEM block by (8, 128): a tile of scores or slots is
# [W, block_s] with block_s on the 128-wide lane axis.
LANES = 128

# Default tiles, largest first: lane-aligned ones for Mosaic, then smaller ones that only the
# interpreter takes.
_COMPILED_BLOCK_S = (1024, 512, 256, 128)
_INTERPRET_ONLY_BLOCK_S = (64, 32, 16, 8)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """How the S token axis is cut into tiles.

    Attributes:
      block_s: tokens per tile: one DMA of `[block_s, N]` indexer keys and `[block_s]` slots, one
        `[W * I, N] x [N, block_s]` matmul. Must divide S. Compiled for a TPU it must also be a
        multiple of 128 (or equal S); interpret mode takes any divisor, so tests can use tiny tiles.
    """

    block_s: int

    def __post_init__(self):
        block_s = self.block_s
        if not isinstance(block_s, int) or isinstance(block_s, bool):
            raise ValueError(f"{block_s=} must be an int")
        if block_s <= 0:
            raise ValueError(f"{block_s=} must be > 0")

    def validate(self, *, s: int, interpret: bool) -> None:
        """Checks the tile against the token count `s`; raises ValueError / NotImplementedError."""
        block_s = self.block_s
        if s % block_s:
            raise ValueError(f"{block_s=} must divide {s=}")
        if not interpret and block_s % LANES and block_s != s:
            raise NotImplementedError(
                f"{block_s=} must be a multiple of {LANES} or equal {s=} on the Mosaic TPU backend "
                "(lane tiling of the [W, block_s] output tiles); interpret mode accepts it"
            )

    @classmethod
    def get_default(cls, *, s: int, interpret: bool = False) -> BlockSizes:
        """The largest tile from a list that divides `s`; `s` itself (one tile) if none does.

        Compiled: 1024, 512, 256, 128 (lane-aligned). Interpret mode has no tiling constraint,
        so the list goes on down to 8: S = 96 gets tiles of 32, S = 200 tiles of 8, and only an
        S with no such divisor (S < 8, or odd) is one tile.
        """
        candidates = _COMPILED_BLOCK_S + (_INTERPRET_ONLY_BLOCK_S if interpret else ())
        for block_s in candidates:
            if s % block_s == 0:
                return cls(block_s=block_s)
        return cls(block_s=s)

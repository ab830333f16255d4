"""Tuning knobs of the CopySFA kernel."""

from __future__ import annotations

import dataclasses

# Mosaic TPU packs bfloat16 rows two to a 32-bit sublane, so a VMEM tile of bf16 rows is
# (16, 128): a workspace of `block_k` rows should hold whole tiles.
SUBLANES_BF16 = 16

# Default tiles, largest first: whole sublane tiles for Mosaic, then smaller ones that only the
# interpreter takes.
_COMPILED_BLOCK_K = (512, 256, 128, 64, 32, 16)
_INTERPRET_ONLY_BLOCK_K = (8, 4)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """How each way's K selected rows are cut into tiles.

    Attributes:
      block_k: selected rows per tile: one gather of `[block_k, D + R]` rows into one half of
        the double-buffered VMEM workspace, one `[H, D + R] x [D + R, block_k]` score matmul and
        one `[H, block_k] x [block_k, D]` value matmul. Must divide K. Compiled for a TPU it
        should also be a multiple of 16 (whole bf16 sublane tiles); interpret mode takes any
        divisor, so tests can use tiny tiles.
    """

    block_k: int

    def __post_init__(self):
        if not isinstance(self.block_k, int) or isinstance(self.block_k, bool):
            raise ValueError(f"{self.block_k=} must be an int")
        if self.block_k <= 0:
            raise ValueError(f"{self.block_k=} must be > 0")

    def validate(self, *, k: int, interpret: bool) -> None:
        """Checks the tile against the top-k `k`; raises ValueError / NotImplementedError."""
        block_k = self.block_k
        if k % block_k:
            raise ValueError(f"{block_k=} must divide {k=}")
        if not interpret and block_k % SUBLANES_BF16 and block_k != k:
            raise NotImplementedError(
                f"{block_k=} must be a multiple of {SUBLANES_BF16} or equal {k=} on the Mosaic "
                "TPU backend (sublane tiling of the [block_k, D + R] workspace); interpret "
                "mode accepts it"
            )

    @classmethod
    def get_default(cls, *, k: int, interpret: bool = False) -> BlockSizes:
        """The largest tile from a list that divides `k`; `k` itself (one tile) if none does.

        Compiled: 512 (4 tiles at K = 2048, as in the design), 256, ..., 16 (whole bf16
        sublane tiles). Interpret mode has no tiling constraint, so the list goes on down to 4:
        a small or non-power-of-two K (12, 24, 40) still gets several tiles per way.
        """
        candidates = _COMPILED_BLOCK_K + (_INTERPRET_ONLY_BLOCK_K if interpret else ())
        for block_k in candidates:
            if k % block_k == 0:
                return cls(block_k=block_k)
        return cls(block_k=k)


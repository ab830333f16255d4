"""LIM: lightning-indexer scores fused with the hot-cache slot lookup, and its top-k selection."""

from pallas_kernels.lim.block_sizes import BlockSizes
from pallas_kernels.lim.kernel import HIDDEN
from pallas_kernels.lim.kernel import MAX_SLOTS
from pallas_kernels.lim.kernel import MAX_TOKENS
from pallas_kernels.lim.kernel import MISS
from pallas_kernels.lim.kernel import check_lim_inputs
from pallas_kernels.lim.kernel import lim
from pallas_kernels.lim.kernel import lim_scores
from pallas_kernels.lim.kernel import lim_select
from pallas_kernels.lim.reference import lim_reference

__all__ = [
    "BlockSizes",
    "HIDDEN",
    "MAX_SLOTS",
    "MAX_TOKENS",
    "MISS",
    "check_lim_inputs",
    "lim",
    "lim_reference",
    "lim_scores",
    "lim_select",
]

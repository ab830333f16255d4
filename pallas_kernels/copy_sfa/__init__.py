"""CopySFA: sparse MLA attention that installs the hot-cache misses from host in the same pass."""

from pallas_kernels.copy_sfa.block_sizes import BlockSizes
from pallas_kernels.copy_sfa.kernel import copy_sfa
from pallas_kernels.copy_sfa.reference import check_copy_sfa_inputs
from pallas_kernels.copy_sfa.reference import copy_sfa_reference
from pallas_kernels.copy_sfa.reference import static_validate_inputs

__all__ = [
    "BlockSizes",
    "check_copy_sfa_inputs",
    "copy_sfa",
    "copy_sfa_reference",
    "static_validate_inputs",
]

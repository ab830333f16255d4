"""Shared test settings: hypothesis profiles (derandomized in CI) and small helpers."""

import gc
import os

from jaxtyping import install_import_hook

# Runtime shape checks of the jaxtyping annotations of the array functions (model and cache
# management; the state pytrees are left unchecked: JAX rebuilds them with non-array leaves), in
# tests only. The hook must be installed before the packages are first imported.
_HOOK = install_import_hook(["fo_jax.model", "fo_jax.offload.manage"], "beartype.beartype")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

jax.config.update("jax_enable_x64", False)


def random_tokens(seed: int, shape, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    Each XLA:CPU executable holds ~3 memory mappings of JIT code, and one pytest worker compiles
    thousands of programs: past the kernel's vm.max_map_count (65530) the next compilation
    crashes the worker with a segmentation fault. Programs are rarely shared between modules,
    so clearing costs little."""
    yield
    jax.clear_caches()
    gc.collect()

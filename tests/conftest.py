"""Shared test settings: hypothesis profiles (derandomized in CI), the order test files run in,
and small helpers."""

import collections
import gc
import os
import time

# XLA:CPU compiles without LLVM's expensive passes (its loop and SLP vectorizers, unrolling), in
# this process and the subprocesses that inherit its environment: compiling is most of the
# suite's time, and this shortens it a little (tests/engine/test_engine.py 57.4 s -> 54.2 s,
# back to back on an idle 2-core machine). The arithmetic is unchanged: fast-math stays
# off, so those passes may not reorder a float operation, and FMA contraction is the code
# generator's (test_compile_flags.py checks a model's logits bit for bit against a process
# without the flag). FO_JAX_TEST_FULL_LLVM=1 keeps XLA's default passes.
if os.environ.get("FO_JAX_TEST_FULL_LLVM", "0") in ("0", ""):
    FAST_COMPILE_FLAG = "--xla_llvm_disable_expensive_passes=true"
    if FAST_COMPILE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = " ".join(
            (os.environ.get("XLA_FLAGS", ""), FAST_COMPILE_FLAG)).strip()

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


def _process_maps() -> tuple[int, int] | None:
    """(memory mappings of this process, the kernel's limit on them), or None off Linux."""
    try:
        with open("/proc/self/maps") as f:
            count = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return count, int(f.read())
    except (OSError, ValueError):
        return None


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


# Past either, compiled programs are dropped after the module (see below).
MAP_SHARE = 0.4          # of vm.max_map_count
RESIDENT_BYTES = 5 << 29  # 2.5 GiB


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Drop every compiled program after a test module once the process holds many.

    Each XLA:CPU executable holds ~3 memory mappings of JIT code, and one pytest worker compiles
    thousands of programs: past the kernel's vm.max_map_count (65530) the next compilation
    crashes the worker with a segmentation fault. Modules share many programs (the engine's
    loop and seat programs on the same test models), so they are kept until the mappings pass
    MAP_SHARE of the limit or the process RESIDENT_BYTES; off Linux, after every module.
    FO_JAX_TEST_CACHE_LOG=PATH appends each module's mappings, resident MiB and whether it
    cleared to PATH."""
    yield
    maps = _process_maps()
    resident = _resident_bytes()
    clear = maps is None or maps[0] > MAP_SHARE * maps[1] or resident > RESIDENT_BYTES
    if os.environ.get("FO_JAX_TEST_CACHE_LOG"):  # where the suite's compile time goes
        with open(os.environ["FO_JAX_TEST_CACHE_LOG"], "a") as f:
            f.write(f"{os.getpid()} {time.time():.1f} {request.module.__name__} "
                    f"maps={maps and maps[0]} rss_mib={resident >> 20} clear={clear}\n")
    if clear:
        jax.clear_caches()
        gc.collect()


# The slowest test files (seconds of their longest tests on 2 cores, `--durations`), longest
# first. `pytest -n 2 --dist loadfile` hands whole files to the workers in queue order; by
# default pytest-xdist queues the files with the most tests first, which leaves the files of one
# or two long tests (a benchmark's smoke run, a subprocess on simulated devices) to the end,
# where one worker runs them alone while the other idles (measured: the last 5% of the tests
# took 4 of 18 minutes). Queued longest first, the end of the run is short files. A file not
# listed goes after these, by number of tests as before; a stale list only costs time.
SLOW_FILES = (
    "tests/offload/test_prefill.py",
    "tests/engine/test_engine.py",
    "tests/offload/test_decode_pallas.py",
    "tests/engine/test_dp_engine.py",
    "tests/engine/test_sharded_engine.py",
    "tests/experiments/test_serving_bench_smoke.py",
    "tests/test_cli.py",
    "tests/sharding/test_data_parallel.py",
    "tests/sharding/test_fp8_sharding.py",
    "tests/sharding/test_all_to_all.py",
    "tests/test_mtp_drafting.py",
    "tests/offload/test_decode.py",
    "tests/engine/test_engine_mtp.py",
    "tests/experiments/test_device_diagnosis_smoke.py",
    # Before the training smoke run, on purpose: run after it in the same worker, the serving
    # latency smoke run ends the worker ("I/O operation on closed file", "lost sys.stderr";
    # under output capture only, cause not found yet), so it is queued first.
    "tests/experiments/test_serving_latency_smoke.py",
    "tests/experiments/test_train_smoke.py",
    "tests/test_multiprocess.py",
    "tests/checkpoints/test_mtp_checkpoint.py",
    "tests/experiments/test_accelerator_check_smoke.py",
    "tests/engine/test_auto.py",
    "tests/engine/test_resident_prefix.py",
    "tests/checkpoints/test_hf_model_dir.py",
    "tests/experiments/test_decode_loop_bench_smoke.py",
    "tests/experiments/test_auto_offload_bench_smoke.py",
    "tests/experiments/test_decode_bench_smoke.py",
    "tests/model/test_init_params.py",
    "tests/experiments/test_record_traces_smoke.py",
    "tests/experiments/test_expert_layouts_smoke.py",
    "tests/test_readme.py",
    "tests/engine/test_bench.py",
)


def pytest_configure(config):
    # Keep the queue in the collection order set below (pytest-xdist's own reordering by number
    # of tests would undo it); without pytest-xdist the option does not exist.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Test files in SLOW_FILES order first, then the rest by number of tests (most first);
    tests keep their order within a file."""
    def path(item):
        return item.nodeid.split("::")[0]

    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    counts = collections.Counter(path(item) for item in items)
    items.sort(key=lambda item: (rank.get(path(item), len(rank)), -counts[path(item)]))

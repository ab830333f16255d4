"""fo_jax's own host copies (fo_jax/offload/ffi): the CPU target against the jnp references,
in place on a donated pinned_host pool; the programs that run them touch host memory only
through them when lowered for CUDA; the CUDA target compiles with nvcc; the default setting.

The decode step, the prefill and the handoff under "ffi", bit for bit against the resident
path, are in tests/offload/test_host.py with the other settings.
"""

from __future__ import annotations

import ctypes
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import hlo_checks, host_memory_checks, resident
from fo_jax.config import get_config
from fo_jax import decode_loop as loop
from fo_jax.model.dsa import init_params
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import ffi
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload.config import OffloadConfig, default_host_access
from fo_jax.offload.ffi import library
from fo_jax.offload.state import DecodeState, to_memory_kind
from fo_jax.sampling import Sampling

L, F, Z, W = 3, 5, 4, 8  # pool [L, F, Z, W]: N = F Z = 20 rows per layer
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "uint8": np.uint8}


def _pool(dtype, seed=0):
    values = np.random.default_rng(seed).integers(0, 250, (L, F, Z, W))
    return np.asarray(values).astype(dtype)


# Entries: valid ones, then every way of being skipped (padding, layer or row out of range,
# an item running past its layer).
INDEX = {
    1: [[0, 3], [2, 19], [1, 0], [-1, -1], [3, 0], [0, -1], [1, 20], [2, 7]],
    Z: [[1, 0], [2, 16], [0, 8], [-1, -1], [0, 17], [3, 4], [2, 12]],
}


def test_gather_by_hand():
    # pool[l, f, z, w] = 1000 l + 100 f + 10 z + w: layer 1's row 6 is page 1, offset 2 (6 =
    # 1 * 4 + 2), so its values are 1000 + 100 + 20 + w; an item of 2 rows from row 7 is rows
    # 7 (page 1, offset 3) and 8 (page 2, offset 0) of layer 2; (-1, -1) reads zeros.
    l, f, z, w = np.meshgrid(*map(np.arange, (L, F, Z, W)), indexing="ij")
    pool = (1000 * l + 100 * f + 10 * z + w).astype(np.float32)
    got = jax.jit(lambda p, i: ffi.gather_items(p, i, item_rows=2))(
        pool, jnp.array([[1, 6], [2, 7], [-1, -1]], jnp.int32))
    want = np.stack([[1120 + np.arange(W), 1130 + np.arange(W)],
                     [2130 + np.arange(W), 2200 + np.arange(W)],
                     np.zeros((2, W))]).astype(np.float32)
    chex.assert_trees_all_equal(np.asarray(got), want)


@pytest.mark.parametrize("item_rows", INDEX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_equals_the_reference(dtype, item_rows):
    pool = _pool(DTYPES[dtype])
    index = jnp.array(INDEX[item_rows], jnp.int32)
    host = to_memory_kind(jnp.asarray(pool), "pinned_host")
    got = jax.jit(functools.partial(ffi.gather_items, item_rows=item_rows))(host, index)
    assert got.sharding.memory_kind == "device"
    want = ffi.gather_items_reference(jnp.asarray(pool), index, item_rows=item_rows)
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(got)[3].any()  # a skipped entry reads zeros


@pytest.mark.parametrize("item_rows", INDEX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_equals_the_reference_in_place(dtype, item_rows):
    pool = _pool(DTYPES[dtype], 1)
    index = jnp.array(INDEX[item_rows], jnp.int32)
    rows = jnp.asarray(_pool(DTYPES[dtype], 2).reshape(-1, W)[:len(index) * item_rows]
                       .reshape(len(index), item_rows, W))
    want = ffi.scatter_items_reference(jnp.asarray(pool), rows, index, item_rows=item_rows)
    write = jax.jit(functools.partial(ffi.scatter_items, item_rows=item_rows),
                    donate_argnums=0)
    host = to_memory_kind(jnp.asarray(pool), "pinned_host")
    compiled = write.lower(host, rows, index).compile().as_text()
    got = write(host, rows, index)
    assert got.sharding.memory_kind == "pinned_host"
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want))
    # The pool is aliased, parameter to result, and never copied.
    assert "input_output_alias={ {}: (0, {}" in compiled
    assert "output_to_operand_aliasing={{}: (0, {})}" in compiled
    assert not [line for line in compiled.splitlines() if " copy(" in line]


def test_read_bulk_equals_one_item_of_the_gather():
    pool = jnp.asarray(_pool(np.float32, 3))
    got = jax.jit(lambda p: ffi.read_bulk(p, layer=2, row=5, rows=9))(pool)
    want = ffi.gather_items(pool, jnp.array([[2, 5]], jnp.int32), item_rows=9)[0]
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("call,message", [
    (lambda p, i: ffi.gather_items(p[0], i), r"pool must be \[L, F, Z, W\], got shape"),
    (lambda p, i: ffi.gather_items(p, i[:, :1]), r"index must be \[R, 2\] int32"),
    (lambda p, i: ffi.gather_items(p, i.astype(jnp.int16)), r"index must be \[R, 2\] int32"),
    (lambda p, i: ffi.gather_items(p, i, item_rows=F * Z + 1),
     r"item_rows=21 must be in \[1, F Z=20\]"),
    (lambda p, i: ffi.scatter_items(p, jnp.zeros((2, 1, W), p.dtype), i),
     r"rows must be \(3, 1, 8\) float32 \(R, item_rows, W\), got \(2, 1, 8\)"),
    (lambda p, i: ffi.scatter_items(p, jnp.zeros((3, 1, W), jnp.bfloat16), i),
     r"rows must be \(3, 1, 8\) float32"),
    (lambda p, i: ffi.read_bulk(p, layer=0, row=15, rows=6),
     r"rows 15..21 of layer 0 are not inside the pool"),
])
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(jnp.zeros((L, F, Z, W), jnp.float32), jnp.zeros((3, 2), jnp.int32))


def test_the_target_checks_its_operands_too():
    # The C++ side refuses what the Python wrapper would have: a result of the wrong size.
    library.ensure_registered()
    call = jax.ffi.ffi_call("fo_jax_host_gather", jax.ShapeDtypeStruct((3, 2, W), jnp.float32))
    with pytest.raises(Exception, match=r"fo_jax_host_gather: rows \[3, 2, 8\] hold 192 bytes; "
                                        r"R \* item_rows rows of the pool's W values are 96"):
        jax.block_until_ready(jax.jit(lambda p, i: call(p, i, item_rows=np.int64(1)))(
            jnp.zeros((L, F, Z, W), jnp.float32), jnp.zeros((3, 2), jnp.int32)))


# The programs, lowered for CUDA: host memory reaches only the copies -------------------------

CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _lowered(access):
    """{name: StableHLO module} of the decode step, the decode loop, the prefill with
    history and the handoff's hot-row gather, each as its public entry point calls it."""
    offload = OffloadConfig(hot_slots=8, page_size=4, capacity=32, host_access=access)
    state = DecodeState.create(CONFIG, offload, batch=2)
    tokens = jnp.zeros((2, 1), jnp.int32)
    programs = {}
    fn, a, k = hlo_checks.captured_call(offload_decode, "decode_jit",
                                        offload_decode.decode_step, _params(), state, tokens,
                                        config=CONFIG, offload=offload)
    programs["decode_step"] = host_memory_checks.lower_for(fn, *a, **k)
    step = loop.OffloadedStep(CONFIG, offload)
    sampling = Sampling.create(2)
    seats = loop.Seats.create(np.array([1, 2], np.int32), jax.random.key(0), sampling=sampling,
                              lengths=state.lengths, capacity=state.capacity)
    fn, a, k = hlo_checks.captured_call(loop, "loop_jit", loop.decode_loop, _params(), state,
                                        seats, 2, sampling, step=step)
    programs["decode_loop"] = host_memory_checks.lower_for(fn, *a, **k)
    pstate = offload_prefill.PrefillState.create(CONFIG, batch=2, capacity=32, page_size=4)
    fn, a, k = hlo_checks.captured_call(offload_prefill, "prefill_jit", offload_prefill.prefill,
                                        _params(), pstate, jnp.zeros((2, 4), jnp.int32),
                                        config=CONFIG, num_buffers=2, history_pages=2,
                                        check=False, host_access=access)
    programs["prefill"] = host_memory_checks.lower_for(fn, *a, **k)
    programs["handoff"] = host_memory_checks.lower_for(
        offload_prefill.gather_hot, pstate.host.kv, pstate.table, jnp.zeros((2, 8), jnp.int32),
        0.0, chunk=4, on_host=True, access=access)
    return programs


def test_programs_touch_host_memory_only_through_the_copies():
    for name, module in _lowered("ffi").items():
        faults = host_memory_checks.host_memory_faults(module, targets=library.TARGETS)
        assert faults == [], (name, faults)
    # The check can fail: under "gather" the same programs gather and scatter on host memory
    # (what XLA turned into host compute on an H200).
    for name, module in _lowered("gather").items():
        faults = host_memory_checks.host_memory_faults(module, targets=library.TARGETS)
        assert any("reads a host value" in f for f in faults), name


def test_host_memory_faults_name_each_kind_of_fault():
    host = to_memory_kind(jnp.zeros((L, F, Z, W), jnp.float32), "pinned_host")
    index = jnp.zeros((2, 2), jnp.int32)

    def faults(fn, *args):
        return host_memory_checks.host_memory_faults(host_memory_checks.lower_for(jax.jit(fn), *args),
                                             targets=library.TARGETS)

    assert faults(lambda p, i: ffi.gather_items(p, i), host, index) == []
    # The pool moved to the device first: the copy's pool operand is not in host memory.
    moved = faults(lambda p, i: ffi.gather_items(jax.device_put(p, jax.memory.Space.Device),
                                                 i), host, index)
    assert moved == [m for m in moved if "pool operand is not in host memory" in m] != []
    # A host value as the copy's row list.
    assert any("takes a host value as operand 1" in m
               for m in faults(lambda p, i: ffi.gather_items(p, i), host,
                               to_memory_kind(index, "pinned_host")))
    # Host compute, and a host value returned in device memory.
    assert any("stablehlo.add reads a host value" in m
               for m in faults(lambda p: jax.device_put(p + 1, jax.memory.Space.Host), host))


# The CUDA target ----------------------------------------------------------------------------


@pytest.mark.skipif(library.find_nvcc() is None, reason="no nvcc on this machine")
def test_cuda_target_compiles_and_exports_its_handlers(tmp_path):
    out = library.build_cuda(tmp_path / library.CUDA_NAME)
    text = out.read_bytes()
    for symbols in library.TARGETS.values():
        assert symbols["CUDA"].encode() in text
    # SASS for the H200's sm_90 is in the library (the driver there cannot JIT newer PTX).
    assert b"sm_90" in text


# The library and the default setting ----------------------------------------------------------


def test_cpu_library_is_compiled_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FO_JAX_CACHE_DIR", str(tmp_path))
    path = library.cpu_library()
    assert path.is_relative_to(tmp_path) and path.exists()
    stamp = path.stat().st_mtime_ns
    assert library.cpu_library() == path and path.stat().st_mtime_ns == stamp
    lib = ctypes.cdll.LoadLibrary(str(path))
    for symbols in library.TARGETS.values():
        assert hasattr(lib, symbols["cpu"])


def test_default_host_access_by_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("FO_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FO_JAX_CUDA_LIBRARY", raising=False)
    monkeypatch.setattr(library, "PACKAGED", tmp_path / "none")
    assert default_host_access("cpu") == "gather" == OffloadConfig(hot_slots=16).host_access
    assert default_host_access("tpu") == "gather"
    library._registered.discard("CUDA")
    with pytest.warns(UserWarning, match=r"host_access defaults to 'gather' on this GPU: the "
                                         r"CUDA host-copy library was not found.*python -m "
                                         r"fo_jax.offload.ffi cuda"):
        default_host_access.__globals__["_warn_no_library"].cache_clear()
        assert default_host_access("gpu") == "gather"
    built = tmp_path / library.CUDA_NAME
    built.write_bytes(b"")
    monkeypatch.setenv("FO_JAX_CUDA_LIBRARY", str(built))
    assert default_host_access("gpu") == "ffi"


def test_explicit_ffi_without_a_library_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("FO_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FO_JAX_CUDA_LIBRARY", raising=False)
    monkeypatch.setattr(library, "PACKAGED", tmp_path / "none")
    monkeypatch.setattr(library, "find_nvcc", lambda: None)
    library._registered.discard("CUDA")
    with pytest.raises(library.LibraryUnavailable,
                       match=r"needs the CUDA host-copy library: build it with `python -m "
                             r"fo_jax.offload.ffi cuda`.*host_access='gather' runs without it"):
        library.ensure_registered("gpu")
    monkeypatch.setenv("FO_JAX_CUDA_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(library.LibraryUnavailable, match=r"missing.so does not exist"):
        library.ensure_registered("gpu")
    with pytest.raises(NotImplementedError, match=r"no target for the 'tpu' backend"):
        library.ensure_registered("tpu")


def test_export_needs_and_gets_the_targets_named():
    exported = jax.export.export(jax.jit(lambda p, i: ffi.gather_items(p, i)),
                                 platforms=("cuda",), disabled_checks=library.export_checks())(
        to_memory_kind(jnp.zeros((L, F, Z, W), jnp.float32), "pinned_host"),
        jnp.zeros((2, 2), jnp.int32))
    assert re.search(r"custom_call @fo_jax_host_gather\(%arg0", exported.mlir_module())

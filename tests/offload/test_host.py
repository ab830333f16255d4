"""Host memory access (fo_jax/offload/host.py): both settings, bit for bit, on host-kind pages.

Every function against a numpy reference under "gather" and "slices"; "slices" built only from
dynamic slices on host memory and touching only the missed rows; the decode step and the prefill
bitwise equal to the resident path under "slices" (tests/offload/test_decode.py and
test_prefill.py cover "gather", the default); every function and the decode step cross-lowered
for CUDA on this CPU machine (`jax.export`), which checks that the lowering accepts the memory
spaces, not that XLA's GPU passes compile it (experiments/accelerator/accelerator_check.py does that
on a GPU).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import host
from fo_jax.offload.config import HOST_ACCESS, OffloadConfig
from fo_jax.offload.ffi import export_checks
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload.prefill import PrefillState, prefill, to_decode_state
from fo_jax.offload.state import DecodeState, to_memory_kind

NAN = float("nan")
TINY = get_config("tiny")
L, B, P, Z, W = 3, 2, 4, 4, 8  # host pool [L, F, Z, D+R], table [B, P]: S = 16 positions
F = B * P + 3  # the permuted pool: spare pages
TABLES = ("identity", "permuted")


def _table(kind):
    """(table [B, P] int32, F): the identity table over B P pages, or the pages of the two
    requests interleaved at random over a larger pool, request 1's last page not held."""
    if kind == "identity":
        return np.arange(B * P, dtype=np.int32).reshape(B, P), B * P
    table = np.random.default_rng(7).permutation(F)[:B * P].astype(np.int32).reshape(B, P)
    table[1, P - 1] = -1
    return table, F


def _pages(seed=0, kind="identity"):
    table, frames = _table(kind)
    kv = np.random.default_rng(seed).normal(size=(L, frames, Z, W)).astype(np.float32)
    return kv, to_memory_kind(jnp.asarray(kv), "pinned_host"), table


def _by_token(kv, table):
    """[L, B, S, W]: every request's rows through the table (pages not held: NaN)."""
    got = kv[:, np.maximum(table, 0)].reshape(L, B, P * Z, W).copy()
    got[:, np.repeat(table < 0, Z, axis=1)] = NAN
    return got


def _write(kv, table, layer, b, pos, row):
    """numpy: write one row through the table; positions past S or in pages not held drop."""
    if 0 <= pos < P * Z and table[b, pos // Z] >= 0:
        kv[layer, table[b, pos // Z], pos % Z] = row


# Each function against numpy, identity and permuted tables ---------------------------------


@pytest.mark.parametrize("kind", TABLES)
@pytest.mark.parametrize("access", HOST_ACCESS)
def test_gather_rows(access, kind):
    kv, pages, table = _pages(kind=kind)
    # Entries past count are real tokens too: "slices" must not read them (left zero).
    tokens = np.array([[5, 1, 15, 7, 3], [2, 9, 4, 0, 11]], np.int32)
    count = np.array([3, 2], np.int32)
    gather = jax.jit(lambda h, tb, t, c: host.host_gather_rows(h, tb, 1, t, c, chunk=2,
                                                               on_host=True, access=access))
    got = np.asarray(gather(pages, table, tokens, count))
    assert got.shape == (B, 5, W)
    for b in range(B):
        chex.assert_trees_all_equal(got[b, :count[b]],
                                    _by_token(kv, table)[1, b, tokens[b, :count[b]]])
    if access == "slices":  # one trip per miss: nothing past count was read
        assert not got[0, 3:].any() and not got[1, 2:].any()


@pytest.mark.parametrize("kind", TABLES)
@pytest.mark.parametrize("access", HOST_ACCESS)
def test_write_rows_all_layers(access, kind):
    kv, pages, table = _pages(1, kind)
    rows = np.random.default_rng(2).normal(size=(L, B, 2, W)).astype(np.float32)
    # 16 is past capacity: dropped; 13 is in request 1's last page (not held when permuted).
    positions = np.array([[4, 16], [6, 13]], np.int32)
    write = jax.jit(lambda h, tb, r, p: host.host_write_rows(h, tb, r, p, on_host=True,
                                                             access=access), donate_argnums=0)
    got = write(pages, table, jnp.asarray(rows), jnp.asarray(positions))
    assert got.sharding.memory_kind == "pinned_host"
    want = kv.copy()
    for layer in range(L):
        for b in range(B):
            for t in range(2):
                _write(want, table, layer, b, positions[b, t], rows[layer, b, t])
    chex.assert_trees_all_equal(np.asarray(got), want)  # the whole pool: spare pages too


@pytest.mark.parametrize("kind", TABLES)
@pytest.mark.parametrize("access", HOST_ACCESS)
def test_write_back_one_layer(access, kind):
    kv, pages, table = _pages(3, kind)
    rows = np.random.default_rng(4).normal(size=(B, 3, W)).astype(np.float32)
    write_pos = np.array([[13, 14, 15], [2, 16, 16]], np.int32)  # padding at S = 16
    write = jax.jit(lambda h, tb, r, p: host.write_back_rows(h, tb, 2, r, p, on_host=True,
                                                             access=access), donate_argnums=0)
    got = write(pages, table, jnp.asarray(rows), jnp.asarray(write_pos))
    want = kv.copy()
    for b in range(B):
        for t in range(3):
            _write(want, table, 2, b, write_pos[b, t], rows[b, t])
    chex.assert_trees_all_equal(np.asarray(got), want)


@pytest.mark.parametrize("kind", TABLES)
@pytest.mark.parametrize("access", HOST_ACCESS)
def test_load_history_reads_whole_pages_through_the_table(access, kind):
    kv, pages, table = _pages(5, kind)
    load = jax.jit(lambda h, tb: host.load_history(h, tb, 1, history_pages=2, on_host=True,
                                                   access=access))
    got = np.asarray(load(pages, table))
    assert got.shape == (B, 2 * Z, W)
    chex.assert_trees_all_equal(got, _by_token(kv, table)[1, :, :2 * Z])


def _sub_jaxprs(eqn):
    """The jaxprs an equation holds (loop bodies, branches, inner jits)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(sub, jax.extend.core.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jax.extend.core.Jaxpr):
                yield sub


def _host_ops(jaxpr, out):
    """Names of the primitives with an operand in host memory, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        if any(getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
               for v in eqn.invars if hasattr(v, "aval")):
            out.add(eqn.primitive.name)
        for sub in _sub_jaxprs(eqn):
            _host_ops(sub, out)
    return out


def _host_read_faults(jaxpr, out):
    """What happens to a gather or slice of host memory other than one move to the device, and
    to a host gather just moved other than an optimization barrier or a dynamic update slice
    (the uses that compiled on the H200), sub-jaxprs included. A slice moved and then reshaped
    is a plain DMA, which compiled there."""
    made, moved = {}, set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        for v in eqn.invars:
            if not isinstance(v, jax.extend.core.Var):
                continue
            if v in made and name != "device_put":
                out.add(f"{name} of a host {made[v]}")
            if v in moved and name not in ("optimization_barrier", "dynamic_update_slice"):
                out.add(f"{name} of a host gather just moved to the device")
        if name == "device_put" and any(isinstance(v, jax.extend.core.Var)
                                        and made.get(v) == "gather" for v in eqn.invars):
            moved.update(eqn.outvars)
        if (name in ("gather", "dynamic_slice")
                and getattr(eqn.invars[0].aval, "memory_space", None) == jax.memory.Space.Host):
            made.update({v: name for v in eqn.outvars})
        for sub in _sub_jaxprs(eqn):
            _host_read_faults(sub, out)
    return out


@pytest.mark.parametrize("access", HOST_ACCESS)
def test_host_reads_move_to_the_device_as_they_come(access):
    # On an H200 (jax 0.11.2) a gather of host pages moved to the device and reshaped there
    # did not compile: XLA folded the reshape into a bitcast from host to device memory
    # ("Bitcast cannot have different memory spaces of output (0) and operand (5)"). What a
    # gather or slice reads from host memory goes to the device as it is; a gather's rows then
    # pass a barrier or land in a buffer (experiments/accelerator/load_history_variants.py has the
    # variants tried there; the prefill's own `rows[None]` broke the first fix the same way).
    _, pages, table = _pages()
    tokens, count = jnp.zeros((B, 5), jnp.int32), jnp.ones((B,), jnp.int32)

    def every_read(h):
        got = host.host_gather_rows(h, table, 1, tokens, count, chunk=2, on_host=True,
                                    access=access)
        loaded = host.load_history(h, table, 1, history_pages=2, on_host=True, access=access)
        return got, loaded

    assert _host_read_faults(jax.make_jaxpr(every_read)(pages).jaxpr, set()) == set()


@pytest.mark.parametrize("access", HOST_ACCESS)
def test_slices_use_only_dynamic_slices_on_host_memory(access):
    _, pages, table = _pages()
    tokens, count = jnp.zeros((B, 5), jnp.int32), jnp.ones((B,), jnp.int32)
    rows, positions = jnp.zeros((L, B, 2, W)), jnp.zeros((B, 2), jnp.int32)

    def every_access(h):
        got = host.host_gather_rows(h, table, 1, tokens, count, chunk=2, on_host=True,
                                    access=access)
        h = host.host_write_rows(h, table, rows, positions, on_host=True, access=access)
        loaded = host.load_history(h, table, 1, history_pages=2, on_host=True, access=access)
        return got, loaded, host.write_back_rows(h, table, 1, rows[0], positions, on_host=True,
                                                 access=access)

    ops = _host_ops(jax.make_jaxpr(every_access)(pages).jaxpr, set())
    control = {"while", "scan", "pjit", "jit", "device_put", "reshape"}
    if access == "slices":
        assert ops - control == {"dynamic_slice", "dynamic_update_slice"}, ops
    elif access == "ffi":  # only our copies touch host memory
        assert ops - control == {"ffi_call"}, ops
    else:
        assert {"gather", "scatter"} <= ops, ops


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match=r"host_access='dma'; choose one of \('gather', "
                                         r"'slices', 'ffi'\)"):
        OffloadConfig(hot_slots=16, host_access="dma")
    state = PrefillState.create(TINY, batch=1, capacity=16, page_size=4)
    with pytest.raises(ValueError, match=r"host_access='dma'; choose one of"):
        prefill(None, state, jnp.zeros((1, 4), jnp.int32), config=TINY, num_buffers=2,
                host_access="dma")
    assert not state.host.kv.is_deleted()


# The decode step and the prefill, bit for bit, under "slices" and "ffi" ------------------------


@pytest.mark.parametrize("access", ["slices", "ffi"])
def test_decode_steps_bitwise_resident(access):
    config = TINY.replace(num_layers=2, indexer_layers=(0,), index_topk=8, max_ways=2)
    offload = OffloadConfig(hot_slots=16, page_size=8, capacity=96, host_access=access)
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, (2, 80), dtype=np.int32)
    res = resident.ResidentState.create(config, batch=2, capacity=96, fill=NAN)
    _, res = resident.prefill(params, res, prompt, np.array([80, 61]), config=config)
    dec = DecodeState.from_resident(res.kv, res.index_keys, res.lengths, config=config,
                                    offload=offload, fill=NAN)
    misses = 0
    for _ in range(4):
        tokens = rng.integers(0, config.vocab_size, (2, 2), dtype=np.int32)
        want, res = resident.decode_step(params, res, tokens, config=config)
        got, dec, stats = offload_decode.decode_step(params, dec, tokens, config=config,
                                                     offload=offload)
        chex.assert_trees_all_equal(got, want)
        misses += int(np.sum(stats.union))
    check_invariants(dec, config=config, offload=offload, resident_kv=res.kv,
                     selected=stats.selected, poisoned=True)
    assert misses > 0  # rows did come from host pages


@pytest.mark.parametrize("access", ["slices", "ffi"])
def test_prefill_and_handoff_bitwise(access):
    # Two layers in two buffers; one chunk shape and a fixed history_pages: one compile each.
    config = TINY.replace(num_layers=2, indexer_layers=(0,), index_topk=8, max_ways=1)
    offload = OffloadConfig(hot_slots=16, page_size=4, capacity=32, host_access=access)
    params = init_params(config, jax.random.key(1))
    rng = np.random.default_rng(1)
    chunks = [(rng.integers(0, 256, (2, 10), dtype=np.int32), [10, 9]),
              (rng.integers(0, 256, (2, 10), dtype=np.int32), [7, 3])]
    rs = resident.ResidentState.create(config, batch=2, capacity=32, fill=NAN)
    ps = PrefillState.create(config, batch=2, capacity=32, page_size=4, fill=NAN)
    for tokens, num_new in chunks:
        want, rs = resident.prefill(params, rs, tokens, num_new, config=config)
        got, ps = prefill(params, ps, tokens, num_new, config=config, num_buffers=2,
                          history_pages=3, poison=True, host_access=offload.host_access)
        for b, n in enumerate(num_new):
            chex.assert_trees_all_equal(np.asarray(got)[b, :n], np.asarray(want)[b, :n])
        chex.assert_trees_all_equal(np.asarray(ps.host.kv).reshape(rs.kv.shape),
                                    np.asarray(rs.kv))  # the identity table: a reshape
    handed = to_decode_state(ps, config=config, offload=offload, fill=NAN)
    expect = DecodeState.from_resident(rs.kv, rs.index_keys, rs.lengths, config=config,
                                       offload=offload, fill=NAN)
    chex.assert_trees_all_equal(jax.device_get(handed), jax.device_get(expect))


# Cross-lowering for CUDA ---------------------------------------------------------------------


@pytest.mark.parametrize("access", HOST_ACCESS)
def test_cross_lowers_for_cuda(access):
    # Concrete pinned_host arrays: a ShapeDtypeStruct with a pinned_host sharding does not carry
    # the host memory space into tracing (jax 0.12).
    _, pages, table = _pages()
    table = jnp.asarray(table)
    tokens, count = jnp.zeros((B, 5), jnp.int32), jnp.ones((B,), jnp.int32)
    rows, positions = jnp.zeros((L, B, 2, W)), jnp.zeros((B, 2), jnp.int32)
    functions = {
        "host_gather_rows": (lambda h, t, c: host.host_gather_rows(
            h, table, 1, t, c, chunk=2, on_host=True, access=access), (pages, tokens, count)),
        "host_write_rows": (lambda h, r, p: host.host_write_rows(
            h, table, r, p, on_host=True, access=access), (pages, rows, positions)),
        "write_back_rows": (lambda h, r, p: host.write_back_rows(
            h, table, 1, r, p, on_host=True, access=access), (pages, rows[0], positions)),
        "load_history": (lambda h: host.load_history(h, table, 1, history_pages=2,
                                                     on_host=True, access=access), (pages,)),
    }
    for name, (fn, args) in functions.items():
        exported = jax.export.export(jax.jit(fn), platforms=("cuda",),
                                     disabled_checks=export_checks())(*args)
        assert "pinned_host" in exported.mlir_module(), name
    config = TINY.replace(max_ways=1, index_topk=4)
    offload = OffloadConfig(hot_slots=8, page_size=4, capacity=32, host_access=access)
    state = DecodeState.create(config, offload, batch=1)
    jax.export.export(offload_decode.decode_jit, platforms=("cuda",),
                      disabled_checks=export_checks())(
        init_params(config, jax.random.key(0)), state, jnp.zeros((1, 1), jnp.int32),
        config=config, offload=offload)


def test_the_setting_is_a_field_of_offload_config():
    assert OffloadConfig(hot_slots=16).host_access == "gather"
    assert dataclasses.replace(OffloadConfig(hot_slots=16), host_access="slices").host_access \
        == "slices"


# No whole copy of the host pages ---------------------------------------------------------------


@pytest.mark.parametrize("access", HOST_ACCESS)
def test_decode_step_at_batch_1_copies_no_host_pages(access):
    # Batch 1 is what `fo-jax generate` runs. A scatter through the [L * B, P * Z, D+R] view
    # made XLA pick another layout for the host pages at B = 1: two whole copies per step.
    config = TINY.replace(num_layers=2, indexer_layers=(0,), max_ways=1, index_topk=4)
    offload = OffloadConfig(hot_slots=8, page_size=4, capacity=64, host_access=access)
    state = DecodeState.create(config, offload, batch=1)
    compiled = offload_decode.decode_jit.lower(
        init_params(config, jax.random.key(0)), state, jnp.zeros((1, 1), jnp.int32),
        config=config, offload=offload).compile().as_text()
    pages = "bf16[%s]" % ",".join(map(str, state.host.kv.shape))
    copies = [line.strip() for line in compiled.splitlines()
              if pages in line.split("=", 1)[-1].split("(", 1)[0] and " copy(" in line]
    assert not copies, copies


def test_read_back_holds_no_reference_to_a_host_buffer():
    """Debug reads of a live state copy: `np.asarray` of a pinned-host array is a zero-copy
    view of its buffer, and on GPU such an external reference makes the next donating step
    fail ("Donation requested for buffer with external reference")."""
    from fo_jax.offload.state import read_back, to_memory_kind

    x = to_memory_kind(jnp.arange(4 * 64, dtype=jnp.float32).reshape(4, 64), "pinned_host")
    view = np.asarray(x)
    if view.ctypes.data != x.unsafe_buffer_pointer():
        pytest.skip("this backend copies host-memory arrays on np.asarray")
    got = read_back(x)
    assert got.ctypes.data != x.unsafe_buffer_pointer()
    assert got.flags.writeable and got.flags.owndata
    np.testing.assert_array_equal(got, view)
    device = jnp.ones((3,), jnp.bfloat16)
    assert read_back(device).dtype == device.dtype

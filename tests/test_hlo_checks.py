"""fo_jax.hlo_checks on toy jitted functions: it catches the copies it is meant to catch."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import hlo_checks

# A state of two distinctive shapes: no intermediate of these toys shares them.
X = jax.ShapeDtypeStruct((5, 7), jnp.float32)
M = jax.ShapeDtypeStruct((3, 11), jnp.int32)
STATE = {"x": X, "map": M}
IDX = jax.ShapeDtypeStruct((2,), jnp.int32)


@functools.partial(jax.jit, donate_argnums=0)
def _in_place(state, idx):
    return {"x": state["x"].at[idx].set(0.0), "map": state["map"].at[0, idx].set(idx)}


@functools.partial(jax.jit, donate_argnums=0)
def _unordered(state, idx):
    # The manage_group bug in miniature: a gather from `map` and a scatter into it that does
    # not depend on the gather. XLA keeps the gather's input alive by copying the whole map.
    old = state["map"][0, idx]
    new_map = state["map"].at[0, idx + 1].set(idx)
    return {"x": state["x"], "map": new_map}, old


@functools.partial(jax.jit, donate_argnums=0)
def _ordered(state, idx):
    old = state["map"][0, idx]
    old, m = jax.lax.optimization_barrier((old, state["map"]))
    return {"x": state["x"], "map": m.at[0, idx + 1].set(idx)}, old


@jax.jit
def _not_donated(state, idx):
    return {"x": state["x"].at[idx].set(0.0), "map": state["map"]}


@functools.partial(jax.jit, donate_argnums=0)
def _full_select(state, idx):
    return {"x": jnp.where(state["x"] > 0, state["x"], 0.0), "map": state["map"]}


def test_in_place_updates_pass():
    compiled = hlo_checks.compile_jitted(_in_place, STATE, IDX,
                                         compiler_options=hlo_checks.FAST_COMPILE)
    hlo_checks.assert_no_state_copies(compiled, STATE)
    hlo_checks.assert_donation_aliased(compiled, STATE)
    assert hlo_checks.state_array_writes(compiled, STATE) == []


def test_unordered_gather_and_scatter_copy_the_map_and_a_barrier_fixes_it():
    bad = hlo_checks.compile_jitted(_unordered, STATE, IDX)
    with pytest.raises(AssertionError, match=r"copy of state map .*s32\[3,11\]"):
        hlo_checks.assert_no_state_copies(bad, STATE)
    good = hlo_checks.compile_jitted(_ordered, STATE, IDX)
    hlo_checks.assert_no_state_copies(good, STATE)
    hlo_checks.assert_donation_aliased(good, STATE)


def test_a_state_that_is_not_donated_is_copied_and_not_aliased():
    compiled = hlo_checks.compile_jitted(_not_donated, STATE, IDX)
    with pytest.raises(AssertionError, match=r"copy of state x"):
        hlo_checks.assert_no_state_copies(compiled, STATE)
    with pytest.raises(AssertionError, match=r"x \(f32\[5,7\]\): 1 needed, 0 aliased"):
        hlo_checks.assert_donation_aliased(compiled, STATE)
    # Ignored leaves are not checked.
    hlo_checks.assert_donation_aliased(compiled, STATE, ignore=("x", "map"))


def test_a_full_shape_elementwise_op_is_reported():
    # O(size) work on a state array even where XLA reuses the donated buffer.
    compiled = hlo_checks.compile_jitted(_full_select, STATE, IDX)
    with pytest.raises(AssertionError, match=r"fusion of state x"):
        hlo_checks.assert_no_state_copies(compiled, STATE)
    # ... unless the program creates the array itself (its one initialization is allowed).
    hlo_checks.assert_no_state_copies(compiled, STATE, created=("x",))


# Hand-written optimized HLO: two fusions write x's shape; `good` updates its parameter in
# place (through a bitcast), `bad` updates an array it broadcast itself (every element written).
HAND_HLO = """HloModule m, input_output_alias={ {0}: (0, {}, may-alias) }

%fused_bad (p0: f32[], p1: f32[1,7]) -> f32[5,7] {
  %p0 = f32[] parameter(0)
  %b = f32[5,7]{1,0} broadcast(%p0), dimensions={}
  %p1 = f32[1,7]{1,0} parameter(1)
  %c = s32[] constant(0)
  ROOT %d = f32[5,7]{1,0} dynamic-update-slice(%b, %p1, %c, %c)
}

%fused_good (p0.1: f32[5,7], p1.1: f32[1,7]) -> f32[5,7] {
  %p0.1 = f32[5,7]{1,0} parameter(0)
  %p1.1 = f32[1,7]{1,0} parameter(1)
  %c.1 = s32[] constant(0)
  %bc = f32[5,7]{1,0} bitcast(%p0.1)
  ROOT %d.1 = f32[5,7]{1,0} dynamic-update-slice(%bc, %p1.1, %c.1, %c.1)
}

ENTRY %main (x: f32[5,7], u: f32[1,7]) -> (f32[5,7], f32[5,7]) {
  %x = f32[5,7]{1,0} parameter(0)
  %u = f32[1,7]{1,0} parameter(1)
  %z = f32[] constant(0)
  %good = f32[5,7]{1,0} fusion(%x, %u), kind=kLoop, calls=%fused_good
  %bad = f32[5,7]{1,0} fusion(%z, %u), kind=kLoop, calls=%fused_bad
  ROOT %t = (f32[5,7]{1,0}, f32[5,7]{1,0}) tuple(%good, %bad)
}
"""


def test_an_update_into_an_array_made_in_the_fusion_is_reported():
    found = hlo_checks.state_array_writes(HAND_HLO, {"x": X})
    assert len(found) == 1 and "%bad = f32[5,7]" in found[0], found
    assert hlo_checks.input_output_aliases(HAND_HLO) == [((0,), 0, ())]
    assert hlo_checks.entry_parameters(HAND_HLO)[0][:2] == ("f32", (5, 7))
    hlo_checks.assert_donation_aliased(HAND_HLO, {"x": X})


def test_sorts_and_top_k_over_a_size():
    @jax.jit
    def f(a, b):
        return jnp.sort(a, axis=-1), jax.lax.top_k(b, 3)[1], jnp.sort(b, axis=0)

    compiled = hlo_checks.compile_jitted(f, jax.ShapeDtypeStruct((4, 40), jnp.float32),
                                         jax.ShapeDtypeStruct((6, 13), jnp.float32))
    assert len(hlo_checks.sorts_over(compiled, 40)) == 1
    assert len(hlo_checks.sorts_over(compiled, 13)) == 1  # top_k over the last axis
    assert len(hlo_checks.sorts_over(compiled, 6)) == 1   # sort over axis 0
    assert hlo_checks.sorts_over(compiled, 4) == []
    with pytest.raises(AssertionError, match=r"1 sorts / top-ks over C = 40 elements"):
        hlo_checks.assert_no_sort_over(compiled, 40)
    hlo_checks.assert_no_sort_over(compiled, 7)


def test_temp_bytes_grow_with_a_temporary():
    @jax.jit
    def f(a):
        return jnp.sum(jnp.outer(a, a) ** 2)

    small = hlo_checks.temp_bytes(hlo_checks.compile_jitted(f, jax.ShapeDtypeStruct((64,),
                                                                                   jnp.float32)))
    large = hlo_checks.temp_bytes(hlo_checks.compile_jitted(f, jax.ShapeDtypeStruct((256,),
                                                                                   jnp.float32)))
    assert 0 <= small <= large


def test_compile_call_compiles_the_call_the_entry_makes():
    module = types.SimpleNamespace(__name__="toy", _step=_in_place)

    def entry(state, idx, *, check=True):
        if check and idx.shape != (2,):
            raise ValueError("bad idx")
        return module._step(state, idx)

    state = {"x": jnp.ones((5, 7)), "map": jnp.zeros((3, 11), jnp.int32)}
    compiled = hlo_checks.compile_call(module, "_step", entry, state, jnp.arange(2))
    hlo_checks.assert_no_state_copies(compiled, state)
    assert module._step is _in_place
    assert not state["x"].is_deleted()  # nothing ran, nothing was donated
    with pytest.raises(AssertionError, match="returned without calling toy._step"):
        hlo_checks.compile_call(module, "_step", lambda *a: None, state, jnp.arange(2))


def test_names_and_errors():
    assert hlo_checks.hlo_dtype(jnp.bfloat16) == "bf16"
    assert hlo_checks.hlo_dtype(np.uint32) == "u32"
    assert hlo_checks.hlo_dtype(bool) == "pred"
    leaves = hlo_checks.state_leaves({"a": {"b": X}, "n": jax.ShapeDtypeStruct((), jnp.int32),
                                      "e": jax.ShapeDtypeStruct((2, 0), jnp.int32)})
    assert [(l.name, l.shape_text) for l in leaves] == [("a.b", "f32[5,7]")]
    with pytest.raises(ValueError, match=r"ignore names \['y'\], which are not leaves of the "
                                         r"state; its leaves are \['map', 'x'\]"):
        hlo_checks.state_leaves(STATE, ignore=("y",))
    with pytest.raises(AssertionError, match="found no HLO computations"):
        hlo_checks.parse_hlo("not hlo")
    with pytest.raises(TypeError, match="is not a jitted function"):
        hlo_checks.compile_jitted(lambda x: x, X)


COLLECTIVE_HLO = """HloModule m, entry_computation_layout={()->f32[8]{0}}

body (p: (s32[], f32[2,3])) -> (s32[], f32[2,3]) {
  p = (s32[], f32[2,3]{1,0}) parameter(0)
  x = f32[2,3]{1,0} get-tuple-element(p), index=1
  a2a = (f32[1,3]{1,0}, f32[1,3]{1,0}) all-to-all(x, x), channel_id=1, replica_groups={{0,1}}
  ROOT t = (s32[], f32[2,3]{1,0}) tuple(p, x)
}

ENTRY main (y: f32[8]) -> f32[8] {
  y = f32[8]{0} parameter(0)
  s = f32[8]{0} all-reduce-start(y), channel_id=2, replica_groups={{0,1}}, to_apply=add
  ROOT d = f32[8]{0} all-reduce-done(s)
}
"""


def test_collectives_are_counted_by_opcode_async_pairs_once():
    found = hlo_checks.collectives(COLLECTIVE_HLO)
    assert [(c.opcode, c.arrays) for c in found] == [
        ("all-to-all", (("f32", (1, 3)), ("f32", (1, 3)))), ("all-reduce", (("f32", (8,)),))]
    assert hlo_checks.assert_collectives(COLLECTIVE_HLO, {"all-to-all": 1, "all-reduce": 1})
    with pytest.raises(AssertionError, match=r"the step holds collectives \{'all-reduce': 1, "
                                             r"'all-to-all': 1\}, expected \{'all-to-all': 1\} "
                                             r"\(got, expected per opcode: \{'all-reduce': "
                                             r"\(1, 0\)\}\)"):
        hlo_checks.assert_collectives(COLLECTIVE_HLO, {"all-to-all": 1}, what="the step")
    # A program without collectives: none expected, none found.
    compiled = _in_place.lower(STATE, IDX).compile()
    assert hlo_checks.assert_collectives(compiled, {}) == []

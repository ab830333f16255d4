"""Tests of CopySFA (pallas_kernels/copy_sfa): reference by hand, kernel vs reference, planted
bugs that prove the harness fails, input checks, and cross-lowering for a TPU.

Kernel tests run in TPU interpret mode on CPU (on_wait DMAs, race detection) and compiled when
the backend is a TPU (the interpret twin). Shapes are tiny: interpret mode moves ~110 rows/s
with race detection. Hot-cache rows that hold no token are NaN, and victims are often such
rows: a row read from the hot cache before its miss was installed shows up as NaN. The stacked
form (`layer=`) puts a case in one layer of an L-layer stack whose other layers are all NaN: a
read of another layer shows as NaN, a write to one changes its bits.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
import numpy as np
import pytest

from pallas_kernels.copy_sfa import BlockSizes
from pallas_kernels.copy_sfa import check_copy_sfa_inputs
from pallas_kernels.copy_sfa import copy_sfa
from pallas_kernels.copy_sfa import copy_sfa_reference
from pallas_kernels.copy_sfa import kernel as copy_sfa_kernel

ON_WAIT = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)
# "on_wait" runs a DMA only when its semaphore is waited on (latest started first), so a DMA
# never waited on never runs and never raises a semaphore. "eager" runs it at start, so a
# missing wait leaves a count that the interpreter prints at kernel exit.
EAGER = pltpu.InterpretParams(dma_execution_mode="eager")
ON_WAIT_NO_RACES = pltpu.InterpretParams(dma_execution_mode="on_wait")
ALARMS = ("RACE DETECTED", "non-zero count")  # what the interpreter prints on a race / leak

# Kernel vs reference `out`. Both read the same bf16/f32 rows and cast them to float32 exactly;
# the only difference is float32 arithmetic order (online softmax over tiles of block_k vs one
# softmax over K), so both dtypes get float32-level tolerances.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(rtol=1e-5, atol=1e-5),
}


def _alarms(text: str) -> list[str]:
    return [alarm for alarm in ALARMS if alarm in text]


@pytest.fixture(autouse=True)
def _no_interpreter_alarms(capfd):
    """Every test fails if the interpreter printed a race or a leaked semaphore."""
    yield
    out, err = capfd.readouterr()
    assert not _alarms(out + err), out + err


def _run_checked(capfd, fn, *args):
    """fn(*args) run to completion; AssertionError naming the alarm on a race or a leak.

    The race detector raises inside a callback (the message reaches us in the exception and
    on stderr); a semaphore left non-zero is only printed, at kernel exit. Both are caught
    here, and the interpreter's global state is reset after a failure so later tests run.
    """
    capfd.readouterr()  # drop what came before
    error = None
    try:
        result = jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 -- re-raised below unless it is an alarm
        error = e
        pltpu.reset_tpu_interpret_mode_state()
    out, err = capfd.readouterr()
    text = out + err + ("" if error is None else str(error))
    if alarms := _alarms(text):
        raise AssertionError(f"interpret mode reported {alarms}:\n{text[-3000:]}")
    if error is not None:
        raise error
    return result


@pytest.fixture(params=["interpret", "compiled"])
def interpret(request):
    """The interpret twin: the same tests compiled when the backend is a TPU."""
    if request.param == "compiled":
        if jax.default_backend() != "tpu":
            pytest.skip("compiled CopySFA needs a TPU backend")
        return False
    return ON_WAIT


# ----------------------------------------------------------------------------------------------
# The reference, by hand.


def test_reference_by_hand():
    """B = 1, W = 2, H = 1, D = 2, R = 1, K = 3, C2 = 2, S = 3, M = 2, scale = 0.5.

    host rows (lat0, lat1, pe): token 0 = (1, 0, 0), token 1 = (0, 1, 1), token 2 = (2, 2, 0).
    hot before: slot 0 = token 0, slot 1 = NaN (free). One miss: token 1 -> slot 1; the second
    miss entry is padding (-1, -1) and must be ignored.
    hot_updated: slot 0 = (1, 0, 0), slot 1 = (0, 1, 1).
    way 0 reads slots [0, 1, -1]; q_lat = (0, 0), q_pe = (2 ln 3):
      s0 = (0*1 + 0*0 + 2 ln3 * 0) * 0.5 = 0
      s1 = (0*0 + 0*1 + 2 ln3 * 1) * 0.5 = ln 3
      s2 = -inf (padding)
      softmax = (1, 3, 0) / 4 = (0.25, 0.75, 0)
      out = 0.25 * (1, 0) + 0.75 * (0, 1) = (0.25, 0.75)
    way 1 reads [-1, -1, -1]: all padding, out = (0, 0).
    """
    nan = float("nan")
    host = jnp.asarray([[[1, 0, 0], [0, 1, 1], [2, 2, 0]]], jnp.float32)
    hot = jnp.asarray([[[1, 0, 0], [nan, nan, nan]]], jnp.float32)
    q_lat = jnp.zeros((1, 2, 1, 2), jnp.float32)
    q_pe = jnp.full((1, 2, 1, 1), 2 * math.log(3), jnp.float32)
    read_slot = jnp.asarray([[[0, 1, -1], [-1, -1, -1]]], jnp.int32)
    miss_token = jnp.asarray([[1, -1]], jnp.int32)
    miss_slot = jnp.asarray([[1, -1]], jnp.int32)
    num_miss = jnp.asarray([1], jnp.int32)
    out, hot_updated = copy_sfa_reference(
        q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss, scale=0.5
    )
    np.testing.assert_allclose(out, [[[[0.25, 0.75]], [[0.0, 0.0]]]], rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_equal(hot_updated, jnp.asarray([[[1, 0, 0], [0, 1, 1]]], jnp.float32))


# ----------------------------------------------------------------------------------------------
# Kernel vs reference over named scenarios.


@dataclasses.dataclass(frozen=True)
class Shapes:
    w: int = 2
    h: int = 2
    d: int = 8
    r: int = 4
    k: int = 8
    block_k: int = 4  # 2 tiles per way, 4 steps per request: prefetch crosses ways
    s: int = 32
    c2: int = 20  # 16 slots + 2 tail blocks of 2: the kernel does not care
    m: int = 16  # K * W: the largest possible miss union

    @property
    def b(self) -> int:
        return 2


# A TPU wants block_k % 16 == 0 and 128-aligned lane slices (D); interpret mode takes anything.
SHAPES = {
    "interpret": Shapes(),
    "compiled": Shapes(d=128, r=64, k=32, block_k=16, s=128, c2=72, m=64),
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How each request's selection meets its hot cache.

    Attributes:
      name: the test id.
      lengths: [B][W] selected tokens per way (the rest of K is -1 padding), or None for K.
      resident: fraction of the union of selected tokens already in the hot cache.
      same_tokens: all ways of a request select the same tokens (each miss is read W times).
      unread_misses: extra (token, victim) pairs that no way reads: installed all the same.
      shuffle_misses: the miss list in random order, not the order of first use.
    """

    name: str
    lengths: tuple[tuple[int, ...], ...] | None = None
    resident: float = 0.5
    same_tokens: bool = False
    unread_misses: int = 0
    shuffle_misses: bool = True


SCENARIOS = [
    Scenario("no_misses", resident=1.0),
    Scenario("all_misses", resident=0.0),
    Scenario("some_misses"),
    Scenario("some_misses_in_first_use_order", shuffle_misses=False),
    Scenario("padding", lengths=((5, 3), (8, 1))),
    Scenario("way_all_padding", lengths=((6, 0), (0, 0))),
    Scenario("misses_shared_by_ways", resident=0.0, same_tokens=True),
    Scenario("unread_misses", unread_misses=2),
]


def make_case(scenario: Scenario, dtype, shapes: Shapes, seed: int = 0):
    """Inputs built the way a decode step builds them, plus the expected hot cache.

    Per request: a random set of resident tokens in random slots (the other slots are NaN);
    each way selects `lengths` tokens in canonical (ascending) order; misses = the union minus
    the resident; victims = random slots that no way reads (free NaN slots or stale tokens).
    """
    sh = shapes
    rng = np.random.default_rng(seed)
    host = np.asarray(jnp.asarray(rng.standard_normal((sh.b, sh.s, sh.d + sh.r)), dtype))
    hot = np.full((sh.b, sh.c2, sh.d + sh.r), np.nan, host.dtype)
    read_slot = np.full((sh.b, sh.w, sh.k), -1, np.int32)
    miss_token = np.full((sh.b, sh.m), -1, np.int32)
    miss_slot = np.full((sh.b, sh.m), -1, np.int32)
    num_miss = np.zeros((sh.b,), np.int32)
    lengths = scenario.lengths or ((sh.k,) * sh.w,) * sh.b
    for b in range(sh.b):
        if scenario.same_tokens:
            tokens = np.sort(rng.choice(sh.s, lengths[b][0], replace=False))
            selected = [tokens[:n] for n in lengths[b]]
        else:
            selected = [np.sort(rng.choice(sh.s, n, replace=False)) for n in lengths[b]]
        union = sorted(set(np.concatenate(selected).tolist()))
        hits = [t for t in union if rng.random() < scenario.resident]
        others = [t for t in range(sh.s) if t not in union]
        stale = rng.choice(others, size=min(3, len(others)), replace=False).tolist()
        slots = rng.permutation(sh.c2).tolist()
        slot_of = {t: slots.pop() for t in hits + stale}  # resident tokens
        for t, slot in slot_of.items():
            hot[b, slot] = host[b, t]
        misses = [t for t in union if t not in slot_of]
        misses += rng.choice(
            [t for t in others if t not in stale], scenario.unread_misses, replace=False
        ).tolist()
        if scenario.shuffle_misses:
            misses = rng.permutation(misses).tolist()
        victims = rng.permutation(slots + [slot_of[t] for t in stale]).tolist()[: len(misses)]
        assert len(victims) == len(misses), "not enough victim slots: grow c2"
        for t, victim in zip(misses, victims):
            slot_of[t] = victim
        num_miss[b] = len(misses)
        miss_token[b, : len(misses)] = misses
        miss_slot[b, : len(misses)] = victims
        for w, tokens in enumerate(selected):
            read_slot[b, w, : len(tokens)] = [slot_of[t] for t in tokens.tolist()]
    expected_hot = hot.copy()
    for b in range(sh.b):
        n = num_miss[b]
        expected_hot[b, miss_slot[b, :n]] = host[b, miss_token[b, :n]]
    q_lat = rng.standard_normal((sh.b, sh.w, sh.h, sh.d)).astype(np.float32)
    q_pe = rng.standard_normal((sh.b, sh.w, sh.h, sh.r)).astype(np.float32)
    args = (q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss)
    return tuple(map(jnp.asarray, args)), jnp.asarray(expected_hot)


def _scale(shapes: Shapes) -> float:
    return (shapes.d + shapes.r) ** -0.5


NUM_LAYERS = 3


def stack_case(args, expected_hot, *, layer: int, num_layers: int = NUM_LAYERS):
    """The per-layer case at `layer` of a stack (hot [L, B, C2, D+R], host [L, B, S, D+R]) whose
    other layers are NaN, and the expected stack after the call: those layers unchanged."""
    stacked = list(args)
    for i in (2, 3):  # hot, host
        poison = jnp.full((num_layers, *args[i].shape), jnp.nan, args[i].dtype)
        stacked[i] = poison.at[layer].set(args[i])
    return tuple(stacked), stacked[2].at[layer].set(expected_hot)


PAGE, SPARE = 4, 3


def page_case(args, *, seed: int = 0):
    """The case with `host` [(L,) B, S, D+R] moved into a pool [(L,) F, Z, D+R] of F = B P + 3
    pages under a random permutation table [B, P] (pages of the two requests interleaved; the
    spare pages NaN): (paged args, page_table)."""
    host = np.asarray(args[3])
    *lead, b, s, width = host.shape
    pages = s // PAGE
    frames = b * pages + SPARE
    table = np.random.default_rng(seed).permutation(frames)[: b * pages].reshape(b, pages)
    pool = np.full((*lead, frames, PAGE, width), np.nan, host.dtype)
    pool[..., table, :, :] = host.reshape(*lead, b, pages, PAGE, width)
    paged = list(args)
    paged[3] = jnp.asarray(pool)
    return tuple(paged), jnp.asarray(table, jnp.int32)


def _assert_bits_equal(actual, expected):
    """Equal bit for bit (NaN payloads included), not merely NaN where NaN."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    bits = np.dtype(f"uint{8 * actual.dtype.itemsize}")
    np.testing.assert_array_equal(actual.view(bits), expected.view(bits))


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "planted_bug", "interpret"))
def _kernel(*args, scale, block_k, planted_bug, interpret, layer=None, page_table=None):
    # Module-level jit: one compile per (dtype, bug, mode, stacked), shared by the scenarios;
    # `layer` is traced, as in a scan over layers.
    return copy_sfa_kernel._copy_sfa(
        *args,
        scale=scale,
        layer=layer,
        page_table=page_table,
        block_sizes=BlockSizes(block_k=block_k),
        planted_bug=planted_bug,
        interpret=interpret,
    )


def _run_kernel(capfd, args, shapes, *, interpret, planted_bug=None, layer=None,
                page_table=None):
    kernel = functools.partial(
        _kernel,
        scale=_scale(shapes),
        block_k=shapes.block_k,
        planted_bug=planted_bug,
        interpret=interpret,
        layer=None if layer is None else jnp.int32(layer),
        page_table=page_table,
    )
    return _run_checked(capfd, kernel, *args)


def _assert_matches(args, expected_hot, out, hot_updated, shapes, layer=None):
    ref_out, ref_hot = copy_sfa_reference(*args, scale=_scale(shapes), layer=layer)
    _assert_bits_equal(ref_hot, expected_hot)  # with a layer: the other layers untouched
    _assert_bits_equal(hot_updated, expected_hot)
    assert not np.isnan(np.asarray(out)).any(), "a NaN (poisoned) row reached the output"
    all_padding = np.asarray(args[4] < 0).all(axis=-1)  # [B, W]
    chex.assert_trees_all_equal(out[all_padding], jnp.zeros_like(out[all_padding]))
    np.testing.assert_allclose(out, ref_out, **TOLERANCES[args[2].dtype])


class TestCopySFA:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    @pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
    def test_matches_reference(self, capfd, interpret, scenario, dtype):
        shapes = SHAPES["compiled" if interpret is False else "interpret"]
        args, expected_hot = make_case(scenario, dtype, shapes)
        check_copy_sfa_inputs(*args[4:], num_slots=shapes.c2, num_tokens=shapes.s)
        out, hot_updated = _run_kernel(capfd, args, shapes, interpret=interpret)
        _assert_matches(args, expected_hot, out, hot_updated, shapes)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    @pytest.mark.parametrize("scenario", [SCENARIOS[1], SCENARIOS[4]], ids=lambda s: s.name)
    def test_misses_bit_exact_with_resident(self, capfd, interpret, scenario, dtype):
        # Lossless: the same rows in the same canonical order give the same bits whether they
        # came from host (misses) or were already in the hot cache (the resident path).
        shapes = SHAPES["compiled" if interpret is False else "interpret"]
        args, expected_hot = make_case(scenario, dtype, shapes)
        out, _ = _run_kernel(capfd, args, shapes, interpret=interpret)
        resident = list(args)
        resident[2] = expected_hot  # every miss already installed
        resident[7] = jnp.zeros_like(args[7])  # and none to copy
        resident_out, resident_hot = _run_kernel(capfd, resident, shapes, interpret=interpret)
        chex.assert_trees_all_equal(out, resident_out)
        chex.assert_trees_all_equal(resident_hot, expected_hot)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    @pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
    def test_stacked_matches_reference(self, capfd, interpret, scenario, dtype):
        # Layer 0, 1 or 2 of 3 by scenario: first, middle and last layers all get a turn.
        shapes = SHAPES["compiled" if interpret is False else "interpret"]
        layer = SCENARIOS.index(scenario) % NUM_LAYERS
        case, expected_hot = make_case(scenario, dtype, shapes)
        args, expected_stack = stack_case(case, expected_hot, layer=layer)
        out, hot_updated = _run_kernel(capfd, args, shapes, interpret=interpret, layer=layer)
        _assert_matches(args, expected_stack, out, hot_updated, shapes, layer=layer)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_stacked_bit_exact_with_per_layer(self, capfd, interpret, dtype):
        shapes = SHAPES["compiled" if interpret is False else "interpret"]
        case, expected_hot = make_case(SCENARIOS[4], dtype, shapes, seed=2)
        out, hot_updated = _run_kernel(capfd, case, shapes, interpret=interpret)
        args, _ = stack_case(case, expected_hot, layer=1)
        stacked_out, stack = _run_kernel(capfd, args, shapes, interpret=interpret, layer=1)
        _assert_bits_equal(stacked_out, out)
        _assert_bits_equal(stack[1], hot_updated)

    def test_stacked_in_a_scan_over_layers(self, capfd, interpret):
        """The decode-step pattern: one jit, `fori_loop` over layers, the stack as the carry
        (donated), a different case in each layer; each layer's result is its own reference."""
        shapes = SHAPES["compiled" if interpret is False else "interpret"]
        cases = [make_case(SCENARIOS[2], jnp.bfloat16, shapes, seed=l) for l in range(NUM_LAYERS)]
        q_lat, q_pe, hot, host, *selection = (
            jnp.stack(arrays) for arrays in zip(*(args for args, _ in cases))
        )  # each [L, ...]

        @functools.partial(jax.jit, donate_argnums=0)
        def all_layers(hot, host, q_lat, q_pe, selection):
            def body(layer, carry):
                hot, out = carry
                out_l, hot = copy_sfa(
                    q_lat[layer], q_pe[layer], hot, host, *(x[layer] for x in selection),
                    scale=_scale(shapes),
                    layer=layer, block_sizes=BlockSizes(block_k=shapes.block_k),
                    interpret=interpret,
                )
                return hot, out.at[layer].set(out_l)

            out = jnp.zeros(q_lat.shape, jnp.float32)
            return jax.lax.fori_loop(0, NUM_LAYERS, body, (hot, out))

        hot_updated, out = _run_checked(capfd, all_layers, hot, host, q_lat, q_pe, selection)
        for layer, (args, expected_hot) in enumerate(cases):
            ref_out, _ = copy_sfa_reference(*args, scale=_scale(shapes))
            _assert_bits_equal(hot_updated[layer], expected_hot)
            np.testing.assert_allclose(out[layer], ref_out, **TOLERANCES[jnp.dtype(jnp.bfloat16)])

    @pytest.mark.parametrize("layer", [None, 1], ids=["per_layer", "stacked"])
    def test_paged_host_bit_exact_with_per_request_rows(self, capfd, interpret, layer):
        # Misses read through a scalar-prefetched page table from a pool whose pages are
        # permuted (spare pages NaN): the same bits as the per-request host rows, and the
        # reference agrees (every miss is installed from its pool page).
        shapes = SHAPES["compiled" if interpret is False else "interpret"]
        case, expected_hot = make_case(SCENARIOS[2], jnp.bfloat16, shapes, seed=3)
        if layer is not None:
            case, expected_hot = stack_case(case, expected_hot, layer=layer)
        out, hot_updated = _run_kernel(capfd, case, shapes, interpret=interpret, layer=layer)
        paged, table = page_case(case, seed=4)
        paged_out, paged_hot = _run_kernel(capfd, paged, shapes, interpret=interpret,
                                           layer=layer, page_table=table)
        _assert_bits_equal(paged_out, out)
        _assert_bits_equal(paged_hot, hot_updated)
        _assert_bits_equal(paged_hot, expected_hot)
        ref_out, ref_hot = copy_sfa_reference(*paged, scale=_scale(shapes), layer=layer,
                                              page_table=table)
        _assert_bits_equal(ref_hot, expected_hot)
        np.testing.assert_allclose(paged_out, ref_out, **TOLERANCES[jnp.dtype(jnp.bfloat16)])

    @pytest.mark.parametrize("layer", [None, 2], ids=["per_layer", "stacked"])
    def test_public_wrapper_default_block_sizes(self, capfd, interpret, layer):
        shapes = SHAPES["compiled" if interpret is False else "interpret"]
        if interpret is not False:  # K = 12: the interpret default cuts it into 3 tiles of 4
            shapes = dataclasses.replace(shapes, k=12, block_k=4, s=48, c2=40, m=24)
        assert BlockSizes.get_default(k=shapes.k, interpret=interpret is not False) == BlockSizes(
            block_k=shapes.block_k
        )
        args, expected_hot = make_case(SCENARIOS[2], jnp.float32, shapes, seed=1)
        if layer is not None:
            args, expected_hot = stack_case(args, expected_hot, layer=layer)
        run = jax.jit(
            functools.partial(copy_sfa, scale=_scale(shapes), layer=layer, interpret=interpret)
        )
        out, hot_updated = _run_checked(capfd, run, *args)
        _assert_matches(args, expected_hot, out, hot_updated, shapes, layer=layer)


# ----------------------------------------------------------------------------------------------
# Planted bugs: each must make the harness fail, or the harness proves nothing.

SHAPES_TINY = SHAPES["interpret"]


def _tiny_case(layer):
    args, expected_hot = make_case(SCENARIOS[2], jnp.float32, SHAPES_TINY)
    return args if layer is None else stack_case(args, expected_hot, layer=layer)[0]


STACKED = pytest.mark.parametrize("layer", [None, 1], ids=["per_layer", "stacked"])


@STACKED
def test_planted_read_before_wait_is_a_race(capfd, layer):
    args = _tiny_case(layer)
    with pytest.raises(AssertionError, match="RACE DETECTED"):
        _run_kernel(
            capfd, args, SHAPES_TINY, interpret=ON_WAIT, planted_bug="read_before_wait",
            layer=layer,
        )


def test_planted_workspace_reuse_gives_a_wrong_result(capfd):
    # Without race detection, to show the comparison alone catches it: under on_wait the latest
    # copy runs first, so tile s is computed on tile s + 1's rows.
    args, expected_hot = make_case(SCENARIOS[2], jnp.float32, SHAPES_TINY)
    out, hot_updated = _run_kernel(
        capfd, args, SHAPES_TINY, interpret=ON_WAIT_NO_RACES, planted_bug="reuse_before_wait"
    )
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        _assert_matches(args, expected_hot, out, hot_updated, SHAPES_TINY)


@STACKED
def test_planted_missing_install_wait_leaks_a_semaphore(capfd, layer):
    args = _tiny_case(layer)
    with pytest.raises(AssertionError, match="non-zero count"):
        _run_kernel(
            capfd, args, SHAPES_TINY, interpret=EAGER, planted_bug="missing_install_wait",
            layer=layer,
        )


@STACKED
def test_no_leaked_semaphore_under_eager(capfd, layer):
    # The control of the test above: the kernel without the bug, eager DMAs, leaves none.
    _run_kernel(capfd, _tiny_case(layer), SHAPES_TINY, interpret=EAGER, layer=layer)


def test_planted_missing_install_wait_under_on_wait_loses_the_install(capfd):
    # on_wait never runs a copy that nobody waits for: the cache comparison catches it.
    args, expected_hot = make_case(SCENARIOS[2], jnp.float32, SHAPES_TINY)
    out, hot_updated = _run_kernel(
        capfd, args, SHAPES_TINY, interpret=ON_WAIT, planted_bug="missing_install_wait"
    )
    with pytest.raises(AssertionError):
        chex.assert_trees_all_equal(hot_updated, expected_hot)


# ----------------------------------------------------------------------------------------------
# Input checks: the messages are part of the contract.


def _tiny_args(dtype=jnp.float32):
    return make_case(SCENARIOS[2], dtype, SHAPES_TINY)[0]


def test_block_sizes_messages():
    with pytest.raises(ValueError, match=re.escape("self.block_k=0 must be > 0")):
        BlockSizes(block_k=0)
    with pytest.raises(ValueError, match="must be an int"):
        BlockSizes(block_k=4.0)
    with pytest.raises(ValueError, match=re.escape("block_k=3 must divide k=8")):
        BlockSizes(block_k=3).validate(k=8, interpret=True)
    with pytest.raises(NotImplementedError, match=re.escape("block_k=4 must be a multiple of 16")):
        BlockSizes(block_k=4).validate(k=8, interpret=False)
    BlockSizes(block_k=8).validate(k=8, interpret=False)  # one tile is always fine
    assert BlockSizes.get_default(k=2048) == BlockSizes(block_k=512)
    assert BlockSizes.get_default(k=8) == BlockSizes(block_k=8)
    # Compiled: whole 16-row tiles or one tile; interpret mode: any listed divisor, down to 4.
    defaults = {4: (4, 4), 8: (8, 8), 16: (16, 16), 12: (12, 4), 24: (24, 8), 48: (16, 16),
                2048: (512, 512), 6: (6, 6)}
    for k, (compiled, interpreted) in defaults.items():
        assert BlockSizes.get_default(k=k) == BlockSizes(block_k=compiled), k
        assert BlockSizes.get_default(k=k, interpret=True) == BlockSizes(block_k=interpreted), k
        BlockSizes.get_default(k=k).validate(k=k, interpret=False)
        BlockSizes.get_default(k=k, interpret=True).validate(k=k, interpret=True)


def test_static_messages():
    q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss = _tiny_args()
    call = functools.partial(copy_sfa, scale=0.1, interpret=ON_WAIT)
    with pytest.raises(ValueError, match=re.escape("block_k=3 must divide k=8")):
        call(*_tiny_args(), block_sizes=BlockSizes(block_k=3))
    bf16 = jnp.bfloat16
    message = "host.dtype=bfloat16 must equal hot.dtype=float32"
    with pytest.raises(ValueError, match=re.escape(message)):
        call(q_lat, q_pe, hot, host.astype(bf16), read_slot, miss_token, miss_slot, num_miss)
    with pytest.raises(ValueError, match=re.escape("q_lat.dtype=bfloat16 must be float32")):
        call(q_lat.astype(bf16), q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss)
    with pytest.raises(ValueError, match=re.escape("hot must be [B=2, C2, D+R=12]")):
        call(q_lat, q_pe, hot[..., :-1], host, read_slot, miss_token, miss_slot, num_miss)
    with pytest.raises(ValueError, match=re.escape("miss_slot.shape=(2, 15) must equal")):
        call(q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot[:, 1:], num_miss)
    with pytest.raises(ValueError, match=re.escape("read_slot.dtype=uint32 must be int32")):
        call(q_lat, q_pe, hot, host, read_slot.astype(jnp.uint32), miss_token, miss_slot, num_miss)
    with pytest.raises(ValueError, match="must be a Python float"):
        copy_sfa(*_tiny_args(), scale=jnp.float32(0.1), interpret=ON_WAIT)


def test_static_messages_paged():
    args = _tiny_args()
    paged, table = page_case(args)
    call = functools.partial(copy_sfa, scale=0.1, interpret=ON_WAIT)
    with pytest.raises(ValueError, match=re.escape("page_table must be [B=2, P] int32, got "
                                                   "page_table.shape=(2, 8) "
                                                   "page_table.dtype=dtype('uint32')")):
        call(*paged, page_table=table.astype(jnp.uint32))
    no_pool = list(paged)
    no_pool[3] = paged[3][0]  # one page, not a pool
    with pytest.raises(ValueError, match=re.escape("with a page_table, host must be a pool "
                                                   "[F, Z, D+R], got host.shape=(4, 12)")):
        call(*no_pool, page_table=table)


def test_static_messages_stacked():
    args = _tiny_args()
    stacked, _ = stack_case(args, args[2], layer=0)
    call = functools.partial(copy_sfa, scale=0.1, interpret=ON_WAIT)
    with pytest.raises(ValueError, match=re.escape(
        "with a layer, hot must be [L, B=2, C2, D+R=12] and host [L, B=2, S, D+R=12] with the "
        "same L, got hot.shape=(2, 20, 12) and host.shape=(2, 32, 12)"
    )):
        call(*args, layer=0)
    bad = list(stacked)
    bad[3] = stacked[3][:2]
    message = "with the same L, got hot.shape=(3, 2, 20, 12)"
    with pytest.raises(ValueError, match=re.escape(message)):
        call(*bad, layer=0)
    bad = list(stacked)
    bad[2] = stacked[2][..., :-1]
    with pytest.raises(ValueError, match=re.escape("hot must be [L=3, B=2, C2, D+R=12], got")):
        call(*bad, layer=0)
    for layer in (jnp.zeros((1,), jnp.int32), 1.0, True):
        with pytest.raises(ValueError, match="layer must be an integer scalar"):
            call(*stacked, layer=layer)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        copy_sfa_reference(*stacked, scale=0.1, layer=jnp.float32(1))


def test_host_memory_kind_under_interpret_is_not_implemented():
    args = list(_tiny_args())
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    args[3] = jax.device_put(args[3], pinned)
    with pytest.raises(NotImplementedError, match="interpret mode needs `host` in device memory"):
        copy_sfa(*args, scale=0.1, interpret=ON_WAIT)


def test_value_checks():
    _, _, _, _, read_slot, miss_token, miss_slot, num_miss = map(np.array, _tiny_args())
    sizes = dict(num_slots=SHAPES_TINY.c2, num_tokens=SHAPES_TINY.s)
    check_copy_sfa_inputs(read_slot, miss_token, miss_slot, num_miss, **sizes)
    bad = num_miss.copy()
    bad[1] = 17
    with pytest.raises(ValueError, match=re.escape("num_miss[1]=17 must be in [0, M=16]")):
        check_copy_sfa_inputs(read_slot, miss_token, miss_slot, bad, **sizes)
    bad = miss_slot.copy()
    bad[0, 1] = bad[0, 0]
    with pytest.raises(ValueError, match=re.escape("miss_slot[0, :") + ".* must be distinct"):
        check_copy_sfa_inputs(read_slot, miss_token, bad, num_miss, **sizes)
    bad = miss_token.copy()
    bad[0, 0] = SHAPES_TINY.s
    with pytest.raises(ValueError, match=re.escape("must be in [0, num_tokens=32)")):
        check_copy_sfa_inputs(read_slot, bad, miss_slot, num_miss, **sizes)
    bad = read_slot.copy()
    bad[1, 0, 2] = -1
    with pytest.raises(ValueError, match=re.escape("read_slot[1, 0] has an entry after the -1")):
        check_copy_sfa_inputs(bad, miss_token, miss_slot, num_miss, **sizes)
    bad = read_slot.copy()
    bad[0, 0, 0] = SHAPES_TINY.c2
    with pytest.raises(ValueError, match=re.escape("read_slot must be in [-1, num_slots=20)")):
        check_copy_sfa_inputs(bad, miss_token, miss_slot, num_miss, **sizes)
    check_copy_sfa_inputs(read_slot, miss_token, miss_slot, num_miss, **sizes, layer=jnp.int32(2),
                          num_layers=3)
    with pytest.raises(ValueError, match=re.escape("layer=3 must be in [0, num_layers=3)")):
        check_copy_sfa_inputs(read_slot, miss_token, miss_slot, num_miss, **sizes, layer=3,
                              num_layers=3)


def test_reference_clamps_the_layer_like_dynamic_index():
    args = _tiny_args()
    stacked, _ = stack_case(args, args[2], layer=NUM_LAYERS - 1)
    for layer, clamped in ((-5, 0), (NUM_LAYERS + 7, NUM_LAYERS - 1)):
        chex.assert_trees_all_equal(
            copy_sfa_reference(*stacked, scale=0.1, layer=layer),
            copy_sfa_reference(*stacked, scale=0.1, layer=clamped),
        )


# ----------------------------------------------------------------------------------------------
# Cross-lowering for a TPU at production shapes.


def test_lowers_for_tpu_at_production_shapes():
    """GLM-5.2 / DeepSeek-V3.2 layer: K = 2048, D + R = 512 + 64 bf16, C2 = 16384 + 2 * 64,
    S = 128k, W = 4, H = 16, M = K * W; `host` in pinned host memory, `hot` donated."""
    b, w, h, d, r, k, s, c2 = 2, 4, 16, 512, 64, 2048, 131072, 16384 + 128
    m = w * k
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")

    def step(q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss):
        host = jax.device_put(host, jax.memory.Space.Host)  # a host-memory-kind array
        args = (q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss)
        return copy_sfa(*args, scale=(d + r) ** -0.5)

    sds = jax.ShapeDtypeStruct
    exported = jax.export.export(jax.jit(step, donate_argnums=2), platforms=("tpu",))(
        sds((b, w, h, d), jnp.float32),
        sds((b, w, h, r), jnp.float32),
        sds((b, c2, d + r), jnp.bfloat16),
        sds((b, s, d + r), jnp.bfloat16, sharding=pinned),
        sds((b, w, k), jnp.int32),
        sds((b, m), jnp.int32),
        sds((b, m), jnp.int32),
        sds((b,), jnp.int32),
    )
    text = exported.mlir_module()
    calls = [line for line in text.splitlines() if "@tpu_custom_call" in line]
    assert len(calls) == 1, calls
    assert "output_operand_aliases" in calls[0]  # hot_updated is written into hot's buffer
    # The Mosaic body is MLIR bytecode (base64 in the call's config); its attribute strings are
    # plain text inside: the host operand is in the host memory space, not copied to HBM.
    body = base64.b64decode(re.search(r"body\\22: \\22([A-Za-z0-9+/=]+)", calls[0]).group(1))
    assert b"#tpu.memory_space<host>" in body
    assert b"copy_sfa_block_k_512" in body or b"copy_sfa_block_k_512" in calls[0].encode()
    assert [o.shape for o in exported.out_avals] == [(b, w, h, d), (b, c2, d + r)]


def test_lowers_for_tpu_stacked_at_production_shapes():
    """The same layer in a stack of L = 4 (hot [L, B, C2, D+R] donated, host [L, B, S, D+R] in
    pinned host memory), the layer traced: the kernel takes both stacks whole (no per-layer
    slice or copy anywhere in the module) and writes the updated stack into hot's buffer."""
    num_layers, b, w, h, d, r, k, s, c2 = 4, 2, 4, 16, 512, 64, 2048, 131072, 16384 + 128
    m = w * k
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")

    def step(q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss, layer):
        host = jax.device_put(host, jax.memory.Space.Host)  # already there: a no-op
        args = (q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss)
        return copy_sfa(*args, scale=(d + r) ** -0.5, layer=layer)

    sds = jax.ShapeDtypeStruct
    exported = jax.export.export(jax.jit(step, donate_argnums=2), platforms=("tpu",))(
        sds((b, w, h, d), jnp.float32),
        sds((b, w, h, r), jnp.float32),
        sds((num_layers, b, c2, d + r), jnp.bfloat16),
        sds((num_layers, b, s, d + r), jnp.bfloat16, sharding=pinned),
        sds((b, w, k), jnp.int32),
        sds((b, m), jnp.int32),
        sds((b, m), jnp.int32),
        sds((b,), jnp.int32),
        sds((), jnp.int32),
    )
    text = exported.mlir_module()
    calls = [line for line in text.splitlines() if "@tpu_custom_call" in line]
    assert len(calls) == 1, calls
    # hot (%arg2) goes into the kernel as is, and its operand is the one aliased to output 1.
    operands = re.search(r"@tpu_custom_call\(([^)]*)\)", calls[0]).group(1).split(", ")
    alias = re.search(r"output_tuple_indices = \[1\], operand_index = (\d+)", calls[0])
    assert alias and operands[int(alias.group(1))] == "%arg2", (operands, calls[0][-600:])
    assert re.search(r"%arg2: tensor<4x2x16512x576xbf16> \{tf.aliasing_output = 1", text)
    # No layer is ever materialised: neither [B, C2, D+R] nor [B, S, D+R] appears.
    for per_layer in (f"tensor<{b}x{c2}x{d + r}xbf16>", f"tensor<{b}x{s}x{d + r}xbf16>"):
        assert per_layer not in text, per_layer
    body = base64.b64decode(re.search(r"body\\22: \\22([A-Za-z0-9+/=]+)", calls[0]).group(1))
    assert b"#tpu.memory_space<host>" in body
    assert [o.shape for o in exported.out_avals] == [(b, w, h, d), (num_layers, b, c2, d + r)]

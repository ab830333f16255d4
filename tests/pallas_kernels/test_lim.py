"""Tests of LIM (pallas_kernels/lim): reference by hand, kernel vs reference, races, lowering.

Kernel tests run in TPU interpret mode on CPU (on_wait DMAs, race detection) and compiled when
the backend is a TPU (the interpret twin). Shapes are tiny: interpret mode is slow. The stacked
form (`group=`) puts a case in one group of a G-group stack whose other groups hold NaN keys and
out-of-range slots: a read of another group shows in the scores or the payload.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import re

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np
import pytest

from pallas_kernels.lim import BlockSizes
from pallas_kernels.lim import HIDDEN
from pallas_kernels.lim import MAX_TOKENS
from pallas_kernels.lim import check_lim_inputs
from pallas_kernels.lim import lim
from pallas_kernels.lim import lim_reference
from pallas_kernels.lim import lim_scores
from pallas_kernels.lim import lim_select

ON_WAIT = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)
# "on_wait" runs a DMA only when it is waited on: a DMA that is started and never waited on goes
# unnoticed. "eager" runs it at start, so an unconsumed semaphore shows at kernel exit.
EAGER = pltpu.InterpretParams(dma_execution_mode="eager")
ALARMS = ("RACE DETECTED", "non-zero count")  # what the interpreter prints on a race / leak

# Kernel scores vs reference scores. bfloat16 keys are cast to float32 exactly in both, so both
# dtypes see the same float32 error: a different summation order over N and over the heads.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(rtol=1e-5, atol=1e-5),
}

# The design's worked example: 20 candidates and their hot-cache slots.
CACHE_SLOTS = [4, 6, -1, 1, 7, -1, -1, -1, -1, 0, -1, -1, -1, 2, -1, -1, -1, -1, 3, 5]


def _alarms(text: str) -> list[str]:
    return [alarm for alarm in ALARMS if alarm in text]


def _drain(capfd, caplog) -> str:
    """Everything printed (stdout, stderr) and logged since the last drain; both are emptied.

    The interpreter prints leaked semaphores and logs races (`on_race="warn"`, or the failing
    io_callback of `on_race="raise"`), so an alarm may come through either."""
    out, err = capfd.readouterr()
    logged = caplog.text
    caplog.clear()
    return out + err + logged


@pytest.fixture(autouse=True)
def _no_interpreter_alarms(capfd, caplog):
    """Every test fails if the interpreter reported a race or a leaked semaphore."""
    yield
    text = _drain(capfd, caplog)
    assert not _alarms(text), text


@pytest.fixture(params=["interpret"] + (["compiled"] if jax.default_backend() == "tpu" else []))
def interpret(request):
    """The interpret twin: the same tests also run compiled when the backend is a TPU."""
    return False if request.param == "compiled" else ON_WAIT


# ----------------------------------------------------------------------------------------------
# The selection rule itself.


def test_lax_top_k_ties_lower_index_wins():
    scores = jnp.asarray([1.0, 3.0, 3.0, 2.0, 3.0, -jnp.inf, -jnp.inf], jnp.float32)
    values, indices = lax.top_k(scores, 5)
    chex.assert_trees_all_equal(indices, jnp.asarray([1, 2, 4, 3, 0], jnp.int32))
    chex.assert_trees_all_equal(values, jnp.asarray([3, 3, 3, 2, 1], jnp.float32))
    # All equal, long row, and -inf padding: still ascending index among equals.
    _, indices = lax.top_k(jnp.zeros((3, 4096), jnp.float32), 7)
    chex.assert_trees_all_equal(indices, jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (3, 7)))
    _, indices = lax.top_k(jnp.asarray([0.0, -jnp.inf, -jnp.inf, -jnp.inf]), 3)
    chex.assert_trees_all_equal(indices, jnp.asarray([0, 1, 2], jnp.int32))


# ----------------------------------------------------------------------------------------------
# The worked example, by hand.


def _worked_example():
    """20 tokens, I = 2 heads of width N = 4, weights [0.5, 2.0], q = unit vectors e0, e1.

    score[s] = 0.5 * relu(key[s, 0]) + 2.0 * relu(key[s, 1])
      token 8:  key (4.0, 0.5)  -> 0.5 * 4.0 + 2.0 * 0.5 = 2.0 + 1.0 = 3.0
      token 4:  key (2.0, 0.5)  -> 0.5 * 2.0 + 2.0 * 0.5 = 1.0 + 1.0 = 2.0
      token 17: key (-3.0, 0.5) -> 0.5 * 0.0 + 2.0 * 0.5 = 0.0 + 1.0 = 1.0   (ReLU drops -3.0)
      others:   key (1.0, -1.0) -> 0.5 * 1.0 + 2.0 * 0.0 = 0.5               (ReLU drops -1.0)
    top-3 by score = tokens [8, 4, 17] (3.0, 2.0, 1.0) -> cache slots [-1, 7, -1]: 8 and 17 miss,
    4 hits slot 7. Canonical order (ascending token): tokens [4, 8, 17], slots [7, -1, -1],
    scores [2.0, 3.0, 1.0].
    """
    keys = np.zeros((1, 20, 4), np.float32)
    keys[0, :, :2] = (1.0, -1.0)
    keys[0, 8, :2] = (4.0, 0.5)
    keys[0, 4, :2] = (2.0, 0.5)
    keys[0, 17, :2] = (-3.0, 0.5)
    q = np.zeros((1, 1, 2, 4), np.float32)
    q[0, 0, 0, 0] = 1.0
    q[0, 0, 1, 1] = 1.0
    weights = np.asarray([[[0.5, 2.0]]], np.float32)
    token_to_slot = np.asarray([CACHE_SLOTS], np.int32)
    visible = np.asarray([[20]], np.int32)
    return tuple(map(jnp.asarray, (q, weights, keys, token_to_slot, visible)))


WORKED_EXPECTED = (
    jnp.asarray([[[4, 8, 17]]], jnp.int32),
    jnp.asarray([[[7, -1, -1]]], jnp.int32),
    jnp.asarray([[[2.0, 3.0, 1.0]]], jnp.float32),
)


def test_reference_worked_example():
    chex.assert_trees_all_equal(lim_reference(*_worked_example(), k=3), WORKED_EXPECTED)


def test_kernel_worked_example():
    # 20 tokens in 5 tiles of 4: the prefetch crosses 4 tile boundaries.
    out = lim(*_worked_example(), k=3, block_sizes=BlockSizes(block_s=4), interpret=ON_WAIT)
    chex.assert_trees_all_equal(out, WORKED_EXPECTED)


# ----------------------------------------------------------------------------------------------
# Kernel vs reference over named scenarios.


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    visible: tuple[tuple[int, ...], ...]  # [B][W]
    s: int
    k: int
    block_s: int
    num_heads: int = 2
    head_dim: int = 8
    negative_weights: bool = False

    @property
    def batch(self) -> int:
        return len(self.visible)

    @property
    def ways(self) -> int:
        return len(self.visible[0])


SCENARIOS = [
    Scenario("one_way", visible=((32,),), s=32, k=5, block_s=8),
    Scenario("two_ways", visible=((32, 11),), s=32, k=6, block_s=8),
    Scenario("three_ways", visible=((7, 32, 20), (16, 3, 29)), s=32, k=4, block_s=8),
    Scenario("four_ways", visible=((32, 5, 17, 0), (9, 32, 1, 24)), s=32, k=6, block_s=8),
    # max visible 3: tile 1 is never copied nor computed.
    Scenario("fewer_visible_than_k", visible=((3, 0, 2),), s=16, k=6, block_s=8),
    Scenario("request_sees_nothing", visible=((0, 0), (16, 10)), s=16, k=4, block_s=8),
    Scenario("single_tile", visible=((16, 12),), s=16, k=5, block_s=16),
    Scenario("mixed_sign_weights", visible=((24, 17),), s=24, k=5, block_s=8,
             num_heads=4, negative_weights=True),
    # Mosaic-sized tiles (128 lanes, I = 8, N = 128): the only scenario a TPU can compile.
    Scenario("lane_tiles", visible=((256, 130),), s=256, k=16, block_s=128,
             num_heads=8, head_dim=128),
]
SCENARIO = {scenario.name: scenario for scenario in SCENARIOS}
DTYPES = [jnp.float32, jnp.bfloat16]


def _inputs(scenario: Scenario, dtype, seed: int = 0):
    """Random inputs; keys past every way's horizon are NaN and their slots garbage (poison)."""
    rng = np.random.default_rng(seed)
    b, w, i, n, s = scenario.batch, scenario.ways, scenario.num_heads, scenario.head_dim, scenario.s
    q = rng.normal(size=(b, w, i, n)).astype(np.float32)
    if scenario.negative_weights:
        weights = rng.normal(size=(b, w, i)).astype(np.float32)
    else:
        weights = rng.uniform(0.1, 1.0, size=(b, w, i)).astype(np.float32)
    keys = rng.normal(size=(b, s, n)).astype(np.float32)
    # Hot cache of s // 2 slots holding a random half of the tokens.
    token_to_slot = np.full((b, s), -1, np.int32)
    for row in token_to_slot:
        resident = rng.choice(s, size=s // 2, replace=False)
        row[resident] = rng.permutation(s // 2)
    visible = np.asarray(scenario.visible, np.int32)
    for r in range(b):
        horizon = visible[r].max()
        keys[r, horizon:] = np.nan
        token_to_slot[r, horizon:] = 10**6
    return (jnp.asarray(q), jnp.asarray(weights), jnp.asarray(keys, dtype),
            jnp.asarray(token_to_slot), jnp.asarray(visible))


NUM_GROUPS = 3


def _stack(args, *, group: int, num_groups: int = NUM_GROUPS):
    """The case's keys [B, S, N] and slots [B, S] at `group` of [G, B, S, N] and [G, B, S] stacks
    whose other groups are poison: NaN keys, slots 10**6 (no hot cache has that many)."""
    q, weights, keys, token_to_slot, visible = args
    keys = jnp.full((num_groups, *keys.shape), jnp.nan, keys.dtype).at[group].set(keys)
    slots = jnp.full((num_groups, *token_to_slot.shape), 10**6, jnp.int32)
    return q, weights, keys, slots.at[group].set(token_to_slot), visible


def _scores_float64(q, weights, keys, visible):
    """score[b, w, s] in float64 numpy, -inf past visible (the check of the kernel's scores)."""
    keys = jnp.asarray(keys, jnp.float32)
    q, weights, keys = (np.asarray(x, np.float64) for x in (q, weights, keys))
    with np.errstate(invalid="ignore"):
        logits = np.einsum("bwin,bsn->bwis", q, keys)
        scores = np.einsum("bwi,bwis->bws", weights, np.maximum(logits, 0.0))
    shown = np.arange(keys.shape[1])[None, None, :] < np.asarray(visible)[:, :, None]
    return np.where(shown, scores, -np.inf)


def _assert_selection_well_posed(scores64, visible, k, tol):
    """The k-th and (k+1)-th visible scores must differ by more than the tolerance (or both be
    exactly 0: ReLU ties, equal in every implementation); otherwise reference and kernel may
    legitimately disagree."""
    for (b, w), vis in np.ndenumerate(np.asarray(visible)):
        if vis <= k:
            continue
        ranked = np.sort(scores64[b, w, :vis])[::-1]
        kth, next_ = ranked[k - 1], ranked[k]
        assert kth - next_ > tol or kth == next_ == 0.0, (b, w, kth, next_)


def _expected_from_scores(scores, token_to_slot, visible, k):
    """LIM's selection rebuilt in numpy from lax.top_k of the kernel's own scores."""
    top_score, top_token = (np.asarray(x) for x in lax.top_k(scores, k))
    b, w, _ = top_token.shape
    token = np.full((b, w, k), -1, np.int32)
    slot = np.full((b, w, k), -1, np.int32)
    score = np.full((b, w, k), -np.inf, np.float32)
    for bi in range(b):
        for wi in range(w):
            keep = top_token[bi, wi] < visible[bi, wi]
            order = np.argsort(top_token[bi, wi][keep])
            kept = top_token[bi, wi][keep][order]
            token[bi, wi, : kept.size] = kept
            slot[bi, wi, : kept.size] = np.asarray(token_to_slot)[bi, kept]
            score[bi, wi, : kept.size] = top_score[bi, wi][keep][order]
    return token, slot, score


def _assert_scores_and_payload(args, scores, payload, dtype):
    """The kernel's scores within tolerance of float64, -inf exactly where hidden, no NaN (the
    poison), and the payload exactly the slot map where shown, HIDDEN elsewhere."""
    q, weights, keys, token_to_slot, visible = args
    expected = _scores_float64(q, weights, keys, visible)
    shown = np.isfinite(expected)
    assert not np.isnan(np.asarray(scores)).any(), "poisoned keys leaked into the scores"
    np.testing.assert_array_equal(np.isfinite(np.asarray(scores)), shown)
    np.testing.assert_allclose(
        np.asarray(scores)[shown], expected[shown], **TOLERANCES[jnp.dtype(dtype)]
    )
    expected_payload = np.where(shown, np.asarray(token_to_slot)[:, None, :], HIDDEN)
    chex.assert_trees_all_equal(payload, jnp.asarray(expected_payload, jnp.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
class TestLim:

    def _prepare(self, scenario, dtype, interpret):
        if interpret is False and scenario.block_s % 128:
            pytest.skip(f"{scenario.block_s=} is not lane-aligned: interpret mode only")
        return _inputs(scenario, dtype), BlockSizes(block_s=scenario.block_s)

    def test_scores_and_payload(self, scenario, dtype, interpret):
        args, block_sizes = self._prepare(scenario, dtype, interpret)
        scores, payload = lim_scores(*args, block_sizes=block_sizes, interpret=interpret)
        _assert_scores_and_payload(args, scores, payload, dtype)

    def test_stacked(self, scenario, dtype, interpret):
        """Group 0, 1 or 2 of 3 by scenario; the group traced. Scores and payload as per-group,
        and the selection on them is the stacked reference's, which is the per-group one."""
        args, block_sizes = self._prepare(scenario, dtype, interpret)
        group = SCENARIOS.index(scenario) % NUM_GROUPS
        stacked = _stack(args, group=group)
        scores, payload = lim_scores(
            *stacked, group=jnp.int32(group), block_sizes=block_sizes, interpret=interpret
        )
        _assert_scores_and_payload(args, scores, payload, dtype)
        q, weights, keys, _, visible = args
        tolerance = TOLERANCES[jnp.dtype(dtype)]
        _assert_selection_well_posed(
            _scores_float64(q, weights, keys, visible), visible, scenario.k,
            tol=10 * (tolerance["atol"] + tolerance["rtol"]),
        )
        token, slot, score = lim_select(scores, payload, k=scenario.k)
        ref = lim_reference(*stacked, k=scenario.k, group=group)
        chex.assert_trees_all_equal(ref, lim_reference(*args, k=scenario.k))
        chex.assert_trees_all_equal((token, slot), ref[:2])
        np.testing.assert_allclose(score, ref[2], **tolerance)

    def test_paged_keys_bit_exact_with_per_request_keys(self, scenario, dtype, interpret):
        """The stacked keys moved into a pool [G, F, Z, N] under a random permutation page
        table (pages of the requests interleaved, spare pages NaN), read through the
        scalar-prefetched table: bitwise the scores and payload of the per-request keys, with
        pages of half a tile (two DMAs per tile) and of two tiles (a tile inside a page)."""
        args, block_sizes = self._prepare(scenario, dtype, interpret)
        group = SCENARIOS.index(scenario) % NUM_GROUPS
        q, weights, keys, slots, visible = _stack(args, group=group)
        want = lim_scores(q, weights, keys, slots, visible, group=jnp.int32(group),
                          block_sizes=block_sizes, interpret=interpret)
        num_g, b, s, n = keys.shape
        block_s = scenario.block_s
        pages = {z for z in (block_s // 2, 2 * block_s) if z >= 1 and s % z == 0
                 and (block_s % z == 0 or z % block_s == 0)}
        assert pages, (block_s, s)
        for z in sorted(pages):
            frames = b * (s // z) + 3
            table = np.random.default_rng(z).permutation(frames)[: b * (s // z)]
            table = table.astype(np.int32).reshape(b, s // z)
            pool = np.full((num_g, frames, z, n), np.nan, np.float32)
            pool[:, table] = np.asarray(keys, np.float32).reshape(num_g, b, s // z, z, n)
            pool = jnp.asarray(pool, keys.dtype)
            got = lim_scores(q, weights, pool, slots, visible, group=jnp.int32(group),
                             page_table=jnp.asarray(table), block_sizes=block_sizes,
                             interpret=interpret)
            chex.assert_trees_all_equal(got, want)
            chex.assert_trees_all_equal(
                lim_reference(q, weights, pool, slots, visible, k=scenario.k, group=group,
                              page_table=jnp.asarray(table)),
                lim_reference(q, weights, keys, slots, visible, k=scenario.k, group=group))

    def test_matches_reference(self, scenario, dtype, interpret):
        args, block_sizes = self._prepare(scenario, dtype, interpret)
        q, weights, keys, _, visible = args
        tolerance = TOLERANCES[jnp.dtype(dtype)]
        _assert_selection_well_posed(
            _scores_float64(q, weights, keys, visible), visible, scenario.k,
            tol=10 * (tolerance["atol"] + tolerance["rtol"]),
        )
        token, slot, score = lim(*args, k=scenario.k, block_sizes=block_sizes, interpret=interpret)
        ref_token, ref_slot, ref_score = lim_reference(*args, k=scenario.k)
        chex.assert_trees_all_equal((token, slot), (ref_token, ref_slot))
        np.testing.assert_array_equal(np.isfinite(score), np.isfinite(ref_score))
        np.testing.assert_allclose(score, ref_score, **tolerance)
        # Canonical order and padding: ascending tokens, -1 (slot -1, score -inf) after them.
        token = np.asarray(token)
        n_shown = np.minimum(np.asarray(visible), scenario.k)
        for (b, w), n in np.ndenumerate(n_shown):
            assert np.all(np.diff(token[b, w, :n]) > 0) and np.all(token[b, w, n:] == -1)
            assert np.all(np.asarray(slot)[b, w, n:] == -1)

    def test_selection_is_top_k_of_kernel_scores(self, scenario, dtype, interpret):
        args, block_sizes = self._prepare(scenario, dtype, interpret)
        _, _, _, token_to_slot, visible = args
        scores, payload = lim_scores(*args, block_sizes=block_sizes, interpret=interpret)
        expected = _expected_from_scores(scores, token_to_slot, visible, scenario.k)
        chex.assert_trees_all_equal(
            lim_select(scores, payload, k=scenario.k), tuple(map(jnp.asarray, expected))
        )
        chex.assert_trees_all_equal(
            lim(*args, k=scenario.k, block_sizes=block_sizes, interpret=interpret),
            tuple(map(jnp.asarray, expected)),
        )


def test_ties_lower_token_wins(interpret):
    """Equal scores everywhere but tokens 5 and 11: the ties go to the lowest tokens, across tiles.

    I = 1, w = 1, q = e0; key[s] = (1, 0, ...) -> score 1.0, tokens 5, 11: (2, 0, ...) -> 2.0.
    k = 5: 5, 11 (score 2.0), then 0, 1, 2 (score 1.0, lowest indices) -> [0, 1, 2, 5, 11].
    Way 1 sees 10 tokens: 5 (2.0), then 0, 1, 2, 3 -> [0, 1, 2, 3, 5].
    """
    s, n = 16, 8
    if interpret is False:
        pytest.skip("tiles of 8 are interpret-only")
    keys = np.zeros((1, s, n), np.float32)
    keys[0, :, 0] = 1.0
    keys[0, [5, 11], 0] = 2.0
    q = np.zeros((1, 2, 1, n), np.float32)
    q[..., 0] = 1.0
    args = (jnp.asarray(q), jnp.ones((1, 2, 1), jnp.float32), jnp.asarray(keys),
            jnp.arange(s, dtype=jnp.int32)[None] * 2, jnp.asarray([[16, 10]], jnp.int32))
    tokens = jnp.asarray([[[0, 1, 2, 5, 11], [0, 1, 2, 3, 5]]], jnp.int32)
    expected = (tokens, tokens * 2,
                jnp.asarray([[[1, 1, 1, 2, 2], [1, 1, 1, 1, 2]]], jnp.float32))
    chex.assert_trees_all_equal(lim_reference(*args, k=5), expected)
    chex.assert_trees_all_equal(
        lim(*args, k=5, block_sizes=BlockSizes(block_s=8), interpret=interpret), expected
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_stacked_bit_exact_with_per_group(dtype, interpret):
    scenario = SCENARIO["lane_tiles"] if interpret is False else SCENARIO["four_ways"]
    args = _inputs(scenario, dtype, seed=3)
    block_sizes = BlockSizes(block_s=scenario.block_s)
    per_group = lim_scores(*args, block_sizes=block_sizes, interpret=interpret)
    stacked = lim_scores(*_stack(args, group=NUM_GROUPS - 1), group=NUM_GROUPS - 1,
                         block_sizes=block_sizes, interpret=interpret)
    chex.assert_trees_all_equal(stacked, per_group)


@pytest.mark.parametrize("s, block_s", [(96, 32), (200, 8), (256, 256)])
def test_default_block_sizes_small_s_interpret(s, block_s):
    """Interpret mode's default tiles S = 96, 200, 256 (non-powers of two included) into
    several tiles; `lim` with a group and default tiles matches the reference."""
    assert BlockSizes.get_default(s=s, interpret=True) == BlockSizes(block_s=block_s)
    visible = ((s, s // 3 + 1),)
    scenario = Scenario(f"s{s}", visible=visible, s=s, k=6, block_s=block_s)
    args = _stack(_inputs(scenario, jnp.bfloat16, seed=4), group=1, num_groups=2)
    q, weights, keys, _, visible = args
    _assert_selection_well_posed(
        _scores_float64(q, weights, keys[1], visible), visible, scenario.k, tol=1e-4
    )
    out = lim(*args, k=scenario.k, group=jnp.int32(1), interpret=ON_WAIT)
    ref = lim_reference(*args, k=scenario.k, group=1)
    chex.assert_trees_all_equal(out[:2], ref[:2])
    np.testing.assert_allclose(out[2], ref[2], **TOLERANCES[jnp.dtype(jnp.bfloat16)])


def test_host_memory_space_interpret():
    """The keys read through the host memory space (modelled by the interpreter) give the same
    result; a real host-kind array is refused under interpret mode (jax bug, see kernel.py)."""
    scenario = SCENARIO["four_ways"]
    args = _inputs(scenario, jnp.bfloat16)
    block_sizes = BlockSizes(block_s=scenario.block_s)
    via_host = lim(*args, k=scenario.k, block_sizes=block_sizes,
                   keys_memory_space=jax.memory.Space.Host, interpret=ON_WAIT)
    chex.assert_trees_all_equal(
        via_host, lim(*args, k=scenario.k, block_sizes=block_sizes, interpret=ON_WAIT)
    )
    q, weights, keys, token_to_slot, visible = args
    host_keys = jax.device_put(keys, jax.memory.Space.Host)
    with pytest.raises(NotImplementedError, match="TPU interpret mode cannot take a host-memory"):
        lim(q, weights, host_keys, token_to_slot, visible, k=scenario.k, block_sizes=block_sizes,
            interpret=ON_WAIT)


# ----------------------------------------------------------------------------------------------
# Races and leaked semaphores.


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_no_race_and_no_leaked_semaphore(capfd, caplog, scenario):
    """LIM under both DMA modes: on_wait + race detector, then eager (shows unwaited DMAs)."""
    args = _inputs(scenario, jnp.bfloat16, seed=1)
    block_sizes = BlockSizes(block_s=scenario.block_s)
    results = [
        jax.block_until_ready(lim(*args, k=scenario.k, block_sizes=block_sizes, interpret=mode))
        for mode in (ON_WAIT, EAGER)
    ]
    text = _drain(capfd, caplog)
    assert not _alarms(text), text
    chex.assert_trees_all_equal(*results)


@pytest.mark.parametrize("scenario", [SCENARIO["four_ways"], SCENARIO["lane_tiles"]],
                         ids=lambda s: s.name)
def test_stacked_no_race_and_no_leaked_semaphore(capfd, caplog, scenario):
    args = _stack(_inputs(scenario, jnp.bfloat16, seed=1), group=2)
    block_sizes = BlockSizes(block_s=scenario.block_s)
    results = [
        jax.block_until_ready(
            lim(*args, k=scenario.k, group=2, block_sizes=block_sizes, interpret=mode)
        )
        for mode in (ON_WAIT, EAGER)
    ]
    text = _drain(capfd, caplog)
    assert not _alarms(text), text
    chex.assert_trees_all_equal(*results)


def _copy_kernel(x_hbm_ref, o_ref, buf, sem, *, bug):
    copy = pltpu.make_async_copy(x_hbm_ref, buf, sem)
    copy.start()
    if bug == "read_before_wait":
        o_ref[...] = buf[...]
        copy.wait()
    elif bug == "never_waited":
        o_ref[...] = jnp.zeros_like(o_ref)
    else:
        copy.wait()
        o_ref[...] = buf[...]


def _run_copy_kernel(bug, mode):
    return pl.pallas_call(
        functools.partial(_copy_kernel, bug=bug),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=mode,
    )(jnp.ones((8, 128), jnp.float32))


@pytest.mark.parametrize(
    "bug, mode, alarm",
    [(None, ON_WAIT, None), (None, EAGER, None),
     ("read_before_wait", ON_WAIT, "RACE DETECTED"), ("never_waited", EAGER, "non-zero count")],
    ids=["clean_on_wait", "clean_eager", "read_before_wait", "never_waited"],
)
def test_alarm_check_catches_bugs(capfd, caplog, bug, mode, alarm):
    """Controls for the alarm check above: it sees a race and a leaked DMA in a tiny kernel."""
    raised = ""
    try:
        jax.block_until_ready(_run_copy_kernel(bug, mode))
    except Exception as e:  # on_race="raise": the race also aborts the kernel
        if alarm is None:
            raise
        raised = str(e)
    finally:
        pltpu.reset_tpu_interpret_mode_state()  # drop what the aborted kernel left behind
    text = _drain(capfd, caplog)
    assert _alarms(text) == ([alarm] if alarm else []), text
    if bug == "read_before_wait":
        assert "RACE DETECTED" in raised


# ----------------------------------------------------------------------------------------------
# Static and value checks: the messages are part of the API.


def _shapes(b=1, w=4, i=2, n=8, s=32, keys_dtype=jnp.float32, slot_dtype=jnp.int32):
    return (jax.ShapeDtypeStruct((b, w, i, n), jnp.float32),
            jax.ShapeDtypeStruct((b, w, i), jnp.float32),
            jax.ShapeDtypeStruct((b, s, n), keys_dtype),
            jax.ShapeDtypeStruct((b, s), slot_dtype),
            jax.ShapeDtypeStruct((b, w), jnp.int32))


def test_bit_budget_rejects_too_many_tokens():
    s = MAX_TOKENS + 1  # abstract shapes only: nothing is allocated
    with pytest.raises(ValueError, match=r"s=2147483648 tokens overflow the LIM payload budget: "
                       r"token indices are the int32 indices returned by lax.top_k, 31 bits, "
                       r"so S must be <= 2147483647"):
        jax.eval_shape(functools.partial(lim, k=8), *_shapes(w=1, i=1, n=1, s=s))
    with pytest.raises(ValueError, match=r"s=2147483648 tokens overflow the LIM payload budget"):
        sds = jax.ShapeDtypeStruct((1, 1, s), jnp.float32)
        jax.eval_shape(functools.partial(lim_select, k=8), sds, sds.update(dtype=jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.uint32], ids=["int16", "uint32"])
def test_bit_budget_rejects_non_int32_slots(dtype):
    with pytest.raises(ValueError, match=r"token_to_slot.dtype=\w+ must be int32: the LIM payload "
                       r"is 32 bits, slots take its 31 non-negative bits \(C <= 2147483647\)"):
        jax.eval_shape(functools.partial(lim, k=8), *_shapes(slot_dtype=dtype))


def test_value_checks():
    slots = jnp.asarray([[0, 3, -1, 2]], jnp.int32)
    visible = jnp.asarray([[4]], jnp.int32)
    check_lim_inputs(slots, visible, num_slots=4)
    with pytest.raises(ValueError, match=r"num_slots=2147483648 overflows the LIM payload: "
                       r"must be in \[1, 2147483647\]"):
        check_lim_inputs(slots, visible, num_slots=2**31)
    with pytest.raises(ValueError,
                       match=r"token_to_slot values must be in \[-1, 3\), got \[-1, 3\]"):
        check_lim_inputs(slots, visible, num_slots=3)
    with pytest.raises(ValueError,
                       match=r"token_to_slot values must be in \[-1, 4\), got \[-2, 3\]"):
        check_lim_inputs(slots.at[0, 0].set(-2), visible, num_slots=4)
    with pytest.raises(ValueError, match=r"visible must be >= 0, got min -1"):
        check_lim_inputs(slots, visible - 5, num_slots=4)
    check_lim_inputs(slots, visible, num_slots=4, group=jnp.int32(0))
    with pytest.raises(ValueError, match=r"group=1 must be in \[0, G=1\)"):
        check_lim_inputs(slots[None], visible, num_slots=4, group=1)


def test_stacked_shape_checks():
    q, weights, keys, slots, visible = _shapes(s=32)
    stacked_keys = jax.ShapeDtypeStruct((3, *keys.shape), keys.dtype)
    stacked_slots = jax.ShapeDtypeStruct((3, *slots.shape), slots.dtype)
    call = functools.partial(lim, k=4, interpret=ON_WAIT)
    with pytest.raises(ValueError, match=re.escape(
        "with a group, index_keys must be [G, B=1, S, N=8] and token_to_slot [G, B=1, S] with "
        "the same G, got index_keys.shape=(1, 32, 8) and token_to_slot.shape=(1, 32)"
    )):
        jax.eval_shape(functools.partial(call, group=0), q, weights, keys, slots, visible)
    with pytest.raises(ValueError, match=re.escape("with the same G, got index_keys.shape=(3, ")):
        jax.eval_shape(functools.partial(call, group=0), q, weights, stacked_keys,
                       stacked_slots.update(shape=(2, 1, 32)), visible)
    with pytest.raises(ValueError, match=re.escape(
        "token_to_slot must have shape G=3, (1, 32), got (1, 31)"
    )):
        jax.eval_shape(functools.partial(call, group=0), q, weights, stacked_keys,
                       stacked_slots.update(shape=(3, 1, 31)), visible)
    with pytest.raises(ValueError, match=re.escape("index_keys must be [G=3, B=1, S, N=8], got")):
        jax.eval_shape(functools.partial(call, group=0), q, weights,
                       stacked_keys.update(shape=(3, 1, 32, 7)), stacked_slots, visible)
    for group in (jnp.zeros((1,), jnp.int32), 1.0, True):
        with pytest.raises(ValueError, match="group must be an integer scalar"):
            jax.eval_shape(functools.partial(call, group=group), q, weights, stacked_keys,
                           stacked_slots, visible)
    jax.eval_shape(functools.partial(call, group=2), q, weights, stacked_keys, stacked_slots,
                   visible)


def test_reference_clamps_the_group_like_dynamic_index():
    args = _stack(_inputs(SCENARIO["two_ways"], jnp.float32), group=0)
    for group, clamped in ((-4, 0), (NUM_GROUPS + 3, NUM_GROUPS - 1)):
        chex.assert_trees_all_equal(lim_reference(*args, k=4, group=group),
                                    lim_reference(*args, k=4, group=clamped))


def test_block_sizes_and_k_checks():
    with pytest.raises(ValueError, match=r"block_s=0 must be > 0"):
        BlockSizes(block_s=0)
    with pytest.raises(ValueError, match=r"block_s=6 must divide s=32"):
        jax.eval_shape(functools.partial(lim, k=4, block_sizes=BlockSizes(6), interpret=ON_WAIT),
                       *_shapes())
    with pytest.raises(NotImplementedError, match=r"block_s=8 must be a multiple of 128 or equal "
                       r"s=32 on the Mosaic TPU backend"):
        jax.eval_shape(functools.partial(lim, k=4, block_sizes=BlockSizes(8)), *_shapes())
    with pytest.raises(ValueError, match=r"k=33 must be in \[1, s=32\]"):
        jax.eval_shape(functools.partial(lim, k=33), *_shapes())
    assert BlockSizes.get_default(s=131072) == BlockSizes(block_s=1024)
    assert BlockSizes.get_default(s=20) == BlockSizes(block_s=20)
    # Compiled: lane-aligned tiles or one tile; interpret mode: any listed divisor, down to 8.
    defaults = {96: (96, 32), 200: (200, 8), 256: (256, 256), 20: (20, 20), 5: (5, 5),
                24: (24, 8), 384: (128, 128), 131072: (1024, 1024), 1001: (1001, 1001)}
    for s, (compiled, interpreted) in defaults.items():
        assert BlockSizes.get_default(s=s) == BlockSizes(block_s=compiled), s
        assert BlockSizes.get_default(s=s, interpret=True) == BlockSizes(block_s=interpreted), s
        BlockSizes.get_default(s=s).validate(s=s, interpret=False)
        BlockSizes.get_default(s=s, interpret=True).validate(s=s, interpret=True)


# ----------------------------------------------------------------------------------------------
# Cross-lowering for a TPU at production shapes.


@pytest.mark.parametrize("keys_in_host_memory", [False, True], ids=["device_keys", "host_keys"])
@pytest.mark.parametrize("num_heads", [32, 64])
def test_lowers_for_tpu_at_production_shapes(num_heads, keys_in_host_memory):
    """S = 131072, N = 128, W = 4, K = 2048, bf16 keys: kernel + XLA selection lower for a TPU."""
    shapes = _shapes(b=2, w=4, i=num_heads, n=128, s=131072, keys_dtype=jnp.bfloat16)

    def f(q_index, weights, index_keys, token_to_slot, visible):
        if keys_in_host_memory:
            index_keys = jax.device_put(index_keys, jax.memory.Space.Host)
        return lim(q_index, weights, index_keys, token_to_slot, visible, k=2048)

    exported = jax.export.export(jax.jit(f), platforms=("tpu",))(*shapes)
    module = exported.mlir_module()
    assert "tpu_custom_call" in module and "lim_block_s_1024" in module
    assert ('_xla_buffer_placement = "pinned_host"' in module) == keys_in_host_memory
    assert [o.shape for o in exported.out_avals] == [(2, 4, 2048)] * 3


@pytest.mark.parametrize("keys_in_host_memory", [False, True], ids=["device_keys", "host_keys"])
def test_lowers_for_tpu_stacked_at_production_shapes(keys_in_host_memory):
    """Keys [G = 4, B, 131072, 128] bf16 (device or pinned host) and slots [G, B, 131072], the
    group traced: both stacks go into the kernel whole; no group is sliced, copied or reshaped."""
    g, b, w, i, n, s = 4, 2, 4, 64, 128, 131072
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    q, weights, _, _, visible = _shapes(b=b, w=w, i=i, n=n, s=s)
    keys = jax.ShapeDtypeStruct((g, b, s, n), jnp.bfloat16,
                                sharding=pinned if keys_in_host_memory else None)
    slots = jax.ShapeDtypeStruct((g, b, s), jnp.int32)

    def f(q_index, weights, index_keys, token_to_slot, visible, group):
        if keys_in_host_memory:
            index_keys = jax.device_put(index_keys, jax.memory.Space.Host)  # already: a no-op
        return lim(q_index, weights, index_keys, token_to_slot, visible, k=2048, group=group)

    exported = jax.export.export(jax.jit(f), platforms=("tpu",))(
        q, weights, keys, slots, visible, jax.ShapeDtypeStruct((), jnp.int32)
    )
    text = exported.mlir_module()
    calls = [line for line in text.splitlines() if "@tpu_custom_call" in line]
    assert len(calls) == 1 and "lim_block_s_1024" in text, calls
    operands = re.search(r"@tpu_custom_call\(([^)]*)\)", calls[0]).group(1).split(", ")
    assert operands[-1] == "%arg3", operands  # the slot stack as is
    if not keys_in_host_memory:
        assert operands[-2] == "%arg2", operands  # the key stack as is
    for per_group in (f"tensor<{b}x{s}x{n}xbf16>", f"tensor<{b}x{s}xi32>",
                      f"tensor<{b}x1x{s}xi32>", f"tensor<{g}x{b}x1x{s}xi32>"):
        assert per_group not in text, per_group
    body = base64.b64decode(re.search(r"body\\22: \\22([A-Za-z0-9+/=]+)", calls[0]).group(1))
    assert (b"#tpu.memory_space<host>" in body) == keys_in_host_memory
    assert [o.shape for o in exported.out_avals] == [(b, w, 2048)] * 3


def test_paged_static_messages():
    # SCENARIOS[0]: B = 1, S = 32; the keys as a pool of 8 pages of 4 (the identity table).
    q, weights, keys, slots, visible = _inputs(SCENARIOS[0], jnp.float32)
    b, s, n = keys.shape
    pool = keys.reshape(b * s // 4, 4, n)
    table = jnp.arange(b * s // 4, dtype=jnp.int32).reshape(b, s // 4)
    call = functools.partial(lim_scores, q, weights, interpret=ON_WAIT)
    with pytest.raises(ValueError, match=re.escape(f"page_table must be [B={b}, P] int32, got "
                                                   "page_table.shape=(1, 8) "
                                                   "page_table.dtype=dtype('uint32')")):
        call(pool, slots, visible, page_table=table.astype(jnp.uint32))
    with pytest.raises(ValueError, match=re.escape(
            f"with a page_table, index_keys must be a pool [G, F, Z, N={n}], got "
            f"index_keys.shape=(8, 4, {n})")):
        call(pool, slots[None], visible, group=0, page_table=table)
    # S = 24 in tiles of 8, pages of 12: a tile would straddle two pages.
    scenario = next(sc for sc in SCENARIOS if sc.name == "mixed_sign_weights")
    q, weights, keys, slots, visible = _inputs(scenario, jnp.float32)
    b, s, n = keys.shape
    with pytest.raises(ValueError, match=re.escape("block_s=8 and the key pool's page size 12 "
                                                   "must divide one another")):
        lim_scores(q, weights, keys.reshape(b * 2, 12, n), slots, visible,
                   page_table=jnp.arange(b * 2, dtype=jnp.int32).reshape(b, 2),
                   block_sizes=BlockSizes(block_s=8), interpret=ON_WAIT)

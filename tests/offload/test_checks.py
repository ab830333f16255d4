"""The on-device invariant checks (fo_jax.offload.checks) against the numpy oracle
(fo_jax.offload.invariants): both pass on real states and both name each planted violation;
the checks run inside a compiled scan of decode steps."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.offload import checks
from fo_jax.offload import decode as offload_decode
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants, occupied_slots
from fo_jax.offload.state import DecodeState, HostPages, to_memory_kind

NAN = float("nan")
# Two indexer groups (layers 0-1, 2-3); C = 16 slots: request 0 (40 tokens) starts full and
# misses, request 1 (13 tokens) starts with 12 filled slots and fills up.
CONFIG = get_config("tiny").replace(index_topk=4, max_ways=2, indexer_layers=(0, 2))
OFFLOAD = OffloadConfig(hot_slots=16, page_size=4, capacity=64, policy="ring")
LENGTHS = [40, 13]
STEPS = 3


def _state(tree) -> DecodeState:
    """A DecodeState from a numpy copy, host pages back in their memory kind; every leaf
    committed to the device, like a step's outputs (so no step compiles twice)."""
    state = jax.device_put(tree, jax.devices()[0])
    kv = to_memory_kind(state.host.kv, OFFLOAD.host_memory_kind)
    return dataclasses.replace(state, host=HostPages(kv=kv))


def _copy(tree):
    return jax.tree_util.tree_map(np.array, tree)


@pytest.fixture(scope="module")
def run():
    """A few checked decode steps on the tiny model; numpy copies of what the plants need."""
    params = init_params(CONFIG, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, CONFIG.vocab_size, (2, max(LENGTHS)), dtype=np.int32)
    res = resident.ResidentState.create(CONFIG, batch=2, capacity=OFFLOAD.capacity, fill=NAN)
    _, res = resident.prefill(params, res, prompt, np.asarray(LENGTHS), config=CONFIG)
    state = _state(_copy(DecodeState.from_resident(res.kv, res.index_keys, res.lengths,
                                                   config=CONFIG, offload=OFFLOAD, fill=NAN)))
    occupied = []
    for _ in range(STEPS):
        before = _copy(state)
        occupied.append(occupied_slots(state))
        tokens = rng.integers(0, CONFIG.vocab_size, (2, CONFIG.max_ways), dtype=np.int32)
        # debug: the on-device checks run after every step (and pass).
        logits, state, stats = offload_decode.decode_step(params, state, tokens, config=CONFIG,
                                                          offload=OFFLOAD, debug=True)
    occupied.append(occupied_slots(state))
    return dict(params=params, state=_copy(state), before=before, stats=_copy(stats),
                logits=np.asarray(logits), occupied=occupied, rng=rng)


def _numpy_check(tree, run):
    check_invariants(_state(tree), config=CONFIG, offload=OFFLOAD, selected=run["stats"].selected,
                     poisoned=True, finite=True, occupied_before=run["occupied"][-2])


def _device_check(tree, run):
    stats = run["stats"]
    checks.check_state_on_device(_state(tree), config=CONFIG, offload=OFFLOAD,
                                 selected=stats.selected, union=stats.union,
                                 occupied_before=run["occupied"][-2], logits=run["logits"])


def test_the_run_fills_and_misses(run):
    # The scenario the plants rely on: request 0 full and missing, request 1 filling up.
    assert run["occupied"][0].tolist() == [[16, 12], [16, 12]]
    assert run["occupied"][-1][:, 0].tolist() == [16, 16]
    assert np.all(run["occupied"][-1][:, 1] > 12)
    assert np.all(run["stats"].union[:, 0] > 0)


def test_both_checkers_pass_the_clean_state(run):
    _numpy_check(run["state"], run)
    _device_check(run["state"], run)


def _tokens(run, g=0, b=0):
    """(selected resident tokens installed by the last step, other selected resident tokens,
    unselected resident tokens, unselected non-resident tokens) of group g, request b."""
    state, before, stats = run["state"], run["before"], run["stats"]
    t2s = state.slots.token_to_slot[g, b]
    was = before.slots.token_to_slot[g, b]
    tail_start = (int(state.lengths[b]) // OFFLOAD.page_size) * OFFLOAD.page_size
    sel = set(stats.selected[g, b].reshape(-1).tolist()) - {-1}
    resident_now = {t for t in range(tail_start) if t2s[t] >= 0}
    installed = sorted(t for t in sel & resident_now if was[t] < 0)
    hits = sorted(t for t in sel & resident_now if was[t] >= 0)
    unselected = sorted(resident_now - sel)
    outside = sorted(set(range(tail_start)) - resident_now - sel)
    assert installed and unselected and outside
    return installed, hits, unselected, outside


def _rows_of(tree, g):
    lo, hi = CONFIG.group_bounds[g]
    return range(lo, hi)


def _host_row(tree, layer, b, t):
    z = OFFLOAD.page_size
    return tree.host.kv[layer, tree.table[b, t // z], t % z]


def plant_maps_not_inverse(tree, run):
    _, _, unselected, outside = _tokens(run)
    t, u = unselected[0], outside[0]
    s = int(tree.slots.token_to_slot[0, 0, t])
    tree.slots.slot_to_token[0, 0, s] = u  # token_to_slot[u] stays -1, [t] stays s
    return (rf"group 0 request 0: slot \[{s}\] holds token \[{u}\] whose token_to_slot is "
            rf"\[-1\]",
            rf"group 0 request 0: slot {s} holds token {u} whose token_to_slot is -1")


def plant_slot_given_twice(tree, run):
    _, _, unselected, outside = _tokens(run)
    t, u = unselected[0], outside[0]
    s = int(tree.slots.token_to_slot[0, 0, t])
    tree.slots.token_to_slot[0, 0, u] = s  # slot s now claimed by t and u
    return (rf"group 0 request 0: token \[{u}\] maps to slot \[{s}\] which holds token \[{t}\]",
            rf"group 0 request 0: token {u} maps to slot {s} which holds token {t}")


def plant_wrong_installed_row(tree, run):
    installed, _, _, outside = _tokens(run)
    t, other = installed[0], outside[0]
    s = int(tree.slots.token_to_slot[0, 0, t])
    layer = _rows_of(tree, 0)[-1]
    tree.hot[layer, 0, s] = _host_row(tree, layer, 0, other)
    return (rf"layer {layer} request 0: hot slot \[{s}\] differs from host row of token \[{t}\]",
            rf"layer {layer} group 0 request 0: device row {s} read for token {t} differs "
            "from the token's host row")


def plant_nan_row(tree, run):
    _, hits, _, _ = _tokens(run)
    t = hits[0]
    s = int(tree.slots.token_to_slot[0, 0, t])
    layer = _rows_of(tree, 0)[0]
    z = OFFLOAD.page_size
    tree.hot[layer, 0, s] = NAN
    # The same NaN in both: only finiteness sees it.
    tree.host.kv[layer, tree.table[0, t // z], t % z] = NAN
    return (rf"layer {layer} request 0: hot slot \[{s}\] of token \[{t}\] holds a non-finite "
            "value",
            rf"layer {layer} group 0 request 0: device row {s} read for token {t} holds a "
            "non-finite value")


def plant_selected_not_resident(tree, run):
    _, hits, _, outside = _tokens(run)
    t, u = hits[0], outside[0]
    s = int(tree.slots.token_to_slot[0, 0, t])
    # A consistent swap: slot s now holds u (maps and rows agree), t has no slot.
    tree.slots.slot_to_token[0, 0, s] = u
    tree.slots.token_to_slot[0, 0, u] = s
    tree.slots.token_to_slot[0, 0, t] = -1
    for layer in _rows_of(tree, 0):
        tree.hot[layer, 0, s] = _host_row(tree, layer, 0, u)
    return (rf"group 0 request 0: selected token \[{t}\] is neither resident nor in the tail",
            rf"group 0 request 0: way \d selected token {t}, which after the step is neither "
            rf"resident \(slot -1\) nor in the step's tail blocks")


def plant_occupancy_drop(tree, run):
    _, _, unselected, _ = _tokens(run)
    t = unselected[0]
    s = int(tree.slots.token_to_slot[0, 0, t])
    # A consistent eviction without an install: the slot is emptied and poisoned.
    tree.slots.slot_to_token[0, 0, s] = -1
    tree.slots.token_to_slot[0, 0, t] = -1
    for layer in _rows_of(tree, 0):
        tree.hot[layer, 0, s] = NAN
    return ("group 0 request 0: occupied slots fell from 16 to 15",
            "group 0 request 0: filled slots fell from 16 to 15")


def plant_page_not_held(tree, run):
    # Request 1 (length 13 + 2 STEPS = 19) loses page 0 of its page table.
    tree.table[1, 0] = -1
    return (r"request 1: page \[0\] holds stored tokens \(length 19\) but its page table "
            r"entry is \[-1\], not a pool page in \[0, 32\)",
            r"request 1: page 0 holds stored tokens \(length 19\) but its page table entry "
            r"is -1, not a pool page in \[0, 32\)")


@pytest.mark.parametrize("plant", [
    plant_maps_not_inverse, plant_slot_given_twice, plant_wrong_installed_row, plant_nan_row,
    plant_selected_not_resident, plant_occupancy_drop, plant_page_not_held,
], ids=lambda f: f.__name__.removeprefix("plant_"))
def test_both_checkers_name_each_planted_violation(run, plant):
    tree = _copy(run["state"])
    numpy_msg, device_msg = plant(tree, run)
    with pytest.raises(AssertionError, match=numpy_msg):
        _numpy_check(tree, run)
    with pytest.raises(AssertionError, match=r"offloaded decode state invariant violated: "
                                             + device_msg):
        _device_check(tree, run)


def test_non_finite_logits_are_named(run):
    logits = run["logits"].copy()
    logits[1, 0, 7] = np.inf
    with pytest.raises(AssertionError, match=r"request 1 way 0: logit 7 is not finite"):
        _device_check(run["state"], {**run, "logits": logits})


def test_a_state_of_other_settings_fails_at_trace_time(run):
    tree = _copy(run["state"])
    bad = dataclasses.replace(tree, lengths=tree.lengths.astype(np.float32))
    with pytest.raises(AssertionError, match=r"assert_type"):
        checks.check_state_on_device(_state(bad), config=CONFIG, offload=OFFLOAD)


def test_checks_run_inside_a_compiled_scan_of_steps(run):
    params = run["params"]

    def loop(state, tokens):
        def body(state, tok):
            # The pure checker on the carried state, then the step with its own checks.
            checks.check_state_jit(state, config=CONFIG, offload=OFFLOAD)
            logits, state, stats = offload_decode.decode_jit(
                params, state, tok, config=CONFIG, offload=OFFLOAD, debug=True)
            return state, stats.union
        return jax.lax.scan(body, state, tokens)

    compiled = jax.jit(checkify.checkify(loop, errors=checkify.user_checks))
    tokens = jnp.asarray(run["rng"].integers(0, CONFIG.vocab_size, (3, 2, CONFIG.max_ways),
                                             dtype=np.int32))
    err, (state, unions) = compiled(_state(run["state"]), tokens)
    assert checks.error_message(err) is None
    assert unions.shape == (3, CONFIG.num_groups, 2)
    assert np.asarray(state.lengths).tolist() == [v + 2 * (STEPS + 3) for v in LENGTHS]

    tree = _copy(run["state"])
    _, device_msg = plant_slot_given_twice(tree, run)
    err, _ = compiled(_state(tree), tokens)  # same shapes: no second compile
    with pytest.raises(AssertionError, match=device_msg):
        checks.raise_on_error(err)


def test_decode_step_debug_raises_after_a_bad_step(run):
    tree = _copy(run["state"])
    _, _, unselected, outside = _tokens(run)
    t, u = unselected[0], outside[0]
    s = int(tree.slots.token_to_slot[0, 0, t])
    tree.slots.token_to_slot[0, 0, u] = s
    tokens = np.zeros((2, CONFIG.max_ways), np.int32)
    # Whether or not the step evicts slot s, token u still claims it afterwards.
    with pytest.raises(AssertionError, match=rf"invariant violated: group 0 request 0: token "
                                             rf"{u} maps to slot {s} which holds token \d+"):
        offload_decode.decode_step(run["params"], _state(tree), tokens, config=CONFIG,
                                   offload=OFFLOAD, debug=True)


def test_clock_steps_keep_every_invariant():
    # The same scenario under the clock policy: the on-device checks (debug) and the numpy
    # oracle pass after every step, and the cache fills by exactly the misses (empties first).
    offload = dataclasses.replace(OFFLOAD, policy="clock")
    params = init_params(CONFIG, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, CONFIG.vocab_size, (2, max(LENGTHS)), dtype=np.int32)
    res = resident.ResidentState.create(CONFIG, batch=2, capacity=offload.capacity, fill=NAN)
    _, res = resident.prefill(params, res, prompt, np.asarray(LENGTHS), config=CONFIG)
    state = DecodeState.from_resident(res.kv, res.index_keys, res.lengths, config=CONFIG,
                                      offload=offload, fill=NAN)
    assert state.policy.ref.shape == (CONFIG.num_groups, 2, offload.hot_slots)
    for _ in range(4):
        before = occupied_slots(state)
        tokens = rng.integers(0, CONFIG.vocab_size, (2, CONFIG.max_ways), dtype=np.int32)
        logits, state, stats = offload_decode.decode_step(params, state, tokens, config=CONFIG,
                                                          offload=offload, debug=True)
        check_invariants(state, config=CONFIG, offload=offload, selected=stats.selected,
                         poisoned=True, finite=True, occupied_before=before)
        np.testing.assert_array_equal(occupied_slots(state),
                                      np.minimum(before + np.asarray(stats.union), 16))
    assert np.asarray(state.policy.ref).any()

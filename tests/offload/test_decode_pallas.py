"""The decode step on the Pallas path (LIM + CopySFA, TPU interpret mode on CPU).

Against the resident step run on the same kernels: bit for bit. Against the XLA path: every
integer output (selections, slot maps, copy counts) exactly, logits within a float32 tolerance
(the kernels sum in their own order).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.offload import decode as offload_decode
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload.state import DecodeState

NAN = float("nan")
INTERPRET = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(autouse=True)
def _no_races(capfd):
    yield
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "RACE DETECTED" not in text and "non-zero" not in text, text


# Host pages for this many steps, whatever a test runs: the tests of one scenario then share
# the compiled prefill and steps.
ROOM = 4


def _setup(*, batch, ways, k, hot, page, lengths, policy, shared, permuted=False):
    # Three layers (the tiny model has four): shared indexers give groups of unequal sizes
    # (layers 0-1 and 2), unshared ones three groups; a quarter less to compile and to interpret.
    config = get_config("tiny").replace(index_topk=k, max_ways=ways, num_layers=3,
                                        indexer_layers=(0, 2) if shared else (0, 1, 2))
    capacity = -(-(max(lengths) + ROOM * ways) // page) * page
    offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity, policy=policy,
                            host_memory_kind="device")
    params = init_params(config, jax.random.key(1))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, config.vocab_size, (batch, max(lengths)), dtype=np.int32)
    res = resident.ResidentState.create(config, batch=batch, capacity=capacity, fill=NAN)
    _, res = resident.prefill(params, res, prompt, np.asarray(lengths), config=config)

    frames, table = None, None
    if permuted:  # the requests' pages interleaved at random over a pool with 3 spare pages
        frames = batch * offload.num_pages + 3
        table = np.random.default_rng(2).permutation(frames)[:batch * offload.num_pages]
        table = table.astype(np.int32).reshape(batch, offload.num_pages)

    def handoff():
        return DecodeState.from_resident(res.kv, res.index_keys, res.lengths, config=config,
                                         offload=offload, fill=NAN, num_frames=frames,
                                         table=table)

    return config, offload, params, res, handoff, rng


def _compare(scenario, steps):
    assert steps <= ROOM
    config, offload, params, res, handoff, rng = _setup(**scenario)
    pallas_state = handoff()
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (res.batch, config.max_ways), np.int32)
        # The XLA step starts from the same state (a copy: states are donated), so the two
        # implementations are compared on one step each time, not on drifting histories.
        xla_state = jax.tree_util.tree_map(jnp.copy, pallas_state)
        want, res = resident.decode_step(params, res, tokens, config=config,
                                         implementation="pallas", interpret=INTERPRET)
        got, pallas_state, stats = offload_decode.decode_step(
            params, pallas_state, tokens, config=config, offload=offload,
            implementation="pallas", interpret=INTERPRET)
        chex.assert_trees_all_equal(got, want)
        ref, xla_state, xla_stats = offload_decode.decode_step(
            params, xla_state, tokens, config=config, offload=offload, implementation="xla")
        np.testing.assert_allclose(got, ref, **TOL)
        for name in ("hits", "tail_hits", "misses", "union", "selected", "h2d_bytes"):
            np.testing.assert_array_equal(getattr(stats, name), getattr(xla_stats, name))
        chex.assert_trees_all_equal(pallas_state.slots, xla_state.slots)
        chex.assert_trees_all_equal(pallas_state.policy, xla_state.policy)
        check_invariants(pallas_state, config=config, offload=offload, resident_kv=res.kv,
                         selected=stats.selected, poisoned=True)


TWO_WAYS = dict(batch=2, ways=2, k=8, hot=16, page=4, lengths=[30, 21], policy="ring",
                shared=True)


def test_pallas_decode_with_misses_and_two_ways():
    _compare(TWO_WAYS, steps=4)


def test_pallas_decode_through_a_permuted_page_table():
    # CopySFA reads the misses through the scalar-prefetched page table; LIM reads the keys
    # through it: still bitwise the resident path, and the XLA step's selection and maps.
    _compare(dict(TWO_WAYS, permuted=True), steps=3)


@settings(max_examples=2)
@given(st.fixed_dictionaries(dict(
    batch=st.integers(1, 2), ways=st.integers(1, 3), k=st.sampled_from([4, 8]),
    policy=st.sampled_from(["ring", "lru", "random"]), shared=st.booleans(),
    long=st.booleans())))
def test_pallas_decode_random_configs(draw):
    ways, k = draw["ways"], draw["k"]
    base = 5 * k if draw["long"] else k
    scenario = dict(batch=draw["batch"], ways=ways, k=k, hot=k * ways, page=4,
                    lengths=[base - i for i in range(draw["batch"])], policy=draw["policy"],
                    shared=draw["shared"])
    _compare(scenario, steps=2)


def test_explicit_pallas_off_tpu_needs_interpret():
    # The scenario of the tests above: its prefill is compiled already.
    config, offload, params, res, handoff, rng = _setup(**TWO_WAYS)
    tokens = np.zeros((2, 2), np.int32)
    with pytest.raises(NotImplementedError, match=r"pass interpret=True"):
        offload_decode.decode_step(params, handoff(), tokens, config=config, offload=offload,
                                   implementation="pallas")
    pinned = OffloadConfig(hot_slots=16, page_size=4, capacity=offload.capacity)
    with pytest.raises(NotImplementedError, match=r"host_memory_kind='device'"):
        offload_decode.decode_step(params, handoff(), tokens, config=config, offload=pinned,
                                   implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match=r"implementation='cuda'"):
        resident.decode_step(params, res, tokens, config=config, implementation="cuda")

"""Tests of the prefill's layer schedule (fo_jax.offload.layer_schedule) and the analytic
pipeline model that times it (H2D, compute, D2H over rotating buffers)."""

from __future__ import annotations

import numpy as np
import pytest

from fo_jax.config import get_config
from fo_jax.offload.layer_schedule import (
    buffer_of_layer,
    default_onload_layer_map,
    normalize_onload_layer_map,
)
from fo_jax.offload.pipeline_model import (
    HARDWARE_PROFILES,
    chunk_layer_times,
    layer_prefill_flops,
    layer_transfer_bytes,
    simulate_prefill_chunk,
    simulate_prefill_pipeline,
)


def uniform(num_layers, load, compute, writeback, *, distance=1, num_buffers=4, shared=False):
    return simulate_prefill_pipeline(
        [load] * num_layers, [compute] * num_layers, [writeback] * num_layers,
        onload_layer_map=default_onload_layer_map(num_layers, distance, num_buffers),
        num_buffers=num_buffers, shared_copy_engine=shared,
    )


# The bound exposed_load(l) = max(0, tau_H2D - d_on * tau_compute) ----------------------------


@pytest.mark.parametrize(
    "load, expected",
    [
        (3.0, 2.0),  # max(0, 3.0 - 1 * 1.0) = 2.0
        (1.0, 0.0),  # max(0, 1.0 - 1 * 1.0) = 0
        (0.5, 0.0),  # max(0, 0.5 - 1 * 1.0) = 0
    ],
)
def test_uniform_distance_one_matches_bound(load, expected):
    # 8 layers of 1.0 s compute, write-back 0.1 s, distance 1: every layer >= 1 waits
    # tau_H2D - tau_compute; layer 0 is pinned and never waits.
    result = uniform(8, load, 1.0, 0.1, distance=1)
    np.testing.assert_allclose(result.exposed_load, [0.0] + [expected] * 7)
    np.testing.assert_allclose(result.buffer_stall, 0.0)
    # Nothing but the last write-back (0.1 s) waits after the last compute.
    assert result.writeback_tail == pytest.approx(0.1)
    assert result.total_time == pytest.approx(8.0 + 7 * expected + 0.1)


@pytest.mark.parametrize(
    "distance, num_buffers, expected",
    [
        (1, 4, 1.5),  # issued when layer 2 starts (t = 2), done at 4.5; layer 2 ends at 3: 2.5 - 1
        (2, 4, 0.5),  # issued when layer 1 starts (t = 1), done at 3.5; layer 2 ends at 3: 2.5 - 2
        (3, 5, 0.0),  # issued when layer 0 starts (t = 0), done at 2.5, before 3: max(0, 2.5 - 3)
    ],
)
def test_single_heavy_layer_matches_bound(distance, num_buffers, expected):
    # 6 layers of 1.0 s compute; only layer 3 has something to load (2.5 s); no write-back.
    load = np.zeros(6)
    load[3] = 2.5
    result = simulate_prefill_pipeline(
        load, np.ones(6), np.zeros(6),
        onload_layer_map=default_onload_layer_map(6, distance, num_buffers),
        num_buffers=num_buffers,
    )
    assert result.exposed_load[3] == pytest.approx(expected)
    assert np.delete(result.exposed_load, 3) == pytest.approx(np.zeros(5))


def test_bound_is_a_lower_bound_when_loads_queue():
    # tau_H2D = 1.5 > tau_compute = 1.0 with distance 2: the bound says max(0, 1.5 - 2) = 0,
    # but one H2D engine delivers a layer every 1.5 s, so compute waits 1.5 - 1.0 = 0.5 per layer.
    result = uniform(8, 1.5, 1.0, 0.1, distance=2)
    np.testing.assert_allclose(result.exposed_load[1:], 0.5)


# Shared copy engine ---------------------------------------------------------------------------


def test_shared_engine_exposes_more():
    # H2D = D2H = 0.75 s per layer, compute 1.0 s. Separate engines: 0.75 < 1.0, all hidden.
    # Shared: 0.75 + 0.75 = 1.5 s of copies per 1.0 s layer: from layer 2 on (layer 1's load has
    # no write-back to share with) compute waits 1.5 - 1.0 = 0.5 s per layer.
    separate = uniform(8, 0.75, 1.0, 0.75, shared=False)
    shared = uniform(8, 0.75, 1.0, 0.75, shared=True)
    np.testing.assert_allclose(separate.exposed_load, 0.0)
    np.testing.assert_allclose(shared.exposed_load, [0.0, 0.0] + [0.5] * 6)
    assert shared.total_time > separate.total_time


@pytest.mark.parametrize("copy_time", [0.25, 0.5, 1.0])
def test_shared_engine_doubles_the_needed_window(copy_time):
    # H2D = D2H = tau. Separate engines hide the copies with compute >= tau, a shared engine
    # needs compute >= 2 * tau; 10% less than either threshold exposes something.
    def exposed(compute, shared):
        return uniform(10, copy_time, compute, copy_time, shared=shared).exposed_load.sum()

    assert exposed(copy_time, shared=False) == pytest.approx(0.0)
    assert exposed(0.9 * copy_time, shared=False) > 0
    assert exposed(2 * copy_time, shared=True) == pytest.approx(0.0)
    assert exposed(1.9 * copy_time, shared=True) > 0
    assert exposed(copy_time, shared=True) > 0


# Distance -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_buffers", [4, 6])
@pytest.mark.parametrize("seed", range(5))
def test_more_distance_never_exposes_more(num_buffers, seed):
    # Separate engines: every event time is a max-plus function of the issue times, and a longer
    # distance issues every load no later, so no layer can start later.
    rng = np.random.default_rng(seed)
    num_layers = 12
    load = rng.uniform(0.0, 3.0, num_layers)
    compute = rng.uniform(0.5, 1.5, num_layers)
    writeback = rng.uniform(0.0, 1.5, num_layers)
    starts = []
    for distance in range(1, num_buffers - 1):
        result = simulate_prefill_pipeline(
            load, compute, writeback,
            onload_layer_map=default_onload_layer_map(num_layers, distance, num_buffers),
            num_buffers=num_buffers,
        )
        starts.append(result.compute_start)
    for shorter, longer in zip(starts, starts[1:]):
        assert np.all(longer <= shorter + 1e-12)


def test_time_identity_and_no_offload_time():
    rng = np.random.default_rng(0)
    load, compute, writeback = rng.uniform(0.0, 2.0, (3, 9))
    for shared in (False, True):
        result = simulate_prefill_pipeline(
            load, compute, writeback, onload_layer_map=default_onload_layer_map(9, 2, 4),
            num_buffers=4, shared_copy_engine=shared,
        )
        assert result.no_offload_time == pytest.approx(compute.sum())
        assert result.total_time == pytest.approx(
            compute.sum() + result.exposed_load.sum() + result.writeback_tail
        )
        assert result.overhead >= 0
        # A buffer is reloaded only after its previous layer computed and was written back.
        for layer in range(4, 9):
            previous = layer - 3
            assert result.load_start[layer] >= result.writeback_end[previous]
            assert result.load_start[layer] >= result.compute_end[previous]


def test_buffer_stall_shows_slow_write_back():
    # 2 buffers (1 rotating), distance 1, nothing to load, compute 1.0 s, write-back 2.0 s.
    # Layer 1 has the rotating buffer to itself: compute 0 [0, 1], compute 1 [1, 2].
    # D2H: write-back 0 [1, 3], write-back 1 ready at 2 but queued behind it: [3, 5].
    # Layer 2 takes layer 1's buffer: held from 2 (layer 1 computed) to 5: stall 3, compute
    # [5, 6]. Write-back 2 [6, 8]; layer 3 held from 6 to 8: stall 2, compute [8, 9].
    # Write-back 3 [9, 11]: the end waits 2.0 s after the last compute.
    result = uniform(4, 0.0, 1.0, 2.0, num_buffers=2)
    np.testing.assert_allclose(result.buffer_stall, [0.0, 0.0, 3.0, 2.0])
    np.testing.assert_allclose(result.exposed_load, [0.0, 0.0, 3.0, 2.0])
    assert result.writeback_tail == pytest.approx(2.0)
    assert result.total_time == pytest.approx(11.0)


# Schedules ------------------------------------------------------------------------------------


def test_default_onload_layer_map():
    assert default_onload_layer_map(6, 1, 4) == ((1,), (2,), (3,), (4,), (5,), ())
    assert default_onload_layer_map(6, 2, 4) == ((1, 2), (3,), (4,), (5,), (), ())
    # Distance above num_buffers - 2 is capped (4 buffers: 2); 2 buffers: distance 1.
    assert default_onload_layer_map(6, 5, 4) == default_onload_layer_map(6, 2, 4)
    assert default_onload_layer_map(4, 3, 2) == ((1,), (2,), (3,), ())
    assert default_onload_layer_map(1, 1, 1) == ((),)
    assert [buffer_of_layer(layer, 4) for layer in range(7)] == [0, 1, 2, 3, 1, 2, 3]


def test_map_forms_are_equivalent():
    expected = ((1, 2), (3,), (), ())
    assert normalize_onload_layer_map({0: (1, 2), 1: 3}, 4, 4) == expected
    assert normalize_onload_layer_map([(1, 2), 3, None, -1], 4, 4) == expected


MAP_ERRORS = {
    "wrong_length": ((1, 2, 3), r"has 3 entries, expected one per layer \(num_layers=4\)"),
    "loads_layer_0": ({0: 0, 1: 2, 2: 3}, r"loads 0: expected a layer in \[1, 4\)"),
    "out_of_range": ({0: 1, 1: 2, 2: 4}, r"loads 4: expected a layer in \[1, 4\)"),
    "not_ahead": ({0: 1, 2: 2, 1: 3}, r"loads layer 2: a load must be issued before"),
    "twice": ({0: (1, 2), 1: 2, 2: 3}, r"loads layer 2 twice \(at layers 0 and 1\)"),
    "missing": ({0: 1, 1: 2}, r"never loads layers \[3\]"),
    "too_far": ({0: (1, 2, 3)}, r"loads layer 3: with num_buffers=3 .* distance <= 2"),
    "bad_key": ({7: 1}, r"key 7 must be a layer in \[0, 4\)"),
    "bad_type": ("0123", r"must be a dict"),
}


@pytest.mark.parametrize("name", list(MAP_ERRORS))
def test_invalid_maps(name):
    onload_layer_map, message = MAP_ERRORS[name]
    with pytest.raises(ValueError, match=message):
        simulate_prefill_pipeline(
            [1.0] * 4, [1.0] * 4, [1.0] * 4, onload_layer_map=onload_layer_map, num_buffers=3
        )


def test_invalid_buffers_and_times():
    schedule = default_onload_layer_map(4, 1, 2)
    with pytest.raises(ValueError, match=r"num_buffers=1 must be an int >= 2 for num_layers=4"):
        simulate_prefill_pipeline([1.0] * 4, [1.0] * 4, [1.0] * 4,
                                  onload_layer_map=schedule, num_buffers=1)
    with pytest.raises(ValueError, match=r"num_buffers=1 must be an int >= 2"):
        default_onload_layer_map(4, 1, 1)
    with pytest.raises(ValueError, match=r"distance must be an int >= 1, got 0"):
        default_onload_layer_map(4, 0, 4)
    with pytest.raises(ValueError, match=r"load_times has 3 entries, expected one per layer \(4\)"):
        simulate_prefill_pipeline([1.0] * 3, [1.0] * 4, [1.0] * 4,
                                  onload_layer_map=schedule, num_buffers=2)
    with pytest.raises(ValueError, match=r"writeback_times must be finite and >= 0"):
        simulate_prefill_pipeline([1.0] * 4, [1.0] * 4, [1.0, -1.0, 1.0, 1.0],
                                  onload_layer_map=schedule, num_buffers=2)


# Work, traffic and hardware -------------------------------------------------------------------


def test_layer_prefill_flops_by_hand():
    tiny = get_config("tiny")
    # tiny: E=64, H=4, n_q=32, D=32, R=8, d_n=16, d_v=16, F=128, K=16, I=4, N=16.
    # per token: 64*32 + 32*4*24 + 64*40 + 4*16*32 + 4*32*16 + 4*16*64 + 3*64*128
    #          = 2048 + 3072 + 2560 + 2048 + 2048 + 4096 + 24576 = 40448 MACs
    # context 20, chunk 4: positions 16..19 attend min(16, p + 1) = 16 tokens each: 64;
    # attention 4 * (2*32 + 8) * 64 = 18432 MACs; total 4 * 40448 + 18432 = 180224 MACs.
    assert layer_prefill_flops(tiny, 20, 4) == 2 * 180_224
    # indexer: per token 32*4*16 + 64*16 + 64*4 = 3328 (x4 = 13312); scores 4 * 17 * (17 + 18 +
    # 19 + 20) = 5032; 180224 + 13312 + 5032 = 198568 MACs.
    assert layer_prefill_flops(tiny, 20, 4, with_indexer=True) == 2 * 198_568
    # Short context: positions 0..3 attend 1 + 2 + 3 + 4 = 10 tokens: 4 * 40448 + 4 * 72 * 10.
    assert layer_prefill_flops(tiny, 4, 4) == 2 * (161_792 + 2_880)
    with pytest.raises(ValueError, match=r"chunk=5 must be <= context=4"):
        layer_prefill_flops(tiny, 4, 5)
    # An MoE layer of 8 experts of width 16, top-2 plus one shared expert: the MLP's 3*64*128
    # becomes the router 64*8 + 3*64*16*(2 + 1) = 512 + 9216: per token 40448 - 24576 + 9728
    # = 25600; 4 * 25600 + 18432 = 120832 MACs.
    moe = tiny.replace(n_routed_experts=8, num_experts_per_tok=2, moe_hidden=16,
                       n_shared_experts=1, first_k_dense_replace=1)
    assert layer_prefill_flops(moe, 20, 4, moe=True) == 2 * 120_832
    assert layer_prefill_flops(moe, 20, 4) == 2 * 180_224  # its dense layer
    with pytest.raises(ValueError, match=r"moe=True but config 'tiny' has no experts"):
        layer_prefill_flops(tiny, 20, 4, moe=True)


def test_layer_transfer_bytes_and_times():
    glm52 = get_config("glm52")
    # 1,000 history rows and 10 new rows of 576 bf16 values (1,152 B).
    assert layer_transfer_bytes(glm52, 1_000, 10) == (1_152_000, 11_520)
    profile = HARDWARE_PROFILES["h200"]
    assert profile.h2d_bytes_per_s == 55e9 and profile.flops_per_s == 790e12
    assert not profile.shared_copy_engine
    assert HARDWARE_PROFILES["h200_shared_copy"].shared_copy_engine
    load, compute, writeback = chunk_layer_times(glm52, 131_072, 4_096, profile)
    assert load.shape == compute.shape == writeback.shape == (78,)
    assert load[0] == 0.0
    assert load[1] == pytest.approx(126_976 * 1_152 / 55e9)  # 2.66 ms
    assert writeback[5] == pytest.approx(4_096 * 1_152 / 55e9)
    assert compute[0] > compute[1]  # layer 0 starts an indexer group, layer 1 does not
    result = simulate_prefill_chunk(glm52, 131_072, 4_096, profile)
    assert result.total_time >= result.no_offload_time

"""Hot-cache management on hand-built cases: lookup, union of misses, victims, map updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import replay
from fo_jax.offload.manage import _clock_victims, manage_group, union_misses


def test_union_of_misses_by_hand():
    # Way 0 selects [2, 5, 9], way 1 selects [5, 7, pad]; tokens 5, 7 and 9 miss (2 hits).
    tokens = jnp.array([[[2, 5, 9], [5, 7, -1]]])
    miss = jnp.array([[[False, True, True], [True, True, False]]])
    unique, count = union_misses(tokens, miss)
    np.testing.assert_array_equal(unique, [[5, 7, 9, -1, -1, -1]])  # 5 once, ascending
    np.testing.assert_array_equal(count, [3])


def _state(c=6, s=20, resident=(3, 4, 10, 11, 12, 13), policy="ring"):
    """One group, one request: slot i holds token resident[i]."""
    t2s = np.full((1, 1, s), -1, np.int32)
    s2t = np.full((1, 1, c), -1, np.int32)
    for slot, tok in enumerate(resident):
        t2s[0, 0, tok], s2t[0, 0, slot] = slot, tok
    last = np.zeros((1, 1, c if policy == "lru" else 0), np.int32)
    if policy == "lru":
        last[0, 0] = [5, 1, 4, 3, 2, 6][:c]  # slot 1 is the least recently used
    ref = jnp.zeros((1, 1, c if policy == "clock" else 0), jnp.int8)
    policy_state = (jnp.full((1, 1, c), -1, jnp.int32), jnp.zeros((1, 1), jnp.int32),
                    jnp.asarray(last), ref, jax.random.key_data(jax.random.key(0)))
    return (jnp.asarray(t2s), jnp.asarray(s2t)), policy_state


@pytest.mark.parametrize("policy", ["ring", "lru", "random", "clock"])
def test_victims_are_never_selected_slots_and_maps_stay_inverse(policy):
    slots, policy_state = _state(policy=policy)
    # W = 2, K = 3: hits 3 (slot 0), 10 (slot 2), 12 (slot 4); misses 1, 7; 16 in the tail.
    tokens = jnp.array([[[1, 3, 10], [7, 12, 16]]])
    mask = tokens >= 0
    plan, stats, (t2s, s2t), _ = manage_group(
        tokens, mask, slots, policy_state, 0, jnp.array([16]), jnp.int32(7), policy=policy,
        hot_slots=6, page_size=4)
    np.testing.assert_array_equal(stats.hits, [[2, 1]])
    np.testing.assert_array_equal(stats.tail_hits, [[0, 1]])
    np.testing.assert_array_equal(stats.misses, [[1, 1]])
    np.testing.assert_array_equal(plan.miss_tokens[0, :2], [1, 7])
    victims = np.asarray(plan.victims[0, :2])
    assert not set(victims) & {0, 2, 4}, f"{policy} evicted a selected slot: {victims}"
    assert len(set(victims)) == 2
    t2s, s2t = np.asarray(t2s)[0, 0], np.asarray(s2t)[0, 0]
    assert t2s[1] == victims[0] and t2s[7] == victims[1]
    for slot, tok in enumerate(s2t):
        assert tok < 0 or t2s[tok] == slot
    assert (t2s >= 0).sum() == 6  # one eviction per miss: the cache keeps its size
    # Read rows: hits from their slots, misses from their victims, the tail token from the
    # tail block (C + (16 // 4 % 2) * 4 + 16 % 4 = 6 + 0 + 0).
    np.testing.assert_array_equal(plan.read_row[0], [[victims[0], 0, 2],
                                                     [victims[1], 4, 6]])
    if policy in ("ring", "clock"):  # from slot 0 (bits clear): 1 and 3 are the first free
        np.testing.assert_array_equal(victims, [1, 3])
    if policy == "lru":  # unprotected slots 1, 3, 5 last used at 1, 3, 6: the oldest two
        np.testing.assert_array_equal(victims, [1, 3])


@pytest.mark.parametrize("c,size", [(8, 8), (13, 4)])
def test_clock_sweep_is_the_replay_simulators(c, size):
    # 256 random caches at once: hand, reference bits (sparse to all set, so some sweeps go
    # round twice), protected slots (up to size - misses of them) and misses; chunks of `size`
    # that do and do not divide C. The chunked while loop must agree with replay's two passes.
    rng = np.random.default_rng(c)
    batch, step = 256, 7
    density = rng.choice([0.0, 0.3, 0.9, 1.0], batch)
    ref = rng.random((batch, c)) < density[:, None]
    num_miss = rng.integers(0, size + 1, batch).astype(np.int32)
    protected = np.zeros((batch, c), bool)
    for b in range(batch):
        count = rng.integers(0, size - num_miss[b] + 1)
        protected[b, rng.choice(c, count, replace=False)] = True
    hand = rng.integers(0, c, batch).astype(np.int32)
    stamp = np.where(protected, step, step - 1).astype(np.int32)[None]
    victims, new_hand, new_ref, new_stamp = jax.jit(
        _clock_victims, static_argnames=("g", "size"))(
        jnp.asarray(hand), jnp.asarray(ref[None].astype(np.int8)), jnp.asarray(stamp), g=0,
        step=jnp.int32(step), num_miss=jnp.asarray(num_miss), size=size)
    want_victims, want_hand, want_ref = replay._clock_victims(hand, ref, protected, num_miss,
                                                              size)
    np.testing.assert_array_equal(victims, want_victims)
    np.testing.assert_array_equal(new_hand, want_hand)
    np.testing.assert_array_equal(np.asarray(new_ref[0]) != 0, want_ref)
    # Victims (and only they) are stamped with the step: the second round skips them.
    taken = np.zeros((batch, c + 1), bool)
    taken[np.arange(batch)[:, None], np.where(want_victims >= 0, want_victims, c)] = True
    np.testing.assert_array_equal(np.asarray(new_stamp[0]) == step, protected | taken[:, :c])
    # The cases cover bits cleared in passing and sweeps that go round into the second round.
    assert np.any(want_ref.sum(-1) < ref.sum(-1))
    assert np.any(num_miss > (~protected & ~ref).sum(-1))

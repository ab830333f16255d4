"""Hot-cache management of one indexer group for one decode step (the logic LIM fuses).

Given each way's selection (the resident path's own `select_topk`, canonical order), the step:

  1. looks every selected token up in `token_to_slot`: hit (slot >= 0), tail (position in the
     current tail blocks) or miss;                                              O(W K)
  2. unites the W ways' misses: sorted, deduplicated, padded to M = W K;       O(W K log W K)
  3. protects the slots of this step's hits (stamps them with the step number);  O(W K)
  4. asks the eviction policy for as many victims as misses, among unprotected slots;
     ring / random: O(W K); lru: O(C) (the baseline, on purpose); clock: O(W K + misses)
     amortised, O(C) worst case (`_clock_victims`);
  5. pairs miss i with victim i and updates both maps;                          O(M)
  6. returns where every selected token is read from after the update (a row of the layer's
     device rows: a hot slot or a tail position) and the copy plan (host token -> slot).

Nothing here touches O(C) or O(S) elements, except the lru policy (and a clock sweep that
goes round the cache, see `_clock_victims`): scatters and gathers into
`token_to_slot` [S] and `slot_to_token` [C] touch only the indexed entries, and every read of
an array is ordered before the scatters into it, so XLA updates the maps and the policy state
in place (no whole-array copy: tests/offload/test_decode_hlo.py checks the compiled step).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fo_jax.typing import Array, Bool, Int

BIG = jnp.iinfo(jnp.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """The result of managing one group for one step; replayed by every layer of the group.

    Attributes:
      read_row: [B, W, K] int32: row of the layer's device rows [C + 2Z] holding each selected
        token after the misses are installed (0 where mask is False).
      mask: [B, W, K] bool: the entry is a selected token.
      miss_tokens: [B, M] int32: the union of the ways' misses, ascending, -1 padding.
      victims: [B, M] int32: the slot each miss is copied into, -1 padding.
      num_miss: [B] int32: misses (the copy count).
    """

    read_row: jax.Array
    mask: jax.Array
    miss_tokens: jax.Array
    victims: jax.Array
    num_miss: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupStats:
    """Per-step counters of one group.

    Attributes:
      hits: [B, W] selected tokens found in the hot cache.
      tail_hits: [B, W] selected tokens served from the tail blocks.
      misses: [B, W] selected tokens read from host memory.
      union: [B] distinct misses over the W ways (rows copied per layer).
    """

    hits: jax.Array
    tail_hits: jax.Array
    misses: jax.Array
    union: jax.Array


def lookup(tokens, mask, token_to_slot, g, tail_start, *, hot_slots: int, page_size: int,
           slots=None):
    """Classify each selected token.

    Args:
      tokens, mask: [B, W, K] the selection; token_to_slot: [G, B, S]; g: the group;
      tail_start: [B]; slots: [B, W, K] the slots a fused selection (LIM) already looked up
        (-1 = not resident), or None to look them up here.
    Returns:
      slot [B, W, K] (-1 unless a hit), hit, tail, miss [B, W, K] bool, tail_row [B, W, K].
    Touches W K entries of token_to_slot.
    """
    rows = jnp.arange(tokens.shape[0])[:, None, None]
    safe = jnp.where(mask, tokens, 0)
    found = token_to_slot[g, rows, safe] if slots is None else slots
    slot = jnp.where(mask, found, -1)
    tail = mask & (safe >= tail_start[:, None, None])
    hit = mask & ~tail & (slot >= 0)
    miss = mask & ~tail & (slot < 0)
    tail_row = hot_slots + ((safe // page_size) % 2) * page_size + safe % page_size
    return slot, hit, tail, miss, tail_row


def union_misses(tokens: Int[Array, "B W K"],
                 miss: Bool[Array, "B W K"]) -> tuple[Int[Array, "B M"], Int[Array, "B"]]:
    """The W ways' misses united: ([B, M] ascending tokens, -1 padding; [B] count), M = W K.

    One sort of W K values per request, then a scatter that compacts the first of each run.
    """
    batch, size = tokens.shape[0], tokens.shape[1] * tokens.shape[2]
    ordered = jnp.sort(jnp.where(miss, tokens, BIG).reshape(batch, size), axis=-1)
    previous = jnp.concatenate([jnp.full((batch, 1), -1, ordered.dtype), ordered[:, :-1]], 1)
    first = (ordered != previous) & (ordered != BIG)
    rank = jnp.cumsum(first, axis=-1) - 1
    rows = jnp.arange(batch)[:, None]
    unique = jnp.full((batch, size), -1, jnp.int32).at[
        rows, jnp.where(first, rank, size)].set(ordered, mode="drop")
    return unique, jnp.sum(first, axis=-1).astype(jnp.int32)


# Eviction policies ------------------------------------------------------------------------
#
# choose(policy fields of one group, stamp, step, num_miss, M) -> (victims [B, M], new fields)
# A victim is never a slot stamped with the current step (a slot some way selected).


def _window_victims(start, stamp, g, step, num_miss, size: int, hot_slots: int):
    """The first num_miss unprotected slots of the ring window start, start + 1, ... (mod C).

    A window of W K slots always holds enough: the protected slots are this step's distinct
    hits, at most W K - num_miss of them. Touches W K slots.
    """
    batch = start.shape[0]
    window = (start[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]) % hot_slots
    rows = jnp.arange(batch)[:, None]
    free = stamp[g, rows, window] != step
    rank = jnp.cumsum(free, axis=-1) - 1
    take = free & (rank < num_miss[:, None])
    victims = jnp.full((batch, size), -1, jnp.int32)
    victims = victims.at[rows, jnp.where(take, rank, size)].set(window, mode="drop")
    # The pointer moves past the last slot taken.
    last = jnp.max(jnp.where(take, jnp.arange(size)[None, :], -1), axis=-1)
    new_start = jnp.where(num_miss > 0, (start + last + 1) % hot_slots, start)
    return victims, new_start.astype(jnp.int32)


def _clock_victims(hand, ref, stamp, g, step, num_miss, size: int):
    """CLOCK (second chance): sweep the slots from the hand; an unprotected slot whose
    reference bit is set has it cleared and is passed, one whose bit is clear is a victim;
    protected slots are passed without clearing. Victims are taken in sweep order (miss i ->
    the i-th); the hand stops just past the last victim. When a request's sweep has gone once
    round without enough victims, every unprotected bit is clear and the second round takes
    them. The same algorithm as fo_jax.replay's clock (its `_clock_victims`, vectorised over C).

    A `lax.while_loop` over chunks of M = W K slots of the circular order from the hand, all
    requests at once (a request that has its victims stops moving): each chunk gathers M bits
    and stamps, takes the unprotected clear slots it still needs, clears the bits of the
    unprotected set slots it passed, and stamps its victims (so the second round skips them).
    Cost: a request's sweep passes its victims, protected slots (at most twice: at most
    W K + misses passes) and the set bits it clears. Bits start clear, a step sets at most
    W K of them (its hits and installs) and each setting is cleared at most once, so over T
    steps a request's sweeps total O(T W K) slots: amortised O(W K + misses) per step,
    independent of C. A step runs ceil(longest sweep of the batch / M) chunks of O(B M) work.
    Worst case, one step: a sweep of up to 2 C slots (every unprotected bit set: one round
    clears them, the second takes the victims), ceil(2 C / M) chunks, O(B C). Touches only
    the gathered / scattered entries of `ref` and `stamp` (updated in place).
    Returns (victims [B, M], hand [B], ref, stamp).
    """
    batch = hand.shape[0]
    hot_slots = stamp.shape[-1]
    rows = jnp.arange(batch)[:, None]
    offsets = jnp.arange(size, dtype=jnp.int32)[None, :]
    # A sweep never passes more than 2 C slots (2 rounds); the bound only guards a broken state.
    max_chunks = -(-2 * hot_slots // size) + 1

    def cond(carry):
        chunk, _, got, *_ = carry
        return (chunk < max_chunks) & jnp.any(got < num_miss)

    def body(carry):
        chunk, hand, got, victims, ref, stamp = carry
        need = num_miss - got  # [B]; <= 0: this request is done
        window = (hand[:, None] + offsets) % hot_slots  # M distinct slots (M <= C)
        free = stamp[g, rows, window] != step
        bit = ref[g, rows, window] != 0
        # Order the gathers before the scatters below (else XLA copies ref / stamp).
        free, bit, ref, stamp = jax.lax.optimization_barrier((free, bit, ref, stamp))
        candidate = free & ~bit
        rank = jnp.cumsum(candidate, axis=-1)  # 1-based among this chunk's candidates
        take = candidate & (rank <= need[:, None])
        taken = jnp.sum(take, axis=-1, dtype=jnp.int32)
        last = jnp.max(jnp.where(take, offsets, -1), axis=-1)
        moving = need > 0
        done = got + taken >= num_miss
        # Slots before the hand's stop are passed: their unprotected set bits are cleared.
        stop = jnp.where(done, last + 1, size)
        clear = free & bit & (offsets < stop[:, None]) & moving[:, None]
        ref = ref.at[g, rows, jnp.where(clear, window, hot_slots)].set(0, mode="drop")
        stamp = stamp.at[g, rows, jnp.where(take, window, hot_slots)].set(step, mode="drop")
        victims = victims.at[rows, jnp.where(take, got[:, None] + rank - 1, size)].set(
            window, mode="drop")
        hand = jnp.where(moving, (hand + stop) % hot_slots, hand).astype(jnp.int32)
        return chunk + 1, hand, got + taken, victims, ref, stamp

    victims = jnp.full((batch, size), -1, jnp.int32)
    carry = (jnp.int32(0), hand, jnp.zeros((batch,), jnp.int32), victims, ref, stamp)
    _, hand, _, victims, ref, stamp = jax.lax.while_loop(cond, body, carry)
    return victims, hand, ref, stamp


def choose_victims(policy: str, hand, last_used, ref, key, stamp, g, step, num_miss,
                   size: int):
    """Victim slots for `num_miss` misses per request: ([B, M] slots, -1 padding, new state).

    Args:
      hand: [B] the group's ring / clock pointer; last_used: [G, B, C] (lru); ref: [G, B, C]
      int8 reference bits (clock); key: [2] uint32 (random); stamp: [G, B, C] step stamps
      (protected slots carry `step`); g: the group; num_miss: [B]; size: M.
    Returns (victims, hand [B], last_used, ref, key, stamp); clock stamps its victims.
    """
    hot_slots = stamp.shape[-1]
    if policy == "ring":
        victims, hand = _window_victims(hand, stamp, g, step, num_miss, size, hot_slots)
        return victims, hand, last_used, ref, key, stamp
    if policy == "random":
        key, sub = jax.random.split(jax.random.wrap_key_data(key))
        start = jax.random.randint(sub, hand.shape, 0, hot_slots, dtype=jnp.int32)
        victims, _ = _window_victims(start, stamp, g, step, num_miss, size, hot_slots)
        return victims, hand, last_used, ref, jax.random.key_data(key), stamp
    if policy == "clock":
        victims, hand, ref, stamp = _clock_victims(hand, ref, stamp, g, step, num_miss, size)
        return victims, hand, last_used, ref, key, stamp
    if policy == "lru":
        # Least recently used first; empty slots (-1) before any; protected slots never.
        # top_k over C: O(C) per step, like the HiSparse / ECHO baselines. float32 keys keep
        # top_k on its fast path (int32 falls back to a sort) and are exact below 2^24 steps.
        priority = jnp.where(stamp[g] == step, jnp.inf, last_used[g].astype(jnp.float32))
        _, order = jax.lax.top_k(-priority, size)  # ties: lower slot first
        take = jnp.arange(size)[None, :] < num_miss[:, None]
        victims = jnp.where(take, order, -1).astype(jnp.int32)
        # Order the read of last_used before the caller's scatters into it (else XLA copies
        # the whole [G, B, C] array to keep this read's input intact).
        victims, last_used = jax.lax.optimization_barrier((victims, last_used))
        return victims, hand, last_used, ref, key, stamp
    raise ValueError(f"unknown eviction policy {policy!r}")


def manage_group(tokens, mask, slots, policy_state, g: int, tail_start, step, *, policy: str,
                 hot_slots: int, page_size: int, looked_up=None):
    """One step of hot-cache management for group g (see the module docstring).

    Args:
      tokens, mask: [B, W, K] the group's selection (canonical order).
      slots: (token_to_slot [G, B, S], slot_to_token [G, B, C]).
      policy_state: (stamp [G, B, C], hand [G, B], last_used [G, B, C] (lru) or [G, B, 0],
        ref [G, B, C] int8 (clock) or [G, B, 0], key [2]).
      g: the group (static); tail_start: [B]; step: [].
      looked_up: [B, W, K] slots already found by a fused selection (LIM), or None.
    Returns:
      (plan: GroupPlan, stats: GroupStats, slots, policy_state), updated by scatters that touch
      only the indexed entries of the full arrays (no per-group slice is copied).
    """
    token_to_slot, slot_to_token = slots
    stamp, hands, last_used, ref, key = policy_state
    if slot_to_token.shape[-1] != hot_slots or stamp.shape[-1] != hot_slots:
        raise ValueError(f"{hot_slots=} but the maps hold {slot_to_token.shape[-1]} slots: the "
                         "state and the offload setting disagree")
    batch, ways, k = tokens.shape
    size = ways * k
    rows2 = jnp.arange(batch)[:, None]
    rows3 = rows2[:, :, None]
    slot, hit, tail, miss, tail_row = lookup(tokens, mask, token_to_slot, g, tail_start,
                                             hot_slots=hot_slots, page_size=page_size,
                                             slots=looked_up)
    miss_tokens, num_miss = union_misses(tokens, miss)
    # Protect this step's hits.
    stamp = stamp.at[g, rows3, jnp.where(hit, slot, hot_slots)].set(step, mode="drop")
    if policy == "clock":  # this step's hits are referenced
        ref = ref.at[g, rows3, jnp.where(hit, slot, hot_slots)].set(1, mode="drop")
    victims, hand, last_used, ref, key, stamp = choose_victims(
        policy, hands[g], last_used, ref, key, stamp, g, step, num_miss, size)
    hands = hands.at[g].set(hand)
    valid = victims >= 0
    # Evict: the victims' old tokens leave the hot cache.
    old = jnp.where(valid, slot_to_token[g, rows2, jnp.maximum(victims, 0)], -1)
    # The install scatter below does not depend on this gather, so XLA could run it first and
    # would then copy the whole [G, B, C] map to keep the gather's input intact. The barrier
    # orders the gather first: the scatter updates the map in place (tests/test_hlo_checks.py).
    old, slot_to_token = jax.lax.optimization_barrier((old, slot_to_token))
    capacity = token_to_slot.shape[-1]
    token_to_slot = token_to_slot.at[g, rows2, jnp.where(old >= 0, old, capacity)].set(
        -1, mode="drop")
    # Install: miss i -> victim i.
    token_to_slot = token_to_slot.at[g, rows2, jnp.where(valid, miss_tokens, capacity)].set(
        victims, mode="drop")
    slot_to_token = slot_to_token.at[g, rows2, jnp.where(valid, victims, hot_slots)].set(
        miss_tokens, mode="drop")
    stamp = stamp.at[g, rows2, jnp.where(valid, victims, hot_slots)].set(step, mode="drop")
    if policy == "lru":
        last_used = last_used.at[g, rows3, jnp.where(hit, slot, hot_slots)].set(
            step, mode="drop")
        last_used = last_used.at[g, rows2, jnp.where(valid, victims, hot_slots)].set(
            step, mode="drop")
    if policy == "clock":  # installed tokens are referenced
        ref = ref.at[g, rows2, jnp.where(valid, victims, hot_slots)].set(1, mode="drop")
    # Where each selected token is read from after the install.
    miss_slot = token_to_slot[g, rows3, jnp.where(miss, tokens, 0)]
    read_row = jnp.where(hit, slot, jnp.where(tail, tail_row, jnp.where(miss, miss_slot, 0)))
    plan = GroupPlan(read_row=read_row.astype(jnp.int32), mask=mask, miss_tokens=miss_tokens,
                     victims=victims, num_miss=num_miss)
    count = lambda x: jnp.sum(x, axis=-1).astype(jnp.int32)
    stats = GroupStats(hits=count(hit), tail_hits=count(tail), misses=count(miss), union=num_miss)
    return plan, stats, (token_to_slot, slot_to_token), (stamp, hands, last_used, ref, key)

"""Replay a top-k trace (fo_jax.traces) through a hot cache under an eviction policy, in numpy.

The rules are fo_jax's own (fo_jax/offload/manage.py and `initial_layout`), per indexer group
and request, one step after the other:

  * handoff: hot slots 0, 1, ... hold the min(C, tail_start) tokens just before the tail, in
    token order; the rest are empty;
  * tail: a selected token at position >= tail_start = (length // Z) * Z is served from the tail
    blocks (a tail hit), never from or into the hot cache;
  * a selected token with a hot slot is a hit, any other a miss; the W ways' misses are united
    (ascending, duplicates once): the union is what is copied;
  * protection: a slot some way hit this step is never a victim in this step;
  * miss i of the ascending union goes into victim i; the victim's old token leaves the cache.

Policies (victims among the unprotected slots):
  ring      fo_jax's default: the first free slots of a window of W K slots from the hand;
            the hand moves past the last victim (exact)
  random    fo_jax's random: the same window from a random start per step, group and request,
            drawn with jax.random from the same key sequence (exact)
  lru       fo_jax's lru: least recent step of use first, empty slots first, ties lower slot
            first (exact)
  clock     fo_jax's clock: reference bits set on use and install; the hand clears set bits as
            it passes (second chance); protected slots are skipped without clearing; the hand
            stops past the last victim; O(k W) amortised in fo_jax (exact)
  hisparse  a per-request LRU list (HiSparse's buffer): a step's hits move to the recent end in
            their selection order, then its misses in ascending order; the oldest goes first
  score-last, score-mean, score-ema, score-max
            evict the lowest aggregate indexer score (a token's score at a step: the max over
            the ways): the last seen, the mean of the last `window` seen, an EMA (`ema`), the
            max since install. Seen: at every step with `all_scores` in the trace, else only
            when selected; a token never seen (cold: the handoff's tokens) goes first
  belady    Belady's MIN: the resident token whose next (non-tail) use is farthest in the
            future goes first (never used again: first of all): offline optimal under the same
            rules (every miss is installed, protected slots stay)

Empty slots (a cache not yet full at the handoff): lru, hisparse, score and belady take them
first; ring and clock start at the first empty slot, random wherever its window falls. The
copies counted are rows, not pages: fo_jax copies every missed row by itself. The loop runs
over steps; each step is vectorised over the G B (group, request) caches: O(G B (W K log W K))
per step for the rules, plus O(G B C) for lru, hisparse, clock, score and belady victims.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fo_jax.traces import Trace

POLICIES = ("ring", "random", "lru", "clock", "hisparse", "score-last", "score-mean",
            "score-ema", "score-max", "belady")
SCORE_POLICIES = tuple(p for p in POLICIES if p.startswith("score-"))
BIG = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class ReplayStats:
    """What a replay did, as DecodeStats gives it, for every step.

    Attributes:
      hits, tail_hits, misses: [T, G, B, W] int32 per step, group, request and way.
      union: [T, G, B] int32 distinct misses (rows copied per layer of the group).
      prefetch_covered, prefetch_wasted: [T, G, B] int32 (ECHO's lossless prefetch, with
        `prefetch=True`): misses whose copy an EMA prediction of the k-th score would have
        started before the exact top-k, and copies started for tokens no way selected.
    """

    hits: np.ndarray
    tail_hits: np.ndarray
    misses: np.ndarray
    union: np.ndarray
    prefetch_covered: np.ndarray | None = None
    prefetch_wasted: np.ndarray | None = None


def initial_slots(lengths: np.ndarray, hot_slots: int, page_size: int) -> np.ndarray:
    """[B, C] the token of every hot slot at the handoff, -1 empty (as `initial_layout`)."""
    tail_start = (lengths // page_size) * page_size
    count = np.minimum(tail_start, hot_slots)
    ids = np.arange(hot_slots)
    return np.where(ids[None, :] < count[:, None], (tail_start - count)[:, None] + ids[None, :],
                    -1).astype(np.int32)


def union_misses(tokens: np.ndarray, miss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, W, K] -> ([N, M] ascending distinct missed tokens, -1 padding; [N] counts)."""
    n, size = tokens.shape[0], tokens.shape[1] * tokens.shape[2]
    ordered = np.sort(np.where(miss, tokens, BIG).reshape(n, size), axis=-1)
    previous = np.concatenate([np.full((n, 1), -1, ordered.dtype), ordered[:, :-1]], 1)
    first = (ordered != previous) & (ordered != BIG)
    rank = np.cumsum(first, axis=-1) - 1
    out = np.full((n, size + 1), -1, np.int32)
    out[np.arange(n)[:, None], np.where(first, rank, size)] = ordered
    return out[:, :size], first.sum(-1).astype(np.int32)


def random_starts(seed: int, calls: int, batch: int, hot_slots: int) -> np.ndarray:
    """[calls, B] the window starts fo_jax's random policy draws, one call per step and group.

    The same key sequence as `choose_victims`: key(seed), then per call `key, sub = split(key)`
    and randint(sub, [B], 0, C). Needs jax (one small scan).
    """
    import jax
    import jax.numpy as jnp

    def body(key, _):
        key, sub = jax.random.split(jax.random.wrap_key_data(key))
        start = jax.random.randint(sub, (batch,), 0, hot_slots, dtype=jnp.int32)
        return jax.random.key_data(key), start

    key = jax.random.key_data(jax.random.key(seed))
    _, starts = jax.lax.scan(body, key, None, length=calls)
    return np.asarray(starts)


def _window_victims(start, protected, num_miss, size: int):
    """fo_jax's ring window: the first num_miss unprotected slots from `start` (mod C)."""
    n, c = protected.shape
    rows = np.arange(n)[:, None]
    window = (start[:, None] + np.arange(size)[None, :]) % c
    free = ~protected[rows, window]
    rank = np.cumsum(free, axis=-1) - 1
    take = free & (rank < num_miss[:, None])
    victims = np.full((n, size + 1), -1, np.int32)
    victims[rows, np.where(take, rank, size)] = window
    last = np.max(np.where(take, np.arange(size)[None, :], -1), axis=-1)
    new_start = np.where(num_miss > 0, (start + last + 1) % c, start)
    return victims[:, :size], new_start.astype(np.int32)


def _lowest(key, num_miss, size: int):
    """Victims: the num_miss slots of smallest key, ties lower slot first ([N, M], -1 pad)."""
    order = np.argsort(key, axis=-1, kind="stable")[:, :size]
    if order.shape[1] < size:
        order = np.pad(order, ((0, 0), (0, size - order.shape[1])))
    return np.where(np.arange(size)[None, :] < num_miss[:, None], order, -1).astype(np.int32)


def _clock_victims(hand, ref, protected, num_miss, size: int):
    """Second chance: sweep from the hand; a set bit is cleared and passed, a clear bit evicted.

    Vectorised as two passes over the circular order from the hand: pass 1 takes unprotected
    slots whose bit is clear; if they run out, the sweep has cleared every unprotected bit and
    pass 2 takes the unprotected slots whose bit was set. Returns (victims, hand, ref).
    """
    n, c = ref.shape
    rows = np.arange(n)[:, None]
    order = (hand[:, None] + np.arange(c)[None, :]) % c
    prot, bit = protected[rows, order], ref[rows, order]
    need = num_miss[:, None]
    e1 = ~prot & ~bit
    c1 = np.cumsum(e1, axis=-1)
    take1 = e1 & (c1 <= need)
    got1 = np.minimum(c1[:, -1:], need)
    e2 = ~prot & bit
    c2 = np.cumsum(e2, axis=-1)
    take2 = e2 & (c2 <= need - got1)
    victims = np.full((n, size + 1), -1, np.int32)
    victims[rows, np.where(take1, c1 - 1, size)] = order
    victims[rows, np.where(take2, got1 + c2 - 1, size)] = order
    pos = np.arange(c)[None, :]
    last1 = np.max(np.where(take1, pos, -1), axis=-1)
    last2 = np.max(np.where(take2, pos, -1), axis=-1)
    second = (need - got1)[:, 0] > 0
    stop = np.where(second, last2, last1)
    # Bits passed over are cleared: all unprotected ones when the sweep went round.
    cleared = e2 & (second[:, None] | (pos < last1[:, None]))
    ref = ref.copy()
    ref[rows, order] = bit & ~cleared
    hand = np.where(num_miss > 0, (hand + stop + 1) % c, hand).astype(np.int32)
    return victims[:, :size], hand, ref


def _next_uses(trace: Trace, tail_start, never: int):
    """For Belady: ([T, N, W, K] the next step > t using each selected token, [N, S] first use).

    A use is a selection outside the tail (a tail hit needs no slot).
    """
    t_steps, g, b, w, k = trace.selected.shape
    n, cap = g * b, trace.capacity
    nxt = np.full((n, cap + 1), never, np.int32)
    after = np.full((t_steps, n, w, k), never, np.int32)
    rows3 = np.arange(n)[:, None, None]
    for t in range(t_steps - 1, -1, -1):
        sel = trace.selected[t].reshape(n, w, k)
        use = (sel >= 0) & (sel < tail_start[t][:, None, None])
        safe = np.where(use, sel, cap)
        after[t] = np.where(use, nxt[rows3, safe], never)
        nxt[rows3, safe] = t
    return after, nxt[:, :cap]


def replay(trace: Trace, *, hot_slots: int, policy: str = "ring", seed: int = 0,
           window: int = 8, ema: float = 0.5, prefetch: bool = False,
           prefetch_alpha: float = 0.5) -> ReplayStats:
    """Replay `trace` with C = `hot_slots` slots per group and request under `policy`.

    seed: the random policy's OffloadConfig.seed. window, ema: the score-mean window (seen
    scores) and the score-ema weight of the newest score. prefetch: also count ECHO's lossless
    prefetch (needs `all_scores`): the k-th score of each way predicted by an EMA
    (`prefetch_alpha`) of the previous steps' k-th scores; every token scoring at least the
    prediction that is neither resident nor in the tail is copied before the exact top-k.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    t_steps, groups, batch, ways, k = trace.selected.shape
    size, c, z = ways * k, hot_slots, trace.page_size
    if c < size:
        raise ValueError(f"hot_slots={c} < top-k * ways = {k} * {ways} = {size}: one step's "
                         f"selections must fit the hot cache (fo_jax refuses it too); use "
                         f"hot_slots >= {size}")
    if policy in SCORE_POLICIES and trace.scores is None and trace.all_scores is None:
        raise ValueError(f"policy {policy!r} evicts by indexer score but the trace has no "
                         "scores: record it with `scores` (the selected tokens' scores) or "
                         "`all_scores`")
    if prefetch and trace.all_scores is None:
        raise ValueError("prefetch=True needs the score of every token (trace.all_scores): "
                         "ECHO's prefetch copies every token above the predicted k-th score")
    if not 0 < ema <= 1 or not 0 < prefetch_alpha <= 1 or window < 1:
        raise ValueError(f"{ema=} and {prefetch_alpha=} must be in (0, 1], {window=} >= 1")
    n, cap = groups * batch, trace.capacity
    rows, rows3 = np.arange(n)[:, None], np.arange(n)[:, None, None]
    lengths = np.tile(trace.lengths, (1, groups))  # [T, N], n = g * B + b
    tail_start = (lengths // z) * z

    slot_tok0 = np.tile(initial_slots(trace.lengths[0] if t_steps else
                                      np.zeros(batch, np.int32), c, z), (groups, 1))
    slot_to_token = np.full((n, c + 1), -1, np.int32)  # column C: sink of dropped writes
    slot_to_token[:, :c] = slot_tok0
    token_to_slot = np.full((n, cap + 1), -1, np.int32)  # column S: sink
    filled = slot_tok0 >= 0
    token_to_slot[np.nonzero(filled)[0], slot_tok0[filled]] = np.nonzero(filled)[1]
    stamp = np.full((n, c + 1), -1, np.int64)
    hand = (filled.sum(-1) % c).astype(np.int32)
    last_used = np.where(filled, 0.0, -1.0)
    last_used = np.concatenate([last_used, np.zeros((n, 1))], 1)
    ref = np.zeros((n, c + 1), bool)  # column C: sink
    if policy == "random":
        starts = random_starts(seed, t_steps * groups, batch, c).reshape(t_steps, n)
    if policy == "belady":
        never = t_steps + 1
        after, first_use = _next_uses(trace, tail_start, never)
        next_use = np.full((n, c + 1), -1.0)
        next_use[:, :c] = np.where(filled, first_use[rows, np.maximum(slot_tok0, 0)], -1)
    agg = np.full((n, c + 1), np.nan)  # score policies: aggregate score, NaN = never seen
    hist = np.full((n, c + 1, window), np.nan)
    seen = np.zeros((n, c + 1), np.int64)
    pred = None

    out = {name: np.zeros((t_steps, n, ways), np.int32) for name in
           ("hits", "tail_hits", "misses")}
    union = np.zeros((t_steps, n), np.int32)
    covered = np.zeros((t_steps, n), np.int32) if prefetch else None
    wasted = np.zeros((t_steps, n), np.int32) if prefetch else None
    for t in range(t_steps):
        step = t + 1
        sel = trace.selected[t].reshape(n, ways, k)
        mask = sel >= 0
        safe = np.where(mask, sel, 0)
        slot = np.where(mask, token_to_slot[rows3, safe], -1)
        tail = mask & (safe >= tail_start[t][:, None, None])
        hit = mask & ~tail & (slot >= 0)
        miss = mask & ~tail & (slot < 0)
        miss_tokens, num_miss = union_misses(sel, miss)
        hit_slot = np.where(hit, slot, c)
        if prefetch:
            covered[t], wasted[t], pred = _echo_prefetch(trace, t, pred, prefetch_alpha,
                                                         token_to_slot[:, :cap], tail_start[t],
                                                         miss_tokens, n)
        stamp[rows3, hit_slot] = step
        protected = stamp[:, :c] == step

        if policy in SCORE_POLICIES:
            cur = _step_scores(trace, t, n, ways, k, mask & ~tail, safe, slot_to_token[:, :c])
            observed = ~np.isnan(cur)
            _aggregate(policy, agg, hist, seen, observed, cur, ema, window, fresh=None)

        if policy == "ring":
            victims, hand = _window_victims(hand, protected, num_miss, size)
        elif policy == "random":
            victims, _ = _window_victims(starts[t], protected, num_miss, size)
        elif policy == "lru":
            victims = _lowest(np.where(protected, np.inf, last_used[:, :c]), num_miss, size)
        elif policy == "hisparse":
            victims = _lowest(np.where(protected, np.inf, last_used[:, :c]), num_miss, size)
        elif policy == "clock":
            ref[rows3, hit_slot] = True  # hits are referenced
            victims, hand, ref[:, :c] = _clock_victims(hand, ref[:, :c], protected, num_miss,
                                                        size)
        elif policy == "belady":
            key = np.where(slot_to_token[:, :c] < 0, -np.inf, -next_use[:, :c])
            victims = _lowest(np.where(protected, np.inf, key), num_miss, size)
        else:
            value = np.where(np.isnan(agg[:, :c]), -1e300, agg[:, :c])
            key = np.where(slot_to_token[:, :c] < 0, -np.inf, value)
            victims = _lowest(np.where(protected, np.inf, key), num_miss, size)

        valid = victims >= 0
        vslot = np.where(valid, victims, c)
        old = np.where(valid, slot_to_token[rows, vslot], -1)
        token_to_slot[rows, np.where(old >= 0, old, cap)] = -1
        token_to_slot[rows, np.where(valid, miss_tokens, cap)] = victims
        slot_to_token[rows, vslot] = miss_tokens
        stamp[rows, vslot] = step

        if policy == "lru":
            last_used[rows3, hit_slot] = step
            last_used[rows, vslot] = step
        elif policy == "hisparse":
            # One counter per use: hits in selection order, then the misses ascending.
            order = np.arange(size).reshape(1, ways, k)
            np.maximum.at(last_used, (np.broadcast_to(rows3, hit_slot.shape), hit_slot),
                          step * (2 * size + 1) + np.broadcast_to(order, hit_slot.shape))
            last_used[rows, vslot] = step * (2 * size + 1) + size + np.arange(size)[None, :]
        elif policy == "clock":
            ref[rows, vslot] = True
        elif policy == "belady":
            used = mask & ~tail
            now = token_to_slot[rows3, safe]
            next_use[rows3, np.where(used, now, c)] = after[t]
        elif policy in SCORE_POLICIES:
            # Installed tokens start afresh from this step's score.
            fresh = np.zeros((n, c + 1), bool)
            fresh[rows, vslot] = True
            fresh[:, c] = False
            cur = _step_scores(trace, t, n, ways, k, mask & ~tail, safe,
                               slot_to_token[:, :c])
            _aggregate(policy, agg, hist, seen, fresh[:, :c] & ~np.isnan(cur), cur, ema,
                       window, fresh=fresh[:, :c])

        for name, value in (("hits", hit), ("tail_hits", tail), ("misses", miss)):
            out[name][t] = value.sum(-1)
        union[t] = num_miss
    shape = (t_steps, groups, batch)
    return ReplayStats(
        hits=out["hits"].reshape(shape + (ways,)),
        tail_hits=out["tail_hits"].reshape(shape + (ways,)),
        misses=out["misses"].reshape(shape + (ways,)),
        union=union.reshape(shape),
        prefetch_covered=None if covered is None else covered.reshape(shape),
        prefetch_wasted=None if wasted is None else wasted.reshape(shape))


def _step_scores(trace: Trace, t, n, ways, k, used, safe, slot_tok):
    """[N, C] this step's score of each slot's token (max over ways), NaN where not seen."""
    c = slot_tok.shape[1]
    if trace.all_scores is not None:
        every = trace.all_scores[t].reshape(n, ways, -1).max(axis=1)  # [N, S]
        got = every[np.arange(n)[:, None], np.maximum(slot_tok, 0)]
        return np.where((slot_tok >= 0) & np.isfinite(got), got, np.nan)
    scores = trace.scores[t].reshape(n, ways, k).astype(np.float64)
    per_token = np.full((n, c + 1), -np.inf)
    # Map each selected token to its slot (if resident) through slot_tok's inverse.
    tok_slot = np.full((n, trace.capacity + 1), c, np.int64)
    filled = slot_tok >= 0
    tok_slot[np.nonzero(filled)[0], slot_tok[filled]] = np.nonzero(filled)[1]
    where = np.where(used, tok_slot[np.arange(n)[:, None, None], safe], c)
    np.maximum.at(per_token, (np.broadcast_to(np.arange(n)[:, None, None], where.shape), where),
                  np.where(used, scores, -np.inf))
    cur = per_token[:, :c]
    return np.where(np.isfinite(cur), cur, np.nan)


def _aggregate(policy, agg, hist, seen, observed, cur, ema, window, fresh):
    """Fold this step's seen scores into each slot's aggregate (in place)."""
    c = cur.shape[1]
    a, h, s = agg[:, :c], hist[:, :c], seen[:, :c]
    if fresh is not None:
        a[fresh] = np.nan
        h[fresh] = np.nan
        s[fresh] = 0
    first = observed & np.isnan(a)
    if policy == "score-last":
        a[observed] = cur[observed]
    elif policy == "score-ema":
        a[observed] = np.where(first, cur, ema * cur + (1 - ema) * a)[observed]
    elif policy == "score-max":
        a[observed] = np.where(first, cur, np.maximum(a, cur))[observed]
    else:  # score-mean over the last `window` seen scores
        idx = np.nonzero(observed)
        h[idx[0], idx[1], s[idx] % window] = cur[idx]
        s[idx] += 1
        a[observed] = np.nanmean(h[observed], axis=-1)


def _echo_prefetch(trace: Trace, t, pred, alpha, token_to_slot, tail_start, miss_tokens, n):
    """ECHO's prefetch at step t: (covered [N], wasted [N], the next prediction [N, W])."""
    every = trace.all_scores[t].reshape(n, trace.ways, -1)[..., :token_to_slot.shape[1]]
    sel = trace.selected[t].reshape(n, trace.ways, trace.topk)
    kth = np.min(np.where(sel >= 0, np.take_along_axis(every, np.maximum(sel, 0), -1), np.inf),
                 axis=-1)  # [N, W]
    covered = np.zeros(n, np.int32)
    wasted = np.zeros(n, np.int32)
    if pred is not None:
        cap = every.shape[-1]
        positions = np.arange(cap)[None, :]
        above = np.any(np.isfinite(every) & (every >= pred[:, :, None]), axis=1)  # [N, S]
        copy = above & (token_to_slot < 0) & (positions < tail_start[:, None])
        missed = np.zeros((n, cap + 1), bool)
        missed[np.arange(n)[:, None], np.where(miss_tokens >= 0, miss_tokens, cap)] = True
        covered = (copy & missed[:, :cap]).sum(-1).astype(np.int32)
        wasted = (copy & ~missed[:, :cap]).sum(-1).astype(np.int32)
    kth = np.where(np.isfinite(kth), kth, -np.inf)
    pred = kth if pred is None else alpha * kth + (1 - alpha) * pred
    return covered, wasted, pred


def summary(stats: ReplayStats, *, ways: int, layers: int = 78, row_bytes: int = 1152) -> dict:
    """Totals of a replay: hit rate, misses (union) per request per group per step, H2D bytes
    per generated token at `layers` layers of `row_bytes` rows (glm52: 78 layers of 576 bf16
    values; every layer of a group copies the group's union), and the mean union."""
    selected = int(stats.hits.sum() + stats.tail_hits.sum() + stats.misses.sum())
    served = int(stats.hits.sum() + stats.tail_hits.sum())
    mean_union = float(stats.union.mean()) if stats.union.size else 0.0
    row = {
        "hit_rate": served / max(selected, 1),
        "misses_per_request_group_step": mean_union,
        "way_misses_per_request_group_step": float(stats.misses.sum(-1).mean())
        if stats.misses.size else 0.0,
        "h2d_bytes_per_token": mean_union * layers * row_bytes / ways,
        "total_union": int(stats.union.sum()),
    }
    if stats.prefetch_covered is not None:
        total = max(int(stats.union.sum()), 1)
        row["prefetch_covered_fraction"] = int(stats.prefetch_covered.sum()) / total
        row["prefetch_wasted_per_request_group_step"] = float(stats.prefetch_wasted.mean())
    return row

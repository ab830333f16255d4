"""Synthetic top-k traces (fo_jax.traces format) with the access patterns attention is known for.

Each step draws an indexer score for every visible token of every (group, request, way) and
selects the exact top-k (ascending, as `select_topk`). The score is a workload's structure plus
Gaussian noise (`noise`), so the selections drift the way real ones do. Groups share the
structure and draw their own noise (shared indexers of one model see similar patterns).

    recency    score falls with the log of the distance to the query: a sliding window
    sinks      recency plus a few first tokens (attention sinks) always on top
    vertical   a fixed random `heavy` fraction of the tokens scores high at every step
               (vertical lines of the attention map; the synthetic keys of experiments/common.py)
    topics     the context is cut into `topic_len`-token segments; every `shift` steps the
               focus moves to another random segment, whose tokens score high
    uniform    noise only: every step an independent draw (no locality; the worst case)

Costs O(T G B W S) to generate (one score vector per way and step).
"""

from __future__ import annotations

import json

import numpy as np

from fo_jax.traces import Trace

KINDS = ("recency", "sinks", "vertical", "topics", "uniform")


def generate(kind: str, *, steps: int, context: int, topk: int, groups: int = 2, batch: int = 2,
             ways: int = 1, page_size: int = 16, seed: int = 0, noise: float = 1.0,
             heavy: float = 0.05, sinks: int = 4, topic_len: int = 256, shift: int = 16,
             keep_all_scores: bool = False) -> Trace:
    """A trace of `steps` decode steps after a prompt of `context` tokens per request.

    The trace carries the selected tokens' scores and each way's k-th score; with
    `keep_all_scores`, every token's score too ([T, G, B, W, S] floats: short contexts only).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown synthetic trace kind {kind!r}; choose one of {KINDS}")
    if min(steps, context, topk, groups, batch, ways, page_size) < 1:
        raise ValueError(f"{steps=}, {context=}, {topk=}, {groups=}, {batch=}, {ways=}, "
                         f"{page_size=} must all be >= 1")
    rng = np.random.default_rng(seed)
    cap = context + steps * ways
    positions = np.arange(cap)
    columns = rng.random((batch, cap)) < heavy  # vertical lines, per request
    focus = rng.integers(0, max(cap // topic_len, 1), (batch,))
    lengths = context + ways * np.arange(steps, dtype=np.int32)
    sel = np.full((steps, groups, batch, ways, topk), -1, np.int32)
    scores = np.full((steps, groups, batch, ways, topk), np.nan, np.float32)
    kth = np.full((steps, groups, batch, ways), np.nan, np.float32)
    every = np.full((steps, groups, batch, ways, cap), -np.inf, np.float32) \
        if keep_all_scores else None
    for t in range(steps):
        if kind == "topics" and t % shift == 0 and t:
            visible_topics = max((int(lengths[t]) + topic_len - 1) // topic_len, 1)
            focus = rng.integers(0, visible_topics, (batch,))
        for w in range(ways):
            query = int(lengths[t]) + w  # the way's own position
            visible = positions <= query
            distance = np.maximum(query - positions, 0) + 1
            base = np.zeros((batch, cap))
            if kind in ("recency", "sinks"):
                base = base - 2.0 * np.log(distance)[None, :]
            if kind == "sinks":
                base = base + np.where(positions < sinks, 50.0, 0.0)[None, :]
            if kind == "vertical":
                base = base + 4.0 * columns
            if kind == "topics":
                base = base + 4.0 * ((positions[None, :] // topic_len) == focus[:, None])
            s = base[None] + noise * rng.standard_normal((groups, batch, cap))
            s = np.where(visible[None, None, :], s, -np.inf).astype(np.float32)
            n_vis = min(query + 1, topk)
            top = np.argpartition(-s, n_vis - 1, axis=-1)[..., :n_vis]
            top.sort(axis=-1)
            sel[t, :, :, w, :n_vis] = top
            got = np.take_along_axis(s, top, axis=-1)
            scores[t, :, :, w, :n_vis] = got
            kth[t, :, :, w] = got.min(axis=-1)
            if every is not None:
                every[t, :, :, w] = s
    meta = {"source": "fo_jax.synthetic_traces.generate", "kind": kind, "noise": noise,
            "heavy": heavy, "sinks": sinks, "topic_len": topic_len, "shift": shift,
            "seed": seed}
    return Trace(selected=sel, lengths=np.repeat(lengths[:, None], batch, 1),
                 page_size=page_size, scores=scores, kth_score=kth, all_scores=every,
                 meta=json.dumps(meta))

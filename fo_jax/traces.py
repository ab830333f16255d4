"""Top-k selection traces: the format the eviction-policy simulator (fo_jax.replay) replays.

A trace is what a run of offloaded decode steps selected, per step t, indexer group g, request b
and way w, starting at the handoff from prefill to decode (the hot cache laid out by
`fo_jax.offload.state.initial_layout`). It is stored as one `.npz` file:

    selected    int32   [T, G, B, W, K]  the tokens each way selected: exactly
                                         `DecodeStats.selected` of step t (ascending, -1 padding)
    lengths     int32   [T, B]           tokens stored per request before step t (`state.lengths`);
                                         the tail blocks of step t start at (lengths // Z) * Z
    page_size   int32   []               Z, tokens per tail block (OffloadConfig.page_size)
    version     int32   []               FORMAT_VERSION
  optional:
    scores      float32 [T, G, B, W, K]  the indexer score of each selected token (NaN at -1)
    kth_score   float32 [T, G, B, W]     the k-th (smallest selected) score of each way
    all_scores  float32 [T, G, B, W, S]  the score of every token (-inf where not visible to the
                                         way); short contexts only: S floats per way and step
    ref_hits, ref_tail_hits, ref_misses  int32 [T, G, B, W]; ref_union int32 [T, G, B]:
                                         the recorded run's own DecodeStats, with
    ref_hot_slots, ref_seed  int32 [];  ref_policy  str []: the setting that produced them
    meta        str     []               free-form JSON (model, source, corpus, ...)

W (ways) and K (top-k) are the last two axes of `selected`. Steps are consecutive decode steps
numbered 1, 2, ... (DecodeState.step), so a policy's state carries over from one to the next.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

FORMAT_VERSION = 1
_REF = ("ref_hits", "ref_tail_hits", "ref_misses", "ref_union")


@dataclasses.dataclass(frozen=True)
class Trace:
    """One trace (see the module docstring for every field's shape and meaning)."""

    selected: np.ndarray
    lengths: np.ndarray
    page_size: int
    scores: np.ndarray | None = None
    kth_score: np.ndarray | None = None
    all_scores: np.ndarray | None = None
    ref_hits: np.ndarray | None = None
    ref_tail_hits: np.ndarray | None = None
    ref_misses: np.ndarray | None = None
    ref_union: np.ndarray | None = None
    ref_hot_slots: int | None = None
    ref_policy: str | None = None
    ref_seed: int | None = None
    meta: str = "{}"

    def __post_init__(self):
        validate(self)

    @property
    def steps(self) -> int:
        return self.selected.shape[0]

    @property
    def groups(self) -> int:
        return self.selected.shape[1]

    @property
    def batch(self) -> int:
        return self.selected.shape[2]

    @property
    def ways(self) -> int:
        return self.selected.shape[3]

    @property
    def topk(self) -> int:
        return self.selected.shape[4]

    @property
    def capacity(self) -> int:
        """S: positions a token id can take (the last step's lengths plus its ways)."""
        return int(self.lengths.max(initial=0)) + self.ways

    @property
    def has_reference(self) -> bool:
        return self.ref_union is not None

    def head(self, steps: int) -> "Trace":
        """The first `steps` steps (reference stats and scores cut alike)."""
        cut = {f.name: getattr(self, f.name)[:steps] for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), np.ndarray)}
        return dataclasses.replace(self, **cut)


def validate(trace: Trace) -> None:
    """Raise ValueError naming the first field that is not a well-formed trace."""
    sel, lengths = trace.selected, trace.lengths
    if not isinstance(sel, np.ndarray) or sel.ndim != 5 or sel.dtype != np.int32:
        raise ValueError(f"trace.selected must be an int32 array [T, G, B, W, K], got "
                         f"{getattr(sel, 'dtype', type(sel))} {np.shape(sel)}; store "
                         "DecodeStats.selected of every step, stacked")
    t, g, b, w, k = sel.shape
    if not isinstance(lengths, np.ndarray) or lengths.shape != (t, b) or \
            lengths.dtype != np.int32:
        raise ValueError(f"trace.lengths must be int32 [T, B] = [{t}, {b}] (the lengths before "
                         f"each step), got {getattr(lengths, 'dtype', type(lengths))} "
                         f"{np.shape(lengths)}")
    if not isinstance(trace.page_size, (int, np.integer)) or trace.page_size < 1:
        raise ValueError(f"trace.page_size must be a positive int (OffloadConfig.page_size), got "
                         f"{trace.page_size!r}")
    if t and (lengths.min() < 0 or np.any(np.diff(lengths, axis=0) < 0)):
        raise ValueError("trace.lengths must be >= 0 and never decrease from one step to the "
                         "next")
    # Way w of step t sees positions < lengths[t] + w + 1.
    visible = lengths[:, None, :, None, None] + np.arange(1, w + 1)[None, None, None, :, None]
    if np.any(sel < -1) or np.any(sel >= visible):
        bad = np.argwhere((sel < -1) | (sel >= visible))[0]
        raise ValueError(f"trace.selected[{', '.join(map(str, bad[:4]))}] holds token "
                         f"{sel[tuple(bad)]}, outside [-1, lengths + way]: token ids must be "
                         "positions the way could see (-1 for padding)")
    real = sel >= 0
    if np.any(real[..., 1:] & ~real[..., :-1]) or np.any(
            (np.diff(sel, axis=-1) <= 0) & real[..., 1:]):
        raise ValueError("trace.selected must be in canonical order: each way's tokens strictly "
                         "ascending, -1 padding last (as select_topk returns them)")
    for name, shape in (("scores", (t, g, b, w, k)), ("kth_score", (t, g, b, w))):
        value = getattr(trace, name)
        if value is not None and (value.shape != shape or value.dtype.kind != "f"):
            raise ValueError(f"trace.{name} must be float [{', '.join(map(str, shape))}], got "
                             f"{value.dtype} {value.shape}")
    if trace.all_scores is not None:
        a = trace.all_scores
        if a.ndim != 5 or a.shape[:4] != (t, g, b, w) or a.shape[4] < trace.capacity or \
                a.dtype.kind != "f":
            raise ValueError(f"trace.all_scores must be float [T, G, B, W, S] with "
                             f"[T, G, B, W] = {[t, g, b, w]} and S >= {trace.capacity}, got "
                             f"{a.dtype} {a.shape}")
    refs = [getattr(trace, n) is not None for n in _REF + ("ref_hot_slots", "ref_policy")]
    if any(refs) and not all(refs):
        raise ValueError("a trace's reference stats come together: ref_hits, ref_tail_hits, "
                         "ref_misses, ref_union, ref_hot_slots and ref_policy, or none of them")
    if all(refs):
        for name in _REF:
            want = (t, g, b) if name == "ref_union" else (t, g, b, w)
            if getattr(trace, name).shape != want:
                raise ValueError(f"trace.{name} must be [{', '.join(map(str, want))}], got "
                                 f"{getattr(trace, name).shape}")
    try:
        json.loads(trace.meta)
    except (TypeError, ValueError):
        raise ValueError(f"trace.meta must be a JSON string, got {trace.meta!r}") from None


def save(path, trace: Trace) -> None:
    """Write `trace` as a compressed .npz (None fields are left out)."""
    arrays = {"version": np.int32(FORMAT_VERSION)}
    for f in dataclasses.fields(trace):
        value = getattr(trace, f.name)
        if value is not None:
            arrays[f.name] = np.asarray(value)
    np.savez_compressed(path, **arrays)


def load(path) -> Trace:
    """Read a trace written by `save` (validated)."""
    with np.load(path, allow_pickle=False) as data:
        fields = dict(data.items())
    version = int(fields.pop("version", -1))
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: trace format version {version}, expected {FORMAT_VERSION} "
                         "(written by fo_jax.traces.save)")
    known = {f.name for f in dataclasses.fields(Trace)}
    unknown = set(fields) - known
    if unknown:
        raise ValueError(f"{path}: unknown trace fields {sorted(unknown)}; known: "
                         f"{sorted(known)}")
    for name in ("page_size", "ref_hot_slots", "ref_seed"):
        if name in fields:
            fields[name] = int(fields[name])
    for name in ("ref_policy", "meta"):
        if name in fields:
            fields[name] = str(fields[name])
    return Trace(**fields)


class TraceRecorder:
    """Collects a run's decode steps into a Trace: call `add` after every decode_step.

        recorder = TraceRecorder(offload)
        lengths = np.asarray(state.lengths)          # before the step
        _, state, stats = decode_step(params, state, tokens, config=..., offload=offload)
        recorder.add(lengths, stats)
        trace = recorder.trace(meta={"model": ...})

    Keeps the selections and the step's stats as the trace's reference (one host copy of
    [G, B, W, K] int32 per step). Scores, when the caller has them, go in `add`'s keywords.
    """

    def __init__(self, offload):
        self.offload = offload
        self.steps: list[dict] = []

    def add(self, lengths, stats, *, scores=None, kth_score=None, all_scores=None) -> None:
        step = {"lengths": np.array(lengths, np.int32),  # a copy: the state is donated
                "selected": np.asarray(stats.selected, np.int32)}
        for name in _REF:
            step[name] = np.asarray(getattr(stats, name[4:]), np.int32)
        for name, value in (("scores", scores), ("kth_score", kth_score),
                            ("all_scores", all_scores)):
            if value is not None:
                step[name] = np.asarray(value, np.float32)
        self.steps.append(step)

    def trace(self, meta: dict | None = None) -> Trace:
        if not self.steps:
            raise ValueError("TraceRecorder.trace: no steps recorded (call add after each "
                             "decode_step)")
        fields = {name: np.stack([s[name] for s in self.steps]) for name in self.steps[0]}
        oc = self.offload
        return Trace(page_size=oc.page_size, ref_hot_slots=oc.hot_slots, ref_policy=oc.policy,
                     ref_seed=oc.seed, meta=json.dumps(meta or {}), **fields)


def record_decode_trace(config, offload, *, lengths, steps: int, ways: int, seed: int = 0,
                        heavy: float = 0.1, boost: float = 4.0) -> Trace:
    """Run `steps` offloaded decode steps and record their selections and stats as a trace.

    The history is synthetic: random KV and indexer keys for `lengths` [B] prompt tokens of a
    random-weight model of `config`, a `heavy` fraction of the tokens given `boost` times longer
    indexer keys (a working set the indexer keeps selecting, as experiments/common.py does),
    random query tokens. The trace carries the run's DecodeStats as its reference (ref_*).
    Costs one compilation of the decode step plus `steps` steps.
    """
    import jax
    import jax.numpy as jnp

    from fo_jax.model.dsa import init_params
    from fo_jax.model.kv_format import store_kv_rows
    from fo_jax.offload import decode as offload_decode
    from fo_jax.offload.state import DecodeState

    lengths = np.asarray(lengths, np.int32)
    batch, cap = len(lengths), offload.capacity
    if int(lengths.max()) + steps * ways > cap:
        raise ValueError(f"lengths up to {int(lengths.max())} plus {steps} steps of {ways} ways "
                         f"exceed offload.capacity={cap}")
    keys = jax.random.split(jax.random.key(seed), 4)
    kv = store_kv_rows(jax.random.normal(keys[0], (config.num_layers, batch, cap,
                                                   config.kv_width), jnp.float32),
                       config=config)
    ik = jax.random.normal(keys[1], (config.num_groups, batch, cap, config.index_head_dim),
                           jnp.float32)
    favoured = jax.random.bernoulli(keys[2], heavy, (1, batch, cap, 1))
    ik = jnp.where(favoured, ik * boost, ik).astype(config.jnp_kv_dtype)
    state = DecodeState.from_resident(kv, ik, lengths, config=config, offload=offload)
    params = init_params(config, keys[3])
    rng = np.random.default_rng(seed)
    recorder = TraceRecorder(offload)
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (batch, ways), dtype=np.int32)
        before = np.array(state.lengths)  # a copy: decode_step donates the state
        _, state, stats = offload_decode.decode_step(params, state, tokens, config=config,
                                                     offload=offload, check=False)
        recorder.add(before, stats)
    return recorder.trace({"source": "fo_jax.traces.record_decode_trace", "model": config.name,
                           "heavy": heavy, "boost": boost, "seed": seed})


# Traces of a trained model over real documents ------------------------------------------------

def copy_prefill_state(state):
    """A copy of a PrefillState (its own buffers: the handoff's first decode step donates the
    host pages, so each of several decode runs from one prefill needs its own)."""
    import jax

    return jax.tree_util.tree_map(lambda x: x.copy(), state)


def prefill_documents(params, config, offload, tokens, *, prefill: int, chunk: int = 2048):
    """Prefill the first `prefill` tokens of each document row with the offloaded prefill.

    tokens: [B, N] int token ids, N > prefill (the token after the prefix is needed for its
    loss). Runs `fo_jax.offload.prefill.prefill` in chunks of `chunk` tokens (every request the
    same length) and scores each chunk's logits against the document's next tokens.
    Returns (PrefillState with `prefill` tokens per request, nll [B, prefill] float32: nats of
    token p + 1 given the tokens up to p).
    Touches the chunk's logits [B, chunk, V] at a time.
    """
    import jax
    import jax.numpy as jnp

    from fo_jax.offload import prefill as offload_prefill

    tokens = np.asarray(tokens, np.int32)
    batch, num_t = tokens.shape
    if not 1 <= prefill < num_t:
        raise ValueError(f"prefill={prefill} must be in [1, N) for documents of N={num_t} "
                         "tokens (the token after the prefix scores its last logits)")
    state = offload_prefill.PrefillState.create(
        config, batch=batch, capacity=offload.capacity, page_size=offload.page_size,
        memory_kind=offload.host_memory_kind)
    nll = []
    for lo in range(0, prefill, chunk):
        hi = min(lo + chunk, prefill)
        logits, state = offload_prefill.prefill(params, state, tokens[:, lo:hi], config=config,
                                                host_access=offload.host_access)
        nll.append(np.asarray(_nll(logits, jnp.asarray(tokens[:, lo + 1:hi + 1]))))
    return state, np.concatenate(nll, axis=1)


def _nll(logits, targets):
    """nats of `targets` [B, T] under `logits` [B, T, V] (float32)."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def record_document_trace(params, config, offload, tokens, prefill_state, *, prefill: int,
                          steps: int, ways: int, keep_all_scores: bool = False,
                          meta: dict | None = None) -> tuple[Trace, np.ndarray]:
    """Teacher-forced offloaded decode through documents, recorded as a trace.

    tokens: [B, N] the documents; prefill_state: their first `prefill` tokens, prefilled
    (`prefill_documents`; copied here, so one prefill serves several runs). Each of `steps`
    decode steps feeds W = `ways` tokens per request: the document's next W tokens (the drafts
    a multi-token-prediction verifier would check, all accepted), so the request advances by W
    per step. Records per step, group, request and way the selection, its scores (from
    `decode_step(..., scores=True)`: the same selection), the k-th score, every token's score
    when `keep_all_scores` (S floats per way and step: short contexts), and the step's
    DecodeStats as the trace's reference (offload's hot_slots and policy).
    Returns (trace, nll [B, steps * W]: nats of the document's token after each fed one).
    Needs N > prefill + steps * W and offload.capacity >= prefill + steps * W.
    """
    import jax.numpy as jnp

    from fo_jax.offload import decode as offload_decode
    from fo_jax.offload import prefill as offload_prefill

    tokens = np.asarray(tokens, np.int32)
    batch, num_t = tokens.shape
    end = prefill + steps * ways
    if end >= num_t or end > offload.capacity:
        raise ValueError(f"prefill {prefill} + {steps} steps x {ways} ways = {end} tokens need "
                         f"documents longer than that (got N={num_t}) and "
                         f"offload.capacity >= {end} (got {offload.capacity})")
    state = offload_prefill.to_decode_state(copy_prefill_state(prefill_state), config=config,
                                            offload=offload)
    recorder = TraceRecorder(offload)
    nll = []
    for s in range(steps):
        lo = prefill + s * ways
        before = np.array(state.lengths)
        logits, state, stats = offload_decode.decode_step(
            params, state, tokens[:, lo:lo + ways], config=config, offload=offload,
            check=False, scores=True)
        nll.append(np.asarray(_nll(logits, jnp.asarray(tokens[:, lo + 1:lo + ways + 1]))))
        every = np.asarray(stats.scores, np.float32)  # [G, B, W, S]
        sel = np.asarray(stats.selected)
        picked = np.take_along_axis(every, np.maximum(sel, 0), axis=-1)
        picked = np.where(sel >= 0, picked, np.nan).astype(np.float32)
        kth = np.nanmin(np.where(sel >= 0, picked, np.inf), axis=-1).astype(np.float32)
        recorder.add(before, stats, scores=picked, kth_score=kth,
                     all_scores=every if keep_all_scores else None)
    info = {"source": "fo_jax.traces.record_document_trace", "model": config.name,
            "prefill": prefill, "steps": steps, "ways": ways, **(meta or {})}
    return recorder.trace(info), np.concatenate(nll, axis=1)


def document_windows(docs: list[np.ndarray], *, count: int, length: int, sep: int
                     ) -> tuple[np.ndarray, list[dict]]:
    """`count` token windows [count, length] from documents, longest documents first.

    Window i starts at the i-th longest document; where it is shorter than `length`, the
    documents after it (in the given order, wrapping around) follow. Every document comes
    behind the separator `sep`, as in the training stream (`fo_jax.training.load_split`). Returns
    (windows int32 [count, length], per window {"first": index of its first document,
    "documents": how many it spans}).
    """
    if count > len(docs):
        raise ValueError(f"{count} windows need at least {count} documents, got {len(docs)}")
    order = sorted(range(len(docs)), key=lambda i: (-len(docs[i]), i))[:count]
    windows, info = [], []
    for first in order:
        parts, total, j = [], 0, first
        while total < length:
            if j == len(docs):
                j = 0  # wrap around: every held-out token is usable
            piece = np.concatenate([[sep], np.asarray(docs[j], np.int32)])
            parts.append(piece)
            total += len(piece)
            j += 1
        windows.append(np.concatenate(parts)[:length])
        info.append({"first": first, "documents": len(parts)})
    return np.stack(windows).astype(np.int32), info

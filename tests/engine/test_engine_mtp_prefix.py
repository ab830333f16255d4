"""MTP drafts with the prefix cache (fo_jax.engine.engine, fo_jax.engine.mtp_prefix): a request
that maps a cached prefix also gets its MTP layer rows from the cache (stored per prefill chunk,
keyed by the chunk's chain hash and the token after it), bit for bit those a prefill from
scratch computes, so its drafts and tokens are those of its run alone without the cache; its
prefill drops by the reused tokens, no page or block leaks, and a prefix followed by another
next token than the stored one maps one chunk fewer.

The model of tests/engine/test_engine_mtp.py: 2 layers, one MTP layer (random, plus a copy of
the input token so that some drafts are accepted), capacity 32, prefill chunks of 8."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax.config import get_config
from fo_jax.engine.engine import Engine
from fo_jax.engine.mtp_prefix import mtp_block_bytes
from fo_jax.engine.resident_prefix import block_bytes
from fo_jax.model.dsa import init_params
from fo_jax.model.mtp import init_mtp_params
from fo_jax.offload.config import OffloadConfig

CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=3,
                                    index_topk=4, kv_dtype="float32",
                                    num_nextn_predict_layers=1)
CAPACITY, CHUNK, DRAFTS = 32, 8, 2


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


@functools.cache
def _mtp():
    """Random MTP parameters (own head) plus the copy of the input token."""
    mtp = init_mtp_params(CONFIG, jax.random.key(1), own_head=True)
    e = CONFIG.dim
    copy = jnp.concatenate([jnp.eye(e), jnp.zeros((e, e))])[None]
    return {**mtp, "eh_proj": mtp["eh_proj"] + copy.astype(mtp["eh_proj"].dtype),
            "head": mtp["head"] + _params()["embed"].T[None].astype(mtp["head"].dtype)}


def _engine(path, prefix_cache=True, **kwargs):
    """path: "resident", "resident-pinned" (the prefix store in pinned host memory) or "ring"
    (offloaded: the MTP rows of cached chunks in pinned host memory, as the host pages)."""
    offload = None
    if path == "resident-pinned" and prefix_cache:
        kwargs["prefix_cache_memory"] = "pinned_host"
    if path == "ring":
        offload = OffloadConfig(hot_slots=12, page_size=4, capacity=CAPACITY, policy="ring")
        kwargs.setdefault("num_pages", 24)
    return Engine(_params(), CONFIG, seats=3, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=2, prefill_chunk=CHUNK, query_block=None,
                  num_drafts=DRAFTS, drafter="mtp", mtp=_mtp(), prefix_cache=prefix_cache,
                  **kwargs)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


SYSTEM = [96] * 6 + _prompt(99, 10)  # two prefill chunks


@functools.cache
def _solo(path, prompt, max_tokens):
    """The request alone on the same engine without the prefix cache: its tokens, and its
    seat's MTP state right after its prefill (rows [0, length), length, draft, h')."""
    engine = _engine(path.split("-")[0], prefix_cache=False)
    rid = engine.add_request(list(prompt), max_tokens=max_tokens)
    seen = _watch(engine)
    out = engine.run()[rid]
    return tuple(out.token_ids), seen[rid]


def _watch(engine):
    """Record each request's seat MTP state right after the prefill program that completes
    its prompt (and, with a mapped prefix, its MTP rows right after admission)."""
    seen, prefill, start = {}, engine._prefill, engine._start_mtp

    def watched_prefill(moved):
        before = [r for r in engine._occupant if r is not None and r.prefilled < len(r.prompt)]
        prefill(moved)
        for req in before:
            if req.prefilled == len(req.prompt):
                seen[req.request_id] = engine._save_mtp(req.seat)

    def watched_start(started):
        start(started)
        for req in started:
            if req.cached_tokens:
                seen["admitted", req.request_id] = engine._save_mtp(req.seat)

    engine._prefill, engine._start_mtp = watched_prefill, watched_start
    return seen


def _assert_same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _check(engine):
    if engine.pool is not None:
        engine.pool.check()
        engine.prefix.check()
        assert engine.pool.num_held == len({p for r in engine._occupant if r is not None
                                            for p in r.pages.pages.tolist()})
    else:
        engine.prefix_store.check()
    engine.mtp_prefix.check()
    memory = "pinned_host"
    if engine.prefix_store is not None:
        memory = engine.prefix_store.memory
    for _, kv, keys in engine.mtp_prefix._blocks.values():
        assert kv.sharding.memory_kind == keys.sharding.memory_kind == memory


@pytest.mark.parametrize("path", ["resident", "ring"])
def test_shared_prefix_requests_with_mtp_drafts_equal_their_solo_runs(path):
    """Three requests share a 16-token system prompt (two chunks) and the token after it,
    arriving while the first
    prefills and decodes: the later ones map both chunks (main KV and MTP rows) and prefill
    only the rest; their MTP rows right after admission are the solo prefill's rows of the
    prefix, their MTP state after the prefill the solo one's, their tokens their solo runs',
    bit for bit; drafts were accepted; no page or block is left held."""
    engine = _engine(path)
    seen = _watch(engine)
    # The same token after the system prompt: the second chunk's MTP rows are shared too.
    specs = [(SYSTEM + [96] * 3, 8), (SYSTEM + [96] + _prompt(2, 6), 6),
             (SYSTEM + [96] + _prompt(3, 2), 6)]
    arrivals, ids, step = [0, 2, 3], {}, 0
    while len(ids) < len(specs) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step:
                ids[i] = engine.add_request(specs[i][0], max_tokens=specs[i][1])
        engine.step()
        _check(engine)
        step += 1
    outputs = engine.run()
    for i, (prompt, max_tokens) in enumerate(specs):
        tokens, mtp_state = _solo(path, tuple(prompt), max_tokens)
        assert tuple(outputs[ids[i]].token_ids) == tokens, i
        _assert_same(seen[ids[i]], mtp_state)
        if i:
            kv, keys, length, _, _ = seen["admitted", ids[i]]
            assert length == 16
            np.testing.assert_array_equal(kv, mtp_state[0][:16])
            np.testing.assert_array_equal(keys, mtp_state[1][:16])
    c = engine.counters
    assert c["prefix_hit_tokens"] == 2 * 16
    assert c["prefill_tokens"] == sum(len(p) for p, _ in specs) - 2 * 16
    assert c["draft_accepted"] > 0
    assert engine.mtp_prefix.num_blocks == 2
    if path != "resident":
        assert engine.pool_occupancy()["held"] == 0


@pytest.mark.parametrize("path", ["resident", "resident-pinned", "ring"])
def test_a_prefix_followed_by_another_token_maps_one_chunk_fewer(path):
    """The second chunk's MTP rows take the token after it: a request whose prompt goes on
    with another token than the stored one maps one chunk (main KV and MTP rows), prefills
    the second chunk again and stores its MTP rows for its own next token (the latest
    replaces the stored ones), so the next request of that kind maps both chunks, and one
    going on with the first token now maps one. Tokens equal the solo runs throughout."""
    engine = _engine(path)
    x, y = _prompt(5, 4), _prompt(6, 4)
    assert x[0] != y[0]
    hits = []
    for prompt in (SYSTEM + x, SYSTEM + x[:1] + y[1:], SYSTEM + y, SYSTEM + y[::-1],
                   SYSTEM + x):
        hit, prefilled = engine.counters["prefix_hit_tokens"], engine.counters["prefill_tokens"]
        rid = engine.add_request(prompt, max_tokens=4)
        out = engine.run()[rid]
        _check(engine)
        assert tuple(out.token_ids) == _solo(path, tuple(prompt), 4)[0]
        hits.append(engine.counters["prefix_hit_tokens"] - hit)
        assert engine.counters["prefill_tokens"] - prefilled == len(prompt) - hits[-1]
    # y[::-1] starts with y[-1]: another token than y[0] unless they agree.
    assert hits == [0, 16, 8, 16 if y[-1] == y[0] else 8, 8]
    # The main cache did match both chunks every time.
    cache = engine.prefix if engine.pool is not None else engine.prefix_store.cache
    assert cache.num_hit_tokens == 4 * 16


def test_mtp_rows_count_in_the_prefix_budget():
    """Resident: a block of the prefix store holds the MTP layer's rows of its chunk too, and
    its bytes count in prefix_cache_bytes; offloaded, host_pool_bytes counts a page's MTP rows
    beside its KV."""
    per_block = block_bytes(CONFIG, CHUNK) + mtp_block_bytes(CONFIG, CHUNK)
    assert mtp_block_bytes(CONFIG, CHUNK) == CHUNK * (CONFIG.kv_width + CONFIG.index_head_dim) * 4
    engine = _engine("resident", prefix_cache_bytes=3 * per_block - 1)
    assert engine.prefix_store.num_blocks == 2
    assert engine.prefix_store.block_bytes == per_block
    probe = _engine("ring", prefix_cache=False, num_pages=1)
    page = probe.costs.page_host_bytes + mtp_block_bytes(CONFIG, 4)
    engine = _engine("ring", num_pages=None, host_pool_bytes=10 * page)
    assert engine.pool.num_pages == 10


def test_mtp_blocks_are_evicted_with_their_chunks():
    """Resident, a prefix store of two blocks: a prompt of two other chunks evicts the system
    prompt's blocks, and their MTP rows go with them (every MTP block's chunk is cached);
    the system prompt is then prefilled again, its tokens still the solo run's."""
    per_block = block_bytes(CONFIG, CHUNK, mtp=True)
    engine = _engine("resident", prefix_cache_bytes=2 * per_block)
    hits = []
    for prompt in (SYSTEM + [96] * 3, _prompt(7, 19), SYSTEM + [96] * 3):
        hit = engine.counters["prefix_hit_tokens"]
        rid = engine.add_request(prompt, max_tokens=3)
        out = engine.run()[rid]
        _check(engine)
        assert tuple(out.token_ids) == _solo("resident", tuple(prompt), 3)[0]
        assert engine.mtp_prefix.num_blocks == 2
        hits.append(engine.counters["prefix_hit_tokens"] - hit)
    assert hits == [0, 0, 0]
    assert engine.prefix_store.cache.num_evicted == 4

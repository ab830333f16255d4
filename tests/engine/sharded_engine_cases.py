"""ShardedEngine on 4 simulated CPU devices against a single-device Engine, bit for bit.

Run by tests/engine/test_sharded_engine.py in a subprocess (the rest of the suite keeps one
device); runs alone too: `XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=.
python tests/engine/sharded_engine_cases.py [resident | offloaded | preempt]` (no argument:
all three; the tests run the first two). Prints one line per case and "ALL OK".

A stream of requests (prompts of one to three prefill chunks, different max_tokens, staggered
arrivals, three on one rank of two seats: one waits in its rank's queue) is served by one
`ShardedEngine` over 4 ranks: "resident", in the all-to-all layout (each device 1/4 of the
experts) and on the plain data mesh (every weight on every device); "offloaded", in the
all-to-all layout with a host pool per rank (every page back in its pool at the end; `serve
--offload` builds it), and a stream placed by least_misses (the default offloaded: by the loads its miss estimates give; the rows each
rank copied are its seats' statistics); "preempt" (by hand: the tests' preemption across
processes is multiprocess_sharded_cases.py's, on the same rank scheduler), with pools of 8
pages and reserve="prompt", where rank 0 preempts its younger request, which resumes
(prefilled again, its tokens replayed). Every
request's tokens (greedy, and two sampled with their own seeds) must equal those of the same
request served alone by one single-device `Engine` of the same settings with the whole
weights; every request sits only in seats of its rank; a request cancelled while it decodes
frees its seat; the seats are free and the lengths zero at the end. "resident" also: the
server's driver runs it; `sharded_seats.sharded_prefill_seats` is bit for bit
`resident.prefill_seat` on each rank's KV alone; the refusals' messages. Two requests ask for
log-probabilities: they equal their solo runs' bit for bit. "offloaded" also: each rank's pool
sized in bytes (host_pool_bytes) and a device budget per rank (device_bytes), the planner's
bytes checked against each rank's shards of the state; a metrics log of one record per step
with every rank's figures.
"""

import dataclasses
import functools
import json
import os
import tempfile
import sys
import time

# FO_JAX_RANKS=8 runs the offloaded cases over 8 ranks (the resident ones assume 4).
RANKS = int(os.environ.get("FO_JAX_RANKS", "4"))
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={RANKS}")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fo_jax import sharding  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.engine.costs import MemoryCosts  # noqa: E402
from fo_jax.engine.engine import Engine  # noqa: E402
from fo_jax.engine.metrics import POOL_STATES  # noqa: E402
from fo_jax.engine.sharded import ShardedEngine  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402

# tiny_moe cut to 2 layers: layer 0 dense, layer 1 MoE (8 experts, 2 per token, a shared one).
CONFIG = get_config("tiny_moe").replace(num_layers=2, indexer_layers=(0,), max_ways=1)
SEATS, CAPACITY, CHUNK = 2, 32, 8
SETTINGS = dict(seats=SEATS, capacity=CAPACITY, decode_steps_per_call=2, prefill_chunk=CHUNK,
                query_block=None, overlap=False)
# (arrival step, prompt seed, prompt length, max_tokens, rank or None: the placement rule's).
# Rank 0 gets three requests for its two seats (the third waits for a seat of rank 0 while
# rank 3 has free ones).
STREAM = [(0, 1, 20, 6, 0), (0, 2, 3, 8, 0), (0, 3, 9, 5, None), (0, 4, 2, 7, None),
          (1, 5, 5, 2, 0), (2, 6, 12, 4, None), (3, 7, 4, 3, None)]
# Prompt seeds of the requests that sample (temperature 0.8, top_p 0.9, their own PRNG seed);
# the others are greedy.
SAMPLED = (3, 6)
# Prompt seeds of the requests that ask for log-probabilities, and their k (a sampled one and
# a greedy one): equal to their solo runs' bit for bit.
LOGPROBS = {3: 2, 1: 0}
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s wall, {time.process_time():5.1f}s cpu] {msg}", flush=True)


@functools.cache
def _params():
    """The whole weights on the first device (initialised in one program)."""
    params = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))
    return jax.device_put(params, jax.devices()[0])


def _sampling(seed):
    out = dict(temperature=0.8, top_p=0.9, seed=seed) if seed in SAMPLED else {}
    return dict(out, logprobs=LOGPROBS[seed]) if seed in LOGPROBS else out


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


OFFLOAD = OffloadConfig(hot_slots=16, page_size=4, capacity=CAPACITY, policy="ring")
# The planner's bytes of a seat and a page (`MemoryCosts`): the offloaded STREAM runs with each
# rank's pool sized in bytes (8 pages, and a byte: host_pool_bytes) and a device budget per
# rank (device_bytes: two full seats with every page and prompt page fit it).
COSTS = MemoryCosts.from_config(CONFIG, page_size=OFFLOAD.page_size,
                                hot_slots=OFFLOAD.hot_slots, num_buffers=CONFIG.num_layers)
RANK_BUDGET = 2 * (COSTS.seat_device_bytes + 8 * COSTS.page_device_bytes
                   + (CAPACITY // OFFLOAD.page_size) * COSTS.page_prefill_bytes)
BYTES = (("host_pool_bytes", 8 * COSTS.page_host_bytes + 1), ("device_bytes", RANK_BUDGET))


# Two requests on rank 0 whose pages outgrow its pool of 8 pages as they decode (reserve
# "prompt"): the younger is preempted, its pages dropped, and it resumes (prefill + replay).
# (The offloaded STREAM runs with pools of 8 pages too: the same programs.)
PREEMPT_STREAM = [(0, 11, 9, 14, 0), (0, 12, 5, 14, 0), (0, 13, 3, 6, 1), (1, 14, 6, 8, 2)]
PREEMPT = (("reserve", "prompt"), ("num_pages", 8))


@functools.cache
def _solo(offload=None, stream=tuple(STREAM), extra=()):
    """Each request of `stream` alone in one single-device Engine of the same settings: its
    (tokens, log-probabilities or None)."""
    out = []
    engine = Engine(_params(), CONFIG, offload=offload, **SETTINGS, **dict(extra))
    for _, seed, length, max_tokens, _ in stream:
        rid = engine.add_request(_prompt(seed, length), max_tokens=max_tokens,
                                 **_sampling(seed))
        got = engine.run()[rid]
        out.append((got.token_ids, got.logprobs))
        engine.release(rid)
    return out


def check_experts(engine, *, split: bool) -> None:
    """Each device holds 1/R of the routed experts (split) or all of them, read from the
    arrays' shards; the router and the shared expert whole on every device."""
    whole = _params()["moe"]
    for name in ("w1", "w2", "w3"):
        placed = engine.params["moe"][name]
        shards = placed.addressable_shards
        assert len(shards) == RANKS, len(shards)
        for shard in shards:
            want = whole[name].shape[1] // (RANKS if split else 1)
            assert shard.data.shape[1] == want, (name, shard.data.shape)
            np.testing.assert_array_equal(np.asarray(shard.data),
                                          np.asarray(whole[name])[:, shard.index[1]])
        assert sum(s.data.nbytes for s in shards) == whole[name].nbytes * (1 if split
                                                                            else RANKS)
    for name in ("gate", "shared_w1"):
        for shard in engine.params["moe"][name].addressable_shards:
            assert shard.data.shape == whole[name].shape, name


def stream_case(mesh, rules, *, split: bool, what: str, offload=None, stream=tuple(STREAM),
                extra=(), metrics=None, logprobs=True):
    """The stream served by one ShardedEngine (`extra`: settings of it and of the solo
    Engines; `metrics`: a metrics log's path, one record per step; logprobs=False: no request
    asks for log-probabilities, their tokens those of the solo runs that did)."""
    logged = {} if metrics is None else dict(metrics_path=metrics, metrics_every=1)
    engine = ShardedEngine(_params(), CONFIG, mesh=mesh, rules=rules, placement="round_robin",
                           offload=offload, **SETTINGS, **dict(extra), **logged)
    assert engine.seats == RANKS * SEATS and engine.ranks == RANKS
    check_experts(engine, split=split)
    if offload is None:
        kv = engine.state.kv
        assert kv.sharding.spec[1] == "data" and kv.addressable_shards[0].data.shape[1] == SEATS
    else:  # one host pool shard per rank, in its device's pinned_host memory
        pool = engine.state.host.kv
        assert pool.sharding.memory_kind == "pinned_host", pool.sharding
        assert pool.sharding.spec[1] == "data" and len(engine.kv.pools) == RANKS
        frames = engine.kv.pools[0].num_pages
        assert {s.data.shape[1] for s in pool.addressable_shards} == {frames}
    ids, step, waited = {}, 0, False
    while len(ids) < len(stream) or engine.has_unfinished():
        for i, (arrival, seed, length, max_tokens, rank) in enumerate(stream):
            if arrival == step:
                kwargs = _sampling(seed)
                if not logprobs:
                    kwargs.pop("logprobs", None)
                ids[i] = engine.add_request(_prompt(seed, length), max_tokens=max_tokens,
                                            rank=rank, **kwargs)
        if step == 1:  # a long request, cancelled two steps later while it decodes
            cancelled = engine.add_request(_prompt(8, 4), max_tokens=20, rank=3)
        if step == 3:
            assert cancelled in engine.seat_request_ids() and engine.cancel(cancelled)
            assert cancelled not in engine.seat_request_ids()
        engine.step()
        for b, rid in enumerate(engine.seat_request_ids()):
            if rid is not None:
                assert b // SEATS == engine.rank_of(rid), (b, rid, engine.rank_of(rid))
        budget = dict(extra).get("device_bytes")
        if budget is not None:  # a budget per rank: each rank's request state within it
            used = engine.device_bytes_used()
            assert max(used) <= budget and sum(used) == engine.scheduler.device_bytes_used()
        waiting = set(engine.waiting_ids())
        waited |= any(engine.rank_of(r) == 0 for r in waiting) and engine.num_running() < 8
        step += 1
        assert step < 100, "the stream did not finish"
    placed = [engine.rank_of(ids[i]) for i in range(len(stream))]
    for i, (*_, rank) in enumerate(stream):
        assert rank is None or placed[i] == rank, (i, placed)
    if stream == tuple(STREAM):
        assert waited, "no request waited for a seat of its rank while others had free seats"
        assert len(set(placed)) >= min(RANKS, 4), placed  # 4 ranks: every rank served some
    solo = _solo(offload, stream, extra)
    outs = engine.run()
    for i in range(len(stream)):
        got = outs[ids[i]].token_ids
        want = solo[i] if logprobs else (solo[i][0], None)
        assert (got, outs[ids[i]].logprobs) == want, (what, i, placed[i], got, solo[i])
        assert len(got) == stream[i][3], (i, got)
        if logprobs and stream[i][1] in LOGPROBS:  # each token's entry: its id, k top tokens
            lps = outs[ids[i]].logprobs
            assert [lp.token_id for lp in lps] == got, (i, lps)
            assert {len(lp.top) for lp in lps} == {LOGPROBS[stream[i][1]]}, (i, lps)
    assert engine.num_running() == 0 and not engine.num_waiting()
    assert all(r is None for r in engine.seat_request_ids())
    assert not np.asarray(engine.state.lengths).any(), np.asarray(engine.state.lengths)
    assert engine.counters["requests_finished"] == len(stream)
    assert engine.counters["requests_cancelled"] == 1
    if offload is not None:  # every page back in its rank's pool
        assert [p["held"] for p in engine.rank_pool_occupancy()] == [0] * RANKS
        assert engine.stats is not None
    assert 0 < len(outs[cancelled].token_ids) < 20, outs[cancelled].token_ids
    for rid in list(ids.values()) + [cancelled]:
        engine.release(rid)
    raises(lambda: engine.rank_of(cancelled), f"no request {cancelled!r}", KeyError)
    log(f"{what}: {len(stream)} requests on ranks {placed}, {step} steps, "
        f"{engine.counters['prefill_calls']} prefill programs, "
        f"{engine.counters['preemptions']} preemptions, "
        f"{engine.counters['decode_calls']} decode calls: tokens bitwise their solo runs")
    return engine


def check_rank_bytes(engine, pages: int) -> None:
    """Each rank's pool holds `pages` pages, and the planner's bytes (`engine.kv.costs`, what
    host_pool_bytes and device_bytes are counted in) are those of each rank's shards of the
    state: its host KV pages, its seats' hot rows and slot maps, its indexer-key pages."""
    costs, st = engine.kv.costs, engine.state
    assert [p.num_pages for p in engine.kv.pools] == [pages] * RANKS

    def per_device(x):
        return {s.device: s.data.nbytes for s in x.addressable_shards}

    host, hot, seat_slots, keys, page_slots = map(per_device, (
        st.host.kv, st.hot, st.slots.slot_to_token, st.index_keys, st.slots.token_to_slot))
    assert len(host) == RANKS, host
    for d in host:
        assert host[d] == pages * costs.page_host_bytes, (host[d], costs)
        assert hot[d] + seat_slots[d] == SEATS * costs.seat_device_bytes, (hot[d], costs)
        assert (keys[d] // pages + page_slots[d] // (SEATS * engine.kv.max_pages)
                == costs.page_device_bytes), (keys[d], page_slots[d], costs)


def check_metrics_log(engine, path) -> None:
    """The sharded engine's metrics log (metrics_every=1): one record per step, each with
    every rank's figures, which sum to the engine's; the offload counters' rows copied are
    the ranks'; Prometheus' text has the per-rank gauges."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == engine.counters["steps"], (len(records), engine.counters)
    for rec in records:
        ranks, gauges = rec["ranks"], rec["gauges"]
        assert [r["rank"] for r in ranks] == list(range(RANKS)), ranks
        assert sum(r["running"] for r in ranks) == gauges["running"], rec
        assert sum(r["waiting"] for r in ranks) == gauges["queue_length"], rec
        assert {k: sum(r["pool_pages"][k] for r in ranks) for k in POOL_STATES} == \
            gauges["pool_pages"], rec
    last = records[-1]
    assert [r["rows_copied"] for r in last["ranks"]] == engine.rank_misses(), last["ranks"]
    assert sum(last["totals"]["union"]) == sum(engine.rank_misses()) > 0, last["totals"]
    assert last["totals"]["decode_calls_offloaded"] == engine.counters["decode_calls"]
    assert [r["device_bytes_used"] for r in last["ranks"]] == engine.device_bytes_used()
    text = engine.metrics.prometheus_text()
    for r in range(RANKS):
        assert f'fojax_rank_requests_running{{rank="{r}"}}' in text, text
        assert f'fojax_rank_pool_pages{{rank="{r}",state="held"}}' in text, text


def driver_case(engine) -> None:
    """The HTTP server's EngineDriver runs a ShardedEngine as it runs an Engine: requests are
    served over the ranks and released (the engine's programs are compiled already)."""
    import asyncio

    from fo_jax.server.driver import Accepted, EngineDriver

    driver = EngineDriver(engine, max_queue=8, stats_every=1)
    driver.start()

    async def drain(handle):
        items = []
        while not getattr(items[-1] if items else None, "finished", False):
            items.append(await asyncio.wait_for(handle.queue.get(), 60))
        return items

    async def main():
        loop = asyncio.get_running_loop()
        handles = [driver.submit([1 + i, 2, 3], loop=loop, max_tokens=3,
                                 **({"logprobs": 1} if i == 0 else {})) for i in range(5)]
        return await asyncio.gather(*(drain(h) for h in handles))

    try:
        got = asyncio.run(main())
    finally:
        assert driver.stop(timeout=30)
    assert all(isinstance(items[0], Accepted) for items in got)
    assert [items[-1].finish_reason for items in got] == ["length"] * 5
    assert [len(items[-1].token_ids) for items in got] == [3] * 5
    assert [len(items[-1].logprobs or ()) for items in got] == [3, 0, 0, 0, 0]
    assert not engine.has_unfinished() and not engine.requests()  # released by the driver
    log("the server's EngineDriver over the sharded engine: 5 requests served and released")


def http_case(engine) -> None:
    """`fo-jax serve`'s app over the sharded engine: an OpenAI completion with `logprobs: k`
    (token ids in, greedy) gives the tokens and log-probabilities of the request's solo run
    on one Engine, bit for bit (the engine's programs are compiled already)."""
    import httpx

    from fo_jax.server.serve import ServerThread, build_served
    from fo_jax.tokenizer import ByteTokenizer

    seed, length, max_tokens = 1, 20, 6  # STREAM's first request: greedy, LOGPROBS[1] = 0
    want_tokens, want = _solo(None)[0]
    served = build_served(engine, ByteTokenizer(), model_name=CONFIG.name, stop_token_ids=(),
                          shutdown_timeout=2.0)
    with ServerThread(served, shutdown_timeout=2.0) as srv:
        resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": CONFIG.name, "prompt": _prompt(seed, length), "max_tokens": max_tokens,
            "temperature": 0, "logprobs": LOGPROBS[seed], "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["token_ids"] == want_tokens, (choice, want_tokens)
    assert choice["logprobs"]["token_logprobs"] == [e.logprob for e in want], choice
    assert not engine.has_unfinished() and not engine.requests()
    log("the server's app over the sharded engine: a completion's logprobs bitwise its solo "
        "run's")


def prefill_seats_case(mesh, rules) -> None:
    """`sharded_seats.sharded_prefill_seats` against `resident.prefill_seat` on each rank's KV
    alone (the whole weights): two rounds, a rank writing nothing in each, the second over
    history; logits and every rank's KV, lengths and untouched seats bit for bit (unwritten
    rows NaN). The engine's shapes: its programs are compiled already."""
    from fo_jax import resident, sharded_seats

    rng = np.random.default_rng(5)
    state = resident.ResidentState.create(CONFIG, batch=RANKS * SEATS, capacity=CAPACITY,
                                          fill=float("nan"))
    refs = [resident.ResidentState.create(CONFIG, batch=SEATS, capacity=CAPACITY,
                                          fill=float("nan")) for _ in range(RANKS)]
    refs = [jax.device_put(r, jax.devices()[0]) for r in refs]
    state = sharding.shard_state(state, mesh, rules)
    placed = sharding.shard_params(_params(), mesh, rules)
    for round_, idle in enumerate((2, 0)):
        seats = rng.integers(0, SEATS, RANKS).astype(np.int32) if round_ else \
            np.arange(RANKS, dtype=np.int32) % SEATS
        tokens = rng.integers(0, CONFIG.vocab_size, (RANKS, CHUNK)).astype(np.int32)
        num_new = rng.integers(1, CHUNK + 1, RANKS).astype(np.int32)
        num_new[idle] = 0
        logits, state = sharded_seats.sharded_prefill_seats(
            placed, state, seats, tokens, num_new, mesh=mesh, config=CONFIG,
            query_block=None, rules=rules)
        for r in range(RANKS):
            want, refs[r] = resident.prefill_seat(_params(), refs[r], int(seats[r]),
                                                  tokens[r:r + 1], num_new[r:r + 1],
                                                  config=CONFIG, query_block=None)
            n = int(num_new[r])
            np.testing.assert_array_equal(np.asarray(logits)[r, :n], np.asarray(want)[0, :n])
    whole = jax.tree.map(np.asarray, state)
    for r in range(RANKS):
        rows = slice(r * SEATS, (r + 1) * SEATS)
        np.testing.assert_array_equal(whole.kv[:, rows], np.asarray(refs[r].kv))
        np.testing.assert_array_equal(whole.index_keys[:, rows], np.asarray(refs[r].index_keys))
        np.testing.assert_array_equal(whole.lengths[rows], np.asarray(refs[r].lengths))
    raises(lambda: sharded_seats.sharded_prefill_seats(
        placed, state, np.zeros(RANKS, np.int32), np.zeros((RANKS, CHUNK), np.int32),
        np.asarray([0, 0, CHUNK + 1, 0]), mesh=mesh, config=CONFIG, rules=rules),
        f"num_new must be [D = {RANKS}] ints in [0, {CHUNK}], got [0, 0, {CHUNK + 1}, 0]")
    raises(lambda: sharded_seats.sharded_prefill_seats(
        placed, state, np.asarray([0, SEATS, 0, 0]), np.zeros((RANKS, CHUNK), np.int32),
        np.zeros(RANKS, np.int32), mesh=mesh, config=CONFIG, rules=rules),
        f"seats must be [D = {RANKS}] ints in [0, {SEATS - 1}], got [0, {SEATS}, 0, 0]")
    log("sharded_prefill_seats: 2 rounds, each rank bitwise its one-device prefill_seat")


def raises(fn, message, kind=ValueError):
    try:
        fn()
    except kind as err:
        assert message in str(err), (str(err), message)
        return
    raise AssertionError(f"no {kind.__name__}: {message}")


def error_cases() -> None:
    mesh = sharding.make_mesh(RANKS)
    make = functools.partial(ShardedEngine, _params(), CONFIG, mesh=mesh)
    raises(lambda: make(**dict(SETTINGS, offload=dataclasses.replace(
        OFFLOAD, host_memory_kind="device"))),
        "the sharded engine does not run the paged KV pool in device memory "
        "(host_memory_kind='device') yet", NotImplementedError)
    raises(lambda: make(**dict(SETTINGS, prefix_cache=True)),
           "the sharded engine does not run prefix_cache yet", NotImplementedError)
    raises(lambda: make(placement="least_misses", **SETTINGS),
           "placement='least_misses' needs the offloaded path (an OffloadConfig): the resident "
           "path copies no misses; use 'least_context'")
    raises(lambda: make(placement="fastest", **SETTINGS),
           "placement='fastest': the sharded engine places by one of ('round_robin', "
           "'least_requests', 'least_context', 'least_misses')")
    raises(lambda: ShardedEngine(_params(), CONFIG, mesh=sharding.make_mesh(RANKS, expert=2),
                                 **SETTINGS),
           "the sharded engine runs a mesh of data ranks only (make_mesh(R), or "
           "expert_mesh(R, expert=R): the experts split over the data ranks), got mesh axes "
           "{'data': 2, 'model': 1, 'expert': 2}", NotImplementedError)
    engine = make(**SETTINGS)
    raises(lambda: engine.add_request([1, 2], rank=RANKS),
           f"rank={RANKS} must be an int in [0, R = {RANKS}) or None")
    raises(lambda: engine.add_request([1, 2], logprobs=21),
           "logprobs=21 must be None (no log-probabilities) or an int in [0, max_logprobs=20]")
    assert not engine.has_unfinished()
    log("refusals ok")


def serve_case() -> None:
    """`fo-jax serve --model tiny_moe --devices 4 --expert-parallel 4` builds one ShardedEngine
    over the 4 devices, 1/4 of the experts on each (nothing runs); a model without experts is
    refused before its weights are read."""
    import argparse

    from fo_jax.server.serve import add_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--devices", "4", "--expert-parallel", "4", "--seats", "2", "--capacity", "32",
             "--prefill-chunk", "8"]
    engine = build_engine(parser.parse_args(["--model", "tiny_moe", *flags]))[0]
    assert isinstance(engine, ShardedEngine), type(engine)
    assert (engine.ranks, engine.seats, engine.placement) == (4, 8, "least_context")
    assert engine.rules == sharding.ALL_TO_ALL_RULES
    for name in ("w1", "w2", "w3"):
        w = engine.params["moe"][name]
        assert {s.data.shape[1] for s in w.addressable_shards} == {w.shape[1] // RANKS}, name
        assert len({s.device for s in w.addressable_shards}) == RANKS
    raises(lambda: build_engine(parser.parse_args(["--model", "tiny", *flags])),
           "--expert-parallel splits the MoE experts, but 'tiny' has none: drop it (--devices "
           "alone serves data-parallel)")
    raises(lambda: build_engine(parser.parse_args(["--model", "tiny_moe", "--devices", "4"]),
                                metrics_jsonl="m.jsonl"),
           "--metrics-jsonl is not supported with --devices alone (one log per engine; the "
           "data-parallel server runs one engine per device): add --expert-parallel N")
    log("serve --devices 4 --expert-parallel 4: one ShardedEngine, 1/4 of the experts per "
        "device; a dense model refused")


def resident_cases():
    error_cases()
    serve_case()
    mesh, rules = sharding.expert_mesh(RANKS, expert=RANKS)
    engine = stream_case(mesh, rules, split=True, what="all-to-all layout (experts split)")
    driver_case(engine)
    http_case(engine)
    prefill_seats_case(mesh, rules)
    # Without log-probabilities (their programs compiled once, for the layout above).
    stream_case(sharding.make_mesh(RANKS), None, split=False, what="data mesh (replicated)",
                logprobs=False)


def serve_offloaded_case() -> None:
    """`fo-jax serve --devices 4 --expert-parallel 4 --offload` builds one ShardedEngine with a
    host pool per rank (nothing runs)."""
    import argparse

    from fo_jax.server.serve import add_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = build_engine(parser.parse_args([
        "--model", "tiny_moe", "--devices", str(RANKS), "--expert-parallel", str(RANKS),
        "--offload",
        "--page-size", "4", "--seats", "2", "--capacity", "32", "--prefill-chunk", "8"]))[0]
    assert isinstance(engine, ShardedEngine) and engine.kv.paged, type(engine.kv)
    assert engine.rank_pool_occupancy() == [{"free": 16, "held": 0, "cached": 0,
                                             "total": 16}] * RANKS
    assert engine.state.host.kv.sharding.memory_kind == "pinned_host"
    assert engine.placement == "least_misses"  # the default offloaded
    log(f"serve --devices {RANKS} --expert-parallel {RANKS} --offload: a host pool of 16 "
        "pages per rank")


def check_rank_misses(engine) -> None:
    """The engine's rows copied per rank are its statistics' union rows of the rank's seats."""
    union = np.asarray(engine.stats.union).sum(axis=0)  # [R B], summed over decode calls
    want = union.reshape(RANKS, SEATS).sum(axis=1).tolist()
    assert engine.rank_misses() == want, (engine.rank_misses(), want)
    figures = engine.imbalance()
    assert figures["steps"] == engine.counters["decode_calls"], figures
    assert figures["rank_misses"] == want and sum(figures["placed_per_rank"]) >= 1, figures
    assert figures["max_over_mean"] is None or 1.0 <= figures["max_over_mean"] <= RANKS


def least_misses_case(mesh, rules) -> None:
    """least_misses, the default offloaded: a new request goes to the rank whose unfinished
    requests' costs (calibrated prior, then each one's estimate of rows per decode call) sum
    least, with the loads read from the engine's bookkeeping; every decode call's rows fold
    into the estimates of the requests it ran (observed: all the rows copied); tokens are
    still bitwise each request's solo run."""
    extra = (("num_pages", 8),)
    engine = ShardedEngine(_params(), CONFIG, mesh=mesh, rules=rules, offload=OFFLOAD,
                           **SETTINGS, **dict(extra))
    assert engine.placement == "least_misses"
    misses = engine._misses
    # Nothing observed: costs are priors, 16 (1 - 16 / S), zero up to 16 tokens: the first
    # two long prompts go to ranks 0 and 1, the short ones (cost 0) to the least loaded
    # ranks with most free seats, then lowest index: 2 and 3.
    stream = [(0, 21, 24, 6, None), (0, 22, 20, 6, None), (0, 23, 3, 8, None),
              (0, 24, 5, 4, None)]
    ids = [engine.add_request(_prompt(seed, length), max_tokens=max_tokens, **_sampling(seed))
           for _, seed, length, max_tokens, _ in stream]
    assert [engine.rank_of(r) for r in ids] == [0, 1, 2, 3], [engine.rank_of(r) for r in ids]
    placed, steps = list(ids), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        # The loads the rule reads: each unfinished request's cost on its rank.
        load = [0.0] * RANKS
        for rid in placed:
            out = engine._requests.get(rid)
            if out is not None and out.finish_reason is None:
                load[engine.rank_of(rid)] += misses.cost(rid, len(out.prompt) + len(out.tokens))
        if steps == 2:  # a request placed while others run: the least loaded rank
            rank, _ = engine.choose_rank(18)
            assert load[rank] == min(load), (rank, load)
            placed.append(engine.add_request(_prompt(25, 18), max_tokens=3))
            stream.append((2, 25, 18, 3, None))
            assert engine.rank_of(placed[-1]) == rank
        assert steps < 60, "the stream did not finish"
    total = sum(engine.rank_misses())
    assert total > 0 and misses.observed == total, (misses.observed, engine.rank_misses())
    assert misses.predicted > 0 and set(misses.estimates) == set(placed), misses.estimates
    check_rank_misses(engine)
    assert sum(engine.imbalance()["placed_per_rank"]) == len(placed)
    solo = _solo(OFFLOAD, tuple(stream), extra)
    outs = engine.run()
    for i, rid in enumerate(placed):
        assert (outs[rid].token_ids, outs[rid].logprobs) == solo[i], (i, outs[rid], solo[i])
        engine.release(rid)
    assert not misses.estimates, misses.estimates  # released: forgotten
    log(f"least_misses: {len(placed)} requests on ranks {engine.placed_per_rank}, rows copied "
        f"per rank {engine.rank_misses()}, estimates from {steps} steps; tokens bitwise "
        "their solo runs")


def budget_case(mesh, rules) -> None:
    """device_bytes is each rank's budget: a request that can never fit it alone is refused
    (nothing queued); host_pool_bytes that holds no page is refused."""
    from fo_jax.engine.scheduler import RequestRefused

    engine = ShardedEngine(_params(), CONFIG, mesh=mesh, rules=rules, offload=OFFLOAD,
                           **SETTINGS, num_pages=8, device_bytes=5000)
    raises(lambda: engine.add_request(_prompt(1, 20), max_tokens=6),
           "prompt of 20 tokens + max_tokens=6 can never fit device_bytes=5,000", RequestRefused)
    assert not engine.has_unfinished() and engine.device_bytes_used() == [0] * RANKS
    raises(lambda: ShardedEngine(_params(), CONFIG, mesh=mesh, rules=rules, offload=OFFLOAD,
                                 **SETTINGS, host_pool_bytes=COSTS.page_host_bytes - 1),
           f"host_pool_bytes={COSTS.page_host_bytes - 1} holds no page of 4 tokens "
           f"({COSTS.page_host_bytes} bytes over 2 layers): raise it")
    log("device_bytes and host_pool_bytes per rank: the refusals")


def budget_binds_case(mesh, rules) -> None:
    """device_bytes binds per rank: with a budget that holds one request's state (its seat,
    prefill buffers and pages), rank 0's second request waits for its first to finish while
    rank 1 admits its own; the three (one prompt) get the same tokens. The stream's shapes:
    its programs are compiled already."""
    need = (COSTS.seat_device_bytes + COSTS.page_prefill_bytes
            + 2 * COSTS.page_device_bytes)  # 3 prompt tokens + 4 sampled: 2 pages of 4
    engine = ShardedEngine(_params(), CONFIG, mesh=mesh, rules=rules, offload=OFFLOAD,
                           **SETTINGS, num_pages=8, device_bytes=need)
    prompt = _prompt(31, 3)
    ids = [engine.add_request(prompt, max_tokens=4, rank=r) for r in (0, 0, 1)]
    engine.step()
    assert engine.waiting_ids() == [ids[1]], engine.waiting_ids()
    assert sorted(engine.rank_of(r) for r in engine.seat_request_ids() if r) == [0, 1]
    used = engine.device_bytes_used()
    assert 0 < used[0] <= need and 0 < used[1] <= need and used[2:] == [0] * (RANKS - 2), used
    outs = engine.run()
    tokens = [outs[r].token_ids for r in ids]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 4, tokens
    assert engine.device_bytes_used() == [0] * RANKS
    log(f"device_bytes={need:,} per rank: rank 0's second request waited, rank 1 ran its own")


def offloaded_cases():
    serve_offloaded_case()
    mesh, rules = sharding.expert_mesh(RANKS, expert=RANKS)
    budget_case(mesh, rules)
    path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    engine = stream_case(mesh, rules, split=True, offload=OFFLOAD, extra=BYTES, metrics=path,
                         what="all-to-all layout, offloaded (a host pool of 8 pages per rank, "
                         "sized in bytes; a device budget per rank; a metrics log)")
    check_rank_bytes(engine, pages=8)
    check_metrics_log(engine, path)
    check_rank_misses(engine)
    budget_binds_case(mesh, rules)
    least_misses_case(mesh, rules)


def preempt_cases():
    mesh, rules = sharding.expert_mesh(RANKS, expert=RANKS)
    engine = stream_case(mesh, rules, split=True, offload=OFFLOAD, stream=tuple(PREEMPT_STREAM),
                         extra=PREEMPT, what="offloaded, reserve='prompt', 8 pages per rank")
    assert engine.counters["preemptions"] >= 1 and engine.counters["replayed_tokens"] >= 1


SUITES = {"resident": resident_cases, "offloaded": offloaded_cases, "preempt": preempt_cases}


def main(argv):
    assert len(jax.devices()) == RANKS, jax.devices()
    for name in argv[1:] or list(SUITES):
        SUITES[name]()
    log("ALL OK")


if __name__ == "__main__":
    main(sys.argv)

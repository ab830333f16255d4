"""One ShardedEngine across two processes: the program each process runs.

Started by tests/engine/test_sharded_engine.py through `fo_jax.distributed.launch` (2 processes
x 2 simulated CPU devices, joined by jax.distributed: 4 data ranks, the experts split over all
of them, so every MoE layer's all-to-alls cross the processes). Each process builds the same
engine over the global mesh, takes requests for its own two ranks only (a stream of its own:
the processes' prefill rounds and decode calls differ, and one runs out of work first), and
steps in lockstep with the other until both are done (`ShardedEngine.run`'s agreement). Then,
on its own: every request's tokens equal those of the request served alone by one
single-device `Engine` of the same settings with the whole weights (greedy), and so do the
log-probabilities of the one that asks for them (on process 0 only: the processes agree on
the decode program), its seats free and its ranks' lengths zero (read from its own devices
only); a request for the other process's rank and a metrics log refused. Then the same offloaded (`PAGED`: a host pool per rank in its
device's host memory, reserve="prompt", least_misses placement): prompts of several chunks
in different history buckets, a preemption and resume on process 0 only; every page back in
its rank's pool, the rows copied read for its own ranks only. Prints one JSON line per mode
and "ALL OK".
"""

import json
import os
import sys
import tempfile

from fo_jax import distributed

INFO = distributed.initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fo_jax import sharding  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.engine.engine import Engine  # noqa: E402
from fo_jax.engine.sharded import ShardedEngine  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402

# tiny_moe cut to 2 layers (layer 1 MoE: 8 experts, 2 per token), as sharded_engine_cases.py.
CONFIG = get_config("tiny_moe").replace(num_layers=2, indexer_layers=(0,), max_ways=1)
RANKS, SEATS, CHUNK = 4, 2, 8
SETTINGS = dict(seats=SEATS, capacity=32, decode_steps_per_call=2, prefill_chunk=CHUNK,
                query_block=None, overlap=False)
# Per process: (arrival step, prompt length, max_tokens, local rank index or None: placed by
# the rule). Process 0: three requests on its first rank's two seats (one waits), prompts of
# up to three chunks; process 1: fewer, shorter, done first.
STREAMS = {0: [(0, 20, 6, 0), (0, 3, 5, 0), (0, 9, 4, None), (1, 5, 3, 0)],
           1: [(0, 4, 2, 1), (2, 12, 3, None)]}
# (process, request index) -> k: the resident requests that ask for log-probabilities (process
# 1 has none: it makes the decode calls with them all the same, one program on both).
LOGPROBS = {(0, 1): 2}
# Offloaded (a host pool of 8 pages of 4 tokens per rank, reserve="prompt"): process 0's first
# rank holds two requests whose pages outgrow its pool as they decode (the younger is
# preempted, its pages dropped, and resumes: prefilled again, its tokens replayed while process
# 1 replays nothing); prompts of one or two chunks, whose chunks load 0 or 2 pages of history
# (two buckets: in step 2 process 0 prefills in one and process 1 in the other).
OFFLOAD = OffloadConfig(hot_slots=16, page_size=4, capacity=32, policy="ring")
PAGED = dict(offload=OFFLOAD, reserve="prompt", num_pages=8)
PAGED_STREAMS = {0: [(0, 9, 14, 0), (0, 5, 14, 0), (0, 16, 4, 1), (1, 12, 3, None)],
                 1: [(0, 4, 2, 0), (0, 13, 3, 1), (2, 12, 5, 0)]}


def prompt(process, i, length):
    return np.random.default_rng(100 * process + i).integers(0, CONFIG.vocab_size,
                                                             length).tolist()


def serve(engine, streams, settings, params, logprobs=None) -> dict:
    """Serve this process's stream of `streams` in lockstep with the other process until both
    are done; check every request's tokens against its solo run on one single-device `Engine`
    of the same `settings`, and the seats, lengths (and pools) of this process's own ranks.
    `logprobs`: (process, request index) -> k of the requests that ask for log-probabilities
    (checked against the solo run's too). Returns this process's figures."""
    logprobs = logprobs or {}
    me, mine = jax.process_index(), engine.local_ranks
    stream = streams[me]
    # the same on both processes: `any_unfinished` is a collective both make
    last_arrival = max(a for s in streams.values() for a, *_ in s)
    ids, step = {}, 0
    while step <= last_arrival or engine.any_unfinished():
        for i, (arrival, length, max_tokens, local) in enumerate(stream):
            if arrival == step:
                ids[i] = engine.add_request(prompt(me, i, length), max_tokens=max_tokens,
                                            rank=None if local is None else mine[local],
                                            logprobs=logprobs.get((me, i)))
        engine.step()
        for b, rid in enumerate(engine.seat_request_ids()):
            if rid is not None:
                assert b // SEATS == engine.rank_of(rid) and b // SEATS in mine, (b, rid)
        step += 1
        assert step < 60, "the streams did not finish"
    outs = engine.run()  # every process is done: no step more
    assert engine.counters["steps"] == step, (engine.counters["steps"], step)
    placed = [engine.rank_of(ids[i]) for i in range(len(stream))]
    assert all(r in mine for r in placed), placed
    assert engine.num_running() == 0 and not engine.num_waiting()
    assert all(r is None for r in engine.seat_request_ids())
    for shard in engine.state.lengths.addressable_shards:  # this process's ranks only
        assert not np.asarray(shard.data).any(), np.asarray(shard.data)
    if engine.pool is not None:  # every page back in its rank's pool
        pools = engine.rank_pool_occupancy()
        assert all(p["held"] == 0 and p["free"] == p["total"] for p in pools), pools
        misses = engine.rank_misses()  # read from this process's devices only
        assert all(misses[r] == 0 for r in range(RANKS) if r not in mine), misses

    solo_engine = Engine(params, CONFIG, **settings)
    tokens = []
    for i, (_, length, max_tokens, _) in enumerate(stream):
        rid = solo_engine.add_request(prompt(me, i, length), max_tokens=max_tokens,
                                      logprobs=logprobs.get((me, i)))
        solo = solo_engine.run()[rid]
        solo_engine.release(rid)
        got = outs[ids[i]].token_ids
        assert got == solo.token_ids and len(got) == max_tokens, (me, i, placed[i], got, solo)
        assert outs[ids[i]].logprobs == solo.logprobs, (me, i, outs[ids[i]].logprobs, solo)
        assert (solo.logprobs is not None) == ((me, i) in logprobs), (me, i)
        tokens.append(got)
    counters = engine.counters
    return {"process": me, "ranks": list(mine), "placed": placed, "steps": step,
            "prefill_calls": counters["prefill_calls"],
            "decode_calls": counters["decode_calls"], "preemptions": counters["preemptions"],
            "replayed_tokens": counters["replayed_tokens"],
            "rank_misses": engine.rank_misses(), "tokens": tokens}


def main() -> int:
    assert INFO is not None and INFO.num_processes == 2, INFO
    # The same weights on every process (one seed), the whole on this process's first device.
    params = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))
    params = jax.device_put(params, jax.local_devices()[0])
    mesh, rules = sharding.expert_mesh(RANKS, expert=RANKS)
    engine = ShardedEngine(params, CONFIG, mesh=mesh, rules=rules, **SETTINGS)
    mine = engine.local_ranks
    assert len(mine) == 2 and engine.multiprocess, mine
    for shard in engine.params["moe"]["w1"].addressable_shards:  # 1/4 of the experts each
        assert shard.data.shape[1] == CONFIG.n_routed_experts // RANKS, shard.data.shape
    try:
        ShardedEngine(params, CONFIG, mesh=mesh, rules=rules, **SETTINGS,
                      metrics_path=os.path.join(tempfile.gettempdir(), "never.jsonl"))
        raise AssertionError("a metrics log across processes was built")
    except NotImplementedError as e:
        assert "the metrics log (metrics_path, --metrics-jsonl) runs in one process" in str(e), e
    other = next(r for r in range(RANKS) if r not in mine)
    try:
        engine.add_request([1, 2], max_tokens=2, rank=other)
        raise AssertionError("a request for another process's rank was taken")
    except ValueError as e:
        assert f"rank={other} is driven by another process" in str(e), e
    print(json.dumps(dict(mode="resident", **serve(engine, STREAMS, SETTINGS, params,
                                                   LOGPROBS))))

    settings = dict(SETTINGS, **PAGED)
    engine = ShardedEngine(params, CONFIG, mesh=mesh, rules=rules, **settings)
    assert engine.placement == "least_misses" and engine.local_ranks == mine
    pool = engine.state.host.kv  # this process's ranks' pool shards, in their host memory
    assert pool.sharding.memory_kind == "pinned_host", pool.sharding
    assert {s.data.shape[1] for s in pool.addressable_shards} == {8}, pool.sharding
    # the buckets the processes agree on: every number of history pages a chunk may load
    buckets = engine.kv.history_buckets()
    assert buckets == (0, 1, 2, 4, 8), buckets
    assert {engine.kv.history_pages(n) for n in range(33)} == set(buckets)
    print(json.dumps(dict(mode="offloaded", **serve(engine, PAGED_STREAMS, settings,
                                                    params))))
    print("ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

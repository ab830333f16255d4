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
only); a request for the other process's rank, a paged engine and a metrics log refused.
Prints one JSON line and "ALL OK".
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
LAST_ARRIVAL = max(a for stream in STREAMS.values() for a, *_ in stream)
# (process, request index) -> k: the requests that ask for log-probabilities (process 1 has
# none: it makes the decode calls with them all the same, one program on both).
LOGPROBS = {(0, 1): 2}


def prompt(process, i, length):
    return np.random.default_rng(100 * process + i).integers(0, CONFIG.vocab_size,
                                                             length).tolist()


def main() -> int:
    me = jax.process_index()
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
        ShardedEngine(params, CONFIG, mesh=mesh, rules=rules, offload=OffloadConfig(
            hot_slots=16, page_size=4, capacity=32, policy="ring"), **SETTINGS)
        raise AssertionError("a paged engine across processes was built")
    except NotImplementedError as e:
        assert "spans processes on the resident path only" in str(e), e
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

    stream = STREAMS[me]
    ids, step = {}, 0
    while step <= LAST_ARRIVAL or engine.any_unfinished():
        for i, (arrival, length, max_tokens, local) in enumerate(stream):
            if arrival == step:
                ids[i] = engine.add_request(prompt(me, i, length), max_tokens=max_tokens,
                                            rank=None if local is None else mine[local],
                                            logprobs=LOGPROBS.get((me, i)))
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

    solo_engine = Engine(params, CONFIG, **SETTINGS)
    tokens = []
    for i, (_, length, max_tokens, _) in enumerate(stream):
        rid = solo_engine.add_request(prompt(me, i, length), max_tokens=max_tokens,
                                      logprobs=LOGPROBS.get((me, i)))
        solo = solo_engine.run()[rid]
        solo_engine.release(rid)
        got = outs[ids[i]].token_ids
        assert got == solo.token_ids and len(got) == max_tokens, (me, i, placed[i], got, solo)
        assert outs[ids[i]].logprobs == solo.logprobs, (me, i, outs[ids[i]].logprobs, solo)
        assert (solo.logprobs is not None) == ((me, i) in LOGPROBS), (me, i)
        tokens.append(got)
    print(json.dumps({"process": me, "ranks": list(mine), "placed": placed, "steps": step,
                      "prefill_calls": engine.counters["prefill_calls"],
                      "decode_calls": engine.counters["decode_calls"], "tokens": tokens}))
    print("ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

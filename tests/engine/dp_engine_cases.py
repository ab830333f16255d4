"""DataParallelEngine on 4 simulated CPU devices against a single-device Engine, bit for bit.

Run by tests/engine/test_dp_engine.py in a subprocess (the rest of the suite keeps one
device); runs alone too: `XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=.
python tests/engine/dp_engine_cases.py [--resident]`. Prints one line per case and "ALL OK".

A stream of requests with staggered arrivals (a long one, then short ones) is served by 4
ranks under least_context (offloaded; with --resident also round_robin, resident); every
request's greedy tokens must equal those of the same request served alone by one `Engine` of
the same settings on the default device; the long request and the short ones go to the
ranks the rule predicts; every rank's arrays (weights, batch state, seats) live on its own
device and its host pool in that device's pinned_host memory; every pool holds no page at the
end.
"""

import functools
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fo_jax.config import get_config  # noqa: E402
from fo_jax.engine.data_parallel import DataParallelEngine  # noqa: E402
from fo_jax.engine.engine import Engine  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402

# tests/engine/test_engine.py's small engine: 2 layers, one indexer, top-4, seats of 32 tokens.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
CAPACITY, SEATS, RANKS = 32, 2, 4
# (arrival step, prompt seed, prompt length, max_tokens): a long request first, then short
# ones, two arriving while the first ones decode.
# Prompts of at most one prefill chunk (8 tokens): one prefill program per device.
STREAM = [(0, 1, 8, 12), (0, 2, 2, 4), (0, 3, 3, 4), (0, 4, 2, 4), (1, 5, 3, 3),
          (3, 6, 5, 4), (3, 7, 2, 4)]


@functools.cache
def _params():
    """The weights, committed to the first device (so the solo engine and rank 0 share their
    compiled programs); initialised in one program (op by op compiles dozens)."""
    params = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))
    return jax.device_put(params, jax.devices()[0])


def _kwargs(path):
    offload = None if path == "resident" else OffloadConfig(hot_slots=8, page_size=4,
                                                            capacity=CAPACITY, policy="ring")
    return dict(seats=SEATS, capacity=CAPACITY, offload=offload, decode_steps_per_call=2,
                prefill_chunk=8, query_block=None)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


def _solo(path):
    """Each request of STREAM alone in one single-device Engine (reused: it is empty between
    requests); its token ids. Built and run under jax.default_device(first device), as rank
    0 is (the default device is part of jit's cache key): they share their programs."""
    out = []
    with jax.default_device(jax.devices()[0]):
        engine = Engine(_params(), CONFIG, **_kwargs(path))
        for _, seed, length, max_tokens in STREAM:
            rid = engine.add_request(_prompt(seed, length), max_tokens=max_tokens)
            out.append(engine.run()[rid].token_ids)
            engine.release(rid)
    return out


def _on_device(tree, device, what):
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            assert leaf.devices() == {device}, (what, leaf.devices(), device)


def _check_placement(engine, path):
    for r, (device, e) in enumerate(zip(engine.devices, engine.engines)):
        _on_device(e.params, device, f"rank {r} params")
        _on_device(e.state, device, f"rank {r} state")
        _on_device(e.runner.seats, device, f"rank {r} seats")
        if path != "resident":
            kv = e.state.host.kv
            assert kv.sharding.memory_kind == "pinned_host", kv.sharding
            assert kv.devices() == {device}


def case_stream(path, rule):
    want = _solo(path)
    devices = jax.devices()[:RANKS]
    engine = DataParallelEngine(_params(), CONFIG, devices=devices, placement=rule,
                                **_kwargs(path))
    assert engine.placement == rule
    _check_placement(engine, path)
    ids, step, pending = {}, 0, list(range(len(STREAM)))
    while pending or engine.has_unfinished():
        while pending and STREAM[pending[0]][0] <= step:
            i = pending.pop(0)
            _, seed, length, max_tokens = STREAM[i]
            predicted, _ = engine.choose_rank(length)
            ids[i] = engine.add_request(_prompt(seed, length), max_tokens=max_tokens)
            assert engine.rank_of(ids[i]) == predicted
        engine.step()
        step += 1
        assert step < 100
    outputs = engine.run()
    ranks = [engine.rank_of(ids[i]) for i in range(len(STREAM))]
    for i, rid in ids.items():
        assert outputs[rid].token_ids == want[i], (i, outputs[rid].token_ids, want[i])
        engine.release(rid)
    assert len(set(ids.values())) == len(STREAM)
    # The first four arrive together: one per rank, the long one (first) on rank 0.
    assert ranks[:4] == [0, 1, 2, 3], ranks
    if rule == "least_context":  # rank 0 holds 8+ tokens: no later short request joins it
        assert 0 not in ranks[4:], ranks
    else:  # round robin: the next ranks in turn
        assert ranks[4:] == [0, 1, 2], ranks
    assert all(n > 0 for n in engine.placed_per_rank), engine.placed_per_rank
    _check_placement(engine, path)
    if path != "resident":
        occupancy = engine.rank_pool_occupancy()
        assert [p["held"] for p in occupancy] == [0] * RANKS, occupancy
        assert engine.pool_occupancy()["held"] == 0
        misses = engine.rank_misses()
        assert misses[0] > 0 and sum(misses) == int(np.sum(engine.stats.union)), misses
        assert engine.imbalance()["max_over_mean"] >= 1.0
    assert engine.counters["requests_finished"] == len(STREAM), engine.counters
    engine.close()
    print(f"ok {path} {rule}: ranks {ranks}, misses {engine.rank_misses()}")


def main():
    assert len(jax.devices()) >= RANKS, jax.devices()
    case_stream("ring", "least_context")
    if "--resident" in sys.argv:  # the resident path too (by hand: twice the compiles)
        case_stream("resident", "round_robin")
    print("ALL OK")


if __name__ == "__main__":
    sys.exit(main())

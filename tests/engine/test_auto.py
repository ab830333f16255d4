"""Automatic offload (fo_jax.engine.auto): requests run resident on short seats and move to
offloaded seats when they outgrow them; every request's tokens equal its solo resident run's
bit for bit, on either tier and across a move; cancel on every tier; no page leaked."""

import functools

import jax
import numpy as np
import pytest

from fo_jax.config import get_config
from fo_jax.engine.auto import AutoEngine
from fo_jax.engine.engine import Engine
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants

# The shapes of tests/engine/test_engine.py: resident seats of 16 tokens, offloaded of 32.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
CAPACITY, SHORT = 32, 16
OFFLOAD = OffloadConfig(hot_slots=8, page_size=4, capacity=CAPACITY, policy="ring")
KW = dict(decode_steps_per_call=2, prefill_chunk=8, query_block=None)


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _auto(resident_seats=1, offload_seats=1):
    return AutoEngine(_params(), CONFIG, resident_seats=resident_seats, resident_capacity=SHORT,
                      offload=OFFLOAD, offload_seats=offload_seats, **KW)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


@functools.cache
def _solo(prompt, max_tokens, temperature=0.0, seed=0):
    """The request alone on a resident engine of long seats: the reference."""
    engine = Engine(_params(), CONFIG, seats=1, capacity=CAPACITY, **KW)
    rid = engine.add_request(list(prompt), max_tokens=max_tokens, temperature=temperature,
                             seed=seed)
    out = engine.run()[rid]
    return out.token_ids, out.finish_reason


def _drive(engine, check=True):
    tiers = {}
    while engine.has_unfinished():
        for rid, tier in engine._tier.items():
            tiers.setdefault(rid, [])
            if not tiers[rid] or tiers[rid][-1] != tier:
                tiers[rid].append(tier)
        engine.step()
        if check:
            check_invariants(engine.offloaded.state, config=CONFIG, offload=OFFLOAD,
                             seats=engine.offloaded.decoding_seats())
    return tiers


def _empty_pool(engine):
    occ = engine.pool_occupancy()
    return occ["held"] == 0 and occ["free"] == occ["total"]


def test_placement_moves_and_parking_keep_every_token():
    """One resident seat of 16 tokens, one offloaded seat of 32: a prompt longer than a
    resident seat goes offloaded at once; prompt 5 + 16 tokens starts resident, outgrows its
    seat while the offloaded seat is busy, waits parked and moves; a request that fits stays
    resident; a sampled one moves too. Every request's tokens equal its solo resident run's
    bit for bit; nothing is prefilled twice; the pool is empty at the end."""
    engine = _auto()
    specs = [(_prompt(3, 20), 12, 0.0, 0), (_prompt(4, 5), 16, 0.0, 0),
             (_prompt(5, 4), 5, 0.0, 0), (_prompt(2, 9), 18, 0.9, 5)]
    ids = [engine.add_request(p, max_tokens=m, temperature=t, seed=s) for p, m, t, s in specs]
    tiers = _drive(engine)
    outputs = engine.run()
    assert tiers[ids[0]] == ["waiting", "offloaded"]
    assert tiers[ids[1]] == ["waiting", "resident", "parked", "offloaded"]
    assert tiers[ids[2]] == ["waiting", "resident"]
    assert tiers[ids[3]][:2] == ["waiting", "resident"] and tiers[ids[3]][-1] == "offloaded"
    for rid, (prompt, max_tokens, temperature, seed) in zip(ids, specs):
        assert (outputs[rid].token_ids, outputs[rid].finish_reason) == _solo(
            tuple(prompt), max_tokens, temperature, seed), rid
    assert engine.counters["migrations"] == 2 and engine.counters["parked"] >= 1
    assert engine.offloaded.counters["prefill_tokens"] == 20  # moved ones: never prefilled
    assert _empty_pool(engine)


def test_cancel_on_every_tier_frees_everything():
    engine = _auto()
    on_resident = engine.add_request(_prompt(6, 5), max_tokens=20)
    on_offloaded = engine.add_request(_prompt(7, 20), max_tokens=8)
    waiting = engine.add_request(_prompt(8, 20), max_tokens=4)
    engine.step()
    assert [engine.tier_of(r) for r in (on_resident, on_offloaded, waiting)] == [
        "resident", "offloaded", "waiting"]
    assert engine.cancel(waiting) and engine.cancel(on_offloaded)
    engine.step()
    engine.step()
    assert engine.tier_of(waiting) == "done"
    while engine.tier_of(on_resident) != "parked":  # the offloaded seat is free again:
        engine.step()                               # parked only for this step
        if engine.tier_of(on_resident) == "offloaded":
            break
    assert engine.cancel(on_resident) and not engine.cancel(on_resident)
    outputs = engine.run()
    want, _ = _solo(tuple(_prompt(6, 5)), 20)
    assert outputs[on_resident].finish_reason == "cancelled"
    assert outputs[on_resident].token_ids == want[:len(outputs[on_resident].token_ids)]
    assert {outputs[r].finish_reason for r in (on_offloaded, waiting)} == {"cancelled"}
    assert _empty_pool(engine) and engine.num_running() == 0 and not engine.has_unfinished()
    for rid in (on_resident, on_offloaded, waiting):
        assert engine.release(rid).finish_reason == "cancelled"
    with pytest.raises(KeyError, match="no request"):
        engine.cancel(waiting)


def test_bad_settings_and_requests_are_refused():
    with pytest.raises(ValueError, match=r"resident_capacity=64 must be an int in \[1, "
                                         r"offload.capacity=32\]"):
        AutoEngine(_params(), CONFIG, resident_seats=1, resident_capacity=64, offload=OFFLOAD,
                   offload_seats=1)
    engine = _auto()
    with pytest.raises(ValueError, match="does not fit a seat of 32 tokens"):
        engine.add_request(_prompt(0, 40))
    rid = engine.add_request(_prompt(0, 4), request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request(_prompt(0, 4), request_id="a")
    assert engine.num_waiting() == 1 and engine.tier_of(rid) == "waiting"

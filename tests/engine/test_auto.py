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
    with pytest.raises(ValueError, match=r"AutoEngine runs its tiers with overlap=False: it "
                                         "moves requests between them by their exact lengths"):
        AutoEngine(_params(), CONFIG, resident_seats=1, resident_capacity=16, offload=OFFLOAD,
                   offload_seats=1, overlap=True)
    engine = _auto()
    assert not engine.resident.settings.scheduler.overlap
    assert not engine.offloaded.settings.scheduler.overlap
    with pytest.raises(ValueError, match="does not fit a seat of 32 tokens"):
        engine.add_request(_prompt(0, 40))
    rid = engine.add_request(_prompt(0, 4), request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request(_prompt(0, 4), request_id="a")
    assert engine.num_waiting() == 1 and engine.tier_of(rid) == "waiting"


def test_a_request_placed_offloaded_moves_back_when_a_resident_seat_frees():
    """The resident seat is taken, so a request that fits it (prompt 4 + 10 tokens <= 16)
    starts offloaded; when the seat frees, it moves back (its rows read from its host pages,
    its pages released at once) and ends there. A greedy and a sampled one: both keep the
    tokens of their solo resident run bit for bit (the offloaded decode equals the resident
    one, and the moved request keeps its key and count)."""
    for temperature, seed in ((0.0, 0), (0.9, 3)):
        engine = _auto()
        first = engine.add_request(_prompt(10, 5), max_tokens=3)
        back = engine.add_request(_prompt(11, 4), max_tokens=10, temperature=temperature,
                                  seed=seed)
        engine.step()
        assert [engine.tier_of(r) for r in (first, back)] == ["resident", "offloaded"]
        held = []
        while engine.tier_of(back) == "offloaded" and engine.has_unfinished():
            held.append(engine.pool_occupancy()["held"])
            engine.step()
        assert engine.tier_of(back) == "resident" and max(held) > 0
        assert _empty_pool(engine)  # its pages went back to the pool with the move
        tiers = _drive(engine)
        assert tiers[back] == ["resident"]  # no move out again: its whole output fits
        outputs = engine.run()
        assert (outputs[back].token_ids, outputs[back].finish_reason) == _solo(
            tuple(_prompt(11, 4)), 10, temperature, seed)
        assert outputs[first].token_ids == _solo(tuple(_prompt(10, 5)), 3)[0]
        assert engine.counters["moved_back"] == 1 == engine.all_counters()["moved_back"]
        assert engine.counters["migrations"] == 0


def test_staggered_stream_moves_both_ways_and_keeps_every_token():
    """Requests arrive over the steps: one placed offloaded (the resident seat busy) moves
    back when it frees, outgrows the short seat and moves out again (parked while the
    offloaded seat is busy: once back, it is not moved out before its next decode call);
    a long prompt goes offloaded; later ones start resident and one of them moves out. Every
    request's tokens equal its solo resident run's bit for bit, the offloaded state's
    invariants hold at every step, and the pool is empty at the end."""
    engine = _auto()
    arrivals = {0: [(_prompt(20, 5), 6, 0.0, 0), (_prompt(21, 3), 20, 0.0, 0)],
                3: [(_prompt(22, 18), 6, 0.0, 0)],
                5: [(_prompt(23, 4), 5, 0.7, 2)],
                8: [(_prompt(24, 6), 14, 0.0, 0)]}
    specs, tiers, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for prompt, max_tokens, temperature, seed in arrivals.get(step, []):
            rid = engine.add_request(prompt, max_tokens=max_tokens, temperature=temperature,
                                     seed=seed)
            specs[rid] = (tuple(prompt), max_tokens, temperature, seed)
        for rid, tier in engine._tier.items():
            if tiers.setdefault(rid, [])[-1:] != [tier]:
                tiers[rid].append(tier)
        engine.step()
        check_invariants(engine.offloaded.state, config=CONFIG, offload=OFFLOAD,
                         seats=engine.offloaded.decoding_seats())
        step += 1
    outputs = engine.run()
    ids = list(specs)
    assert tiers[ids[1]] == ["waiting", "offloaded", "resident", "parked", "offloaded"]
    assert tiers[ids[2]] == ["waiting", "offloaded"]
    assert tiers[ids[4]] == ["waiting", "resident", "offloaded"]
    for rid, spec in specs.items():
        assert (outputs[rid].token_ids, outputs[rid].finish_reason) == _solo(*spec), rid
    assert {k: engine.counters[k] for k in ("moved_back", "migrations", "placed_offloaded")} \
        == {"moved_back": 1, "migrations": 2, "placed_offloaded": 2}
    assert _empty_pool(engine)


def test_drafts_go_to_both_tiers_and_move_with_the_request():
    """AutoEngine(num_drafts=2): both tiers verify n-gram drafts (steps of 3 ways, so one
    decode call stores up to 2 x 3 tokens: a request moves out before a call could fill its
    short seat, not only before 2 tokens could). One request drafts its way out of the
    resident seat, one placed offloaded moves back into it (its history rebuilt there:
    prompt + tokens), one ends offloaded. Every request's tokens equal those of the same
    engine serving it alone bit for bit (alone, the last two never leave the resident seat:
    the offloaded drafting decode equals the resident one)."""
    config = CONFIG.replace(max_ways=3)
    offload = OffloadConfig(hot_slots=12, page_size=4, capacity=CAPACITY, policy="ring")
    params = init_params(config, jax.random.key(0))

    def auto():
        return AutoEngine(params, config, resident_seats=1, resident_capacity=SHORT,
                          offload=offload, offload_seats=2, num_drafts=2, **KW)

    engine = auto()
    assert engine.resident.num_drafts == engine.offloaded.num_drafts == 2
    specs = [([129] * 5, 20), (_prompt(32, 4), 13), (_prompt(45, 3) * 2, 11)]
    ids = [engine.add_request(p, max_tokens=m) for p, m in specs]
    tiers = _drive(engine, check=False)
    outputs = engine.run()
    assert tiers[ids[0]] == ["waiting", "resident", "offloaded"]
    assert tiers[ids[1]] == ["waiting", "offloaded", "resident"]
    assert tiers[ids[2]] == ["waiting", "offloaded"]
    assert len(outputs[ids[0]].token_ids) == 20  # moved out in time: no early "length"
    for rid, (prompt, max_tokens) in zip(ids, specs):
        solo = auto()
        solo_id = solo.add_request(prompt, max_tokens=max_tokens)
        solo_tiers = _drive(solo, check=False)
        want = solo.run()[solo_id]
        assert solo_tiers[solo_id][-1] == ("offloaded" if rid == ids[0] else "resident")
        assert (outputs[rid].token_ids, outputs[rid].finish_reason) == (
            want.token_ids, want.finish_reason), rid
    assert engine.counters["moved_back"] == 1 and engine.counters["migrations"] == 1
    assert engine.all_counters()["draft_accepted"] > 0
    assert _empty_pool(engine)

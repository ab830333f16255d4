"""Inputs: every entry point refuses bad input with a clear error before any state changes
(or handles it), composes under an outer jit / scan / while_loop, and never writes past the
state's capacity, checked or not."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax import resident
from fo_jax.cli import main
from fo_jax.config import get_config
from fo_jax.model import dsa
from fo_jax.model.dsa import init_params, param_shapes
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload.state import DecodeState, HostPages, to_memory_kind
from fo_jax.sampling import sample

TINY = get_config("tiny")
# Two layers, one indexer each: small programs, quick to compile.
CONFIG = TINY.replace(num_layers=2, indexer_layers=(0, 1), max_ways=2, index_topk=4)
OFFLOAD = OffloadConfig(hot_slots=8, page_size=4, capacity=24)


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


# Every test runs the same few shapes (prompts [2, 22], capacity 24, steps of W = 2), so that
# the programs compile once for the file.


def _resident(lengths=(10, 7), capacity=24):
    params = _params()
    state = resident.ResidentState.create(CONFIG, batch=len(lengths), capacity=capacity)
    prompt = np.random.default_rng(0).integers(0, 256, (len(lengths), 22), np.int32)
    _, state = resident.prefill(params, state, prompt, np.asarray(lengths), config=CONFIG)
    return params, state


def _offloaded(lengths=(10, 7), offload=OFFLOAD):
    params, res = _resident(lengths, offload.capacity)
    dec = DecodeState.from_resident(res.kv, res.index_keys, res.lengths, config=CONFIG,
                                    offload=offload)
    return params, dec


def _prefill_state(batch=2, capacity=24):
    return offload_prefill.PrefillState.create(CONFIG, batch=batch, capacity=capacity,
                                               page_size=4)


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


# int64 token ids ------------------------------------------------------------------------------

BIG = [2**32 + 5, -(2**32) + 7]


@pytest.mark.parametrize("token", BIG)
@pytest.mark.parametrize("check", [True, False])
def test_int64_tokens_are_checked_before_any_cast(token, check):
    tokens = np.array([[1, 2], [token, 3]], np.int64)
    message = rf"token id {token} at \[1, 0\] is outside the vocabulary \[0, 256\)"
    params, res = _resident()
    before = _host(res)
    with pytest.raises(ValueError, match=message):
        resident.decode_step(params, res, tokens, config=CONFIG, check=check)
    with pytest.raises(ValueError, match=message):
        resident.prefill(params, res, tokens, config=CONFIG, check=check)
    chex.assert_trees_all_equal(_host(res), before)
    params, dec = _offloaded()
    before = _host(dec)
    with pytest.raises(ValueError, match=message):
        offload_decode.decode_step(params, dec, tokens, config=CONFIG, offload=OFFLOAD,
                                   check=check)
    chex.assert_trees_all_equal(_host(dec), before)
    state = _prefill_state()
    with pytest.raises(ValueError, match=message):
        offload_prefill.prefill(params, state, tokens, config=CONFIG, check=check)
    assert not state.host.kv.is_deleted()


# Donated states -------------------------------------------------------------------------------

DONATED = r"was donated to an earlier call .* use the state that call returned"


def test_a_donated_state_used_again_is_named():
    params, res = _resident()
    tokens = np.zeros((2, 2), np.int32)
    _, new = resident.decode_step(params, res, tokens, config=CONFIG)
    with pytest.raises(ValueError, match=r"decode_step: the state " + DONATED):
        resident.decode_step(params, res, tokens, config=CONFIG)
    with pytest.raises(ValueError, match=r"prefill: the state " + DONATED):
        resident.prefill(params, res, np.zeros((2, 22), np.int32), config=CONFIG)
    params, dec = _offloaded()
    _, new, _ = offload_decode.decode_step(params, dec, tokens, config=CONFIG, offload=OFFLOAD)
    with pytest.raises(ValueError, match=r"decode_step: the state " + DONATED):
        offload_decode.decode_step(params, dec, tokens, config=CONFIG, offload=OFFLOAD)
    state = _prefill_state()
    _, new = offload_prefill.prefill(params, state, np.zeros((2, 22), np.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"prefill: the state " + DONATED):
        offload_prefill.prefill(params, state, np.zeros((2, 22), np.int32), config=CONFIG)
    with pytest.raises(ValueError, match=r"to_decode_state: the state " + DONATED):
        offload_prefill.to_decode_state(state, config=CONFIG, offload=OFFLOAD)


# Capacity: never written past, checked or not --------------------------------------------------


def test_unchecked_offloaded_steps_never_pass_capacity():
    params, dec = _offloaded(lengths=(22, 19))
    host_before = dec.token_rows()
    tokens = np.full((2, 2), 9, np.int32)
    for _ in range(3):  # request 0 fills at 24, then asks for 26 and 28
        _, dec, stats = offload_decode.decode_step(params, dec, tokens, config=CONFIG,
                                                   offload=OFFLOAD, check=False)
        np.testing.assert_array_equal(np.asarray(dec.lengths) <= 24, True)
        check_invariants(dec, config=CONFIG, offload=OFFLOAD, selected=stats.selected)
    np.testing.assert_array_equal(dec.lengths, [24, 24])
    # Request 0's stored rows [0, 22) are what they were; only 22 and 23 were added.
    np.testing.assert_array_equal(dec.token_rows()[:, 0, :22], host_before[:, 0, :22])


def test_unchecked_resident_calls_never_pass_capacity():
    params, res = _resident(lengths=(22, 19))
    tokens = np.zeros((2, 2), np.int32)
    for _ in range(3):
        _, res = resident.decode_step(params, res, tokens, config=CONFIG, check=False)
    np.testing.assert_array_equal(res.lengths, [24, 24])
    _, res = resident.prefill(params, res, np.zeros((2, 22), np.int32), config=CONFIG,
                              check=False)
    np.testing.assert_array_equal(res.lengths, [24, 24])
    state = _prefill_state()
    _, state = offload_prefill.prefill(params, state, np.zeros((2, 22), np.int32),
                                       np.array([22, 30]), config=CONFIG, check=False)
    np.testing.assert_array_equal(state.lengths, [22, 22])  # at most the chunk width
    _, state = offload_prefill.prefill(params, state, np.zeros((2, 22), np.int32),
                                       config=CONFIG, check=False)
    np.testing.assert_array_equal(state.lengths, [24, 24])


@pytest.mark.parametrize("kind", ["resident", "offload"])
def test_engine_refuses_a_step_past_capacity(kind):
    params = _params()
    engine = (gen.ResidentEngine(params, CONFIG, batch=2, capacity=24) if kind == "resident"
              else gen.OffloadEngine(params, CONFIG, batch=2, offload=OFFLOAD))
    engine.prefill(np.zeros((2, 22), np.int32), np.array([21, 22]))
    engine.step(np.zeros((2, 2), np.int32))
    before = _host(engine.state)
    with pytest.raises(ValueError, match=r"request 1 holds 24 tokens; a step of 2 more needs "
                                         r"26 positions, beyond the engine's capacity of 24"):
        engine.step(np.zeros((2, 2), np.int32))
    chex.assert_trees_all_equal(_host(engine.state), before)


# Under jit, scan and while_loop ----------------------------------------------------------------

STEPS = 3


def _step_tokens():
    return jnp.asarray(np.random.default_rng(1).integers(0, 256, (STEPS, 2, 2), np.int32))


def test_offloaded_decode_composes_under_jit_scan_and_while_loop():
    tokens = _step_tokens()
    params, dec = _offloaded()
    want = []
    for t in tokens:
        logits, dec, _ = offload_decode.decode_step(params, dec, t, config=CONFIG,
                                                    offload=OFFLOAD)
        want.append(logits)
    want_logits, want_state = np.stack(want), _host(dec)

    def step(state, t):
        logits, state, _ = offload_decode.decode_step(params, state, t, config=CONFIG,
                                                      offload=OFFLOAD)
        return state, logits

    @jax.jit
    def scanned(state, tokens):
        return jax.lax.scan(step, state, tokens)

    @jax.jit
    def looped(state, tokens):
        def body(carry):
            i, state, out = carry
            state, logits = step(state, tokens[i])
            return i + 1, state, out.at[i].set(logits)

        out = jnp.zeros(want_logits.shape, want_logits.dtype)
        _, state, out = jax.lax.while_loop(lambda c: c[0] < STEPS, body, (0, state, out))
        return state, out

    for run in (scanned, looped):
        _, dec = _offloaded()
        state, logits = run(dec, tokens)
        chex.assert_trees_all_equal(np.asarray(logits), want_logits)
        chex.assert_trees_all_equal(_host(state), want_state)


def test_resident_decode_and_prefills_compose_under_jit():
    tokens = _step_tokens()
    params, res = _resident()
    want = []
    for t in tokens:
        logits, res = resident.decode_step(params, res, t, config=CONFIG)
        want.append(logits)
    want_state = _host(res)

    @jax.jit
    def scanned(state, tokens):
        return jax.lax.scan(
            lambda s, t: resident.decode_step(params, s, t, config=CONFIG)[::-1], state, tokens)

    _, res = _resident()
    state, logits = scanned(res, tokens)
    chex.assert_trees_all_equal(np.asarray(logits), np.stack(want))
    chex.assert_trees_all_equal(_host(state), want_state)

    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 22), np.int32))
    num_new = jnp.array([22, 15], jnp.int32)
    want, want_res = resident.prefill(params, resident.ResidentState.create(
        CONFIG, batch=2, capacity=24), prompt, num_new, config=CONFIG)
    got, got_res = jax.jit(lambda s, t, n: resident.prefill(params, s, t, n, config=CONFIG))(
        resident.ResidentState.create(CONFIG, batch=2, capacity=24), prompt, num_new)
    chex.assert_trees_all_equal(_host((got, got_res)), _host((want, want_res)))

    want, want_state = offload_prefill.prefill(params, _prefill_state(), prompt, num_new,
                                               config=CONFIG)
    got, got_state = jax.jit(lambda s, t, n: offload_prefill.prefill(
        params, s, t, n, config=CONFIG, history_pages=0))(_prefill_state(), prompt, num_new)
    chex.assert_trees_all_equal(_host((got, got_state)), _host((want, want_state)))


# Sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=float("nan")), r"temperature=nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite number >= 0"),
    (dict(temperature=-0.5), r"temperature=-0.5 must be a finite number >= 0"),
    (dict(top_p=float("nan")), r"top_p=nan must be a number in \(0, 1\]"),
    (dict(top_p=0.0), r"top_p=0.0 must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be a number in \(0, 1\]"),
])
def test_bad_sampling_settings_are_refused(kwargs, message):
    settings = {"temperature": 0.7, "top_p": 0.9, **kwargs}
    with pytest.raises(ValueError, match=message):
        sample(jnp.zeros((1, 4)), jax.random.key(0), **settings)
    engine = gen.ResidentEngine(_params(), CONFIG, batch=1, capacity=8)
    with pytest.raises(ValueError, match=message):
        gen.generate(engine, [[1, 2]], max_new_tokens=2, **settings)
    assert int(engine.state.lengths[0]) == 0


# Engines --------------------------------------------------------------------------------------


def test_offload_engine_summary_after_prefill_only():
    engine = gen.OffloadEngine(_params(), CONFIG, batch=2, offload=OFFLOAD)
    result = gen.generate(engine, [[1, 2, 3], list(range(22))], max_new_tokens=1)
    assert result.tokens.shape == (2, 1)
    assert result.extra["decode_steps"] == 0
    assert result.extra["hit_rate"] is None and result.extra["misses"] == 0


def test_engine_settings_follow_the_prefill_rules():
    with pytest.raises(ValueError, match=r"num_buffers=9 must be an int in \[2, 2\] "
                                         r"\(num_layers=2\)"):
        gen.OffloadEngine(_params(), CONFIG, batch=1, offload=OFFLOAD, num_buffers=9)
    for n in (1, 9):
        with pytest.raises(ValueError, match=rf"num_buffers={n} must be an int in \[2, 2\] "
                                             r"\(num_layers=2\)"):
            offload_prefill.prefill(_params(), _prefill_state(), np.zeros((2, 1), np.int32),
                                    config=CONFIG, num_buffers=n)
    with pytest.raises(NotImplementedError, match=r"TPU interpret mode"):
        gen.OffloadEngine(_params(), CONFIG, batch=1, offload=OFFLOAD, implementation="pallas")
    with pytest.raises(NotImplementedError, match=r"TPU interpret mode"):
        gen.ResidentEngine(_params(), CONFIG, batch=1, capacity=8, implementation="pallas")


def test_offload_config_accepts_numpy_integers():
    oc = OffloadConfig(hot_slots=np.int64(64), page_size=np.int32(8), capacity=np.int64(64))
    assert (oc.hot_slots, oc.page_size, oc.capacity) == (64, 8, 64)
    assert all(type(v) is int for v in (oc.hot_slots, oc.page_size, oc.capacity))
    assert oc == OffloadConfig(hot_slots=64, page_size=8, capacity=64)
    for bad in (64.0, True, "64"):
        with pytest.raises(ValueError, match=r"OffloadConfig.hot_slots must be a positive int"):
            OffloadConfig(hot_slots=bad)


def test_one_hot_slot_rule_for_plan_and_decode():
    glm52 = get_config("glm52")
    message = r"hot_slots=4096 < index_topk \* max_ways = 2048 \* 4 = 8192"
    with pytest.raises(ValueError, match=message):
        OffloadConfig(hot_slots=4096, page_size=64, capacity=128_000).validate_for(glm52)
    from fo_jax.plan import plan_capacity

    with pytest.raises(ValueError, match=message):
        plan_capacity(glm52, 128_000, hot_slots=4096)


@dataclasses.dataclass
class _Planted:
    what: str
    message: str


def _plant_nan_host(state):
    host = np.asarray(state.host.kv).copy()
    host[1, 0, 2, 5] = np.nan  # layer 1, pool page 0 (request 0's page 0: identity), token 2
    kind = state.host.kv.sharding.memory_kind
    return dataclasses.replace(state, host=HostPages(kv=to_memory_kind(jnp.asarray(host), kind)))


def _plant_bad_map(state):
    s2t = np.asarray(state.slots.slot_to_token).copy()
    s2t[0, 0, [6, 7]] = s2t[0, 0, [7, 6]]  # two slots swap tokens, token_to_slot is stale
    return dataclasses.replace(state, slots=dataclasses.replace(state.slots,
                                                                slot_to_token=jnp.asarray(s2t)))


@pytest.mark.parametrize("planted", [
    _Planted("nan", r"decode step 1: request 0: the host KV of layer 1 holds a non-finite "
                    r"value at token 2"),
    _Planted("map", r"decode step 1: invariant violated: group 0 request 0: slot \[6\]"),
])
def test_engine_check_mode_finds_a_bad_state(planted):
    engine = gen.OffloadEngine(_params(), CONFIG, batch=2, offload=OFFLOAD, check=True)
    engine.prefill(np.arange(1, 45, dtype=np.int32).reshape(2, 22), np.array([12, 22]))
    plant = _plant_nan_host if planted.what == "nan" else _plant_bad_map
    engine.state = plant(engine.state)
    with pytest.raises(gen.StateCheckError, match=planted.message):
        engine.step(np.zeros((2, 2), np.int32))


def test_resident_engine_check_mode_finds_nan():
    engine = gen.ResidentEngine(_params(), CONFIG, batch=2, capacity=24, check=True)
    engine.prefill(np.arange(1, 45, dtype=np.int32).reshape(2, 22), np.array([8, 8]))
    engine.step(np.zeros((2, 2), np.int32))  # a clean state passes
    engine.state = dataclasses.replace(engine.state,
                                       index_keys=engine.state.index_keys.at[1, 1, 3].set(
                                           jnp.inf))
    with pytest.raises(gen.StateCheckError, match=r"decode step 2: request 1: the indexer keys "
                                                  r"of group 1 hold a non-finite value at "
                                                  r"token 3"):
        engine.step(np.zeros((2, 2), np.int32))


# Parameter memory ------------------------------------------------------------------------------


def test_param_bytes_counts_every_parameter():
    got = sum(x.nbytes for x in jax.tree_util.tree_leaves(_params()))
    assert dsa.param_bytes(CONFIG) == got
    glm52 = get_config("glm52")
    # bfloat16: 2 bytes per value, the routers' float32 correction biases [L_moe, X] 4; the
    # shapes are the model's own.
    shapes = param_shapes(glm52)
    count = sum(int(np.prod(s)) for s in jax.tree_util.tree_leaves(
        shapes, is_leaf=lambda x: isinstance(x, tuple)))
    biases = int(np.prod(shapes["moe"]["gate_bias"]))
    assert dsa.param_bytes(glm52) == 2 * count + 2 * biases > 60e9


# The command ---------------------------------------------------------------------------------


def test_generate_offload_one_new_token(capsys):
    code = main(["generate", "--model", "tiny",
                 "--offload", "--max-new-tokens", "1", "--prompt", "abcde" * 6,
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no decode step ran" in out


@pytest.mark.parametrize("argv,message", [
    (["--temperature", "nan"], "temperature=nan must be a finite number >= 0"),
    (["--top-p", "nan"], "top_p=nan must be a number in (0, 1]"),
    (["--offload", "--hot-slots", "10"], "hot_slots=10 < index_topk * max_ways = 16 * 4 = 64"),
    (["--policy", "lru"], "--policy applies to the offloaded path only: add --offload"),
    (["--hot-slots", "64"], "--hot-slots applies to the offloaded path only: add --offload"),
    (["--model", "glm52"], "fo-jax plan --model glm52"),
    (["--max-param-gb", "0.0001"], "above --max-param-gb=0.0001"),
    # Estimated from the shapes before anything is allocated (it died out of memory).
    (["--batch", "1000000"], "the KV of --batch 1000000 requests of 160 tokens (61.44 GB) "
                             "take 61.44 GB with the parameters, above half of the available "
                             "memory (32.00 GB): lower --batch"),
    (["--offload", "--batch", "1000000"], "the KV of --batch 1000000 requests"),
    (["--decode-steps-per-call", "0"], "decode_steps_per_call=0 must be an int >= 1"),
    (["--offload", "--check", "--decode-steps-per-call", "2"],
     "--check compares the logits of every step with the resident model's: use "
     "--decode-steps-per-call 1"),
])
def test_generate_refuses_before_running(capsys, monkeypatch, argv, message):
    def refuse(*_, **__):
        raise AssertionError("parameters were built before the input was checked")

    monkeypatch.setattr("fo_jax.model.dsa.init_params", refuse)
    monkeypatch.setattr("fo_jax.resolve.available_bytes", lambda: 64e9)  # any machine alike
    assert main(["generate", "--model", "tiny", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "page_size" not in err


def test_plan_refuses_hot_slots_decode_refuses(capsys):
    assert main(["plan", "--model", "glm52", "--context", "128000", "--hot-slots", "4096"]) == 2
    assert "hot_slots=4096 < index_topk * max_ways = 2048 * 4 = 8192" in capsys.readouterr().err


@pytest.mark.parametrize("offload", [[], ["--offload"]])
def test_pallas_on_cpu_is_refused_before_prefill(capsys, monkeypatch, offload):
    def refuse(*_, **__):
        raise AssertionError("prefill ran")

    monkeypatch.setattr(gen.OffloadEngine, "prefill", refuse)
    monkeypatch.setattr(gen.ResidentEngine, "prefill", refuse)
    assert main(["generate", "--model", "tiny",
                 "--no-progress", "--implementation", "pallas", *offload]) == 2
    assert "TPU interpret mode" in capsys.readouterr().err


def test_generate_check_mode_reports_a_bad_state(capsys, monkeypatch):
    original = gen.OffloadEngine.prefill

    def planted(self, tokens, lengths):
        logits = original(self, tokens, lengths)
        self.state = _plant_bad_map(self.state)
        return logits

    monkeypatch.setattr(gen.OffloadEngine, "prefill", planted)
    code = main(["generate", "--model", "tiny",
                 "--offload", "--check", "--max-new-tokens", "3", "--prompt",
                 "abcde" * 6, "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert "CHECK FAILED: decode step 1: invariant violated: group 0 request 0" in out

"""The generation loop over both engines (sampling itself: tests/test_sampling.py)."""

import jax
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax.config import get_config
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

CONFIG = get_config("tiny")


def test_offload_engine_generates_the_resident_tokens():
    params = init_params(CONFIG, jax.random.key(0))
    prompts = [list(range(40, 90)), list(range(100, 133))]
    kwargs = dict(max_new_tokens=12, temperature=0.7, top_p=0.9, key=jax.random.key(3))
    res = gen.generate(gen.ResidentEngine(params, CONFIG, batch=2, capacity=128), prompts,
                       **kwargs)
    offload = OffloadConfig(hot_slots=64, page_size=8, capacity=128)
    off = gen.generate(gen.OffloadEngine(params, CONFIG, offload=offload, batch=2), prompts,
                       **kwargs)
    np.testing.assert_array_equal(off.tokens, res.tokens)
    np.testing.assert_array_equal(off.context_length, [61, 44])
    assert 0 <= off.extra["hit_rate"] <= 1 and off.extra["h2d_bytes_per_token"] >= 0
    assert off.device_kv_bytes < res.device_kv_bytes


def test_decode_steps_per_call_gives_the_same_tokens():
    # N = 4 steps per compiled call (sampling on the device) against one step per call: the
    # same tokens, lengths and offload totals; 11 steps take calls of 4, 4 and 3 (the last one
    # ends early on max_new_tokens).
    params = init_params(CONFIG, jax.random.key(0))
    prompts = [list(range(40, 90)), list(range(100, 133))]
    kwargs = dict(max_new_tokens=12, temperature=0.7, top_p=0.9, key=jax.random.key(3))
    offload = OffloadConfig(hot_slots=64, page_size=8, capacity=128)
    for make in (lambda: gen.ResidentEngine(params, CONFIG, batch=2, capacity=128),
                 lambda: gen.OffloadEngine(params, CONFIG, offload=offload, batch=2)):
        one = make()
        want = gen.generate(one, prompts, **kwargs)
        engine = make()
        got = gen.generate(engine, prompts, decode_steps_per_call=4, **kwargs)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(engine.lengths, one.lengths)
        assert engine.steps == one.steps == 11
        assert got.extra == want.extra
    greedy = dict(kwargs, temperature=0.0)
    np.testing.assert_array_equal(
        gen.generate(engine, prompts, decode_steps_per_call=4, **greedy).tokens,
        gen.generate(make(), prompts, **greedy).tokens)
    with pytest.raises(ValueError, match=r"decode_steps_per_call=0 must be an int >= 1 \(decode "
                                         r"steps per compiled call; 1 = one step per call\)"):
        gen.generate(engine, prompts, decode_steps_per_call=0, **kwargs)
    with pytest.raises(ValueError, match=r"on_step sees the logits of every step; a decode loop "
                                         r"of decode_steps_per_call=2 keeps them on the device"):
        gen.generate(engine, prompts, decode_steps_per_call=2, on_step=print, **kwargs)
    checked = gen.OffloadEngine(params, CONFIG, offload=offload, batch=2, check=True)
    with pytest.raises(ValueError, match=r"check mode reads the state back after every step: "
                                         r"use decode_steps_per_call=1 \(got 2\)"):
        gen.generate(checked, prompts, decode_steps_per_call=2, **kwargs)


def test_generate_validates_before_running():
    params = init_params(CONFIG, jax.random.key(0))
    engine = gen.ResidentEngine(params, CONFIG, batch=1, capacity=32)
    with pytest.raises(ValueError, match=r"needs 39 positions; the engine holds 32"):
        gen.generate(engine, [[1] * 30], max_new_tokens=10)
    with pytest.raises(ValueError, match=r"max_new_tokens=0 must be >= 1"):
        gen.generate(engine, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"every prompt needs at least one token"):
        gen.generate(engine, [[]], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"token id 300 at \[0, 0\]"):
        gen.generate(engine, [[300]], max_new_tokens=1)
    assert int(engine.state.lengths[0]) == 0


def test_engines_prefill_long_prompts_in_chunks(monkeypatch):
    # Chunks of 16 tokens: prompts of 50 and 33 tokens take 4 prefill calls (the second request
    # has no new tokens in the last one). The last token's logits are those of one call over
    # the whole prompt (to rounding: other program shapes), and offloaded == resident bit for
    # bit under the same chunking.
    from fo_jax import resident
    from fo_jax.offload import prefill as offload_prefill

    params = init_params(CONFIG, jax.random.key(0))
    tokens, lengths = gen.pad_prompts([list(range(40, 90)), list(range(100, 133))])
    calls = []
    for module in (resident, offload_prefill):
        real = module.prefill
        monkeypatch.setattr(module, "prefill", lambda *a, real=real, **k: (
            calls.append(np.asarray(a[3]).tolist()), real(*a, **k))[1])
    whole = gen.ResidentEngine(params, CONFIG, batch=2, capacity=128, prefill_chunk=None)
    want = np.asarray(whole.prefill(tokens, lengths))
    assert calls == [[50, 33]]
    calls.clear()
    chunked = gen.ResidentEngine(params, CONFIG, batch=2, capacity=128, prefill_chunk=16)
    got = np.asarray(chunked.prefill(tokens, lengths))
    assert calls == [[16, 16], [16, 16], [16, 1], [2, 0]]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(chunked.state.lengths, [50, 33])
    offload = OffloadConfig(hot_slots=64, page_size=8, capacity=128)
    engine = gen.OffloadEngine(params, CONFIG, offload=offload, batch=2, prefill_chunk=16)
    np.testing.assert_array_equal(np.asarray(engine.prefill(tokens, lengths)), got)
    # By default a prompt is cut into chunks of PREFILL_CHUNK tokens.
    assert gen.ResidentEngine(params, CONFIG, batch=1, capacity=8).prefill_chunk == \
        gen.PREFILL_CHUNK
    with pytest.raises(ValueError, match=r"prefill_chunk=0 must be an int >= 1 \(prompt tokens "
                                         r"per prefill call\), or None for the whole prompt"):
        gen.OffloadEngine(params, CONFIG, offload=offload, batch=2, prefill_chunk=0)


def test_engines_step_with_the_decode_loops_steps():
    """One decode core: the engines `generate` drives (fo_jax.batch_engines, re-exported by
    fo_jax.generate) step with the step objects the decode loop runs, one each, so a step from
    the host and a step inside `decode_loop` are the same program's step."""
    from fo_jax import batch_engines
    from fo_jax.decode_loop import OffloadedStep, ResidentStep

    assert gen.ResidentEngine is batch_engines.ResidentEngine
    assert gen.OffloadEngine is batch_engines.OffloadEngine
    params = init_params(CONFIG, jax.random.key(0))
    res = gen.ResidentEngine(params, CONFIG, batch=1, capacity=16)
    off = gen.OffloadEngine(params, CONFIG, batch=1,
                            offload=OffloadConfig(hot_slots=64, page_size=8, capacity=16))
    for engine, kind in ((res, ResidentStep), (off, OffloadedStep)):
        assert isinstance(engine.loop_step(), kind) and engine.loop_step() is engine.loop_step()
        calls = []
        step = engine.loop_step()
        engine._loop_step = lambda *a, step=step, **k: (calls.append(1), step(*a, **k))[1]
        engine.prefill(np.asarray([[40, 41, 42]]), np.asarray([3]))
        logits = engine.step(np.asarray([[43]]))
        assert calls == [1] and logits.shape == (1, 1, CONFIG.vocab_size)

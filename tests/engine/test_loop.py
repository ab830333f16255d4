"""The jit-compiled decode loop (fo_jax.decode_loop): tokens bit for bit those of a Python loop
of single steps, stop tokens and per-request limits that freeze a finished request's state,
early exit, statistics summed on the device, the state updated in place in the loop body."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import hlo_checks
from fo_jax import resident
from fo_jax.config import get_config
from fo_jax import decode_loop as loop
from fo_jax.decode_loop import OffloadedStep, ResidentStep, Seats, decode_loop
from fo_jax.model.dsa import init_params
from fo_jax.offload import decode as offload_decode
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState
from fo_jax.sampling import Sampling, sample

# Two layers sharing one indexer (one group: the smallest program), top-4 of at most 24
# positions: quick to compile.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
CAPACITY = 24
FIRST = np.array([3, 7], np.int32)  # the tokens each request sampled last (fed first)
STEPS = 4  # every loop here runs N = 4: one program per path


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _offload(policy="ring"):
    return OffloadConfig(hot_slots=8, page_size=4, capacity=CAPACITY, policy=policy)


def _state(path, lengths=(10, 7)):
    """A state holding random history (the same every time) for `path`: "resident" or a
    policy name. Random rows instead of a prefill: one program less to compile."""
    rng = np.random.default_rng(0)
    batch = len(lengths)
    kv = rng.standard_normal((CONFIG.num_layers, batch, CAPACITY, CONFIG.kv_width))
    keys = rng.standard_normal((CONFIG.num_groups, batch, CAPACITY, CONFIG.index_head_dim))
    state = resident.ResidentState(kv=jnp.asarray(kv, CONFIG.jnp_kv_dtype),
                                   index_keys=jnp.asarray(keys, CONFIG.jnp_kv_dtype),
                                   lengths=jnp.asarray(lengths, jnp.int32))
    if path == "resident":
        return state
    return DecodeState.from_resident(state.kv, state.index_keys, state.lengths, config=CONFIG,
                                     offload=_offload(path))


def _step(path):
    return ResidentStep(CONFIG) if path == "resident" else OffloadedStep(CONFIG, _offload(path))


def _python_loop(path, state, n, *, temperature, top_p, key, logits_out=None):
    """The reference: n jitted single steps from Python, sampled by fo_jax.sampling.sample
    (each step's logits [B, V] appended to `logits_out` when given)."""
    step = _step(path)
    tokens, out, stats = jnp.asarray(FIRST), [], []
    for _ in range(n):
        logits, state, st = step(_params(), state, tokens[:, None], None)
        if logits_out is not None:
            logits_out.append(np.asarray(logits[:, -1], np.float32))
        key, sub = jax.random.split(key)
        tokens = sample(logits[:, -1], sub, temperature=temperature, top_p=top_p)
        out.append(np.asarray(tokens))
        stats.append(st)
    return np.stack(out, axis=1), state, stats


def _seats(state, sampling, key):
    return Seats.create(FIRST, key, sampling=sampling, lengths=state.lengths,
                        capacity=state.capacity)


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


SAMPLINGS = {"greedy": dict(temperature=0.0, top_p=1.0),
             "sampled": dict(temperature=0.8, top_p=0.9)}


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("path", ["resident", "ring", "random"])
def test_loop_equals_the_python_loop_of_single_steps(path, sampling):
    kwargs = SAMPLINGS[sampling]
    want, want_state, want_stats = _python_loop(path, _state(path), STEPS,
                                                key=jax.random.key(4), **kwargs)
    state = _state(path)
    settings = Sampling.create(2, **kwargs)
    out, state, seats = decode_loop(_params(), state, _seats(state, settings, jax.random.key(4)),
                                    STEPS, settings, step=_step(path))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    assert int(out.num_steps) == STEPS
    np.testing.assert_array_equal(out.fed, [STEPS, STEPS])
    np.testing.assert_array_equal(seats.tokens, want[:, -1])
    np.testing.assert_array_equal(seats.generated, [STEPS + 1] * 2)
    chex.assert_trees_all_equal(_host(state), _host(want_state))
    if path == "resident":
        assert out.stats is None
        return
    # Statistics summed on the device equal the sums of the single steps' statistics.
    for name in ("hits", "tail_hits", "misses", "union", "h2d_bytes", "d2h_bytes"):
        total = sum(np.asarray(getattr(s, name)) for s in want_stats)
        np.testing.assert_array_equal(np.asarray(getattr(out.stats, name)), total, err_msg=name)
    assert int(out.stats.misses.sum()) > 0 and int(out.stats.hits.sum()) > 0


TOP = 3  # top log-probabilities per token in the logprobs tests


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_logprobs_are_the_steps_log_softmax_and_leave_the_tokens_alone(sampling):
    """decode_loop(..., logprobs=K): [B, N, K + 1] values and ids per token: column 0 the
    sampled token's log-probability, columns 1..K the K most likely tokens', descending, all
    log_softmax of the step's raw logits (before temperature and top_p); the tokens are those
    of the same loop without logprobs, bit for bit. The reference: single steps' logits."""
    kwargs = SAMPLINGS[sampling]
    logits = []
    want, _, _ = _python_loop("resident", _state("resident"), STEPS, key=jax.random.key(4),
                              logits_out=logits, **kwargs)
    settings = Sampling.create(2, **kwargs)
    state = _state("resident")
    plain, _, _ = decode_loop(_params(), state, _seats(state, settings, jax.random.key(4)),
                              STEPS, settings, step=_step("resident"))
    assert plain.logprobs is None and plain.logprob_ids is None
    state = _state("resident")
    out, _, _ = decode_loop(_params(), state, _seats(state, settings, jax.random.key(4)),
                            STEPS, settings, step=_step("resident"), logprobs=TOP)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    values, ids = np.asarray(out.logprobs), np.asarray(out.logprob_ids)
    assert values.shape == ids.shape == (2, STEPS, TOP + 1)
    assert values.dtype == np.float32 and ids.dtype == np.int32
    reference = np.asarray(jax.nn.log_softmax(jnp.asarray(np.stack(logits, axis=1)), axis=-1))
    np.testing.assert_array_equal(ids[:, :, 0], want)
    np.testing.assert_allclose(values[:, :, 0],
                               np.take_along_axis(reference, want[..., None], -1)[..., 0],
                               rtol=0, atol=1e-5)
    top = np.argsort(-reference, axis=-1, kind="stable")[..., :TOP]
    np.testing.assert_array_equal(ids[:, :, 1:], top)
    np.testing.assert_allclose(values[:, :, 1:], np.take_along_axis(reference, top, -1),
                               rtol=0, atol=1e-5)


def test_loop_over_several_calls_and_per_request_keys():
    # Per-request keys: each request splits its own key and samples its row alone, so its
    # tokens are those of sample(logits[b:b + 1], its sub-key); a second call continues where
    # the first stopped (same program).
    keys = jax.random.split(jax.random.key(7), 2)
    step = _step("ring")
    state, tokens, want = _state("ring"), jnp.asarray(FIRST), []
    ref_keys = list(keys)
    for _ in range(2 * STEPS):
        logits, state, _ = step(_params(), state, tokens[:, None], None)
        row_tokens = []
        for b in range(2):
            ref_keys[b], sub = jax.random.split(ref_keys[b])
            row_tokens.append(int(sample(logits[b:b + 1, -1], sub, **SAMPLINGS["sampled"])[0]))
        tokens = jnp.asarray(row_tokens, jnp.int32)
        want.append(row_tokens)
    state = _state("ring")
    settings = Sampling.create(2, **SAMPLINGS["sampled"])
    seats = _seats(state, settings, keys)
    first, state, seats = decode_loop(_params(), state, seats, STEPS, settings, step=step)
    second, state, seats = decode_loop(_params(), state, seats, STEPS, settings, step=step)
    got = np.concatenate([np.asarray(first.tokens), np.asarray(second.tokens)], axis=1)
    np.testing.assert_array_equal(got, np.asarray(want).T)
    chex.assert_trees_all_equal(jax.random.key_data(seats.keys),
                                jax.random.key_data(jnp.stack(ref_keys)))


def _rows(state, b):
    """Every per-request leaf of an offloaded state at request b (the batch is axis 1 of the
    [L|G, B, ...] arrays, axis 0 of lengths); the batch-wide step counter and key left out."""
    return {
        "host.kv": state.token_rows()[:, b],  # read through the page table
        "hot": np.asarray(state.hot[:, b]),
        "index_keys": state.token_index_keys()[:, b],
        "token_to_slot": np.asarray(state.slots.token_to_slot[:, b]),
        "slot_to_token": np.asarray(state.slots.slot_to_token[:, b]),
        "stamp": np.asarray(state.policy.stamp[:, b]),
        "hand": np.asarray(state.policy.hand[:, b]),
        "lengths": np.asarray(state.lengths[b]),
    }


def test_stop_tokens_and_max_new_tokens_freeze_finished_requests():
    kwargs = SAMPLINGS["sampled"]
    want, _, _ = _python_loop("ring", _state("ring"), 2 * STEPS, key=jax.random.key(1), **kwargs)
    # Request 1 stops at the first token of its reference that it had not sampled before, from
    # its third step on; request 0 may sample 3 tokens in all (2 steps).
    k = next(i for i in range(2, 2 * STEPS - 1)
             if want[1, i] not in want[1, :i] and want[1, i] != FIRST[1])
    settings = Sampling.create(2, **kwargs, stop_tokens=[[], [int(want[1, k])]],
                               max_new_tokens=[3, 100])
    state = _state("ring")
    seats = _seats(state, settings, jax.random.key(1))
    step = _step("ring")
    first, state, seats = decode_loop(_params(), state, seats, STEPS, settings, step=step)
    np.testing.assert_array_equal(np.asarray(first.tokens)[0], list(want[0, :2]) + [-1, -1])
    np.testing.assert_array_equal(np.asarray(first.tokens)[1, :min(k + 1, STEPS)],
                                  want[1, :min(k + 1, STEPS)])
    assert bool(seats.done[0])
    assert int(state.lengths[0]) == 12
    frozen = _rows(state, 0)
    # The first call ran its 4 steps unless request 1 had stopped already.
    assert int(first.num_steps) == min(k + 1, STEPS)
    rest = k + 1 - int(first.num_steps)
    second, state, seats = decode_loop(_params(), state, seats, STEPS, settings, step=step)
    # Request 1 sampled its stop token at step k + 1 overall: the loop ended there.
    assert int(second.num_steps) == rest
    np.testing.assert_array_equal(np.asarray(second.tokens)[1, :rest], want[1, STEPS:k + 1])
    assert (np.asarray(second.tokens)[0] == -1).all()
    assert (np.asarray(second.tokens)[1, rest:] == -1).all()
    np.testing.assert_array_equal(second.fed, [0, rest])
    np.testing.assert_array_equal(seats.done, [True, True])
    # Nothing of the finished request changed: length, host pages, hot cache, maps, policy.
    chex.assert_trees_all_equal(_rows(state, 0), frozen)
    assert int(state.lengths[1]) == 7 + k + 1
    stopped = _rows(state, 1)
    third, state, _ = decode_loop(_params(), state, seats, STEPS, settings, step=step)
    assert int(third.num_steps) == 0 and (np.asarray(third.tokens) == -1).all()
    chex.assert_trees_all_equal(_rows(state, 1), stopped)
    # The statistics count only the active requests.
    assert int(second.stats.hits[:, 0].sum() + second.stats.misses[:, 0].sum()) == 0
    assert float(second.stats.d2h_bytes[0]) == 0


def test_early_exit_on_capacity_and_max_new_tokens():
    # Resident, 21 and 22 tokens held of 24: request 0 is full after 3 steps, request 1 after
    # 2; a loop of 4 steps runs 3.
    state = _state("resident", lengths=(21, 22))
    settings = Sampling.create(2)
    out, state, seats = decode_loop(_params(), state, _seats(state, settings,
                                                             jax.random.key(0)),
                                    STEPS, settings, step=_step("resident"))
    assert int(out.num_steps) == 3
    np.testing.assert_array_equal(state.lengths, [CAPACITY, CAPACITY])
    tokens = np.asarray(out.tokens)
    assert (tokens[0, :3] >= 0).all() and (tokens[0, 3:] == -1).all()
    assert (tokens[1, :2] >= 0).all() and (tokens[1, 2:] == -1).all()
    # Offloaded: max_new_tokens 2 and 3 (the first token counts): 2 steps, the step counter too.
    state = _state("ring")
    settings = Sampling.create(2, max_new_tokens=[2, 3])
    out, state, _ = decode_loop(_params(), state, _seats(state, settings, jax.random.key(0)),
                                STEPS, settings, step=_step("ring"))
    assert int(out.num_steps) == 2 and int(state.step) == 3
    np.testing.assert_array_equal(out.fed, [1, 2])
    np.testing.assert_array_equal(state.lengths, [11, 9])


def test_decode_step_active_flags_leave_inactive_requests_alone():
    state = _state("ring")
    before = _rows(state, 1)
    # debug=True: the on-device invariant checks (fo_jax.offload.checks) hold after the step.
    _, state, stats = offload_decode.decode_step(
        _params(), state, FIRST[:, None], config=CONFIG, offload=_offload(),
        active=np.array([True, False]), debug=True)
    chex.assert_trees_all_equal(_rows(state, 1), before)
    np.testing.assert_array_equal(state.lengths, [11, 7])
    assert int(stats.hits[:, 1].sum() + stats.misses[:, 1].sum()) == 0
    assert (np.asarray(stats.selected)[:, 1] == -1).all()
    assert (np.asarray(stats.selected)[:, 0] >= 0).any()
    with pytest.raises(ValueError, match=r"active must be a \[2\] bool array \(one flag per "
                                         r"request: False = the request takes no token\), got "
                                         r"int64\[2\]"):
        resident.decode_step(_params(), _state("resident"), FIRST[:, None], config=CONFIG,
                             active=[1, 0])


@pytest.mark.parametrize("call,message", [
    (lambda s, seats, cfg: decode_loop(_params(), s, seats, 0, cfg, step=_step("ring")),
     r"n_steps=0 must be an int >= 1 \(decode steps per call\)"),
    (lambda s, seats, cfg: decode_loop(_params(), s, seats, 2, Sampling.create(3),
                                       step=_step("ring")),
     r"sampling hold 3 requests but the state holds 2: build them for the same batch"),
    (lambda s, seats, cfg: decode_loop(_params(), s, seats, 2, cfg, step=_step("resident")),
     r"ResidentStep steps a ResidentState, got DecodeState"),
    (lambda s, seats, cfg: Seats.create(FIRST, jax.random.PRNGKey(0), sampling=cfg,
                                        lengths=s.lengths, capacity=CAPACITY),
     r"keys must be typed PRNG keys \(jax.random.key\(seed\)"),
    (lambda s, seats, cfg: Sampling.create(2, temperature=[0.5, -1.0]),
     r"temperature=-1.0 of request 1 must be a finite number >= 0"),
    (lambda s, seats, cfg: Sampling.create(2, top_p=[1.0, 0.0]),
     r"top_p=0.0 of request 1 must be a number in \(0, 1\]"),
    (lambda s, seats, cfg: Sampling.create(2, max_new_tokens=[0, 3]),
     r"max_new_tokens=0 of request 0 must be >= 1"),
    (lambda s, seats, cfg: Sampling.create(2, stop_tokens=[[1], [-3]]),
     r"stop_tokens of request 1 must be token ids >= 0, got \[-3\]"),
    (lambda s, seats, cfg: decode_loop(_params(), s, seats, 2, cfg, step=_step("ring"),
                                       logprobs=True),
     r"logprobs=True must be None \(no log-probabilities\) or an int in \[0, vocab_size="),
    (lambda s, seats, cfg: decode_loop(_params(), s, seats, 2, cfg, step=_step("ring"),
                                       logprobs=CONFIG.vocab_size + 1),
     rf"logprobs={CONFIG.vocab_size + 1} must be None \(no log-probabilities\) or an int in "
     rf"\[0, vocab_size={CONFIG.vocab_size}\]"),
])
def test_bad_loop_arguments_are_refused(call, message):
    state = _state("ring")
    settings = Sampling.create(2)
    seats = _seats(state, settings, jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        call(state, seats, settings)
    assert not state.hot.is_deleted()


# The loop body updates the state in place -------------------------------------------------------

# Distinctive shapes (as in tests/offload/test_decode_hlo.py): B = 3, C = 36, Z = 4, S = 96; the
# loop's own arrays ([B, N] tokens, [G, B, 1] stats, [B] seats) share no state leaf's shape.
# The hands and the random policy's key are O(B) counters (as in that file): not checked.
HLO_BATCH, HLO_STEPS = 3, 5
COUNTERS = ("lengths", "step", "policy.hand", "policy.key")


@pytest.mark.parametrize("path", ["ring", "resident"])
def test_loop_carries_the_state_in_place(path):
    config = CONFIG
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    if path == "resident":
        state = resident.ResidentState.create(config, batch=HLO_BATCH, capacity=96)
        step, ignore = ResidentStep(config), ("lengths",)
    else:
        offload = OffloadConfig(hot_slots=36, page_size=4, capacity=96, policy=path)
        state = DecodeState.create(config, offload, batch=HLO_BATCH)
        step, ignore = OffloadedStep(config, offload), COUNTERS
    settings = Sampling.create(HLO_BATCH, temperature=0.5, stop_tokens=[1, 2])
    seats = Seats.create(np.zeros(HLO_BATCH, np.int32), jax.random.key(0), sampling=settings,
                         lengths=np.zeros(HLO_BATCH), capacity=96)
    compiled = hlo_checks.compile_call(loop, "loop_jit", decode_loop, params, state,
                                       seats, HLO_STEPS, settings, step=step,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    assert " while(" in compiled.as_text()
    hlo_checks.assert_no_state_copies(compiled, state, ignore=ignore)
    hlo_checks.assert_donation_aliased(compiled, state, ignore=ignore)

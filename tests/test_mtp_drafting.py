"""The MTP layer as a drafter: hidden states, the MTP step, greedy-exact drafting, rollback."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax import resident
from fo_jax.checkpoints.hf import load_checkpoint
from fo_jax.drafting import MTPDrafter, make_drafter
from fo_jax.offload.config import OffloadConfig
from fo_jax.resident import mtp_step

# The parity fixture: DeepSeek-V3.2 of 3 layers (MoE, indexer per layer) with its MTP layer.
PARITY = os.path.join(os.path.dirname(__file__), "fixtures", "parity", "deepseek_v32")
PROMPTS = [list(range(40, 70)), list(range(100, 121))]
NEW = 12
CAPACITY = 30 + NEW - 1


@pytest.fixture(scope="module")
def model():
    return load_checkpoint(PARITY, progress=False, mtp=True)


def _engine(model, **kw):
    config, params, mtp = model
    return gen.ResidentEngine(params, config, batch=2, capacity=CAPACITY, mtp=mtp, **kw)


def test_hidden_states_leave_the_logits_bitwise_unchanged(model):
    config, params, _ = model
    tokens, lengths = gen.pad_prompts(PROMPTS)
    runs = []
    for hidden in (False, True):
        state = resident.ResidentState.create(config, batch=2, capacity=CAPACITY)
        out = resident.prefill(params, state, tokens, lengths, config=config,
                               return_hidden=hidden)
        logits, state = out[:2]
        step = resident.decode_step(params, state, [[1, 2, 3, 4], [4, 5, 6, 7]],
                                    config=config, return_hidden=hidden)
        runs.append((out, step))
    (p0, s0), (p1, s1) = runs
    np.testing.assert_array_equal(np.asarray(p0[0]), np.asarray(p1[0]))
    np.testing.assert_array_equal(np.asarray(s0[0]), np.asarray(s1[0]))
    assert len(p0) == 2 and p1[2].shape == (2, 30, config.dim)
    assert s1[2].shape == (2, 4, config.dim)


def test_mtp_greedy_drafting_gives_the_w1_greedy_tokens(model):
    config = model[0]
    want = gen.generate(_engine(model), PROMPTS, max_new_tokens=NEW)
    for num_drafts in (1, 3):
        got = gen.generate(_engine(model), PROMPTS, max_new_tokens=NEW, drafter="mtp",
                           num_drafts=num_drafts)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.context_length, want.context_length)
        extra = got.extra
        assert extra["draft"] == "mtp" and extra["num_drafts"] == num_drafts
        assert extra["tokens_per_step"] >= 1
        print(f"num_drafts={num_drafts}: {extra['tokens_per_step']:.2f} tokens per step, "
              f"accepted {extra['accepted_drafts']} of {extra['proposed_drafts']}")
    assert config.num_nextn_predict_layers == 1


def test_offloaded_mtp_drafting_gives_the_w1_greedy_tokens(model):
    """The offloaded engine returns the hidden states too (decode step and prefill): MTP
    drafts verified offloaded give the resident W = 1 greedy tokens."""
    config, params, mtp = model
    offload = OffloadConfig(hot_slots=config.index_topk * config.max_ways, page_size=8,
                            capacity=48)
    want = gen.generate(_engine(model), PROMPTS, max_new_tokens=NEW)
    engine = gen.OffloadEngine(params, config, offload=offload, batch=2, mtp=mtp)
    got = gen.generate(engine, PROMPTS, max_new_tokens=NEW, drafter="mtp", num_drafts=2)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.extra["draft"] == "mtp"


def test_models_without_mtp_are_refused(model):
    config, params, _ = model
    plain = gen.ResidentEngine(params, config, batch=2, capacity=CAPACITY)
    with pytest.raises(ValueError, match=r"drafter='mtp' needs the multi-token-prediction layer "
                       r"of the model .* has no MTP layer loaded: load it with "
                       r"load_checkpoint\(\.\.\., mtp=True\) and pass it as "
                       r"ResidentEngine\(\.\.\., mtp=\.\.\.\)"):
        gen.generate(plain, PROMPTS, max_new_tokens=4, drafter="mtp")
    assert isinstance(make_drafter("mtp", config, engine=_engine(model)), MTPDrafter)


def _stored(state):
    """What a state holds on its stored positions (numpy), per request."""
    lengths = np.asarray(state.lengths)
    kv, keys = np.asarray(state.kv), np.asarray(state.index_keys)
    return lengths, [(kv[:, b, :n], keys[:, b, :n]) for b, n in enumerate(lengths)]


def test_chained_drafts_leave_no_trace_in_the_mtp_state(model):
    # Two drafters see the same prefill and the same verification step; one chained two
    # drafts through the MTP layer in between (rolled back by observe), the other none.
    config, params, mtp = model
    engine = _engine(model)
    tokens, lengths = gen.pad_prompts(PROMPTS)
    logits, hidden = engine.prefill(tokens, lengths, hidden=True)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drafters = [MTPDrafter(params, mtp, config, batch=2, capacity=CAPACITY) for _ in range(2)]
    for d in drafters:
        d.start(hidden, tokens, lengths, first)
    chained = drafters[0].propose(PROMPTS, 3)
    plain = drafters[1].propose(PROMPTS, 1)
    np.testing.assert_array_equal(chained[:, :1], plain)
    assert np.all(np.asarray(drafters[0].state.lengths) == lengths + 2)
    fed = np.concatenate([np.asarray(first)[:, None], chained], axis=1)
    step_logits, step_hidden = engine.step(fed, hidden=True)
    greedy = np.asarray(jnp.argmax(step_logits, axis=-1)).astype(np.int32)
    keep = np.array([2, 1])
    for d in drafters:
        d.observe(step_hidden, greedy, keep)
    (la, a), (lb, b) = _stored(drafters[0].state), _stored(drafters[1].state)
    np.testing.assert_array_equal(la, lengths + keep)
    np.testing.assert_array_equal(la, lb)
    for (kv_a, ik_a), (kv_b, ik_b) in zip(a, b):
        np.testing.assert_array_equal(kv_a, kv_b)
        np.testing.assert_array_equal(ik_a, ik_b)
    np.testing.assert_array_equal(drafters[0].propose(PROMPTS, 1), drafters[1].propose(PROMPTS, 1))


def test_mtp_step_pairs_match_one_at_a_time(model):
    # Feeding the prompt's pairs at once or one by one: the same logits up to rounding, one
    # cache row per pair. (The shapes of the generation tests: their programs are reused.)
    config, params, mtp = model
    engine = _engine(model)
    tokens, lengths = gen.pad_prompts(PROMPTS)
    _, hidden = engine.prefill(tokens, lengths, hidden=True)
    from fo_jax.resident import create_mtp_state

    nxt = jnp.asarray(np.roll(tokens, -1, axis=1), jnp.int32)
    state = create_mtp_state(config, batch=2, capacity=CAPACITY)
    whole, _, state = mtp_step(params, mtp, state, hidden, nxt, jnp.asarray(lengths),
                               config=config, query_block=resident.QUERY_BLOCK)
    assert np.asarray(state.lengths).tolist() == lengths.tolist()
    state = create_mtp_state(config, batch=2, capacity=CAPACITY)
    for i in range(int(lengths.min())):
        one, _, state = mtp_step(params, mtp, state, hidden[:, i:i + 1], nxt[:, i:i + 1],
                                 jnp.ones((2,), jnp.int32), config=config)
        np.testing.assert_allclose(np.asarray(one[:, 0]), np.asarray(whole[:, i]),
                                   rtol=2e-5, atol=2e-5)


def _copy_mtp(params, mtp):
    """An MTP layer that repeats the main model's prediction: eh_proj passes hnorm(h) through,
    the decoder layer adds nothing (zero attention output and MLP), shared_head.norm is the
    model's final norm; so its logits at pair (h_i, t_{i+1}) are the main logits at i (up to a
    second RMS normalisation's rounding) and its drafts repeat the last greedy token."""
    dim = mtp["enorm"].shape[-1]
    out = jax.tree_util.tree_map(lambda a: a, mtp)
    out["eh_proj"] = jnp.concatenate([jnp.zeros((1, dim, dim)), jnp.eye(dim)[None]], axis=1
                                     ).astype(mtp["eh_proj"].dtype)
    out["layers"] = {**mtp["layers"], "wo": jnp.zeros_like(mtp["layers"]["wo"])}
    out["moe"] = {**mtp["moe"], "w2": jnp.zeros_like(mtp["moe"]["w2"]),
                  "shared_w2": jnp.zeros_like(mtp["moe"]["shared_w2"])}
    out["head_norm"] = params["norm"][None]
    return out


def test_an_mtp_layer_that_copies_the_model_is_accepted_on_repeats(model):
    # Checks the plumbing: the hidden state of the right position reaches the layer (its first
    # draft after the prefill is the model's own first token), and drafts that are right are
    # accepted (W = 1 greedy tokens still, in fewer steps when the output repeats).
    config, params, mtp = model
    copy = _copy_mtp(params, mtp)
    engine = gen.ResidentEngine(params, config, batch=2, capacity=CAPACITY, mtp=copy)
    tokens, lengths = gen.pad_prompts(PROMPTS)
    logits, hidden = engine.prefill(tokens, lengths, hidden=True)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drafter = MTPDrafter(params, copy, config, batch=2, capacity=CAPACITY)
    drafter.start(hidden, tokens, lengths, first)
    np.testing.assert_array_equal(drafter.propose(PROMPTS, 2),
                                  np.repeat(np.asarray(first)[:, None], 2, axis=1))
    # A main model whose layers add nothing and whose head is the embedding repeats its input
    # token (the random fixture itself never repeats one): every copied draft is right.
    still = {**params, "head": params["embed"].T,
             "layers": {**params["layers"], "wo": jnp.zeros_like(params["layers"]["wo"])},
             "dense_mlp": {**params["dense_mlp"],
                           "w2": jnp.zeros_like(params["dense_mlp"]["w2"])},
             "moe": {**params["moe"], "w2": jnp.zeros_like(params["moe"]["w2"]),
                     "shared_w2": jnp.zeros_like(params["moe"]["shared_w2"])}}
    copy = _copy_mtp(still, mtp)
    want = gen.generate(gen.ResidentEngine(still, config, batch=2, capacity=CAPACITY),
                        PROMPTS, max_new_tokens=NEW)
    repeats = int(np.sum(want.tokens[:, 1:] == want.tokens[:, :-1]))
    assert repeats == 2 * (NEW - 1)
    for num_drafts, steps in ((1, 6), (3, 3)):
        got = gen.generate(gen.ResidentEngine(still, config, batch=2, capacity=CAPACITY,
                                              mtp=copy),
                           PROMPTS, max_new_tokens=NEW, drafter="mtp", num_drafts=num_drafts)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        extra = got.extra
        print(f"copying MTP layer, num_drafts={num_drafts}: {extra['tokens_per_step']:.2f} "
              f"tokens per step, accepted {extra['accepted_drafts']} of "
              f"{extra['proposed_drafts']} in {extra['verify_steps']} steps")
        assert extra["verify_steps"] == -(-(NEW - 1) // (num_drafts + 1)) == steps
        assert extra["accepted_drafts"] == 2 * (NEW - 1 - steps)


def test_sampled_mtp_drafting_offloaded_equals_resident_and_feeds_the_sampled_tokens(model):
    """MTP drafts at temperature > 0 (speculative sampling): the offloaded engine yields the
    resident engine's tokens bit for bit for the same key (num_drafts=2: the offloaded
    programs of the greedy test above). The MTP layer is fed the pairs of the tokens
    generated (sampled, mostly not the argmax): what `observe` is given for the kept
    positions, step after step, is each request's generated tokens after the first."""
    config, params, mtp = model
    offload = OffloadConfig(hot_slots=config.index_topk * config.max_ways, page_size=8,
                            capacity=48)
    kwargs = dict(max_new_tokens=NEW, temperature=1.0, top_p=0.95, key=jax.random.key(7),
                  num_drafts=2)
    engine = _engine(model)
    drafter = make_drafter("mtp", config, engine=engine)
    observed = [[] for _ in PROMPTS]
    observe = drafter.observe

    def recording(hidden, tokens, keep):
        for b, k in enumerate(np.asarray(keep)):
            observed[b] += np.asarray(tokens)[b, :k].tolist()
        observe(hidden, tokens, keep)

    drafter.observe = recording
    got = gen.generate(engine, PROMPTS, drafter=drafter, **kwargs)
    offloaded = gen.generate(gen.OffloadEngine(params, config, offload=offload, batch=2,
                                               mtp=mtp), PROMPTS, drafter="mtp", **kwargs)
    np.testing.assert_array_equal(offloaded.tokens, got.tokens)
    np.testing.assert_array_equal(offloaded.context_length, got.context_length)
    assert offloaded.extra["verify_steps"] == got.extra["verify_steps"]
    np.testing.assert_array_equal(np.asarray(observed), got.tokens[:, 1:])
    greedy = gen.generate(_engine(model), PROMPTS, max_new_tokens=NEW)
    assert np.mean(got.tokens != greedy.tokens) > 0.5

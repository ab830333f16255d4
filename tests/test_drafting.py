"""Speculative decoding: the n-gram drafter, rollback of rejected drafts, greedy verification,
speculative sampling offloaded and resident."""

import jax
import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax import resident
from fo_jax.config import check_num_drafts, get_config
from fo_jax.drafting import NGramDrafter, make_drafter
from fo_jax.model.dsa import init_params
from fo_jax.offload import checks
from fo_jax.offload import decode as offload_decode
from fo_jax.offload import state as offload_state
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.invariants import check_invariants

# One indexer group of two layers (one unrolled group: half the compile time of tiny's two);
# max_ways 4: three drafts per step.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), index_topk=8)


# The tests share their shapes, so that each step program compiles once for the file.
PROMPTS = [list(range(40, 90)), list(range(100, 133))]
NEW = 10
CAPACITY = 50 + NEW - 1  # exactly what W = 1 decoding of PROMPTS needs
# The fewest hot slots (top-k x max ways): evictions in every step.
OFFLOAD = OffloadConfig(hot_slots=CONFIG.index_topk * CONFIG.max_ways, page_size=8,
                        capacity=64)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0))


# The n-gram drafter --------------------------------------------------------------------------

def test_ngram_continues_the_most_recent_match_of_the_longest_ngram():
    drafter = NGramDrafter(max_ngram=3)
    # "7 8 9" occurred earlier, followed by 1 2 3; a later "8 9" followed by 5 loses to it.
    history = [7, 8, 9, 1, 2, 3, 4, 8, 9, 5, 7, 8, 9]
    np.testing.assert_array_equal(drafter.propose([history], 3), [[1, 2, 3]])
    # Only the 1-gram "9" matches: its most recent occurrence was followed by 5, then 7.
    np.testing.assert_array_equal(drafter.propose([[9, 5, 7, 6, 9]], 2), [[5, 7]])


def test_ngram_pads_short_continuations_and_falls_back_without_a_match():
    drafter = NGramDrafter()
    # The match's continuation (6, then the end) is shorter than 3 drafts: the last repeats.
    np.testing.assert_array_equal(drafter.propose([[4, 6, 4]], 3), [[6, 4, 4]])
    # No match at all: the last token, repeated. One-token history: the same.
    got = drafter.propose([[1, 2, 3], [5]], 2)
    np.testing.assert_array_equal(got, [[3, 3], [5, 5]])
    assert got.dtype == np.int32
    assert drafter.propose([[1, 2]], 0).shape == (1, 0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_ngram=0), r"max_ngram=0 must be an int >= 1 \(tokens of the pattern"),
    (dict(min_ngram=3, max_ngram=2), r"min_ngram=3 > max_ngram=2: the n-gram lengths tried run "
                                     r"from max_ngram down to min_ngram"),
])
def test_ngram_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NGramDrafter(**kwargs)


def test_make_drafter():
    assert make_drafter(None, CONFIG) is None and make_drafter("none", CONFIG) is None
    assert isinstance(make_drafter("ngram", CONFIG), NGramDrafter)
    with pytest.raises(ValueError, match=r"drafter='mtp' needs the multi-token-prediction "
                                         r"layer of the model .*model 'tiny' has no MTP "
                                         r"layer loaded: load it with "
                                         r"load_checkpoint\(\.\.\., mtp=True\)"):
        make_drafter("mtp", CONFIG)
    with pytest.raises(ValueError, match=r"drafter='eagle' must be one of None, 'ngram', 'mtp' "
                                         r"\(where the drafts"):
        make_drafter("eagle", CONFIG)


# Rollback: rejected drafts leave no visible trace --------------------------------------------

def test_rejected_drafts_leave_no_visible_trace(params):
    """Run A feeds W = 4 tokens per request and step, then rolls back all but keep[b] of them
    (resident and offloaded). Run B never feeds the rejected tokens: the same compiled step
    appends only keep[b] tokens (the rest is padding, never stored: `num_new`). After every
    round: lengths equal; host pages and indexer keys up to each length equal B's, bitwise; the
    invariants hold; the logits of every kept token (all later outputs) are bitwise B's. Rows
    past the lengths, the hot cache and the policy state may differ."""
    batch, ways, offload = len(PROMPTS), CONFIG.max_ways, OFFLOAD
    rng = np.random.default_rng(0)
    prompts, prompt_len = gen.pad_prompts(PROMPTS)  # mid-block: steps cross tail blocks
    nan = float("nan")  # unwritten rows are NaN, so a stray read shows in the logits
    state_b = resident.ResidentState.create(CONFIG, batch=batch, capacity=CAPACITY, fill=nan)
    _, state_b = resident.prefill(params, state_b, prompts, prompt_len, config=CONFIG)
    # A's states start as copies of B's (the resident one and the offloaded handoff of it).
    state_r = jax.tree.map(lambda x: x.copy(), state_b)
    state_o = offload_state.DecodeState.from_resident(
        state_b.kv, state_b.index_keys, state_b.lengths, config=CONFIG, offload=offload,
        fill=nan)
    # keep: every count from 0 (all fed tokens rejected) to W (all drafts accepted).
    keeps = [[1, 0], [2, 3], [0, 4], [1, 2]]
    for round_, keep in enumerate(np.asarray(keeps)):
        fed = rng.integers(0, CONFIG.vocab_size, (batch, ways)).astype(np.int32)
        never = np.where(np.arange(ways)[None, :] < keep[:, None], fed, 0)  # drafts replaced
        logits_b, state_b = resident.prefill(params, state_b, never, keep, config=CONFIG,
                                             query_block=None)
        logits_r, state_r = resident.decode_step(params, state_r, fed, config=CONFIG)
        state_r = resident.rollback(state_r, ways - keep)
        logits_o, state_o, stats = offload_decode.decode_step(params, state_o, fed,
                                                              config=CONFIG, offload=offload)
        check_invariants(state_o, config=CONFIG, offload=offload, selected=stats.selected)
        state_o = offload_state.rollback(state_o, ways - keep)

        lengths = np.asarray(state_b.lengths)
        np.testing.assert_array_equal(state_r.lengths, lengths)
        np.testing.assert_array_equal(state_o.lengths, lengths)
        check_invariants(state_o, config=CONFIG, offload=offload, resident_kv=state_b.kv,
                         finite=True)
        checks.check_state_on_device(state_o, config=CONFIG, offload=offload)  # the jit twin
        # Everything to numpy once (slicing device arrays would compile a program per slice).
        kv_b, keys_b, kv_r, keys_r, logits_b, logits_r, logits_o = (
            np.asarray(x) for x in (state_b.kv, state_b.index_keys, state_r.kv,
                                    state_r.index_keys, logits_b, logits_r, logits_o))
        # The offloaded pools read through the page table: [L, B, S, D+R], [G, B, S, N].
        host, keys_o = state_o.token_rows(), state_o.token_index_keys()
        for b, n in enumerate(lengths):
            where = f"round {round_}, request {b}"
            for got in (kv_r, host):
                np.testing.assert_array_equal(got[:, b, :n], kv_b[:, b, :n], err_msg=where)
            for got in (keys_r, keys_o):
                np.testing.assert_array_equal(got[:, b, :n], keys_b[:, b, :n], err_msg=where)
            kept = int(keep[b])
            assert np.all(np.isfinite(logits_b[b, :kept])), where
            for got in (logits_r, logits_o):
                np.testing.assert_array_equal(got[b, :kept], logits_b[b, :kept], err_msg=where)
    # The rollback touched the lengths only: the offloaded state's other leaves are the step's.
    assert int(state_o.step) == len(keeps) + 1


# Greedy verification ---------------------------------------------------------------------

class OracleDrafter:
    """Proposes the true greedy continuation with every `wrong`-th draft replaced, so that
    steps accept 0, some or all of their drafts; request-dependent, so requests finish apart."""

    name = "oracle"

    def __init__(self, prompts, tokens, wrong):
        self.prompts, self.tokens, self.wrong, self.calls = prompts, tokens, wrong, 0

    def propose(self, histories, num_drafts):
        out = []
        for b, h in enumerate(histories):
            done = len(h) - len(self.prompts[b])
            truth = list(self.tokens[b, done:done + num_drafts])
            truth += [0] * (num_drafts - len(truth))
            for i in range(num_drafts):
                if (self.calls + i + 1) % self.wrong[b] == 0:
                    truth[i] = (truth[i] + 1) % CONFIG.vocab_size
            out.append(truth)
        self.calls += 1
        return np.asarray(out, np.int32)


def _engines(params):
    return {"resident": lambda: gen.ResidentEngine(params, CONFIG, batch=2, capacity=CAPACITY),
            "offload": lambda: gen.OffloadEngine(params, CONFIG, offload=OFFLOAD, batch=2,
                                                 check=True)}


def test_greedy_with_drafts_gives_the_w1_greedy_tokens(params):
    # Capacity exactly what W = 1 needs: request 1 finishes first and is fed (then rolled
    # back) while request 0 still decodes, its ways past capacity dropped. The offloaded
    # engine checks its invariants after every step and rollback.
    prompts, new = PROMPTS, NEW
    engines = _engines(params)
    want = gen.generate(engines["resident"](), prompts, max_new_tokens=new)
    for name, make in engines.items():
        oracle = OracleDrafter(prompts, want.tokens, wrong=[3, 1000])
        got = gen.generate(make(), prompts, max_new_tokens=new, drafter=oracle)
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=name)
        np.testing.assert_array_equal(got.context_length, want.context_length)
        extra = got.extra
        assert extra["draft"] == "oracle" and extra["num_drafts"] == 3
        assert extra["verify_steps"] < new - 1
        assert extra["tokens_per_step"] > 1.4
        assert 0 < extra["accepted_drafts"] < extra["proposed_drafts"]
        ngram = gen.generate(make(), prompts, max_new_tokens=new, drafter="ngram")
        np.testing.assert_array_equal(ngram.tokens, want.tokens, err_msg=name)
        assert ngram.extra["draft"] == "ngram" and ngram.extra["tokens_per_step"] >= 1
    assert got.extra["decode_steps"] == extra["verify_steps"]


def test_sampled_drafting_offloaded_equals_resident(params):
    """Speculative sampling (temperature > 0), the same key: the offloaded engine (checking its
    invariants after every step and rollback) yields the resident engine's tokens bit for bit,
    over steps that accept drafts and steps that reject them (every third draft of request 0
    is wrong: p(d) ~ 0), the resident capacity exactly what W = 1 needs; another key, other
    tokens. At temperature 0.1 the greedy continuation is likely enough that most right
    drafts are accepted."""
    prompts, new = PROMPTS, NEW
    engines = _engines(params)
    want = gen.generate(engines["resident"](), prompts, max_new_tokens=new)
    kwargs = dict(max_new_tokens=new, temperature=0.1, top_p=0.9, key=jax.random.key(4))
    runs = {name: gen.generate(make(), prompts,
                               drafter=OracleDrafter(prompts, want.tokens, wrong=[3, 1000]),
                               **kwargs)
            for name, make in engines.items()}
    np.testing.assert_array_equal(runs["offload"].tokens, runs["resident"].tokens)
    np.testing.assert_array_equal(runs["offload"].context_length,
                                  runs["resident"].context_length)
    extra = runs["offload"].extra
    assert 0 < extra["accepted_drafts"] < extra["proposed_drafts"] - 3, extra
    assert extra["verify_steps"] < new - 1
    other = gen.generate(engines["resident"](), prompts,
                         drafter=OracleDrafter(prompts, want.tokens, wrong=[3, 1000]),
                         **dict(kwargs, key=jax.random.key(5), temperature=1.0))
    assert not np.array_equal(other.tokens, runs["resident"].tokens)


def test_bad_draft_counts_are_refused(params):
    engine = gen.ResidentEngine(params, CONFIG, batch=1, capacity=32)
    with pytest.raises(ValueError, match=r"num_drafts=4 makes steps of W = 5 ways, but config "
                                         r"'tiny' allows at most max_ways=4: use num_drafts <= 3"):
        gen.generate(engine, [[1, 2]], max_new_tokens=4, drafter="ngram", num_drafts=4)
    with pytest.raises(ValueError, match=r"num_drafts=2 needs a drafter: pass drafter='ngram'"):
        gen.generate(engine, [[1, 2]], max_new_tokens=4, num_drafts=2)
    with pytest.raises(ValueError, match=r"drafter='mtp' needs the multi-token-prediction"):
        gen.generate(engine, [[1, 2]], max_new_tokens=4, drafter="mtp")
    with pytest.raises(ValueError, match=r"num_drafts=-1 must be an int >= 0 \(draft tokens per "
                                         r"request and step; 0 = no drafts\)"):
        gen.generate(engine, [[1, 2]], max_new_tokens=4, drafter="ngram", num_drafts=-1)
    with pytest.raises(ValueError, match=r"drafter='ngram' needs num_drafts >= 1 \(drafts per "
                                         r"request and decode step\): pass num_drafts, or drop "
                                         r"drafter"):
        gen.generate(engine, [[1, 2]], max_new_tokens=4, drafter="ngram", num_drafts=0)
    assert engine.lengths is None  # refused before anything ran


def test_the_number_of_drafts_has_one_range_check():
    """`check_num_drafts`: an int >= 0 (any int type, not a bool), and with a config
    W = num_drafts + 1 <= max_ways; generate, the flags, the engine and the loop call it."""
    for ok in (0, 3, np.int32(2)):
        check_num_drafts(ok, CONFIG)
    check_num_drafts(7)  # without a config: no upper bound
    for bad in (-1, 1.0, True, "2", None):
        with pytest.raises(ValueError, match=rf"num_drafts={bad!r} must be an int >= 0 "
                                             r"\(draft tokens per request and step; 0 = no "
                                             r"drafts\)"):
            check_num_drafts(bad, CONFIG)
    with pytest.raises(ValueError, match=r"^num_drafts=4 makes steps of W = 5 ways, but config "
                                         r"'tiny' allows at most max_ways=4: use num_drafts <= 3,"
                                         r" or a config with max_ways >= 5$"):
        check_num_drafts(4, CONFIG)


def test_draft_is_the_deprecated_spelling_of_drafter(params):
    """generate's old `draft=` keyword: still accepted (one release) with a DeprecationWarning
    naming drafter=, "none" as None; with drafter= too, a TypeError."""
    def engine():
        return gen.ResidentEngine(params, CONFIG, batch=1, capacity=32)

    deprecated = r"generate\(draft=\.\.\.\) is deprecated: pass drafter= \(None for no drafts\)"
    refused = engine()
    with pytest.warns(DeprecationWarning, match=deprecated):
        with pytest.raises(ValueError, match=r"num_drafts=4 makes steps of W = 5 ways"):
            gen.generate(refused, [[1, 2]], max_new_tokens=4, draft="ngram", num_drafts=4)
    with pytest.raises(TypeError, match=r"generate\(\) got drafter='ngram' and draft='mtp': "
                                        r"draft= is the deprecated spelling of drafter=: pass "
                                        r"drafter= only"):
        gen.generate(refused, [[1, 2]], max_new_tokens=4, drafter="ngram", draft="mtp")
    assert refused.lengths is None  # refused before anything ran
    with pytest.warns(DeprecationWarning, match=deprecated):
        old = gen.generate(engine(), [[1, 2]], max_new_tokens=3, draft="none")
    new = gen.generate(engine(), [[1, 2]], max_new_tokens=3, drafter="none")  # "none": None
    np.testing.assert_array_equal(old.tokens, new.tokens)
    assert "draft" not in old.extra and "draft" not in new.extra


def test_engine_rollback_is_checked(params):
    engine = _engines(params)["resident"]()  # the shapes above: compiled programs reused
    with pytest.raises(ValueError, match=r"needs a decode step to roll back"):
        engine.rollback([0, 0])  # before any prefill
    engine.prefill(*gen.pad_prompts(PROMPTS))
    with pytest.raises(ValueError, match=r"ResidentEngine.rollback needs a decode step to roll "
                                         r"back \(one rollback per step\)"):
        engine.rollback([0, 0])
    engine.step(np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match=r"keep=\[5, 0\] must be 2 ints in \[0, tokens the last "
                                         r"step stored\] = \[0, \[4, 4\]\]"):
        engine.rollback([5, 0])
    engine.rollback([2, 0])
    np.testing.assert_array_equal(engine.lengths, [52, 33])
    np.testing.assert_array_equal(engine.state.lengths, [52, 33])
    assert engine.tokens_kept == 2

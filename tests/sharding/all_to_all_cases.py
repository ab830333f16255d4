"""Data-parallel attention with expert-parallel MoE on the same simulated devices (the
all-to-all layout: `fo_jax.sharding.ALL_TO_ALL_RULES`), against single-device runs, bit for bit.

Run by tests/sharding/test_all_to_all.py in a subprocess (the rest of the suite keeps one
device); runs alone too: `XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=.
python tests/sharding/all_to_all_cases.py [case ...]`. Prints one line per case and "ALL OK".

Every rank holds its own requests, cache and host pool and 1/D of the routed experts; each MoE
layer sends (token, expert) rows to the experts' owners and back by all-to-all. The reference of
a rank is the single-device step with the whole weights run on that rank's requests and pool
shard (as in data_parallel_cases.py): logits, stats and whole states bit for bit; the compiled
step holds exactly three all-to-alls per loop of MoE layers and no other collective; each device
holds 1/D of the experts' bytes, read from the arrays.
"""

import contextlib
import dataclasses
import io
import os
import sys
import tempfile

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from data_parallel_cases import (CONFIG, NAN, PROMPT, assert_ranks_decode,  # noqa: E402
                                 assert_state_equal, log, random_decode_state,
                                 random_params, raises, rank_state)
from fo_jax import hlo_checks, resident, sharded_steps, sharding  # noqa: E402
from fo_jax.model.dsa import quantize_params  # noqa: E402
from fo_jax.model.moe import all_to_all_capacity  # noqa: E402
from fo_jax.offload import prefill as offload_prefill  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402
from fo_jax.offload.state import DecodeState  # noqa: E402

# Layer 0 dense, layers 1-2 MoE (one loop: one indexer group); 8 experts, 3 per token, one
# shared expert.
MOE = CONFIG.replace(num_layers=3, n_routed_experts=8, num_experts_per_tok=3, moe_hidden=8,
                     n_shared_experts=1, first_k_dense_replace=1)
OFFLOAD = OffloadConfig(hot_slots=16, page_size=4, capacity=32, policy="ring")
FP8_BLOCK = (16, 4)  # divides E = 64 and M = 8: whole blocks in every expert


def moe_loops(config) -> int:
    """Loops of MoE layers in the forward pass (`fo_jax.model.forward`: one per indexer group
    holding MoE layers): each holds one MoE layer's collectives, whatever its trip count."""
    return sum(is_moe and end > start for lo, hi in config.group_bounds
               for start, end, is_moe in config.mlp_ranges(lo, hi))


def placed_weights(rng, config, ranks, fp8=False):
    params = random_params(config, rng)
    if fp8:  # the projections in FP8 with block scales (experts: values and scales split)
        params = quantize_params(params, FP8_BLOCK)
    mesh, rules = sharding.expert_mesh(ranks, expert=ranks)
    return params, sharding.shard_params(params, mesh, rules), mesh, rules


def check_expert_bytes(params, placed, ranks, param_in=None):
    """Each device holds 1/D of w1 / w2 / w3 [L', X, ...] (experts [d X/D, (d+1) X/D); FP8
    experts: their values and block scales alike), read from the arrays' shards; the router
    and the shared experts whole on every device. Returns the expert bytes of one device."""
    per_device = 0
    for name in ("w1", "w2", "w3"):
        inside = None if param_in is None else jax.tree.leaves(param_in["moe"][name])
        for k, (whole, got) in enumerate(zip(jax.tree.leaves(params["moe"][name]),
                                             jax.tree.leaves(placed["moe"][name]))):
            shards = got.addressable_shards
            assert len(shards) == ranks, len(shards)
            held = set()
            for shard in shards:
                assert shard.data.nbytes * ranks == whole.nbytes, (name, shard.data.shape)
                experts = shard.index[1]
                held.add(experts.start)
                np.testing.assert_array_equal(np.asarray(shard.data),
                                              np.asarray(whole)[:, experts])
            assert held == set(range(0, whole.shape[1], whole.shape[1] // ranks)), held
            per_device += shards[0].data.nbytes
            if inside is not None:  # inside the compiled step too
                assert inside[k].shard_shape(whole.shape)[1] == whole.shape[1] // ranks
    for name in ("gate", "gate_bias", "shared_w1"):
        for shard in jax.tree.leaves(placed["moe"][name])[0].addressable_shards:
            assert shard.data.shape == jax.tree.leaves(params["moe"][name])[0].shape, name
    return per_device


def check_all_to_alls(compiled, config, *, ranks, tokens):
    """Exactly three all-to-alls per loop of MoE layers (expert ids [D C] int32, rows and
    outputs [D C, E] in the activations' dtype, C = tokens min(K', X / D) rows per peer) and no
    other collective: no all-reduce or all-gather of expert rows, nothing of the cache."""
    loops = moe_loops(config)
    found = hlo_checks.assert_collectives(compiled, {"all-to-all": 3 * loops},
                                          what="the all-to-all expert-parallel step")
    cap = all_to_all_capacity(tokens, top=config.num_experts_per_tok,
                              num_local=config.n_routed_experts // ranks)
    act = hlo_checks.hlo_dtype(config.jnp_dtype)
    kinds = sorted(c.arrays for c in found)
    want = sorted([((("s32", (cap,)),) * ranks)] * loops
                  + [((act, (cap, config.dim)),) * ranks] * (2 * loops))
    assert kinds == want, (kinds, want)
    return cap


def decode_case(rng, *, ranks, batch, steps, inactive=False, fp8=False):
    params, placed, mesh, rules = placed_weights(rng, MOE, ranks, fp8=fp8)
    lengths = [PROMPT] + rng.integers(1, PROMPT, batch - 1).tolist()
    state = random_decode_state(rng, MOE, batch=batch, offload=OFFLOAD, lengths=lengths,
                                permute=ranks)
    sharded = sharding.shard_state(state, mesh, rules)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    per = batch // ranks
    compiled = sharded_steps.lower_sharded_decode_step(
        placed, sharded, np.zeros((batch, 1), np.int32), mesh=mesh, config=MOE, offload=OFFLOAD,
        active=np.ones(batch, bool) if inactive else None, rules=rules).compile()
    cap = check_all_to_alls(compiled, MOE, ranks=ranks, tokens=per)
    per_device = check_expert_bytes(params, placed, ranks, compiled.input_shardings[0][0])
    shard_in = compiled.input_shardings[0]
    for _ in range(steps):  # the compiled program stepped (one compile)
        tokens = rng.integers(0, MOE.vocab_size, (batch, 1), dtype=np.int32)
        active = rng.random(batch) < 0.7 if inactive else None
        logits, sharded, stats = compiled(
            placed, sharded, jax.device_put(tokens, shard_in[2]),
            None if active is None else jax.device_put(active, shard_in[3]))
        assert_ranks_decode(logits, stats, refs, params, tokens, active, config=MOE,
                            offload=OFFLOAD)
    assert_state_equal(sharded, mesh, refs, ranks)
    expert_bytes = sum(x.nbytes for n in ("w1", "w2", "w3")
                       for x in jax.tree.leaves(params["moe"][n]))
    log(f"all-to-all offloaded decode ranks={ranks} B={batch} X={MOE.n_routed_experts} "
        f"K'={MOE.num_experts_per_tok} inactive seats={inactive} FP8 weights={fp8}: {steps} "
        "steps bitwise ok; "
        f"3 all-to-alls of C={cap} rows per peer per MoE loop, no other collective; "
        f"{per_device} of {expert_bytes} expert bytes per device")


def resident_case(rng, *, ranks, batch, steps):
    """The resident decode step under the all-to-all layout against each rank's one-device
    run, and the offloaded step from the same cache under the same mesh: equal bit for bit."""
    params, placed, mesh, rules = placed_weights(rng, MOE, ranks)
    lengths = rng.integers(1, PROMPT, batch)
    res = resident.ResidentState.create(MOE, batch=batch, capacity=OFFLOAD.capacity, fill=NAN)
    res = dataclasses.replace(
        res, kv=jnp.asarray(rng.standard_normal(res.kv.shape), res.kv.dtype),
        index_keys=jnp.asarray(rng.standard_normal(res.index_keys.shape), res.index_keys.dtype),
        lengths=jnp.asarray(lengths, jnp.int32))
    dec = DecodeState.from_resident(res.kv, res.index_keys, res.lengths,
                                                   config=MOE, offload=OFFLOAD, fill=NAN)
    refs = [rank_state(res, r, ranks) for r in range(ranks)]
    res = sharding.shard_state(res, mesh, rules)
    dec = sharding.shard_state(dec, mesh, rules)
    per = batch // ranks
    for _ in range(steps):
        tokens = rng.integers(0, MOE.vocab_size, (batch, 1), dtype=np.int32)
        logits, res = sharded_steps.sharded_resident_decode_step(placed, res, tokens, mesh=mesh,
                                                                 config=MOE, rules=rules)
        off, dec, _ = sharded_steps.sharded_decode_step(placed, dec, tokens, mesh=mesh,
                                                        config=MOE, offload=OFFLOAD, rules=rules)
        chex.assert_trees_all_equal(np.asarray(off), np.asarray(logits))
        for r in range(ranks):
            seats = slice(r * per, (r + 1) * per)
            want, refs[r] = resident.decode_step(params, refs[r], tokens[seats], config=MOE)
            chex.assert_trees_all_equal(np.asarray(logits)[seats], np.asarray(want))
    assert_state_equal(res, mesh, refs, ranks)
    log(f"all-to-all resident decode ranks={ranks} B={batch}: {steps} steps bitwise each "
        "rank's one-device run, and the offloaded step's logits bitwise the resident ones")


def prefill_case(rng, *, ranks, batch, width):
    """One offloaded prefill chunk (N = B/D x width tokens per rank: more rows than a tile)."""
    params, placed, mesh, rules = placed_weights(rng, MOE, ranks)
    page = 4
    state = offload_prefill.PrefillState.create(MOE, batch=batch, capacity=4 * page,
                                                page_size=page, fill=NAN)
    sharded = sharding.shard_state(state, mesh, rules)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    tokens = rng.integers(0, MOE.vocab_size, (batch, width), dtype=np.int32)
    num_new = rng.integers(1, width + 1, batch).astype(np.int32)
    logits, sharded = sharded_steps.sharded_prefill(placed, sharded, tokens, num_new, mesh=mesh,
                                                    config=MOE, num_buffers=2, history_pages=4,
                                                    rules=rules)
    per = batch // ranks
    for r in range(ranks):
        seats = slice(r * per, (r + 1) * per)
        want, refs[r] = offload_prefill.prefill(params, refs[r], tokens[seats], num_new[seats],
                                                config=MOE, num_buffers=2, history_pages=4,
                                                query_block=None)
        for b in range(per):  # padding logits are unspecified
            n = int(num_new[seats][b])
            chex.assert_trees_all_equal(np.asarray(logits)[seats][b, :n],
                                        np.asarray(want)[b, :n])
    assert_state_equal(sharded, mesh, refs, ranks)
    log(f"all-to-all offloaded prefill ranks={ranks} B={batch} width={width}: bitwise ok")


def loop_case(rng, *, ranks, batch, steps):
    """The decode loop under the all-to-all layout: the ranks leave it together (every rank
    takes part in every step's all-to-alls); a rank done sooner steps inactively, so its
    tokens, stats and state are its one-device loop's followed by inactive steps."""
    from fo_jax.decode_loop import OffloadedStep, Seats, decode_loop
    from fo_jax.sampling import Sampling

    params, placed, mesh, rules = placed_weights(rng, MOE, ranks)
    lengths = [PROMPT] + rng.integers(1, PROMPT, batch - 1).tolist()
    offload = dataclasses.replace(OFFLOAD, policy="random")
    state = random_decode_state(rng, MOE, batch=batch, offload=offload, lengths=lengths,
                                permute=False)
    step = OffloadedStep(MOE, offload)
    max_new = [steps + 1] + rng.integers(2, steps + 1, batch - 1).tolist()
    sampling = Sampling.create(batch, temperature=[0.0, 0.8] * (batch // 2), top_p=0.9,
                               max_new_tokens=max_new)
    keys = jax.random.split(jax.random.key(3), batch)
    first = rng.integers(64, MOE.vocab_size, batch).astype(np.int32)
    seats = Seats.create(first, keys, sampling=sampling, lengths=lengths,
                         capacity=offload.capacity)
    sharded = sharding.shard_state(state, mesh, rules)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    out, sharded, new_seats = sharded_steps.sharded_decode_loop(
        placed, sharded, seats, steps, sampling, mesh=mesh, step=step, rules=rules)
    per = batch // ranks
    taken, wants = [], []
    for r in range(ranks):
        rows = slice(r * per, (r + 1) * per)
        part = lambda tree: jax.tree.map(lambda x: x[rows], tree)  # noqa: E731
        want, refs[r], want_seats = decode_loop(params, refs[r], part(seats), steps,
                                                part(sampling), step=step)
        taken.append(int(want.num_steps))
        wants.append((want, want_seats))
    for r in range(ranks):
        for _ in range(max(taken) - taken[r]):
            refs[r] = step(params, refs[r], np.zeros((per, 1), np.int32),
                           jnp.zeros((per,), bool))[1]
        rows = slice(r * per, (r + 1) * per)
        want, want_seats = wants[r]
        chex.assert_trees_all_equal(np.asarray(out.tokens)[rows], np.asarray(want.tokens))
        chex.assert_trees_all_equal(np.asarray(new_seats.tokens)[rows],
                                    np.asarray(want_seats.tokens))
        got_stats = jax.tree.map(lambda x: np.take(np.asarray(x), np.arange(
            rows.start, rows.stop), axis=0 if x.ndim == 1 else 1), out.stats)
        chex.assert_trees_all_equal(got_stats, jax.tree.map(np.asarray, want.stats))
    assert int(out.num_steps) == max(taken), (int(out.num_steps), taken)
    assert len(set(taken)) > 1, taken  # the ranks' own requests finished at different steps
    assert_state_equal(sharded, mesh, refs, ranks)
    log(f"all-to-all decode loop ranks={ranks} B={batch} N={steps}: steps per rank {taken} "
        "(all ranks stepped together), bitwise ok")


def cli_case(rng, directory):
    """`fo-jax generate --model tiny_moe --offload --devices 4 --expert-parallel 4` (the
    all-to-all layout) with numpy-drawn weights from a file, and the flags' refusals."""
    from fo_jax import cli
    from fo_jax.config import get_config
    from fo_jax.weights import save_params

    config = get_config("tiny_moe")
    weights = os.path.join(directory, "tiny_moe.safetensors")
    save_params(weights, jax.device_get(random_params(config, rng)), config)
    base = ["generate", "--model", "tiny_moe", "--offload", "--devices", "4", "--batch", "4",
            "--max-new-tokens", "3", "--prompt", "abc", "--page-size", "4", "--no-progress",
            "--weights", weights]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(base + ["--expert-parallel", "4", "--decode-steps-per-call", "2"])
    assert code == 0, out.getvalue()
    assert "path: offload   batch: 4" in out.getvalue(), out.getvalue()
    assert "generated: 12 tokens" in out.getvalue(), out.getvalue()
    assert base[4:6] == ["--devices", "4"]
    without_devices = base[:4] + base[6:]
    for argv, message in (
            (base + ["--expert-parallel", "2"], "--expert-parallel 2 with --expert-layout "
             "all-to-all must equal --devices 4 (every device holds its own requests and "
             "1/devices of the experts); use --expert-layout replicated to split the experts "
             "over a part of the devices"),
            (base + ["--expert-parallel", "3"], "--expert-parallel 3 must divide --devices 4"),
            (without_devices + ["--expert-parallel", "4"],
             "--expert-parallel splits the experts over --devices: add --devices")):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        assert code == 2 and f"fo-jax: error: {message}" in err.getvalue(), err.getvalue()
    log("fo-jax generate --devices 4 --expert-parallel 4 (all-to-all) and its refusals ok")


def error_cases(rng):
    raises(lambda: sharding.expert_mesh(8, expert=4),
           "the all-to-all expert layout splits the experts over every device (each holds its "
           "own requests and 1/8 of the experts): expert=4 must equal num_devices=8, or use the "
           "replicated layout for experts over a part of the devices")
    raises(lambda: sharding.expert_mesh(8, expert=8, layout="ring"),
           "expert layout 'ring' is not one of ('all-to-all', 'replicated')")
    mesh, rules = sharding.expert_mesh(8, expert=8)
    assert dict(mesh.shape) == {"data": 8, "model": 1, "expert": 1}
    assert rules == sharding.ALL_TO_ALL_RULES and sharding.experts_over_data(mesh, rules)
    specs = sharding.param_specs(random_params(MOE, rng), mesh, rules)
    assert specs["moe"]["w1"] == jax.sharding.PartitionSpec(None, "data")
    assert specs["moe"]["gate"] == jax.sharding.PartitionSpec()
    fp8 = sharding.param_specs(quantize_params(random_params(MOE, rng), FP8_BLOCK), mesh, rules)
    assert fp8["moe"]["w2"].q == fp8["moe"]["w2"].scale_inv == jax.sharding.PartitionSpec(
        None, "data")
    # Not an expert: as the bf16 wo (its heads over `model`, of size 1 here: whole on every
    # device), values and scales alike.
    assert fp8["layers"]["wo"].q == fp8["layers"]["wo"].scale_inv == specs["layers"]["wo"]
    assert all(axis is None or mesh.shape[axis] == 1 for axis in fp8["layers"]["wo"].q)
    raises(lambda: sharding.param_specs(random_params(
        MOE.replace(n_routed_experts=4, num_experts_per_tok=2), rng), mesh, rules),
        "weight moe.w1 (2, 4, 64, 8) cannot be split over mesh axis 'data' of size 8")
    log("all-to-all layout refusals and weight rules ok")


CASES = {
    "errors": lambda rng: error_cases(rng),
    # D = 4: X/D = 2 experts per device < K' = 3 (C = 2 N); D = 2: 4 per device (C = 3 N).
    "decode": lambda rng: decode_case(rng, ranks=4, batch=8, steps=3, inactive=True),
    # By hand (the tests' D = 2 is the prefill case's): C = 3 N per peer.
    "decode_two_ranks": lambda rng: decode_case(rng, ranks=2, batch=4, steps=2, inactive=True),
    "decode_fp8": lambda rng: decode_case(rng, ranks=4, batch=4, steps=2, fp8=True),
    "resident": lambda rng: resident_case(rng, ranks=4, batch=4, steps=2),
    "prefill": lambda rng: prefill_case(rng, ranks=2, batch=4, width=6),
    "loop": lambda rng: loop_case(rng, ranks=4, batch=8, steps=5),
    "cli": None,
}


def main(argv):
    assert len(jax.devices()) == 8, jax.devices()
    names = argv[1:] or list(CASES)
    rng = np.random.default_rng(0)
    for name in names:
        if name == "cli":
            with tempfile.TemporaryDirectory() as directory:
                cli_case(rng, directory)
        else:
            CASES[name](rng)
    log("ALL OK")


if __name__ == "__main__":
    main(sys.argv)

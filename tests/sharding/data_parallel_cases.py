"""Data-parallel steps on 8 simulated CPU devices against single-device runs, bit for bit.

Run by tests/sharding/test_data_parallel.py in a subprocess (the rest of the suite keeps one
device); runs alone too: `XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=.
python tests/sharding/data_parallel_cases.py [SEED] [--fp8-...]`. Prints one line per case
and "ALL OK". The `FP8_SUITES` options (each run by tests/sharding/test_fp8_sharding.py) run
FP8 cases instead: `--fp8-weights` FP8 weights placed over `model` and `expert` (bytes per
device from the arrays, steps bitwise), `--fp8-kv-steps` the fp8_ds_mla KV format through the
sharded offloaded and resident steps, `--fp8-generate` `fo-jax generate --devices 2` with it.

The reference of a rank is the single-device step run on that rank's requests and pool shard
(sliced here by hand, with global page ids turned into the shard's own): XLA's CPU matmuls are
not batch-invariant (a request's logits in a batch of 4 and of 2 differ in the last bits even on
one device), so the sharded step is compared with the programs each rank is meant to run.
Logits, stats and the whole state after every case (host pages, tables, hot rows, maps, policy
state) must match bit for bit; the compiled program's shardings and memory kinds are checked,
and its HLO must hold no collective (the cache never crosses devices), but for the MoE
experts' all-reduce over `expert` when they are split there.
"""

import contextlib
import dataclasses
import functools
import io
import os
import re
import sys
import tempfile
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fo_jax import resident, sharded_steps, sharding  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.model.dsa import init_params, param_shapes, quantize_params  # noqa: E402
from fo_jax.model.kv_format import store_kv_rows  # noqa: E402
from fo_jax.model.linear import Fp8Weight  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload import prefill as offload_prefill  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402
from fo_jax.offload.state import DecodeState  # noqa: E402

NAN = float("nan")
# Two layers, one indexer group: the smallest programs that still run every part of a step.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), index_topk=4,
                                    max_ways=1, max_seq_len=64)
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
               "reduce-scatter")
PROMPT = 16  # the longest prompt of a decode case
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s wall, {time.process_time():5.1f}s cpu] {msg}", flush=True)


def to_numpy(x):
    """numpy copy of any array, host-memory ones through device memory."""
    kind = getattr(x.sharding, "memory_kind", None)
    if kind not in (None, "device"):
        x = jax.device_put(x, x.sharding.with_memory_kind("device"))
    return np.array(x, copy=True)


def rank_state(state, rank: int, ranks: int):
    """Rank `rank`'s requests and pool shard of a single-device state with global page ids, as
    a single-device state with the shard's own ids (written here, not with fo_jax.sharding)."""
    kind = type(state).__name__
    arrays = jax.tree.map(to_numpy, state)
    batch = arrays.lengths.shape[0] // ranks
    seats = slice(rank * batch, (rank + 1) * batch)
    frames = None
    if kind != "ResidentState":
        per = arrays.host.kv.shape[1] // ranks
        frames = slice(rank * per, (rank + 1) * per)
    batch_axis = {"DecodeState": {"table": 0, "lengths": 0, "policy.key": None, "step": None,
                                  "host.kv": None, "index_keys": None},
                  "PrefillState": {"table": 0, "lengths": 0, "host.kv": None,
                                   "index_keys": None},
                  "ResidentState": {"lengths": 0}}[kind]

    def one(path, x):
        name = sharding._names(path)
        if name in ("host.kv", "index_keys") and frames is not None:
            return x[:, frames]
        axis = batch_axis.get(name, 1)
        return x if axis is None else np.take(x, np.arange(seats.start, seats.stop), axis=axis)

    out = jax.tree_util.tree_map_with_path(one, arrays)
    if frames is not None:
        out = dataclasses.replace(out, table=np.where(out.table >= 0, out.table - frames.start,
                                                      -1).astype(np.int32))
    device = jax.devices()[0]
    out = jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), device), out)
    if frames is not None:
        host = jax.device_put(out.host.kv, jax.sharding.SingleDeviceSharding(
            device, memory_kind="pinned_host"))
        out = dataclasses.replace(out, host=dataclasses.replace(out.host, kv=host))
    return out


def assert_state_equal(sharded, mesh, refs, ranks):
    whole = sharding.unshard_state(sharded, mesh)
    for r in range(ranks):
        chex.assert_trees_all_equal(jax.tree.map(to_numpy, rank_state(whole, r, ranks)),
                                    jax.tree.map(to_numpy, refs[r]))


def assert_ranks_decode(logits, stats, refs, params, tokens, active, *, config, offload):
    """A sharded decode step's logits and stats against each rank's single-device step on its
    seats (refs[r]: rank r's state, advanced in place), bit for bit; an inactive seat's logits
    are unspecified (not compared)."""
    ranks = len(refs)
    per = len(tokens) // ranks
    for r in range(ranks):
        seats = slice(r * per, (r + 1) * per)
        want, refs[r], want_stats = offload_decode.decode_step(
            params, refs[r], tokens[seats], config=config, offload=offload,
            active=None if active is None else active[seats])
        live = slice(None) if active is None else active[seats]
        chex.assert_trees_all_equal(np.asarray(logits)[seats][live], np.asarray(want)[live])
        got_stats = jax.tree.map(lambda x: np.take(np.asarray(x), np.arange(
            seats.start, seats.stop), axis=0 if x.ndim == 1 else 1), stats)
        chex.assert_trees_all_equal(got_stats, jax.tree.map(np.asarray, want_stats))


def assert_split(x, axis: int, ranks: int, memory_kind: str = "device"):
    """x is split over its axis `axis` in `ranks` shards (no replication), in memory_kind."""
    shard = x.sharding.shard_shape(x.shape)
    want = tuple(n // ranks if i == axis else n for i, n in enumerate(x.shape))
    assert shard == want, (x.shape, shard, want)
    assert x.sharding.memory_kind == memory_kind, (x.sharding.memory_kind, memory_kind)


def check_decode_shardings(state, ranks):
    assert_split(state.host.kv, 1, ranks, "pinned_host")
    assert_split(state.index_keys, 1, ranks)
    assert_split(state.hot, 1, ranks)
    assert_split(state.table, 0, ranks)
    assert_split(state.slots.token_to_slot, 1, ranks)
    assert_split(state.slots.slot_to_token, 1, ranks)
    assert_split(state.policy.stamp, 1, ranks)
    assert_split(state.lengths, 0, ranks)


def check_compiled(compiled, state, ranks):
    """The compiled sharded decode step: state in and out split over `data` (host pages in
    pinned_host memory), no collective in its HLO."""
    text = compiled.as_text()
    found = [c for c in COLLECTIVES if c in text]
    assert not found, f"collectives in the sharded decode step: {found}"
    _, state_in, _, _ = compiled.input_shardings[0]
    _, state_out, _ = compiled.output_shardings
    for where in (state_in, state_out):
        for name, axis in (("host.kv", 1), ("hot", 1), ("index_keys", 1), ("table", 0),
                           ("lengths", 0), ("slots.token_to_slot", 1)):
            array, got = state, where
            for part in name.split("."):
                array, got = getattr(array, part), getattr(got, part)
            assert got.shard_shape(array.shape)[axis] == array.shape[axis] // ranks, (name, got)
            kind = "pinned_host" if name == "host.kv" else "device"
            assert got.memory_kind == kind, (name, got)
    log("  compiled program: state split over data, host pages pinned_host, no collectives")


def random_params(config, rng):
    """Weights of init_params' shapes drawn in numpy (no program compiled to make them)."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype),
                        shapes)


def stored_rows(values, config):
    """Random KV rows [..., D + R] (numpy) as the config's cache stores them: kv_dtype values, or
    fp8_ds_mla uint8 rows (quantized in one program)."""
    if config.kv_format == "bf16":
        return jnp.asarray(values, config.jnp_kv_dtype)
    return jax.jit(store_kv_rows, static_argnames="config")(
        jnp.asarray(values, jnp.float32), config=config)


def random_decode_state(rng, config, *, batch, offload, lengths, permute):
    """A DecodeState of random KV and indexer keys (no prefill: the step only reads rows)."""
    s_in = max(lengths)
    kv = rng.standard_normal((config.num_layers, batch, s_in, config.kv_width))
    keys = rng.standard_normal((config.num_groups, batch, s_in, config.index_head_dim))
    table = None
    if permute:  # pages shuffled within each rank's shard (`permute` ranks): local != global
        per = batch * offload.num_pages // permute
        frames = np.concatenate([r * per + rng.permutation(per) for r in range(permute)])
        table = frames.reshape(batch, offload.num_pages).astype(np.int32)
    return DecodeState.from_resident(stored_rows(kv, config),
                                     jnp.asarray(keys, config.jnp_kv_dtype),
                                     np.asarray(lengths, np.int32), config=config,
                                     offload=offload, fill=NAN, table=table)


def decode_case(params, rng, *, ranks, batch, ways, policy, page, hot, steps, permute=False,
                hlo=False, inactive=False, host_access=None, config=CONFIG):
    config = config.replace(max_ways=ways)
    # One capacity and prompt size for every case: the handoff's eager ops compile once.
    lengths = [PROMPT] + rng.integers(1, PROMPT, batch - 1).tolist()
    capacity = 32
    assert PROMPT + steps * ways <= capacity
    offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity, policy=policy,
                            host_access=host_access)
    state = random_decode_state(rng, config, batch=batch, offload=offload, lengths=lengths,
                                permute=ranks if permute else False)
    mesh = sharding.make_mesh(ranks)
    sharded = sharding.shard_state(state, mesh)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    check_decode_shardings(sharded, ranks)
    # The rows as the KV format stores them (fp8_ds_mla: uint8 rows of kv_row_width bytes).
    assert (sharded.host.kv.dtype, sharded.hot.dtype) == (config.kv_row_dtype,) * 2
    assert sharded.host.kv.shape[-1] == config.kv_row_width
    step = functools.partial(sharded_steps.sharded_decode_step, mesh=mesh, config=config,
                             offload=offload)
    if hlo:
        # The program the step runs, compiled once here and stepped below (one compile).
        tokens = rng.integers(0, config.vocab_size, (batch, ways), dtype=np.int32)
        compiled = sharded_steps.lower_sharded_decode_step(params, sharded, tokens, mesh=mesh,
                                                           config=config, offload=offload).compile()
        check_compiled(compiled, sharded, ranks)
        token_sharding = compiled.input_shardings[0][2]
        step = lambda p, s, t: compiled(p, s, jax.device_put(t, token_sharding), None)  # noqa
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (batch, ways), dtype=np.int32)
        active = rng.random(batch) < 0.7 if inactive else None  # finished seats step too
        if inactive:
            logits, sharded, stats = step(params, sharded, tokens, active=active)
        else:
            logits, sharded, stats = step(params, sharded, tokens)
        assert_ranks_decode(logits, stats, refs, params, tokens, active, config=config,
                            offload=offload)
    check_decode_shardings(sharded, ranks)
    if not hlo:  # one compiled program served every step (outputs placed as the inputs)
        statics = (("config", config), ("offload", offload), ("implementation", "xla"),
                   ("scores", False))
        program = sharded_steps._program(mesh, sharded_steps._offload_decode, statics, inactive,
                                         None)
        assert program._cache_size() == 1, program._cache_size()
    assert_state_equal(sharded, mesh, refs, ranks)
    log(f"decode {config.kv_format} ranks={ranks} B={batch} W={ways} policy={policy} Z={page} "
        f"C={hot} permuted={permute} inactive seats={inactive} host access {offload.host_access}: "
        f"{steps} steps bitwise ok (misses "
        f"{int(np.asarray(stats.misses).sum())} in the last step)")


MOE = CONFIG.replace(n_routed_experts=4, num_experts_per_tok=2, moe_hidden=8, n_group=1,
                     topk_group=1, first_k_dense_replace=1)


def all_reduces(text):
    """The all-reduces of an HLO module: (shape, replica groups) per op."""
    found = []
    for line in text.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            shape = line.split("=", 1)[1].split()[0]
            groups = re.split(r", (?:use_global_device_ids|to_apply|channel_id)=",
                              line.split("replica_groups=", 1)[1])[0]
            found.append((shape, groups))
    return found


def steps_bitwise(params, placed, rng, *, compiled, mesh, config, offload, sharded, refs,
                  ranks, batch, steps):
    """`steps` sharded decode steps (the `compiled` program) with the weights as `placed` on
    `mesh`, then one prefill chunk, each bit for bit every data rank's one-device run (`refs`:
    its DecodeState) with the whole weights `params`."""
    step = lambda p, s, t: compiled(p, s, jax.device_put(  # noqa: E731
        t, compiled.input_shardings[0][2]), None)
    per = batch // ranks
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (batch, 1), dtype=np.int32)
        logits, sharded, stats = step(placed, sharded, tokens)
        for r in range(ranks):
            seats = slice(r * per, (r + 1) * per)
            want, refs[r], _ = offload_decode.decode_step(params, refs[r], tokens[seats],
                                                          config=config, offload=offload)
            chex.assert_trees_all_equal(np.asarray(logits)[seats], np.asarray(want))
    assert_state_equal(sharded, mesh, refs, ranks)
    # One prefill chunk of up to 6 tokens per request (N = 12 tokens of a rank: more rows than
    # a tile), on the same mesh.
    page = 4
    state = offload_prefill.PrefillState.create(config, batch=batch, capacity=4 * page,
                                                page_size=page, fill=NAN)
    sharded = sharding.shard_state(state, mesh)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    tokens = rng.integers(0, config.vocab_size, (batch, 6), dtype=np.int32)
    num_new = rng.integers(1, 7, batch).astype(np.int32)
    logits, sharded = sharded_steps.sharded_prefill(placed, sharded, tokens, num_new, mesh=mesh,
                                                    config=config, num_buffers=2, history_pages=4)
    for r in range(ranks):
        seats = slice(r * per, (r + 1) * per)
        want, refs[r] = offload_prefill.prefill(params, refs[r], tokens[seats], num_new[seats],
                                                config=config, num_buffers=2, history_pages=4,
                                                query_block=None)
        for b in range(per):  # padding logits are unspecified
            n = int(num_new[seats][b])
            chex.assert_trees_all_equal(np.asarray(logits)[seats][b, :n],
                                        np.asarray(want)[b, :n])
    assert_state_equal(sharded, mesh, refs, ranks)


def expert_parallel_case(rng, *, expert, steps):
    """MoE decode steps with the experts split over `expert` (mesh data=2 x expert): each device
    holds X / expert experts' w1 / w2 / w3 and computes only their rows, summed over `expert`
    (the only collective); logits and state bit for bit each data rank's single-device run with
    the whole weights."""
    ranks, batch, num_x = 2, 4, MOE.n_routed_experts
    params = random_params(MOE, rng)
    mesh = sharding.make_mesh(ranks * expert, expert=expert)
    placed = sharding.shard_params(params, mesh)
    lengths = [PROMPT] + rng.integers(1, PROMPT, batch - 1).tolist()
    offload = OffloadConfig(hot_slots=16, page_size=4, capacity=32, policy="ring")
    state = random_decode_state(rng, MOE, batch=batch, offload=offload, lengths=lengths,
                                permute=ranks)
    sharded = sharding.shard_state(state, mesh)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    tokens = rng.integers(0, MOE.vocab_size, (batch, 1), dtype=np.int32)
    compiled = sharded_steps.lower_sharded_decode_step(placed, sharded, tokens, mesh=mesh,
                                                       config=MOE, offload=offload).compile()
    # Each device holds X / expert experts of w1 / w2 / w3 [L', X, ...], in and inside.
    param_in = compiled.input_shardings[0][0]
    for name in ("w1", "w2", "w3"):
        shape = params["moe"][name].shape
        for where in (placed["moe"][name].sharding, param_in["moe"][name]):
            assert where.shard_shape(shape) == (shape[0], num_x // expert) + shape[2:], where
    assert param_in["moe"]["gate"].shard_shape(params["moe"]["gate"].shape) == \
        params["moe"]["gate"].shape
    # The only collective: one all-reduce (in the MoE layers' loop) over the expert axis, of a
    # layer's [N K', E] expert rows (N = B / D tokens of the rank); the cache never crosses
    # devices. Replica groups: {{0,1},{2,3}} (devices of one data rank), or with jax 0.12 the
    # mesh form.
    text = compiled.as_text()
    found = [c for c in COLLECTIVES if c != "all-reduce" and c in text]
    assert not found, f"collectives other than the MoE all-reduce: {found}"
    reduces = all_reduces(text)
    groups = "{" + ",".join("{" + ",".join(str(d.id) for d in row) + "}"
                            for row in mesh.devices.reshape(-1, expert)) + "}"
    by_mesh = f"mesh['data'={ranks},'model'=1,'expert'={expert}] {{'expert'}}"
    rows = (batch // ranks) * MOE.num_experts_per_tok
    hlo_type = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[MOE.dtype]
    assert len(reduces) == 1 and reduces[0][0] == f"{hlo_type}[{rows},{MOE.dim}]{{1,0}}" and \
        reduces[0][1] in (groups, by_mesh), (reduces, groups)
    steps_bitwise(params, placed, rng, compiled=compiled, mesh=mesh, config=MOE,
                  offload=offload, sharded=sharded, refs=refs, ranks=ranks, batch=batch,
                  steps=steps)
    log(f"expert-parallel MoE decode data={ranks} x expert={expert} (X={num_x}, "
        f"{placed['moe']['w1'].addressable_shards[0].data.nbytes * 3} bytes of w1+w2+w3 per "
        f"device of {params['moe']['w1'].nbytes * 3}): {steps} steps and a prefill "
        f"chunk bitwise ok, the one collective an all-reduce {reduces[0][0]} over {reduces[0][1]}")


# FP8 weights in 128 x 128 blocks whose tensor-parallel widths leave whole blocks on each of
# two `model` devices: wq_b and wkv_b out H (dn + dr) = H (dn + dv) = 512, wo in H dv = 256.
FP8_MOE = MOE.replace(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                      index_head_dim=64)


def flat_weights(params):
    """{'layers.wo': leaf, ...}: an Fp8Weight is one leaf."""
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]
    return {sharding._names(path): leaf for path, leaf in leaves}


def fp8_weights_case(rng, *, steps):
    """FP8 weights (Fp8Weight: e4m3 values, float32 128 x 128 block scales) on a mesh data 2 x
    model 2 x expert 2, placed by the rules as the weights they stand for: wq_b, wkv_b and wo
    over `model` (attention heads), the MoE experts over `expert`, each with its block scales.
    From the arrays: every device holds 1/2 of each split weight's e4m3 values and of its
    scales, every other weight whole. Decode steps and a prefill chunk with them, bit for bit
    each data rank's one-device run with the whole FP8 weights. A mesh whose split would cut a
    scale block is refused, naming the weight and the devices, before anything is placed."""
    ranks, batch, model, expert = 2, 4, 2, 2
    params = jax.jit(quantize_params)(random_params(FP8_MOE, rng))
    split = {"embed": model, "head": model,  # the vocabulary (not FP8)
             "layers.wq_b": model, "layers.wkv_b": model, "layers.wo": model,
             "moe.w1": expert, "moe.w2": expert, "moe.w3": expert}
    live = len(jax.live_arrays())
    raises(lambda: sharding.shard_params(params, sharding.make_mesh(8, model=4)),
           "FP8 weight layers.wo (2, 256, 64): splitting its in axis (256 values, scale "
           "blocks of 128) over mesh axis 'model' of 4 devices gives 64 values per device, not "
           "a whole number of blocks: the block scales cannot be split with it. Use a mesh "
           "whose 'model' axis has one of [1, 2] devices, or map its logical axis to None in "
           "the rules (replicated)")
    assert len(jax.live_arrays()) == live, "a refused placement placed arrays"
    # At real size (shapes only) the FP8 weights split 8 ways over `model` and over `expert`:
    # DeepSeek-V3.2's wq_b / wkv_b / wo are 192 / 256 / 128 blocks wide, GLM-5's 128 / 224 / 128.
    for name in ("deepseek_v32", "glm5"):
        shapes = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                              param_shapes(get_config(name)),
                              is_leaf=lambda x: isinstance(x, tuple))
        real = jax.eval_shape(quantize_params, shapes)
        for axes, weight, spec in (({"model": 8}, "layers.wo", P(None, "model")),
                                   ({"expert": 8}, "moe.w1", P(None, "expert"))):
            got = flat_weights(sharding.param_specs(real, sharding.make_mesh(8, **axes)))
            assert got[weight] == Fp8Weight(spec, spec), (name, weight, got[weight])
    mesh = sharding.make_mesh(8, model=model, expert=expert)
    placed = sharding.shard_params(params, mesh)
    whole, held = flat_weights(params), flat_weights(placed)
    assert all(isinstance(whole[name], Fp8Weight) for name in split if "." in name), split
    per_device = {d: 0 for d in mesh.devices.flat}
    for name, w in whole.items():
        parts = (w.q, w.scale_inv) if isinstance(w, Fp8Weight) else (w,)
        placed_parts = ((held[name].q, held[name].scale_inv) if isinstance(w, Fp8Weight)
                        else (held[name],))
        for part, placed_part in zip(parts, placed_parts):
            shards = placed_part.addressable_shards
            assert len(shards) == 8, (name, len(shards))
            for shard in shards:  # 1/n of the values and of the scales on every device
                assert shard.data.dtype == part.dtype, (name, shard.data.dtype)
                assert shard.data.nbytes * split.get(name, 1) == part.nbytes, (
                    name, part.shape, shard.data.shape)
                per_device[shard.device] += shard.data.nbytes
    total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    want = sum(sum(np.asarray(x).nbytes for x in jax.tree.leaves(w)) // split.get(name, 1)
               for name, w in whole.items())
    assert set(per_device.values()) == {want}, (per_device, want)
    assert held["layers.wo"].q.dtype == jnp.float8_e4m3fn
    lengths = [PROMPT] + rng.integers(1, PROMPT, batch - 1).tolist()
    offload = OffloadConfig(hot_slots=16, page_size=4, capacity=32, policy="ring")
    state = random_decode_state(rng, FP8_MOE, batch=batch, offload=offload, lengths=lengths,
                                permute=ranks)
    sharded = sharding.shard_state(state, mesh)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    tokens = rng.integers(0, FP8_MOE.vocab_size, (batch, 1), dtype=np.int32)
    compiled = sharded_steps.lower_sharded_decode_step(placed, sharded, tokens, mesh=mesh,
                                                       config=FP8_MOE, offload=offload).compile()
    # The program takes every FP8 weight as placed, values and scales alike; inside the step
    # (shard_map) the experts' stay split over `expert`, the heads' are whole (gathered).
    param_in = flat_weights(compiled.input_shardings[0][0])
    inside = flat_weights(sharding.step_param_specs(params, mesh))
    for name, w in whole.items():
        if not isinstance(w, Fp8Weight):
            continue
        for part, placed_part, where in ((w.q, held[name].q, param_in[name].q),
                                         (w.scale_inv, held[name].scale_inv,
                                          param_in[name].scale_inv)):
            assert where.shard_shape(part.shape) == \
                placed_part.sharding.shard_shape(part.shape), (name, where)
        spec = P(None, "expert") if name.startswith("moe.w") else P()
        assert inside[name] == Fp8Weight(spec, spec), (name, inside[name])
    steps_bitwise(params, placed, rng, compiled=compiled, mesh=mesh, config=FP8_MOE,
                  offload=offload, sharded=sharded, refs=refs, ranks=ranks, batch=batch,
                  steps=steps)
    log(f"FP8 weights data={ranks} x model={model} x expert={expert}: {want} bytes per device "
        f"of {total} (wq_b, wkv_b, wo values and scales / {model}, experts / {expert}), "
        f"{steps} decode steps and a prefill chunk bitwise ok; model=4 refused (wo's blocks)")


def resident_case(params, rng, *, ranks, batch, ways, steps, config=CONFIG):
    config = config.replace(max_ways=ways)
    capacity = 32
    state = resident.ResidentState.create(config, batch=batch, capacity=capacity, fill=NAN)
    lengths = rng.integers(1, 16, batch)
    state = dataclasses.replace(
        state,
        kv=stored_rows(rng.standard_normal(state.kv.shape[:-1] + (config.kv_width,)), config),
        index_keys=jnp.asarray(rng.standard_normal(state.index_keys.shape),
                               state.index_keys.dtype),
        lengths=jnp.asarray(lengths, jnp.int32))
    mesh = sharding.make_mesh(ranks)
    sharded = sharding.shard_state(state, mesh)
    assert_split(sharded.kv, 1, ranks)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    per = batch // ranks
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (batch, ways), dtype=np.int32)
        logits, sharded = sharded_steps.sharded_resident_decode_step(params, sharded, tokens,
                                                                     mesh=mesh, config=config)
        for r in range(ranks):
            seats = slice(r * per, (r + 1) * per)
            want, refs[r] = resident.decode_step(params, refs[r], tokens[seats], config=config)
            chex.assert_trees_all_equal(np.asarray(logits)[seats], np.asarray(want))
    assert_split(sharded.kv, 1, ranks)
    assert_state_equal(sharded, mesh, refs, ranks)
    log(f"resident decode {config.kv_format} ranks={ranks} B={batch} W={ways}: {steps} steps "
        "bitwise ok")


def loop_case(params, rng, *, ranks, batch, steps, resident_path=False):
    """The decode loop data-parallel (`sharded_decode_loop`): greedy and sampled requests with
    their own keys, stop tokens and max_new_tokens, so ranks leave their loops at different
    steps; tokens, stats, seats and state against each rank's single-device `decode_loop`."""
    from fo_jax.decode_loop import OffloadedStep, ResidentStep, Seats, decode_loop
    from fo_jax.sampling import Sampling

    config = CONFIG
    lengths = [PROMPT] + rng.integers(1, PROMPT, batch - 1).tolist()
    capacity = 32
    offload = OffloadConfig(hot_slots=16, page_size=4, capacity=capacity, policy="random")
    state = random_decode_state(rng, config, batch=batch, offload=offload, lengths=lengths,
                                permute=False)
    if resident_path:
        state = resident.ResidentState.create(config, batch=batch, capacity=capacity, fill=NAN)
        state = dataclasses.replace(
            state, kv=jnp.asarray(rng.standard_normal(state.kv.shape), state.kv.dtype),
            index_keys=jnp.asarray(rng.standard_normal(state.index_keys.shape),
                                   state.index_keys.dtype),
            lengths=jnp.asarray(lengths, jnp.int32))
    step = ResidentStep(config) if resident_path else OffloadedStep(config, offload)
    # Rank 0 keeps sampling for `steps` steps; the others stop sooner (max_new_tokens).
    max_new = [steps + 1] + rng.integers(2, steps + 1, batch - 1).tolist()
    sampling = Sampling.create(batch, temperature=[0.0, 0.8] * (batch // 2), top_p=0.9,
                               max_new_tokens=max_new,
                               stop_tokens=[[int(t)] for t in rng.integers(0, 64, batch)])
    keys = jax.random.split(jax.random.key(3), batch)
    first = rng.integers(64, config.vocab_size, batch).astype(np.int32)
    seats = Seats.create(first, keys, sampling=sampling, lengths=lengths, capacity=capacity)
    mesh = sharding.make_mesh(ranks)
    sharded = sharding.shard_state(state, mesh)
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    out, sharded, new_seats = sharded_steps.sharded_decode_loop(params, sharded, seats, steps,
                                                                sampling, mesh=mesh, step=step)
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
        for _ in range(max(taken) - taken[r]):  # what the busiest rank's count adds: inactive
            # steps, which change only the step counter and the random policy's key
            refs[r] = step(params, refs[r], np.zeros((per, 1), np.int32),
                           jnp.zeros((per,), bool))[1]
        rows = slice(r * per, (r + 1) * per)
        want, want_seats = wants[r]
        chex.assert_trees_all_equal(np.asarray(out.tokens)[rows], np.asarray(want.tokens))
        chex.assert_trees_all_equal(np.asarray(out.fed)[rows], np.asarray(want.fed))
        for got, ref in ((new_seats.tokens, want_seats.tokens),
                         (new_seats.generated, want_seats.generated),
                         (new_seats.done, want_seats.done),
                         (jax.random.key_data(new_seats.keys),
                          jax.random.key_data(want_seats.keys))):
            chex.assert_trees_all_equal(np.asarray(got)[rows], np.asarray(ref))
        if not resident_path:
            got_stats = jax.tree.map(lambda x: np.take(np.asarray(x), np.arange(
                rows.start, rows.stop), axis=0 if x.ndim == 1 else 1), out.stats)
            chex.assert_trees_all_equal(got_stats, jax.tree.map(np.asarray, want.stats))
    assert int(out.num_steps) == max(taken), (int(out.num_steps), taken)
    assert len(set(taken)) > 1, taken  # the ranks left their loops at different steps
    if resident_path:
        assert_split(sharded.kv, 1, ranks)
    else:
        check_decode_shardings(sharded, ranks)
    assert_state_equal(sharded, mesh, refs, ranks)
    log(f"decode loop {'resident' if resident_path else 'offloaded'} ranks={ranks} B={batch} "
        f"N={steps}: steps per rank {taken}, bitwise ok")


def prefill_case(params, rng, *, ranks, batch, page, chunks, width):
    capacity = 4 * page
    state = offload_prefill.PrefillState.create(CONFIG, batch=batch, capacity=capacity,
                                                page_size=page, fill=NAN)
    mesh = sharding.make_mesh(ranks)
    sharded = sharding.shard_state(state, mesh)
    assert_split(sharded.host.kv, 1, ranks, "pinned_host")
    refs = [rank_state(state, r, ranks) for r in range(ranks)]
    per = batch // ranks
    for _ in range(chunks):
        tokens = rng.integers(0, CONFIG.vocab_size, (batch, width), dtype=np.int32)
        num_new = rng.integers(1, width + 1, batch).astype(np.int32)
        # Every page loaded each chunk: one program for both chunks.
        history = capacity // page
        logits, sharded = sharded_steps.sharded_prefill(params, sharded, tokens, num_new, mesh=mesh,
                                                        config=CONFIG, num_buffers=2,
                                                        history_pages=history)
        for r in range(ranks):
            seats = slice(r * per, (r + 1) * per)
            want, refs[r] = offload_prefill.prefill(params, refs[r], tokens[seats],
                                                    num_new[seats], config=CONFIG,
                                                    num_buffers=2, history_pages=history,
                                                    query_block=None)
            for b in range(per):  # padding logits are unspecified
                n = int(num_new[seats][b])
                chex.assert_trees_all_equal(np.asarray(logits)[seats][b, :n],
                                            np.asarray(want)[b, :n])
    assert_split(sharded.host.kv, 1, ranks, "pinned_host")
    assert_state_equal(sharded, mesh, refs, ranks)
    log(f"offloaded prefill ranks={ranks} B={batch} Z={page}: {chunks} chunks bitwise ok")


def tiny_weights(rng, directory):
    """A file of numpy-drawn `tiny` weights (`--weights`: no init program compiled; the CLI's
    own init runs in tests/test_cli.py)."""
    from fo_jax.weights import save_params

    config = get_config("tiny")
    weights = os.path.join(directory, "tiny.safetensors")
    save_params(weights, jax.device_get(random_params(config, rng)), config)
    return weights


def cli_case(weights):
    """`fo-jax generate --offload --devices 4` on the simulated devices (in this process)."""
    from fo_jax import cli

    out = io.StringIO()
    argv = ["generate", "--model", "tiny", "--offload", "--devices", "4", "--batch", "4",
            "--max-new-tokens", "3", "--prompt", "abc", "--page-size", "4", "--no-progress",
            "--decode-steps-per-call", "2", "--weights", weights]
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    text = out.getvalue()
    assert code == 0, text
    assert "path: offload   batch: 4" in text and "generated: 12 tokens" in text, text
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(argv + ["--batch", "6"])
    assert code == 2 and ("fo-jax: error: --batch 6 must be a multiple of --devices 4 (each "
                          "device runs batch / devices requests)") in err.getvalue(), err.getvalue()
    log("fo-jax generate --offload --devices 4 ok")


def generated(argv):
    """`fo-jax ARGV` run here: (its output, the tokens it generated [B, N])."""
    from fo_jax import cli, generate

    results, real = [], generate.generate

    def recording(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    out = io.StringIO()
    generate.generate = recording
    try:
        with contextlib.redirect_stdout(out):
            code = cli.main(argv)
    finally:
        generate.generate = real
    assert code == 0, out.getvalue()
    return out.getvalue(), np.asarray(results[0].tokens)


def cli_fp8_kv_case(weights):
    """`fo-jax generate --offload --devices 2 --kv-format fp8_ds_mla`: the data-parallel
    prefill, handoff and decode steps on uint8 fp8_ds_mla rows, a context past the hot cache
    (misses read from the host pool); every request's tokens bit for bit those of the
    one-device FP8 run of one request (`--batch 1`: the program each rank runs)."""
    prompt = "def read_lines(path): return open(path).read().splitlines()  # a text file's lines"
    argv = ["generate", "--model", "tiny", "--offload", "--kv-format", "fp8_ds_mla",
            "--max-new-tokens", "4", "--prompt", prompt, "--page-size", "4", "--no-progress",
            "--weights", weights]
    text, tokens = generated(argv + ["--devices", "2", "--batch", "2"])
    assert "path: offload   batch: 2   KV rows: fp8_ds_mla" in text, text
    misses = int(re.search(r"misses (\d+)", text).group(1))
    assert misses > 0, text  # the hot cache (64 slots) holds less than the context
    _, solo = generated(argv + ["--batch", "1"])
    assert tokens.shape == (2, 4), tokens.shape
    for b in range(2):
        np.testing.assert_array_equal(tokens[b], solo[0])
    log(f"fo-jax generate --offload --devices 2 --kv-format fp8_ds_mla: tokens "
        f"{tokens[0].tolist()} of each request ({misses} misses) bitwise those of the "
        "one-device FP8 run")


def raises(fn, message):
    try:
        fn()
    except ValueError as err:
        assert message in str(err), f"{message!r} not in {str(err)!r}"
    else:
        raise AssertionError(f"no ValueError ({message!r})")


def error_cases(rng):
    """The refusals of fo_jax.sharding, messages pinned (no program compiled)."""
    offload = OffloadConfig(hot_slots=4, page_size=4, capacity=8)
    # Seat 0 (rank 0) holds frame 2, which is rank 1's (F = 4, two frames per rank).
    table = np.array([[2, 1], [0, 3]], np.int32)
    state = random_decode_state(rng, CONFIG, batch=2, offload=offload, lengths=[5, 6],
                                permute=False)
    raises(lambda: sharding.shard_state(dataclasses.replace(state, table=jnp.asarray(table)),
                                        sharding.make_mesh(2)),
           "page table entry [0, 0] = 2 names a frame of rank 1's pool shard, but seat 0 "
           "belongs to rank 0 (frames [0, 2)): give each seat pages of its own rank's shard")
    raises(lambda: sharding.shard_state(state, sharding.make_mesh(4)),
           "batch B=2 must be a multiple of the data axis size 4 (every rank holds B / D "
           "seats): pad the batch with inactive seats")
    raises(lambda: sharding.make_mesh(16),
           "num_devices=16 must be in [1, 8] (the devices jax sees; on a CPU set XLA_FLAGS="
           "--xla_force_host_platform_device_count=N before jax starts to simulate N)")
    raises(lambda: sharding.make_mesh(8, model=3),
           "model=3 x expert=1 must divide num_devices=8 (the data axis gets the rest)")
    mesh = sharding.make_mesh(8, model=2, expert=2)
    assert dict(mesh.shape) == {"data": 2, "model": 2, "expert": 2}
    moe = CONFIG.replace(n_routed_experts=4, num_experts_per_tok=2, moe_hidden=8,
                         n_group=1, topk_group=1, first_k_dense_replace=1)
    specs = sharding.param_specs(random_params(moe, rng), mesh)
    assert specs["moe"]["w1"] == jax.sharding.PartitionSpec(None, "expert")
    assert specs["layers"]["wo"] == jax.sharding.PartitionSpec(None, "model")
    assert specs["layers"]["attn_norm"] == jax.sharding.PartitionSpec()
    log("refusals and weight rules ok")


def empty_operand_case():
    """A zero-sized operand and result of a data-parallel body (the policy fields a policy does
    not use, [G, B, 0]): the body sees its per-rank shape, the result comes back whole. jax
    0.11.2 segfaulted compiling a shard_map with a zero-sized operand."""
    spec = jax.sharding.PartitionSpec

    def body(x, empty):
        assert empty.shape == (1, 2, 0), empty.shape
        return x * 2, empty + 1

    run = jax.jit(sharded_steps.data_parallel(body, sharding.make_mesh(4),
                                               (spec("data"), spec(None, "data")),
                                               (spec("data"), spec(None, "data"))))
    x = np.arange(24, dtype=np.int32).reshape(8, 3)
    doubled, empty = run(jnp.asarray(x), jnp.zeros((1, 8, 0), jnp.int32))
    np.testing.assert_array_equal(np.asarray(doubled), 2 * x)
    assert empty.shape == (1, 8, 0) and empty.dtype == jnp.int32, empty
    log("zero-sized operand of a data-parallel body ok")


def handoff_case(rng, *, config, ranks=2, batch=4):
    """The prefill -> decode handoff on a mesh (`sharded_to_decode_state`) with the NaN fill
    (fp8_ds_mla rows: the bytes 0xFF): the DecodeState bit for bit each rank's one-device
    `to_decode_state` of its requests and pool shard (hot rows past a request's length hold
    the fill)."""
    page, capacity = 4, 32
    offload = OffloadConfig(hot_slots=16, page_size=page, capacity=capacity, policy="ring")
    state = offload_prefill.PrefillState.create(config, batch=batch, capacity=capacity,
                                                page_size=page, fill=NAN)
    rows = stored_rows(rng.standard_normal(state.host.kv.shape[:-1] + (config.kv_width,)),
                       config)
    state = dataclasses.replace(
        state, host=dataclasses.replace(state.host,
                                        kv=jax.device_put(rows, state.host.kv.sharding)),
        index_keys=jnp.asarray(rng.standard_normal(state.index_keys.shape),
                               state.index_keys.dtype),
        lengths=jnp.asarray(rng.integers(1, 24, batch), jnp.int32))
    mesh = sharding.make_mesh(ranks)
    refs = [offload_prefill.to_decode_state(rank_state(state, r, ranks), config=config,
                                            offload=offload, fill=NAN) for r in range(ranks)]
    got = sharded_steps.sharded_to_decode_state(sharding.shard_state(state, mesh), mesh=mesh,
                                                config=config, offload=offload, fill=NAN)
    check_decode_shardings(got, ranks)
    assert_state_equal(got, mesh, refs, ranks)
    log(f"handoff {config.kv_format} ranks={ranks} B={batch}, NaN fill: bitwise ok")


def fp8_kv_steps(rng):
    """The fp8_ds_mla KV format through the sharded offloaded decode (uint8 host and hot rows,
    no collective), resident decode and the prefill -> decode handoff, bit for bit each rank's
    one-device run."""
    fp8_kv = CONFIG.replace(kv_format="fp8_ds_mla")
    params = random_params(CONFIG, rng)
    decode_case(params, rng, ranks=2, batch=4, ways=2, policy="clock", page=4, hot=16, steps=2,
                permute=True, hlo=True, config=fp8_kv)
    resident_case(params, rng, ranks=2, batch=4, ways=1, steps=2, config=fp8_kv)
    handoff_case(rng, config=fp8_kv)


def fp8_generate(rng):
    with tempfile.TemporaryDirectory() as directory:
        cli_fp8_kv_case(tiny_weights(rng, directory))


# The FP8 cases, one subprocess each (tests/sharding/test_fp8_sharding.py).
FP8_SUITES = {"--fp8-weights": lambda rng: fp8_weights_case(rng, steps=2),
              "--fp8-kv-steps": fp8_kv_steps, "--fp8-generate": fp8_generate}


def main(argv):
    assert len(jax.devices()) == 8, jax.devices()
    unknown = [a for a in argv[1:] if a.startswith("--") and a not in FP8_SUITES]
    assert not unknown, f"unknown options {unknown}: expected {sorted(FP8_SUITES)}"
    seeds = [a for a in argv[1:] if not a.startswith("--")]
    rng = np.random.default_rng(int(seeds[0]) if seeds else 0)
    suites = [FP8_SUITES[a] for a in argv[1:] if a in FP8_SUITES]
    if suites:
        for suite in suites:
            suite(rng)
        log("ALL OK")
        return
    params = random_params(CONFIG, rng)
    error_cases(rng)
    empty_operand_case()
    decode_case(params, rng, ranks=4, batch=8, ways=1, policy="ring", page=4, hot=16, steps=3,
                hlo=True)
    # fo_jax's own host copies (FFI custom calls) inside each rank's program.
    decode_case(params, rng, ranks=2, batch=8, ways=3, policy="clock", page=4, hot=16, steps=3,
                permute=True, inactive=True, host_access="ffi")
    decode_case(params, rng, ranks=8, batch=8, ways=4, policy="lru", page=4, hot=16, steps=3)
    expert_parallel_case(rng, expert=2, steps=2)
    resident_case(params, rng, ranks=4, batch=4, ways=2, steps=2)
    prefill_case(params, rng, ranks=2, batch=4, page=4, chunks=2, width=6)
    loop_case(params, rng, ranks=4, batch=8, steps=6)
    loop_case(params, rng, ranks=2, batch=4, steps=4, resident_path=True)
    with tempfile.TemporaryDirectory() as directory:
        cli_case(tiny_weights(rng, directory))
    log("ALL OK")


if __name__ == "__main__":
    main(sys.argv)

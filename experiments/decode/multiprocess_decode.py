"""Question: does data-parallel decode over many processes give the single-device results?

Each process of a `jax.distributed` run feeds its own requests (rows of the batch), the weights
are replicated, and one program per step runs on every device of every process; greedy tokens
and all logits are read back per process and gathered. They must equal, bit for bit, one
process on one device running the same requests with the same rows per program (XLA:CPU's
results depend on the batch of a program: a [8, ...] step and two [4, ...] steps differ in the
last bits, so the single-device run takes the rows a device takes, B / D at a time).

    python -m fo_jax.distributed launch --processes 2 --devices-per-process 4 -- \\
        -m experiments.decode.multiprocess_decode --out /tmp/mp --check --path both

Each process writes rows_<path>_<process id>.npz (its rows, the gathered tokens) under --out;
with --check, process 0 also runs the single-device reference and reports the comparison (one
JSON line per path and process). Without a launcher the script runs as one process over its
local devices.

The decode implementation is a `DecodePath` (--path): a state constructor (this process's rows),
its placement over a mesh, prefill and decode step. RESIDENT is fo_jax.resident split over the
`data` axis by plain jit. OFFLOADED is fo_jax.sharded_steps' data-parallel offloaded steps (prefill,
handoff, decode step in shard_map over `data`): each process builds only its own seats and its
own part of the host pools (F / P frames, `pinned_host`), with page tables of rank-local frame
ids, and joins them into global arrays with `distributed.global_tree`; with --check it is
compared with the single-device offloaded steps of each device's B / D rows and F / D frames.
`--path both` runs the two in one launch.

The offloaded path calls fo_jax.sharded_steps' public steps with their checks on: across processes
their value checks read the whole batch's lengths, page tables and token ids by gathering every
process's rows (small arrays; the KV stays where it is), so every process validates the same
values and compiles the same program.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable

import jax

from fo_jax import distributed

# Join the other processes before anything starts the backend (the imports below do not).
INFO = distributed.initialize_from_env() if __name__ == "__main__" else None

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from fo_jax import resident, sharded_steps, sharding  # noqa: E402
from fo_jax.config import ModelConfig, get_config  # noqa: E402
from fo_jax.model.dsa import check_params, param_dtype, param_shapes  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload import prefill as offload_prefill  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402

from experiments.common import run_metadata  # noqa: E402


@dataclasses.dataclass(frozen=True)
class DecodePath:
    """What data-parallel generation needs of a decode implementation.

    Attributes:
      name: for reports.
      create_state: (config, batch, capacity) -> an empty state of `batch` requests (built on
        the host side of each process: its own rows only).
      place_state: (state, mesh, axis) -> the state of every process's rows as one state over
        the mesh, requests split over the mesh axis `axis` (each process passes its own).
      prefill: (params, state, tokens [B, T], num_new [B], *, config, mesh) -> (logits
        [B, T, V], a state ready for decode steps); mesh None: one device.
      decode_step: (params, state, tokens [B, W], *, config, mesh) -> (logits [B, W, V],
        state).
    """

    name: str
    create_state: Callable[[ModelConfig, int, int], Any]
    place_state: Callable[[Any, Mesh, str], Any]
    prefill: Callable[..., tuple[jax.Array, Any]]
    decode_step: Callable[..., tuple[jax.Array, Any]]


def resident_state_shardings(state: resident.ResidentState, mesh: Mesh, axis: str
                             ) -> resident.ResidentState:
    """ResidentState split by requests over `axis`: kv [L, B, S, D+R] and index_keys
    [G, B, S, N] along B, lengths [B]; each device holds its B / D requests whole."""
    rows = NamedSharding(mesh, P(None, axis))
    return resident.ResidentState(kv=rows, index_keys=rows,
                                  lengths=NamedSharding(mesh, P(axis)))


RESIDENT = DecodePath(
    name="resident",
    create_state=lambda config, batch, capacity: resident.ResidentState.create(
        config, batch=batch, capacity=capacity, fill=float("nan")),
    place_state=lambda state, mesh, axis: distributed.global_tree(
        state, resident_state_shardings(state, mesh, axis)),
    # check=False: the checks read state.lengths to the host, which a process cannot do for
    # rows on another process's devices (the inputs are checked where they are made).
    prefill=lambda params, state, tokens, num_new, *, config, mesh: resident.prefill(
        params, state, tokens, num_new, config=config, check=False),
    decode_step=lambda params, state, tokens, *, config, mesh: resident.decode_step(
        params, state, tokens, config=config, check=False),
)


# The offloaded path: page size Z and hot slots C of the demonstration (C = index_topk x
# max_ways, the fewest a step runs with, for the tiny config).
OFFLOAD_PAGE = 4


def _offload_config(config: ModelConfig, state) -> OffloadConfig:
    """The OffloadConfig of a PrefillState / DecodeState built by `create_offload_state`."""
    return OffloadConfig(hot_slots=config.index_topk * config.max_ways,
                         page_size=state.host.page_size, capacity=state.capacity)


def create_offload_state(config: ModelConfig, batch: int, capacity: int
                         ) -> offload_prefill.PrefillState:
    """An empty PrefillState of `batch` requests: capacity rounded up to whole pages, a pool of
    F = B P pages in `pinned_host` memory, the identity page table (seat b: frames
    [b P, (b + 1) P)), unwritten rows NaN (a stray read shows)."""
    capacity = -(-capacity // OFFLOAD_PAGE) * OFFLOAD_PAGE
    return offload_prefill.PrefillState.create(config, batch=batch, capacity=capacity,
                                               page_size=OFFLOAD_PAGE, fill=float("nan"))


def _local_ranks(mesh: Mesh, axis: str) -> int:
    """Positions of `axis` held by this process's devices (its data-parallel ranks)."""
    along = mesh.axis_names.index(axis)
    return len({at[along] for at in np.ndindex(mesh.devices.shape)
                if mesh.devices[at].process_index == jax.process_index()})


def place_offload_state(state: offload_prefill.PrefillState, mesh: Mesh, axis: str
                        ) -> offload_prefill.PrefillState:
    """This process's PrefillState (its B / P seats, its F / P pool frames, table of frame ids
    of its own pool) as its part of one state over the mesh: the table converted to rank-local
    ids of its D / P ranks (`sharding.local_table`: each seat must name frames of its own
    rank's F / D), every array placed by `sharding.shardings` (host pages keep `pinned_host`,
    split over `data` by frames), rows and frames of each process in process order. Touches
    the local state only (O(state / P) host to device)."""
    if axis != sharding.DATA:
        raise ValueError(f"the offloaded path splits over fo_jax.sharding's {sharding.DATA!r} "
                         f"axis, got axis={axis!r}")
    ranks = _local_ranks(mesh, axis)
    table = sharding.local_table(state.table, num_frames=state.num_frames, ranks=ranks)
    local = dataclasses.replace(state, table=table)
    return distributed.global_tree(local, sharding.shardings(local, mesh))


def offload_prefill_step(params, state, tokens, num_new, *, config: ModelConfig, mesh):
    """Prefill from an empty PrefillState and the handoff to a DecodeState.

    mesh None: `offload_prefill.prefill` + `to_decode_state` on one device. With a mesh:
    `sharded_steps.sharded_prefill` + `sharded_steps.sharded_to_decode_state`, checks on: across
    processes their value checks and static sizes read the whole batch's lengths, page table
    and token ids by gathering every process's rows (small arrays), so every process compiles
    the same program; the KV never crosses processes."""
    if mesh is None:
        logits, state = offload_prefill.prefill(params, state, tokens, num_new, config=config,
                                                history_pages=0)
        return logits, offload_prefill.to_decode_state(
            state, config=config, offload=_offload_config(config, state), fill=float("nan"))
    offload = _offload_config(config, state)
    logits, state = sharded_steps.sharded_prefill(params, state, tokens, num_new, mesh=mesh,
                                                  config=config, history_pages=0,
                                                  query_block=offload_prefill.QUERY_BLOCK)
    return logits, sharded_steps.sharded_to_decode_state(state, mesh=mesh, config=config,
                                                         offload=offload, fill=float("nan"))


def offload_decode_one(params, state, tokens, *, config: ModelConfig, mesh):
    """One offloaded decode step: `offload_decode.decode_step` (mesh None) or
    `sharded_steps.sharded_decode_step` (checks on, as for the prefill)."""
    offload = _offload_config(config, state)
    if mesh is None:
        logits, state, _ = offload_decode.decode_step(params, state, tokens, config=config,
                                                      offload=offload, implementation="xla")
    else:
        logits, state, _ = sharded_steps.sharded_decode_step(params, state, tokens, mesh=mesh,
                                                             config=config, offload=offload,
                                                             implementation="xla")
    return logits, state


OFFLOADED = DecodePath(
    name="offloaded",
    create_state=create_offload_state,
    place_state=place_offload_state,
    prefill=offload_prefill_step,
    decode_step=offload_decode_one,
)

PATHS = {p.name: p for p in (RESIDENT, OFFLOADED)}


@jax.jit
def _first_token(logits, num_new):
    """[B, 1] greedy token after each prompt: argmax of logits [B, T, V] at row b's last real
    position num_new[b] - 1."""
    last = jnp.take_along_axis(logits, (num_new - 1)[:, None, None], axis=1)
    return jnp.argmax(last, axis=-1).astype(jnp.int32)


@jax.jit
def _next_token(logits):
    """[B, 1] greedy token of logits [B, 1, V]."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def generate(params, prompts: np.ndarray, num_new: np.ndarray, *, config: ModelConfig,
             steps: int, mesh: Mesh | None, path: DecodePath = RESIDENT,
             axis: str = distributed.DATA_AXIS) -> dict[str, np.ndarray]:
    """Greedy decode of this process's requests: prefill of prompts [b, T] (row r's first
    num_new[r] tokens real), then `steps` decode steps of one token.

    With a mesh, `prompts` are this process's b = B / P rows of the global batch, the state is
    split over `axis` by `path.place_state` and `params` must be replicated over the mesh;
    without one (None), everything runs on the default device, b = B. Returns this process's
    rows on the host: "tokens" [b, steps + 1] int32 and "logits" [b, T + steps, V] (prefill
    logits, then one row per step).
    """
    capacity = prompts.shape[1] + steps
    state = path.create_state(config, prompts.shape[0], capacity)
    if mesh is None:
        put, rows = jnp.asarray, np.asarray
    else:
        state = path.place_state(state, mesh, axis)

        def put(x):
            return distributed.global_batch(x, mesh, axis)

        rows = distributed.local_rows
    num_new = put(np.asarray(num_new, np.int32))
    logits, state = path.prefill(params, state, put(np.asarray(prompts, np.int32)), num_new,
                                 config=config, mesh=mesh)
    token = _first_token(logits, num_new)
    out_logits, out_tokens = [rows(logits)], [rows(token)]
    for _ in range(steps):
        logits, state = path.decode_step(params, state, token, config=config, mesh=mesh)
        token = _next_token(logits)
        out_logits.append(rows(logits))
        out_tokens.append(rows(token))
    return {"tokens": np.concatenate(out_tokens, axis=1),
            "logits": np.concatenate(out_logits, axis=1)}


def reference(params, prompts: np.ndarray, num_new: np.ndarray, *, config: ModelConfig,
              steps: int, rows_per_call: int, path: DecodePath = RESIDENT
              ) -> dict[str, np.ndarray]:
    """`generate` on one device, no mesh, `rows_per_call` requests at a time (the rows a
    device holds in the data-parallel run): the results it must equal bit for bit."""
    if prompts.shape[0] % rows_per_call:
        raise ValueError(f"rows_per_call={rows_per_call} must divide the batch "
                         f"{prompts.shape[0]}")
    parts = [generate(params, prompts[lo:lo + rows_per_call], num_new[lo:lo + rows_per_call],
                      config=config, steps=steps, mesh=None, path=path)
             for lo in range(0, prompts.shape[0], rows_per_call)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def host_params(config: ModelConfig, seed: int) -> dict:
    """Random weights in numpy, the same on every process from the seed (no compilation, unlike
    `init_params`): normal(0, fan_in^-0.5) matrices, unit norms, zero biases."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        names = tuple(k.key for k in path)
        dtype = param_dtype(names, config)
        if names[-1].endswith(("norm", "norm_w")):
            return np.ones(shape, dtype)
        if names[-1].endswith(("_b", "bias")):
            return np.zeros(shape, dtype)
        scale = 1.0 if names[-1] == "embed" else shape[-2] ** -0.5
        return (rng.standard_normal(shape, np.float32) * scale).astype(dtype)

    params = jax.tree_util.tree_map_with_path(
        leaf, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    check_params(params, config)
    return params


def workload(*, batch: int, prompt_len: int, config: ModelConfig, seed: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """The global batch: prompts [B, T] of random tokens and ragged lengths num_new [B] in
    [1, T] (the same on every process, from the seed)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, config.vocab_size, (batch, prompt_len), dtype=np.int32)
    return prompts, rng.integers(1, prompt_len + 1, (batch,), dtype=np.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=None,
                         help="global requests (default: one per device)")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for rows_<process>.npz")
    parser.add_argument("--check", action="store_true",
                        help="process 0 also runs the single-device reference and compares")
    parser.add_argument("--path", choices=sorted(PATHS) + ["both"], default="resident",
                        help="decode implementation ('both': resident, then offloaded)")
    ns = parser.parse_args(argv)
    config = get_config(ns.config)
    mesh = distributed.data_mesh()
    num_devices, me, num_processes = mesh.size, jax.process_index(), jax.process_count()
    batch = num_devices if ns.batch is None else ns.batch
    if batch % num_devices:
        parser.error(f"--batch {batch} must be a multiple of the {num_devices} devices")
    prompts, num_new = workload(batch=batch, prompt_len=ns.prompt_len, config=config,
                                seed=ns.seed)
    per_process = batch // num_processes
    mine = slice(me * per_process, (me + 1) * per_process)
    weights = host_params(config, ns.seed)
    params = distributed.replicate(weights, mesh)
    paths = [RESIDENT, OFFLOADED] if ns.path == "both" else [PATHS[ns.path]]
    ok = True
    for path in paths:
        start = time.perf_counter()
        result = generate(params, prompts[mine], num_new[mine], config=config, steps=ns.steps,
                          mesh=mesh, path=path)
        # Every process's tokens on every process: a collective across processes (gloo on CPU).
        gathered = np.asarray(multihost_utils.process_allgather(result["tokens"], tiled=True))
        seconds = time.perf_counter() - start
        if ns.out:
            os.makedirs(ns.out, exist_ok=True)
            np.savez(os.path.join(ns.out, f"rows_{path.name}_{me}.npz"), first_row=mine.start,
                     gathered_tokens=gathered, **result)
        line = dict(run_metadata(), question="multiprocess_decode", path=path.name,
                    process=me, processes=num_processes, devices=num_devices, batch=batch,
                    prompt_len=ns.prompt_len, steps=ns.steps, seconds=round(seconds, 3))
        if ns.check:
            logits = np.asarray(multihost_utils.process_allgather(result["logits"],
                                                                  tiled=True))
        if ns.check and me == 0:
            ref = reference(weights, prompts, num_new, config=config, steps=ns.steps,
                            rows_per_call=batch // num_devices, path=path)
            line["equal_tokens"] = bool(np.array_equal(gathered, ref["tokens"]))
            line["equal_logits"] = bool(np.array_equal(logits, ref["logits"], equal_nan=True))
        print(json.dumps(line), flush=True)
        ok = ok and line.get("equal_tokens", True) and line.get("equal_logits", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

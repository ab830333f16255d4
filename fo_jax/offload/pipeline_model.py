"""Analytic model of the offloaded prefill layer loop: three engines (H2D copy, compute, D2H copy)
sharing `num_buffers` full-layer device buffers.

The loop (design brief, section 2, "Prefill"):

  * buffer 0 is pinned to layer 0 for the whole prefill: layer 0's KV is on the device before the
    loop starts, so compute starts at once (its load time is ignored);
  * buffers 1 .. n-1 rotate over layers >= 1 round-robin: layer j uses buffer
    `1 + (j - 1) % (n - 1)`, so it takes over the buffer of layer `j - (n - 1)` (its "previous
    occupant"; none for j <= n - 1);
  * `onload_layer_map[i]` names the layers whose loads are issued when layer i starts computing
    (its scheduling point); every layer >= 1 is loaded exactly once;
  * a load may start when (a) its scheduling point is reached, (b) its buffer is free: the
    previous occupant's compute AND write-back have finished, and (c) its copy engine is idle;
  * compute of layer l starts when compute of layer l - 1 has finished and l's load is done;
  * the write-back (D2H) of layer l is ready when l's compute has finished;
  * each copy engine runs one transfer at a time, in the order the transfers became ready
    (ties: program order, i.e. the write-back of layer i - 1 before the loads issued at layer i).
    H2D and D2H use separate engines, or one shared serial engine.

The prefill ends when the last compute AND every write-back have finished.

Exposure. With separate engines and a copy engine that is idle when a load is issued, the
compute waits for layer l exactly

    exposed_load(l) = max(0, tau_H2D(l) - d_on(l) * tau_compute)

where d_on(l) is the number of layers computed between the scheduling point and layer l (the
bound of the design). When loads queue behind each other (tau_H2D > tau_compute in steady state)
the engine's throughput bounds instead: the compute waits max(0, tau_H2D - tau_compute) per layer
whatever the distance, so the formula is a lower bound. With one shared engine a steady layer
needs tau_H2D + tau_D2H of copy time per tau_compute of compute: the window needed to hide the
copies doubles when the two directions take equal time.

Times are seconds, sizes bytes, work FLOPs (2 per multiply-add).
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.offload.layer_schedule import (check_count, default_onload_layer_map,
                                           normalize_onload_layer_map)

# Hardware ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Rates of one accelerator for the pipeline model.

    Attributes:
      name: label for reports.
      h2d_bytes_per_s: achieved host-to-device copy rate (bytes/s).
      d2h_bytes_per_s: achieved device-to-host copy rate (bytes/s).
      shared_copy_engine: True when H2D and D2H share one serial copy path.
      flops_per_s: achievable dense compute rate (FLOP/s) used to turn FLOPs into time.
    """

    name: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    shared_copy_engine: bool
    flops_per_s: float

    def __post_init__(self):
        for field in ("h2d_bytes_per_s", "d2h_bytes_per_s", "flops_per_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"HardwareProfile.{field} must be > 0, got {value!r}")

    def h2d_time(self, num_bytes: float) -> float:
        """Seconds to copy `num_bytes` host -> device."""
        return num_bytes / self.h2d_bytes_per_s

    def d2h_time(self, num_bytes: float) -> float:
        """Seconds to copy `num_bytes` device -> host."""
        return num_bytes / self.d2h_bytes_per_s

    def compute_time(self, flops: float) -> float:
        """Seconds to run `flops` FLOPs at the achievable rate."""
        return flops / self.flops_per_s


# H200: PCIe Gen5 x16, ~63 GB/s per direction in theory, ~55 GB/s achieved with pinned memory
# (design brief, section 6). Compute: 989 TFLOP/s bf16 dense peak; ~80% of it, 790 TFLOP/s, is
# taken as achievable for the prefill's large matmuls.
H200_COPY_BYTES_PER_S = 55e9
H200_FLOPS_PER_S = 790e12

HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "h200": HardwareProfile(
        name="h200", h2d_bytes_per_s=H200_COPY_BYTES_PER_S,
        d2h_bytes_per_s=H200_COPY_BYTES_PER_S, shared_copy_engine=False,
        flops_per_s=H200_FLOPS_PER_S,
    ),
    "h200_shared_copy": HardwareProfile(
        name="h200_shared_copy", h2d_bytes_per_s=H200_COPY_BYTES_PER_S,
        d2h_bytes_per_s=H200_COPY_BYTES_PER_S, shared_copy_engine=True,
        flops_per_s=H200_FLOPS_PER_S,
    ),
}


# Work and traffic of one layer -----------------------------------------------------------------


def _sum_min(limit: int, start: int, end: int) -> int:
    """sum over q in (start, end] of min(limit, q)."""

    def prefix(count: int) -> int:  # sum over q in [1, count] of min(limit, q)
        if count <= limit:
            return count * (count + 1) // 2
        return limit * (limit + 1) // 2 + (count - limit) * limit

    return prefix(end) - prefix(start)


def layer_prefill_flops(
    config: ModelConfig, context: int, chunk: int, *, with_indexer: bool = False,
    moe: bool = False,
) -> int:
    """FLOPs of one layer's prefill forward for `chunk` new tokens ending at `context` tokens.

    The new tokens sit at positions p = context - chunk, ..., context - 1. Counting 2 FLOPs per
    multiply-add (E model width, H heads, D latent, R RoPE width, n_q = q_lora_rank,
    d_n = qk_nope_head_dim, d_v = v_head_dim, F = mlp_hidden, K = index_topk, I indexer heads,
    N indexer head width):

        projections, per new token:  E*n_q + n_q*H*(d_n + R) + E*(D + R)     (q, kv down/up)
                                     + H*d_n*D                                (absorb q_nope)
                                     + H*D*d_v + H*d_v*E                      (W_UV, W_o)
        MLP, per new token:          3*E*F                                    (SwiGLU)
             or with `moe`:          E*X + 3*E*M*(K' + S)   (router; K' routed experts and
                                     S = n_shared_experts of width M = moe_hidden)
        attention, per query at p:   H*a*(D + R) + H*a*D,  a = min(K, p + 1)  (absorbed MLA)
        indexer (with_indexer only): n_q*I*N + E*N + E*I per new token
                                     + I*(N + 1)*(p + 1) per query            (scores all of
                                                                               the causal prefix)

    FLOPs = 2 * (sum of the above). Norms, RoPE, softmax and top-k are not counted.

    Args:
      config: the model.
      context: tokens in the sequence after this chunk (history + chunk).
      chunk: new tokens of this forward, 1 <= chunk <= context.
      with_indexer: add the lightning indexer (layers that start an indexer group).
      moe: an MoE layer (layers >= first_k_dense_replace of a config with experts).

    Returns:
      FLOPs (int).
    """
    check_count("context", context, 1)
    check_count("chunk", chunk, 1)
    if chunk > context:
        raise ValueError(f"chunk={chunk} must be <= context={context} (context counts the chunk)")
    dim, heads = config.dim, config.num_heads
    latent, rope = config.kv_lora_rank, config.qk_rope_head_dim
    q_rank, nope, value = config.q_lora_rank, config.qk_nope_head_dim, config.v_head_dim
    per_token = (
        dim * q_rank
        + q_rank * heads * (nope + rope)
        + dim * (latent + rope)
        + heads * nope * latent
        + heads * latent * value
        + heads * value * dim
    )
    if moe:
        if not config.moe:
            raise ValueError(f"moe=True but config {config.name!r} has no experts "
                             "(n_routed_experts=0)")
        per_token += dim * config.n_routed_experts + 3 * dim * config.moe_hidden * (
            config.num_experts_per_tok + config.n_shared_experts)
    else:
        per_token += 3 * dim * config.mlp_hidden
    start = context - chunk
    attended = _sum_min(config.index_topk, start, context)  # sum of min(K, p + 1)
    macs = chunk * per_token + heads * (2 * latent + rope) * attended
    if with_indexer:
        index_heads, index_width = config.index_n_heads, config.index_head_dim
        prefix = context * (context + 1) // 2 - start * (start + 1) // 2  # sum of (p + 1)
        macs += chunk * (q_rank * index_heads * index_width + dim * index_width + dim * index_heads)
        macs += index_heads * (index_width + 1) * prefix
    return 2 * macs


def layer_transfer_bytes(config: ModelConfig, history_tokens: int, chunk: int) -> tuple[int, int]:
    """(H2D bytes, D2H bytes) of one offloaded layer in one prefill forward.

    H2D loads the layer's `history_tokens` KV rows written by earlier chunks; D2H writes back the
    `chunk` new rows. A row is `kv_row_bytes` (1,152 B for bf16 at 512 + 64, 656 B in
    fp8_ds_mla).
    Token granularity: a partly filled history block would add at most one block each way.
    """
    check_count("history_tokens", history_tokens, 0)
    check_count("chunk", chunk, 1)
    row = config.kv_row_bytes
    return history_tokens * row, chunk * row


def chunk_layer_times(
    config: ModelConfig, context: int, chunk: int, profile: HardwareProfile
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-layer (load, compute, write-back) seconds, each [L], of the forward of a `chunk`-token
    chunk that ends at `context` tokens (history = context - chunk).

    Layers that start an indexer group (`config.indexer_layers`) also run the indexer; layers
    from `config.num_dense_layers` on are MoE layers. Layer 0's load is 0: it stays in the pinned
    buffer 0.
    """
    check_count("chunk", chunk, 1)
    if chunk > context:
        raise ValueError(f"chunk={chunk} must be <= context={context} (context counts the chunk)")
    h2d_bytes, d2h_bytes = layer_transfer_bytes(config, context - chunk, chunk)
    num_layers = config.num_layers
    starts = set(config.indexer_layers)
    compute = np.array([
        profile.compute_time(layer_prefill_flops(
            config, context, chunk, with_indexer=layer in starts,
            moe=layer >= config.num_dense_layers))
        for layer in range(num_layers)])
    load = np.full(num_layers, profile.h2d_time(h2d_bytes))
    load[0] = 0.0
    writeback = np.full(num_layers, profile.d2h_time(d2h_bytes))
    return load, compute, writeback


# Simulation -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineResult:
    """Event times and exposure of one simulated prefill layer loop (seconds; arrays are [L]).

    Attributes:
      load_start, load_end: H2D of each layer (0, 0 for the pinned layer 0).
      compute_start, compute_end: compute of each layer.
      writeback_start, writeback_end: D2H of each layer.
      exposed_load: time compute idles before layer l waiting for its load,
        compute_start[l] - compute_end[l - 1] (0 for layer 0). Includes buffer stalls.
      buffer_stall: time the load of layer l, once issued and its buffer's previous occupant
        computed, still waited for that occupant's write-back (the write-back exposed inside the
        loop; a cause of exposed_load, not added to it).
      writeback_tail: time the end of prefill waits for write-backs after the last compute.
      total_time: end of the last compute or write-back.
      no_offload_time: sum of compute times (all layers resident, nothing copied).
    """

    load_start: np.ndarray
    load_end: np.ndarray
    compute_start: np.ndarray
    compute_end: np.ndarray
    writeback_start: np.ndarray
    writeback_end: np.ndarray
    exposed_load: np.ndarray
    buffer_stall: np.ndarray
    writeback_tail: float
    total_time: float
    no_offload_time: float

    @property
    def overhead(self) -> float:
        """total_time - no_offload_time = sum(exposed_load) + writeback_tail (seconds)."""
        return self.total_time - self.no_offload_time


def _check_times(name: str, values, num_layers: int | None) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"{name} must be a non-empty 1-D array of seconds, got shape {array.shape}"
        )
    if num_layers is not None and array.size != num_layers:
        raise ValueError(
            f"{name} has {array.size} entries, expected one per layer ({num_layers})"
        )
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {array}")
    return array


def simulate_prefill_pipeline(
    load_times,
    compute_times,
    writeback_times,
    *,
    onload_layer_map,
    num_buffers: int,
    shared_copy_engine: bool = False,
) -> PipelineResult:
    """Simulates the offloaded prefill layer loop (see the module docstring for the rules).

    Args:
      load_times: [L] H2D seconds of each layer (entry 0 is ignored: layer 0 is pinned).
      compute_times: [L] compute seconds of each layer.
      writeback_times: [L] D2H seconds of each layer.
      onload_layer_map: prefetch schedule, any form `normalize_onload_layer_map` accepts.
      num_buffers: device buffers n (buffer 0 pinned to layer 0, n - 1 rotating).
      shared_copy_engine: True when H2D and D2H share one serial copy engine.

    Returns:
      The `PipelineResult`.
    """
    compute = _check_times("compute_times", compute_times, None)
    num_layers = compute.size
    load = _check_times("load_times", load_times, num_layers)
    writeback = _check_times("writeback_times", writeback_times, num_layers)
    schedule = normalize_onload_layer_map(onload_layer_map, num_layers, num_buffers)
    rotating = num_buffers - 1

    nan = np.full(num_layers, np.nan)
    load_start, load_end = nan.copy(), nan.copy()
    compute_start, compute_end = nan.copy(), nan.copy()
    wb_start, wb_end = nan.copy(), nan.copy()
    issued_at = nan.copy()
    load_start[0] = load_end[0] = 0.0
    issued_at_layer = {target: source for source, targets in enumerate(schedule)
                       for target in targets}

    engines = ("copy", "copy") if shared_copy_engine else ("h2d", "d2h")
    queues: dict[str, list] = {name: [] for name in engines}  # heap of (ready, key, kind, layer)
    busy = {name: False for name in engines}
    events: list = []  # heap of (time, seq, kind, layer)
    seq = 0
    waiting_loads: list[int] = []  # issued, buffer not yet free
    next_layer = 0
    computing = False

    def occupant(layer: int) -> int | None:
        previous = layer - rotating
        return previous if previous >= 1 else None

    def buffer_free(layer: int) -> bool:
        previous = occupant(layer)
        return previous is None or not np.isnan(wb_end[previous])

    def push_event(time: float, kind: str, layer: int) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, kind, layer))
        seq += 1

    def progress(now: float) -> None:
        nonlocal next_layer, computing
        changed = True
        while changed:
            changed = False
            if (not computing and next_layer < num_layers and not np.isnan(load_end[next_layer])
                    and (next_layer == 0 or not np.isnan(compute_end[next_layer - 1]))):
                layer = next_layer
                compute_start[layer] = now
                computing = True
                next_layer += 1
                push_event(now + compute[layer], "compute", layer)
                for target in schedule[layer]:
                    issued_at[target] = now
                    waiting_loads.append(target)
                changed = True
            for target in list(waiting_loads):
                if buffer_free(target):
                    waiting_loads.remove(target)
                    key = (issued_at_layer[target], 0, target)
                    heapq.heappush(queues[engines[0]], (now, key, "load", target))
                    changed = True
            for name in engines:
                if not busy[name] and queues[name]:
                    _, _, kind, layer = heapq.heappop(queues[name])
                    busy[name] = True
                    if kind == "load":
                        load_start[layer] = now
                        push_event(now + load[layer], "load", layer)
                    else:
                        wb_start[layer] = now
                        push_event(now + writeback[layer], "writeback", layer)
                    changed = True

    progress(0.0)
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, layer = heapq.heappop(events)
            if kind == "compute":
                compute_end[layer] = now
                computing = False
                heapq.heappush(queues[engines[1]], (now, (layer, 1, layer), "writeback", layer))
            elif kind == "load":
                load_end[layer] = now
                busy[engines[0]] = False
            else:
                wb_end[layer] = now
                busy[engines[1]] = False
        progress(now)

    if np.isnan(compute_end).any() or np.isnan(wb_end).any():  # a bug, not a user error
        raise AssertionError("pipeline simulation stalled; the schedule validation missed a case")

    exposed = np.zeros(num_layers)
    exposed[1:] = compute_start[1:] - compute_end[:-1]
    stall = np.zeros(num_layers)
    for layer in range(1, num_layers):
        previous = occupant(layer)
        if previous is not None:
            held_from = max(issued_at[layer], compute_end[previous])
            stall[layer] = max(0.0, wb_end[previous] - held_from)
    last_compute = float(compute_end[-1])
    total = max(last_compute, float(wb_end.max()))
    return PipelineResult(
        load_start=load_start, load_end=load_end,
        compute_start=compute_start, compute_end=compute_end,
        writeback_start=wb_start, writeback_end=wb_end,
        exposed_load=exposed, buffer_stall=stall,
        writeback_tail=total - last_compute, total_time=total,
        no_offload_time=float(compute.sum()),
    )


def simulate_prefill_chunk(
    config: ModelConfig,
    context: int,
    chunk: int,
    profile: HardwareProfile,
    *,
    distance: int = 2,
    num_buffers: int = 4,
) -> PipelineResult:
    """The pipeline of one chunk's forward (`chunk_layer_times`) under `profile`, with the
    default prefetch schedule of `distance` layers."""
    load, compute, writeback = chunk_layer_times(config, context, chunk, profile)
    return simulate_prefill_pipeline(
        load, compute, writeback,
        onload_layer_map=default_onload_layer_map(config.num_layers, distance, num_buffers),
        num_buffers=num_buffers, shared_copy_engine=profile.shared_copy_engine,
    )

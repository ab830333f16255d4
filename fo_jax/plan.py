"""Capacity planner: how many requests of a given context fit on one device, with and without
offloading the KV cache to host memory (the `fo-jax plan` command).

Notation (see `fo_jax/typing.py`): L layers, G indexer groups, D latent width, R RoPE width,
N indexer head width, C hot-cache slots per layer, Z tokens per tail block (b in the design
notes). All sizes are bytes; reports use decimal units (1 kB = 1e3 bytes, 1 GB = 1e9 bytes).

Per token the model stores

    kappa = (L * (D + R) + G * N) * bytes_per_elem

i.e. a KV row of every layer plus an indexer key of every indexer group. `(D + R) * bytes`
below stands for the row of the config's `kv_format` (`ModelConfig.kv_row_bytes`): (D + R) *
bytes_per_elem in "bf16" (1,152 at D = 512, R = 64), D + 4 D / 128 + 2 R in "fp8_ds_mla"
(656); the indexer keys stay in kv_dtype. Without offloading a
request of S tokens keeps `S * kappa` on the device. With offloading the device keeps, per request:

    hot cache      C * L * (D + R) * bytes        (C slots in every layer)
    tail blocks    2 * Z * L * (D + R) * bytes    (two blocks of Z new tokens in every layer)
    indexer keys   S * G * N * bytes              (every token: the indexer scores all of them)
    slot maps      4 * G * (S + C)                (int32 token_to_slot [G, S], slot_to_token [G, C])

and the authoritative KV (`S * L * (D + R) * bytes`) lives in host memory. Prefill keeps
`num_buffers` full-layer buffers of `S` rows instead of all `L` layers.

`plan_devices` adds the weights (`weight_bytes`: every parameter in bf16, or the projections
in FP8 with 128 x 128 block scales, 1 byte a value + 4 a block) split over `devices` devices of
`device_gb` each, one request's KV in both formats (`KvFigures`), and refuses a setting that
does not fit, naming what would. `plan_expert_parallel` plans the all-to-all layout per device
(attention data-parallel, the routed experts split over the devices, every other weight
replicated): weights, KV, host bytes, the largest batch and context.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fo_jax.config import ModelConfig, sequence_capacity_check
from fo_jax.offload.config import check_hot_slots, check_num_buffers

GB = 1e9
KB = 1e3
INT32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """Device and host memory of one model at one context length, with and without offload.

    All `*_bytes` fields are bytes; `max_batch_*` are request counts.

    Attributes:
      model: preset name of the config.
      kv_dtype: dtype of the KV cache (bf16 format) and the indexer keys.
      kv_format: how a KV row is stored ("bf16" or "fp8_ds_mla", `ModelConfig.kv_format`).
      num_layers: L.
      num_groups: G, indexer groups.
      context: S, tokens of one request (prompt + generated).
      budget_bytes: device memory available for KV state (weights and activations excluded).
      hot_slots: C, hot-cache slots per layer and request.
      tail_block: Z, tokens per tail block (two tail blocks per layer and request).
      num_buffers: full-layer device buffers of the offloaded prefill.
      prefill_chunk: T, new tokens per prefill forward (at most `context`).
      kv_bytes_per_token: L * (D + R) * bytes.
      index_bytes_per_token: G * N * bytes.
      bytes_per_token: kappa = kv_bytes_per_token + index_bytes_per_token.
      request_kv_bytes: S * kv_bytes_per_token, the KV of one request.
      request_index_bytes: S * index_bytes_per_token, the indexer keys of one request.
      request_bytes: S * kappa, everything one request stores.
      max_batch_resident: floor(budget / request_bytes), decode batch without offload.
      hot_cache_bytes: C * L * (D + R) * bytes, device hot cache of one request.
      tail_bytes: 2 * Z * L * (D + R) * bytes, device tail blocks of one request.
      index_key_bytes: S * G * N * bytes, device indexer keys of one request
        (= request_index_bytes).
      slot_map_bytes: 4 * G * (S + C): int32 token_to_slot [G, S] and slot_to_token [G, C].
      offload_device_bytes: hot cache + tails + indexer keys + slot maps, per request.
      max_batch_offload: floor(budget / offload_device_bytes), decode batch with offload.
      host_bytes_per_request: S * L * (D + R) * bytes, the authoritative KV in host memory.
      prefill_resident_kv_bytes: S * L * (D + R) * bytes, device KV of a prefill without offload.
      prefill_offload_kv_bytes: num_buffers * S * (D + R) * bytes, device KV of the offloaded
        prefill (indexer keys stay on the device in both cases and are not included).
      prefill_num_chunks: ceil(S / T), forwards of the prefill.
      prefill_reload_bytes: H2D bytes of the offloaded prefill over all chunks: before chunk c
        (c = 0, 1, ...) the c * T history rows of every layer but the pinned layer 0 are loaded,
        (L - 1) * (D + R) * bytes * sum_c c * T. Zero for a single chunk (a new request).
    """

    model: str
    kv_dtype: str
    kv_format: str
    num_layers: int
    num_groups: int
    context: int
    budget_bytes: float
    hot_slots: int
    tail_block: int
    num_buffers: int
    prefill_chunk: int
    kv_bytes_per_token: int
    index_bytes_per_token: int
    bytes_per_token: int
    request_kv_bytes: int
    request_index_bytes: int
    request_bytes: int
    max_batch_resident: int
    hot_cache_bytes: int
    tail_bytes: int
    index_key_bytes: int
    slot_map_bytes: int
    offload_device_bytes: int
    max_batch_offload: int
    host_bytes_per_request: int
    prefill_resident_kv_bytes: int
    prefill_offload_kv_bytes: int
    prefill_num_chunks: int
    prefill_reload_bytes: int

    @property
    def prefill_resident_bytes(self) -> int:
        """Device bytes of a prefill without offload: all layers' KV plus the indexer keys."""
        return self.prefill_resident_kv_bytes + self.index_key_bytes

    @property
    def prefill_offload_bytes(self) -> int:
        """Device bytes of the offloaded prefill: `num_buffers` layers' KV plus the indexer keys."""
        return self.prefill_offload_kv_bytes + self.index_key_bytes


@dataclasses.dataclass(frozen=True)
class RequestBytes:
    """The bytes one offloaded request of S tokens keeps, part by part: the planner's arithmetic
    in one place (`plan_capacity` and the engine's admission, `fo_jax.engine.costs`, both
    use it). Each part is either fixed per request or linear in S.

    Attributes:
      hot_cache: C * L * (D + R) * bytes, device; fixed.
      tails: 2 * Z * L * (D + R) * bytes, device; fixed.
      index_keys: S * G * N * bytes, device; linear in S.
      token_to_slot: 4 * G * S, device (int32 [G, S]); linear in S.
      slot_to_token: 4 * G * C, device (int32 [G, C]); fixed.
      prefill_buffers: num_buffers * S * (D + R) * bytes, device, only while the request
        prefills; linear in S.
      host_kv: S * L * (D + R) * bytes, host (the authoritative KV); linear in S.
    """

    hot_cache: int
    tails: int
    index_keys: int
    token_to_slot: int
    slot_to_token: int
    prefill_buffers: int
    host_kv: int

    @property
    def slot_maps(self) -> int:
        """token_to_slot + slot_to_token: 4 * G * (S + C)."""
        return self.token_to_slot + self.slot_to_token

    @property
    def device_decode(self) -> int:
        """Device bytes while decoding: hot cache + tails + indexer keys + slot maps."""
        return self.hot_cache + self.tails + self.index_keys + self.slot_maps


def offload_request_bytes(config: ModelConfig, context: int, *, hot_slots: int, tail_block: int,
                          num_buffers: int) -> RequestBytes:
    """The parts of one offloaded request of `context` (S) tokens, in bytes. No validation:
    `plan_capacity` and the engine check their arguments first."""
    row_bytes = config.kv_row_bytes  # one token, one layer, in the config's kv_format
    num_layers = config.num_layers
    return RequestBytes(
        hot_cache=hot_slots * num_layers * row_bytes,
        tails=2 * tail_block * num_layers * row_bytes,
        index_keys=context * config.index_bytes_per_token,
        token_to_slot=INT32_BYTES * config.num_groups * context,
        slot_to_token=INT32_BYTES * config.num_groups * hot_slots,
        prefill_buffers=num_buffers * context * row_bytes,
        host_kv=context * config.kv_bytes_per_token,
    )


def _check_int(name: str, value, minimum: int, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{why}, got {value!r}")


def plan_capacity(
    config: ModelConfig,
    context: int,
    *,
    budget_gb: float = 29.0,
    hot_slots: int = 16384,
    tail_block: int = 64,
    num_buffers: int = 4,
    prefill_chunk: int | None = None,
) -> CapacityPlan:
    """Plans device and host memory for requests of `context` tokens of `config`.

    Args:
      config: the model.
      context: S, tokens per request (prompt + generated); at most `config.max_seq_len`.
      budget_gb: device memory left for KV state, in GB (1e9 bytes); 29 GB on a 64 GB decode die
        holding 25.36 GB of GLM-5.2 weights.
      hot_slots: C, hot-cache slots per layer and request; at least `config.index_topk *
        config.max_ways` (every way's selection of a step must be resident at once: the decode
        step's rule, `fo_jax.offload.config.check_hot_slots`). The hot cache has a fixed shape,
        so it is counted at C slots even when `context < C`.
      tail_block: Z, tokens per tail block.
      num_buffers: full-layer device buffers of the offloaded prefill (buffer 0 pinned to layer
        0, the others rotate over layers >= 1); in [min(2, L), L].
      prefill_chunk: T, new tokens per prefill forward; None means the whole context in one
        forward; a chunk longer than the context is cut to the context.

    Returns:
      The `CapacityPlan`.

    Raises:
      ValueError: an argument is out of range; the message says what was expected.
    """
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    _check_int("context", context, 1)
    sequence_capacity_check(config, context)
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or not (
        math.isfinite(budget_gb) and budget_gb > 0
    ):
        raise ValueError(f"budget_gb must be a finite number > 0, got {budget_gb!r}")
    _check_int("hot_slots", hot_slots, 1)
    check_hot_slots(hot_slots, config)  # the decode step's own rule
    _check_int("tail_block", tail_block, 1)
    num_layers = config.num_layers
    num_buffers = check_num_buffers(num_buffers, num_layers)  # the prefill's own rule
    if prefill_chunk is None:
        chunk = context
    else:
        _check_int("prefill_chunk", prefill_chunk, 1)
        chunk = min(prefill_chunk, context)

    row_bytes = config.kv_row_bytes  # one token, one layer, in the config's kv_format
    num_groups = config.num_groups
    budget_bytes = float(budget_gb) * GB

    kv_per_token = config.kv_bytes_per_token
    index_per_token = config.index_bytes_per_token
    kappa = config.bytes_per_token
    request_kv = context * kv_per_token
    request_index = context * index_per_token
    request = context * kappa

    parts = offload_request_bytes(config, context, hot_slots=hot_slots, tail_block=tail_block,
                                  num_buffers=num_buffers)

    num_chunks = -(-context // chunk)
    # History rows loaded before chunk c: c * chunk (c = 0 .. num_chunks - 1); layer 0 is pinned.
    history_rows = chunk * num_chunks * (num_chunks - 1) // 2
    reload = (num_layers - 1) * row_bytes * history_rows

    return CapacityPlan(
        model=config.name,
        kv_dtype=config.kv_dtype,
        kv_format=config.kv_format,
        num_layers=num_layers,
        num_groups=num_groups,
        context=context,
        budget_bytes=budget_bytes,
        hot_slots=hot_slots,
        tail_block=tail_block,
        num_buffers=num_buffers,
        prefill_chunk=chunk,
        kv_bytes_per_token=kv_per_token,
        index_bytes_per_token=index_per_token,
        bytes_per_token=kappa,
        request_kv_bytes=request_kv,
        request_index_bytes=request_index,
        request_bytes=request,
        max_batch_resident=math.floor(budget_bytes / request),
        hot_cache_bytes=parts.hot_cache,
        tail_bytes=parts.tails,
        index_key_bytes=parts.index_keys,
        slot_map_bytes=parts.slot_maps,
        offload_device_bytes=parts.device_decode,
        max_batch_offload=math.floor(budget_bytes / parts.device_decode),
        host_bytes_per_request=parts.host_kv,
        prefill_resident_kv_bytes=context * num_layers * row_bytes,
        prefill_offload_kv_bytes=parts.prefill_buffers,
        prefill_num_chunks=num_chunks,
        prefill_reload_bytes=reload,
    )


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / GB:.2f} GB"


def _kb(num_bytes: float) -> str:
    return f"{num_bytes / KB:.2f} kB"


def format_plan(plan: CapacityPlan) -> str:
    """A readable multi-line report of `plan` (decimal GB and kB, two decimals)."""
    budget = _gb(plan.budget_bytes)
    chunks = "chunk" if plan.prefill_num_chunks == 1 else "chunks"
    ratio = plan.prefill_offload_kv_bytes / plan.prefill_resident_kv_bytes
    rows = [
        ("bytes per token (kappa)",
         f"{_kb(plan.bytes_per_token)}  (KV {_kb(plan.kv_bytes_per_token)}"
         f" + indexer {_kb(plan.index_bytes_per_token)})"),
        ("one request",
         f"{_gb(plan.request_bytes)}  (KV {_gb(plan.request_kv_bytes)}"
         f" + indexer keys {_gb(plan.request_index_bytes)})"),
        None,
        "Decode without offload",
        ("max batch", f"{plan.max_batch_resident}"),
        None,
        f"Decode with offload (hot cache C = {plan.hot_slots:,} slots per layer,"
        f" tail blocks 2 x {plan.tail_block} tokens)",
        ("hot-cache KV", _gb(plan.hot_cache_bytes)),
        ("tail blocks", _gb(plan.tail_bytes)),
        ("indexer keys + slot maps",
         f"{_gb(plan.index_key_bytes + plan.slot_map_bytes)}  (keys {_gb(plan.index_key_bytes)}"
         f" + maps {_gb(plan.slot_map_bytes)})"),
        ("device bytes per request", _gb(plan.offload_device_bytes)),
        ("host KV per request", _gb(plan.host_bytes_per_request)),
        ("max batch", f"{plan.max_batch_offload}"),
        None,
        f"Prefill (chunk {plan.prefill_chunk:,} tokens, {plan.prefill_num_chunks:,} {chunks})",
        (f"device KV, all {plan.num_layers} layers",
         f"{_gb(plan.prefill_resident_kv_bytes)}  (+ indexer keys {_gb(plan.index_key_bytes)})"),
        (f"device KV, {plan.num_buffers} buffers",
         f"{_gb(plan.prefill_offload_kv_bytes)}  (+ indexer keys {_gb(plan.index_key_bytes)};"
         f" {100 * ratio:.1f}% of resident KV)"),
        ("history reloaded (H2D)", _gb(plan.prefill_reload_bytes)),
    ]
    width = max(len(row[0]) for row in rows if isinstance(row, tuple)) + 2
    lines = [
        f"fo-jax plan: {plan.model}, context {plan.context:,} tokens, {_kv_label(plan)} KV,"
        f" device budget {budget}"
    ]
    for row in rows:
        if row is None:
            lines.append("")
        elif isinstance(row, str):
            lines.append(row)
        else:
            label, value = row
            lines.append(f"  {label + ':':<{width}}{value}")
    return "\n".join(lines)


def _kv_label(plan: CapacityPlan) -> str:
    """"bfloat16" for the bf16 format, "fp8_ds_mla (indexer keys bfloat16)" for the other."""
    if plan.kv_format == "bf16":
        return plan.kv_dtype
    return f"{plan.kv_format} (indexer keys {plan.kv_dtype})"


# Weights and devices -------------------------------------------------------------------------

WEIGHT_FORMATS = ("bf16", "fp8")
FP8_BLOCK = (128, 128)  # DeepSeek-V3.2's and GLM-5's weight_block_size
KV_FORMATS = ("bf16", "fp8_ds_mla")


def weight_bytes(config: ModelConfig, weights: str) -> int:
    """Bytes of every parameter of `config`: "bf16" in the config's dtype (`param_bytes`),
    "fp8" with the projections in FP8 with 128 x 128 block scales (`param_bytes(...,
    fp8_block=FP8_BLOCK)`: what an FP8 checkpoint loaded with weights="fp8" holds)."""
    from fo_jax.model.dsa import param_bytes

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHT_FORMATS}")
    return param_bytes(config, fp8_block=FP8_BLOCK if weights == "fp8" else None)


@dataclasses.dataclass(frozen=True)
class KvFigures:
    """One request's KV in one format (bytes).

    Attributes:
      kv_format: "bf16" or "fp8_ds_mla".
      resident_bytes: S * kappa, the device KV + indexer keys of a request without offload.
      offload_device_bytes: hot cache + tails + indexer keys + slot maps with offload.
      host_bytes: S * L * row bytes, the host KV of an offloaded request.
    """

    kv_format: str
    resident_bytes: int
    offload_device_bytes: int
    host_bytes: int


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """A model on `devices` devices of `device_bytes` each: weights per device (both formats)
    and one request's KV (both KV formats), and the batch the chosen setting fits.

    The weights are counted as split evenly over the devices (ceil(total / devices): experts
    and heads sharded, nothing replicated, a lower bound); what is left of a device holds KV.

    Attributes:
      model, context, devices, device_bytes: the setting; weights: the weight format chosen
        ("bf16" or "fp8"); kv_format: the config's KV format.
      weight_bytes: {"bf16": total bytes, "fp8": total bytes}.
      weights_per_device: {"bf16": bytes, "fp8": bytes}.
      kv: {"bf16": KvFigures, "fp8_ds_mla": KvFigures} at `context`.
      kv_budget_bytes: device_bytes - weights_per_device[weights].
      max_batch_resident, max_batch_offload: requests per device in the config's kv_format.
    """

    model: str
    context: int
    devices: int
    device_bytes: float
    weights: str
    kv_format: str
    hot_slots: int
    weight_bytes: dict
    weights_per_device: dict
    kv: dict
    kv_budget_bytes: float
    max_batch_resident: int
    max_batch_offload: int


def plan_devices(config: ModelConfig, context: int, *, devices: int, device_gb: float,
                 weights: str = "fp8", hot_slots: int = 16384, tail_block: int = 64,
                 num_buffers: int = 4) -> DevicePlan:
    """Plan `config` at `context` tokens per request on `devices` devices of `device_gb` GB.

    Raises ValueError, naming what would fit, when the weights do not fit a device (the number
    of devices they need, and the FP8 figure for bf16 weights) or when no offloaded request
    fits what they leave (the longest context that would, and the other KV format's batch).
    """
    _check_int("devices", devices, 1)
    if isinstance(device_gb, bool) or not isinstance(device_gb, (int, float)) or not (
            math.isfinite(device_gb) and device_gb > 0):
        raise ValueError(f"device_gb must be a finite number > 0, got {device_gb!r}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHT_FORMATS}")
    device_bytes = float(device_gb) * GB
    totals = {w: weight_bytes(config, w) for w in WEIGHT_FORMATS}
    per_device = {w: -(-totals[w] // devices) for w in WEIGHT_FORMATS}
    if per_device[weights] >= device_bytes:
        need = {w: math.floor(totals[w] / device_bytes) + 1 for w in WEIGHT_FORMATS}
        other = "" if weights == "fp8" else (
            f", or FP8 weights ({_gb(per_device['fp8'])} per device here, "
            f"{need['fp8']} devices at least)")
        raise ValueError(
            f"{config.name}: its {weights} weights take {_gb(per_device[weights])} per device "
            f"on {devices} device(s) ({_gb(totals[weights])} in all), above the "
            f"{_gb(device_bytes)} of a device: they need at least {need[weights]} devices"
            f"{other}")
    kv = {}
    for fmt in KV_FORMATS:
        plan = plan_capacity(config.replace(kv_format=fmt), context, budget_gb=device_gb,
                             hot_slots=hot_slots, tail_block=tail_block,
                             num_buffers=num_buffers)
        kv[fmt] = KvFigures(fmt, plan.request_bytes, plan.offload_device_bytes,
                            plan.host_bytes_per_request)
    budget = device_bytes - per_device[weights]
    mine = kv[config.kv_format]
    if mine.offload_device_bytes > budget:
        parts = offload_request_bytes(config, 1, hot_slots=hot_slots, tail_block=tail_block,
                                      num_buffers=num_buffers)
        fixed = parts.hot_cache + parts.tails + parts.slot_to_token
        per_token = parts.index_keys + parts.token_to_slot
        longest = max(0, math.floor((budget - fixed) / per_token))
        other = [f for f in KV_FORMATS if f != config.kv_format][0]
        fits = "fits" if kv[other].offload_device_bytes <= budget else "does not fit either"
        raise ValueError(
            f"{config.name}: one offloaded request of {context:,} tokens takes "
            f"{_gb(mine.offload_device_bytes)} of device memory, above the "
            f"{_gb(budget)} the {weights} weights leave on each of {devices} device(s): "
            f"a context of at most {longest:,} tokens fits; kv_format {other!r} "
            f"({_gb(kv[other].offload_device_bytes)} per request) {fits}; fewer hot slots "
            f"than {hot_slots:,} or more devices leave more")
    return DevicePlan(
        model=config.name, context=context, devices=devices, device_bytes=device_bytes,
        weights=weights, kv_format=config.kv_format, hot_slots=hot_slots, weight_bytes=totals,
        weights_per_device=per_device, kv=kv, kv_budget_bytes=budget,
        max_batch_resident=math.floor(budget / mine.resident_bytes),
        max_batch_offload=math.floor(budget / mine.offload_device_bytes))


def format_device_plan(plan: DevicePlan) -> str:
    """The weights and KV figures of `plan`, one line each (decimal GB)."""
    lines = [f"Devices: {plan.devices} x {_gb(plan.device_bytes)}, weights split evenly",
             f"  weights:  bf16 {_gb(plan.weight_bytes['bf16'])} "
             f"({_gb(plan.weights_per_device['bf16'])} per device), fp8 "
             f"{_gb(plan.weight_bytes['fp8'])} ({_gb(plan.weights_per_device['fp8'])} per "
             "device, 128 x 128 block scales)",
             f"  one request of {plan.context:,} tokens (C = {plan.hot_slots:,}):"]
    for fmt, kv in plan.kv.items():
        lines.append(f"    {fmt + ':':<12}resident {_gb(kv.resident_bytes)}, offloaded "
                     f"{_gb(kv.offload_device_bytes)} device + {_gb(kv.host_bytes)} host")
    lines.append(f"  with {plan.weights} weights and {plan.kv_format} KV: "
                 f"{_gb(plan.kv_budget_bytes)} per device for KV, max batch per device "
                 f"{plan.max_batch_resident} resident, {plan.max_batch_offload} offloaded")
    return "\n".join(lines)


# Data-parallel attention, expert-parallel MoE (the all-to-all layout) -------------------------

ROUTED_EXPERTS = (("moe", "w1"), ("moe", "w2"), ("moe", "w3"))


@dataclasses.dataclass(frozen=True)
class ExpertParallelPlan:
    """A model on `devices` devices of `device_bytes` each in the all-to-all layout
    (`fo_jax.sharding.ALL_TO_ALL_RULES`): every device runs attention for its own requests over
    its own KV (and, offloaded, its own host pool) and holds 1/devices of the routed experts;
    the router, the shared experts, attention, the dense layers, embedding and head whole on
    every device. Figures per device, in the config's kv_format, with `weights` weights.

    Attributes:
      model, context, devices, device_bytes, weights, kv_format, hot_slots: the setting.
      expert_bytes: the routed experts' w1 / w2 / w3 of every MoE layer, whole model.
      replicated_bytes: every other weight (held whole by every device).
      weights_per_device: replicated_bytes + expert_bytes / devices.
      kv_budget_bytes: device_bytes - weights_per_device.
      all_to_all_bytes_per_token: the MoE layer's all-to-all buffers per token of a step: four
        [D C, E] buffers (rows sent, received, outputs, outputs back; C = min(K', X / D) rows
        per token and peer, `fo_jax.model.moe.all_to_all_capacity`) in the activations' dtype;
        one layer's at a time (the layers are a loop).
      resident_request_bytes, offload_request_bytes, host_request_bytes: one request's device
        KV resident, device bytes offloaded (hot cache, tails, indexer keys, slot maps) and host
        KV offloaded (`KvFigures`).
      max_batch_resident, max_batch_offload: requests per device at `context`, one decode token
        each (KV + that many tokens' all-to-all buffers within kv_budget_bytes).
      host_bytes_offload: max_batch_offload * host_request_bytes, the device's host pool.
      max_context_resident, max_context_offload: the longest context of one request per device
        (at most the model's max_seq_len).
    """

    model: str
    context: int
    devices: int
    device_bytes: float
    weights: str
    kv_format: str
    hot_slots: int
    expert_bytes: int
    replicated_bytes: int
    weights_per_device: int
    kv_budget_bytes: float
    all_to_all_bytes_per_token: int
    resident_request_bytes: int
    offload_request_bytes: int
    host_request_bytes: int
    max_batch_resident: int
    max_batch_offload: int
    host_bytes_offload: int
    max_context_resident: int
    max_context_offload: int


def _expert_split(config: ModelConfig, weights: str, devices: int):
    """(expert bytes, replicated bytes, per device) of `config`'s weights over `devices`."""
    from fo_jax.model.dsa import param_bytes

    block = FP8_BLOCK if weights == "fp8" else None
    experts = param_bytes(config, fp8_block=block, names=ROUTED_EXPERTS)
    replicated = param_bytes(config, fp8_block=block) - experts
    return experts, replicated, replicated + -(-experts // devices)


def plan_expert_parallel(config: ModelConfig, context: int, *, devices: int,
                         device_gb: float, weights: str = "fp8", hot_slots: int = 16384,
                         tail_block: int = 64, num_buffers: int = 4) -> ExpertParallelPlan:
    """Plan `config` at `context` tokens per request on `devices` devices of `device_gb` GB in
    the all-to-all layout (data-parallel attention, routed experts split over the same
    devices). Raises ValueError naming what would fit when `devices` does not divide the
    routed experts, when the weights of a device do not fit it (the fewest devices that
    would, or that none would: the replicated part alone exceeds a device), or when no
    offloaded request of `context` tokens fits what they leave (the longest context that
    would)."""
    _check_int("devices", devices, 1)
    if isinstance(device_gb, bool) or not isinstance(device_gb, (int, float)) or not (
            math.isfinite(device_gb) and device_gb > 0):
        raise ValueError(f"device_gb must be a finite number > 0, got {device_gb!r}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHT_FORMATS}")
    if not config.moe:
        raise ValueError(f"{config.name} has no routed experts: the all-to-all layout splits "
                         "MoE experts (plan it with plan_devices)")
    num_x = config.n_routed_experts
    divisors = [d for d in range(1, num_x + 1) if num_x % d == 0]
    if num_x % devices:
        raise ValueError(f"{config.name}: {devices} devices do not divide its {num_x} routed "
                         f"experts (every device holds X / devices of them): use one of "
                         f"{divisors}")
    device_bytes = float(device_gb) * GB
    experts, replicated, per_device = _expert_split(config, weights, devices)
    if per_device >= device_bytes:
        fit = [d for d in divisors if _expert_split(config, weights, d)[2] < device_bytes]
        need = (f"at least {fit[0]} devices (a divisor of {num_x})" if fit else
                f"more than {num_x} devices: the replicated weights alone take "
                f"{_gb(replicated)}")
        other = ""
        if weights == "bf16":
            fp8 = _expert_split(config, "fp8", devices)[2]
            other = f"; FP8 weights take {_gb(fp8)} per device here"
        raise ValueError(
            f"{config.name}: its {weights} weights take {_gb(per_device)} per device on "
            f"{devices} device(s) in the all-to-all layout ({_gb(replicated)} replicated + "
            f"{_gb(experts)} of routed experts / {devices}), above the {_gb(device_bytes)} of "
            f"a device: it needs {need}{other}")
    plan = plan_capacity(config, context, budget_gb=device_gb, hot_slots=hot_slots,
                         tail_block=tail_block, num_buffers=num_buffers)
    budget = device_bytes - per_device
    from fo_jax.model.moe import all_to_all_capacity

    act_bytes = np.dtype(config.jnp_dtype).itemsize

    rows = all_to_all_capacity(1, top=config.num_experts_per_tok, num_local=num_x // devices)
    a2a = 4 * devices * rows * config.dim * act_bytes
    parts = offload_request_bytes(config, 1, hot_slots=hot_slots, tail_block=tail_block,
                                  num_buffers=num_buffers)
    fixed = parts.hot_cache + parts.tails + parts.slot_to_token + a2a
    longest_offload = min(config.max_seq_len, max(0, math.floor(
        (budget - fixed) / (parts.index_keys + parts.token_to_slot))))
    longest_resident = min(config.max_seq_len, max(0, math.floor(
        (budget - a2a) / config.bytes_per_token)))
    if plan.offload_device_bytes + a2a > budget:
        raise ValueError(
            f"{config.name}: one offloaded request of {context:,} tokens takes "
            f"{_gb(plan.offload_device_bytes + a2a)} of device memory, above the "
            f"{_gb(budget)} the {weights} weights leave on each of {devices} device(s) in the "
            f"all-to-all layout: a context of at most {longest_offload:,} tokens fits; more "
            f"devices or fewer hot slots than {hot_slots:,}"
            f"{' or FP8 weights' if weights == 'bf16' else ''} leave more")
    batch_offload = math.floor(budget / (plan.offload_device_bytes + a2a))
    return ExpertParallelPlan(
        model=config.name, context=context, devices=devices, device_bytes=device_bytes,
        weights=weights, kv_format=config.kv_format, hot_slots=hot_slots,
        expert_bytes=experts, replicated_bytes=replicated, weights_per_device=per_device,
        kv_budget_bytes=budget, all_to_all_bytes_per_token=a2a,
        resident_request_bytes=plan.request_bytes,
        offload_request_bytes=plan.offload_device_bytes,
        host_request_bytes=plan.host_bytes_per_request,
        max_batch_resident=math.floor(budget / (plan.request_bytes + a2a)),
        max_batch_offload=batch_offload,
        host_bytes_offload=batch_offload * plan.host_bytes_per_request,
        max_context_resident=longest_resident, max_context_offload=longest_offload)


def format_expert_plan(plan: ExpertParallelPlan) -> str:
    """The per-device figures of `plan`, one line each (decimal GB)."""
    return "\n".join([
        f"All-to-all layout: {plan.devices} x {_gb(plan.device_bytes)}, attention data-parallel "
        f"on every device, routed experts split over all {plan.devices}",
        f"  weights per device ({plan.weights}): {_gb(plan.weights_per_device)} "
        f"({_gb(plan.replicated_bytes)} replicated + {_gb(plan.expert_bytes)} of routed "
        f"experts / {plan.devices})",
        f"  KV per device: {_gb(plan.kv_budget_bytes)} ({plan.kv_format}; all-to-all buffers "
        f"{_kb(plan.all_to_all_bytes_per_token)} per token of a step)",
        f"  one request of {plan.context:,} tokens: resident {_gb(plan.resident_request_bytes)}, "
        f"offloaded {_gb(plan.offload_request_bytes)} device + {_gb(plan.host_request_bytes)} "
        "host",
        f"  max batch per device: {plan.max_batch_resident} resident, {plan.max_batch_offload} "
        f"offloaded ({_gb(plan.host_bytes_offload)} of host memory per device)",
        f"  longest context of one request per device: {plan.max_context_resident:,} resident,"
        f" {plan.max_context_offload:,} offloaded",
    ])

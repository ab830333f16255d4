"""Load and save Hugging Face checkpoint directories of DeepSeek-V3.2 / GLM-5.

A directory holds config.json, model.safetensors.index.json ({"weight_map": {name: shard}})
and the shards (or one model.safetensors). `load_checkpoint` checks the config, the index and
every shard's header before loading anything, then fills the stacked parameters shard by
shard and moves them to the device a stack at a time (host memory: the model once plus one
tensor). `weights="fp8"` keeps an FP8 checkpoint's projections as `Fp8Weight`s,
`"dequantize"` dequantises them (`dequantize_fp8`); `mtp=True` returns the
multi-token-prediction layers' parameters too. `save_checkpoint` writes the same layout
(unquantised, in the parameters' dtypes; the MTP layers too when given); `inspect_checkpoint`,
`shard_files`, `all_finite`, `resolve_weights` and `to_hf_config` are the steps and checks.

Contracts: `load_checkpoint(save_checkpoint(params))` returns `params` bit for bit. A malformed
config.json, index or header, missing, extra or mis-shaped tensors, FP8 weights without scales,
truncated shards, a tensor in two shards or a non-finite tensor raise `ValueError` (one line
naming the file, the tensor or field, what was expected and what came), before anything
reaches the device. The loading steps and FP8 in full: docs/guides/checkpoints.md.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fo_jax.checkpoints.hf_config import (config_from_hf, hf_quantization, hf_scale_fmt,
                                          indexer_fields, read_hf_config, read_json)
from fo_jax.checkpoints.names import MTP_SHARED, Slot, mtp_layer, mtp_tensor_names, tensor_names
from fo_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors
from fo_jax.config import ModelConfig
from fo_jax.model.dsa import FP8_PARAMS, check_params, param_dtype, param_shapes
from fo_jax.model.linear import Fp8Weight
from fo_jax.model.mtp import check_mtp_params, mtp_param_shapes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE = "_scale_inv"
WEIGHTS = ("fp8", "dequantize")


def shard_files(directory: str | os.PathLike) -> dict[str, list[str]]:
    """{shard file: [tensor names the index gives it]} ([] for a lone model.safetensors);
    ValueError naming the index file and the entry unless it is well formed."""
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        weight_map = read_json(index, '{"weight_map": {tensor name: shard file name}}').get(
            "weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f'{index}: "weight_map" must map tensor names to the names of '
                             f"shard files in {directory}, got {weight_map!r:.80}")
        out: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not (isinstance(shard, str) and shard and os.path.basename(shard) == shard
                    and shard not in (".", "..")):
                raise ValueError(f"{index}: weight_map[{name!r}]={shard!r:.80} must be the name "
                                 f"of a shard file in {directory}")
            out.setdefault(shard, []).append(name)
        return out
    if os.path.exists(os.path.join(directory, SINGLE)):
        return {SINGLE: []}
    raise FileNotFoundError(f"{directory}: neither {INDEX} nor {SINGLE}")


def _expected_shape(shapes: dict, slot: Slot) -> tuple[int, ...]:
    shape = shapes
    for key in slot.path:
        shape = shape[key]
    shape = tuple(shape[len(slot.index):])
    return shape[:-2] + shape[:-3:-1] if slot.transpose else shape


def _expected(config: ModelConfig, found) -> dict:
    """{checkpoint name: (shape, [(Slot, rows or None)])}: where each tensor's pieces go.

    A MoE layer's experts come one tensor per expert and matrix (the Hub checkpoints), or packed
    as `mlp.experts.gate_up_proj` [X, 2M, E] (gate rows first) and `mlp.experts.down_proj`
    [X, E, M] (how recent `transformers` hold them).
    """
    shapes = param_shapes(config)
    out = {name: (_expected_shape(shapes, slot), [(slot, None)])
           for name, slot in tensor_names(config, "hf").items()}
    num_x, m_width = config.n_routed_experts, config.moe_hidden
    for l in range(config.num_dense_layers, config.num_layers):
        pre = f"model.layers.{l}.mlp.experts."
        if pre + "gate_up_proj" not in found and pre + "down_proj" not in found:
            continue
        for e in range(num_x):
            for matrix in ("gate_proj", "up_proj", "down_proj"):
                out.pop(f"{pre}{e}.{matrix}.weight")
        m = l - config.num_dense_layers
        out[pre + "gate_up_proj"] = ((num_x, 2 * m_width, config.dim), [
            (Slot(("moe", "w1"), (m,), True), (0, m_width)),
            (Slot(("moe", "w3"), (m,), True), (m_width, 2 * m_width))])
        out[pre + "down_proj"] = ((num_x, config.dim, m_width),
                                  [(Slot(("moe", "w2"), (m,), True), None)])
    return out


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 of FP8 weights q [O, I] with block scales scale_inv [ceil(O/b0), ceil(I/b1)]."""
    rows, cols = q.shape
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return q.astype(np.float32) * full[:rows, :cols]


def _mtp_own(config: ModelConfig, found) -> dict[str, bool]:
    """Whether the checkpoint stores the MTP layers' own embed / head (judged on layer L)."""
    pre = f"model.layers.{config.num_layers}."
    return {f"own_{key}": pre + hf in found for key, (hf, _) in MTP_SHARED.items()}


def _expected_mtp(config: ModelConfig, found) -> dict:
    """`_expected` of the MTP layers' tensors: Slots into {"mtp": mtp params}."""
    if config.num_nextn_predict_layers < 1:
        raise ValueError(f"mtp=True: config {config.name!r} has num_nextn_predict_layers=0 "
                         "(no multi-token-prediction layer to load); load with mtp=False")
    own = _mtp_own(config, found)
    shapes = {"mtp": mtp_param_shapes(config, **own)}
    return {name: (_expected_shape(shapes, slot), [(slot, None)])
            for name, slot in mtp_tensor_names(config, **own).items()}



def _mismatch(expected, found) -> str:
    """'' when the two name sets agree, else "missing [...], unexpected [...]" (8 of each)."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if not (missing or extra):
        return ""
    return (f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
            f"{extra[:8]}{' ...' if len(extra) > 8 else ''}")

def _indexer_hint(directory: str, config: ModelConfig, tensors) -> str:
    """"; the checkpoint holds indexer tensors at layers ..., config ... puts indexers at ...
    (config.json: the fields that say so)" when those layers differ, else ""."""
    held = tuple(sorted({int(n.split(".")[2]) for n in tensors
                         if n.startswith("model.layers.") and ".self_attn.indexer." in n}
                        & set(range(config.num_layers))))
    if held == config.indexer_layers:
        return ""
    return (f"; the checkpoint holds indexer tensors at layers {held}, config {config.name!r} "
            f"puts indexers at layers {config.indexer_layers} (config.json: "
            f"{indexer_fields(read_hf_config(directory))})")


def inspect_checkpoint(directory: str | os.PathLike, config: ModelConfig, *,
                       mtp: bool = False) -> dict:
    """Check a checkpoint directory against `config` without reading tensor data.

    Returns {name: (SafetensorsFile, [(Slot, rows or None)], the SafetensorsFile of its FP8
    scale or None)} of the tensors to load (see `_expected`); with `mtp`, the MTP layers'
    tensors too (Slots into {"mtp": ...}).
    """
    directory = os.fspath(directory)
    block = hf_quantization(directory)
    found: dict[str, tuple[str, SafetensorsFile]] = {}
    shards = shard_files(directory)
    index_shard = {name: shard for shard, names in shards.items() for name in names}
    for shard, listed in sorted(shards.items()):
        path = os.path.join(directory, shard)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{directory}: shard {shard} (named by {INDEX}) is missing")
        file = SafetensorsFile(path)
        missing_here = sorted(set(listed) - set(file.entries))
        if missing_here:
            raise ValueError(f"{path}: {INDEX} puts {missing_here[:5]} in this shard but it "
                             "does not hold them")
        for name in file.entries:
            if name in found:
                raise ValueError(
                    f"{path}: tensor {name!r} is also in {found[name][0]}: which copy to load "
                    f"is ambiguous (the index puts it in {index_shard.get(name)}); remove the "
                    "other")
            found[name] = (path, file)
    expected = _expected(config, found)
    scales = {n for n in found if n.endswith(SCALE)}
    if mtp:
        wanted = _expected_mtp(config, found)
        held = {n for n in found if n not in scales and mtp_layer(n, config)}
        mismatch = _mismatch(wanted, held)
        if mismatch:
            raise ValueError(
                f"{directory}: the multi-token-prediction layer tensors (layers "
                f"{config.num_layers}..{config.num_layers + config.num_nextn_predict_layers - 1}"
                f") do not match config {config.name!r}: {mismatch}; load with mtp=False to "
                "skip them")
        expected.update(wanted)
    tensors = {n for n in found if n not in scales and (mtp or not mtp_layer(n, config))}
    mismatch = _mismatch(expected, tensors)
    if mismatch:
        raise ValueError(
            f"{directory}: checkpoint tensors do not match config {config.name!r} "
            f"({config.num_layers} layers, {config.n_routed_experts} experts, indexers at "
            f"{config.indexer_layers}): {mismatch}{_indexer_hint(directory, config, tensors)}")
    plan = {}
    for name in sorted(expected):
        path, file = found[name]
        dtype, shape, _, _ = file.entries[name]
        want, pieces = expected[name]
        if shape != want:
            raise ValueError(f"{path}: tensor {name!r} has shape {shape}, expected {want} "
                             f"for config {config.name!r}")
        scale_file = None
        if dtype.name == "float8_e4m3fn":
            if block is None:
                raise ValueError(f"{path}: tensor {name!r} is FP8 but config.json has no "
                                 "quantization_config")
            if len(shape) != 2:
                raise ValueError(f"{path}: tensor {name!r} of shape {shape} is FP8; fo_jax "
                                 "reads FP8 block scales of 2-D weights only")
            if name + SCALE not in found:
                raise ValueError(f"{path}: FP8 tensor {name!r} has no {name + SCALE!r}")
            scale_file = found[name + SCALE][1]
            _, scale_shape, _, _ = scale_file.entries[name + SCALE]
            want_scale = tuple(-(-n // b) for n, b in zip(shape, block))
            if scale_shape != want_scale:
                raise ValueError(f"{path}: {name + SCALE!r} has shape {scale_shape}, expected "
                                 f"{want_scale} ({shape} in blocks of {block})")
        elif not (np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"):
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, expected a float")
        plan[name] = (file, pieces, scale_file)
    stray = sorted(s for s in scales if s[:-len(SCALE)] not in plan
                   and not mtp_layer(s, config))
    if stray:
        raise ValueError(f"{directory}: scales without an FP8 weight to scale: {stray[:5]}")
    return plan


def resolve_weights(weights: str | None, directory: str | os.PathLike) -> str:
    """`weights`, or for None "fp8" when the checkpoint's config.json has a
    quantization_config (FP8 weights) and "dequantize" otherwise; ValueError for any other
    value, and for "fp8" on a checkpoint without FP8 weights."""
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHTS} (or None: 'fp8' for a "
                         "checkpoint with FP8 weights, else 'dequantize')")
    quantized = hf_quantization(directory) is not None
    if weights is None:
        return "fp8" if quantized else "dequantize"
    if weights == "fp8" and not quantized:
        raise ValueError(f"weights='fp8': {os.fspath(directory)} has no FP8 weights (its "
                         "config.json has no quantization_config); load with "
                         "weights='dequantize' (or None)")
    return weights


def _fp8_stacks(plan: dict, block) -> dict:
    """{parameter path: (bI, bO) block} of the stacks kept FP8: in `FP8_PARAMS` and FP8 in
    every tensor that fills them."""
    fp8: dict[tuple, bool] = {}
    for _, pieces, scale_file in plan.values():
        for slot, _ in pieces:
            fp8[slot.path] = fp8.get(slot.path, True) and scale_file is not None and (
                slot.path[-2:] in FP8_PARAMS and slot.transpose)
    return {path: (block[1], block[0]) for path, kept in fp8.items() if kept}


def load_checkpoint(directory: str | os.PathLike, config: ModelConfig | None = None, *,
                    progress: bool = True, mtp: bool = False, weights: str | None = None,
                    **settings):
    """(config, params) of a Hugging Face checkpoint directory; (config, params, mtp_params)
    with `mtp`.

    Args:
      directory: holds config.json, the index and the shards.
      config: the ModelConfig to load into (default: `config_from_hf(directory,
        **settings)`).
      progress: show a tqdm bar over the tensors.
      mtp: also load the num_nextn_predict_layers multi-token-prediction layers
        (`fo_jax.model.mtp.mtp_param_shapes`: stacked over the MTP layers; "embed" / "head"
        only where the checkpoint stores the layer's own copy); without it they are skipped.
      weights: "fp8" keeps FP8 weights FP8 (`Fp8Weight` parameters, see the module
        docstring), "dequantize" dequantises them to `config.dtype`; None: "fp8" for a
        checkpoint with a quantization_config, else "dequantize" (`resolve_weights`).
    """
    directory = os.fspath(directory)
    weights = resolve_weights(weights, directory)
    if config is None:
        config = config_from_hf(directory, **settings)
    block = hf_quantization(directory)
    plan = inspect_checkpoint(directory, config, mtp=mtp)
    kept = _fp8_stacks(plan, block) if weights == "fp8" else {}
    scale_fmt = hf_scale_fmt(directory)
    shapes = param_shapes(config)
    if mtp:
        own = {f"own_{key}": any(slot.path == ("mtp", key) for _, pieces, _ in plan.values()
                                 for slot, _ in pieces) for key in MTP_SHARED}
        shapes["mtp"] = mtp_param_shapes(config, **own)
    def allocate(path, shape):
        path = tuple(k.key for k in path)
        if path in kept:
            grid = shape[:-2] + tuple(-(-n // b) for n, b in zip(shape[-2:], kept[path]))
            return Fp8Weight(np.empty(shape, jnp.float8_e4m3fn), np.empty(grid, np.float32),
                             kept[path], scale_fmt)
        return np.empty(shape, jnp.dtype(param_dtype(path, config)))

    host = jax.tree_util.tree_map_with_path(allocate, shapes,
                                            is_leaf=lambda x: isinstance(x, tuple))
    by_shard: dict[str, list[str]] = {}
    for name, (file, _, _) in plan.items():
        by_shard.setdefault(file.path, []).append(name)
    bar = tqdm(total=len(plan), desc="loading tensors", unit="tensor", disable=not progress)
    for path in sorted(by_shard):
        for name in by_shard[path]:
            file, pieces, scale_file = plan[name]
            value = file.get(name)
            if scale_file is not None and pieces[0][0].path in kept:
                _fill_fp8(host, pieces[0][0], value, scale_file.get(name + SCALE), file.path,
                          name, block)
                bar.update(1)
                continue
            if scale_file is not None:
                value = dequantize_fp8(value, scale_file.get(name + SCALE), block)
            for slot, rows in pieces:
                piece = value if rows is None else value[..., rows[0]:rows[1], :]
                target = host
                for key in slot.path:
                    target = target[key]
                with np.errstate(over="ignore"):  # an overflow is reported just below
                    target[slot.index] = np.swapaxes(piece, -1, -2) if slot.transpose else piece
                if not all_finite(target[slot.index]):
                    _refuse_non_finite(file.path, name, value, target.dtype,
                                       scale_file is not None)
            del value
            bar.update(1)
    bar.close()
    params = _to_device(host)
    if mtp:
        mtp_params = params.pop("mtp")
        check_params(params, config)
        check_mtp_params(mtp_params, config)
        return config, params, mtp_params
    check_params(params, config)
    return config, params


def _fill_fp8(host: dict, slot: Slot, q: np.ndarray, scale: np.ndarray, path: str, name: str,
              block) -> None:
    """Write FP8 tensor `name` (q [O, I] e4m3, scale [ceil(O/b0), ceil(I/b1)]) transposed
    into its `Fp8Weight` stack at `slot`; refuse NaN values or non-finite scales (named as
    `_refuse_non_finite` names a dequantised tensor)."""
    target = host
    for key in slot.path:
        target = target[key]
    if not (all_finite(q) and all_finite(scale)):
        _refuse_non_finite(path, name, dequantize_fp8(q, scale, block), np.float32, True)
    target.q[slot.index] = q.T
    target.scale_inv[slot.index] = scale.T


# The bits of a float whose exponent bits are all set are inf or NaN: per float dtype, the
# unsigned int of its width and the mask of its exponent bits (float8_e4m3fn has no inf: its
# NaN alone has every exponent and mantissa bit set).
_EXPONENT = {np.dtype(np.float16): (np.uint16, 0x7C00),
             np.dtype(jnp.bfloat16): (np.uint16, 0x7F80),
             np.dtype(np.float32): (np.uint32, 0x7F800000),
             np.dtype(np.float64): (np.uint64, 0x7FF0000000000000),
             np.dtype(jnp.float8_e4m3fn): (np.uint8, 0x7F)}
_CHUNK = 1 << 18  # values per step of `all_finite` (cache-sized)


def all_finite(array: np.ndarray) -> bool:
    """Whether every value of float `array` (float16, bfloat16, float32 or float64) is finite.

    Reads its bits in cache-sized chunks: max(bits & exponent mask) == mask iff some value
    has every exponent bit set (inf or NaN). Measured on one CPU core: 0.05 s per GB of
    bfloat16, 0.08 s per GB of float32 (np.isfinite(...).all(): 0.35 s per GB of bfloat16).
    """
    uint, mask = _EXPONENT[array.dtype]
    bits = np.ascontiguousarray(array).reshape(-1).view(uint)
    scratch = np.empty(min(bits.size, _CHUNK), uint)
    for i in range(0, bits.size, _CHUNK):
        chunk = scratch[:len(bits[i:i + _CHUNK])]
        np.bitwise_and(bits[i:i + _CHUNK], uint(mask), out=chunk)
        if chunk.max() == mask:
            return False
    return True


def _refuse_non_finite(path: str, name: str, value: np.ndarray, dtype, scaled: bool) -> None:
    """Raise the ValueError for tensor `name` (`value`: its values in the file's layout, FP8
    dequantised), which is not finite once cast to `dtype`: it holds inf or NaN, or values too
    large for `dtype`. Names the count and the first one (error path: not timed)."""
    value = value.astype(np.float32) if value.dtype.itemsize < 4 else value
    bad = ~np.isfinite(value)
    if bad.any():
        what = "non-finite value" + ("s" if bad.sum() > 1 else "")
        fix = (f" once dequantised with {name + SCALE!r}" if scaled else "") + (
            ": a corrupt or mis-converted checkpoint (fo_jax loads finite weights only)")
    else:
        bad = np.abs(value) > float(jnp.finfo(dtype).max)
        what = ("values that overflow" if bad.sum() > 1 else "value that overflows") + (
            f" {np.dtype(dtype).name}")
        fix = ": load it with a wider dtype (dtype='bfloat16' or 'float32')"
    if not bad.any():  # not reached: a finite value within range casts to a finite one
        raise ValueError(f"{path}: tensor {name!r} is not finite as {np.dtype(dtype).name}")
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{path}: tensor {name!r} holds {int(bad.sum())} {what} (the first, "
                     f"{float(value[first])}, at {list(first)}){fix}")


def _to_device(host: dict) -> dict:
    """The numpy stacks as jax arrays, one stack at a time (each host copy dropped after;
    `jax.device_put` copies once where `jnp.asarray` held two copies of a stack in flight)."""
    out = {}
    for key in list(host):
        if isinstance(host[key], dict):
            out[key] = _to_device(host[key])
        elif isinstance(host[key], Fp8Weight):
            w = host.pop(key)
            out[key] = Fp8Weight(jax.device_put(w.q), jax.device_put(w.scale_inv), w.block,
                                 w.scale_fmt)
        else:
            out[key] = jax.device_put(host.pop(key))
    return out


def to_hf_config(config: ModelConfig,
                 architecture: str = "DeepseekV32ForCausalLM") -> dict:
    """The config.json of `config` (`config_from_hf` reads it back to an equal config, up to
    the settings config.json does not hold: max_ways, kv_dtype, index_fp8)."""
    from fo_jax.checkpoints.hf_config import ARCHITECTURES, MAPPED
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r} is not one of {sorted(ARCHITECTURES)}")
    hf = {"architectures": [architecture], "model_type": ARCHITECTURES[architecture],
          "_name_or_path": config.name, "torch_dtype": config.dtype,
          "max_position_embeddings": config.max_seq_len, "rope_theta": config.rope_theta}
    for key, field in MAPPED.items():
        hf[key] = getattr(config, field)
    if not config.moe:
        for key in ("num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                    "first_k_dense_replace"):
            hf.pop(key)
    if config.rope_factor != 1.0:
        hf["rope_scaling"] = {
            "type": "yarn", "factor": config.rope_factor,
            "original_max_position_embeddings": config.rope_original_seq_len,
            "beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow,
            "mscale": config.rope_mscale, "mscale_all_dim": config.rope_mscale}
    if config.indexer_layers != tuple(range(config.num_layers)):
        full = set(config.indexer_layers)
        hf["indexer_types"] = ["full" if l in full else "shared"
                               for l in range(config.num_layers)]
    return hf


def save_checkpoint(directory: str | os.PathLike, params: dict, config: ModelConfig, *,
                    architecture: str = "DeepseekV32ForCausalLM",
                    max_shard_bytes: int = 4 << 30, progress: bool = True,
                    mtp: dict | None = None) -> None:
    """Write `params` as a Hugging Face checkpoint directory (config.json, the index, shards
    of at most `max_shard_bytes` unless one tensor is larger), tensors in the params' dtypes.
    mtp: the multi-token-prediction layers' parameters (`fo_jax.model.mtp`), written as layers
    L .. L + num_nextn_predict_layers - 1 (their own embed / head only if they hold one)."""
    check_params(params, config)
    fp8 = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(
        {"params": params, "mtp": mtp}, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]
        if isinstance(leaf, Fp8Weight)]
    if fp8:
        raise NotImplementedError(
            f"save_checkpoint writes unquantised parameters; {fp8[0]} is an Fp8Weight: load the "
            "checkpoint with weights='dequantize' (or dequantize the FP8 stacks with "
            "fo_jax.model.linear.dequantize) to save it")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    names = tensor_names(config, "hf")
    if mtp is not None:
        check_mtp_params(mtp, config)
        names.update(mtp_tensor_names(config, own_embed="embed" in mtp,
                                      own_head="head" in mtp))
        params = {**params, "mtp": mtp}
    shards: list[list[str]] = [[]]
    size = 0
    for name, slot in names.items():
        leaf = _leaf(params, slot)
        nbytes = int(np.prod(leaf.shape[len(slot.index):])) * leaf.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    bar = tqdm(total=len(names), desc="saving tensors", unit="tensor", disable=not progress)
    for i, group in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in group:
            slot = names[name]
            value = np.asarray(_leaf(params, slot)[slot.index])
            tensors[name] = np.ascontiguousarray(value.T if slot.transpose else value)
            weight_map[name] = file
            total += tensors[name].nbytes
        write_safetensors(os.path.join(directory, file), tensors, {"format": "pt"})
        bar.update(len(group))
        del tensors
    bar.close()
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(to_hf_config(config, architecture), f, indent=1)


def _leaf(params: dict, slot: Slot):
    leaf = params
    for key in slot.path:
        leaf = leaf[key]
    return leaf


__all__ = ["WEIGHTS", "all_finite", "dequantize_fp8", "inspect_checkpoint",
           "load_checkpoint", "read_hf_config", "resolve_weights", "save_checkpoint",
           "shard_files", "to_hf_config"]

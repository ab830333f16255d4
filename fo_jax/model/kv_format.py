"""How a KV row is stored: `kv_format="bf16"` (D + R values in kv_dtype) or `"fp8_ds_mla"`.

`"fp8_ds_mla"` is DeepSeek's FP8 layout of the sparse-MLA cache (FlashMLA's sparse decode,
vLLM's `fp8_ds_mla`): one row of Y = D + 4 D / blk + 2 R bytes (uint8) per token and layer,

    bytes [0, D)                 the D latent values as float8_e4m3fn
    bytes [D, D + 4 D / blk)     D / blk float32 scales, one per block of blk latent values
    bytes [D + 4 D / blk, Y)     the R RoPE values as bfloat16

with blk = min(128, D) (128 at real size: D = 512, R = 64 -> 512 + 16 + 128 = 656 bytes,
against 1,152 in bfloat16). Scalars are little-endian, as the hosts these run on store them.

Quantization of one block x (float32):
    scale = 2 ** ceil(log2(max(amax(|x|) / 448, 2 ** -126)))   a power of two, computed exactly
    q = e4m3(clip(x / scale, -448, 448))                        round to nearest even
so x / scale is exact (a power of two), |q| <= 448, an all-zero block gets scale 2^-126 and
q = 0, and NaN propagates. vLLM's kernel clamps the scale at FLT_MIN (2^-126) the same way but
keeps amax / 448 as it is; the power of two is DeepSeek's `ue8m0` scale rounding (and makes
x / scale exact). Dequantization is q * scale in float32 (exact: 4 significant bits times a
power of two) and the RoPE values widened from bfloat16.

The write path quantizes each new row (`store_kv_rows`); attention dequantizes only the rows it
has gathered (`load_kv_rows`, called by `sparse_attention` on its K rows). Every path stores
and moves the same bytes, so offloaded equals resident bit for bit in either format.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fo_jax.config import KV_FORMATS
from fo_jax.typing import Array, Float, Shaped, UInt8

__all__ = ["KV_FORMATS", "dequantize_kv_rows", "fp8_row_bytes", "kv_fill", "load_kv_rows",
           "quantize_kv_rows", "store_kv_rows"]
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_MIN_SCALE_BITS = 0x00800000  # float32 2^-126 (FLT_MIN), the smallest scale


def scale_block(d: int) -> int:
    """blk: latent values per float32 scale, min(128, D)."""
    return min(128, d)


def fp8_row_bytes(d: int, r: int) -> int:
    """Y = D + 4 D / blk + 2 R: bytes of one fp8_ds_mla row (656 for D = 512, R = 64)."""
    return d + 4 * (d // scale_block(d)) + 2 * r


def check_fp8_widths(d: int) -> None:
    """Raise ValueError unless D = kv_lora_rank fits the format's blocks."""
    blk = scale_block(d)
    if d % blk:
        raise ValueError(
            f"kv_format='fp8_ds_mla' needs kv_lora_rank % 128 == 0 when kv_lora_rank > 128 "
            f"(one float32 scale per 128 latent values), got kv_lora_rank={d}; use a multiple "
            f"of 128 ({(d // 128) * 128} or {(d // 128 + 1) * 128}) or kv_format='bf16'")


def _pow2_ceil(x: jax.Array) -> jax.Array:
    """The least power of two >= x, for float32 x >= 2^-126 (normal, finite), exactly:
    the exponent of x, plus one when x has mantissa bits. NaN stays NaN."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    exponent = bits & jnp.uint32(0x7F800000)
    up = jnp.where((bits & jnp.uint32(0x007FFFFF)) != 0, exponent + jnp.uint32(0x00800000),
                   exponent)
    return jnp.where(jnp.isnan(x), x, jax.lax.bitcast_convert_type(up, jnp.float32))


def quantize_kv_rows(rows: Float[Array, "*B DR"], *, kv_lora_rank: int) -> UInt8[Array, "*B Y"]:
    """KV rows [..., D + R] (any float dtype) -> fp8_ds_mla rows [..., Y] uint8.

    D = kv_lora_rank; R = the rest. See the module docstring for the layout and the rounding.
    """
    d = kv_lora_rank
    r = rows.shape[-1] - d
    check_fp8_widths(d)
    if r < 0:
        raise ValueError(f"rows of width {rows.shape[-1]} are narrower than {kv_lora_rank=}")
    blk = scale_block(d)
    lead = rows.shape[:-1]
    x = rows[..., :d].astype(jnp.float32).reshape(lead + (d // blk, blk))
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    floor = jax.lax.bitcast_convert_type(jnp.uint32(_MIN_SCALE_BITS), jnp.float32)
    scale = _pow2_ceil(jnp.maximum(amax / FP8_MAX, floor))  # [..., D/blk, 1]
    q = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).reshape(lead + (d,))
    q_bytes = jax.lax.bitcast_convert_type(q, jnp.uint8)
    s_bytes = jax.lax.bitcast_convert_type(scale[..., 0], jnp.uint8).reshape(lead + (-1,))
    pe = rows[..., d:].astype(jnp.bfloat16)
    pe_bytes = jax.lax.bitcast_convert_type(pe, jnp.uint8).reshape(lead + (2 * r,))
    return jnp.concatenate([q_bytes, s_bytes, pe_bytes], axis=-1)


def dequantize_kv_rows(rows: Shaped[Array, "*B Y"], *, kv_lora_rank: int,
                       dtype=jnp.float32) -> Float[Array, "*B DR"]:
    """fp8_ds_mla rows [..., Y] uint8 (checked here, with a message) -> KV rows [..., D + R] in
    `dtype` (float32 default: exact). Bytes that hold NaN (0xFF poison) decode to NaN."""
    if rows.dtype != jnp.uint8:
        raise ValueError(f"fp8_ds_mla rows must be uint8, got {rows.dtype}")
    d = kv_lora_rank
    blk = scale_block(d)
    nb = d // blk
    width = rows.shape[-1]
    r2 = width - d - 4 * nb
    if d % blk or r2 < 0 or r2 % 2:
        raise ValueError(
            f"a row of {width} bytes is not an fp8_ds_mla row for {kv_lora_rank=}: expected "
            f"{d} + 4 * {nb} + 2 R bytes")
    lead = rows.shape[:-1]
    q = jax.lax.bitcast_convert_type(rows[..., :d], jnp.float8_e4m3fn).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(
        rows[..., d:d + 4 * nb].reshape(lead + (nb, 4)), jnp.float32)  # [..., D/blk]
    latent = (q.reshape(lead + (nb, blk)) * scale[..., None]).reshape(lead + (d,))
    pe = jax.lax.bitcast_convert_type(
        rows[..., d + 4 * nb:].reshape(lead + (r2 // 2, 2)), jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([latent, pe], axis=-1).astype(dtype)


def store_kv_rows(rows: Float[Array, "*B DR"], *, config) -> Array:
    """New KV rows [..., D + R] as the cache stores them: kv_dtype values ("bf16") or
    quantized uint8 rows ("fp8_ds_mla")."""
    if config.kv_format == "fp8_ds_mla":
        return quantize_kv_rows(rows, kv_lora_rank=config.kv_lora_rank)
    return rows.astype(config.jnp_kv_dtype)


def load_kv_rows(rows: Shaped[Array, "*B Y"], *, kv_lora_rank: int) -> Float[Array, "*B DR"]:
    """Stored rows as float32 [..., D + R]: uint8 rows are fp8_ds_mla (dequantized), float
    rows are widened. Call it on the rows read (the K selected), never on a whole cache."""
    if rows.dtype == jnp.uint8:
        return dequantize_kv_rows(rows, kv_lora_rank=kv_lora_rank)
    return rows.astype(jnp.float32)


def kv_fill(fill: float, dtype) -> float | int:
    """The scalar that fills unwritten rows of a KV array of `dtype` for `fill` (0.0, or NaN
    to poison): `fill` itself for float rows; for uint8 (fp8_ds_mla) rows the byte 0x00
    (decodes to 0) or 0xFF (every field decodes to NaN: e4m3 0xFF, float32 and bfloat16
    all-ones)."""
    if jnp.dtype(dtype) != jnp.uint8:
        return fill
    fill = float(fill)
    if fill != fill:
        return 0xFF
    if fill == 0.0:
        return 0
    raise ValueError(f"{fill=} cannot fill an fp8_ds_mla cache: use 0.0, or NaN (the poison, "
                     "stored as bytes 0xFF)")

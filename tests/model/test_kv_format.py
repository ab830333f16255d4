"""The fp8_ds_mla KV row format: hand-computed bytes, round trips, widths and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import resident
from fo_jax.config import get_config
from fo_jax.model.kv_format import (dequantize_kv_rows, fp8_row_bytes, kv_fill, load_kv_rows,
                                    quantize_kv_rows, store_kv_rows)
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState

TINY = get_config("tiny")


def test_reference_row_by_hand():
    # D = 4, R = 2: one block of 4 latent values (blk = min(128, D)), Y = 4 + 4 + 2 * 2 = 12.
    rows = jnp.array([[1.0, -3.0, 0.5, 7.0, 1.5, -2.0],
                      [10.0, -1.0, 0.3, 0.0, 0.0, 3.0]], jnp.float32)
    got = np.asarray(quantize_kv_rows(rows, kv_lora_rank=4))
    # Row 0: amax 7, 7 / 448 = 2^-6 exactly, so scale = 2^-6 and x / scale = [64, -192, 32, 448]:
    #   e4m3 (sign, 4 exponent bits biased by 7, 3 mantissa bits):
    #   64 = 2^6 -> 0 1101 000 = 0x68 = 104;  -192 = -1.5 * 2^7 -> 1 1110 100 = 0xF4 = 244;
    #   32 = 2^5 -> 0 1100 000 = 0x60 = 96;  448 = 1.75 * 2^8 -> 0 1111 110 = 0x7E = 126.
    #   scale 2^-6 as float32: exponent 121 -> 0x3C800000, little-endian [0x00, 0x00, 0x80, 0x3C].
    #   RoPE in bfloat16: 1.5 = 0x3FC0 -> [0xC0, 0x3F]; -2.0 = 0xC000 -> [0x00, 0xC0].
    want0 = [104, 244, 96, 126, 0, 0, 128, 60, 192, 63, 0, 192]
    # Row 1: amax 10, 10 / 448 = 0.0223 -> rounded up to 2^-5 = 0.03125; x / scale = x * 32 =
    #   [320, -32, 9.6, 0]: 320 = 1.25 * 2^8 -> 0 1111 010 = 0x7A = 122; -32 -> 1 1100 000 =
    #   0xE0 = 224; 9.6 lies between e4m3 neighbours 9 and 10 (step 1 in [8, 16)) -> 10 =
    #   1.25 * 2^3 -> 0 1010 010 = 0x52 = 82; 0 -> 0x00.
    #   scale 2^-5: exponent 122 -> 0x3D000000 -> [0, 0, 0, 0x3D = 61].
    #   RoPE: 0.0 -> [0, 0]; 3.0 = 0x4040 -> [0x40, 0x40] = [64, 64].
    want1 = [122, 224, 82, 0, 0, 0, 0, 61, 0, 0, 64, 64]
    np.testing.assert_array_equal(got, np.array([want0, want1], np.uint8))
    back = np.asarray(dequantize_kv_rows(jnp.asarray(got), kv_lora_rank=4))
    # 10 * 2^-5 = 0.3125 is what 0.3 comes back as; every other value is exact.
    np.testing.assert_array_equal(back, [[1.0, -3.0, 0.5, 7.0, 1.5, -2.0],
                                         [10.0, -1.0, 0.3125, 0.0, 0.0, 3.0]])


def test_blocks_are_scaled_apart_and_zero_blocks_get_the_smallest_scale():
    # D = 256: two blocks of 128; block 0 all zeros, block 1 with amax 3 (3 / 448 -> 2^-7).
    rows = np.zeros((1, 256 + 8), np.float32)
    rows[0, 128:256] = np.linspace(-3.0, 2.0, 128)
    got = np.asarray(quantize_kv_rows(jnp.asarray(rows), kv_lora_rank=256))
    assert got.shape == (1, 256 + 4 * 2 + 2 * 8)
    scales = got[0, 256:264].view(np.float32)
    np.testing.assert_array_equal(scales, [2.0 ** -126, 2.0 ** -7])
    assert not got[0, :128].any()  # zeros quantize to 0x00 under the smallest scale


def test_round_trip_at_deepseek_widths():
    # D = 512, R = 64: 656 bytes; each value within its e4m3 rounding (3 mantissa bits:
    # relative 2^-4, or 2^-10 of the block's scale below e4m3's normal range), the RoPE values
    # exactly their bfloat16 rounding.
    assert fp8_row_bytes(512, 64) == 656
    x = jax.random.normal(jax.random.key(0), (3, 5, 576), jnp.float32)
    x = x * jnp.where(jnp.arange(576) < 128, 50.0, 1.0)  # blocks of different magnitudes
    q = quantize_kv_rows(x, kv_lora_rank=512)
    assert q.shape == (3, 5, 656) and q.dtype == jnp.uint8
    back = np.asarray(dequantize_kv_rows(q, kv_lora_rank=512))
    x = np.asarray(x)
    scales = np.asarray(q[..., 512:528]).copy().view(np.float32)  # [3, 5, 4]
    np.testing.assert_array_equal(np.log2(scales), np.round(np.log2(scales)))  # powers of two
    per_value = np.repeat(scales, 128, axis=-1)
    bound = np.maximum(np.abs(x[..., :512]) * 2.0 ** -4, per_value * 2.0 ** -10)
    assert np.all(np.abs(back[..., :512] - x[..., :512]) <= bound)
    assert np.all(np.abs(x[..., :512]) / per_value <= 448)
    np.testing.assert_array_equal(back[..., 512:],
                                  np.asarray(jnp.asarray(x[..., 512:]).astype(jnp.bfloat16),
                                             np.float32))


def test_poison_bytes_decode_to_nan_and_zero_bytes_to_zero():
    nan_rows = jnp.full((2, 52), kv_fill(float("nan"), jnp.uint8), jnp.uint8)
    assert np.all(np.isnan(np.asarray(dequantize_kv_rows(nan_rows, kv_lora_rank=32))))
    zero_rows = jnp.full((2, 52), kv_fill(0.0, jnp.uint8), jnp.uint8)
    np.testing.assert_array_equal(np.asarray(dequantize_kv_rows(zero_rows, kv_lora_rank=32)), 0)
    assert kv_fill(float("nan"), jnp.bfloat16) != kv_fill(float("nan"), jnp.bfloat16)  # NaN


def test_store_and_load_follow_the_config():
    x = jax.random.normal(jax.random.key(1), (2, TINY.kv_width))
    fp8 = TINY.replace(kv_format="fp8_ds_mla")
    assert store_kv_rows(x, config=TINY).dtype == jnp.bfloat16
    stored = store_kv_rows(x, config=fp8)
    assert stored.shape == (2, fp8.kv_row_width) and fp8.kv_row_width == 32 + 4 + 16
    np.testing.assert_array_equal(load_kv_rows(stored, kv_lora_rank=32),
                                  dequantize_kv_rows(stored, kv_lora_rank=32))


def test_row_bytes_of_the_presets():
    ds = get_config("deepseek_v32")
    assert ds.kv_row_bytes == 1152
    fp8 = ds.replace(kv_format="fp8_ds_mla")
    assert (fp8.kv_row_width, fp8.kv_row_dtype, fp8.kv_row_bytes) == (656, jnp.uint8, 656)
    # kappa: 61 layers * 656 + 61 indexer groups * 128 * 2 bytes (the keys stay bfloat16).
    assert fp8.bytes_per_token == 61 * 656 + 61 * 256


def test_host_bytes_per_token_and_layer_from_the_arrays_at_deepseek_widths():
    # The state's own arrays at the deepseek_v32 widths, traced (jax.eval_shape allocates
    # nothing): 656 host bytes per token and layer, plus 256 device bytes of indexer key per
    # token and indexer (DeepSeek: one indexer per layer).
    config = get_config("deepseek_v32").replace(kv_format="fp8_ds_mla")
    offload = OffloadConfig(hot_slots=8192, page_size=64, capacity=16384)
    state = jax.eval_shape(lambda: DecodeState.create(config, offload, batch=1))
    num_l, frames, z, width = state.host.kv.shape
    tokens = frames * z
    host = state.host.kv.size * state.host.kv.dtype.itemsize
    keys = state.index_keys.size * state.index_keys.dtype.itemsize
    assert state.host.kv.dtype == jnp.uint8 and width == 656
    assert host // (num_l * tokens) == 656 and host % (num_l * tokens) == 0
    assert keys // (config.num_groups * tokens) == 256
    assert (host + keys) // tokens == config.bytes_per_token
    hot = state.hot.size * state.hot.dtype.itemsize
    assert hot == num_l * (8192 + 2 * 64) * 656


@pytest.mark.parametrize("change,error,message", [
    (dict(kv_format="fp8"), ValueError,
     r"kv_format='fp8' is not supported; use one of \('bf16', 'fp8_ds_mla'\)"),
    (dict(kv_format="fp8_ds_mla", kv_lora_rank=192), ValueError,
     r"needs kv_lora_rank % 128 == 0 when kv_lora_rank > 128 .* got kv_lora_rank=192; use "
     r"128 or 256, or kv_format='bf16'"),
])
def test_invalid_settings_are_rejected(change, error, message):
    with pytest.raises(error, match=message):
        TINY.replace(**change)


def test_invalid_rows_are_rejected():
    with pytest.raises(ValueError, match=r"fp8_ds_mla rows must be uint8, got float32"):
        dequantize_kv_rows(jnp.zeros((1, 52), jnp.float32), kv_lora_rank=32)
    with pytest.raises(ValueError, match=r"a row of 51 bytes is not an fp8_ds_mla row for "
                                         r"kv_lora_rank=32"):
        dequantize_kv_rows(jnp.zeros((1, 51), jnp.uint8), kv_lora_rank=32)
    with pytest.raises(ValueError, match=r"kv_lora_rank % 128 == 0 .* got kv_lora_rank=200"):
        quantize_kv_rows(jnp.zeros((1, 208)), kv_lora_rank=200)
    with pytest.raises(ValueError, match=r"fill=1.0 cannot fill an fp8_ds_mla cache"):
        kv_fill(1.0, jnp.uint8)


def test_pallas_path_refuses_the_fp8_format():
    config = TINY.replace(kv_format="fp8_ds_mla")
    with pytest.raises(NotImplementedError, match=r"implementation='pallas' \(CopySFA\) reads "
                                                  r"kv_format='bf16' rows, not 'fp8_ds_mla'"):
        resident.ResidentBackend(config, False, implementation="pallas")

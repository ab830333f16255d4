"""Linear layers over plain or block-scaled FP8 weights: `linear(x, w)`, `Fp8Weight`.

Every projection of the model goes through `linear` (and `ragged_linear` for the MoE's
grouped matmul): a plain weight w [I, O] is `jnp.matmul(x, w)`, unchanged. An FP8 weight
(`Fp8Weight`, as a DeepSeek-V3.2 / GLM-5 checkpoint stores it) is e4m3 values q [I, O] with one
float32 scale per block of bI x bO values (`scale_inv` [ceil(I / bI), ceil(O / bO)], the last
blocks partial where the width is not a multiple), w = q * scale_inv; it is multiplied as the
DeepSeek reference's `linear` does (its `act_quant` + `fp8_gemm`):

  1. the activations are quantized per bI values of their last axis (`act_quant`):
       s = max(amax, 1e-4) / 448      (scale_fmt "ue8m0": rounded up to a power of two)
       x_q = e4m3(clip(x / s, -448, 448))
  2. out[n, o] = sum over in-blocks k of s[n, k] * scale_inv[k, o // bO]
                 * sum_{i in block k} x_q[n, i] q[i, o]          (float32 accumulation)
  3. cast to x's dtype.

Two implementations compute it (`FP8_IMPLEMENTATIONS`):
  "fp8_dot"     the products in FP8: one `jax.lax.dot_general` of float8 operands per in-block
                (batched over the blocks, preferred_element_type float32), the block sums then
                scaled and added: XLA's FP8 matmul where the backend has one (Hopper GPUs);
  "dequantize"  x_q * s and q * scale_inv in float32, one float32 matmul (any backend): the
                same values summed in another order (equal to float32 rounding).
None picks "fp8_dot" on GPU and "dequantize" elsewhere (`resolve_fp8_implementation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_FORMATS = (None, "ue8m0")
FP8_IMPLEMENTATIONS = ("fp8_dot", "dequantize")
_MIN_AMAX = 1e-4  # the reference's floor on a block's amax (an all-zero block gets s = 1e-4/448)


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight kept in FP8 with block scales (a pytree: stacks slice and scan like arrays).

    Attributes:
      q: [..., I, O] float8_e4m3fn values (fo_jax's [in, out] layout; leading axes stack
        layers / experts).
      scale_inv: [..., ceil(I / block[0]), ceil(O / block[1])] float32: w = q * scale_inv of
        its block (the checkpoint's `weight_scale_inv`, transposed with the weight).
      block: (bI, bO) static: the block shape in the [in, out] layout; the activations are
        quantized per bI values.
      scale_fmt: static: None (activation scales amax / 448) or "ue8m0" (rounded up to a power
        of two), as the checkpoint's quantization_config names it.
    """

    # jax arrays (numpy while a checkpoint loads on the host; any pytree leaf under
    # jax.eval_shape or tree_map, hence Any)
    q: Any
    scale_inv: Any
    block: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None

    def __post_init__(self):
        if self.scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"Fp8Weight scale_fmt={self.scale_fmt!r} is not one of "
                             f"{SCALE_FORMATS}")
        shape, grid = getattr(self.q, "shape", None), getattr(self.scale_inv, "shape", None)
        if shape is None or grid is None:  # a pytree of other leaves (tree_map, eval_shape)
            return
        want = tuple(shape[:-2]) + tuple(-(-n // b) for n, b in zip(shape[-2:], self.block))
        if len(shape) < 2 or tuple(grid) != want:
            raise ValueError(f"Fp8Weight: q {tuple(shape)} in blocks of {self.block} needs "
                             f"scale_inv of shape {want}, got {tuple(grid)}")

    @classmethod
    def quantize(cls, w: jax.typing.ArrayLike, block: tuple[int, int] = (128, 128),
                 scale_fmt: str | None = None) -> Fp8Weight:
        """w [..., I, O] in FP8 with per-block scales amax / 448 (an all-zero block: 1), as
        checkpoints are made (tests and random FP8 weights)."""
        wf = w.astype(F32)
        *lead, rows, cols = wf.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        padded = jnp.pad(wf, [(0, 0)] * len(lead) + [(0, grid[0] * block[0] - rows),
                                                     (0, grid[1] * block[1] - cols)])
        tiles = padded.reshape(*lead, grid[0], block[0], grid[1], block[1])
        amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
        scale = jnp.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(F32)
        q = (wf / _expand(scale, block, (rows, cols))).astype(FP8)
        return cls(q, scale, tuple(block), scale_fmt)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the values and their scales."""
        return self.q.nbytes + self.scale_inv.nbytes

    def __getitem__(self, index) -> Fp8Weight:
        """Index the leading (stack) axes only: w[l], w[l, e] (an int or a traced scalar)."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim - 2:
            raise IndexError(f"Fp8Weight of shape {self.shape} indexes its leading "
                             f"{self.ndim - 2} axes only, got {len(index)} indices")
        return dataclasses.replace(self, q=self.q[index], scale_inv=self.scale_inv[index])


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["q", "scale_inv"],
                                 meta_fields=["block", "scale_fmt"])


def is_fp8(w) -> bool:
    return isinstance(w, Fp8Weight)


def _expand(scale: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """Block scales [..., gI, gO] repeated to [..., I, O] (the last blocks cut)."""
    full = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return full[..., :shape[0], :shape[1]]


def dequantize(w, dtype=None):
    """An `Fp8Weight` as q * scale_inv in float32 (then `dtype` if given); a plain array as
    it is (the reference's `weight_dequant`, for the uses that are not a linear layer: MLA's
    absorbed W_UK / W_UV)."""
    if not is_fp8(w):
        return w
    out = w.q.astype(F32) * _expand(w.scale_inv, w.block, w.shape[-2:])
    return out if dtype is None else out.astype(dtype)


def act_quant(x: jax.Array, block: int, scale_fmt: str | None = None):
    """The activations x [..., I] in FP8, one scale per `block` values of the last axis (the
    last block partial when block does not divide I): (x_q [..., I] float8_e4m3fn,
    s [..., ceil(I / block)] float32), x ~ x_q * s.

    s = max(amax, 1e-4) / 448 per block, rounded up to a power of two with scale_fmt "ue8m0";
    x_q = e4m3(clip(x / s, -448, 448)) (the reference's `act_quant`).
    """
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"act_quant: scale_fmt={scale_fmt!r} is not one of {SCALE_FORMATS}")
    width = x.shape[-1]
    groups = -(-width // block)
    xf = jnp.pad(x.astype(F32), [(0, 0)] * (x.ndim - 1) + [(0, groups * block - width)])
    xf = xf.reshape(x.shape[:-1] + (groups, block))
    amax = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), _MIN_AMAX)
    scale = amax / FP8_E4M3_MAX
    if scale_fmt == "ue8m0":
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    q = jnp.clip(xf / scale[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8)
    return q.reshape(x.shape[:-1] + (groups * block,))[..., :width], scale


def resolve_fp8_implementation(implementation: str | None) -> str:
    """`implementation`, or for None "fp8_dot" on GPU (XLA's FP8 matmul) and "dequantize"
    elsewhere."""
    if implementation is None:
        return "fp8_dot" if jax.default_backend() == "gpu" else "dequantize"
    if implementation not in FP8_IMPLEMENTATIONS:
        raise ValueError(f"FP8 implementation={implementation!r} is not one of "
                         f"{FP8_IMPLEMENTATIONS} (or None: chosen by backend)")
    return implementation


def linear(x: jax.Array, w, *, implementation: str | None = None) -> jax.Array:
    """x @ w: [..., I] @ [I, O] -> [..., O] in x's dtype; w a plain array (`jnp.matmul`) or
    an `Fp8Weight` (the module docstring; `implementation` chooses how)."""
    if not is_fp8(w):
        return jnp.matmul(x, w)
    if w.ndim != 2:
        raise ValueError(f"linear: an Fp8Weight of shape {w.shape} must be one matrix [I, O] "
                         "(index the stack first)")
    implementation = resolve_fp8_implementation(implementation)
    block_i = w.block[0]
    x_q, x_s = act_quant(x, block_i, w.scale_fmt)
    if implementation == "dequantize":
        xd = x_q.astype(F32) * jnp.repeat(x_s, block_i, axis=-1)[..., :x.shape[-1]]
        out = jnp.matmul(xd, dequantize(w), precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=F32)
        return out.astype(x.dtype)
    return _fp8_dot(x_q, x_s, w).astype(x.dtype)


def _fp8_dot(x_q: jax.Array, x_s: jax.Array, w: Fp8Weight) -> jax.Array:
    """Step 2 of the module docstring with FP8 operands: [..., I] e4m3 -> [..., O] float32."""
    (num_i, num_o), (block_i, _) = w.shape, w.block
    groups = x_s.shape[-1]
    pad = groups * block_i - num_i
    lead = x_q.shape[:-1]
    xq = jnp.pad(x_q.reshape(-1, num_i), [(0, 0), (0, pad)]).reshape(-1, groups, block_i)
    wq = jnp.pad(w.q, [(0, pad), (0, 0)]).reshape(groups, block_i, num_o)
    # [G, N, O]: per in-block sums of e4m3 products, accumulated in float32.
    part = jax.lax.dot_general(xq, wq, (((2,), (1,)), ((1,), (0,))),
                               preferred_element_type=F32)
    w_s = jnp.repeat(w.scale_inv, w.block[1], axis=-1)[:, :num_o]  # [G, O]
    out = jnp.sum(part * w_s[:, None, :] * x_s.reshape(-1, groups).T[:, :, None], axis=0)
    return out.reshape(lead + (num_o,))


def ragged_linear(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` (rows x [R, I] sorted by group, w [X, I, O]);
    an `Fp8Weight` w as `linear` does it with "dequantize": quantized activations, the
    weights dequantized to float32 (all X of them, for this call), a float32 grouped matmul."""
    if not is_fp8(w):
        return jax.lax.ragged_dot(x, w, group_sizes)
    x_q, x_s = act_quant(x, w.block[0], w.scale_fmt)
    xd = x_q.astype(F32) * jnp.repeat(x_s, w.block[0], axis=-1)[..., :x.shape[-1]]
    out = jax.lax.ragged_dot(xd, dequantize(w), group_sizes, preferred_element_type=F32,
                             precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


__all__ = ["FP8_IMPLEMENTATIONS", "Fp8Weight", "SCALE_FORMATS", "act_quant", "dequantize",
           "is_fp8", "linear", "ragged_linear", "resolve_fp8_implementation"]

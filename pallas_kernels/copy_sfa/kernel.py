"""CopySFA: sparse MLA attention whose gather also installs the hot-cache misses from host memory.

    out, hot_updated = copy_sfa(q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot,
                                num_miss, scale=scale, layer=l, page_table=table)

The Pallas TPU kernel of the contract in reference.py (`copy_sfa_reference` is its oracle): one
program per request; the misses' host rows are DMA'd into VMEM first, the W * K / block_k tiles
of selected rows are then attended in canonical order through a double-buffered workspace (hits
read from the hot cache, misses from their VMEM copy, padding as zero rows), and every miss is
installed in its victim slot of `hot`, which is updated in place (the aliased `hot_updated`
output: donate `hot` under jit). With `layer` only that layer of the stacked `hot` / `host` is
touched; with `page_table` `host` is a page pool. `host` may be a host-memory-kind array (the
miss DMAs then read host memory); in interpret mode it must be device-kind
(NotImplementedError otherwise).

Design (the order of copies and compute, why misses are read from VMEM, VMEM and semaphore
budget, why the layer index is scalar-prefetched): docs/design/kernels.md.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.copy_sfa.block_sizes import BlockSizes
from pallas_kernels.copy_sfa.reference import static_validate_inputs

PADDING = -1  # read_src of a padding entry; a miss i is encoded as MISS_BASE - i
MISS_BASE = -2

# Deliberate bugs, for the tests only: they prove the harness catches each kind of mistake.
#   read_before_wait: tile s is computed before its gather DMAs are waited (race detection).
#   reuse_before_wait: one workspace half for every tile, so tile s+1's copies overwrite tile s
#     before it is computed (wrong result under on_wait, which runs the latest copy first).
#   missing_install_wait: the installs are never waited (non-zero semaphore at kernel exit).
PlantedBug = Literal["read_before_wait", "reuse_before_wait", "missing_install_wait"] | None

_DEFAULT_VMEM_LIMIT_BYTES = 16 * 1024 * 1024


def _copy_sfa_kernel(
    # Scalar prefetch
    num_miss_ref,  # [B] int32 in SMEM
    layer_ref,  # [1] int32 in SMEM: the layer of hot and host (unused when they are per-layer)
    table_ref,  # [B, P] int32 in SMEM: pool page of each request's page (paged host only)
    # Inputs
    read_src_ref,  # [1, W*K] int32 in SMEM: slot >= 0, PADDING, or MISS_BASE - i for miss i
    miss_token_ref,  # [1, M] int32 in SMEM
    miss_slot_ref,  # [1, M] int32 in SMEM
    valid_ref,  # [W*K/block_k, block_k] int32 in VMEM: 1 where the entry is not padding
    q_lat_ref,  # [W, H, D] float32 in VMEM
    q_pe_ref,  # [W, H, R] float32 in VMEM
    host_ref,  # [L, B, S, D+R] or [B, S, D+R] (paged: [L, F, Z, D+R] or [F, Z, D+R]) in host
    #            memory (pl.ANY under interpret mode)
    hot_ref,  # [L, B, C2, D+R] or [B, C2, D+R] in HBM; aliased to hot_out_ref, never touched
    # Outputs
    out_ref,  # [W, H, D] float32 in VMEM
    hot_out_ref,  # [L, B, C2, D+R] or [B, C2, D+R] in HBM: misses installed in place
    # Scratch
    miss_buf,  # [M, D+R] in VMEM: the miss rows, on their way from host to hot
    workspace,  # [2, block_k, D+R] in VMEM: double-buffered gather of one tile
    zero_row,  # [1, D+R] in VMEM: the source of padding rows
    loaded_ref,  # [M] int32 in SMEM: 1 once miss i's host load has been waited
    load_sems,  # [M] DMA semaphores: one per miss load
    install_sem,  # [] DMA semaphore: all installs
    gather_sems,  # [2] DMA semaphores: one per workspace half
    *,
    scale: float,
    block_k: int,
    num_ways: int,
    latent_width: int,
    stacked: bool,
    paged: bool,
    planted_bug: PlantedBug,
):
    del hot_ref
    b = pl.program_id(0)
    at = (layer_ref[0], b) if stacked else (b,)  # leading index of every hot / host DMA
    num_miss = num_miss_ref[b]
    num_tiles = read_src_ref.shape[1] // (num_ways * block_k)  # K / block_k per way
    num_steps = num_ways * num_tiles
    d = latent_width

    def load(i):
        token = miss_token_ref[0, i]
        if paged:  # the token's pool page, from the scalar-prefetched page table
            page = host_ref.shape[-2]
            frame = table_ref[b, token // page]
            src = host_ref.at[(*at[:-1], frame, pl.ds(token % page, 1))]
        else:
            src = host_ref.at[(*at, pl.ds(token, 1))]
        return pltpu.make_async_copy(src, miss_buf.at[pl.ds(i, 1)], load_sems.at[i])

    def install(i):
        row = pl.ds(miss_slot_ref[0, i], 1)
        return pltpu.make_async_copy(
            miss_buf.at[pl.ds(i, 1)], hot_out_ref.at[(*at, row)], install_sem
        )

    def ensure_loaded(i):
        @pl.when(loaded_ref[i] == 0)
        def _():
            load(i).wait()
            loaded_ref[i] = 1
            install(i).start()

    # 1. All miss loads start now: they are the slow copies.
    zero_row[...] = jnp.zeros(zero_row.shape, zero_row.dtype)

    def start_load(i, carry):
        loaded_ref[i] = 0
        load(i).start()
        return carry

    lax.fori_loop(0, num_miss, start_load, None)

    # 2. Tiles, canonical order, double-buffered.
    def buffer_of(step):
        return 0 if planted_bug == "reuse_before_wait" else step % 2

    def into_workspace(src, buf, j):
        return pltpu.make_async_copy(src, workspace.at[buf, pl.ds(j, 1)], gather_sems.at[buf])

    def start_hits_and_padding(step):  # phase a: no waiting
        buf, base = buffer_of(step), step * block_k

        def row(j, carry):
            src = read_src_ref[0, base + j]

            @pl.when(src >= 0)
            def _():
                into_workspace(hot_out_ref.at[(*at, pl.ds(src, 1))], buf, j).start()

            @pl.when(src == PADDING)
            def _():
                into_workspace(zero_row, buf, j).start()

            return carry

        lax.fori_loop(0, block_k, row, None)

    def start_misses(step):  # phase b: may wait for the host loads of this tile's misses
        buf, base = buffer_of(step), step * block_k

        def row(j, carry):
            src = read_src_ref[0, base + j]

            @pl.when(src <= MISS_BASE)
            def _():
                i = MISS_BASE - src
                ensure_loaded(i)
                into_workspace(miss_buf.at[pl.ds(i, 1)], buf, j).start()

            return carry

        lax.fori_loop(0, block_k, row, None)

    def wait_tile(step):  # every row of a tile signals its half's semaphore: wait all bytes
        buf = buffer_of(step)
        pltpu.make_async_copy(workspace.at[buf], workspace.at[buf], gather_sems.at[buf]).wait()

    hi = lax.Precision.HIGHEST

    def compute_tile(step, w, carry):
        m_prev, l_prev, acc_prev = carry  # [H, 1], [H, 1], [H, D] float32
        rows = workspace[buffer_of(step)].astype(jnp.float32)  # [block_k, D+R]
        lat, pe = rows[:, :d], rows[:, d:]
        contract_last = (((1,), (1,)), ((), ()))
        s = lax.dot_general(q_lat_ref[w], lat, contract_last, precision=hi)
        s = s + lax.dot_general(q_pe_ref[w], pe, contract_last, precision=hi)
        s = s * scale  # [H, block_k]
        valid = valid_ref[pl.ds(step, 1), :] != 0  # [1, block_k]
        s = jnp.where(valid, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing valid yet: exp(-inf) = 0
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        acc_new = alpha * acc_prev + jnp.dot(p, lat, precision=hi)
        return m_new, l_new, acc_new

    start_hits_and_padding(0)
    start_misses(0)

    h = q_lat_ref.shape[1]

    def way(w, carry):
        def tile(t, state):
            step = w * num_tiles + t
            has_next = step + 1 < num_steps

            @pl.when(has_next)
            def _():
                start_hits_and_padding(step + 1)

            if planted_bug == "read_before_wait":
                state = compute_tile(step, w, state)
                wait_tile(step)
            else:
                wait_tile(step)
                state = compute_tile(step, w, state)

            @pl.when(has_next)
            def _():
                start_misses(step + 1)

            return state

        init = (
            jnp.full((h, 1), -jnp.inf, jnp.float32),
            jnp.zeros((h, 1), jnp.float32),
            jnp.zeros((h, d), jnp.float32),
        )
        _, l, acc = lax.fori_loop(0, num_tiles, tile, init)
        out_ref[w] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
        return carry

    lax.fori_loop(0, num_ways, way, None)

    # 3. Misses nobody read still go to their slots; then every install must have landed.
    def finish(i, carry):
        ensure_loaded(i)
        return carry

    lax.fori_loop(0, num_miss, finish, None)
    if planted_bug != "missing_install_wait":

        def wait_install(i, carry):
            install(i).wait()
            return carry

        lax.fori_loop(0, num_miss, wait_install, None)


def _host_memory_space(host):
    """pl.HOST for a host-memory-kind array (DMAs read host memory), pl.ANY otherwise."""
    if jax.typeof(host).memory_space == jax.memory.Space.Host:
        return pl.HOST
    return pl.ANY


def _read_sources(read_slot, miss_slot, num_miss, *, num_slots):
    """[B, W, K]: slot >= 0 for a hit, PADDING, or MISS_BASE - i where entry reads miss i."""
    b, m = miss_slot.shape
    valid = jnp.arange(m)[None, :] < num_miss[:, None]
    target = jnp.where(valid, miss_slot, num_slots)  # padding misses fall off the end
    slot_to_miss = jnp.full((b, num_slots), -1, jnp.int32)
    slot_to_miss = slot_to_miss.at[jnp.arange(b)[:, None], target].set(
        jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m)), mode="drop"
    )
    flat = jnp.maximum(read_slot, 0).reshape(b, -1)
    miss = jnp.take_along_axis(slot_to_miss, flat, axis=1).reshape(read_slot.shape)
    src = jnp.where(miss >= 0, MISS_BASE - miss, read_slot)
    return jnp.where(read_slot < 0, PADDING, src).astype(jnp.int32)


def copy_sfa(
    q_lat: jax.Array,
    q_pe: jax.Array,
    hot: jax.Array,
    host: jax.Array,
    read_slot: jax.Array,
    miss_token: jax.Array,
    miss_slot: jax.Array,
    num_miss: jax.Array,
    *,
    scale: float,
    layer: jax.Array | int | None = None,
    page_table: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array]:
    """Sparse MLA attention with the misses copied from host into the hot cache in one pass.

    Same contract as `copy_sfa_reference` (see `reference.py`): returns `out [B, W, H, D]`
    float32 and `hot_updated` (`hot`'s shape), the latter written in place into `hot`'s buffer
    (donate `hot` under jit to avoid a copy).

    Args:
      q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss: see the contract.
      scale: the softmax scale (a Python float, baked into the kernel).
      layer: None for per-layer `hot [B, C2, D+R]` and `host [B, S, D+R]`; an int32 scalar
        (may be traced) for stacked `hot [L, B, C2, D+R]` and `host [L, B, S, D+R]`: only that
        layer is read and written, and `hot_updated` is the whole stack, aliased to `hot`.
        Clamped to [0, L) (`check_copy_sfa_inputs` checks it).
      page_table: None for per-request host rows; [B, P] int32 for a page pool `host`
        ([F, Z, D+R], or [L, F, Z, D+R] with a layer): miss token t of request b is read from
        host[page_table[b, t // Z], t % Z]. The table reaches the kernel by scalar prefetch
        (SMEM; B P int32 words, so very long contexts want a per-request block instead).
      block_sizes: the tiling; `BlockSizes.get_default(k=K, interpret=...)` if None.
      interpret: False to compile for a TPU; True or `pltpu.InterpretParams(...)` to run the
        TPU interpreter on CPU.
    """
    return _copy_sfa(
        q_lat,
        q_pe,
        hot,
        host,
        read_slot,
        miss_token,
        miss_slot,
        num_miss,
        scale=scale,
        layer=layer,
        page_table=page_table,
        block_sizes=block_sizes,
        planted_bug=None,
        interpret=interpret,
    )


def _copy_sfa(
    q_lat,
    q_pe,
    hot,
    host,
    read_slot,
    miss_token,
    miss_slot,
    num_miss,
    *,
    scale,
    layer=None,
    page_table=None,
    block_sizes,
    planted_bug: PlantedBug,
    interpret,
):
    """`copy_sfa` with a test-only `planted_bug` (see `PlantedBug`)."""
    static_validate_inputs(
        q_lat, q_pe, hot, host, read_slot, miss_token, miss_slot, num_miss, scale=scale,
        layer=layer, page_table=page_table,
    )
    paged = page_table is not None
    # Pages not held (-1) hold no valid miss: clamp so that no id leaves the pool.
    table = jnp.maximum(page_table, 0) if paged else jnp.zeros((q_lat.shape[0], 1), jnp.int32)
    b, w, h, d = q_lat.shape
    r = q_pe.shape[-1]
    k = read_slot.shape[-1]
    c2 = hot.shape[-2]
    m = miss_token.shape[1]
    stacked = layer is not None
    if stacked:  # [1] int32 for SMEM, clamped like lax.dynamic_index_in_dim: DMAs stay in bounds
        layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, hot.shape[0] - 1).reshape(1)
    else:
        layer = jnp.zeros((1,), jnp.int32)
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(k=k, interpret=bool(interpret))
    block_sizes.validate(k=k, interpret=bool(interpret))
    block_k = block_sizes.block_k
    host_space = _host_memory_space(host)
    if interpret and host_space == pl.HOST:
        raise NotImplementedError(
            "copy_sfa in TPU interpret mode needs `host` in device memory: jax (0.10.2, 0.12) "
            "fails a jit that holds an interpret-mode kernel and an array of another memory "
            f"kind, and host has memory space {jax.typeof(host).memory_space}"
        )

    # SMEM blocks are [1, X] rows of [B, 1, X] arrays: Mosaic wants the last two block dims
    # whole (or (8, 128)-divisible), and a squeezed B would leave only one.
    read_src = _read_sources(read_slot, miss_slot, num_miss, num_slots=c2).reshape(b, 1, w * k)
    valid = (read_slot >= 0).astype(jnp.int32).reshape(b, w * k // block_k, block_k)
    num_miss = jnp.clip(num_miss, 0, m)

    def per_request(*block, memory_space=None):
        index_map = lambda i, *_: (i,) + (0,) * len(block)  # noqa: E731
        return pl.BlockSpec((None, *block), index_map, memory_space=memory_space)

    smem = pltpu.SMEM
    in_specs = [
        per_request(1, w * k, memory_space=smem),  # read_src
        per_request(1, m, memory_space=smem),  # miss_token
        per_request(1, m, memory_space=smem),  # miss_slot
        per_request(w * k // block_k, block_k),  # valid
        per_request(w, h, d),  # q_lat
        per_request(w, h, r),  # q_pe
        pl.BlockSpec(memory_space=host_space),  # host
        pl.BlockSpec(memory_space=pl.ANY),  # hot
    ]
    out_specs = [per_request(w, h, d), pl.BlockSpec(memory_space=pl.ANY)]
    scratch_shapes = [
        pltpu.VMEM((m, d + r), hot.dtype),  # miss_buf
        pltpu.VMEM((2, block_k, d + r), hot.dtype),  # workspace
        pltpu.VMEM((1, d + r), hot.dtype),  # zero_row
        pltpu.SMEM((m,), jnp.int32),  # loaded_ref
        pltpu.SemaphoreType.DMA((m,)),  # load_sems
        pltpu.SemaphoreType.DMA(()),  # install_sem
        pltpu.SemaphoreType.DMA((2,)),  # gather_sems
    ]
    itemsize = hot.dtype.itemsize
    vmem_bytes = (m + 2 * block_k + 1) * (d + r) * itemsize + 2 * 4 * (
        w * k + 2 * w * h * d + w * h * r  # double-buffered valid, q_lat, out, q_pe blocks
    )
    vmem_limit_bytes = None
    if vmem_bytes > _DEFAULT_VMEM_LIMIT_BYTES * 3 // 4:
        vmem_limit_bytes = vmem_bytes * 5 // 4 + (1 << 20)
    cost = pl.CostEstimate(
        flops=2 * b * w * h * k * (2 * d + r),
        transcendentals=b * w * h * k,
        bytes_accessed=itemsize * (d + r) * (b * w * k + 2 * b * m) + 4 * b * w * h * (2 * d + r),
    )
    kernel = functools.partial(
        _copy_sfa_kernel,
        scale=float(scale),
        block_k=block_k,
        num_ways=w,
        latent_width=d,
        stacked=stacked,
        paged=paged,
        planted_bug=planted_bug,
    )
    num_scalar_prefetch = 3  # num_miss, layer, page table
    hot_index = num_scalar_prefetch + 7  # position of `hot` among the call's operands
    out, hot_updated = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalar_prefetch,
            grid=(b,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, w, h, d), jnp.float32),
            jax.ShapeDtypeStruct(hot.shape, hot.dtype),
        ],
        input_output_aliases={hot_index: 1},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=cost,
        interpret=interpret,
        name=f"copy_sfa_{block_k=}",
    )(
        num_miss,
        layer,
        table,
        read_src,
        miss_token.reshape(b, 1, m),
        miss_slot.reshape(b, 1, m),
        valid,
        q_lat,
        q_pe,
        host,
        hot,
    )
    return out, hot_updated

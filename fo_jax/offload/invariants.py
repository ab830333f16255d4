"""Value checks of a DecodeState: what must hold after every offloaded decode step.

These read the whole state to the host (O(L B S)): for tests and a debug flag, never for the
serving loop. Each failed check raises `AssertionError` naming the group, request, slot or token.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig
from fo_jax.model.kv_format import dequantize_kv_rows
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.state import DecodeState, read_back, shared_page_conflict


def check_invariants(state: DecodeState, *, config: ModelConfig, offload: OffloadConfig,
                     resident_kv=None, selected=None, poisoned: bool = False,
                     finite: bool = False, occupied_before=None, seats=None) -> None:
    """Raise AssertionError unless every invariant of the offloaded state holds.

    Checks:
      * page table: every page holding a stored token (t < length) is held (table entry >= 0
        and < F), and no pool page is held twice; every host row below is read through it;
      * slot maps: token_to_slot and slot_to_token are inverse on resident tokens, indices in
        range, no tail token (position >= tail start) holds a slot;
      * every hot-cache row equals its token's row in host pages (every layer of the group);
      * every tail row of a token of the current tail blocks equals its host row;
      * with `resident_kv` [L, B, S', D+R]: host pages equal it on every stored position
        (nothing lost);
      * with `selected` [G, B, W, K] (the last step's selection, from DecodeStats): every
        selected token is resident afterwards, or was served from that step's tail blocks;
      * with `poisoned`: every empty slot holds NaN on every layer (in the fp8_ds_mla format:
        every byte 0xFF, which decodes to NaN);
      * with `finite`: every occupied slot and every tail row of a stored token is finite;
      * with `occupied_before` [G, B] (`occupied_slots` before the last step): no group and
        request has fewer occupied slots now (once full, the cache stays full).
    seats: [B] bool, check only these requests (default all): a serving engine's seat in the
    middle of a prefill holds host pages and indexer keys but no decode rows yet
    (`fo_jax.engine.Engine.prefilling_seats`).
    The jittable twin that runs inside compiled loops is fo_jax.offload.checks.
    Rows are compared as stored (fp8_ds_mla rows byte for byte); NaN and finiteness are those
    of the values the rows hold.
    """
    c, z = offload.hot_slots, offload.page_size
    t2s = np.asarray(state.slots.token_to_slot)
    s2t = np.asarray(state.slots.slot_to_token)
    lengths = np.asarray(state.lengths)
    fp8 = state.hot.dtype == np.uint8  # fp8_ds_mla rows: compared byte by byte
    hot = np.asarray(state.hot).astype(np.float32)
    host = read_back(state.host.kv).astype(np.float32)  # [L, F, Z, D+R]
    table = np.asarray(state.table)
    batch, pages = table.shape
    num_frames = host.shape[1]
    for b in range(batch):
        need = -(-int(lengths[b]) // z)
        bad = np.flatnonzero((table[b, :need] < 0) | (table[b, :need] >= num_frames))
        assert bad.size == 0, (
            f"request {b}: page {bad[:1]} holds stored tokens (length {lengths[b]}) but its "
            f"page table entry is {table[b, bad[:1]]}, not a pool page in [0, {num_frames})")
    clash = shared_page_conflict(table, lengths, z)
    assert clash is None, (f"pool page {clash} is held by two page table entries and one of "
                           "them may write it (a page is shared only as a full prefix page)")
    # Every request's host rows, read through the table: [L, B, S, D+R].
    host_tok = host[:, np.maximum(table, 0)].reshape(host.shape[0], batch, pages * z,
                                                     host.shape[-1])
    tail_start = (lengths // z) * z
    checked = range(batch) if seats is None else np.flatnonzero(np.asarray(seats, bool))
    for g, (lo, hi) in enumerate(config.group_bounds):
        for b in checked:
            tok_of = s2t[g, b]
            slot_of = t2s[g, b]
            occupied = np.flatnonzero(tok_of >= 0)
            assert np.all(tok_of[occupied] < lengths[b]), (
                f"group {g} request {b}: a slot holds a token beyond length {lengths[b]}")
            back = slot_of[tok_of[occupied]]
            bad = occupied[back != occupied]
            assert bad.size == 0, (
                f"group {g} request {b}: slot {bad[:1]} holds token {tok_of[bad[:1]]} whose "
                f"token_to_slot is {slot_of[tok_of[bad[:1]]]}")
            resident = np.flatnonzero(slot_of >= 0)
            assert np.all(slot_of[resident] < c), f"group {g} request {b}: slot id >= {c}"
            fwd = tok_of[slot_of[resident]]
            bad = resident[fwd != resident]
            assert bad.size == 0, (
                f"group {g} request {b}: token {bad[:1]} maps to slot {slot_of[bad[:1]]} "
                f"which holds token {fwd[fwd != resident][:1]}")
            assert resident.size == occupied.size, (
                f"group {g} request {b}: {resident.size} resident tokens but {occupied.size} "
                "occupied slots")
            in_tail = resident[resident >= tail_start[b]]
            assert in_tail.size == 0, (
                f"group {g} request {b}: tail token {in_tail[:1]} also holds a hot slot")
            for layer in range(lo, hi):
                got = hot[layer, b, occupied]
                want = host_tok[layer, b, tok_of[occupied]]
                same = np.all((got == want) | (np.isnan(got) & np.isnan(want)), axis=-1)
                assert np.all(same), (
                    f"layer {layer} request {b}: hot slot {occupied[~same][:1]} differs from "
                    f"host row of token {tok_of[occupied][~same][:1]}")
                if finite:
                    ok = np.all(np.isfinite(_values(got, config, fp8)), axis=-1)
                    assert np.all(ok), (
                        f"layer {layer} request {b}: hot slot {occupied[~ok][:1]} of token "
                        f"{tok_of[occupied][~ok][:1]} holds a non-finite value")
                if poisoned:
                    empty = np.flatnonzero(tok_of < 0)
                    assert np.all(_poisoned(hot[layer, b, empty], fp8)), (
                        f"layer {layer} request {b}: an empty slot holds a non-NaN value")
            if selected is not None:
                sel_all = np.asarray(selected)
                # The step's tail: computed from the length before its W new tokens.
                step_tail = ((lengths[b] - sel_all.shape[2]) // z) * z
                sel = sel_all[g, b].reshape(-1)
                sel = sel[sel >= 0]
                ok = (slot_of[sel] >= 0) | (sel >= step_tail)
                assert np.all(ok), (
                    f"group {g} request {b}: selected token {sel[~ok][:1]} is neither resident "
                    "nor in the tail after the step")
    for b in checked:
        for p in range(int(tail_start[b]), int(lengths[b])):
            row = c + ((p // z) % 2) * z + p % z
            assert np.array_equal(hot[:, b, row], host_tok[:, b, p]), (
                f"request {b}: tail row of token {p} differs from its host row")
            assert not finite or np.all(np.isfinite(_values(hot[:, b, row], config, fp8))), (
                f"request {b}: tail row of token {p} holds a non-finite value")
    if occupied_before is not None:
        now, before = np.sum(s2t >= 0, axis=-1), np.asarray(occupied_before)
        if seats is not None:
            before = np.where(np.asarray(seats, bool)[None], before, 0)
        for g, b in np.argwhere(now < before)[:1]:
            raise AssertionError(f"group {g} request {b}: occupied slots fell from "
                                 f"{before[g, b]} to {now[g, b]}")
    if resident_kv is not None:
        ref = np.asarray(resident_kv).astype(np.float32)
        for b in checked:
            n = int(lengths[b])
            same = (host_tok[:, b, :n] == ref[:, b, :n]) | (
                np.isnan(host_tok[:, b, :n]) & np.isnan(ref[:, b, :n]))
            assert np.all(same), (
                f"request {b}: host pages differ from the resident KV at "
                f"(layer, token) {np.argwhere(~np.all(same, axis=-1))[:1].tolist()}")


def _values(rows: np.ndarray, config: ModelConfig, fp8: bool) -> np.ndarray:
    """The float values stored rows hold (fp8_ds_mla bytes, given as float32, dequantized)."""
    if not fp8:
        return rows
    return np.asarray(dequantize_kv_rows(jnp.asarray(rows.astype(np.uint8)),
                                         kv_lora_rank=config.kv_lora_rank))


def _poisoned(rows: np.ndarray, fp8: bool) -> np.ndarray:
    """Whether every value of the rows is the poison: NaN, or the byte 0xFF in fp8_ds_mla."""
    return rows == 0xFF if fp8 else np.isnan(rows)


def occupied_slots(state: DecodeState) -> np.ndarray:
    """[G, B] number of occupied hot slots."""
    return np.sum(np.asarray(state.slots.slot_to_token) >= 0, axis=-1)

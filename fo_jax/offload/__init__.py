"""FlashOffloading: the authoritative KV in host memory, a hot cache on the device.

Decode: `DecodeState` (host pages, hot cache, cache slots, indexer keys, policy state),
`decode_step` (pure, jitted, state donated), `manage_group` (the LIM logic), `gather_attend`
(the CopySFA logic), `check_invariants` (numpy) and `check_state_jit` (on the device, under
checkify). Prefill: `PrefillState`, `to_decode_state`, and the module
`fo_jax.offload.prefill` whose `prefill` runs the layer buffers and `onload_layer_map` (not
re-exported here: the name would shadow the module), `fo_jax.offload.seat_prefill` whose
`prefill_seat` / `prefill_seats` run it over chosen seats (the engine's prefill);
`layer_schedule` holds the buffer and load rules it runs by, `pipeline_model` simulates their
timing on the copy engines. `host` holds every read and write of host memory, in the way
`OffloadConfig.host_access` chooses. Host KV and indexer keys are page pools addressed by a
per-request page table (`assign_pages` sets a seat's row; `check_table` validates one).
"""

from fo_jax.offload.checks import check_state_jit
from fo_jax.offload.config import OffloadConfig
from fo_jax.offload.decode import DecodeStats, check_state, decode_step, gather_attend
from fo_jax.offload.invariants import check_invariants
from fo_jax.offload.manage import GroupPlan, GroupStats, manage_group
from fo_jax.offload.prefill import PrefillState, to_decode_state
from fo_jax.offload.state import (
    CacheSlots,
    DecodeState,
    HostPages,
    PolicyState,
    assign_pages,
    check_table,
    identity_table,
)

__all__ = [
    "CacheSlots",
    "DecodeState",
    "DecodeStats",
    "GroupPlan",
    "GroupStats",
    "HostPages",
    "OffloadConfig",
    "PolicyState",
    "PrefillState",
    "assign_pages",
    "check_invariants",
    "check_state",
    "check_state_jit",
    "check_table",
    "decode_step",
    "gather_attend",
    "identity_table",
    "manage_group",
    "to_decode_state",
]

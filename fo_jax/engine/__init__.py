"""The serving engine over the pure decode steps.

The jit-compiled decode loop it runs (`decode_loop`: up to N decode steps with on-device
sampling, stop checks and summed statistics in one program) is `fo_jax.decode_loop`, below the
engine, shared with `fo_jax.generate`; sampling is `fo_jax.sampling`. Both are re-exported here.
`fo_jax.engine.engine`: continuous batching over seats (`Engine`), composed of a scheduler
(`fo_jax.engine.scheduler`: queue, admission, preemption), a KV store
(`fo_jax.engine.kv_store`: resident or paged seats, prefix reuse, a seat's rows out and in), the
decode-loop runner (`fo_jax.engine.runner`; with overlap, the decode call in flight and the
device's clock: `fo_jax.engine.overlap`) and the requests' host records
(`fo_jax.engine.requests`).
`fo_jax.engine.settings`: the engine's settings as frozen dataclasses by concern
(`EngineSettings`: `CacheSettings`, `SchedulerSettings`, `SpeculativeSettings`, ...), checked
once; `fo_jax.engine.args`: the command-line flags that build them (`EngineArgs`).
`fo_jax.engine.data_parallel`: R engines on R devices behind one request stream
(`DataParallelEngine`), each request placed on a rank by a `fo_jax.placement` rule.
`fo_jax.engine.sharded`: one engine over every data-parallel rank of a mesh, each step one
prefill program per round and one decode program over all ranks (`ShardedEngine`: resident,
or a host pool per rank; the MoE experts split over the devices in the all-to-all layout).
`fo_jax.engine.auto`: automatic offload (`AutoEngine`): short resident seats while a request
fits them, offloaded seats once it outgrows them, and back when a short seat frees (lossless
moves).
`fo_jax.engine.pages`: host-side page bookkeeping: a page pool with reference counts
(`PagePool`), a prefix cache of full pages (`PrefixCache`), each request's pages and page-table
row (`RequestPages`).
`fo_jax.engine.prefix`: prefix reuse, one object per engine with one interface (`PrefixReuse`:
`PagedPrefix` maps cached pages, `ResidentPrefix` copies cached rows), over the two stores below.
`fo_jax.engine.resident_prefix`: prefix reuse on the resident path: whole chunks of earlier
prompts' KV rows, copied into a new request's seat (`ResidentPrefixStore`).
`fo_jax.engine.mtp_prefix`: with MTP drafts and the prefix cache, the MTP layer's rows of the
cached chunks, kept beside the main cache and copied into a new request's MTP state
(`MTPPrefixStore`).
`fo_jax.engine.costs`: the planner's bytes per seat and per page (`MemoryCosts`), which the
scheduler charges its device budget with.
`fo_jax.engine.metrics`: counters summed on the device, read every N steps into JSON lines
(`MetricsLog`), and their Prometheus families.
"""

from fo_jax.engine.args import EngineArgs
from fo_jax.engine.auto import AutoEngine
from fo_jax.engine.costs import MemoryCosts
from fo_jax.engine.data_parallel import DataParallelEngine
from fo_jax.engine.engine import Engine, RequestOutput, TokenLogprobs
from fo_jax.decode_loop import (
    LoopOutput,
    LoopStats,
    MTPSeats,
    OffloadedStep,
    ResidentStep,
    Seats,
    decode_loop,
    mtp_feed,
)
from fo_jax.engine.metrics import MetricsLog
from fo_jax.engine.pages import NO_PAGE, PagePool, PoolExhausted, PrefixCache, RequestPages
from fo_jax.engine.mtp_prefix import MTPPrefixStore
from fo_jax.engine.prefix import PagedPrefix, PrefixReuse, ResidentPrefix
from fo_jax.engine.resident_prefix import ResidentPrefixStore
from fo_jax.engine.scheduler import RequestRefused
from fo_jax.engine.sharded import ShardedEngine
from fo_jax.sampling import Sampling, sample_tokens
from fo_jax.engine.settings import (
    CacheSettings,
    EngineSettings,
    MetricsSettings,
    ProgramSettings,
    RequestSettings,
    SchedulerSettings,
    SpeculativeSettings,
)

__all__ = ["AutoEngine", "CacheSettings", "DataParallelEngine", "Engine", "EngineArgs",
           "EngineSettings", "LoopOutput", "LoopStats", "MTPPrefixStore", "MTPSeats",
           "MemoryCosts", "MetricsLog", "MetricsSettings", "NO_PAGE", "OffloadedStep", "PagePool",
           "PagedPrefix", "PoolExhausted", "PrefixCache", "PrefixReuse", "ProgramSettings",
           "RequestOutput", "RequestPages", "RequestRefused", "RequestSettings", "ResidentPrefix",
           "ResidentPrefixStore", "ResidentStep", "Sampling", "SchedulerSettings", "Seats",
           "ShardedEngine", "SpeculativeSettings", "TokenLogprobs", "decode_loop", "mtp_feed",
           "sample_tokens"]

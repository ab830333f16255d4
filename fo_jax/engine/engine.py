"""Continuous batching: requests join and leave a fixed set of seats while others decode.

    engine = Engine(params, config, seats=8, capacity=4096, offload=OffloadConfig(...))
    rid = engine.add_request(prompt_ids, max_tokens=64, temperature=0.0, stop_token_ids=[eos])
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput per request that moved
            print(out.request_id, out.new_token_ids, out.finished, out.finish_reason)

The engine owns one batch state of `seats` requests (the offloaded `DecodeState`, or the
resident `ResidentState` with `offload=None`), sized once: requests come and go without
recompiling. Each `step()`:

  1. admits waiting requests into free seats, in queue order (`order`: "fifo", or
     "shortest" prompt + max_tokens first; preempted requests before either), stopping at the
     first that does not fit (no overtaking). Offloaded, the seats share one pool of
     `num_pages` pages (host KV and indexer keys, `fo_jax.offload` page tables): a request is
     admitted once the pool can reserve its pages (`reserve`, below) and, with `device_bytes`,
     once its device bytes fit the budget (the planner's arithmetic,
     `fo_jax.engine.admission.MemoryCosts`: hot cache and tails per occupied seat + indexer
     keys per page held (+ the page's KV rows when the pool lives on the device, below) +
     prefill layer buffers per prompt page while prefilling; counted
     from the pool's held pages, so a shared prefix page counts once, where the
     `fo_jax.engine.admission.Admission` ledger, not used here, charges it per request); a request
     that could not fit even alone (pool or device bytes) is refused by `add_request` with the
     figures. With `prefix_cache`, the longest cached prefix of whole prefill chunks of its
     prompt is mapped from earlier requests' pages (`fo_jax.engine.pages.PrefixCache`) and not
     prefilled again; resident, the seats' KV is apart, so those rows are copied into the seat
     from a prefix store of whole chunks (`fo_jax.engine.resident_prefix`: the same chain
     hash, a byte budget, least recently released first eviction; one program of O(L prefix)
     rows). The seat's length starts at the cached tokens (what the previous occupant left in
     the seat is never read: reads stop at the length);
  2. runs one prefill chunk for every seat that is prefilling (one program for all of them,
     `prefill_chunk` tokens per seat; the others take 0 tokens and are not written); a seat
     whose prompt is complete samples its first token from the chunk's logits and joins the
     decode batch (`fo_jax.offload.prefill.join_seats`: its hot rows, maps and policy state);
     resident with the prefix cache, the chunks the program completed are copied into the
     prefix store (one program for all seats; blocks already cached are not); with MTP drafts
     and the prefix cache, their MTP rows too, once fed (`fo_jax.engine.mtp_prefix`);
  3. (reserve="prompt") grows the decoding requests' pages for the call, preempting the
     youngest request when they cannot be had (below);
  4. runs `decode_steps_per_call` decode steps of the running seats in one program
     (`fo_jax.engine.loop.decode_loop`: sampling, stop tokens, max_tokens and capacity on the
     device), then reads the new tokens once, applies text stop strings, and frees the seats
     of finished requests.

A request's tokens never depend on what else is in the batch: every program has the same
shapes whoever sits in the other seats ([seats, prefill_chunk] prefill chunks cut at the same
offsets of each prompt, [seats, 1] decode steps), every row is computed from its own state
alone, inactive seats are never written, and each request samples with its own PRNG key
(`seed`). So a request's greedy tokens equal those of the same engine serving it alone, and,
offloaded, those of the resident engine (tests/engine/test_engine.py checks both, bit for
bit, over random arrival, cancel, prefix-sharing and preemption schedules).

Costs per step: admission and bookkeeping O(seats) on the host; a prefill chunk is one
[seats, prefill_chunk] program over every seat (the offloaded one loads
`history_pages` pages per seat and layer: the longest history among the prefilling seats,
rounded up to a power of two so that a prompt of n chunks compiles O(log n) programs); a
join is O(L seats (C + 2Z)) device work (a request resumed with its pages dropped adds one
decode step per token it replays; one that kept them, none); the decode loop reads its
outputs once per call; the queue is sorted once per step with free seats (O(Q log Q));
`device_bytes_used()` is O(seats).
A finished or cancelled request's pages return to the pool at once (the ones the prefix cache
registered stay cached, mapped by none, until an allocation needs them: least recently
released first).

Reservation and preemption (offloaded). reserve="full" (default) reserves pages for prompt +
max_tokens at admission: a running request never needs a page, nothing is preempted, and a
request that does not fit waits. reserve="prompt" reserves the prompt and one decode call
(`decode_steps_per_call` tokens) and, before every decode call, grows each decoding request's
pages for that call, oldest first. When they cannot be had, what is short decides:

  * pool pages (the pool cannot give them even after evicting unreferenced prefix-cache
    pages, least recently released first: what every allocation does): keeping a victim's
    pages would not help, so pages are dropped: first those that waiting preempted requests
    kept (below), youngest first (they hold pages nobody decodes with, where a running
    request's are in use), then those of the youngest running request (admitted or resumed
    last, as in vLLM), which is preempted;
  * only device bytes (`device_bytes`; the pool has the pages): the youngest running request
    is preempted keeping its pages: its seat's bytes (hot cache and tails, and its prefill
    buffers while prefilling) are freed, its host KV and indexer-key pages stay held (their
    bytes still count). When the growing request is alone in the seats, nothing is left to
    preempt: the pages waiting requests kept are dropped, youngest first.
  * device bytes with the pool on the device (`OffloadConfig(host_memory_kind="device")`:
    the paged KV on the device, each page held counting its KV rows as device bytes too):
    device bytes and pool pages are the same memory, so a shortage of bytes is one of
    pages: the pages waiting requests kept are dropped first (youngest first), then the
    youngest running request is preempted, keeping its pages only when freeing its seat's
    bytes covers what is short (keeping them then costs no more than the preemption frees;
    else keeping them would hold the very bytes the growing request needs, and a round
    more would drop them anyway), else dropping them.

A preempted request keeps its sampled tokens and PRNG key (no token is lost or changed) and
waits at the head of the queue (preempted requests first, in arrival order). One that kept
its pages resumes when a seat is free, the pool can give the pages of the coming decode call
(its own and the running requests': else that call would preempt it again at once) and its
seat bytes + those pages fit `device_bytes`, with nothing computed again: the
offloaded decode writes every step's KV rows through to the host pages, so its pages hold
every token it stored; its length and page-table row are set, `join_seats` rebuilds its hot
rows, tails, maps and policy state from them, and its last token, key and count of tokens
generated are restored (one preempted while prefilling goes on from the chunk it reached).
The hot cache decides where rows are read from, never their values, so its tokens are those
of its uninterrupted run, bit for bit. One whose pages were dropped prefills its prompt again
(with the prefix cache, its prompt's whole chunks are mapped again unless evicted meanwhile)
and then replays its sampled tokens but the last through the decode step, one per step, with
its own tokens forced: the KV it rebuilds is the one it had, bit for bit. Prefilling prompt +
sampled tokens in chunks would be cheaper (one program per chunk instead of one step per
token) but is not bitwise on CPU: XLA rounds a [chunk]-row matmul differently from a 1-row one,
so a token's KV and logits computed by a prefill chunk differ in their last bits from the
decode step's (measured on the tiny model, 3 prompts x 3 resume points: the last position's
logits differed in 9 of 9, the KV in 1 of 9; a bare jitted x @ w of 8 rows against each row
alone differs too, e.g. float32 [8, 256] @ [256, 512] by 4e-5; the greedy tokens happened to
agree), and the resumed request could then sample other tokens than its solo run.

The engine always progresses. The oldest running request always gets its pages: while they
are short, every round removes a running request younger than it or a waiting request's kept
pages (finitely many), and once it is alone in the seats with no kept pages waiting, every
page held is its own and it fits (`add_request` refused any request whose seat, prefill
buffers and pages for prompt + max_tokens do not fit alone, the pages' KV rows counted when
the pool is on the device). With the pool on the device a victim that keeps its pages
leaves the growing request short of nothing (its seat's bytes covered the shortfall), and
its kept pages are the first thing dropped in a later round: the argument is unchanged.
Kept pages never block the queue for good: when its head does not fit and no seat is
occupied (nothing would ever free them), the pages the other waiting requests kept are
dropped, youngest first, until it fits (it fits alone); while a request runs, it ends and
frees its seat and pages. New requests
never overtake preempted ones, so every request runs. A request can be preempted again after
it resumes (under a tight device budget, a request that kept its pages may be preempted
again by a later call's growth: it loses no work, only its join).
`counters["preemptions"]` counts every preemption, `counters["preemptions_kept_pages"]` those
that kept the pages, `counters["resumed_without_recompute"]` the resumes with kept pages, and
`counters["replayed_tokens"]` the tokens replayed after dropped pages.

Drafts (`num_drafts=D > 0`, `drafter="ngram"`): the decode loop verifies D n-gram drafts per
request and step (steps of [seats, D + 1] ways; see `fo_jax.engine.loop`), drafted from each seat's history
(prompt + sampled tokens, [seats, capacity] on the device, set at its join and appended to by
the loop): a greedy request keeps the drafts its greedy tokens confirm, a sampled one
(temperature > 0) the ones speculative sampling accepts (`fo_jax.engine.loop.
speculative_tokens`: its tokens follow the same distribution as without drafts, but are other
random draws than a num_drafts=0 engine's for the same seed). Every program still has the same
shapes whoever sits in the other seats and each request draws from its own key, so a
request's tokens equal those of the same engine serving it alone, bit for bit; greedy ones
equal a num_drafts=0 engine's up to a near-tie of the two largest logits (a W-way step's
logits differ from a W = 1 step's in the last bits on CPU). A resumed request replays its
tokens in the groups its W-way steps stored them (one W-way step per group, the rest rolled
back), so its KV is the one it had, bit for bit. With reserve="prompt", a call may store up to
`decode_steps_per_call` x (D + 1) tokens per request, and that is what is grown before it.

MTP drafts (`drafter="mtp"`, `mtp=` the model's MTP parameters): the drafts come from the
model's multi-token-prediction layer on the device instead (`decode_loop(..., mtp=...)`, the
rule of `fo_jax.drafting.MTPDrafter`). The engine keeps one MTP layer state for all seats
([1, seats, capacity, D+R] KV rows + indexer keys: one main layer's worth, allocated once,
not counted in `device_bytes`) and each seat's next draft. Each prefill chunk returns the
main model's hidden states too and feeds the chunk's pairs (h_i, t_{i+1}) to the prefilling
seats' MTP state (one [seats, prefill_chunk] MTP program; a prompt's last pair takes its first
sampled token, so the first draft after the prefill is right); a seat's MTP state starts empty
at admission. A preempted request's seat MTP state (O(length) rows of one layer: 1/L of its
KV) is copied to the host and written back when it resumes, with its pages kept or dropped
(the replay rebuilds the main KV only): nothing is recomputed, and its drafts, hence its W-way
steps, are those of its uninterrupted run, so its tokens are too, bit for bit; a request moved
by `AutoEngine` carries its MTP state the same way. With `prefix_cache`, a prefix mapped from
the cache is not prefilled, so the hidden states its MTP pairs need do not exist: its MTP rows
come from the cache too (`fo_jax.engine.mtp_prefix.MTPPrefixStore`, beside the main cache: the
MTP rows of each cached prefill chunk, keyed by the chunk's chain hash and the token after it,
which its last pair took). They are a function of the tokens up to and including that next
token, computed by the same chunk programs, so they are those the request's own prefill would
compute, bit for bit (a pair recomputed alone would differ in the last bits on CPU: never
done). A request maps the longest prefix of whole chunks whose main blocks and MTP blocks are
all cached with its own next tokens (a prefix followed by another token than the stored one
maps a chunk fewer, prefills that chunk and stores its MTP rows for its token: the latest
replaces the block), and one program copies the MTP rows into its seat's MTP state, whose
length starts at the cached tokens. After each prefill chunk (and its feed), the chunks it
completed store their MTP rows, where the main cache holds them; a block is dropped with its
chunk's last main page, so the MTP rows count in the cache's budget: resident, in the prefix
store's block bytes (`prefix_cache_bytes`); offloaded, in a page's bytes with
`host_pool_bytes` (they live in the host pages' memory: one host-to-device move of the prefix's
MTP rows per admission, 1/L of the main KV of the same tokens).

Log-probabilities (`add_request(logprobs=k)`): each token a request samples comes with its
log-probability and the k most likely tokens' (`RequestOutput.logprobs`), of the raw model
distribution (log_softmax of the logits it was sampled from, before temperature and top_p, as
vLLM returns them by default), computed on the device by the program that samples it: the
first token's by the join's sampling program, the others' by the decode loop
(`decode_loop(..., logprobs=max_logprobs)`, another program, run only while a seated request
asks for them; [seats, steps, max_logprobs + 1] values and ids read once per call). The tokens
are those the programs without them sample, bit for bit, for every request of the batch.
Tokens a text stop string drops drop their logprobs too; a preempted request keeps them with
its tokens. Not with drafts (refused by `add_request`).

Three ways to hold the KV. Resident (`offload=None`): fixed seats of `capacity` contiguous
rows, sized once: the fastest path for a batch that fits; nothing in it can run out
mid-decode, so admission by bytes, reserve="prompt" and preemption have nothing to do there
(`device_bytes`, `reserve`, `num_pages` are refused with a message saying so). The paged
device pool (`OffloadConfig(host_memory_kind="device")`): the offloaded engine with its page
pool in device memory; device bytes follow the pages requests hold (the pool itself is one
array of `num_pages` pages, allocated once, as vLLM's block pool: size it to the budget),
with admission, reserve="prompt" and preemption by `device_bytes` as above. Offloaded
(`host_memory_kind="pinned_host"`): the same engine with the pool in host memory; the device
holds the seats' hot caches and the indexer-key pages.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax import resident
from fo_jax.config import ModelConfig
from fo_jax.engine.loop import (
    MTPSeats,
    OffloadedStep,
    ResidentStep,
    Sampling,
    Seats,
    _check_sampling_values,
    decode_loop,
    mtp_feed_jit,
    sample_tokens,
    token_logprobs,
)
from fo_jax.offload import prefill as offload_prefill
from fo_jax.offload.config import OffloadConfig
from fo_jax.engine.admission import MemoryCosts, RequestRefused
from fo_jax.engine.metrics import MetricsLog
from fo_jax.engine.mtp_prefix import MTPPrefixStore, mtp_block_bytes
from fo_jax.engine.pages import NO_PAGE, PagePool, PoolExhausted, PrefixCache, RequestPages
from fo_jax.engine.resident_prefix import ResidentPrefixStore
from fo_jax.engine.settings import (DEFAULT_PREFILL_CHUNK, DRAFTERS, MAX_LOGPROBS,
                                    EngineSettings)
from fo_jax.offload.host import in_host_memory, load_history, write_back_rows
from fo_jax.offload.state import (DecodeState, committed, read_pool_keys,
                                  write_pool_keys)

FINISH_REASONS = ("stop", "length", "cancelled")


class TokenLogprobs(NamedTuple):
    """One sampled token's log-probability (`add_request(logprobs=k)`).

    Attributes:
      token_id: the token sampled.
      logprob: its log-probability under the raw model distribution (log_softmax of the
        logits it was sampled from, before temperature and top_p: vLLM's default).
      top: the k most likely tokens, ((id, logprob), ...) in descending order (ties: the lower
        id first); the sampled token is among them only if it is one of the k.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]

# Text stop strings per request and characters per string: each step searches the new text
# for every one, and a server streaming the text holds back the longest one's length - 1
# characters (a stop string of 100k characters streamed nothing until the end).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
SEEDS = (-2**63, 2**63)  # jax.random.key takes an int64


def _token_ids(ids, vocab: int, what: str) -> np.ndarray:
    """`ids` (ints: Python or numpy integers, not bools) as an int32 array, each checked in
    [0, vocab) before any cast: an id past int64 is named, not an OverflowError, and 1.5 is
    refused, not truncated to 1. Raises ValueError naming the first bad one. O(len(ids))."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            raise ValueError(f"{what} {ids[bad[0]]} at position {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        return ids.astype(np.int32)
    try:
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
    except TypeError:
        raise ValueError(f"{what}s must be a sequence of token ids, got "
                         f"{type(ids).__name__} {ids!r}") from None
    for i, t in enumerate(ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)):
            raise ValueError(f"{what} {t!r} at position {i} is not an int (token ids are ints "
                             f"in [0, {vocab}))")
        if not 0 <= t < vocab:
            raise ValueError(f"{what} {t} at position {i} is outside the vocabulary "
                             f"[0, {vocab})")
    return np.asarray(ids, np.int32)


@dataclasses.dataclass
class RequestOutput:
    """What a request produced so far (returned by `Engine.step` for each request that moved).

    Attributes:
      request_id: the id `add_request` returned.
      new_token_ids: tokens sampled in this step.
      token_ids: every token sampled so far (a stop token included; text stops cut `text` only).
      text: the decoded output (with a tokenizer), cut before a text stop string; else None.
      finished: no more tokens will come.
      finish_reason: None while running; "stop" (a stop token or stop string), "length"
        (max_tokens, or the seat's capacity), or "cancelled".
      prompt_tokens: the prompt's length.
      time_to_first_token: seconds from `add_request` to the first token (None before it).
      time_per_output_token: mean seconds between its tokens after the first (None before the
        second token): tokens of one decode call arrive together, so with N steps per call
        this is the call's time over N.
      logprobs: with `add_request(logprobs=k)`, one `TokenLogprobs` per token of token_ids
        (so far); else None.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    time_to_first_token: float | None
    time_per_output_token: float | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: np.ndarray
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    arrival: float
    seat: int | None = None
    prefilled: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    pages: Any = None  # RequestPages (offloaded path): the pool pages the request maps
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled)
    order: int = 0  # arrival number: the queue's tie-break
    admitted: int = -1  # admission (or resume) number: the youngest is preempted first
    preempted: bool = False  # waiting to resume (its tokens kept; `pages` None: dropped)
    key_data: Any = None  # its PRNG key data when preempted after sampling (restored on resume)
    groups: list[int] = dataclasses.field(default_factory=list)  # with drafts: tokens yielded
    # by each decode step (a replay feeds the same groups: the same W-way programs)
    queued_at: int = 0  # the engine step it arrived at (aging of order="shortest")
    mtp_saved: Any = None  # MTP drafts: its seat's MTP rows when preempted (`_save_mtp`)
    mtp_blocks: Any = None  # MTP drafts + prefix cache: its mapped prefix's MTP rows (admitted)
    top_logprobs: int | None = None  # logprobs=k: k top tokens per token; None: no logprobs
    logprobs: list | None = None  # with top_logprobs: one TokenLogprobs per token of `tokens`

    def output(self, new: list[int]) -> RequestOutput:
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        tpot = None
        if len(self.tokens) > 1 and self.last_token_at is not None:
            tpot = (self.last_token_at - self.first_token_at) / (len(self.tokens) - 1)
        return RequestOutput(self.request_id, list(new), list(self.tokens), self.text,
                             self.finish_reason is not None, self.finish_reason,
                             len(self.prompt), ttft, tpot,
                             None if self.logprobs is None else list(self.logprobs))


@jax.jit
def _set_lengths(lengths, mask, values):
    """lengths [B] with the seats of `mask` set to `values` (a request starts there)."""
    return jnp.where(mask, values, lengths)


@jax.jit
def _set_rows(table, mask, rows):
    """The page table [B, P] with the rows of the seats of `mask` set to `rows`."""
    return jnp.where(mask[:, None], rows, table)


@jax.jit
def _set_keys(keys, mask, data):
    """Per-seat keys [B] with the seats of `mask` set to the key data `data` [B, ...]."""
    new = jnp.where(mask.reshape((-1,) + (1,) * (data.ndim - 1)), data,
                    jax.random.key_data(keys))
    return jax.random.wrap_key_data(new, impl=jax.random.key_impl(keys))


@functools.partial(jax.jit, static_argnames=("logprobs",))
def _first_tokens(logits, last, keys, fresh, mask, sampling: Sampling, *,
                  logprobs: int | None = None):
    """Each joining seat's first token, sampled from its last prompt position's logits with a
    fresh key (key data `fresh` [B, ...] where `mask`); other seats' keys stay: (tokens [B],
    keys, log-probabilities). With logprobs=K (static), the tokens' and the K most likely
    tokens' log-probabilities ([B, K + 1] values and ids, `token_logprobs`), else None.
    O(B V)."""
    picked = logits[jnp.arange(logits.shape[0]), last]  # [B, V]
    data = jnp.where(mask.reshape((-1,) + (1,) * (fresh.ndim - 1)), fresh,
                     jax.random.key_data(keys))
    keys = jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))
    tokens, keys = sample_tokens(picked, keys, sampling, mask)
    lp = None if logprobs is None else token_logprobs(picked, tokens, logprobs)
    return tokens, keys, lp


def _logprob_rows(values, ids, top: int) -> list[TokenLogprobs]:
    """TokenLogprobs of rows of `token_logprobs` output (host arrays [T, K + 1]), the first
    `top` of the K most likely tokens kept."""
    return [TokenLogprobs(int(i[0]), float(v[0]),
                          tuple(zip(i[1:top + 1].tolist(), v[1:top + 1].tolist())))
            for v, i in zip(values, ids)]


def claim_request_id(request_id, ids, taken) -> str:
    """A request's id: `request_id` checked (a non-empty string not in `taken`), or, for None,
    the next "req-N" of the counter `ids` not in `taken`. Raises ValueError before anything
    is queued. O(1) per id tried."""
    if request_id is None:
        request_id = f"req-{next(ids)}"
        while request_id in taken:
            request_id = f"req-{next(ids)}"
    elif not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r} must be a non-empty string")
    elif request_id in taken:
        raise ValueError(f"request_id {request_id!r} is already in use (queued, running or "
                         "finished and not yet collected)")
    return request_id


def _next_power_of_two(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


class Engine:
    """Continuous batching over `seats` seats of `capacity` tokens each (see the module doc).

        Engine(params, config, EngineSettings(cache=CacheSettings(seats=8, capacity=4096)))
        Engine(params, config, seats=8, capacity=4096)      # the same, flat keywords

    Args:
      params, config: the model.
      settings: an `EngineSettings` (`fo_jax.engine.settings`: the settings below grouped by
        concern), or None to build it from the keywords below (`EngineSettings.create`).
      tokenizer, mtp: as below (objects, not settings).
      seats: requests decoded at once (the batch of every program).
      capacity: tokens per seat (prompt + output); with `offload`, its `capacity` is used and
        must equal this when both are given.
      offload: OffloadConfig for the offloaded path, or None for the resident path.
      decode_steps_per_call: decode steps per program (1 keeps per-token latency; more means
        fewer host round trips per token).
      prefill_chunk: prompt tokens per seat and prefill program (at most max(capacity, 256):
        a longer chunk would only pad).
      tokenizer: anything with `decode(ids) -> str`; needed for text stop strings and `text`.
      max_stop_ids: stop token ids per request (fixed so that the programs' shapes are).
      query_block: the prefill's query blocks (the same for both paths: bitwise equal).
      num_pages: offloaded: pages of `offload.page_size` tokens in the shared host-KV and
        indexer-key pools (default seats x capacity / page_size: every seat full at once).
      host_pool_bytes: offloaded: size the pools in bytes of host KV instead (the planner's
        bytes per page, `fo_jax.engine.admission.MemoryCosts`; as vLLM's host pool setting;
        with drafter="mtp" and prefix_cache, + a page's MTP rows, `mtp_block_bytes`).
      prefix_cache: reuse the prefixes of earlier prompts, whole prefill chunks of them (a
        reused prefix ends where a chunk ends, so the rest of the prompt is computed exactly
        as from scratch: the KV rows and tokens do not change, bit for bit). Offloaded: map
        their cached pages (needs prefill_chunk a multiple of page_size). Resident: copy their
        rows into the seat from a prefix store (`fo_jax.engine.resident_prefix`) of blocks of
        one prefill chunk (needs prefill_chunk < capacity). With drafter="mtp", the MTP
        layer's rows of the cached chunks are kept and reused too (module doc).
      prefix_cache_bytes: resident: the prefix store's bytes of KV rows and indexer keys
        (`block_bytes(config, prefill_chunk, mtp=drafter == "mtp")` per block; whole blocks;
        least recently released blocks evicted first). Default: one seat's blocks
        (capacity // prefill_chunk).
      prefix_cache_memory: resident: where the store's blocks live: "device" (default: the
        copy into a seat is one device program; the store counts on the device budget) or
        "pinned_host" (off the device budget; one host-to-device move of the prefix rows per
        admission).
      metrics_path: append a JSON line of counters here every `metrics_every` steps
        (`fo_jax.engine.metrics.MetricsLog`, kept as `self.metrics`; counters are summed on
        the device between reads). A caller may set `self.metrics` to its own log instead.
      device_bytes: offloaded: the device budget of request state, the planner's arithmetic
        (`MemoryCosts`): hot cache and tails per running seat + indexer keys per page held
        (+ its KV rows with the pool on the device, `host_memory_kind="device"`) + prefill
        layer buffers per prompt page while prefilling (weights and activations not
        counted). A request that can never fit it is refused by `add_request`; one that does
        not fit now waits. None: no device limit beyond the seats and the pool.
      order: the waiting queue: "fifo" (arrival order) or "shortest" (by prompt + max_tokens,
        ties by arrival). Either way admission stops at the first request that does not fit
        (no overtaking) and preempted requests come first.
      max_wait_steps: order="shortest" only: a request that has waited this many engine
        steps goes ahead of every request that has not (those that did, in arrival order), so
        a long request does not wait for ever under a steady stream of shorter ones. None: no
        aging (it can).
      reserve: offloaded: "full" reserves pages for prompt + max_tokens at admission (a running
        request never needs a page: no preemption); "prompt" reserves the prompt and the next
        decode call, and grows each running request's pages before every decode call,
        preempting the youngest running request when they cannot be had: dropping its pages
        when the pool is short, keeping them (its seat freed) when only device_bytes is (with
        the pool on the device, only when freeing its seat covers the bytes; see the module
        doc).
      num_drafts: D >= 0 drafts per request and decode step, verified on the device
        (`decode_loop(..., num_drafts=D)`: steps of W = D + 1 <= config.max_ways ways;
        greedy requests keep the confirmed drafts, sampled ones do speculative sampling);
        0: one token per step.
      drafter: with num_drafts > 0, "ngram" (prompt lookup in each seat's history, prompt +
        sampled tokens, kept on the device) or "mtp" (the model's multi-token-prediction
        layer, `mtp` its parameters: each seat's MTP state is kept on the device; with
        prefix_cache, a mapped prefix's MTP rows come from the cache; see the module doc).
      mtp: drafter="mtp": the MTP parameters (`load_checkpoint(..., mtp=True)` or
        `fo_jax.model.mtp.init_mtp_params`) of a config with num_nextn_predict_layers >= 1.
      max_logprobs: the most top tokens a request's logprobs may list (`add_request(
        logprobs=k)`, k <= max_logprobs): while some request asks for logprobs, the programs
        compute this many (one program whatever k; default min(20, vocab_size), vLLM's).
    Raises:
      ValueError: bad settings, before anything is allocated.
    """

    def __init__(self, params, config: ModelConfig, settings: EngineSettings | None = None, *,
                 tokenizer=None, mtp: dict | None = None, **kwargs):
        if settings is None:
            settings = EngineSettings.create(**kwargs)
        elif kwargs:
            raise TypeError(f"Engine(params, config, settings) takes no other settings, got "
                            f"{sorted(kwargs)}: put them in the EngineSettings")
        settings = settings.for_model(config, mtp=mtp)
        self.settings = settings
        cache, sched, spec = settings.cache, settings.scheduler, settings.speculative
        programs = settings.programs
        offload = cache.offload
        self.params, self.config, self.offload = params, config, offload
        self.seats, self.capacity = int(cache.seats), int(cache.capacity)
        self.n_steps, self.chunk = int(sched.decode_steps_per_call), int(sched.prefill_chunk)
        self.tokenizer, self.max_stop_ids = tokenizer, int(settings.requests.max_stop_ids)
        self.query_block, self.num_buffers = programs.query_block, programs.num_buffers
        self.pool = self.prefix = None
        self.max_pages = 1  # P, page-table row width (offloaded; unused on the resident path)
        self.prefix_store = None
        if offload is None and cache.prefix_cache:
            self.prefix_store = ResidentPrefixStore.for_engine(
                config, prefill_chunk=self.chunk, capacity=self.capacity,
                size=cache.prefix_cache_bytes, memory=cache.prefix_cache_memory,
                mtp=spec.drafter == "mtp")
        self.max_logprobs = int(settings.requests.max_logprobs)
        self.num_drafts = int(spec.num_drafts)
        self.drafter, self.mtp = spec.drafter, mtp
        self.order, self.reserve = sched.order, sched.reserve
        self.max_wait_steps = sched.max_wait_steps
        self.device_bytes = None if sched.device_bytes is None else int(sched.device_bytes)
        self.costs = None  # MemoryCosts (offloaded): the planner's bytes per seat and page
        prefix_cache, num_pages = cache.prefix_cache, cache.num_pages
        if offload is not None:
            z = offload.page_size
            self.max_pages = self.capacity // z
            num_buffers = self.num_buffers
            self.costs = MemoryCosts.from_config(
                config, page_size=z, hot_slots=offload.hot_slots,
                num_buffers=min(4, config.num_layers) if num_buffers is None else num_buffers,
                pool_memory=offload.host_memory_kind)
            if cache.host_pool_bytes is not None:  # the planner's bytes of one page
                page_bytes = self.costs.page_host_bytes
                if prefix_cache and self.drafter == "mtp":  # + its MTP rows
                    page_bytes += mtp_block_bytes(config, z)
                num_pages = int(cache.host_pool_bytes) // page_bytes
                if num_pages < 1:
                    mtp_layer = (" and the MTP layer" if prefix_cache and self.drafter == "mtp"
                                 else "")
                    raise ValueError(f"host_pool_bytes={cache.host_pool_bytes} holds no page of "
                                     f"{z} tokens ({page_bytes} bytes over {config.num_layers} "
                                     f"layers{mtp_layer}): raise it")
            num_pages = self.seats * self.max_pages if num_pages is None else num_pages
            self.pool = PagePool(int(num_pages), z)
            self.prefix = PrefixCache(self.pool) if prefix_cache else None
        implementation, interpret = programs.implementation, programs.interpret
        if offload is None:
            self.state = committed(resident.ResidentState.create(config, batch=self.seats,
                                                                 capacity=self.capacity))
            self.step_fn = ResidentStep(config, implementation or "xla", interpret)
        else:
            self.state = DecodeState.create(
                config, offload, batch=self.seats, num_frames=self.pool.num_pages,
                table=np.full((self.seats, self.max_pages), NO_PAGE, np.int32))
            self.step_fn = OffloadedStep(config, offload, implementation or "xla", interpret)
        batch = self.seats
        # Every array the programs take is committed to the device, as the programs' outputs
        # are: a mix of committed and uncommitted inputs would compile them again.
        self._seats = committed(Seats(tokens=jnp.zeros((batch,), jnp.int32),
                                      keys=jax.random.split(jax.random.key(0), batch),
                                      generated=jnp.zeros((batch,), jnp.int32),
                                      done=jnp.ones((batch,), bool)))
        self._key_shape = tuple(jax.random.key_data(jax.random.key(0)).shape)
        # With n-gram drafts: each seat's prompt + sampled tokens [seats, capacity], set at its
        # join. With MTP drafts: the MTP layer's state and each seat's next draft, fed with
        # the prompt's pairs by the prefill (`_feed_mtp`).
        self._history = (committed(jnp.zeros((batch, self.capacity), jnp.int32))
                         if self.num_drafts and self.mtp is None else None)
        self._mtp = (committed(MTPSeats.create(config, batch=batch, capacity=self.capacity))
                     if self.mtp is not None else None)
        # MTP drafts with the prefix cache: the MTP rows of the cached chunks, beside the main
        # cache (offloaded: in the host pages' memory; resident: the prefix store's).
        self.mtp_prefix = None
        if self.mtp is not None and prefix_cache:
            self.mtp_prefix = MTPPrefixStore(
                self.prefix if self.pool is not None else self.prefix_store.cache,
                chunk=self.chunk, memory=(offload.host_memory_kind if offload is not None
                                          else self.prefix_store.memory))
        self._sampling_rows = [self._sampling_row(None)] * batch
        self._sampling = None  # rebuilt when a seat's request changes
        self._occupant: list[_Request | None] = [None] * batch
        self._waiting: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self.stats = None  # offload statistics summed over decode calls, on the device
        self.counters = {"steps": 0, "prefill_calls": 0, "decode_calls": 0,
                         "prefill_tokens": 0, "decode_tokens": 0, "prefix_hit_tokens": 0,
                         "requests_finished": 0, "requests_cancelled": 0,
                         "preemptions": 0, "preemptions_kept_pages": 0,
                         "resumed_without_recompute": 0, "replayed_tokens": 0,
                         "decode_steps": 0, "draft_accepted": 0, "draft_proposed": 0}
        # Wall seconds of `step`: in the prefill / decode programs (until their results are
        # ready) and in total; the rest is the engine's own host work.
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "step_s": 0.0}
        log = settings.metrics
        self.metrics = None if log.path is None else MetricsLog(self, path=log.path,
                                                                every=log.every)

    # Requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], *, max_tokens: int = 16,
                    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                    stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                    request_id: str | None = None, logprobs: int | None = None) -> str:
        """Queue a request; returns its id. Everything is checked here, before the request
        is queued: a refused request leaves the engine as it was (ValueError). Token ids are
        ints in [0, vocab) (not bools, not floats), `seed` an int64, at most
        `MAX_STOP_STRINGS` stop strings of at most `MAX_STOP_CHARS` characters each.

        logprobs: None, or k in [0, max_logprobs]: each output token comes with its
        log-probability and the k most likely tokens' (`RequestOutput.logprobs`: of the raw
        model distribution, before temperature and top_p; computed on the device from the
        logits the token is sampled from, the tokens unchanged bit for bit). Not with drafts
        (num_drafts > 0): refused."""
        vocab = self.config.vocab_size
        if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
            raise ValueError(f"prompt must be a non-empty list of token ids, got an array of "
                             f"shape {prompt.shape}")
        prompt_np = _token_ids(prompt, vocab, "prompt token")
        if prompt_np.size == 0:
            raise ValueError("prompt must be a non-empty list of token ids")
        if prompt_np.size > self.capacity:
            raise ValueError(f"prompt of {prompt_np.size} tokens does not fit a seat of "
                             f"{self.capacity} tokens: shorten it or raise the capacity")
        if (not isinstance(max_tokens, numbers.Integral) or isinstance(max_tokens, bool)
                or max_tokens < 1):
            raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
        if self.pool is not None:
            need = -(-self._reserved_tokens(prompt_np.size, max_tokens) // self.pool.page_size)
            if need > self.pool.num_pages:
                raise ValueError(
                    f"prompt of {prompt_np.size} tokens + max_tokens={max_tokens} needs {need} "
                    f"pages of {self.pool.page_size} tokens, but the pool holds "
                    f"{self.pool.num_pages}: lower max_tokens or raise num_pages")
            if self.device_bytes is not None:
                seat, prefill, pages = self._device_need(prompt_np.size, need)
                if seat + prefill + pages > self.device_bytes:
                    raise RequestRefused(
                        f"prompt of {prompt_np.size} tokens + max_tokens={max_tokens} can never "
                        f"fit device_bytes={self.device_bytes:,}: alone it needs "
                        f"{seat + prefill + pages:,} bytes of device memory (seat hot cache "
                        f"{seat:,} + prefill buffers {prefill:,} + {self.costs.page_label} "
                        f"{pages:,} for {need} pages of {self.pool.page_size} tokens"
                        f"{', the pool in device memory' if self.costs.pool_on_device else ''})"
                        "; shorten the prompt or max_tokens, or raise device_bytes")
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be a number")
        _check_sampling_values(np.asarray([temperature]), np.asarray([top_p]))
        if (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)
                or not SEEDS[0] <= seed < SEEDS[1]):
            raise ValueError(f"seed={seed!r} must be an int in [-2**63, 2**63)")
        stop_ids = tuple(_token_ids(stop_token_ids, vocab, "stop token id").tolist())
        if len(stop_ids) > self.max_stop_ids:
            raise ValueError(f"{len(stop_ids)} stop token ids, at most max_stop_ids="
                             f"{self.max_stop_ids} per request")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stop)} stop strings, at most {MAX_STOP_STRINGS} per request")
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string of {longest} characters, at most {MAX_STOP_CHARS} "
                             "per string")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (Engine(..., tokenizer=...)); "
                             "without one, use stop_token_ids")
        if logprobs is not None:
            if (not isinstance(logprobs, numbers.Integral) or isinstance(logprobs, bool)
                    or not 0 <= logprobs <= self.max_logprobs):
                raise ValueError(
                    f"logprobs={logprobs!r} must be None (no log-probabilities) or an int in "
                    f"[0, max_logprobs={self.max_logprobs}] (the most likely tokens returned "
                    "besides the sampled one; Engine(max_logprobs=...) raises the bound)")
            if self.num_drafts:
                raise ValueError(
                    f"logprobs are not computed with drafts (this engine verifies num_drafts="
                    f"{self.num_drafts} drafts per step): serve without drafts (num_drafts=0) "
                    "to have them, or drop logprobs")
        request_id = claim_request_id(request_id, self._ids, self._requests)
        req = _Request(request_id, prompt_np.astype(np.int32), int(max_tokens),
                       float(temperature), float(top_p), int(seed), stop_ids, stop,
                       time.perf_counter(), text="" if self.tokenizer is not None else None,
                       order=next(self._arrivals), queued_at=self.counters["steps"],
                       top_logprobs=None if logprobs is None else int(logprobs),
                       logprobs=None if logprobs is None else [])
        self._requests[request_id] = req
        self._waiting.append(req)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its seat; False if it had already finished.

        Raises KeyError for an id the engine does not know (never added, or already
        released with `release`)."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        if req.finish_reason is not None:
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        req.finish_reason = "cancelled"
        self.counters["requests_cancelled"] += 1
        self._free(req)
        return True

    def release(self, request_id: str) -> RequestOutput:
        """Forget a finished request (its id can be used again); returns its final output."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        if req.finish_reason is None:
            raise ValueError(f"request {request_id!r} has not finished: cancel it first")
        del self._requests[request_id]
        return req.output([])

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._occupant)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_ids(self) -> list[str]:
        """Ids of the waiting requests in the order admission considers them (preempted
        ones first, then by `order`). O(Q log Q)."""
        return [r.request_id for r in self._queue()]

    def pool_occupancy(self) -> dict | None:
        """Pages of the shared pools: free, held (mapped by requests), cached (kept by the
        prefix cache, mapped by none) and total; None on the resident path. O(1)."""
        if self.pool is None:
            return None
        return {"free": self.pool.num_free, "held": self.pool.num_held,
                "cached": self.pool.num_cached, "total": self.pool.num_pages}

    def seat_request_ids(self) -> list[str | None]:
        """The id of each seat's request (None: a free seat): per-seat figures (the offload
        statistics are [.., seats, ..]) belong to these requests. O(seats)."""
        return [None if r is None else r.request_id for r in self._occupant]

    def decoding_seats(self) -> np.ndarray:
        """[seats] bool: seats whose request has its decode state (prompt complete)."""
        return np.asarray([r is not None and r.prefilled >= len(r.prompt)
                           for r in self._occupant])

    def prefilling_seats(self) -> np.ndarray:
        """[seats] bool: seats whose request is still prefilling (their decode rows, maps and
        policy state are set when the prompt is complete: see `join_seats`)."""
        return np.asarray([r is not None and r.prefilled < len(r.prompt)
                           for r in self._occupant])

    def num_running(self) -> int:
        return sum(r is not None for r in self._occupant)

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; the final output of each request."""
        while self.has_unfinished():
            self.step()
        return {rid: req.output([]) for rid, req in self._requests.items()}

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, prefill one chunk, decode `decode_steps_per_call` steps (see the module
        doc); the outputs of the requests that moved."""
        start = time.perf_counter()
        moved: dict[str, list[int]] = {}
        self._admit()
        self._prefill(moved)
        self._grow_pages()
        self._decode(moved)
        self.counters["steps"] += 1
        self.timings["step_s"] += time.perf_counter() - start
        outputs = [self._requests[rid].output(new) for rid, new in moved.items()]
        if self.metrics is not None:  # host figures; device counters read every N steps
            self.metrics.on_step(outputs)
        return outputs

    def _reserved_tokens(self, prompt_len: int, max_tokens: int) -> int:
        """The most tokens a request's pages ever hold: prompt + output, at most a seat
        (reserve="full" reserves them all at admission: a running request never waits for a
        page)."""
        return min(prompt_len + max_tokens, self.capacity)

    def _tokens_needed(self, req: _Request) -> int:
        """Tokens the request's pages must hold before its next decode call (or, admitted,
        through its prefill, its replay and its first decode call): with reserve="prompt",
        the tokens stored (prompt + fed tokens: every sampled token but the last) + one
        call's steps; with reserve="full", all it may ever hold."""
        full = self._reserved_tokens(len(req.prompt), req.max_tokens)
        if self.reserve == "full":
            return full
        return min(len(req.prompt) + max(len(req.tokens) - 1, 0)
                   + self.n_steps * (self.num_drafts + 1), full)

    def _device_need(self, prompt_len: int, pages: int) -> tuple[int, int, int]:
        """(seat, prefill buffers, pages): device bytes of a request of `prompt_len` prompt
        tokens holding `pages` pages, while prefilling (`MemoryCosts.device_need`: indexer
        keys per page, + KV rows with the pool on the device). O(1)."""
        return self.costs.device_need(prompt_len, pages)

    def _seat_bytes(self, req: _Request) -> int:
        """Device bytes seat-bound to a running request: its seat (hot cache, tails, slot
        map), + its prefill buffers while prefilling; what preempting it frees besides its
        pages. O(1)."""
        seat, prefill, _ = self.costs.device_need(
            len(req.prompt), 0, prefilling=req.prefilled < len(req.prompt))
        return seat + prefill

    def device_bytes_used(self) -> int | None:
        """Device bytes of request state by the planner's arithmetic (`MemoryCosts`): hot
        cache of every occupied seat + prefill buffers of the prefilling ones + every page
        held (a shared page once; cached pages mapped by none are evictable: not counted): its
        indexer keys, and its KV rows too when the pool is on the device
        (`MemoryCosts.held_page_device_bytes`). None on the resident path. O(seats)."""
        if self.costs is None:
            return None
        used = self.pool.num_held * self.costs.held_page_device_bytes
        return used + sum(self._seat_bytes(r) for r in self._occupant if r is not None)

    def _queue(self) -> list[_Request]:
        """The waiting requests in admission order: preempted ones first (in arrival order:
        the oldest resumes first), then new ones by `order`; with "shortest", those that
        waited `max_wait_steps` steps go first, in arrival order.
        O(Q log Q)."""
        if self.order == "fifo":
            return sorted(self._waiting, key=lambda r: (not r.preempted, r.order))
        now, wait = self.counters["steps"], self.max_wait_steps

        def aged(r: _Request) -> bool:
            return r.preempted or (wait is not None and now - r.queued_at >= wait)

        return sorted(self._waiting, key=lambda r: (
            not r.preempted, not aged(r), 0 if aged(r) else len(r.prompt) + r.max_tokens,
            r.order))

    def _admit(self) -> None:
        """The first request of the queue (`_queue`) takes a free seat once the pool can
        reserve its pages (`_tokens_needed`) and its device bytes fit `device_bytes`; a
        request that does not fit yet blocks the ones behind it. With the prefix cache, its
        longest cached prefix of whole prefill chunks is mapped and not prefilled. A request
        preempted with its pages kept takes them back (`_fits_kept`): its prompt is not
        prefilled again and, once decoding, it joins at once (`_rejoin`); one whose pages
        were dropped prefills its prompt again (cached chunks mapped) and replays its tokens
        at its join. When the head of the queue does not fit and no seat is occupied, the
        pages kept by the requests behind it are dropped, youngest first, until it fits
        (nothing else would ever free them). O(seats + prompt + pages) per admitted
        request, O(Q log Q) for the queue."""
        free = [b for b, r in enumerate(self._occupant) if r is None]
        started, kept = {}, []
        queue = self._queue() if free else []
        for req in queue:
            if not free:
                break
            had_pages = req.pages is not None  # preempted with its pages kept
            if self.pool is not None and not self._fits(req):
                break
            self._waiting.remove(req)
            b = free.pop(0)
            req.seat, req.preempted = b, False
            req.admitted = next(self._admissions)
            self._occupant[b] = req
            if had_pages:
                kept.append(req)
            else:
                if self.prefix_store is not None:
                    self._reuse_prefix(req, b)
                req.prefilled = req.cached_tokens
            started[b] = req
        if started:
            self._set_seats({b: (self._stored_tokens(r),
                                 None if r.pages is None else r.pages.table_row())
                             for b, r in started.items()})
            self._start_mtp(list(started.values()))
        if kept:
            self.counters["resumed_without_recompute"] += len(kept)
            self._rejoin([r for r in kept if r.prefilled == len(r.prompt)])

    def _reuse_prefix(self, req: _Request, b: int) -> None:
        """Resident: copy the request's longest cached prefix of whole prefill chunks into
        seat b (`ResidentPrefixStore`: one program, O(L prefix) rows); its prefill starts
        there. O(prompt) hashing."""
        slots, cached = self.prefix_store.lookup(req.prompt, chunk=self.chunk)
        keep = self._mtp_prefix(req, cached) // self.prefix_store.block_tokens
        self.prefix_store.pool.decref(slots[keep:][::-1])
        slots, cached = slots[:keep], keep * self.prefix_store.block_tokens
        self.state = self.prefix_store.write(self.state, b, slots)
        req.cached_tokens = cached
        self.counters["prefix_hit_tokens"] += cached

    def _mtp_prefix(self, req: _Request, cached: int) -> int:
        """MTP drafts with the prefix cache: of the `cached` tokens (whole chunks) the main
        cache found for the request, those whose MTP rows are stored with the prompt's own
        next tokens (`MTPPrefixStore.lookup`: its blocks kept on the request for `_start_mtp`);
        all of them without MTP drafts, or for a request that takes back its saved MTP state.
        O(prompt) hashing."""
        req.mtp_blocks = None
        if self.mtp_prefix is None or req.mtp_saved is not None or not cached:
            return cached
        n, req.mtp_blocks = self.mtp_prefix.lookup(req.prompt, chunks=cached // self.chunk)
        return n * self.chunk

    def _fits(self, req: _Request) -> bool:
        """Whether the request can take a seat now (its pages reserved, or the kept ones
        grown): `_fits_kept` or `_reserve`. When it cannot and no seat is occupied, the pages
        other waiting requests kept are dropped, youngest first, until it fits: it fits alone
        (`add_request` refused any request that does not), and with no request running
        nothing else would ever free them. O(queue + pages) per drop."""
        while not (self._fits_kept(req) if req.pages is not None else self._reserve(req)):
            others = [r for r in self._waiting if r.pages is not None and r is not req]
            if any(r is not None for r in self._occupant) or not others:
                return False
            self._drop_kept(max(others, key=lambda r: r.admitted))
        return True

    def _reserve(self, req: _Request) -> bool:
        """Map the request's cached prefix (with the prefix cache) and reserve its pages
        (`_tokens_needed`) if the pool can give them and its device bytes (seat + prefill
        buffers) fit `device_bytes`; False, with nothing held, when they do not."""
        matched, cached = np.zeros((0,), np.int32), 0
        if self.prefix is not None:
            matched, cached = self.prefix.match(req.prompt[:-1])
            cached = self._mtp_prefix(req, cached // self.chunk * self.chunk)
            keep = cached // self.pool.page_size
            self.pool.decref(matched[keep:].tolist())
            matched = matched[:keep]
        pages = RequestPages(self.pool, self.max_pages, prefix_pages=matched.tolist(),
                             prefix_tokens=cached)
        try:
            pages.grow(self._tokens_needed(req))
        except PoolExhausted:
            pages.release()
            return False
        if self.device_bytes is not None:
            seat, prefill, _ = self._device_need(len(req.prompt), 0)
            if self.device_bytes_used() + seat + prefill > self.device_bytes:
                pages.release()  # its pages are counted in the pool's held pages
                return False
        req.pages, req.cached_tokens = pages, cached
        self.counters["prefix_hit_tokens"] += cached
        return True

    def _fits_kept(self, req: _Request) -> bool:
        """A request preempted with its pages kept: grow them for its next decode call (or,
        prefilling, they already hold its prompt) if the pool can give its new pages and
        those the running requests need for the coming call (`_tokens_needed`), and its seat
        (+ prefill buffers while prefilling) + all these pages fit `device_bytes`; False,
        nothing changed, when they do not. Counting the running requests' growth keeps the
        call it resumes for from preempting it again at once. O(seats + pages)."""
        tokens = self._tokens_needed(req)
        need = req.pages.pages_needed(tokens) + sum(
            r.pages.pages_needed(self._tokens_needed(r)) for r in self._occupant
            if r is not None and r.prefilled == len(r.prompt))
        if need > self.pool.num_available:
            return False
        if self.device_bytes is not None:
            seat, prefill, _ = self._device_need(len(req.prompt), 0)
            if req.prefilled == len(req.prompt):
                prefill = 0
            if (self.device_bytes_used() + seat + prefill
                    + need * self.costs.held_page_device_bytes > self.device_bytes):
                return False
        req.pages.grow(tokens)
        return True

    def _stored_tokens(self, req: _Request) -> int:
        """Tokens the request's pages hold: the cached prefix (admitted), the prompt tokens
        prefilled, or, decoding, prompt + sampled tokens but the last (not fed yet)."""
        if req.prefilled == len(req.prompt) and req.tokens:
            return len(req.prompt) + len(req.tokens) - 1
        return req.prefilled

    def _rejoin(self, resumed: list[_Request]) -> None:
        """Seat decoding requests that kept their pages, without recompute: their host pages
        hold every stored token (the decode writes each step's rows through to them), so
        `join_seats` rebuilds their hot rows, tails, maps and policy state from the pages for
        their length, and their last token, PRNG key and tokens generated are restored: the
        decode goes on as if never interrupted. O(L seats (C + 2Z)) device work, once."""
        if not resumed:
            return
        mask = np.zeros((self.seats,), bool)
        for req in resumed:
            mask[req.seat] = True
            self._sampling_rows[req.seat] = self._sampling_row(req)
        self._sampling = None
        self.state = offload_prefill.join_seats(self.state, mask, config=self.config,
                                                offload=self.offload)
        self._restore_seats({r.seat: (r.tokens[-1], len(r.tokens), r.key_data)
                             for r in resumed})
        self._set_history(resumed)  # with drafts: what the drafter looks up
        for req in resumed:
            req.key_data = None

    def _restore_seats(self, rows: dict) -> None:
        """Seat b decodes again from rows[b] = (last token, tokens generated, PRNG key data):
        the Seats rows of a request that joins without sampling its first token. O(B)."""
        tokens = np.array(self._seats.tokens)
        generated = np.array(self._seats.generated)
        done = np.array(self._seats.done)
        data = np.array(jax.random.key_data(self._seats.keys))
        for b, (token, count, key_data) in rows.items():
            tokens[b], generated[b], done[b], data[b] = token, count, False, key_data
        keys = jax.random.wrap_key_data(jnp.asarray(data),
                                        impl=jax.random.key_impl(self._seats.keys))
        self._seats = committed(Seats(tokens=jnp.asarray(tokens), keys=keys,
                                      generated=jnp.asarray(generated), done=jnp.asarray(done)))

    def _grow_pages(self) -> None:
        """reserve="prompt": before the decode call, give every decoding request the pages
        the call may write (`_tokens_needed`), oldest request first. When they cannot be
        had, make room and try again (the rule and why it always progresses: module doc):
        pool pages short (after evicting unreferenced prefix-cache pages, least recently
        released first, as any allocation does): drop the pages a waiting preempted request
        kept (youngest first), else preempt the youngest running request dropping its pages;
        only `device_bytes` short: preempt the youngest running request keeping its pages
        (its seat's bytes are freed), or, when the request is alone in the seats, drop the
        pages a waiting request kept (youngest first); with the pool on the device (bytes
        short are pages short): drop the kept pages first, then preempt the youngest running
        request, keeping its pages only when its seat's bytes cover the shortfall. A request
        that is itself the youngest is preempted. O(seats + queue + pages allocated) per
        preemption or drop."""
        if self.pool is None or self.reserve == "full":
            return
        rows = {}
        decoding = sorted((r for r in self._occupant
                           if r is not None and r.prefilled == len(r.prompt)),
                          key=lambda r: r.admitted)
        for req in decoding:
            while req.seat is not None:
                need = req.pages.pages_needed(self._tokens_needed(req))
                if need == 0:
                    break
                pool_ok = need <= self.pool.num_available
                short = (0 if self.device_bytes is None else self.device_bytes_used()
                         + need * self.costs.held_page_device_bytes - self.device_bytes)
                if pool_ok and short <= 0:
                    req.pages.grow(self._tokens_needed(req))
                    rows[req.seat] = req.pages.table_row()
                    break
                running = [r for r in self._occupant if r is not None]
                kept = [r for r in self._waiting if r.pages is not None]
                victim = max(running, key=lambda r: r.admitted)
                # With the pool on the device, bytes short are pages short: kept pages hold
                # device bytes nobody decodes with, so they go first too.
                if kept and (not pool_ok or self.costs.pool_on_device or len(running) == 1):
                    self._drop_kept(max(kept, key=lambda r: r.admitted))
                    continue
                # Keep the victim's pages when they do not stand in the way: the pool has the
                # pages and, with it on the device, freeing the victim's seat covers the bytes.
                keep = pool_ok and (not self.costs.pool_on_device
                                    or self._seat_bytes(victim) >= short)
                rows.pop(victim.seat, None)
                self._preempt(victim, keep_pages=keep)
        if rows:
            self._set_rows(rows)

    def _set_rows(self, rows: dict) -> None:
        """Set seat b's page-table row to rows[b] (pages appended; lengths unchanged)."""
        mask = np.zeros((self.seats,), bool)
        table = np.full((self.seats, self.max_pages), NO_PAGE, np.int32)
        for b, row in rows.items():
            mask[b], table[b] = True, row
        self.state = dataclasses.replace(
            self.state, table=_set_rows(self.state.table, jnp.asarray(mask), jnp.asarray(table)))

    def _preempt(self, req: _Request, *, keep_pages: bool = False) -> None:
        """Take a running request's seat; it waits at the head of the queue (`_queue`) with
        its sampled tokens (and, once it sampled, its PRNG key) kept. keep_pages: its pages
        stay held (its host KV and indexer keys: every token it stored, the decode writes
        through to the host pages), so it resumes where it stopped (`_rejoin`, or its
        prefill goes on); else they are dropped (`_drop_kept`). O(pages + seats)."""
        if req.prefilled == len(req.prompt):  # joined: its seat holds its key (a request
            # resumed but not joined yet keeps the key it saved)
            req.key_data = np.asarray(jax.random.key_data(self._seats.keys[req.seat]))
        if self._mtp is not None and (keep_pages or req.tokens):
            req.mtp_saved = self._save_mtp(req.seat)  # restored by `_start_mtp`
        self._vacate(req.seat)
        req.seat = None
        req.preempted = True
        self._waiting.append(req)
        self.counters["preemptions"] += 1
        if keep_pages:
            self.counters["preemptions_kept_pages"] += 1
        else:
            self._drop_kept(req)

    def _drop_kept(self, req: _Request) -> None:
        """Drop a preempted request's pages: it will prefill its prompt again and replay its
        tokens. Its full prompt pages the prefix cache registered stay cached (mapped again
        on resume unless evicted meanwhile); the others go back to the pool. O(pages)."""
        req.pages.release()
        req.pages = None
        req.prefilled = req.cached_tokens = 0
        if not req.tokens:  # it prefills again from the start: so does its MTP state
            req.mtp_saved = None

    def _set_seats(self, seats: dict) -> None:
        """Set seat b's length (and page-table row, offloaded) to seats[b] = (length, row)."""
        mask = np.zeros((self.seats,), bool)
        lengths = np.zeros((self.seats,), np.int32)
        rows = np.full((self.seats, self.max_pages), NO_PAGE, np.int32)
        for b, (length, row) in seats.items():
            mask[b], lengths[b] = True, length
            if row is not None:
                rows[b] = row
        new_lengths = _set_lengths(self.state.lengths, jnp.asarray(mask), jnp.asarray(lengths))
        if self.pool is None:
            self.state = dataclasses.replace(self.state, lengths=new_lengths)
        else:
            self.state = dataclasses.replace(
                self.state, lengths=new_lengths,
                table=_set_rows(self.state.table, jnp.asarray(mask), jnp.asarray(rows)))

    def _prefilling(self) -> list[_Request]:
        return [r for r in self._occupant
                if r is not None and r.prefilled < len(r.prompt)]

    def _prefill(self, moved) -> None:
        requests = self._prefilling()
        if not requests:
            return
        batch, chunk = self.seats, self.chunk
        tokens = np.zeros((batch, chunk), np.int32)
        num_new = np.zeros((batch,), np.int32)
        history = 0
        # MTP drafts: the seats whose MTP state takes this chunk's pairs (`_feed_mtp`); a
        # resumed request that sampled before has its MTP state back already (`_start_mtp`).
        feed = ([(req, req.seat, req.prefilled) for req in requests if not req.tokens]
                if self._mtp is not None else [])
        want_hidden = self._mtp is not None
        for req in requests:
            part = req.prompt[req.prefilled:req.prefilled + chunk]
            tokens[req.seat, :len(part)] = part
            num_new[req.seat] = len(part)
            history = max(history, req.prefilled)
        start = time.perf_counter()
        if self.offload is None:
            logits, self.state, *hidden = resident.prefill(
                self.params, self.state, tokens, num_new, config=self.config, check=False,
                query_block=self.query_block, return_hidden=want_hidden)
        else:
            oc = self.offload
            pages = min(_next_power_of_two(-(-history // oc.page_size)),
                        oc.capacity // oc.page_size)
            view = offload_prefill.PrefillState(host=self.state.host, table=self.state.table,
                                                index_keys=self.state.index_keys,
                                                lengths=self.state.lengths)
            logits, view, *hidden = offload_prefill.prefill(
                self.params, view, tokens, num_new, config=self.config,
                num_buffers=self.num_buffers, history_pages=pages, check=False,
                host_access=oc.host_access, query_block=self.query_block,
                return_hidden=want_hidden)
            self.state = dataclasses.replace(self.state, host=view.host, table=view.table,
                                             index_keys=view.index_keys, lengths=view.lengths)
        jax.block_until_ready(logits)
        self.timings["prefill_s"] += time.perf_counter() - start
        self.counters["prefill_calls"] += 1
        self.counters["prefill_tokens"] += int(num_new.sum())
        for req in requests:
            req.prefilled += int(num_new[req.seat])
            if self.prefix is not None:  # pages of prefilled tokens are final: a request
                # admitted from now on may map them (O(prefilled) hashing per chunk)
                self.prefix.insert(req.prompt[:req.prefilled], req.pages.pages)
        if self.prefix_store is not None:  # resident: the blocks this chunk completed
            self.prefix_store.insert(self.state, [
                (r.seat, r.prompt[:r.prefilled], r.prefilled - int(num_new[r.seat]))
                for r in requests])
        done = [r for r in requests if r.prefilled == len(r.prompt)]
        if done:
            self._join(done, logits, num_new, moved)
        if feed:  # after the join: a prompt's last pair takes its first sampled token
            self._feed_mtp(feed, hidden[0], tokens, num_new)
        if self.mtp_prefix is not None:  # the MTP rows of the chunks completed (final now)
            self.mtp_prefix.insert(self._mtp, [
                (r.seat, r.prompt, r.prefilled - int(num_new[r.seat]), r.prefilled,
                 r.tokens[0] if r.tokens else None) for r in requests])

    # MTP drafts: each seat's MTP state -------------------------------------------------------

    def _feed_mtp(self, feed, hidden, tokens, num_new) -> None:
        """Feed the prefill chunk's pairs (h_i, t_{i+1}) to the MTP state of each seat of
        `feed` [(request, seat, prompt tokens prefilled before the chunk)]: hidden [B, T, E]
        the chunk's last hidden states, t_{i+1} the next prompt token, or, for a prompt's last
        position, the first sampled token (`MTPDrafter.start`, chunk by chunk). One
        [seats, prefill_chunk] MTP-layer program; the others take 0 pairs. O(B T) host work."""
        nxt = np.zeros(tokens.shape, np.int32)
        count = np.zeros((self.seats,), np.int32)
        for req, b, lo in feed:
            n = int(num_new[b])
            row = req.prompt[lo + 1:lo + n + 1]
            if lo + n == len(req.prompt):
                row = np.concatenate([row, np.asarray(req.tokens[:1], np.int32)])
            nxt[b, :len(row)], count[b] = row, n
        self._mtp = mtp_feed_jit(self.params, self.mtp, self._mtp, hidden,
                                 committed(jnp.asarray(nxt)), committed(jnp.asarray(count)),
                                 config=self.config, query_block=self.query_block)

    def _start_mtp(self, started: list[_Request]) -> None:
        """MTP drafts: each admitted request's MTP state. One preempted with its pages kept, or
        after it sampled, takes back the MTP state it had (`_save_mtp`: its pairs are those
        of the tokens its seat stores again, and the MTP layer's cache is never dropped,
        just saved: nothing to recompute); any other starts empty (its prefill feeds it)."""
        if self._mtp is None:
            return
        fresh = []
        for req in started:
            if req.mtp_saved is not None:  # `_drop_kept` cleared it if the prompt prefills again
                self._restore_mtp(req.seat, req.mtp_saved)
            elif req.mtp_blocks:  # its mapped prefix's MTP rows, from the cache
                self._mtp = self.mtp_prefix.write(self._mtp, req.seat, req.mtp_blocks)
            else:
                fresh.append(req.seat)
            req.mtp_saved = req.mtp_blocks = None
        if fresh:
            mask = np.zeros((self.seats,), bool)
            mask[fresh] = True
            self._mtp = _reset_mtp(self._mtp, committed(jnp.asarray(mask)))

    def _save_mtp(self, b: int) -> tuple:
        """Seat b's MTP state on the host: (KV rows [n, D+R], indexer keys [n, N], n, next
        draft, h' [E]), n its length. O(S (D+R + N)) device-to-host copy of one layer's seat
        (1/L of the main KV of the same tokens)."""
        kv, keys, length, draft, hidden = jax.device_get(
            _mtp_seat(self._mtp, jnp.asarray(b, jnp.int32)))
        n = int(length)
        return np.array(kv[:n]), np.array(keys[:n]), n, int(draft), np.asarray(hidden)

    def _restore_mtp(self, b: int, saved: tuple) -> None:
        """Set seat b's MTP state to `saved` (`_save_mtp`), its rows padded to the capacity."""
        kv, keys, n, draft, hidden = saved
        st = self._mtp.state
        rows = np.zeros(st.kv.shape[2:], st.kv.dtype)
        rows[:n] = kv
        ik = np.zeros(st.index_keys.shape[2:], st.index_keys.dtype)
        ik[:n] = keys
        self._mtp = _set_mtp_seat(self._mtp, jnp.asarray(b, jnp.int32), jnp.asarray(rows),
                                  jnp.asarray(ik), jnp.asarray(n, jnp.int32),
                                  jnp.asarray(draft, jnp.int32), jnp.asarray(hidden))

    def _join(self, joined: list[_Request], logits, num_new, moved) -> None:
        """Start each request whose prompt is complete: a new one samples its first token
        from the chunk's logits; a resumed one (preempted after sampling) takes back its PRNG
        key and its last token and replays its other tokens (`_replay`)."""
        batch = self.seats
        mask = np.zeros((batch,), bool)
        for req in joined:
            mask[req.seat] = True
            self._sampling_rows[req.seat] = self._sampling_row(req)
        self._sampling = None
        if self.offload is not None:
            self.state = offload_prefill.join_seats(self.state, mask, config=self.config,
                                                    offload=self.offload)
        new = [r for r in joined if not r.tokens]
        resumed = [r for r in joined if r.tokens]  # preempted after sampling, pages dropped
        keys, first_np = self._seats.keys, None
        if new:
            new_mask = np.zeros((batch,), bool)
            fresh = np.zeros((batch,) + self._key_shape, np.uint32)
            for req in new:
                new_mask[req.seat] = True
                fresh[req.seat] = np.asarray(jax.random.key_data(jax.random.key(req.seed)))
            want = any(r.top_logprobs is not None for r in new)
            first, keys, lp = _first_tokens(logits, jnp.asarray(np.maximum(num_new - 1, 0)),
                                            keys, jnp.asarray(fresh), jnp.asarray(new_mask),
                                            self._sampling_now(),
                                            logprobs=self.max_logprobs if want else None)
            first_np = np.asarray(first)
            lp_np = None if lp is None else jax.device_get(lp)
        if resumed:
            old_mask = np.zeros((batch,), bool)
            saved = np.zeros((batch,) + self._key_shape, np.uint32)
            for req in resumed:
                old_mask[req.seat], saved[req.seat] = True, req.key_data
            keys = _set_keys(keys, jnp.asarray(old_mask), jnp.asarray(saved))
        now = time.perf_counter()
        generated = np.array(self._seats.generated)
        tokens_np = np.array(self._seats.tokens)
        done = np.array(self._seats.done)
        for req in new:
            b = req.seat
            t = int(first_np[b])
            req.first_token_at = now
            tokens_np[b], generated[b] = t, 1
            rows = None
            if req.top_logprobs is not None:
                rows = _logprob_rows(lp_np[0][b:b + 1], lp_np[1][b:b + 1], req.top_logprobs)
            finished = self._record(req, [t], moved, length=len(req.prompt), logprobs=rows)
            done[b] = finished
        for req in resumed:
            tokens_np[req.seat], generated[req.seat] = req.tokens[-1], len(req.tokens)
            done[req.seat] = False
            req.preempted, req.key_data = False, None
        self._seats = committed(Seats(tokens=jnp.asarray(tokens_np), keys=keys,
                                      generated=jnp.asarray(generated), done=jnp.asarray(done)))
        self._set_history(joined)
        if resumed:
            self._replay(resumed)
        for req in new:
            if req.finish_reason is not None:
                self._free(req)

    def _replay(self, resumed: list[_Request]) -> None:
        """Feed each resumed request's sampled tokens but the last (their KV was dropped with
        its pages) through the decode step, the program that computed them before, one token
        per step, the other seats inactive (unchanged); the logits are not used. Prefilling
        them instead would not be bitwise: on CPU, XLA rounds a [chunk]-row matmul
        differently from a 1-row one (the KV and logits of a token differ in the last bits),
        so a resumed request could sample other tokens than its solo run. Costs: one decode
        step of the batch per replayed token of the longest replay. With drafts, the tokens
        are fed in the groups their W-way steps stored them (`_replay_groups`)."""
        if self.num_drafts:
            return self._replay_groups(resumed)
        batch = self.seats
        for i in range(max(len(r.tokens) - 1 for r in resumed)):
            tokens = np.zeros((batch, 1), np.int32)
            active = np.zeros((batch,), bool)
            for req in resumed:
                if i < len(req.tokens) - 1:
                    tokens[req.seat, 0], active[req.seat] = req.tokens[i], True
            _, self.state, _ = self.step_fn(self.params, self.state,
                                            committed(jnp.asarray(tokens)),
                                            committed(jnp.asarray(active)))
            self.counters["replayed_tokens"] += int(active.sum())

    def _set_history(self, joined: list[_Request]) -> None:
        """With drafts: each joined request's seat history = its prompt + sampled tokens (what
        the device drafter looks up; the loop appends the tokens it yields). O(B S) copy."""
        if self._history is None or not joined:
            return
        mask = np.zeros((self.seats,), bool)
        rows = np.zeros((self.seats, self.capacity), np.int32)
        for req in joined:
            row = np.concatenate([req.prompt, np.asarray(req.tokens, np.int32)])
            mask[req.seat], rows[req.seat, :min(len(row), self.capacity)] = True, \
                row[:self.capacity]
        self._history = _set_rows(self._history, jnp.asarray(mask), jnp.asarray(rows))

    def _replay_groups(self, resumed: list[_Request]) -> None:
        """`_replay` with drafts: request b's decode step k yielded groups[k] tokens and stored
        the groups[k] tokens fed before them; the replay feeds those again at the same ways
        of the same [seats, W] step (the rest of the W ways padded, then rolled back), so
        every stored row is computed by the program that computed it before, bit for bit (a
        W = 1 step's rows differ in the last bits on CPU). Tokens no step of this engine
        yielded (a request moved in by `_import_seat`) are replayed one per step first. One
        W-way step per group of the longest replay."""
        batch, ways = self.seats, self.num_drafts + 1
        groups = {id(r): [1] * (len(r.tokens) - 1 - sum(r.groups)) + r.groups for r in resumed}
        starts = {id(r): 0 for r in resumed}
        for i in range(max(len(g) for g in groups.values())):
            tokens = np.zeros((batch, ways), np.int32)
            active = np.zeros((batch,), bool)
            keep = np.zeros((batch,), np.int32)
            for req in resumed:
                if i < len(groups[id(req)]):
                    lo, n = starts[id(req)], groups[id(req)][i]
                    tokens[req.seat, :n] = req.tokens[lo:lo + n]
                    active[req.seat], keep[req.seat] = True, n
                    starts[id(req)] = lo + n
            before = np.asarray(self.state.lengths)  # the state is donated to the step
            _, self.state, _ = self.step_fn(self.params, self.state,
                                            committed(jnp.asarray(tokens)),
                                            committed(jnp.asarray(active)))
            self.state = self.step_fn.rollback(
                self.state, self.state.lengths - jnp.asarray(before + keep))
            self.counters["replayed_tokens"] += int(keep.sum())

    def _decode(self, moved) -> None:
        running = [r for r in self._occupant
                   if r is not None and r.prefilled == len(r.prompt) and r.finish_reason is None]
        if not running:
            return
        start = time.perf_counter()
        drafts = {} if not self.num_drafts else dict(num_drafts=self.num_drafts,
                                                     history=self._history)
        if self._mtp is not None:
            drafts.update(mtp=self.mtp, mtp_seats=self._mtp)
        if any(r.top_logprobs is not None for r in running):
            drafts["logprobs"] = self.max_logprobs  # another program: only while one asks
        out, self.state, self._seats = decode_loop(self.params, self.state, self._seats,
                                                   self.n_steps, self._sampling_now(),
                                                   step=self.step_fn, **drafts)
        tokens = np.asarray(out.tokens)  # waits for the program
        lp_np = None if out.logprobs is None else jax.device_get((out.logprobs,
                                                                  out.logprob_ids))
        self.timings["decode_s"] += time.perf_counter() - start
        self.counters["decode_calls"] += 1
        self.counters["decode_tokens"] += int(np.sum(tokens >= 0))
        self.counters["decode_steps"] += int(out.num_steps)
        if self.num_drafts:
            self._history = out.history
            if self._mtp is not None:
                self._mtp = out.mtp_seats
            self.counters["draft_accepted"] += int(np.sum(out.accepted))
            self.counters["draft_proposed"] += int(np.sum(out.proposed))
            counts = np.asarray(out.counts)
            for req in running:
                req.groups.extend(int(c) for c in counts[req.seat] if c > 0)
        if out.stats is not None:
            self.stats = out.stats if self.stats is None else jax.tree_util.tree_map(
                jnp.add, self.stats, out.stats)
        if self.metrics is not None:
            self.metrics.add_stats(out.stats)  # on the device: no host sync
        lengths = np.asarray(self.state.lengths)
        done = np.asarray(self._seats.done)
        stopped = []
        for req in running:
            new = [int(t) for t in tokens[req.seat] if t >= 0]
            rows = None
            if req.top_logprobs is not None:  # no drafts: column i is step i (-1: none)
                steps = tokens[req.seat] >= 0
                rows = _logprob_rows(lp_np[0][req.seat][steps], lp_np[1][req.seat][steps],
                                     req.top_logprobs)
            finished = self._record(req, new, moved, length=int(lengths[req.seat]),
                                    done=bool(done[req.seat]), logprobs=rows)
            if finished:
                stopped.append(req)
        if stopped:
            done = done.copy()
            for req in stopped:
                done[req.seat] = True
            self._seats = committed(dataclasses.replace(self._seats, done=jnp.asarray(done)))
            for req in stopped:
                self._free(req)

    # Bookkeeping ---------------------------------------------------------------------------

    def _record(self, req: _Request, new: list[int], moved, *, length: int,
                done: bool = False, logprobs: list[TokenLogprobs] | None = None) -> bool:
        """Append sampled tokens one by one until one finishes the request; decide whether
        it finished, and why. Tokens the device sampled after a text stop string (within the
        same decode call) are dropped, so the output does not depend on decode_steps_per_call.
        With stop strings the output is decoded after every token (O(output) per token).
        `logprobs` (one per token of `new`) go with their tokens."""
        kept = moved.setdefault(req.request_id, [])
        if new:
            req.last_token_at = time.perf_counter()
        for j, t in enumerate(new):
            req.tokens.append(t)
            kept.append(t)
            if logprobs is not None:
                req.logprobs.append(logprobs[j])
            if req.stop:
                req.text = self.tokenizer.decode(req.tokens)
                cut = [at for at in (req.text.find(s) for s in req.stop) if at >= 0]
                if cut:
                    req.text = req.text[:min(cut)]
                    req.finish_reason = "stop"
                    return True
            if t in req.stop_token_ids:
                req.finish_reason = "stop"
                break
        if req.text is not None and not req.stop:
            req.text = self.tokenizer.decode(req.tokens)
        if req.finish_reason is None and (len(req.tokens) >= req.max_tokens
                                          or length >= self.capacity or done):
            req.finish_reason = "length"
        return req.finish_reason is not None

    def _vacate(self, b: int) -> None:
        """Seat b empty: no occupant, default sampling, done, no tokens, no pages. O(B)."""
        self._occupant[b] = None
        self._sampling_rows[b] = self._sampling_row(None)
        self._sampling = None
        done = np.array(self._seats.done)
        done[b] = True
        self._seats = committed(dataclasses.replace(self._seats, done=jnp.asarray(done)))
        self._set_seats({b: (0, None)})

    def _free(self, req: _Request) -> None:
        """Free the request's seat and drop its pages (finished or cancelled: a waiting
        request's kept pages too)."""
        if req.seat is not None and self._occupant[req.seat] is req:
            self._vacate(req.seat)
        if req.pages is not None:
            req.pages.release()
            req.pages = None
        req.seat, req.mtp_saved = None, None
        if req.finish_reason != "cancelled":
            self.counters["requests_finished"] += 1

    def _sampling_row(self, req: _Request | None):
        if req is None:
            return (0.0, 1.0, (), 1)
        return (req.temperature, req.top_p, req.stop_token_ids, req.max_tokens)

    def _sampling_now(self) -> Sampling:
        if self._sampling is None:
            rows = self._sampling_rows
            stops = np.full((self.seats, self.max_stop_ids), -1, np.int32)
            for b, (_, _, ids, _) in enumerate(rows):
                stops[b, :len(ids)] = ids
            self._sampling = committed(Sampling(
                temperature=jnp.asarray([r[0] for r in rows], jnp.float32),
                top_p=jnp.asarray([r[1] for r in rows], jnp.float32),
                stop_tokens=jnp.asarray(stops),
                max_new_tokens=jnp.asarray([min(r[3], 2**31 - 1) for r in rows], jnp.int32)))
        return self._sampling

    # Moving a request between engines (fo_jax.engine.auto) --------------------------------
    # Kept apart from admission and decoding: these only read and set one seat.

    def _withdraw(self, request_id: str) -> _Request:
        """Take a waiting request (checked by `add_request`) out of the queue and forget it,
        counted nowhere: another engine will serve it (`_enqueue`). O(queue)."""
        req = self._requests.get(request_id)
        if req is None or req not in self._waiting:
            raise KeyError(f"no waiting request {request_id!r}")
        self._waiting.remove(req)
        del self._requests[request_id]
        return req

    def _enqueue(self, req: _Request) -> None:
        """Queue a request another engine's `add_request` checked (same model, tokenizer and
        max_stop_ids); it must fit this engine's seats."""
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if len(req.prompt) > self.capacity:
            raise ValueError(f"prompt of {len(req.prompt)} tokens does not fit a seat of "
                             f"{self.capacity} tokens")
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def _export_seat(self, request_id: str, rows: int | None = None) -> SeatExport:
        """Take a decoding request out of this engine, with what its decode needs: its KV rows
        [L, S, D+R] and indexer keys [G, S, N] (the first `length` are its tokens), its last
        token, PRNG key and tokens generated. The seat is freed at once (the request counts as
        neither finished nor cancelled here) and the id forgotten.

        Resident: the seat's rows, S = this engine's capacity (`rows` unused): O(L S (D+R) +
        G S N) device copy. Offloaded: its first ceil(rows / Z) pages read from the host pool
        and the indexer-key pool through its page-table row, S = that many pages' tokens
        (`rows` is required: at least its length; the seat it goes to), O(L S (D+R)) host to
        device + O(G S N) device rows; then its pages are released."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        if req.seat is None or req.prefilled < len(req.prompt) or req.finish_reason is not None:
            raise ValueError(f"request {request_id!r} is not decoding (queued, prefilling or "
                             "finished): only a request past its prompt moves")
        b = req.seat
        if self.pool is None:
            kv, keys, length = _seat_rows(self.state.kv, self.state.index_keys,
                                          self.state.lengths, jnp.asarray(b, jnp.int32))
            length = int(length)
        else:
            length = self._stored_tokens(req)
            if rows is None or not length <= rows <= self.capacity:
                raise ValueError(f"_export_seat of an offloaded request of {length} stored "
                                 f"tokens needs rows in [{length}, {self.capacity}] (the rows "
                                 f"its new seat takes), got {rows!r}")
            pages = -(-int(rows) // self.offload.page_size)
            kv, keys = _page_rows(self.state.host.kv, self.state.index_keys,
                                  jnp.asarray(req.pages.table_row()[:pages]),
                                  access=self.offload.host_access)
        out = SeatExport(request=req, kv=kv, index_keys=keys, length=length,
                         token=int(self._seats.tokens[b]),
                         key_data=np.asarray(jax.random.key_data(self._seats.keys)[b]),
                         generated=int(self._seats.generated[b]),
                         mtp=None if self._mtp is None else self._save_mtp(b))
        self._vacate(b)
        if req.pages is not None:
            req.pages.release()
            req.pages = None
        del self._requests[request_id]
        req.seat = None
        return out

    def _import_seat(self, moved: SeatExport) -> bool:
        """Seat a request `_export_seat` took from another engine. Offloaded: reserve its pages
        (prompt + max_tokens, as admission does), write its first `length` KV rows and indexer
        keys into them through its page-table row (O(L length) rows, once), set its length and
        row, build its hot rows, maps and policy state from the host rows (`join_seats`: O(L
        seats (C + 2Z))). Resident: write its first `length` rows into the seat's KV and
        indexer keys (O(L S) rows; its length must be below this engine's capacity). Then its
        last token, PRNG key, count and sampling row (and, with drafts, its history). False
        (nothing changed) when no seat is free or the pool cannot reserve the pages yet."""
        req = moved.request
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if (self._mtp is None) != (moved.mtp is None):
            raise ValueError("a request moves between engines that both draft with the MTP "
                             "layer (drafter='mtp') or neither")
        if self.pool is None and moved.length >= self.capacity:
            raise ValueError(f"a request of {moved.length} stored tokens does not fit a "
                             f"resident seat of {self.capacity} tokens (it needs room for the "
                             "token it feeds next)")
        free = [b for b, r in enumerate(self._occupant) if r is None]
        if not free:
            return False
        if self.pool is None:
            b = free[0]
            kv, keys = _write_resident_seat(self.state.kv, self.state.index_keys, moved.kv,
                                            moved.index_keys, jnp.asarray(b, jnp.int32))
            self.state = dataclasses.replace(self.state, kv=kv, index_keys=keys)
            self._set_seats({b: (moved.length, None)})
            return self._seat_moved(b, moved, None)
        pages = RequestPages(self.pool, self.max_pages)
        try:
            pages.grow(self._reserved_tokens(len(req.prompt), req.max_tokens))
        except PoolExhausted:
            pages.release()
            return False
        b = free[0]
        row = pages.table_row()
        host, index_keys = _write_seat_rows(
            self.state.host.kv, self.state.index_keys, moved.kv, moved.index_keys,
            jnp.asarray(row), jnp.asarray(moved.length, jnp.int32))
        self.state = dataclasses.replace(self.state, host=dataclasses.replace(self.state.host,
                                                                              kv=host),
                                         index_keys=index_keys)
        self._set_seats({b: (moved.length, row)})
        mask = np.zeros((self.seats,), bool)
        mask[b] = True
        self.state = offload_prefill.join_seats(self.state, mask, config=self.config,
                                                offload=self.offload)
        return self._seat_moved(b, moved, pages)

    def _seat_moved(self, b: int, moved: SeatExport, pages) -> bool:
        """`_import_seat`'s last part: seat b decodes `moved.request` from its last token,
        PRNG key and count, with its sampling row (and, with drafts, its history). O(B S)."""
        req = moved.request
        self._restore_seats({b: (moved.token, moved.generated, moved.key_data)})
        if moved.mtp is not None:
            self._restore_mtp(b, moved.mtp)
        self._sampling_rows[b] = self._sampling_row(req)
        self._sampling = None
        req.seat, req.pages = b, pages
        self._set_history([req])
        self._occupant[b] = req
        self._requests[req.request_id] = req
        return True


@dataclasses.dataclass(frozen=True)
class SeatExport:
    """A decoding request leaving an engine (`Engine._export_seat`).

    Attributes:
      request: its bookkeeping (prompt, tokens so far, sampling settings, times).
      kv: [L, S, D+R] its KV rows (S: the resident capacity, or the pages' tokens read from an
        offloaded engine; rows >= length unused).
      index_keys: [G, S, N] its indexer keys.
      length: tokens stored (prompt + tokens sampled - 1: the last one is not fed yet).
      token: its last sampled token; key_data: its PRNG key's data; generated: tokens sampled.
      mtp: with MTP drafts, its seat's MTP state (`Engine._save_mtp`), else None.
    """

    request: _Request
    kv: jax.Array
    index_keys: jax.Array
    length: int
    token: int
    key_data: np.ndarray
    generated: int
    mtp: Any = None


@jax.jit
def _mtp_seat(mtp: MTPSeats, seat):
    """Seat `seat`'s MTP state: (KV rows [S, D+R], indexer keys [S, N], length, draft, h' [E])
    of the one MTP layer. O(S) rows copied."""
    st = mtp.state
    return (st.kv[0, seat], st.index_keys[0, seat], st.lengths[seat], mtp.draft[seat],
            mtp.hidden[seat])


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_mtp_seat(mtp: MTPSeats, seat, kv, keys, length, draft, hidden) -> MTPSeats:
    """`mtp` with seat `seat`'s state set (the inverse of `_mtp_seat`); donated, in place."""
    st = mtp.state
    state = dataclasses.replace(st, kv=st.kv.at[0, seat].set(kv),
                                index_keys=st.index_keys.at[0, seat].set(keys),
                                lengths=st.lengths.at[seat].set(length))
    return MTPSeats(state=state, draft=mtp.draft.at[seat].set(draft),
                    hidden=mtp.hidden.at[seat].set(hidden.astype(mtp.hidden.dtype)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_mtp(mtp: MTPSeats, mask) -> MTPSeats:
    """`mtp` with the seats of `mask` empty (length 0: nothing is read past a length). O(B)."""
    state = dataclasses.replace(mtp.state, lengths=jnp.where(mask, 0, mtp.state.lengths))
    return dataclasses.replace(mtp, state=state)


@jax.jit
def _seat_rows(kv, index_keys, lengths, seat):
    """Seat `seat`'s rows: kv [L, B, S, D+R] -> [L, S, D+R], index_keys [G, B, S, N] ->
    [G, S, N], and its length. O(L S) rows copied."""
    return (jax.lax.dynamic_index_in_dim(kv, seat, 1, keepdims=False),
            jax.lax.dynamic_index_in_dim(index_keys, seat, 1, keepdims=False), lengths[seat])


@functools.partial(jax.jit, static_argnames=("access",))
def _page_rows(host_kv, key_pool, row, *, access: str):
    """One request's rows read through its first pages row [p]: host_kv [L, F, Z, D+R] ->
    [L, p Z, D+R] on the device (`load_history`: whole pages, host to device), key_pool [G, F,
    Z, N] -> [G, p Z, N]. O(L p Z) rows moved."""
    on_host = in_host_memory(host_kv)
    table = row[None]
    kv = jnp.stack([load_history(host_kv, table, layer, history_pages=row.shape[0],
                                 on_host=on_host, access=access)[0]
                    for layer in range(host_kv.shape[0])])
    keys = jnp.stack([read_pool_keys(key_pool, table, g)[0] for g in range(key_pool.shape[0])])
    return kv, keys


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_resident_seat(kv, index_keys, seat_kv, seat_keys, seat):
    """Seat `seat` of a resident state with its first min(S, S') rows from seat_kv [L, S',
    D+R] and seat_keys [G, S', N] (kv [L, B, S, D+R], index_keys [G, B, S, N]; the rows past
    the request's length are never read). O(L S) rows written; the state is donated."""
    width = min(kv.shape[2], seat_kv.shape[1])
    zero = jnp.zeros((), jnp.int32)

    def put(old, new):
        rows = new[:, None, :width].astype(old.dtype)
        return jax.lax.dynamic_update_slice(old, rows, (zero, seat, zero, zero))

    return put(kv, seat_kv), put(index_keys, seat_keys)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_seat_rows(host_kv, key_pool, kv, keys, row, length):
    """Write one request's first `length` rows into the pools through its page-table row
    [P]: kv [L, S, D+R] into host_kv [L, F, Z, D+R], keys [G, S, N] into key_pool [G, F, Z, N]
    (positions >= length, or in pages not held, are dropped). O(L S) rows written; the pools
    are donated (updated in place)."""
    on_host = in_host_memory(host_kv)
    positions = jnp.arange(kv.shape[1], dtype=jnp.int32)
    write_pos = jnp.where(positions < length, positions, -1)[None]  # [1, S]; -1: dropped
    table = row[None]
    for layer in range(kv.shape[0]):
        host_kv = write_back_rows(host_kv, table, layer, kv[layer][None], write_pos,
                                  on_host=on_host)
    for g in range(keys.shape[0]):
        key_pool = write_pool_keys(key_pool, table, g, keys[g][None], write_pos)
    return host_kv, key_pool


__all__ = ["Engine", "FINISH_REASONS", "MAX_LOGPROBS", "RequestOutput", "SeatExport",
           "TokenLogprobs"]

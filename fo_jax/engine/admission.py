"""Admission by memory: whether a request runs now, waits, or can never run; the waiting queue;
which running request to preempt under pressure.

Pure Python. `MemoryCosts` (`from_config`) cuts the planner's bytes
(`fo_jax.plan.offload_request_bytes`, behind `fo-jax plan`) into a fixed part per running
request (its seat), a part per page of Z tokens (device and host), and a part per prompt page
while prefilling; the engine charges its device budget with it. `Admission` is a ledger over
those costs: `submit` / `decide` return a `Decision` (`Verdict` admit, wait or refuse, with the
figures), `schedule` admits from the queue (`order` "fifo" or "shortest"; `reserve` "full" or
"prompt"), `grow`, `preempt` / `victim` (the request admitted last) and `finish`. The engine
uses `MemoryCosts`, `RequestRefused`, `ORDERS` and `RESERVES`, not the `Admission` ledger.

Contracts: the ledger charges every request for all of its pages, so the real use is never
above it and, with reserve="full", an admitted request never finds the pools short. A request
that cannot fit an idle engine, or whose context exceeds `max_seq_len`, is refused. Costs:
every method O(1) or O(requests it admits), except `schedule` with order="shortest"
(O(Q log Q)), `victim` and `running` (O(requests known)) and `finish` of a queued request
(O(Q)). Not thread-safe. The byte formulas and the rules: docs/design/engine.md,
"Admission by memory".
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable

from fo_jax.config import ModelConfig
from fo_jax.offload.config import MEMORY_KINDS, check_hot_slots, check_num_buffers
from fo_jax.plan import offload_request_bytes

ORDERS = ("fifo", "shortest")
RESERVES = ("full", "prompt")


class RequestRefused(ValueError):
    """A request that can never run with these budgets (the message gives the figures)."""


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclasses.dataclass(frozen=True)
class MemoryCosts:
    """The bytes of one request of paged offloaded serving, per seat and per page.

    Attributes:
      page_size: Z, tokens per page (also the tail block).
      hot_slots: C, hot-cache slots per layer and request.
      num_buffers: full-layer device buffers of the offloaded prefill.
      max_context: the model's max_seq_len: the longest request.
      seat_device_bytes: hot cache + tails + slot_to_token, device, per running request.
      page_device_bytes: indexer keys + token_to_slot of one page, device.
      page_host_bytes: KV of one page in every layer, host.
      page_prefill_bytes: prefill-buffer rows of one prompt page, device, while prefilling.
      pool_memory: where the KV page pool lives: "pinned_host" (offloaded: a page's KV is host
        memory) or "device" (the paged KV on the device: a page's KV is device memory too).
    """

    page_size: int
    hot_slots: int
    num_buffers: int
    max_context: int
    seat_device_bytes: int
    page_device_bytes: int
    page_host_bytes: int
    page_prefill_bytes: int
    pool_memory: str = "pinned_host"

    def __post_init__(self):
        if self.pool_memory not in MEMORY_KINDS:
            raise ValueError(f"pool_memory={self.pool_memory!r} must be one of {MEMORY_KINDS} "
                             "(where the KV page pool lives)")

    @classmethod
    def from_config(cls, config: ModelConfig, *, page_size: int, hot_slots: int,
                    num_buffers: int = 4, pool_memory: str = "pinned_host") -> MemoryCosts:
        """The costs of `config` served with pages of `page_size` tokens and `hot_slots` hot
        slots, from `fo_jax.plan.offload_request_bytes`, with the page pool in `pool_memory`
        ("pinned_host", or "device": `OffloadConfig.host_memory_kind`).

        Raises:
          ValueError: page_size < 1, hot_slots / num_buffers break the decode or prefill
            rule (`check_hot_slots`, `check_num_buffers`), or an unknown pool_memory
            (`__post_init__`).
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        _check_int("page_size", page_size, 1)
        _check_int("hot_slots", hot_slots, 1)
        check_hot_slots(hot_slots, config)
        num_buffers = check_num_buffers(num_buffers, config.num_layers)
        kwargs = dict(hot_slots=hot_slots, tail_block=page_size, num_buffers=num_buffers)
        fixed = offload_request_bytes(config, 0, **kwargs)  # S = 0: the per-request parts
        page = offload_request_bytes(config, page_size, **kwargs)  # S = Z: adds one page
        return cls(
            page_size=page_size,
            hot_slots=hot_slots,
            num_buffers=num_buffers,
            max_context=config.max_seq_len,
            seat_device_bytes=fixed.device_decode,
            page_device_bytes=page.index_keys + page.token_to_slot,
            page_host_bytes=page.host_kv,
            page_prefill_bytes=page.prefill_buffers,
            pool_memory=pool_memory,
        )

    def pages(self, num_tokens: int) -> int:
        """Pages holding `num_tokens` tokens: ceil(num_tokens / Z)."""
        return _pages(num_tokens, self.page_size)

    @property
    def pool_on_device(self) -> bool:
        """The KV page pool lives in device memory (the paged KV on the device)."""
        return self.pool_memory == "device"

    @property
    def held_page_device_bytes(self) -> int:
        """Device bytes of one page held: its indexer keys and slot map, + its KV rows of every
        layer (Z * L * (D + R) * bytes) when the pool is on the device."""
        return self.page_device_bytes + (self.page_host_bytes if self.pool_on_device else 0)

    @property
    def held_page_host_bytes(self) -> int:
        """Host bytes of one page held: its KV rows of every layer; 0 with the pool on the
        device."""
        return 0 if self.pool_on_device else self.page_host_bytes

    @property
    def page_label(self) -> str:
        """What a page's device bytes are, for messages."""
        return "KV and indexer-key pages" if self.pool_on_device else "indexer-key pages"

    def device_need(self, prompt_len: int, pages: int, *,
                    prefilling: bool = True) -> tuple[int, int, int]:
        """(seat, prefill buffers, pages): the device bytes of one request of `prompt_len`
        prompt tokens holding `pages` pages: hot cache + tails + slot map of its seat, prefill
        layer buffers for its prompt pages (0 once `prefilling` is over), and `pages` x
        `held_page_device_bytes`. The one place the engine and the ledger add device bytes
        up. O(1)."""
        prefill = self.pages(prompt_len) * self.page_prefill_bytes if prefilling else 0
        return self.seat_device_bytes, prefill, pages * self.held_page_device_bytes


@dataclasses.dataclass(frozen=True)
class Request:
    """What admission needs to know of a request.

    Attributes:
      request_id: any hashable id, unique among the requests the admission knows.
      prompt_len: p, prompt tokens (>= 1).
      max_new_tokens: m, the most tokens it generates (>= 0).
    """

    request_id: Hashable
    prompt_len: int
    max_new_tokens: int

    def __post_init__(self):
        _check_int("prompt_len", self.prompt_len, 1)
        _check_int("max_new_tokens", self.max_new_tokens, 0)

    @property
    def context(self) -> int:
        """p + m: the most tokens the request ever holds."""
        return self.prompt_len + self.max_new_tokens


class Verdict(enum.Enum):
    ADMIT = "admit"
    WAIT = "wait"
    REFUSE = "refuse"


@dataclasses.dataclass(frozen=True)
class Decision:
    """The verdict on one request and the figures behind it.

    Attributes:
      verdict: admit now, wait, or refuse.
      device_bytes: device bytes the request needs now (0 for a refused one: see the reason).
      host_bytes: host bytes it needs now.
      reason: a sentence with the figures ("" when admitted).
    """

    verdict: Verdict
    device_bytes: int
    host_bytes: int
    reason: str


@dataclasses.dataclass
class _Entry:
    request: Request
    arrival: int
    pages: int = 0  # pages charged (device and host)
    prefilled: bool = False
    seated: bool = False
    preempted: bool = False
    admitted_at: int = -1  # admission (or resume) counter: the victim rule


def _b(num_bytes: int) -> str:
    return f"{num_bytes:,} B"


class Admission:
    """The ledger of device and host bytes, the waiting queue and the preemption rule.

    Lifecycle of a request: `submit` (queued, or `RequestRefused`) -> `schedule` returns it
    when admitted (it holds a seat and is prefilling) -> `finish_prefill` -> `grow` as it
    decodes (reserve="prompt") -> `finish` (done or cancelled, in any state). `preempt` takes a
    running request's seat (pages kept) and queues it first; `schedule` resumes it.
    """

    def __init__(self, costs: MemoryCosts, *, device_budget_bytes: int, host_budget_bytes: int,
                 max_seats: int, order: str = "fifo", reserve: str = "full"):
        """
        Args:
          costs: the bytes per seat and per page (`MemoryCosts.from_config`).
          device_budget_bytes: device bytes for request state (weights and activations
            excluded), as `fo-jax plan --budget-gb` counts it.
          host_budget_bytes: host bytes for the KV pool.
          max_seats: B, requests running at once (rows of the page table).
          order: "fifo" or "shortest" (docs/design/engine.md, "Admission by memory").
          reserve: "full" or "prompt" (docs/design/engine.md, "Admission by memory").
        """
        if not isinstance(costs, MemoryCosts):
            raise ValueError(f"costs must be a MemoryCosts, got {type(costs).__name__}")
        self.costs = costs
        self.device_budget_bytes = _check_int("device_budget_bytes", device_budget_bytes, 0)
        self.host_budget_bytes = _check_int("host_budget_bytes", host_budget_bytes, 0)
        self.max_seats = _check_int("max_seats", max_seats, 1)
        if order not in ORDERS:
            raise ValueError(f"order={order!r} must be one of {ORDERS}")
        if reserve not in RESERVES:
            raise ValueError(f"reserve={reserve!r} must be one of {RESERVES}")
        self.order = order
        self.reserve = reserve
        self._entries: dict[Hashable, _Entry] = {}
        self._waiting: list[Hashable] = []  # new requests, arrival order
        self._resume: list[Hashable] = []  # preempted requests, preemption order
        self._seated = 0
        self._device = 0
        self._host = 0
        self._arrivals = 0
        self._admissions = 0

    # -- figures -------------------------------------------------------------------------------

    @property
    def used_device_bytes(self) -> int:
        return self._device

    @property
    def used_host_bytes(self) -> int:
        return self._host

    @property
    def free_seats(self) -> int:
        return self.max_seats - self._seated

    @property
    def num_pool_pages(self) -> int:
        """Pages the host budget buys: the size of a `PagePool` that matches this ledger."""
        return self.host_budget_bytes // self.costs.page_host_bytes

    @property
    def running(self) -> tuple[Hashable, ...]:
        """Ids of the requests holding a seat, in admission order. O(R log R), R requests
        known."""
        seated = [e for e in self._entries.values() if e.seated]
        return tuple(e.request.request_id for e in sorted(seated, key=lambda e: e.admitted_at))

    @property
    def waiting(self) -> tuple[Hashable, ...]:
        """Ids of the queued requests in the order `schedule` considers them. O(Q), or
        O(Q log Q) with order="shortest"."""
        return tuple(self._resume) + tuple(self._ordered_waiting())

    def pages_charged(self, request_id: Hashable) -> int:
        return self._entry(request_id).pages

    # -- the rules -----------------------------------------------------------------------------

    def _initial_pages(self, request: Request) -> int:
        tokens = request.context if self.reserve == "full" else request.prompt_len + 1
        return self.costs.pages(min(tokens, request.context))

    def _seat_bytes(self, request: Request, prefilling: bool) -> int:
        seat, prefill, _ = self.costs.device_need(request.prompt_len, 0, prefilling=prefilling)
        return seat + prefill

    def need(self, request: Request) -> tuple[int, int]:
        """(device, host) bytes a new `request` takes when admitted: its seat, its prefill
        buffers and the pages `reserve` charges at admission."""
        pages = self._initial_pages(request)
        return (self._seat_bytes(request, prefilling=True)
                + pages * self.costs.held_page_device_bytes,
                pages * self.costs.held_page_host_bytes)

    def decide(self, request: Request) -> Decision:
        """Admit now, wait or refuse `request` (not yet known to this admission). O(1)."""
        costs = self.costs
        if request.context > costs.max_context:
            return Decision(Verdict.REFUSE, 0, 0, (
                f"request {request.request_id!r} can never fit: prompt_len={request.prompt_len}"
                f" + max_new_tokens={request.max_new_tokens} = {request.context} tokens exceed "
                f"the model's max_seq_len={costs.max_context}"))
        # Alone on an idle engine, at its largest: all its pages and its prefill buffers.
        pages = costs.pages(request.context)
        seat, prefill, page_bytes = costs.device_need(request.prompt_len, pages)
        alone_device = seat + prefill + page_bytes
        alone_host = pages * costs.held_page_host_bytes
        if alone_device > self.device_budget_bytes or alone_host > self.host_budget_bytes:
            return Decision(Verdict.REFUSE, 0, 0, (
                f"request {request.request_id!r} can never fit: {request.context} tokens "
                f"({pages} pages of {costs.page_size}) need {_b(alone_device)} of device memory"
                f" (seat {_b(costs.seat_device_bytes)} + prefill buffers {_b(prefill)} + "
                f"{costs.page_label} {_b(page_bytes)}) against a budget of "
                f"{_b(self.device_budget_bytes)}, and {_b(alone_host)} of host memory (KV pages)"
                f" against a budget of {_b(self.host_budget_bytes)}; shorten the prompt or "
                "max_new_tokens, or raise the budgets"))
        device, host = self.need(request)
        return self._fits(request.request_id, device, host)

    def _fits(self, request_id, device: int, host: int) -> Decision:
        free_device = self.device_budget_bytes - self._device
        free_host = self.host_budget_bytes - self._host
        if self.free_seats and device <= free_device and host <= free_host:
            return Decision(Verdict.ADMIT, device, host, "")
        return Decision(Verdict.WAIT, device, host, (
            f"request {request_id!r} waits: it needs {_b(device)} of device memory "
            f"({_b(free_device)} free) and {_b(host)} of host memory ({_b(free_host)} free), "
            f"and a seat ({self.free_seats} of {self.max_seats} free)"))

    # -- the queue -----------------------------------------------------------------------------

    def submit(self, request: Request) -> Decision:
        """Queues `request` (admitted by a later `schedule` once it fits) and returns the
        verdict on its memory alone (with order="fifo" it may still wait behind earlier
        requests). O(1).

        Raises:
          RequestRefused: it can never fit; nothing is queued.
          ValueError: its id is already known.
        """
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        if request.request_id in self._entries:
            raise ValueError(f"request id {request.request_id!r} is already queued or running")
        decision = self.decide(request)
        if decision.verdict is Verdict.REFUSE:
            raise RequestRefused(decision.reason)
        self._entries[request.request_id] = _Entry(request, arrival=self._arrivals)
        self._arrivals += 1
        self._waiting.append(request.request_id)
        return decision

    def _ordered_waiting(self) -> list[Hashable]:
        if self.order == "fifo":
            return list(self._waiting)
        return sorted(self._waiting, key=lambda i: (self._entries[i].request.context,
                                                    self._entries[i].arrival))

    def schedule(self) -> list[Request]:
        """Admits queued requests while they fit: preempted ones first (they resume), then new
        ones in `order`; stops at the first that does not fit. Returns the admitted requests in
        admission order (each now holds a seat; a new one is prefilling). O(admitted), or
        O(Q log Q) with order="shortest"."""
        admitted = []
        while self._resume:
            entry = self._entries[self._resume[0]]
            device = self._seat_bytes(entry.request, prefilling=not entry.prefilled)
            if self._fits(entry.request.request_id, device, 0).verdict is not Verdict.ADMIT:
                return admitted
            self._resume.pop(0)
            entry.preempted = False
            self._seat(entry, device)
            admitted.append(entry.request)
        queue = self._ordered_waiting()
        for request_id in queue:
            entry = self._entries[request_id]
            device, host = self.need(entry.request)
            if self._fits(request_id, device, host).verdict is not Verdict.ADMIT:
                break
            entry.pages = self._initial_pages(entry.request)
            self._host += host
            self._seat(entry, device)
            admitted.append(entry.request)
        if admitted:
            done = {r.request_id for r in admitted}
            self._waiting = [i for i in self._waiting if i not in done]
        return admitted

    def _seat(self, entry: _Entry, device: int) -> None:
        entry.seated = True
        entry.admitted_at = self._admissions
        self._admissions += 1
        self._seated += 1
        self._device += device

    # -- running requests ----------------------------------------------------------------------

    def _entry(self, request_id) -> _Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise ValueError(f"unknown request id {request_id!r}: not queued or running")
        return entry

    def _running(self, request_id, action: str) -> _Entry:
        entry = self._entry(request_id)
        if not entry.seated:
            raise ValueError(f"{action} of request {request_id!r}, which is not running (queued"
                             " or preempted)")
        return entry

    def finish_prefill(self, request_id: Hashable) -> None:
        """The request's prefill is done: its prefill buffers are released. O(1)."""
        entry = self._running(request_id, "finish_prefill")
        if entry.prefilled:
            raise ValueError(f"finish_prefill of request {request_id!r} twice")
        entry.prefilled = True
        self._device -= self._seat_bytes(entry.request, True) - self._seat_bytes(
            entry.request, False)

    def grow(self, request_id: Hashable, num_tokens: int) -> bool:
        """Charges the pages `num_tokens` tokens need (call before growing the request's pages).
        Returns False, changing nothing, when they do not fit the budgets: preempt `victim()`
        and try again, or wait for requests to finish. Preemption keeps pages, so it frees seat
        bytes, not page bytes: with reserve="prompt", requests preempted while holding pages
        can leave a growing request short for good (every running request preempted, none
        able to grow); a scheduler using reserve="prompt" needs a way to drop a preempted
        request's pages (recompute it later), which this ledger does not do yet. reserve="full"
        never returns False. O(1).

        Raises:
          ValueError: not running, or num_tokens beyond its prompt_len + max_new_tokens.
        """
        entry = self._running(request_id, "grow")
        request = entry.request
        if num_tokens > request.context:
            raise ValueError(f"grow of request {request_id!r} to {num_tokens} tokens, beyond "
                             f"prompt_len + max_new_tokens = {request.context}")
        more = max(0, self.costs.pages(num_tokens) - entry.pages)
        device = more * self.costs.held_page_device_bytes
        host = more * self.costs.held_page_host_bytes
        if (self._device + device > self.device_budget_bytes
                or self._host + host > self.host_budget_bytes):
            return False
        entry.pages += more
        self._device += device
        self._host += host
        return True

    def victim(self) -> Hashable | None:
        """The running request to preempt under pressure: the one admitted (or resumed) last;
        None when nothing runs. O(requests known)."""
        seated = [e for e in self._entries.values() if e.seated]
        if not seated:
            return None
        return max(seated, key=lambda e: e.admitted_at).request.request_id

    def preempt(self, request_id: Hashable | None = None) -> Hashable:
        """Takes the seat of `request_id` (default: `victim()`): its seat and prefill bytes are
        released, its pages stay charged (the pages are kept), and it is queued ahead of every
        new request. Returns its id. O(1) (+ O(running) to pick the victim).

        Raises:
          ValueError: nothing runs, or the request is not running.
        """
        if request_id is None:
            request_id = self.victim()
            if request_id is None:
                raise ValueError("preempt with no running request")
        entry = self._running(request_id, "preempt")
        self._device -= self._seat_bytes(entry.request, prefilling=not entry.prefilled)
        self._seated -= 1
        entry.seated = False
        entry.preempted = True
        self._resume.append(request_id)
        return request_id

    def finish(self, request_id: Hashable) -> None:
        """The request is done or cancelled, wherever it is (running, preempted, queued):
        everything charged to it is released. O(1) (+ O(queue) to leave the queue)."""
        entry = self._entry(request_id)
        if entry.seated:
            self._device -= self._seat_bytes(entry.request, prefilling=not entry.prefilled)
            self._seated -= 1
        elif entry.preempted:
            self._resume.remove(request_id)
        else:
            self._waiting.remove(request_id)
        self._device -= entry.pages * self.costs.held_page_device_bytes
        self._host -= entry.pages * self.costs.held_page_host_bytes
        del self._entries[request_id]

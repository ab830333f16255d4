"""The engine driver: one thread owns the `Engine` (and the device); HTTP handlers talk to it
through queues.

    driver = EngineDriver(engine, max_queue=64)
    driver.start()
    handle = driver.submit(prompt_ids, loop=asyncio.get_running_loop(), max_tokens=16, ...)
    handles = driver.submit_choices(prompt_ids, loop=..., choices=[dict(seed=s + i, ...) ...])
    first = await handle.queue.get()      # Accepted(request_id) or Refused(message)
    out = await handle.queue.get()        # RequestOutput ... until out.finished
    driver.cancel(handle.request_id)      # e.g. the client went away
    driver.stop(timeout=10)               # cancel what is left, join the thread

Failures: an exception `add_request` raises for one request fails that request alone (a
ValueError is a refusal, HTTP 400; anything else HTTP 500); the engine thread ends only when
`step()` raises (a fault of the engine's own state): every request in flight gets `Failed`, the
driver stops accepting and calls `on_failure` (the server then shuts down and the process
exits non-zero).

Threads: `submit`, `cancel`, `stop_accepting`, `begin_shutdown` and `stop` may be called from
any thread (the event loop's); they only put commands on a `queue.Queue`. The engine thread
applies every pending command between two `Engine.step()` calls, then steps while anything is
unfinished, and blocks on the command queue when idle (no busy loop). Outputs go back to each
request's `asyncio.Queue` with `loop.call_soon_threadsafe`; a finished request is released from
the engine at once (its id can be used again).

Backpressure: at most `max_queue` requests wait for a seat (commands not yet applied plus the
engine's own waiting list, less the seats free after the last step: a burst that free seats
will take does not wait); `submit` refuses the next one with `QueueFull` at once, in the
caller's thread, so that the server answers 429 without waiting for the engine thread. (A
request that a free seat cannot take yet because the page pool is short waits too, uncounted:
the bound is then max_queue plus those.)

Choices (`submit_choices`: n requests of one prompt, OpenAI's `n`): counted by the bound as
one burst (all are queued or none), each told `Accepted` at once. When the engine has a prefix
cache that can share the prompt (`Engine.prefix` set, and a whole prefill chunk
before the prompt's last token: `Engine.chunk`), the first is added at once and the others
once it has sampled its first token: its prompt's whole chunks are in the cache by then, so
each of the others maps them and prefills only the rest (the prompt is prefilled once). Else
(no prefix cache, a short prompt, an engine without these attributes: `AutoEngine`,
`DataParallelEngine`) all are added at once, each prefilling the prompt.

Costs: per step O(requests that moved) callbacks onto the event loop; the engine's counters and
offload statistics (`engine.stats`: one device-to-host read, summed in total and per indexer
group) are copied into `snapshot` every `stats_every` steps and whenever the engine goes idle,
not per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np

logger = logging.getLogger("fo_jax.server")


class QueueFull(Exception):
    """`max_queue` requests already wait for a seat (HTTP 429)."""


class NotAccepting(Exception):
    """The driver is shutting down or has stopped (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Accepted:
    """First item of a request's queue: the engine queued it."""
    request_id: str


@dataclasses.dataclass(frozen=True)
class Refused:
    """First item of a request's queue: `Engine.add_request` raised ValueError (HTTP 400)."""
    message: str


@dataclasses.dataclass(frozen=True)
class Failed:
    """No more outputs (HTTP 500): the engine thread failed (`engine`: an exception in
    `step()`, a fault of the engine's own state), or this request alone did (not `engine`:
    `add_request` raised something other than a refusal, or refused a choice that waited for
    its first one (`submit_choices`) after it was accepted; the engine goes on)."""
    message: str
    engine: bool = True


@dataclasses.dataclass
class RequestHandle:
    """A submitted request as the handler sees it: read `queue` until a finished output."""
    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float
    kwargs: dict
    prompt: list[int]
    first_token_at: float | None = None
    last_token_at: float | None = None

    def put(self, item) -> None:
        """Hand an item to the handler's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclasses.dataclass
class Snapshot:
    """What the engine thread last published (read by /metrics and /health)."""
    running: int = 0
    waiting: int = 0
    counters: dict = dataclasses.field(default_factory=dict)
    offload: dict = dataclasses.field(default_factory=dict)
    pool: dict = dataclasses.field(default_factory=dict)  # pages: free, held, cached, total
    groups: dict = dataclasses.field(default_factory=dict)  # fo_jax.engine.metrics.group_totals
    page_bytes: dict = dataclasses.field(default_factory=dict)  # per pool: bytes of one page


def offload_totals(stats) -> dict:
    """Sums of the engine's `LoopStats` (one device-to-host read): hits, tail_hits, misses,
    union (rows copied), h2d_bytes, d2h_bytes. Empty before the first offloaded decode call."""
    if stats is None:
        return {}
    import jax

    host = jax.device_get(stats)
    return {name: float(np.asarray(getattr(host, name), np.float64).sum())
            for name in ("hits", "tail_hits", "misses", "union", "h2d_bytes", "d2h_bytes")}


class EngineDriver:
    """Runs an `Engine` in one dedicated thread (see the module doc).

    Args:
      engine: a `fo_jax.engine.Engine`; nothing else may touch it once `start` ran.
      max_queue: requests that may wait for a seat; the next is refused with `QueueFull`.
      stats_every: publish the engine counters and offload statistics every this many steps.
      on_output: called in the engine thread with (handle, RequestOutput, now) for each output
        before it is handed over (metrics: TTFT, inter-token latency, finish counters).
      on_failure: called in the engine thread once it has failed (after every request in
        flight got `Failed`).
    """

    def __init__(self, engine, *, max_queue: int = 64, stats_every: int = 16,
                 on_output: Callable[[RequestHandle, Any, float], None] | None = None,
                 on_failure: Callable[[], None] | None = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r} must be an int >= 0")
        if not isinstance(stats_every, int) or stats_every < 1:
            raise ValueError(f"stats_every={stats_every!r} must be an int >= 1")
        self.engine = engine
        self.max_queue, self.stats_every = max_queue, stats_every
        self.on_output, self.on_failure = on_output, on_failure
        self.snapshot = Snapshot()
        self.failure: str | None = None
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending_adds = 0      # submitted, not yet applied by the engine thread
        self._engine_waiting = 0    # engine.num_waiting() after the last command / step
        self._free_seats = int(engine.seats)  # seats - engine.num_running(), likewise
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._drain_timer: threading.Timer | None = None
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        # Choices waiting for their first choice's prefill (engine thread only): first
        # choice's id -> the handles of the others, not yet added (counted in _pending_adds).
        self._later: dict[str, list[RequestHandle]] = {}
        from fo_jax.engine.metrics import page_bytes

        self._page_bytes = page_bytes(engine)

    # Any thread --------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self._accepting and self.failure is None and self.alive

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the driver was started already")
        self._thread = threading.Thread(target=self._run, name="fo-jax-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], *, loop: asyncio.AbstractEventLoop,
               **kwargs) -> RequestHandle:
        """Queue a request for the engine (kwargs: `Engine.add_request`'s). Raises
        `NotAccepting` (shutting down) or `QueueFull` (`max_queue` already waiting, beyond
        the free seats) at once."""
        return self.submit_choices(prompt, loop=loop, choices=[kwargs])[0]

    def submit_choices(self, prompt: list[int], *, loop: asyncio.AbstractEventLoop,
                       choices: list[dict]) -> list[RequestHandle]:
        """Queue one request per entry of `choices` (each `Engine.add_request`'s kwargs) for
        the same prompt, as one burst: all are queued or none (see the module doc for how they
        share the prompt's prefill). Raises ValueError (more choices than the seats and the
        queue can ever hold), `NotAccepting` or `QueueFull` at once."""
        n = len(choices)
        if n < 1 or n > self.engine.seats + self.max_queue:
            raise ValueError(
                f"n={n} choices can never be queued at once: this server has "
                f"{self.engine.seats} seats and --max-queue {self.max_queue} (at most "
                f"{self.engine.seats + self.max_queue} choices per request)")
        with self._lock:
            if not self.accepting:
                raise NotAccepting(self.failure or "the server is shutting down")
            waiting = self._pending_adds + self._engine_waiting - self._free_seats + n - 1
            if waiting >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests already wait for a seat "
                                f"(--max-queue {self.max_queue}): retry later")
            self._pending_adds += n
            handles = [RequestHandle(f"cmpl-{uuid.uuid4().hex}", asyncio.Queue(), loop,
                                     time.perf_counter(), kwargs, list(prompt))
                       for kwargs in choices]
            # Under the lock: an accepted add is queued before `stop_accepting` returns, so
            # before the cancel-all of `begin_shutdown` (which would miss it).
            self._commands.put(("add", handles))
        return handles

    def cancel(self, request_id: str) -> None:
        """Cancel a request (no-op if it finished or was refused); its seat is freed by the
        engine thread before its next step."""
        self._commands.put(("cancel", request_id))

    def stop_accepting(self) -> None:
        """New requests are refused with `NotAccepting` from now on."""
        with self._lock:
            self._accepting = False

    def begin_shutdown(self, timeout: float) -> None:
        """Stop accepting; in `timeout` seconds cancel whatever is still in flight (each
        client then gets its final output, finish_reason "cancelled"). Returns at once."""
        self.stop_accepting()
        if self._drain_timer is None:
            self._drain_timer = threading.Timer(timeout, self._commands.put,
                                                (("cancel_all", None),))
            self._drain_timer.daemon = True
            self._drain_timer.start()

    def in_flight(self) -> int:
        """Requests submitted and not yet finished (approximate from other threads)."""
        with self._lock:
            return self._pending_adds + len(self._handles)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop accepting; let in-flight requests finish for up to `timeout` seconds, cancel
        the rest, stop the thread. True if the thread has exited."""
        self.stop_accepting()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        while self.alive and self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._commands.put(("stop", None))
        self._thread.join(max(1.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    # The engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        steps = 0
        try:
            while True:
                block = not engine.has_unfinished()
                if block:
                    self._publish()
                if not self._apply_commands(block=block):
                    break
                if not engine.has_unfinished():
                    continue
                outputs = engine.step()
                steps += 1
                self._count()  # before the outputs reach a handler that may submit again
                now = time.perf_counter()
                for out in outputs:
                    self._deliver(out, now)
                self._publish(stats=steps % self.stats_every == 0)
        except Exception as err:  # noqa: BLE001 - every request must hear about it
            logger.exception("the engine thread failed")
            self.failure = f"engine failure: {type(err).__name__}: {err}"
            later = [h for hs in self._later.values() for h in hs]
            for handle in list(self._handles.values()) + later:
                handle.put(Failed(self.failure))
            self._handles.clear()
            self._later.clear()
            with self._lock:
                self._pending_adds -= len(later)
        finally:
            self._stop_remaining()
        if self.failure is not None and self.on_failure is not None:
            try:
                self.on_failure()
            except Exception:  # noqa: BLE001
                logger.exception("on_failure failed")

    def _apply_commands(self, *, block: bool) -> bool:
        """Apply every pending command (wait for one if `block`); False on "stop"."""
        while True:
            try:
                kind, arg = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "cancel":
                self._cancel(arg)
            elif kind == "cancel_all":
                for request_id in list(self._handles) + self._later_ids():
                    self._cancel(request_id)

    def _later_ids(self) -> list[str]:
        return [h.request_id for later in self._later.values() for h in later]

    def _add(self, handles: list[RequestHandle]) -> None:
        """Add a burst of choices: the first now; the others now too, or, when the engine's
        prefix cache can share the prompt, once the first has sampled (`_add_later`)."""
        first, rest = handles[0], handles[1:]
        if not self._add_one(first):
            for handle in rest:  # the same prompt and settings: refused alike
                self._add_one(handle)
            return
        if rest and self._shares_prompt(first.prompt):
            self._later[first.request_id] = rest
            for handle in rest:
                handle.put(Accepted(handle.request_id))
            return
        for handle in rest:
            self._add_one(handle)

    def _shares_prompt(self, prompt: list[int]) -> bool:
        """The engine's prefix cache can map a whole prefill chunk of the prompt (it maps
        whole chunks of all but the last token)."""
        engine = self.engine
        cached = getattr(engine, "prefix", None) is not None
        chunk = getattr(engine, "chunk", None)
        return cached and chunk is not None and len(prompt) - 1 >= chunk

    def _add_later(self, first_id: str) -> None:
        """Add the choices that waited for choice `first_id` (it sampled, finished or left).
        They were told Accepted: one the engine refuses after all gets Failed."""
        for handle in self._later.pop(first_id, []):
            self._add_one(handle, announce=False)

    def _add_one(self, handle: RequestHandle, *, announce: bool = True) -> bool:
        try:
            self.engine.add_request(handle.prompt, request_id=handle.request_id,
                                    **handle.kwargs)
        except ValueError as err:
            handle.put(Refused(str(err)) if announce else Failed(
                f"the engine refused a choice of an accepted request: {err}", engine=False))
            return False
        except Exception as err:  # noqa: BLE001 - one request's error must not end the thread
            logger.exception("add_request failed for %s", handle.request_id)
            handle.put(Failed(f"request failed: {type(err).__name__}: {err}", engine=False))
            return False
        else:
            self._handles[handle.request_id] = handle
            if announce:
                handle.put(Accepted(handle.request_id))
            return True
        finally:
            with self._lock:
                self._pending_adds -= 1
            self._count()

    def _cancel(self, request_id: str) -> None:
        for later in self._later.values():  # a choice not added yet
            for handle in later:
                if handle.request_id == request_id:
                    from fo_jax.engine.engine import RequestOutput

                    later.remove(handle)
                    with self._lock:
                        self._pending_adds -= 1
                    self._deliver_to(handle, RequestOutput(
                        request_id, [], [], None, True, "cancelled", len(handle.prompt), None),
                        time.perf_counter())
                    return
        if request_id not in self._handles:
            return  # finished, refused, or never known
        self.engine.cancel(request_id)
        self._deliver(self.engine.release(request_id), time.perf_counter(), released=True)
        self._count()

    def _deliver(self, out, now: float, *, released: bool = False) -> None:
        handle = self._handles.get(out.request_id)
        if handle is None:
            return
        if out.finished:
            del self._handles[out.request_id]
            if not released:
                self.engine.release(out.request_id)
        if out.request_id in self._later and (out.new_token_ids or out.finished):
            self._add_later(out.request_id)  # its prompt's chunks are cached now
        self._deliver_to(handle, out, now)

    def _deliver_to(self, handle: RequestHandle, out, now: float) -> None:
        if self.on_output is not None:
            try:
                self.on_output(handle, out, now)
            except Exception:  # noqa: BLE001 - metrics must not stop the engine
                logger.exception("on_output failed")
        if out.new_token_ids:
            if handle.first_token_at is None:
                handle.first_token_at = now
            handle.last_token_at = now
        handle.put(out)

    def _count(self) -> None:
        """The engine's waiting requests and free seats, for `submit`'s bound."""
        engine = self.engine
        waiting, free = engine.num_waiting(), engine.seats - engine.num_running()
        with self._lock:
            self._engine_waiting, self._free_seats = waiting, free

    def _publish(self, stats: bool = True) -> None:
        engine = self.engine
        self._count()
        occupancy = getattr(engine, "pool_occupancy", None)
        snap = Snapshot(running=engine.num_running(), waiting=engine.num_waiting(),
                        counters=self.snapshot.counters, offload=self.snapshot.offload,
                        pool=(occupancy() or {}) if occupancy is not None else {},
                        groups=self.snapshot.groups, page_bytes=self._page_bytes)
        if stats:
            snap.counters = dict(engine.counters)
            loop_stats = getattr(engine, "stats", None)
            if loop_stats is not None:
                import jax

                from fo_jax.engine.metrics import group_totals

                loop_stats = jax.device_get(loop_stats)  # the one device-to-host read
                snap.groups = group_totals(loop_stats)
            snap.offload = offload_totals(loop_stats)
        self.snapshot = snap

    def _stop_remaining(self) -> None:
        """Cancel every request still known (the thread is ending) and refuse pending adds."""
        with self._lock:
            self._accepting = False
        for request_id in list(self._handles) + self._later_ids():
            try:
                self._cancel(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("cancel %s failed", request_id)
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                with self._lock:
                    self._pending_adds -= len(arg)
                for handle in arg:
                    handle.put(Failed(self.failure or "the server is shutting down"))
        try:
            self._publish()
        except Exception:  # noqa: BLE001
            logger.exception("final publish failed")


__all__ = ["Accepted", "EngineDriver", "Failed", "NotAccepting", "QueueFull", "Refused",
           "RequestHandle", "Snapshot", "offload_totals"]

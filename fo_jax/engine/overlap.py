"""Host work overlapped with the device: the decode call in flight, and the device's clock.

    call = runner.dispatch(running, logprobs=None)   # returns at once: JAX dispatch is async
    ...                                              # the host reads call n - 1 meanwhile
    tokens = call.tokens()                           # waits for the device if not done yet
    clock.end(call.work, call.ready_at, timings)     # what the device did, and when it waited

With `overlap` on (`SchedulerSettings.overlap`), `Engine.step` dispatches decode call n + 1
before it reads back call n's tokens: the tokens, stop flags and counts stay on the device
between calls, so the engine's scheduling, page tables, detokenizing and the caller's
streaming run while the device computes. An `InFlight` is one dispatched call: its outputs
(on the device), the seat -> request map it was dispatched with (the host learns what a seat
produced one call later, and attributes it to the request that sat there then), and the
lengths and done flags it left (copied before the next call takes the state). The rules the
engine keeps so that every request's tokens stay those of its solo run, bit for bit:
docs/design/engine.md, "Overlap".

`DeviceClock` measures how long the device waits for the host: every program group of a
step (the prefill chunks, a decode call) is one interval from its dispatch (or the end of
the work before it, if later) to the moment its results were ready; the gaps between them
are the device's idle time. A background thread (`watch`) notes when each decode call becomes
ready (with or without overlap: one measure), so a call that finished long before the host
read it is timed right.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from fo_jax.engine.requests import RequestState


@dataclasses.dataclass
class InFlight:
    """One dispatched decode call whose results the host has not read yet.

    Attributes:
      out: the call's `fo_jax.decode_loop.LoopOutput`, on the device.
      requests: {seat: request} of the seats that ran it (decoding when it was dispatched).
      lengths: [B] the state's lengths after the call (a copy: the state is donated to the
        next program).
      done: [B] the seats' done flags after the call.
      dispatched: host clock (`time.perf_counter`) when it was dispatched.
      work: its interval on the `DeviceClock`.
      watched: whether the watcher thread notes when it is ready (`watch`).
      ready_at: host clock when its tokens were ready (set by `watch`, or by `tokens`).
    """

    out: Any
    requests: dict[int, RequestState]
    lengths: jax.Array
    done: jax.Array
    dispatched: float
    work: list | None = None
    watched: bool = False
    ready_at: float | None = None
    _ready: threading.Event = dataclasses.field(default_factory=threading.Event)

    def live(self) -> list[RequestState]:
        """The requests whose results still count: still in the seat the call ran them in,
        neither finished nor cancelled since (what a request that ended meanwhile produced is
        dropped: the device ran it masked, or for a stop string or a cancel, unmasked, and
        nothing it wrote is read again). O(seats)."""
        return [r for b, r in self.requests.items()
                if r.seat == b and r.finish_reason is None]

    def mark_ready(self, at: float) -> None:
        if self.ready_at is None:
            self.ready_at = at
        self._ready.set()

    def tokens(self) -> np.ndarray:
        """The call's tokens on the host (waits for the device); `ready_at` then set: the
        watcher's time when it saw the call finish first, else now."""
        tokens = np.asarray(self.out.tokens)
        if self.watched and not self._ready.is_set():
            # the watcher wakes with us: take its time (earlier if the call ended while the
            # host was busy); not long: it may still be waiting on another engine's call
            self._ready.wait(0.005)
        self.mark_ready(time.perf_counter())
        return tokens


class DeviceClock:
    """The device's busy and idle time, from the host's view (see the module doc).

        work = clock.begin(time.perf_counter())     # before dispatching a group of programs
        ...
        clock.end(work, ready, engine.timings)      # once its results were ready

    Work is begun in dispatch order and may end out of order (a decode call in flight ends
    when the next step reads it back, after the prefill dispatched behind it); it is counted
    in dispatch order once every earlier one ended: the device starts it at max(dispatched,
    the end of the work before) and is idle in between (timings "device_idle_s"), busy until
    it is ready ("device_busy_s"). `rest` marks the start of a busy period: the time the engine
    waited for requests is not idle time. O(1) per interval.
    """

    def __init__(self):
        self.busy_until: float | None = None
        self._work: list[list] = []  # [dispatched, ready or None], in dispatch order

    def rest(self, now: float) -> None:
        """Nothing is in flight and nothing ran before `now`: idle time counts from here."""
        if not self._work:
            self.busy_until = now if self.busy_until is None else max(self.busy_until, now)

    def begin(self, dispatched: float) -> list:
        work = [dispatched, None]
        self._work.append(work)
        return work

    def end(self, work: list, ready: float, timings: dict) -> None:
        work[1] = ready
        while self._work and self._work[0][1] is not None:
            dispatched, ready = self._work.pop(0)
            prev = dispatched if self.busy_until is None else self.busy_until
            began = max(dispatched, prev)
            timings["device_idle_s"] = timings.get("device_idle_s", 0.0) + (began - prev)
            timings["device_busy_s"] = (timings.get("device_busy_s", 0.0)
                                        + max(ready - began, 0.0))
            self.busy_until = max(ready, began)


# The watcher: one daemon thread for the process, started on first use. It blocks on each
# watched array in turn (the calls of one engine finish in dispatch order) and calls back with
# the time it became ready; it holds a reference to the array until then, nothing more.
_queue: "queue.SimpleQueue[tuple[Any, Callable[[float], None]]]" = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()


def _watch_loop() -> None:
    while True:
        array, callback = _queue.get()
        try:
            jax.block_until_ready(array)
        except Exception:  # a failed call: the engine's own read raises it
            pass
        callback(time.perf_counter())
        del array, callback


def watch(array, callback: Callable[[float], None]) -> None:
    """Call `callback(time)` from the watcher thread once `array` is ready."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_watch_loop, name="fo-jax-ready-watch",
                                       daemon=True)
            _thread.start()
    _queue.put((array, callback))


__all__ = ["DeviceClock", "InFlight", "watch"]

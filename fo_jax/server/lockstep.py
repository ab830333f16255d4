"""The engine driver across processes: one HTTP endpoint on process 0, every process stepping
one `ShardedEngine` in lockstep.

    driver = LockstepDriver(engine)      # on every process, after the same warm-up
    # process 0: the app's driver (`build_served`), its thread started by the app
    # the others: driver.follow()        # in the main thread, until process 0 stops

A `ShardedEngine` that spans processes (`engine.multiprocess`) makes collectives in `step()`,
so every process must call it at the same points; and only process 0 serves HTTP. So the
drivers tick together. Each tick:

1. Process 0 takes its pending commands (new requests, each with its sampling settings and the
   rank process 0 chose for it; cancels; stop) and every process packs the records its engine
   produced since the last tick (a request accepted, refused or failed; new tokens and the
   finish reason) into one `Tick`, as JSON bytes (`pack` / `unpack`).
2. One exchange: `fo_jax.distributed.allgather_bytes` (every process gets every `Tick`).
3. Every process applies process 0's commands to the requests of its own ranks
   (`ShardedEngine.add_request(..., rank=r, request_id=...)`, cancels of its own requests),
   and all call `step()` once when any process had a request unfinished or a request came
   (the same answer on every process: it is read from the exchanged ticks).
4. Process 0 hands every record to the HTTP handlers (`RequestHandle`s).

When no process has work, process 0 waits for a command at most `idle_s` seconds before the
next tick (at once when one comes), so idle processes do not spin: about 1 / idle_s small
all-gathers a second (20 with the default 0.05 s).

Placement (process 0, over every rank of every process): the engine's rule
(`ShardedEngine.placement`: least_context by default resident, least_misses offloaded,
least_requests, round_robin; `fo_jax.placement.assign`) on process 0's own bookkeeping of what
runs where: each request in flight, its rank and its cost, the ranks with a free seat first, as
`ShardedEngine.choose_rank` does on one process's ranks. least_context because a resident
seat's step costs grow with its context (attention over it), and a rank's decode step waits
for its longest: a request's cost is its context (prompt + tokens so far, from the records).
least_misses: its owner's estimate of its rows copied per step, sent with each output
(`Record.cost`, `ShardedEngine.placement_cost`: the estimate lives where the request's rows
are copied); before its first output, the prior of its context, calibrated by process 0's own
ranks' steps. Request ids are process 0's ("cmpl-" + a uuid), unique over
every process.

Outputs: a record carries a request's new tokens and finish reason only; process 0 keeps each
request's tokens and decodes the text with the engine's tokenizer, cut before the first stop
string (the engine's rule, `RequestState.record`: tokens after a stop string are never sent).
Log-probabilities (`logprobs=k`) go with their tokens: each new token's value and top k
(JSON writes floats exactly; -inf as -Infinity). Choices (`n`) are added at once, each placed
on its own (the sharded engine has no prefix cache to share a prompt's prefill).

Ending: process 0's "stop" command (server shutdown, after the drain) is the last tick: every
process leaves the loop, cancels what its engine still holds and returns (`follow` returns 0:
the process exits 0). A fault (an exception in a step, or a malformed tick) ends the driver on
the process where it happens without another collective (its peers may be waiting in the
step's collectives): process 0 fails its requests and its server shuts down (exit 1, saying
so); another process returns 1 from `follow` with the message. Its peers' next collective then
fails (the peer is gone: "process P lost the other processes"), which ends them the same way
(`fo_jax.server.serve.run` then leaves at once, without jax.distributed's shutdown barrier).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import time

from fo_jax.engine.requests import TokenLogprobs
from fo_jax.server.driver import (Accepted, EngineDriver, Failed, Refused, RequestHandle,
                                  Snapshot)

logger = logging.getLogger("fo_jax.server")

IDLE_S = 0.05  # seconds process 0 waits for a command between idle ticks
STOP = "stop"


@dataclasses.dataclass(frozen=True)
class AddCommand:
    """Process 0 to the owner of `rank`: add this request there (`add_request`'s kwargs)."""
    request_id: str
    rank: int
    prompt: list[int]
    kwargs: dict


@dataclasses.dataclass(frozen=True)
class CancelCommand:
    """Process 0 to every process: cancel this request (its owner does)."""
    request_id: str


@dataclasses.dataclass(frozen=True)
class Record:
    """A process to process 0: what became of one of its requests.

    Attributes:
      request_id: the request.
      event: "accepted" (queued on its rank), "refused" (`add_request` raised ValueError:
        HTTP 400), "failed" (another exception, this request alone), or "output".
      message: the refusal's or failure's text ("" otherwise).
      new_token_ids: an output's tokens sampled since the last one.
      finish_reason: an output's, None while running ("stop", "length", "cancelled").
      num_tokens: an output's tokens so far (process 0 checks its own count against it).
      logprobs: with `logprobs=k`, one `TokenLogprobs` per token of new_token_ids; else None.
      cost: an output's cost in the placement rule's unit now (`placement_cost` on its owner:
        least_misses, the owner's estimate of its rows copied per step), or None.
    """
    request_id: str
    event: str
    message: str = ""
    new_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    cost: float | None = None


EVENTS = ("accepted", "refused", "failed", "output")


@dataclasses.dataclass(frozen=True)
class Tick:
    """What one process sends at a tick.

    Attributes:
      process: its index.
      commands: process 0's, in order (`AddCommand`, `CancelCommand`); empty elsewhere.
      stop: process 0 ends the loop (every process stops after this tick).
      unfinished: the process's engine had a request unfinished when it packed the tick.
      records: what became of its requests since its last tick.
    """
    process: int
    commands: tuple = ()
    stop: bool = False
    unfinished: bool = False
    records: tuple[Record, ...] = ()


def pack(tick: Tick) -> bytes:
    """`tick` as UTF-8 JSON bytes (floats round-trip exactly: JSON writes their shortest
    repr). O(size of the tick)."""
    commands = []
    for cmd in tick.commands:
        if isinstance(cmd, AddCommand):
            commands.append({"add": cmd.request_id, "rank": cmd.rank,
                             "prompt": [int(t) for t in cmd.prompt], "kwargs": cmd.kwargs})
        elif isinstance(cmd, CancelCommand):
            commands.append({"cancel": cmd.request_id})
        else:
            raise TypeError(f"a tick's commands are AddCommand or CancelCommand, got "
                            f"{type(cmd).__name__}")
    records = [[r.request_id, r.event, r.message, [int(t) for t in r.new_token_ids],
                r.finish_reason, r.num_tokens,
                None if r.logprobs is None else [
                    [int(e.token_id), float(e.logprob), [[int(t), float(v)] for t, v in e.top]]
                    for e in r.logprobs],
                None if r.cost is None else float(r.cost)] for r in tick.records]
    # allow_nan: a log-probability may be -inf (the commands' floats are finite: add_kwargs)
    return json.dumps({"process": tick.process, "commands": commands, "stop": tick.stop,
                       "unfinished": tick.unfinished, "records": records},
                      separators=(",", ":"), allow_nan=True).encode()


def unpack(data: bytes) -> Tick:
    """The `Tick` of `pack`'s bytes. Raises ValueError naming what is malformed."""
    try:
        raw = json.loads(bytes(data).decode())
        commands = []
        for cmd in raw["commands"]:
            if "add" in cmd:
                commands.append(AddCommand(str(cmd["add"]), int(cmd["rank"]),
                                           [int(t) for t in cmd["prompt"]], dict(cmd["kwargs"])))
            else:
                commands.append(CancelCommand(str(cmd["cancel"])))
        records = []
        for rid, event, message, new, reason, count, logprobs, cost in raw["records"]:
            if event not in EVENTS:
                raise ValueError(f"event {event!r} is not one of {EVENTS}")
            if logprobs is not None:
                logprobs = tuple(TokenLogprobs(int(t), float(v), tuple(
                    (int(i), float(w)) for i, w in top)) for t, v, top in logprobs)
            records.append(Record(str(rid), event, str(message), tuple(int(t) for t in new),
                                  None if reason is None else str(reason), int(count),
                                  logprobs, None if cost is None else float(cost)))
        return Tick(int(raw["process"]), tuple(commands), bool(raw["stop"]),
                    bool(raw["unfinished"]), tuple(records))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"a malformed tick ({len(data)} bytes: {bytes(data)[:80]!r}): "
                         f"{type(err).__name__}: {err}") from None


def add_kwargs(kwargs: dict) -> dict:
    """A request's `add_request` kwargs in JSON's types (tuples as lists): what its owner
    receives, so process 0 places exactly what the owner will add."""
    return json.loads(json.dumps(kwargs, allow_nan=False))


def output_text(tokenizer, tokens: list[int], stop) -> str | None:
    """A request's text as the engine keeps it (`RequestState.record`): the tokens decoded,
    cut before the first stop string; None without a tokenizer."""
    if tokenizer is None:
        return None
    text = tokenizer.decode(tokens)
    cut = [at for at in (text.find(s) for s in stop) if at >= 0]
    return text[:min(cut)] if cut else text


@dataclasses.dataclass
class _Flight:
    """Process 0's record of a request in flight: its rank, prompt length, tokens so far."""
    rank: int
    prompt_tokens: int
    stop: tuple[str, ...]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # with logprobs=k
    cost: float | None = None  # its owner's last `placement_cost` (None: none reported yet)


class LockstepDriver(EngineDriver):
    """`EngineDriver` for a `ShardedEngine` spanning processes (see the module doc): the same
    handler-side API on process 0 (`submit_choices`, `cancel`, `begin_shutdown`, `stop`);
    `follow()` on the others.

    Args:
      engine: the ShardedEngine (the same on every process, warmed up alike).
      max_queue, stats_every: as `EngineDriver` (process 0).
      idle_s: process 0's wait for a command between idle ticks.
      exchange: bytes -> every process's bytes, in process order
        (`fo_jax.distributed.allgather_bytes`; tests pass their own).
      process: this process's index (default `jax.process_index()`).
    """

    def __init__(self, engine, *, max_queue: int = 64, stats_every: int = 16,
                 idle_s: float = IDLE_S, exchange=None, process: int | None = None,
                 on_output=None, on_failure=None):
        import jax

        from fo_jax import distributed

        super().__init__(engine, max_queue=max_queue, stats_every=stats_every,
                         on_output=on_output, on_failure=on_failure)
        if not idle_s > 0:
            raise ValueError(f"idle_s={idle_s!r} must be > 0 (seconds between idle ticks)")
        self.idle_s = float(idle_s)
        self.exchange = distributed.allgather_bytes if exchange is None else exchange
        self.process = jax.process_index() if process is None else int(process)
        self.ticks = self.steps = 0
        self._flights: dict[str, _Flight] = {}  # process 0: every request in flight
        self._turn = 0                           # process 0: round_robin's cursor
        self._mine: set[str] = set()             # requests on this process's ranks
        self._records: list[Record] = []         # to send at the next tick

    # The loop (every process) --------------------------------------------------------------

    def follow(self) -> int:
        """The loop of a process other than 0, in the calling thread, until process 0 stops
        it (0) or a fault ends it (1, `failure` says why)."""
        if self.process == 0:
            raise RuntimeError("process 0 serves: its loop runs in the driver's thread "
                               "(start), not in follow()")
        try:
            self._loop()
        except Exception as err:  # noqa: BLE001 - the process must end, saying why
            logger.exception("the engine loop failed")
            self.failure = f"engine failure: {type(err).__name__}: {err}"
        finally:
            self._cancel_mine()
        return 0 if self.failure is None else 1

    def _run(self) -> None:  # process 0's driver thread
        try:
            self._loop()
        except Exception as err:  # noqa: BLE001 - every request must hear about it
            logger.exception("the engine loop failed")
            self.failure = f"engine failure: {type(err).__name__}: {err}"
            for handle in list(self._handles.values()):
                handle.put(Failed(self.failure))
            self._handles.clear()
            self._flights.clear()
        finally:
            self._stop_remaining()
        if self.failure is not None and self.on_failure is not None:
            try:
                self.on_failure()
            except Exception:  # noqa: BLE001
                logger.exception("on_failure failed")

    def _loop(self) -> None:
        engine, idle = self.engine, False
        while True:
            if self.process == 0:
                commands, stop = self._take_commands(wait=self.idle_s if idle else None)
            else:
                commands, stop = (), False
            mine = Tick(self.process, tuple(commands), stop, engine.has_unfinished(),
                        tuple(self._records))
            self._records = []
            try:
                messages = self.exchange(pack(mine))
            except Exception as err:  # noqa: BLE001 - e.g. gloo: the connection was reset
                raise RuntimeError(f"process {self.process} lost the other processes (one "
                                   f"failed or was stopped): {type(err).__name__}: {err}"
                                   ) from err
            ticks = [unpack(data) for data in messages]
            self.ticks += 1
            if [t.process for t in ticks] != list(range(len(ticks))):
                raise ValueError(f"the exchange returned the ticks of processes "
                                 f"{[t.process for t in ticks]}, expected 0 .. "
                                 f"{len(ticks) - 1} in order")
            if self.process == 0:
                for tick in ticks:
                    self._receive(tick.records)
            head = ticks[0]
            if head.stop:
                return
            for cmd in head.commands:
                self._apply(cmd)
            if self.process == 0:  # its own records, at once
                self._receive(self._records)
                self._records = []
            work = any(t.unfinished for t in ticks) or any(
                isinstance(cmd, AddCommand) for cmd in head.commands)
            if work:
                outputs = engine.step()
                self.steps += 1
                for out in outputs:
                    self._records.append(self._output_record(out))
                    if out.finished:
                        engine.release(out.request_id)
                        self._mine.discard(out.request_id)
                if self.process == 0:
                    self._receive(self._records)
                    self._records = []
                    self._publish(stats=self.steps % self.stats_every == 0)
            elif self.process == 0 and not idle:
                self._publish()
            idle = not work and not head.commands

    def _apply(self, cmd) -> None:
        """One of process 0's commands, on this process's own ranks."""
        engine = self.engine
        if isinstance(cmd, AddCommand):
            if cmd.rank not in engine.local_ranks:
                return
            try:
                engine.add_request(cmd.prompt, rank=cmd.rank, request_id=cmd.request_id,
                                   **cmd.kwargs)
            except ValueError as err:
                self._records.append(Record(cmd.request_id, "refused", str(err)))
            except Exception as err:  # noqa: BLE001 - one request's error, not the engine's
                logger.exception("add_request failed for %s", cmd.request_id)
                self._records.append(Record(cmd.request_id, "failed",
                                            f"request failed: {type(err).__name__}: {err}"))
            else:
                self._mine.add(cmd.request_id)
                self._records.append(Record(cmd.request_id, "accepted"))
        elif cmd.request_id in self._mine:
            self._mine.discard(cmd.request_id)
            engine.cancel(cmd.request_id)
            self._records.append(self._output_record(engine.release(cmd.request_id)))

    def _output_record(self, out) -> Record:
        logprobs = None
        if out.logprobs is not None:  # the full list so far: the new tokens' are its last
            logprobs = tuple(out.logprobs[len(out.logprobs) - len(out.new_token_ids):])
        cost = None
        if self.engine.placement == "least_misses" and out.finish_reason is None:
            cost = self.engine.placement_cost(out.request_id,
                                              out.prompt_tokens + len(out.token_ids))
        return Record(out.request_id, "output", "", tuple(out.new_token_ids),
                      out.finish_reason, len(out.token_ids), logprobs, cost)

    def _cancel_mine(self) -> None:
        """Cancel and release what this process's engine still holds (the loop has ended)."""
        for request_id in sorted(self._mine):
            try:
                self.engine.cancel(request_id)
                self.engine.release(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("cancel %s failed", request_id)
        self._mine.clear()

    # Process 0: commands in, records out ---------------------------------------------------

    def _take_commands(self, *, wait: float | None) -> tuple[list, bool]:
        """The commands pending on the queue (the first awaited up to `wait` seconds), as tick
        commands, and whether to stop."""
        commands: list = []
        block = wait is not None
        while True:
            try:
                kind, arg = self._commands.get(block=block, timeout=wait if block else None)
            except queue.Empty:
                return commands, False
            block = False
            if kind == STOP:
                return commands, True
            if kind == "add":
                commands += self._place(arg)
            elif kind == "cancel":
                if arg in self._flights:
                    commands.append(CancelCommand(arg))
            elif kind == "cancel_all":
                commands += [CancelCommand(rid) for rid in self._flights]

    def _place(self, handles: list[RequestHandle]) -> list[AddCommand]:
        """A rank for each handle's request (the placement rule over every rank, on process
        0's bookkeeping), as commands. O(R + requests) each."""
        from fo_jax import placement as placement_rules

        engine, commands = self.engine, []
        for handle in handles:
            with self._lock:
                self._pending_adds -= 1
            try:
                kwargs = add_kwargs(handle.kwargs)
            except (TypeError, ValueError) as err:  # not JSON: no owner could receive it
                handle.put(Refused(f"the request's settings cannot be sent to its rank: {err}"))
                continue
            load, busy = [0.0] * engine.ranks, [0] * engine.ranks
            for flight in self._flights.values():
                busy[flight.rank] += 1
                load[flight.rank] += (self._cost(flight.prompt_tokens + len(flight.tokens))
                                      if flight.cost is None else flight.cost)
            free = [max(engine.seats_per_rank - n, 0) for n in busy]
            if not any(free):
                free = [1] * engine.ranks
            ranks, self._turn = placement_rules.assign(
                engine.placement, [self._cost(len(handle.prompt))], load=load, free=free,
                turn=self._turn)
            self._handles[handle.request_id] = handle
            self._flights[handle.request_id] = _Flight(
                ranks[0], len(handle.prompt), tuple(kwargs.get("stop", ())),
                logprobs=None if kwargs.get("logprobs") is None else [])
            commands.append(AddCommand(handle.request_id, ranks[0], handle.prompt, kwargs))
        self._count()
        return commands

    def _cost(self, context: int) -> float:
        """A request's cost by process 0's own books, until its owner reports its estimate:
        the engine's rule for one not placed yet (`placement_cost`; least_misses: the prior
        of its context, calibrated by process 0's ranks' steps)."""
        return self.engine.placement_cost(None, context)

    def _receive(self, records) -> None:
        """Hand records to their requests' handlers (process 0)."""
        now = time.perf_counter()
        for record in records:
            handle = self._handles.get(record.request_id)
            flight = self._flights.get(record.request_id)
            if handle is None or flight is None:
                continue
            if record.event == "accepted":
                handle.put(Accepted(record.request_id))
                continue
            if record.event in ("refused", "failed"):
                del self._handles[record.request_id], self._flights[record.request_id]
                handle.put(Refused(record.message) if record.event == "refused"
                           else Failed(record.message, engine=False))
                continue
            flight.tokens += record.new_token_ids
            flight.cost = record.cost
            if flight.logprobs is not None and record.logprobs is not None:
                flight.logprobs += record.logprobs
            if len(flight.tokens) != record.num_tokens:
                raise RuntimeError(
                    f"request {record.request_id}: process 0 holds {len(flight.tokens)} of its "
                    f"tokens, its rank {flight.rank} reports {record.num_tokens}")
            self._deliver_to(handle, self._output(record, flight), now)
            if record.finish_reason is not None:
                del self._handles[record.request_id], self._flights[record.request_id]
        if records:
            self._count()

    def _output(self, record: Record, flight: _Flight):
        from fo_jax.engine.engine import RequestOutput

        return RequestOutput(record.request_id, list(record.new_token_ids), list(flight.tokens),
                             output_text(self.engine.tokenizer, flight.tokens, flight.stop),
                             record.finish_reason is not None, record.finish_reason,
                             flight.prompt_tokens, None, None,
                             None if flight.logprobs is None else list(flight.logprobs))

    def _cancel(self, request_id: str) -> None:
        """(Process 0, the loop has ended) the request's final output, "cancelled", from
        process 0's record of it: its owner cancels it on its own way out."""
        handle, flight = self._handles.pop(request_id, None), self._flights.pop(request_id, None)
        if handle is None or flight is None:
            return
        if request_id in self._mine:
            self._mine.discard(request_id)
            self.engine.cancel(request_id)
            self.engine.release(request_id)
        record = Record(request_id, "output", finish_reason="cancelled",
                        num_tokens=len(flight.tokens))
        self._deliver_to(handle, self._output(record, flight), time.perf_counter())

    def _stop_remaining(self) -> None:
        super()._stop_remaining()
        self._cancel_mine()

    def _count(self) -> None:
        """Requests waiting for a seat and seats free over every rank, from process 0's
        bookkeeping (for `submit`'s bound)."""
        busy = [0] * self.engine.ranks
        for flight in self._flights.values():
            busy[flight.rank] += 1
        per = self.engine.seats_per_rank
        waiting = sum(max(n - per, 0) for n in busy)
        free = sum(max(per - n, 0) for n in busy)
        with self._lock:
            self._engine_waiting, self._free_seats = waiting, free

    def _publish(self, stats: bool = True) -> None:
        self._count()
        busy = [0] * self.engine.ranks
        for flight in self._flights.values():
            busy[flight.rank] += 1
        per = self.engine.seats_per_rank
        self.snapshot = Snapshot(
            running=sum(min(n, per) for n in busy), waiting=sum(max(n - per, 0) for n in busy),
            counters=dict(self.engine.counters) if stats else self.snapshot.counters,
            page_bytes=self._page_bytes)


def process_report(engine) -> dict:
    """What this process's part of `engine` holds (a ShardedEngine, printed at start-up and
    shutdown): its ranks, the requests placed on each since the warm-up, its requests running
    and waiting, the sum of its seats' lengths (read from its own devices: 0 once every request
    has left), offloaded the pages its ranks' pools hold (0 once every request has left; None
    resident), and the routed experts each of its devices holds."""
    import numpy as np

    lengths = getattr(getattr(engine, "state", None), "lengths", None)
    held = None if lengths is None else int(sum(
        np.asarray(s.data).sum() for s in lengths.addressable_shards))
    pools = engine.rank_pool_occupancy()
    pages = None if pools is None else sum(pools[r]["held"] for r in engine.local_ranks)
    moe = engine.params.get("moe", {}) if isinstance(engine.params, dict) else {}
    experts = sorted({int(s.data.shape[1]) for s in moe["w1"].addressable_shards}) \
        if "w1" in moe else []
    import jax

    return {"process": jax.process_index(), "processes": jax.process_count(),
            "ranks": list(engine.local_ranks),
            "placed": [engine.placed_per_rank[r] for r in engine.local_ranks],
            "running": engine.num_running(), "waiting": engine.num_waiting(),
            "lengths": held, "pages_held": pages, "experts_per_device": experts}


__all__ = ["AddCommand", "CancelCommand", "IDLE_S", "LockstepDriver", "Record", "Tick",
           "add_kwargs", "output_text", "pack", "process_report", "unpack"]

"""fo_jax.server.lockstep without a second process: the ticks' encoding, the output text rule,
and two drivers (process 0 serving, process 1 following) over stand-in engines of 2 ranks each,
trading ticks through an in-memory exchange in two threads: placement over every rank, tokens,
refusals, cancels, stop (exit 0) and a fault on process 1 (exit 1, process 0's requests
failed). The real thing across processes: test_serve_processes.py."""

import asyncio
import threading

import pytest

from fo_jax.engine.requests import RequestOutput, RequestState, TokenLogprobs
from fo_jax.server.driver import Accepted, Failed, Refused
from fo_jax.server.lockstep import (AddCommand, CancelCommand, LockstepDriver, Record, Tick,
                                    add_kwargs, output_text, pack, unpack)
from fo_jax.tokenizer import ByteTokenizer


def test_tick_round_trip():
    tick = Tick(0, (AddCommand("cmpl-1", 3, [1, 2, 255], add_kwargs(dict(
        max_tokens=4, temperature=0.1 + 0.2, top_p=1.0, seed=2 ** 40, stop_token_ids=(7, 8),
        stop=("é\n", "</s>")))), CancelCommand("cmpl-0")), stop=False, unfinished=True,
        records=(Record("cmpl-0", "output", "", (5, 6), "cancelled", 9),
                 Record("cmpl-3", "output", "", (7,), None, 1, (TokenLogprobs(
                     7, -0.1 - 0.2, ((7, -0.1 - 0.2), (1, float("-inf")))),), cost=1 / 3),
                 Record("cmpl-2", "refused", "max_tokens=0 must be an int >= 1")))
    back = unpack(pack(tick))
    assert back == tick
    assert back.commands[0].kwargs["temperature"] == 0.1 + 0.2  # exact (shortest repr)
    assert back.commands[0].kwargs["stop_token_ids"] == [7, 8]
    assert back.records[1].logprobs[0].top[1][1] == float("-inf")  # a logprob may be -inf
    assert back.records[1].cost == 1 / 3 and back.records[0].cost is None
    assert unpack(pack(Tick(1))) == Tick(1)


@pytest.mark.parametrize("data, message", [
    (b"\xff", "a malformed tick (1 bytes"),
    (b"{}", "a malformed tick (2 bytes: b'{}'): KeyError: 'commands'"),
    (b'{"process":0,"commands":[],"stop":false,"unfinished":false,'
     b'"records":[["r","done","",[],null,0,null,null]]}', "event 'done' is not one of"),
], ids=["not_utf8", "no_fields", "bad_event"])
def test_unpack_refuses_malformed_ticks(data, message):
    with pytest.raises(ValueError) as err:
        unpack(data)
    assert message in str(err.value)


def test_pack_refuses_unknown_commands():
    with pytest.raises(TypeError) as err:
        pack(Tick(0, ("stop",)))
    assert str(err.value) == "a tick's commands are AddCommand or CancelCommand, got str"


def test_output_text_is_the_engines():
    """The text process 0 rebuilds from the tokens equals RequestState.record's."""
    tok = ByteTokenizer()
    for stop in ((), ("lo",), ("zz",)):
        req = RequestState("r", None, 16, 0.0, 1.0, 0, (), stop, 0.0, text="")
        req.prompt = [1]
        kept = req.record(list(b"hello world"), tokenizer=tok, capacity=64, length=3)
        assert output_text(tok, kept, stop) == req.text
    assert output_text(None, [1, 2], ()) is None


class FakeEngine:
    """The ShardedEngine surface the driver uses: R = 4 ranks of 1 seat, this process's two;
    each step every request gets one token, (sum of its prompt + its tokens so far) % 256."""

    def __init__(self, process: int):
        self.ranks, self.seats_per_rank, self.seats = 4, 1, 4
        self.local_ranks = (2 * process, 2 * process + 1)
        self.placement, self.tokenizer, self.counters = "least_requests", None, {"steps": 0}
        self.requests, self.fail_at_step, self.added = {}, None, {}

    def add_request(self, prompt, *, rank, request_id, max_tokens=16, **kwargs):
        assert rank in self.local_ranks, rank
        if max_tokens > 100:
            raise ValueError(f"max_tokens={max_tokens} is too many here")
        self.requests[request_id] = dict(prompt=list(prompt), max_tokens=max_tokens,
                                         tokens=[], reason=None, rank=rank)
        self.added[request_id] = rank
        return request_id

    def _out(self, rid, new):
        r = self.requests[rid]
        return RequestOutput(rid, new, list(r["tokens"]), None, r["reason"] is not None,
                             r["reason"], len(r["prompt"]), None)

    def step(self):
        self.counters["steps"] += 1
        if self.counters["steps"] == self.fail_at_step:
            raise RuntimeError("boom")
        outs = []
        for rid, r in self.requests.items():
            if r["reason"] is None:
                r["tokens"].append(expected_token(r["prompt"], r["tokens"]))
                if len(r["tokens"]) == r["max_tokens"]:
                    r["reason"] = "length"
                outs.append(self._out(rid, r["tokens"][-1:]))
        return outs

    def has_unfinished(self):
        return any(r["reason"] is None for r in self.requests.values())

    def cancel(self, rid):
        r = self.requests[rid]
        if r["reason"] is not None:
            return False
        r["reason"] = "cancelled"
        return True

    def release(self, rid):
        out = self._out(rid, [])
        del self.requests[rid]
        return out

    def num_running(self):
        return len(self.requests)

    def placement_cost(self, rid, context):
        """least_misses's cost: rank 3's requests copy no rows, the others' 10 per step;
        one not placed yet (rid None) the prior, 5."""
        if rid is None:
            return 5.0
        return 0.0 if self.requests[rid]["rank"] == 3 else 10.0

    def num_waiting(self):
        return 0


def expected_token(prompt, tokens):
    return (sum(prompt) + len(tokens)) % 256


def expected_tokens(prompt, n):
    tokens = []
    for _ in range(n):
        tokens.append(expected_token(prompt, tokens))
    return tokens


class Exchange:
    """allgather_bytes between threads: every party's bytes, in party order."""

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=30)
        self.slots = [None] * parties

    def of(self, party: int):
        def exchange(data: bytes) -> list[bytes]:
            self.slots[party] = data
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()  # every party has read before any writes again
            return out
        return exchange


def _pair(fail_at_step=None, placement="least_requests"):
    engines = [FakeEngine(0), FakeEngine(1)]
    for engine in engines:
        engine.placement = placement
    engines[1].fail_at_step = fail_at_step
    exchange = Exchange(2)
    failed = threading.Event()
    drivers = [LockstepDriver(engines[p], exchange=exchange.of(p), process=p, idle_s=0.01,
                              **({"on_failure": failed.set} if p == 0 else {}))
               for p in range(2)]
    codes = []

    def follow():
        codes.append(drivers[1].follow())
        if codes[-1]:  # as a peer's collective fails once the faulty process has gone
            exchange.barrier.abort()

    follower = threading.Thread(target=follow, daemon=True)
    return engines, drivers, follower, codes, failed


async def _collect(handle):
    items = [await handle.queue.get()]
    while isinstance(items[-1], RequestOutput) and not items[-1].finished or \
            isinstance(items[-1], Accepted):
        items.append(await asyncio.wait_for(handle.queue.get(), 30))
    return items


def test_two_drivers_serve_every_rank_and_stop_cleanly():
    engines, drivers, follower, codes, failed = _pair()
    follower.start()
    drivers[0].start()
    prompts = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]

    async def main():
        loop = asyncio.get_running_loop()
        handles = [drivers[0].submit(p, loop=loop, max_tokens=3 + i)
                   for i, p in enumerate(prompts)]
        refused = drivers[0].submit([1], loop=loop, max_tokens=1000)
        unsendable = drivers[0].submit([1], loop=loop, max_tokens=2, temperature=float("nan"))
        long = drivers[0].submit([2], loop=loop, max_tokens=90)
        got = await asyncio.gather(*map(_collect, handles))
        refusal = await refused.queue.get()
        assert await unsendable.queue.get() == Refused(
            "the request's settings cannot be sent to its rank: Out of range float values are "
            "not JSON compliant: nan")
        assert isinstance(await long.queue.get(), Accepted)
        first = await long.queue.get()  # running: then cancelled
        drivers[0].cancel(long.request_id)
        rest = await _collect(long)
        return got, refusal, first, rest

    got, refusal, first, rest = asyncio.run(main())
    for i, (items, prompt) in enumerate(zip(got, prompts)):
        assert isinstance(items[0], Accepted), items
        outs = items[1:]
        assert outs[-1].token_ids == expected_tokens(prompt, 3 + i)
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
        assert outs[-1].finish_reason == "length" and outs[-1].prompt_tokens == len(prompt)
    assert isinstance(refusal, Refused) and refusal.message == "max_tokens=1000 is too many here"
    assert rest[-1].finish_reason == "cancelled"
    assert rest[-1].token_ids[:len(first.token_ids)] == first.token_ids
    assert drivers[0].stop(timeout=10)
    follower.join(10)
    assert codes == [0] and not failed.is_set()
    assert engines[0].requests == engines[1].requests == {}
    assert drivers[0].ticks == drivers[1].ticks and drivers[0].steps == drivers[1].steps
    # The first four requests went to the four ranks (one seat each): both processes served.
    placed = {**engines[0].added, **engines[1].added}
    assert sorted(placed[h] for h in [r.request_id for r in (o[0] for o in got)][:4]) == [
        0, 1, 2, 3]
    assert drivers[0].in_flight() == 0 and drivers[0].snapshot.running == 0


def test_a_fault_on_a_follower_ends_both():
    engines, drivers, follower, codes, failed = _pair(fail_at_step=2)
    follower.start()
    drivers[0].start()

    async def main():
        loop = asyncio.get_running_loop()
        handles = [drivers[0].submit([i + 1], loop=loop, max_tokens=20) for i in range(4)]
        return await asyncio.gather(*map(_collect, handles))

    got = asyncio.run(main())
    follower.join(10)
    assert codes == [1]
    assert drivers[1].failure == "engine failure: RuntimeError: boom"
    assert failed.wait(10) and drivers[0].failure.startswith(
        "engine failure: RuntimeError: process 0 lost the other processes (one failed or was "
        "stopped): BrokenBarrierError")
    assert all(isinstance(items[-1], Failed) for items in got), got
    assert engines[1].requests == {}  # the follower cancelled its own on the way out
    assert not drivers[0].accepting


def test_least_misses_places_by_the_owners_estimates():
    """least_misses: each output carries its owner's estimate of the request's rows per step
    (`placement_cost`); process 0 sums them per rank. With every seat taken, a new request
    goes to the rank whose requests copy least (rank 3, on process 1), not to the first rank
    of a tie of priors."""
    engines, drivers, follower, codes, failed = _pair(placement="least_misses")
    follower.start()
    drivers[0].start()

    async def main():
        loop = asyncio.get_running_loop()
        handles = [drivers[0].submit([i + 1], loop=loop, max_tokens=60) for i in range(4)]
        for handle in handles:  # accepted, then a first output: its cost is on process 0
            assert isinstance(await handle.queue.get(), Accepted)
            await handle.queue.get()
        late = drivers[0].submit([9], loop=loop, max_tokens=2)
        for handle in handles:
            drivers[0].cancel(handle.request_id)
        return await _collect(late), await asyncio.gather(*map(_collect, handles))

    late, _ = asyncio.run(main())
    assert late[-1].token_ids == expected_tokens([9], 2)
    assert drivers[0].stop(timeout=10)
    follower.join(10)
    assert codes == [0] and not failed.is_set()
    placed = {**engines[0].added, **engines[1].added}
    assert sorted(placed.values())[:4] == [0, 1, 2, 3]
    assert placed[late[0].request_id] == 3, placed

"""`fo-jax serve` end to end in a subprocess, offloaded (the embedded model, 4 seats of 64
tokens, no prefix cache: it maps whole prefill chunks, and one chunk per prompt keeps the
programs few), one server per module (compiling the offloaded programs is the
cost): the openai client gets a reply and streams another; a load of concurrent streaming
clients with mixed prompt and output lengths, some leaving mid-stream: every accepted request
completes or (its client gone) is cancelled, every rejected one got 429, the pool holds no page
afterwards and /metrics adds up; then SIGTERM under many streams: new connections are refused,
every stream ends cleanly ([DONE]), the process exits 0 and its final line shows no held page.
The tests run in file order (the last one ends the server)."""

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEATS, CAPACITY, MAX_QUEUE = 4, 64, 12
NAME = "trained-small"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Proc:
    def __init__(self, proc, url, log, metrics):
        self.proc, self.url, self.log, self.metrics = proc, url, log, metrics

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    folder = tmp_path_factory.mktemp("serve")
    log, metrics = folder / "serve.log", folder / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # One prefill chunk per prompt (chunk = capacity): the warm-up compiles every program.
    cmd = [sys.executable, "-m", "fo_jax.cli", "serve", "--port", str(port), "--offload",
           "--seats", str(SEATS), "--capacity", str(CAPACITY), "--page-size", "16",
           "--prefill-chunk", str(CAPACITY), "--decode-steps-per-call", "2",
           "--max-queue", str(MAX_QUEUE), "--shutdown-timeout", "0", "--log-level", "warning",
           "--metrics-jsonl", str(metrics), "--metrics-every", "4"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                text=True)
    srv = _Proc(proc, url, log, metrics)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, srv.output()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start: " + srv.output()
            time.sleep(0.2)
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _idle(url, timeout=30.0) -> dict:
    """/metrics once nothing runs or waits and the pool holds no page (the snapshot is
    published when the engine goes idle)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        if (m["fojax_requests_running"] == 0 and m["fojax_requests_waiting"] == 0
                and m['fojax_pool_pages{state="held"}'] == 0):
            return m
        assert time.monotonic() < deadline, f"still busy: {m}"
        time.sleep(0.05)


def _total(m, prefix) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


def test_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    reply = client.completions.create(model=NAME, prompt="def read_lines(path):", max_tokens=4,
                                      temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens <= 4
    chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    m = _idle(server.url)
    assert m['fojax_requests_completed_total{finish_reason="length"}'] >= 1


CLIENTS = 64  # concurrent streaming clients of the load test


async def _client(client, url, i, rng):
    """One streaming client, arriving at once (the first 24: more than seats + queue, so some
    get 429 however fast the engine) or in the first 2 s: a prompt of 1-40 tokens, 1-24
    tokens out; every sixth asks for the rest of its seat and leaves after its first chunk,
    another sixth sends its request and closes the connection without reading a byte.
    ("completed", body, token ids), ("rejected",), ("left",) or ("vanished",)."""
    arrival, linger = (0.0 if i < 24 else rng.uniform(0, 2.0)), rng.uniform(0, 0.2)
    prompt = [rng.randrange(10, 250) for _ in range(rng.randint(1, 40))]
    leaves = i % 6 == 1
    max_tokens = CAPACITY - len(prompt) if i % 6 in (1, 4) else rng.randint(1, 24)
    await asyncio.sleep(arrival)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    stream = dict(body, stream=True, stream_options={"include_usage": True})
    if i % 6 == 4:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        data = json.dumps(stream).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
        await writer.drain()
        await asyncio.sleep(linger)
        writer.close()
        await writer.wait_closed()
        return ("vanished",)
    async with client.stream("POST", url + "/v1/completions", json=stream) as resp:
        if resp.status_code == 429:
            assert resp.headers["retry-after"] == "1"
            return ("rejected",)
        assert resp.status_code == 200, await resp.aread()
        lines = []
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if leaves:
                    return ("left",)  # the connection closes mid-stream
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-3][5:])["choices"][0]["finish_reason"] == "length"
    assert json.loads(lines[-2][5:])["usage"]["completion_tokens"] == max_tokens
    ids = [t for line in lines[:-2] for t in json.loads(line[5:])["choices"][0]["token_ids"]]
    return ("completed", body, ids)


def test_load_with_clients_leaving_mid_stream(server):
    before = _idle(server.url)
    rng = random.Random(0)

    async def main():
        async with httpx.AsyncClient(timeout=60,
                                     limits=httpx.Limits(max_connections=CLIENTS)) as client:
            return await asyncio.gather(*(_client(client, server.url, i, rng)
                                          for i in range(CLIENTS)))

    outcomes = asyncio.run(asyncio.wait_for(main(), 120))
    results = [o[0] for o in outcomes]
    m = _idle(server.url)

    def delta(name):
        return _total(m, name) - _total(before, name)

    completed, rejected = results.count("completed"), results.count("rejected")
    left, vanished = results.count("left"), results.count("vanished")
    assert completed >= SEATS and rejected >= 1 and left >= 1, results
    assert delta("fojax_requests_received_total") == CLIENTS
    # A client that vanished got 429 unread, or its request was cancelled; one that left was
    # cancelled (or, if its request had ended first, completed).
    assert rejected <= delta("fojax_requests_rejected_total") <= rejected + vanished
    assert completed <= delta("fojax_requests_completed_total") <= completed + left + vanished
    assert delta("fojax_requests_received_total") == delta("fojax_requests_completed_total") + \
        delta("fojax_requests_cancelled_total") + delta("fojax_requests_rejected_total")
    pages = {s: m[f'fojax_pool_pages{{state="{s}"}}'] for s in ("free", "held", "cached",
                                                                 "total")}
    assert pages["held"] == pages["cached"] == 0 and pages["free"] == pages["total"], pages

    # No request's tokens depended on the others (nor on the ones cancelled around it): the
    # first 8 completed ones, served again at once (fewer than SEATS + MAX_QUEUE), give the
    # same tokens.
    async def again(client, body):
        resp = await client.post(server.url + "/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    done = [o for o in outcomes if o[0] == "completed"][:8]

    async def replay():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(again(client, o[1]) for o in done))

    assert asyncio.run(asyncio.wait_for(replay(), 120)) == [o[2] for o in done]


def test_sigterm_under_many_streams(server):
    """SIGTERM while every seat decodes and requests wait (15 streaming clients, 5 waiting for
    a whole response): the listening socket closes, every stream ends with [DONE], every other
    client gets its JSON body (finish_reason "cancelled", or "length" for one that ended before
    the signal was handled), the process exits 0, and its final line counts every request and no
    held page. The server drains for 0 s, so the requests in flight are cancelled whatever this
    machine's speed (with a 1 s drain, a fast machine finished all 20 within it)."""
    url = server.url
    streams = 20
    results, errors, started = [], [], threading.Event()

    async def one(client, i):
        body = {"prompt": [10 + i, 11, 12], "max_tokens": CAPACITY - 3, "stream": i % 4 != 3,
                "ignore_eos": True}
        if not body["stream"]:  # a whole-response client: a complete body all the same
            resp = await client.post(url + "/v1/completions", json=body)
            if resp.status_code in (429, 503):
                return resp.status_code
            assert resp.status_code == 200
            return resp.json()["choices"][0]["finish_reason"]
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code in (429, 503):
                return resp.status_code
            assert resp.status_code == 200
            lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            return json.loads(lines[-2][5:])["choices"][0]["finish_reason"]

    def load():
        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.ensure_future(one(client, i)) for i in range(streams)]
                started.set()
                return await asyncio.gather(*tasks, return_exceptions=True)
        try:
            results.extend(asyncio.run(asyncio.wait_for(main(), 90)))
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)
        finally:
            started.set()

    before = _idle(url)
    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    try:
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while True:  # every stream received, every seat decoding, requests waiting
            m = _metrics(url)
            received = _total(m, "fojax_requests_received_total") - \
                _total(before, "fojax_requests_received_total")
            if (received == streams and m["fojax_requests_running"] == SEATS
                    and m["fojax_requests_waiting"] > 0):
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # no longer accepting (the socket closes; 503 before)
        try:
            late = httpx.post(url + "/v1/completions", json={"prompt": "a"}, timeout=5)
            assert late.status_code == 503, late.text
            refused = 1  # received and rejected
        except httpx.ConnectError:
            refused = 0
        reader.join(60)
        assert not reader.is_alive() and not errors, errors
        assert server.proc.wait(60) == 0
        elapsed = time.monotonic() - t0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    bad = [r for r in results if isinstance(r, BaseException)]
    assert not bad, bad
    assert len(results) == streams
    assert set(results) <= {"cancelled", "length", 429, 503}, results
    assert "cancelled" in results
    assert elapsed < 30
    log = server.output()
    assert "Traceback" not in log, log
    final = re.search(r"fo-jax serve: stopped: requests received (\d+), completed (\d+), "
                      r"cancelled (\d+), rejected (\d+), failed (\d+); pool pages held (\d+), "
                      r"cached (\d+), free (\d+), total (\d+)", log)
    assert final, log
    received, completed, cancelled, rejected, failed, held, cached, free, total = \
        map(int, final.groups())
    assert received == _total(before, "fojax_requests_received_total") + streams + refused
    assert received == completed + cancelled + rejected and failed == 0
    # --metrics-jsonl: a record every 4 engine steps after the warm-up, and a last one at exit
    # (its gauges are those of the last step the engine ran, before the drain's cancels)
    records = [json.loads(line) for line in server.metrics.read_text().splitlines()]
    assert len(records) >= 2
    last = records[-1]
    assert last["totals"]["decode_tokens"] > 0
    assert len(last["totals"]["hits"]) == len(last["totals"]["misses"]) >= 1
    assert sum(last["totals"]["hits"]) + sum(last["totals"]["misses"]) > 0
    assert last["totals"]["decode_tokens"] == sum(r["deltas"]["decode_tokens"] for r in records)
    assert held == cached == 0 and free == total

"""Serving latency: time to first token and inter-token latency seen by streaming HTTP clients.

One question: with `clients` concurrent streaming clients on `fo-jax serve` (the embedded model,
in this process on a free loopback port, or `--url` of a running server), what TTFT and
inter-token latency do they see, and what throughput does the server reach?

Each client sends `requests` streaming completions one after the other (`max_tokens` tokens,
greedy, `ignore_eos`), and records per request the time from sending to the first token and the
gaps between tokens (a chunk of k tokens counts its gap / k per token: `return_token_ids`).
Reported: p50 / p99 of TTFT and inter-token latency, output tokens/s over the run, requests
rejected (429), and the server's own means (its /metrics histograms, measured where the engine
thread hands tokens over: client-side gaps also hold the event loop's and the socket's batching,
which bunch tokens). The server warms up (compiles) before the clock starts, unless --smoke.

    python -m experiments.serving.serving_latency --clients 8 --seats 4 --out runs/serving.jsonl
    python -m experiments.serving.serving_latency --offload --hot-slots 512 --clients 16 --seats 8
    python -m experiments.serving.serving_latency --url http://127.0.0.1:8000   # a running server
    python -m experiments.serving.serving_latency --smoke                       # seconds; the tests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

PROMPTS = ("def read_lines(path):", "class Stack:", "import os\n", "def main(argv):",
           "for line in sys.stdin:", "with open(path) as f:")


async def _one(client, url, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    ttft, gaps, last, tokens = None, [], None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code == 429:
            return None
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if not ids:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
                gaps += [0.0] * (len(ids) - 1)  # tokens that came with the first one
            else:
                gaps += [(now - last) / len(ids)] * len(ids)
            last, tokens = now, tokens + len(ids)
    return ttft, gaps, tokens


async def _load(url, clients, requests, max_tokens):
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def worker(i):
            out = []
            for r in range(requests):
                out.append(await _one(client, url, PROMPTS[(i + r) % len(PROMPTS)], max_tokens))
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*(worker(i) for i in range(clients)))
        return [r for rs in results for r in rs], time.perf_counter() - start


def _server_metrics(url) -> dict:
    """The server's own TTFT and inter-token sums and counts (/metrics)."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("fojax_time_to_first_token_seconds_",
                            "fojax_inter_token_latency_seconds_")) and "bucket" not in name:
            out[name] = float(value)
    return out


def _mean(before, after, name):
    count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    total = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
    return total / count if count else None


def _percentiles(values):
    if not values:
        return None, None
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one here)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seats", type=int, default=4)
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--hot-slots", type=int, default=512)
    p.add_argument("--decode-steps-per-call", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="tiny run, no warm-up (the tests)")
    p.add_argument("--out", default=None, help="append a JSON line here")
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.requests, args.max_tokens = 3, 1, 6
        args.seats, args.capacity, args.prefill_chunk, args.decode_steps_per_call = 2, 64, 8, 2

    server = None
    if args.url is None:
        from fo_jax.embedded import load_embedded
        from fo_jax.engine import Engine
        from fo_jax.offload.config import OffloadConfig
        from fo_jax.server.serve import ServerThread, build_served, warm_up

        config, params, tokenizer = load_embedded()
        offload = (OffloadConfig(hot_slots=args.hot_slots, page_size=16, capacity=args.capacity)
                   if args.offload else None)
        engine = Engine(params, config, seats=args.seats, capacity=args.capacity,
                        offload=offload, decode_steps_per_call=args.decode_steps_per_call,
                        prefill_chunk=args.prefill_chunk, tokenizer=tokenizer,
                        query_block=None if args.smoke else 128)
        if not args.smoke:
            warm_up(engine)
        served = build_served(engine, tokenizer, model_name=config.name,
                              max_queue=args.max_queue)
        server = ServerThread(served).start()
        url = server.url
    else:
        url = args.url.rstrip("/")
    try:
        before = _server_metrics(url)
        results, seconds = asyncio.run(_load(url, args.clients, args.requests,
                                             args.max_tokens))
        after = _server_metrics(url)
    finally:
        if server is not None:
            server.stop()
    done = [r for r in results if r is not None]
    ttft = [r[0] for r in done if r[0] is not None]
    gaps = [g for r in done for g in r[1]]
    tokens = sum(r[2] for r in done)
    ttft50, ttft99 = _percentiles(ttft)
    itl50, itl99 = _percentiles(gaps)
    row = {"experiment": "serving_latency", "clients": args.clients,
           "requests": len(results), "rejected": len(results) - len(done),
           "max_tokens": args.max_tokens, "seats": args.seats, "capacity": args.capacity,
           "offload": args.offload, "decode_steps_per_call": args.decode_steps_per_call,
           "ttft_p50": ttft50, "ttft_p99": ttft99, "itl_p50": itl50, "itl_p99": itl99,
           "server_ttft_mean": _mean(before, after, "fojax_time_to_first_token_seconds"),
           "server_itl_mean": _mean(before, after, "fojax_inter_token_latency_seconds"),
           "output_tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
           "url": args.url, **run_metadata()}
    print(f"{len(done)}/{len(results)} requests, {tokens} tokens in {seconds:.2f} s "
          f"({tokens / seconds:.1f} tokens/s); TTFT p50 {ttft50 * 1e3:.1f} ms p99 "
          f"{ttft99 * 1e3:.1f} ms; inter-token p50 {itl50 * 1e3:.1f} ms p99 "
          f"{itl99 * 1e3:.1f} ms")
    write_jsonl(args.out, [row])
    return [row]


if __name__ == "__main__":
    main()

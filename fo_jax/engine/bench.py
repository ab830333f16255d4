"""A Poisson stream of requests through the engine, and what it measured (`fo-jax bench-serve`,
experiments/serving/serving_bench.py).

    requests = poisson_workload(16, rate=2.0, prompt_len=(64, 256), output_len=(16, 48),
                                vocab=config.vocab_size)
    figures = run_workload(engine, requests)     # tokens/s, TTFT, TPOT, hit rate, pool ...
    print("\\n".join(summary_lines(figures)))
    figures = run_workload(engine, requests, concurrency=engine.seats)   # closed loop

The host clock drives arrivals: a request is added once its arrival time has passed, so an
engine whose steps are slower sees more requests waiting. In a closed loop (`concurrency`)
arrival times are ignored: before every step the engine holds that many unfinished requests
(while any are left), each one that finished replaced by the next, until all are done (with
concurrency >= seats, every seat is busy while requests remain: the engine at saturation).
Figures are of the timed run only: every program of one request is compiled first by an
untimed request as long as the longest prompt (one per rank of a `DataParallelEngine`, whose
imbalance figures are added); the prefill programs of packs of several requests
(`SchedulerSettings.prefill_batch`) compile on their first use in the timed run
(`prefill_batch=1`, `--prefill-batch 1`, has none).
"""

from __future__ import annotations

import math
import time

import numpy as np

from fo_jax.engine.engine import Engine
from fo_jax.engine.metrics import MetricsLog, group_totals


def poisson_workload(num_requests: int, *, rate: float, prompt_len: tuple[int, int],
                     output_len: tuple[int, int], vocab: int, seed: int = 0,
                     shared_fraction: float = 0.0, prefix_len: int = 0):
    """[(arrival seconds, prompt ids, max_tokens)]: arrivals of a Poisson process of `rate`
    requests per second (the first at 0), random prompts and output lengths uniform in the
    inclusive ranges; a fraction `shared_fraction` of the prompts start with the same
    `prefix_len` tokens (a system prompt)."""
    if num_requests < 1 or not 0 < rate < math.inf:
        raise ValueError(f"num_requests={num_requests} must be >= 1 and rate={rate} > 0 "
                         "(a finite number)")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name}=({lo}, {hi}) must be a range 1 <= lo <= hi")
    if prefix_len < 0:
        raise ValueError(f"prefix_len={prefix_len} must be >= 0 (tokens of the shared prefix)")
    if not 0 <= shared_fraction <= 1:
        raise ValueError(f"shared_fraction={shared_fraction} must be a fraction in [0, 1]")
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, prefix_len).tolist()
    gaps = rng.exponential(1.0 / rate, num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    out = []
    for t in arrivals:
        prompt = rng.integers(0, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1)))
        prompt = prompt.tolist()
        if rng.random() < shared_fraction:
            prompt = system + prompt
        out.append((float(t), prompt, int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


def _reset(engine: Engine) -> None:
    if hasattr(engine, "reset_figures"):  # a DataParallelEngine: every rank's
        engine.reset_figures()
        return
    engine.timings = dict.fromkeys(engine.timings, 0.0)
    engine.counters = dict.fromkeys(engine.counters, 0)
    engine.stats = None
    if getattr(engine, "metrics", None) is not None:  # a fresh log: the warm-up not counted
        log = engine.metrics
        engine.metrics = MetricsLog(engine, path=log.path, every=log.every,
                                    on_record=log.on_record)


def run_workload(engine: Engine, requests, *, warm: bool = True,
                 metrics_path: str | None = None, metrics_every: int = 16,
                 concurrency: int | None = None) -> dict:
    """Feed `requests` by their arrival times (or, with `concurrency`, in a closed loop: that
    many in the engine at once, each finished one replaced at once by the next) and step until
    all finish; the run's figures.

    Figures: wall seconds, output tokens and tokens/s, mean / peak running requests per step,
    TTFT and time per output token (p50 / p99), compiled programs per output token (host
    round trips), the host share (the device's time idle, waiting for the engine's host work:
    `_host_share`) and the device's idle time per step, prompt tokens prefilled
    and served from the prefix cache, and, offloaded, the hit rate (in total and per indexer
    group), the bytes moved (in total and H2D per token) and the pool's pages at the end.
    With `metrics_path`, the timed run's counters go there as JSON lines every
    `metrics_every` steps (`fo_jax.engine.metrics.MetricsLog`, attached after the warm-up).
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1 (requests kept in the engine)")
    if metrics_path is not None:
        # a bad setting or path is refused before any work
        MetricsLog(engine, path=metrics_path, every=metrics_every)
    if warm:  # compile every program (each prefill bucket up to the longest prompt), untimed;
        # reversed: the same length without filling a prefix cache with a workload prompt.
        # Two decode calls: the second compiles the sum of the offload statistics too.
        longest = max((r[1] for r in requests), key=len)
        ranks = getattr(engine, "ranks", None)  # a DataParallelEngine: warm every rank
        call_tokens = engine.n_steps * (getattr(engine, "num_drafts", 0) + 1)
        warm_ids = [engine.add_request(longest[::-1], max_tokens=2 * call_tokens + 1,
                                       **({} if ranks is None else {"rank": r}))
                    for r in range(ranks or 1)]
        engine.run()
        if ranks is not None:
            for rid in warm_ids:
                engine.release(rid)
        _reset(engine)
    if metrics_path is not None:
        engine.metrics = MetricsLog(engine, path=metrics_path, every=metrics_every)
    start = time.perf_counter()
    pending = list(enumerate(requests))
    ids, running = {}, []

    def admit(now: float) -> bool:  # whether the next request goes in now
        if concurrency is not None:  # closed loop: the engine's unfinished requests
            return engine.num_running() + engine.num_waiting() < concurrency
        return pending[0][1][0] <= now

    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and admit(now):
            i, (_, prompt, max_tokens) = pending.pop(0)
            ids[i] = engine.add_request(prompt, max_tokens=max_tokens)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1][0] - now))
            continue
        engine.step()
        running.append(engine.num_running())
    wall = time.perf_counter() - start
    outputs = engine.run()
    if getattr(engine, "metrics", None) is not None:
        engine.metrics.flush()  # the steps since the last read
    outs = [outputs[ids[i]] for i in range(len(requests))]
    for i in range(len(requests)):
        engine.release(ids[i])
    tokens = sum(len(o.token_ids) for o in outs)
    ttft = np.asarray([o.time_to_first_token for o in outs])
    tpot = np.asarray([o.time_per_output_token for o in outs
                       if o.time_per_output_token is not None])
    t, c = engine.timings, engine.counters
    figures = {
        "requests": len(requests), "wall_s": wall, "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "mean_running": float(np.mean(running)) if running else 0.0,
        "peak_running": int(np.max(running)) if running else 0,
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
        "tpot_p50": float(np.percentile(tpot, 50)) if tpot.size else None,
        "tpot_p99": float(np.percentile(tpot, 99)) if tpot.size else None,
        "programs_per_token": (c["prefill_calls"] + c["decode_calls"]) / max(tokens, 1),
        **_host_share(t, c["steps"]),
        "prefill_tokens": c["prefill_tokens"], "cached_tokens": c["prefix_hit_tokens"],
        "steps": c["steps"], "prefill_calls": c["prefill_calls"],
        "decode_calls": c["decode_calls"], "decode_tokens": c["decode_tokens"],
        "decode_steps": c.get("decode_steps", 0),
        "draft_accepted": c.get("draft_accepted", 0), "draft_proposed": c.get("draft_proposed", 0),
    }
    if engine.stats is not None:
        s = engine.stats
        hits = float(np.sum(s.hits) + np.sum(s.tail_hits))
        misses = float(np.sum(s.misses))
        figures["hit_rate"] = hits / max(hits + misses, 1.0)
        figures["h2d_bytes_per_token"] = float(np.sum(s.h2d_bytes)) / max(tokens, 1)
        figures["h2d_bytes"] = float(np.sum(s.h2d_bytes))
        figures["d2h_bytes"] = float(np.sum(s.d2h_bytes))
        groups = group_totals(s)
        figures["group_hit_rate"] = [
            (h + t) / max(h + t + m, 1.0)
            for h, t, m in zip(groups["hits"], groups["tail_hits"], groups["misses"])]
    if engine.pool_occupancy() is not None:
        figures["pool_pages"] = engine.pool_occupancy()
    if hasattr(engine, "imbalance"):  # a DataParallelEngine
        figures["data_parallel"] = engine.imbalance()
    return figures


def _host_share(timings: dict, steps: int) -> dict:
    """The device's wait for the host: "host_share", the share of the device's time (busy +
    idle, `fo_jax.engine.overlap.DeviceClock`) it sat idle waiting for the engine's host
    work (and, between steps, the caller's), and "device_idle_per_step_s". An engine
    without the device clock (a `DataParallelEngine`'s figures): the share of its step time
    outside the programs, None per step."""
    busy, idle = timings.get("device_busy_s"), timings.get("device_idle_s")
    if busy is None or idle is None:
        share = 1 - (timings["prefill_s"] + timings["decode_s"]) / max(timings["step_s"], 1e-9)
        return {"host_share": share, "device_idle_per_step_s": None}
    return {"host_share": idle / max(busy + idle, 1e-9),
            "device_idle_per_step_s": idle / max(steps, 1)}


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def summary_lines(figures: dict) -> list[str]:
    """The figures of `run_workload` as a few readable lines."""
    f = figures
    tpot = "-" if f["tpot_p50"] is None else (f"{f['tpot_p50'] * 1e3:.1f} / "
                                              f"{f['tpot_p99'] * 1e3:.1f} ms")
    lines = [
        f"requests: {f['requests']} in {f['wall_s']:.1f} s; {f['output_tokens']} output tokens, "
        f"{f['tokens_per_s']:.1f} tokens/s",
        f"running requests per step: mean {f['mean_running']:.2f}, peak {f['peak_running']}",
        f"time to first token p50 / p99: {f['ttft_p50']:.3f} / {f['ttft_p99']:.3f} s; time per "
        f"output token p50 / p99: {tpot}",
        f"prompt tokens prefilled {f['prefill_tokens']}, from the prefix cache "
        f"{f['cached_tokens']}; programs per output token {f['programs_per_token']:.3f}; "
        f"device idle, waiting for the host, {f['host_share']:.1%} of its time"
        + ("" if f.get("device_idle_per_step_s") is None
           else f" ({f['device_idle_per_step_s'] * 1e3:.2f} ms per step)"),
    ]
    if f.get("draft_proposed"):
        lines.append(f"drafts: {f['draft_accepted']} of {f['draft_proposed']} accepted; "
                     f"{f['decode_steps']} decode steps for {f['decode_tokens']} tokens")
    if "hit_rate" in f:
        lines.append(f"offload: hit rate {f['hit_rate']:.3f}, H2D "
                     f"{f['h2d_bytes_per_token'] / 1e3:.2f} kB per output token")
    if "group_hit_rate" in f:
        rates = " / ".join(f"{r:.3f}" for r in f["group_hit_rate"])
        lines.append(f"offload per indexer group: hit rate {rates}; bytes moved H2D "
                     f"{_fmt_bytes(f['h2d_bytes'])}, D2H {_fmt_bytes(f['d2h_bytes'])}")
    if "data_parallel" in f:
        d = f["data_parallel"]
        spread = "-" if d["max_over_mean"] is None else f"{d['max_over_mean']:.2f}"
        lines.append(f"data parallel ({d['placement']}): requests per rank "
                     f"{d['placed_per_rank']}, rows copied per rank {d['rank_misses']}, "
                     f"largest rank / mean per step {spread}")
    if "pool_pages" in f:
        p = f["pool_pages"]
        lines.append(f"pool pages at the end: {p['free']} free, {p['held']} held, "
                     f"{p['cached']} cached of {p['total']}")
    return lines


__all__ = ["poisson_workload", "run_workload", "summary_lines"]

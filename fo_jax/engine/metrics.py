"""Serving metrics: counters summed on the device per step, read on the host every N steps,
written as JSON lines and exposed in Prometheus' text format.

    engine = Engine(..., metrics_path="run.jsonl", metrics_every=16)   # or:
    log = MetricsLog(engine, path="run.jsonl", every=16); engine.metrics = log
    while engine.has_unfinished():
        engine.step()            # the engine calls log.add_stats / log.on_step
    log.flush()                  # a last record for the steps since the last read
    print(log.prometheus_text())

`accumulate` adds a decode call's `LoopStats` to a device accumulator (`DeviceCounters`, per
indexer group and outcome, plus bytes each way); `MetricsLog` reads it every `every` steps and
writes one JSON record (totals, deltas, gauges, finished requests); `summarize` reduces
records; `prometheus_families(record)` gives `prometheus_client` metric families, which the
server's /metrics shows.

Contracts: no host sync per step (one read of 4 G + 2 numbers every `every` steps); the
totals are host Python numbers, exact at any run length; a group's hits + tail_hits + misses
are its selections. Offload counters are absent on the resident path. The record's fields and
the metric families: docs/guides/serving.md, "Metrics".
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.flags import check_output_path

GROUP_KINDS = ("hits", "tail_hits", "misses", "union")
BYTE_KINDS = ("h2d_bytes", "d2h_bytes")
POOL_STATES = ("free", "held", "cached", "total")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceCounters:
    """Offload counters summed over the decode calls since the last read, on the device.

    Attributes:
      hits, tail_hits, misses: [G] int32 selected rows per group by outcome.
      union: [G] int32 rows copied into each layer of the group (distinct misses).
      h2d_bytes, d2h_bytes: [] float32 bytes moved (every request and layer).
      calls: [] int32 decode calls added.
    """

    hits: jax.Array
    tail_hits: jax.Array
    misses: jax.Array
    union: jax.Array
    h2d_bytes: jax.Array
    d2h_bytes: jax.Array
    calls: jax.Array

    @classmethod
    def zeros(cls, groups: int) -> "DeviceCounters":
        g = jnp.zeros((groups,), jnp.int32)
        return cls(hits=g, tail_hits=g, misses=g, union=g, h2d_bytes=jnp.zeros((), jnp.float32),
                   d2h_bytes=jnp.zeros((), jnp.float32), calls=jnp.zeros((), jnp.int32))


@jax.jit
def accumulate(counters: DeviceCounters, stats) -> DeviceCounters:
    """counters + one decode call's `LoopStats` reduced over requests and ways (O(G B W)),
    on the device: no host sync."""
    per_group = lambda x: jnp.sum(x.reshape(x.shape[0], -1), axis=1).astype(jnp.int32)
    return DeviceCounters(
        hits=counters.hits + per_group(stats.hits),
        tail_hits=counters.tail_hits + per_group(stats.tail_hits),
        misses=counters.misses + per_group(stats.misses),
        union=counters.union + per_group(stats.union),
        h2d_bytes=counters.h2d_bytes + jnp.sum(stats.h2d_bytes).astype(jnp.float32),
        d2h_bytes=counters.d2h_bytes + jnp.sum(stats.d2h_bytes).astype(jnp.float32),
        calls=counters.calls + 1)


def group_totals(stats) -> dict:
    """Per-group sums of `LoopStats` (or anything with its fields; one device-to-host read):
    {"hits": [G], "tail_hits": [G], "misses": [G], "union": [G]} as Python floats; {} for
    None (the resident path, or before the first decode call)."""
    if stats is None:
        return {}
    host = jax.device_get(stats)
    out = {}
    for name in GROUP_KINDS:
        arr = np.asarray(getattr(host, name), np.float64)
        out[name] = arr.reshape(arr.shape[0], -1).sum(axis=1).tolist()
    return out


def page_bytes(engine) -> dict:
    """Bytes of one pool page: {"host_kv": KV of every layer, on the host ("device_kv" with
    the pool in device memory, `host_memory_kind="device"`), "device_index_keys": indexer keys
    and slot maps, on the device} (the planner's `MemoryCosts`); {} on the resident path or for
    an engine without an offload config."""
    offload, config = getattr(engine, "offload", None), getattr(engine, "config", None)
    if offload is None or config is None or getattr(engine, "pool", None) is None:
        return {}
    from fo_jax.engine.costs import MemoryCosts

    costs = MemoryCosts.from_config(config, page_size=offload.page_size,
                                    hot_slots=offload.hot_slots,
                                    num_buffers=min(4, config.num_layers))
    kv = "device_kv" if offload.host_memory_kind == "device" else "host_kv"
    return {kv: costs.page_host_bytes, "device_index_keys": costs.page_device_bytes}


def pool_bytes(pages: dict | None, per_page: dict) -> dict | None:
    """{pool: {state: bytes}} for the held / cached / total pages of `pages`."""
    if not pages or not per_page:
        return None
    return {pool: {state: int(pages[state]) * int(size) for state in ("held", "cached", "total")}
            for pool, size in per_page.items()}


def check_engine(engine) -> None:
    """Raise NotImplementedError for an engine whose steps span processes
    (`ShardedEngine.multiprocess`): its offload statistics are split over the processes and a
    read of them would be a collective every process makes at the same point."""
    if getattr(engine, "multiprocess", False):
        raise NotImplementedError(
            "the metrics log (metrics_path, --metrics-jsonl) runs in one process: the "
            "sharded engine across processes writes none yet")


class MetricsLog:
    """Counters of an engine, accumulated on the device per step and read every `every` steps
    (see the module doc). The engine calls `add_stats` after each decode call and `on_step`
    after each step when it holds the log as `engine.metrics`; a caller may also call them.

    Args:
      engine: the `Engine` whose host figures (queue, pool, counters) are sampled.
      path: append one JSON line per read here (None: keep `last` only); its directory must
        exist (`fo_jax.flags.check_output_path`: ValueError at once).
      every: steps between reads (>= 1).
      on_record: called with each record (e.g. a server publishing it).
    """

    def __init__(self, engine, *, path: str | os.PathLike | None = None, every: int = 16,
                 on_record: Callable[[dict], Any] | None = None):
        if not isinstance(every, numbers.Integral) or isinstance(every, bool) or every < 1:
            raise ValueError(f"metrics_every={every!r} must be an int >= 1 (engine steps "
                             "between reads of the device counters)")
        check_engine(engine)
        if path is not None:  # refused now, not at the first record
            check_output_path(path)
        self.engine, self.path, self.every = engine, path, int(every)
        self.on_record = on_record
        self._page_bytes = page_bytes(engine)
        # Allocated by the first decode call's LoopStats (never on the resident path).
        self._zeros = self._device = None
        self._fetch = jax.device_get  # every device-to-host read goes through here
        self.reads = 0  # device-to-host reads of the counters
        self.records = 0  # records written (one per read; the resident path reads nothing)
        self.steps = 0
        self._last_read_step = 0
        self._queue_max = 0
        self._finished: list[dict] = []
        self._totals: dict[str, Any] = {}
        self._start = time.perf_counter()
        self.last: dict | None = None

    # Per step: no host sync ----------------------------------------------------------------

    def add_stats(self, stats) -> None:
        """Add one decode call's `LoopStats` (None on the resident path) on the device."""
        if stats is None:
            return
        if self._device is None:
            self._zeros = self._device = DeviceCounters.zeros(stats.hits.shape[0])
        self._device = accumulate(self._device, stats)

    def on_step(self, outputs=()) -> dict | None:
        """After an engine step with its `RequestOutput`s: sample the host figures; every
        `every` steps, read the device counters and write a record (returned; else None)."""
        self.steps += 1
        self._queue_max = max(self._queue_max, self.engine.num_waiting())
        for out in outputs:
            if out.finished:
                self._finished.append({
                    "request_id": out.request_id, "prompt_tokens": out.prompt_tokens,
                    "output_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
                    "ttft_s": out.time_to_first_token, "tpot_s": out.time_per_output_token})
        if self.steps % self.every == 0:
            return self.read()
        return None

    # Every N steps ---------------------------------------------------------------------------

    def flush(self) -> dict | None:
        """A record for the steps since the last read (None if there were none)."""
        if self.steps == self._last_read_step and not self._finished:
            return None
        return self.read()

    def read(self) -> dict:
        """Read the device counters once, reset them, and write a record."""
        now = {}
        if self._device is not None:
            host = self._fetch(self._device)
            self.reads += 1
            self._device = self._zeros
            for name in GROUP_KINDS:
                now[name] = [int(v) for v in np.asarray(getattr(host, name))]
            for name in BYTE_KINDS:
                now[name] = float(np.asarray(getattr(host, name)))
            now["decode_calls_offloaded"] = int(np.asarray(host.calls))
        engine = self.engine
        counters = dict(getattr(engine, "counters", {}))
        counters.setdefault("preemptions", 0)
        deltas = {}
        for name, value in now.items():  # device counters: the read is the delta
            deltas[name] = value
            old = self._totals.get(name)
            self._totals[name] = (value if old is None else
                                  [a + b for a, b in zip(old, value)] if isinstance(value, list)
                                  else old + value)
        for name, value in counters.items():  # host counters: totals, deltas from the last
            deltas[name] = value - self._totals.get(name, 0)
            self._totals[name] = value
        occupancy = engine.pool_occupancy() if hasattr(engine, "pool_occupancy") else None
        ranks = engine.rank_figures() if hasattr(engine, "rank_figures") else None
        record = {
            "step": self.steps, "time": time.time(),
            "elapsed_s": time.perf_counter() - self._start,
            "interval_steps": self.steps - self._last_read_step,
            "totals": {k: (list(v) if isinstance(v, list) else v)
                       for k, v in self._totals.items()},
            "deltas": deltas,
            "gauges": {"queue_length": engine.num_waiting(),
                       "queue_length_max": max(self._queue_max, engine.num_waiting()),
                       "running": engine.num_running(), "pool_pages": occupancy,
                       "pool_bytes": pool_bytes(occupancy, self._page_bytes)},
            "requests": self._finished,
        }
        if ranks is not None:  # an engine of many ranks (`ShardedEngine.rank_figures`)
            record["ranks"] = ranks
        self._finished, self._queue_max = [], 0
        self._last_read_step = self.steps
        self.last = record
        self.records += 1
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.on_record is not None:
            self.on_record(record)
        return record

    def prometheus_text(self) -> str:
        """The last record in Prometheus' text format (empty before the first read)."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        record = self.last

        class _Collector:
            def describe(self):
                return []

            def collect(self):
                if record is not None:
                    yield from prometheus_families(record)

        registry.register(_Collector())
        return generate_latest(registry).decode()


def rank_families(ranks: list[dict]):
    """Per-rank gauges of a record's "ranks" (`ShardedEngine.rank_figures`):
    `fojax_rank_requests_running{rank}`, `fojax_rank_requests_waiting{rank}`,
    `fojax_rank_rows_copied{rank}` and, paged, `fojax_rank_pool_pages{rank, state}` and
    `fojax_rank_device_bytes_used{rank}`."""
    from prometheus_client.core import GaugeMetricFamily

    for name, doc in (("running", "Requests in a seat of the rank"),
                      ("waiting", "Requests waiting for a seat of the rank"),
                      ("rows_copied", "Rows the rank copied from its host pool (since the "
                       "figures were reset)"),
                      ("device_bytes_used", "Device bytes of the rank's request state (the "
                       "planner's arithmetic; what its device_bytes budget is charged)")):
        if any(r[name] is None for r in ranks):
            continue
        metric = "fojax_rank_" + (f"requests_{name}" if name in ("running", "waiting")
                                  else name)
        family = GaugeMetricFamily(metric, doc, labels=["rank"])
        for r in ranks:
            family.add_metric([str(r["rank"])], r[name])
        yield family
    if all(r["pool_pages"] for r in ranks):
        pages = GaugeMetricFamily("fojax_rank_pool_pages", "Pages of the rank's pool by state",
                                  labels=["rank", "state"])
        for r in ranks:
            for state in POOL_STATES:
                pages.add_metric([str(r["rank"]), state], r["pool_pages"][state])
        yield pages


def summarize(records) -> dict:
    """Run figures from records (the last one's totals, every record's requests): per-group
    hit rate ((hits + tail_hits) / selections), bytes moved, TTFT / TPOT p50 and p99."""
    records = list(records)
    if not records:
        return {}
    totals = records[-1]["totals"]
    out: dict[str, Any] = {"reads": len(records), "steps": records[-1]["step"]}
    if "hits" in totals:
        out["group_hit_rate"] = [
            (h + t) / max(h + t + m, 1)
            for h, t, m in zip(totals["hits"], totals["tail_hits"], totals["misses"])]
        out["h2d_bytes"], out["d2h_bytes"] = totals["h2d_bytes"], totals["d2h_bytes"]
    requests = [r for rec in records for r in rec["requests"]]
    for name in ("ttft_s", "tpot_s"):
        values = np.asarray([r[name] for r in requests if r[name] is not None], np.float64)
        if values.size:
            out[f"{name[:-2]}_p50"] = float(np.percentile(values, 50))
            out[f"{name[:-2]}_p99"] = float(np.percentile(values, 99))
    return out


# Prometheus ------------------------------------------------------------------------------------


def group_family(groups: dict):
    """`fojax_offload_group_rows{group, kind}` (a counter) from `group_totals`' dict."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(
        "fojax_offload_group_rows",
        "Offloaded decode: selected rows per indexer group by outcome (hits, tail_hits, misses; "
        "their sum is the group's selections) and rows copied (union)",
        labels=["group", "kind"])
    for kind in GROUP_KINDS:
        for g, value in enumerate(groups.get(kind, ())):
            family.add_metric([str(g), kind], value)
    return family


def pool_bytes_family(pool: dict):
    """`fojax_pool_bytes{pool, state}` (a gauge) from `pool_bytes`' dict."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(
        "fojax_pool_bytes", "Bytes of the shared page pools (host_kv: KV pages in host memory, or "
        "device_kv: in device memory; device_index_keys: indexer-key pages on the device) by "
        "state", labels=["pool", "state"])
    for name, states in pool.items():
        for state, value in states.items():
            family.add_metric([name, state], value)
    return family


def counter_family(name: str, documentation: str, value: float):
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, documentation, value=value)


def preemptions_family(counters: dict):
    """`fojax_preemptions` (a counter): requests preempted (their seat freed; their pages
    kept or dropped)."""
    return counter_family("fojax_preemptions",
                          "Requests preempted (seat freed; pages kept or dropped)",
                          counters.get("preemptions", 0))


def preemption_families(counters: dict):
    """`fojax_preemptions` and how preempted requests come back: `fojax_preemptions_kept_pages`
    (preempted with their pages kept: device bytes were short),
    `fojax_resumed_without_recompute` (resumed from their kept pages) and
    `fojax_replayed_tokens` (tokens fed again through the decode step after dropped pages)."""
    yield preemptions_family(counters)
    yield counter_family("fojax_preemptions_kept_pages",
                         "Requests preempted keeping their pages (device bytes short)",
                         counters.get("preemptions_kept_pages", 0))
    yield counter_family("fojax_resumed_without_recompute",
                         "Preempted requests resumed from their kept pages (nothing recomputed)",
                         counters.get("resumed_without_recompute", 0))
    yield counter_family("fojax_replayed_tokens",
                         "Tokens replayed through the decode step by requests resumed after "
                         "their pages were dropped", counters.get("replayed_tokens", 0))


def prefix_hits_family(counters: dict):
    """`fojax_prefix_cache_hit_tokens` (a counter): prompt tokens served from the prefix cache
    (offloaded: cached pages mapped; resident: cached rows copied into the seat)."""
    return counter_family("fojax_prefix_cache_hit_tokens",
                          "Prompt tokens served from the prefix cache (cached pages mapped, "
                          "or cached rows copied into the seat; not prefilled)",
                          counters.get("prefix_hit_tokens", 0))


def prometheus_families(record: dict):
    """Every metric family of a `MetricsLog` record (docs/guides/serving.md, "Metrics")."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    totals, gauges = record["totals"], record["gauges"]
    yield GaugeMetricFamily("fojax_requests_waiting", "Requests waiting for a seat (queue length)",
                            value=gauges["queue_length"])
    yield GaugeMetricFamily("fojax_requests_running", "Requests in a seat",
                            value=gauges["running"])
    yield from preemption_families(totals)
    yield prefix_hits_family(totals)
    if "hits" in totals:
        yield group_family(totals)
        moved = CounterMetricFamily("fojax_offload_bytes", "Offloaded decode: bytes moved",
                                    labels=["direction"])
        moved.add_metric(["h2d"], totals["h2d_bytes"])
        moved.add_metric(["d2h"], totals["d2h_bytes"])
        yield moved
    if gauges["pool_pages"]:
        pages = GaugeMetricFamily("fojax_pool_pages", "Pages of the shared pools by state",
                                  labels=["state"])
        for state in POOL_STATES:
            pages.add_metric([state], gauges["pool_pages"][state])
        yield pages
    if gauges["pool_bytes"]:
        yield pool_bytes_family(gauges["pool_bytes"])
    if record.get("ranks"):
        yield from rank_families(record["ranks"])


__all__ = ["DeviceCounters", "MetricsLog", "accumulate", "check_engine", "group_family",
           "group_totals", "page_bytes", "pool_bytes", "pool_bytes_family",
           "preemption_families", "preemptions_family", "prefix_hits_family",
           "prometheus_families", "rank_families", "summarize"]

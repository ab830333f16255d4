"""Serving metrics (fo_jax.engine.metrics): counters summed on the device and read only every N
steps, JSON lines whose counters agree with each other and with what the requests did, the
Prometheus text of a log and of the server's /metrics."""

import functools
import json
import time

import jax
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fo_jax.config import get_config
from fo_jax.engine.engine import Engine
from fo_jax.engine.metrics import MetricsLog, group_totals, summarize
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

# Two layers, one indexer group each, top-4: two groups whose counters differ. Seats of 32.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0, 1), max_ways=1,
                                    index_topk=4)
CAPACITY, EVERY = 32, 2
REQUESTS = [(3, 6), (8, 5), (5, 7)]  # (prompt tokens, max_tokens): 3 requests, 2 seats,
# every prompt one prefill chunk (one prefill program to compile)


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _engine(offloaded: bool, **kwargs):
    offload = (OffloadConfig(hot_slots=8, page_size=4, capacity=CAPACITY, policy="ring")
               if offloaded else None)
    return Engine(_params(), CONFIG, seats=2, capacity=CAPACITY, offload=offload,
                  decode_steps_per_call=2, prefill_chunk=8, query_block=None, **kwargs)


def _run(engine):
    """Run REQUESTS to the end, counting the log's device reads by the step they happen at."""
    log = engine.metrics
    fetched, fetch = [], log._fetch
    log._fetch = lambda tree: fetched.append(log.steps) or fetch(tree)
    rng = np.random.default_rng(0)
    ids = [engine.add_request(rng.integers(0, CONFIG.vocab_size, n).tolist(), max_tokens=m)
           for n, m in REQUESTS]
    outputs = engine.run()
    log.flush()
    return [outputs[i] for i in ids], fetched


@pytest.fixture(scope="module")
def offloaded_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("metrics") / "run.jsonl"
    engine = _engine(True, metrics_path=str(path), metrics_every=EVERY)
    outs, fetched = _run(engine)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return engine, outs, fetched, records


def test_reads_only_every_n_steps(offloaded_run):
    engine, _, fetched, records = offloaded_run
    steps = engine.counters["steps"]
    assert steps > 2 * EVERY
    want = list(range(EVERY, steps + 1, EVERY)) + ([steps] if steps % EVERY else [])
    assert [r["step"] for r in records] == want  # a record every EVERY steps, and the flush
    assert fetched == want  # one device-to-host read per record, none in between
    assert engine.metrics.reads == engine.metrics.records == len(records)
    assert [r["interval_steps"] for r in records] == np.diff([0] + want).tolist()
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(engine.metrics._device))


def test_counters_are_consistent(offloaded_run):
    """Deltas sum to totals; per group, hits + tail hits + misses are the selections (min(K,
    visible tokens) per decode step); both agree with the engine's own LoopStats sums; bytes
    follow the rows moved; every request's TTFT and TPOT are there."""
    engine, outs, _, records = offloaded_run
    totals = records[-1]["totals"]
    for name, total in totals.items():
        summed = np.sum([r["deltas"][name] for r in records], axis=0)
        np.testing.assert_allclose(summed, total, err_msg=name)
    k = CONFIG.index_topk
    selections = sum(min(k, prompt + i + 1)  # decode step i sees the prompt and i + 1 tokens
                     for (prompt, _), out in zip(REQUESTS, outs)
                     for i in range(len(out.token_ids) - 1))
    for g in range(CONFIG.num_groups):
        assert totals["hits"][g] + totals["tail_hits"][g] + totals["misses"][g] == selections
    assert totals["hits"] != totals["hits"][::-1] or totals["misses"] != totals["misses"][::-1]
    engine_sums = group_totals(engine.stats)
    for name in ("hits", "tail_hits", "misses", "union"):
        assert totals[name] == engine_sums[name], name
    row_bytes = CONFIG.kv_width * CONFIG.jnp_kv_dtype.itemsize
    layers = [hi - lo for lo, hi in CONFIG.group_bounds]
    assert totals["decode_tokens"] == sum(len(o.token_ids) - 1 for o in outs)
    assert totals["d2h_bytes"] == totals["decode_tokens"] * CONFIG.num_layers * row_bytes
    assert totals["h2d_bytes"] == row_bytes * sum(u * n for u, n in zip(totals["union"], layers))
    assert totals["preemptions"] == totals["preemptions_kept_pages"] == 0
    assert totals["decode_calls"] == totals["decode_calls_offloaded"]
    finished = {r["request_id"]: r for rec in records for r in rec["requests"]}
    assert sorted(finished) == sorted(o.request_id for o in outs)
    for out in outs:
        r = finished[out.request_id]
        assert r["output_tokens"] == len(out.token_ids) and r["finish_reason"] == "length"
        assert r["ttft_s"] == out.time_to_first_token > 0 and r["tpot_s"] > 0
    assert records[0]["gauges"]["queue_length_max"] == 1  # the third request waited
    gauges = records[-1]["gauges"]
    assert gauges["queue_length"] == gauges["running"] == gauges["pool_pages"]["held"] == 0
    total_pages = gauges["pool_pages"]["total"]
    page_kv = 4 * CONFIG.num_layers * row_bytes  # pages of 4 tokens, every layer
    assert gauges["pool_bytes"]["host_kv"]["total"] == total_pages * page_kv
    assert gauges["pool_bytes"]["device_index_keys"]["held"] == 0
    summary = summarize(records)
    assert summary["group_hit_rate"] == [
        (h + t) / selections for h, t in zip(totals["hits"], totals["tail_hits"])]
    assert summary["ttft_p50"] > 0 and summary["h2d_bytes"] == totals["h2d_bytes"]


def _families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_text_of_a_log(offloaded_run):
    engine, _, _, records = offloaded_run
    totals = records[-1]["totals"]
    families = _families(engine.metrics.prometheus_text())
    rows = {(s.labels["group"], s.labels["kind"]): s.value
            for s in families["fojax_offload_group_rows"].samples}
    for g in range(CONFIG.num_groups):
        for kind in ("hits", "tail_hits", "misses", "union"):
            assert rows[(str(g), kind)] == totals[kind][g]
    moved = {s.labels["direction"]: s.value for s in families["fojax_offload_bytes"].samples}
    assert moved == {"h2d": totals["h2d_bytes"], "d2h": totals["d2h_bytes"]}
    pools = {(s.labels["pool"], s.labels["state"]) for s in families["fojax_pool_bytes"].samples}
    assert ("host_kv", "total") in pools and ("device_index_keys", "held") in pools
    assert families["fojax_pool_pages"].type == "gauge"
    assert families["fojax_requests_waiting"].samples[0].value == 0
    assert families["fojax_preemptions"].samples[0].value == 0
    for name in ("fojax_preemptions_kept_pages", "fojax_resumed_without_recompute",
                 "fojax_replayed_tokens"):
        assert families[name].type == "counter" and families[name].samples[0].value == 0
    assert families["fojax_prefix_cache_hit_tokens"].type == "counter"


def test_server_metrics_per_group(offloaded_run):
    """/metrics keeps its names and adds the per-group rows, pool bytes and preemptions."""
    from fo_jax.server.app import ServerMetrics
    from fo_jax.server.driver import EngineDriver

    engine, _, _, _ = offloaded_run
    driver = EngineDriver(engine, max_queue=1)
    metrics = ServerMetrics(driver)
    driver.start()
    try:
        deadline = time.monotonic() + 10
        while not driver.snapshot.groups and time.monotonic() < deadline:
            time.sleep(0.01)  # published when the thread goes idle
        text = generate_latest(metrics.registry).decode()
    finally:
        driver.stop(timeout=5)
    families = _families(text)
    sums = group_totals(engine.stats)
    rows = {(s.labels["group"], s.labels["kind"]): s.value
            for s in families["fojax_offload_group_rows"].samples}
    assert rows[("1", "misses")] == sums["misses"][1] and rows[("0", "hits")] == sums["hits"][0]
    assert families["fojax_preemptions"].samples[0].value == 0
    assert families["fojax_resumed_without_recompute"].samples[0].value == 0
    assert {s.labels["pool"] for s in families["fojax_pool_bytes"].samples} == {
        "host_kv", "device_index_keys"}
    for name in ("fojax_offload_rows", "fojax_offload_bytes", "fojax_pool_pages",
                 "fojax_engine_events", "fojax_requests_running", "fojax_requests_waiting"):
        assert name in families, name


def test_resident_records_without_offload_counters(tmp_path):
    path = tmp_path / "resident.jsonl"
    engine = _engine(False, metrics_path=str(path), metrics_every=2)
    outs, fetched = _run(engine)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert fetched == [] and engine.metrics.reads == 0 and len(records) >= 2
    assert "hits" not in records[-1]["totals"] and records[-1]["gauges"]["pool_bytes"] is None
    assert records[-1]["totals"]["decode_tokens"] == sum(len(o.token_ids) - 1 for o in outs)
    families = _families(engine.metrics.prometheus_text())
    assert "fojax_offload_group_rows" not in families and "fojax_requests_running" in families


def test_bad_metrics_every():
    with pytest.raises(ValueError, match=r"metrics_every=0 must be an int >= 1 \(engine steps "
                                         r"between reads of the device counters\)"):
        MetricsLog(None, every=0)
    with pytest.raises(ValueError, match=r"^metrics_every=0 must be an int >= 1$"):
        Engine(_params(), CONFIG, seats=1, capacity=CAPACITY, metrics_path="unused.jsonl",
               metrics_every=0)  # refused before anything is allocated


def test_a_path_that_cannot_be_written_is_refused_at_once(tmp_path):
    """`serve --metrics-jsonl /nonexistent/dir/m.jsonl` started, then its first record failed
    the request in flight and ended the engine thread."""
    with pytest.raises(ValueError, match="^/nonexistent/dir/m.jsonl: the directory "
                                         "/nonexistent/dir does not exist: create it first$"):
        MetricsLog(None, path="/nonexistent/dir/m.jsonl")
    with pytest.raises(ValueError, match=f"^{tmp_path} is a directory: give a file path$"):
        MetricsLog(None, path=tmp_path)

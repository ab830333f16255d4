"""DataParallelEngine (fo_jax.engine.data_parallel): a request stream on 4 simulated devices
in a subprocess (dp_engine_cases.py: tokens bit for bit those of a single-device Engine, the
placement rule followed, arrays and host pools on their rank's device, pools empty at the
end); with MTP drafts on 2 simulated devices in another (dp_mtp_cases.py: tokens bit for bit
those of one Engine with the same MTP drafter, offloaded (resident by hand), each rank's MTP
layer on its device, draft counters summed; `serve --devices 2 --drafter mtp` builds it); in this
process (one device, listed twice: two ranks) the refusals and the placement bookkeeping,
without stepping."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from fo_jax.config import get_config
from fo_jax.engine.data_parallel import DataParallelEngine
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests", "engine", "dp_engine_cases.py")
MTP_CASES = os.path.join(ROOT, "tests", "engine", "dp_mtp_cases.py")
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=1,
                                    index_topk=4)
OFFLOAD = OffloadConfig(hot_slots=8, page_size=4, capacity=32, policy="ring")


def _run_cases(script, devices):
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # subprocess.run kills the child when the time is up.
    proc = subprocess.run([sys.executable, script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "ALL OK" in proc.stdout, output[-6000:]


def test_stream_on_four_devices():
    _run_cases(CASES, 4)  # ~45 s of CPU on a quiet machine


def test_mtp_drafts_on_two_devices():
    _run_cases(MTP_CASES, 2)  # ~45 s of CPU on a quiet machine


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.key(0))


def _engine(placement=None, offload=OFFLOAD, **kwargs):
    device = jax.devices()[0]
    kwargs.setdefault("seats", 1)
    return DataParallelEngine(_params(), CONFIG, devices=[device, device], placement=placement,
                              capacity=32, offload=offload, prefill_chunk=8, query_block=None,
                              **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(devices=[]), "devices=[] holds no rank: give at least one device (default: "
                       "jax.local_devices())"),
    (dict(devices=["cpu:0"]), "devices must be this process's jax devices "
                              "(jax.local_devices()), got 'cpu:0'"),
    (dict(placement="random"), "placement='random' is not a placement rule; choose one of "
                               "('round_robin', 'least_requests', 'least_context', "
                               "'least_misses') (fo_jax.placement)"),
    (dict(placement="least_misses", offload=None),
     "placement='least_misses' needs the offloaded path (an OffloadConfig): the resident path "
     "copies no misses; use 'least_context'"),
    (dict(metrics_path="m.jsonl"), "metrics_path is not supported by DataParallelEngine (one "
                                   "log per engine); read counters, stats and imbalance() "
                                   "instead"),
    (dict(seats=0), "seats=0 must be an int >= 1"),  # the Engine's own
    (dict(mtp="MTP"), "mtp (the MTP parameters) is read only with drafter='mtp': pass "
                      "drafter='mtp', or drop mtp"),  # the Engine's, not a failed copy
])
def test_refused_settings(kwargs, message):
    kwargs.setdefault("seats", 1)
    devices = kwargs.pop("devices", [jax.devices()[0]])
    offload = kwargs.pop("offload", OFFLOAD)
    with pytest.raises(ValueError) as e:
        DataParallelEngine(_params(), CONFIG, devices=devices, offload=offload, capacity=32,
                           **kwargs)
    assert str(e.value) == message


def test_defaults_and_placement_bookkeeping():
    """Default rules; least_context places by tokens held, round robin in turn; a refused
    request changes nothing; ids are unique over the ranks; cancel and release find the
    rank. No step runs (nothing compiles)."""
    assert _engine().placement == "least_misses"
    assert _engine(offload=None).placement == "least_context"
    engine = _engine("least_context")
    assert engine.ranks == 2 and engine.seats == 2
    # The ranks run without overlap (they step side by side already).
    assert not any(e.settings.scheduler.overlap for e in engine.engines)
    assert engine.add_request(list(range(20)), max_tokens=2) == "req-0"
    assert engine.choose_rank(3) == (1, 0)
    assert engine.add_request([1, 2, 3], max_tokens=2) == "req-1"
    assert engine.add_request([1, 2], max_tokens=2) == "req-2"  # every seat promised: rank 1
    assert [engine.rank_of(f"req-{i}") for i in range(3)] == [0, 1, 1]
    assert engine.rank_loads() == [20.0, 5.0]
    with pytest.raises(ValueError, match="does not fit a seat of 32 tokens"):
        engine.add_request(list(range(40)))
    with pytest.raises(ValueError) as e:
        engine.add_request([1], request_id="req-1")
    assert str(e.value) == ("request_id 'req-1' is already in use (queued, running or "
                            "finished and not yet collected)")
    assert engine.placed_per_rank == [1, 2] and engine.num_waiting() == 3
    assert engine.cancel("req-0") and engine.rank_loads() == [0.0, 5.0]
    assert engine.release("req-0").finish_reason == "cancelled"
    with pytest.raises(KeyError, match="no request 'req-0'"):
        engine.cancel("req-0")
    assert engine.pool_occupancy() == {"free": 16, "held": 0, "cached": 0, "total": 16}
    robin = _engine("round_robin", seats=2)
    got = [robin.rank_of(robin.add_request([1, 2], max_tokens=1)) for _ in range(3)]
    assert got == [0, 1, 0]
    robin.close()
    with pytest.raises(RuntimeError, match="was closed"):
        robin.step()


def test_bench_workload_over_two_ranks():
    """fo_jax.engine.bench runs a DataParallelEngine (two ranks on one device): every rank
    warmed, the pools empty at the end, the imbalance figures reported."""
    from fo_jax.engine.bench import poisson_workload, run_workload, summary_lines

    engine = _engine("least_context", seats=2)
    requests = poisson_workload(4, rate=100.0, prompt_len=(2, 8), output_len=(2, 4),
                                vocab=CONFIG.vocab_size)
    figures = run_workload(engine, requests)
    assert figures["requests"] == 4 and figures["pool_pages"]["held"] == 0
    dp = figures["data_parallel"]
    assert dp["placement"] == "least_context" and sum(dp["placed_per_rank"]) == 4
    assert min(dp["placed_per_rank"]) >= 1 and dp["max_over_mean"] >= 1.0
    assert len(dp["rank_misses"]) == 2 and figures["hit_rate"] <= 1
    assert engine.counters["requests_finished"] == 4  # the warm-up's left out
    assert any(line.startswith("data parallel (least_context): requests per rank")
               for line in summary_lines(figures))


def test_fp8_kv_format_over_two_ranks():
    """kv_format="fp8_ds_mla" data-parallel (two ranks on one device, offloaded): each rank's
    host pool holds uint8 rows and every request's tokens are those of its solo run on a
    resident Engine of the same format, bit for bit."""
    from fo_jax.engine import Engine

    config = CONFIG.replace(kv_format="fp8_ds_mla")
    device = jax.devices()[0]
    engine = DataParallelEngine(_params(), config, devices=[device, device],
                                placement="round_robin", seats=1, capacity=32, offload=OFFLOAD,
                                prefill_chunk=8, query_block=None)
    assert all(e.state.host.kv.dtype == jnp.uint8 for e in engine.engines)
    prompts = [[(7 * i + j) % CONFIG.vocab_size for j in range(3 + 4 * i)] for i in range(3)]
    ids = [engine.add_request(p, max_tokens=5) for p in prompts]
    assert [engine.rank_of(rid) for rid in ids] == [0, 1, 0]
    outputs = engine.run()
    assert engine.pool_occupancy()["held"] == 0
    engine.close()
    solo = Engine(_params(), config, seats=1, capacity=32, prefill_chunk=8, query_block=None)
    for prompt, rid in zip(prompts, ids):
        ref = solo.add_request(prompt, max_tokens=5)
        want = solo.run()[ref]
        assert outputs[rid].token_ids == want.token_ids and outputs[rid].finish_reason == \
            want.finish_reason == "length"


def test_cli_devices_flags(capsys):
    import argparse

    from fo_jax import cli
    from fo_jax.server.serve import add_engine_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    engine = build_engine(parser.parse_args(["--model", "tiny", "--offload", "--capacity", "64",
                                             "--devices", "1"]))[0]
    assert isinstance(engine, DataParallelEngine)
    assert (engine.ranks, engine.placement) == (1, "least_misses")
    n = len(jax.local_devices())
    for flags, message in [
            (["--devices", str(n + 1)], f"--devices {n + 1} must be in [1, {n}] (this "
             "process's devices; on a CPU, simulate more with XLA_FLAGS="
             f"--xla_force_host_platform_device_count={n + 1})"),
            (["--placement", "round_robin"], "--placement chooses among data-parallel ranks: "
             "add --devices N"),
            (["--devices", "1", "--placement", "least_misses"], "--placement least_misses "
             "needs --offload (the resident path copies no misses)"),
            (["--devices", "1", "--metrics-jsonl", "m.jsonl"], "--metrics-jsonl is not "
             "supported with --devices alone (one log per engine; the data-parallel server "
             "runs one engine per device): add --expert-parallel N")]:
        assert cli.main(["bench-serve", "--model", "tiny", *flags]) == 2
        assert message in capsys.readouterr().err


def test_server_driver_over_two_ranks():
    """The HTTP server's EngineDriver runs a DataParallelEngine as it runs an Engine (the
    same calls): requests are served, released, and the snapshot sums the ranks' pools."""
    import asyncio

    from fo_jax.server.driver import Accepted, EngineDriver

    engine = _engine("least_context", seats=2)
    driver = EngineDriver(engine, max_queue=4, stats_every=1)
    driver.start()

    async def drain(handle):
        items = []
        while not getattr(items[-1] if items else None, "finished", False):
            items.append(await asyncio.wait_for(handle.queue.get(), 60))
        return items

    async def main():
        loop = asyncio.get_running_loop()
        handles = [driver.submit([1 + i, 2, 3], loop=loop, max_tokens=3) for i in range(3)]
        return await asyncio.gather(*(drain(h) for h in handles))

    try:
        got = asyncio.run(main())
    finally:
        assert driver.stop(timeout=30)
    assert all(isinstance(items[0], Accepted) for items in got)
    assert [items[-1].finish_reason for items in got] == ["length"] * 3
    assert [len(items[-1].token_ids) for items in got] == [3] * 3
    assert not engine.has_unfinished() and engine._placed == {}  # released by the driver
    assert driver.snapshot.pool["total"] == 32 and driver.snapshot.pool["held"] == 0
    assert driver.snapshot.counters["requests_finished"] >= 3


def test_cli_mtp_drafter_with_devices_and_prefix_cache(tmp_path):
    """--devices with --drafter mtp is served (test_mtp_drafts_on_two_devices), with
    --prefix-cache too: each rank keeps the MTP rows of its cached chunks
    (tests/engine/test_engine_mtp.py checks such an engine's tokens)."""
    import argparse
    import pathlib

    from tokenizers import Tokenizer, models, pre_tokenizers

    from fo_jax.server.serve import add_engine_arguments, build_engine

    fixture = pathlib.Path(ROOT) / "tests" / "fixtures" / "parity" / "deepseek_v32"
    parity = tmp_path / "deepseek_v32"
    parity.mkdir()
    for name in ("config.json", "model.safetensors"):
        (parity / name).symlink_to(fixture / name)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(parity / "tokenizer.json"))
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    engine = build_engine(parser.parse_args([
        "--model-dir", str(parity), "--devices", "1", "--drafter", "mtp", "--num-drafts", "1",
        "--offload", "--hot-slots", "64", "--capacity", "64", "--prefill-chunk", "16",
        "--prefix-cache"]))[0]
    assert isinstance(engine, DataParallelEngine) and len(engine.engines) == 1
    rank = engine.engines[0]
    assert rank.drafter == "mtp" and rank.prefix.mtp is not None

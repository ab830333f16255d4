"""The engine's settings as data (fo_jax.engine.settings) and its flags (fo_jax.engine.args):
each group checks itself once, with messages that say what was expected; the flat keywords of
`Engine(...)` and the `fo-jax serve` flags build the same settings."""

import argparse
import dataclasses

import jax
import pytest

from fo_jax.config import get_config
from fo_jax.engine import Engine
from fo_jax.engine.args import EngineArgs
from fo_jax.engine.settings import (CacheSettings, EngineSettings, MetricsSettings,
                                    RequestSettings, SchedulerSettings, SpeculativeSettings)
from fo_jax.model.dsa import init_params
from fo_jax.offload.config import OffloadConfig

CONFIG = get_config("tiny")


def _offload(**kw):
    return OffloadConfig(**{"hot_slots": 64, "page_size": 4, "capacity": 32, **kw})


@pytest.mark.parametrize("build, message", [
    (lambda: CacheSettings(seats=0, capacity=8), "seats=0 must be an int >= 1"),
    (lambda: CacheSettings(seats=1), r"capacity \(tokens per seat\) is required"),
    (lambda: CacheSettings(seats=1, capacity=16, offload=_offload()),
     "capacity=16 differs from offload.capacity=32"),
    (lambda: CacheSettings(seats=1, capacity=8, prefix_cache_bytes=10),
     "prefix_cache_bytes and prefix_cache_memory need prefix_cache=True"),
    (lambda: CacheSettings(seats=1, offload=_offload(), prefix_cache=True,
                           prefix_cache_bytes=10),
     "size the resident path's prefix store; offloaded, the prefix cache keeps pages"),
    (lambda: CacheSettings(seats=1, offload=_offload(), num_pages=4, host_pool_bytes=10),
     "give num_pages or host_pool_bytes, not both"),
    (lambda: CacheSettings(seats=1, offload=_offload(), num_pages=0),
     r"num_pages=0 must be an int >= 1 \(pages of 4 tokens in the shared pools\)"),
    (lambda: SchedulerSettings(prefill_chunk=0), "prefill_chunk=0 must be an int >= 1"),
    (lambda: SchedulerSettings(prefill_batch=0), r"prefill_batch=0 must be an int >= 1 \(the "
                                                 "most prefilling requests one prefill program "
                                                 r"runs; 1: one program per request\)"),
    (lambda: SchedulerSettings(prefill_batch=2.0), "prefill_batch=2.0 must be an int >= 1"),
    (lambda: SchedulerSettings(order="lifo"), r"order='lifo' must be one of"),
    (lambda: SchedulerSettings(max_wait_steps=-2), "max_wait_steps=-2 must be an int >= 0"),
    (lambda: SchedulerSettings(reserve="all"), r"reserve='all' must be one of"),
    (lambda: SchedulerSettings(device_bytes=True), "device_bytes=True must be an int >= 1"),
    (lambda: SchedulerSettings(overlap=1), r"overlap=1 must be True or False \(dispatch the "
                                           "next decode call before reading back the last one"),
    (lambda: SpeculativeSettings(drafter="eagle"), r"drafter='eagle' must be one of"),
    (lambda: RequestSettings(max_stop_ids=0), "max_stop_ids=0 must be an int >= 1"),
    (lambda: MetricsSettings(every=0), "metrics_every=0 must be an int >= 1"),
    (lambda: EngineSettings(cache=CacheSettings(seats=1, capacity=8),
                            scheduler=SchedulerSettings(reserve="prompt")),
     r"reserve='prompt' need a page pool \(an OffloadConfig\)"),
    (lambda: EngineSettings(cache=CacheSettings(seats=1, offload=_offload(), prefix_cache=True),
                            scheduler=SchedulerSettings(prefill_chunk=6)),
     "prefix_cache needs prefill_chunk=6 to be a multiple of page_size=4"),
])
def test_each_group_checks_itself_once(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_settings_are_frozen_and_resolve_the_capacity():
    cache = CacheSettings(seats=2, offload=_offload())
    assert cache.capacity == 32 and cache.paged
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.seats = 3


def test_the_model_checks_and_the_defaults_it_fills_in():
    settings = EngineSettings(cache=CacheSettings(seats=1, capacity=8))
    assert settings.requests.max_logprobs is None
    assert settings.for_model(CONFIG).requests.max_logprobs == min(20, CONFIG.vocab_size)
    too_long = EngineSettings(cache=CacheSettings(seats=1, capacity=CONFIG.max_seq_len + 1))
    with pytest.raises(ValueError, match=r"must be an int in \[1, max_seq_len="):
        too_long.for_model(CONFIG)
    drafts = dataclasses.replace(settings, speculative=SpeculativeSettings(num_drafts=-1))
    with pytest.raises(ValueError, match=r"num_drafts=-1 must be an int >= 0 .* "
                                         r"\(Engine\(num_drafts=...\)\)"):
        drafts.for_model(CONFIG)


def test_flat_keywords_and_settings_build_the_same_engine():
    params = init_params(CONFIG, jax.random.key(0))
    kwargs = dict(seats=2, offload=_offload(), prefill_chunk=8, reserve="prompt",
                  num_pages=6, prefix_cache=True, order="shortest", max_wait_steps=None)
    flat = Engine(params, CONFIG, **kwargs)
    settings = EngineSettings.create(**kwargs)
    assert settings.cache.num_pages == 6 and settings.scheduler.order == "shortest"
    grouped = Engine(params, CONFIG, settings)
    assert flat.settings == grouped.settings
    for name in ("seats", "capacity", "chunk", "max_logprobs"):
        assert getattr(flat, name) == getattr(grouped, name)
    for name in ("order", "reserve", "max_wait_steps"):  # the scheduler's
        assert getattr(flat.scheduler, name) == getattr(grouped.scheduler, name)
    assert flat.kv.max_pages == grouped.kv.max_pages  # the KV store's
    assert grouped.pool.num_pages == 6 and grouped.prefix is not None
    with pytest.raises(TypeError, match="takes no other settings"):
        Engine(params, CONFIG, settings, seats=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sets'"):
        Engine(params, CONFIG, sets=2, capacity=8)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'seats'"):
        Engine(params, CONFIG, capacity=8)


def _args(*argv):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--max-queue", type=int, default=64)  # another command's flag: left
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_the_flags_build_the_settings():
    args = _args("--model", "tiny", "--offload", "--capacity", "64", "--page-size", "8",
                 "--device-gb", "0.5", "--reserve", "prompt", "--queue-order", "shortest",
                 "--max-wait-steps", "-1", "--num-drafts", "2", "--prefill-chunk", "16",
                 "--prefill-batch", "4")
    offload = args.offload_config(CONFIG)
    assert (offload.capacity, offload.page_size, offload.policy) == (64, 8, "ring")
    settings = args.engine_settings(CONFIG, offload)
    assert settings.cache == CacheSettings(seats=4, capacity=64, offload=offload)
    assert settings.scheduler == SchedulerSettings(
        order="shortest", max_wait_steps=None, reserve="prompt", device_bytes=500_000_000,
        prefill_chunk=16, prefill_batch=4)
    assert settings.speculative == SpeculativeSettings(num_drafts=2)
    assert settings.scheduler.overlap  # on by default; --no-overlap turns it off
    assert not _args("--no-overlap").engine_settings(CONFIG, None).scheduler.overlap
    resident = _args("--model", "tiny", "--prefix-cache", "--prefix-cache-gb", "1e-6")
    assert resident.offload_config(CONFIG) is None
    cache = resident.engine_settings(CONFIG, None).cache
    assert (cache.capacity, cache.prefix_cache_bytes) == (min(CONFIG.max_seq_len, 2048), 1000)


@pytest.mark.parametrize("argv, message", [
    (["--seats", "0"], "--seats must be >= 1, got 0"),
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["--prefill-batch", "0"], "--prefill-batch must be >= 1, got 0"),
    (["--offload", "--pool-memory", "disk"], "--pool-memory disk: choose pinned_host"),
    (["--hot-slots", "8"], "--hot-slots applies to the offloaded path only: add --offload"),
    (["--reserve", "prompt"], "--host-pool-gb, --device-gb and --reserve prompt need --offload"),
    (["--prefix-cache-gb", "1"], "--prefix-cache-gb sizes the resident prefix store"),
    (["--max-wait-steps", "-2"], "--max-wait-steps must be >= 0, or -1 for no aging; got -2"),
    (["--placement", "round_robin"], "--placement chooses among data-parallel ranks"),
    (["--devices", "1", "--placement", "least_misses"],
     "--placement least_misses needs --offload"),
    (["--expert-parallel", "2"],
     "--expert-parallel splits the experts over --devices: add --devices"),
    (["--devices", "4", "--expert-parallel", "2"], "--expert-parallel 2 must equal --devices 4: "
     "the sharded engine splits the experts over every device"),
    (["--devices", "2", "--expert-parallel", "2", "--offload", "--pool-memory", "device"],
     "--expert-parallel does not run with --pool-memory device yet: drop it"),
    (["--devices", "2", "--expert-parallel", "2", "--placement", "least_misses"],
     "--placement least_misses needs --offload"),
    (["--devices", "2", "--expert-parallel", "2", "--prefix-cache"],
     "--expert-parallel does not run with --prefix-cache yet: drop it"),
    (["--devices", "2", "--expert-parallel", "2", "--drafter", "ngram"],
     "--expert-parallel does not run with drafts"),
])
def test_bad_flag_combinations_are_refused_before_any_model(argv, message):
    with pytest.raises(ValueError, match=message):
        _args(*argv)


def test_expert_parallel_flags_are_kept():
    args = _args("--devices", "2", "--expert-parallel", "2", "--offload", "--reserve", "prompt")
    assert (args.devices, args.expert_parallel, args.offload, args.reserve) == (2, 2, True,
                                                                                "prompt")
    args = _args("--devices", "2", "--expert-parallel", "2", "--offload", "--placement",
                 "least_misses")
    assert (args.expert_parallel, args.placement) == (2, "least_misses")
    # The budgets are each device's (the sharded engine's per rank: tests/engine/
    # sharded_engine_cases.py).
    args = _args("--model", "tiny", "--devices", "2", "--expert-parallel", "2", "--offload",
                 "--device-gb", "1", "--host-pool-gb", "0.5")
    settings = args.engine_settings(CONFIG, args.offload_config(CONFIG))
    assert (settings.scheduler.device_bytes, settings.cache.host_pool_bytes) == (
        1_000_000_000, 500_000_000)


def test_values_the_parser_does_not_see_are_checked_too():
    # Built in Python, not parsed: flags.gigabytes never saw the value.
    with pytest.raises(ValueError, match="--device-gb must be > 0, got 0"):
        EngineArgs(offload=True, device_gb=0)
    with pytest.raises(ValueError, match="--prefix-cache-gb must be > 0, got -1"):
        EngineArgs(prefix_cache=True, prefix_cache_gb=-1)

"""`fo-jax bench-serve` and fo_jax.engine.bench: a Poisson workload through the engine, the
figures it reports, bad workload flags refused before any weights are read, and the closed
loop (every seat busy) that ignores arrival times."""

import argparse
import json

import numpy as np
import pytest

from fo_jax import cli
from fo_jax.engine.bench import poisson_workload, run_workload
from fo_jax.engine.engine import RequestOutput
from fo_jax.server.serve import add_engine_arguments, build_engine


def test_poisson_workload_shapes_and_shared_prefix():
    requests = poisson_workload(50, rate=10.0, prompt_len=(3, 7), output_len=(2, 4), vocab=100,
                                seed=1, shared_fraction=0.5, prefix_len=5)
    arrivals = [t for t, _, _ in requests]
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    system = [p[:5] for _, p, _ in requests if len(p) >= 8]  # only prefixed prompts are >= 8
    assert system and all(s == system[0] for s in system)
    assert all(3 <= len(p) <= 12 and 2 <= m <= 4 for _, p, m in requests)
    assert 0.3 < len(system) / 50 < 0.7
    assert requests == poisson_workload(50, rate=10.0, prompt_len=(3, 7), output_len=(2, 4),
                                        vocab=100, seed=1, shared_fraction=0.5, prefix_len=5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=0.0), "rate=0.0 > 0"),
    (dict(prompt_len=(5, 2)), r"prompt_len=\(5, 2\) must be a range 1 <= lo <= hi"),
    (dict(rate=float("nan")), r"rate=nan > 0 \(a finite number\)"),
    (dict(rate=float("inf")), r"rate=inf > 0 \(a finite number\)"),
    (dict(prefix_len=-1, shared_fraction=0.5), "prefix_len=-1 must be >= 0"),
    (dict(shared_fraction=float("nan")), r"shared_fraction=nan must be a fraction in \[0, 1\]"),
])
def test_bad_workloads(kwargs, message):
    args = dict(rate=1.0, prompt_len=(1, 2), output_len=(1, 2), vocab=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        poisson_workload(4, **args)


def test_bench_serve_offloaded_with_prefix_cache(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    rc = cli.main(["bench-serve", "--offload", "--seats", "2", "--capacity", "512",
                   "--hot-slots", "512", "--prefill-chunk", "32", "--requests", "4",
                   "--rate", "50", "--prompt-len", "4", "12", "--output-len", "3", "6",
                   "--shared-prefix", "1", "--prefix-len", "64", "--prefix-cache",
                   "--decode-steps-per-call", "2", "--out", str(out),
                   "--reserve", "prompt", "--queue-order", "shortest", "--device-gb", "1",
                   "--metrics-jsonl", str(tmp_path / "metrics.jsonl"), "--metrics-every", "2"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    fig = json.loads(out.read_text())
    assert fig["requests"] == 4 and fig["output_tokens"] >= 4 * 3
    assert fig["cached_tokens"] > 0  # later prompts map the system prompt's pages
    assert fig["pool_pages"]["held"] == 0  # every page back once all requests ended
    assert 0 <= fig["hit_rate"] <= 1
    assert "time to first token" in printed and "pool pages at the end" in printed
    assert "offload per indexer group: hit rate" in printed and "bytes moved H2D" in printed
    assert len(fig["group_hit_rate"]) == 2 and fig["d2h_bytes"] > 0  # no misses: C = capacity
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] % 2 for r in records[:-1]] == [0] * (len(records) - 1)  # every 2 steps
    assert sum(len(r["requests"]) for r in records) == 4  # the timed run only: no warm-up
    assert records[-1]["totals"]["d2h_bytes"] == fig["d2h_bytes"]
    assert f"metrics: {len(records)} records" in printed


def test_bench_serve_refuses_bad_flags_first(capsys):
    assert cli.main(["bench-serve", "--rate", "0"]) == 2
    assert "rate=0.0 > 0" in capsys.readouterr().err
    assert cli.main(["bench-serve", "--model", "tiny", "--host-pool-gb", "1"]) == 2
    want = ("--host-pool-gb, --device-gb and --reserve prompt need --offload")
    assert want in capsys.readouterr().err
    for flags in (["--prefix-cache-gb", "1"], ["--offload", "--prefix-cache",
                                               "--prefix-cache-gb", "1"]):
        assert cli.main(["bench-serve", "--model", "tiny", *flags]) == 2
        assert ("--prefix-cache-gb sizes the resident prefix store: it needs --prefix-cache "
                "without --offload") in capsys.readouterr().err
    for flags in (["--device-gb", "1"], ["--reserve", "prompt"]):
        assert cli.main(["bench-serve", "--model", "tiny", *flags]) == 2
        assert want in capsys.readouterr().err
    with pytest.raises(SystemExit):  # fo_jax.flags.gigabytes: as argparse parses it
        cli.main(["bench-serve", "--model", "tiny", "--offload", "--device-gb", "0"])
    assert "argument --device-gb: 0.0 must be a size in GB" in capsys.readouterr().err
    assert cli.main(["bench-serve", "--model", "tiny", "--offload", "--pool-memory", "hbm"]) == 2
    assert ("--pool-memory hbm: choose pinned_host (the KV pages in host memory: offloaded) or "
            "device (the paged KV on the device, its pages counted against --device-gb)"
            ) in capsys.readouterr().err
    assert cli.main(["bench-serve", "--model", "tiny", "--pool-memory", "device"]) == 2
    assert ("--pool-memory applies to the offloaded path only: add --offload"
            ) in capsys.readouterr().err
    assert cli.main(["bench-serve", "--model", "tiny", "--num-drafts", "4"]) == 2
    assert ("--num-drafts 4: num_drafts=4 makes steps of W = 5 ways, but config 'tiny' allows "
            "at most max_ways=4: use num_drafts <= 3, or a config with max_ways >= 5"
            ) in capsys.readouterr().err
    assert cli.main(["bench-serve", "--metrics-every", "0"]) == 2
    assert ("--metrics-every 0 must be >= 1 (engine steps between reads of the device "
            "counters)") in capsys.readouterr().err


def test_engine_flags_reach_the_engine():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--offload", "--capacity", "64",
                              "--device-gb", "0.5", "--reserve", "prompt",
                              "--queue-order", "shortest", "--num-drafts", "2",
                              "--max-wait-steps", "-1"])
    engine = build_engine(args)[0]
    sched = engine.scheduler
    assert (sched.device_bytes, sched.reserve, sched.order, engine.num_drafts,
            sched.max_wait_steps) == (500_000_000, "prompt", "shortest", 2, None)
    assert engine.offload.host_memory_kind == "pinned_host"
    args = parser.parse_args(["--model", "tiny", "--offload", "--capacity", "64",
                              "--pool-memory", "device", "--device-gb", "0.5"])
    engine = build_engine(args)[0]  # the paged KV on the device: its pages are device bytes
    assert engine.offload.host_memory_kind == "device" and engine.kv.costs.pool_on_device
    args = parser.parse_args(["--model", "tiny", "--capacity", "64", "--prefill-chunk", "16",
                              "--prefix-cache", "--prefix-cache-gb", "0.0001"])
    engine = build_engine(args)[0]  # resident: a prefix store of 100 kB
    assert engine.prefix.store.num_blocks == 100_000 // engine.prefix.store.block_bytes


def test_mtp_drafter_flag_loads_the_checkpoints_mtp_layer(capsys, tmp_path):
    """--drafter mtp: a Hugging Face checkpoint's MTP layer (the parity fixture, with a
    tokenizer) reaches the engine; refused (before any weight is read) without drafts and for a
    model without an MTP layer; with the prefix cache, both paths build."""
    import pathlib

    from tokenizers import Tokenizer, models, pre_tokenizers

    fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "parity" / "deepseek_v32"
    parity = tmp_path / "deepseek_v32"
    parity.mkdir()
    for name in ("config.json", "model.safetensors"):
        (parity / name).symlink_to(fixture / name)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(parity / "tokenizer.json"))  # 2 ids: within the vocabulary of 256
    parity = str(parity)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    engine = build_engine(parser.parse_args(["--model-dir", parity, "--capacity", "64",
                                             "--num-drafts", "1", "--drafter", "mtp"]))[0]
    assert engine.drafter == "mtp" and engine.num_drafts == 1 and "eh_proj" in engine.mtp
    for flags, message in (
            (["--model-dir", parity, "--num-drafts", "0"],
             "--drafter mtp needs --num-drafts >= 1"),
            (["--model", "tiny", "--num-drafts", "1"],
             "--drafter mtp needs a model with an MTP layer (num_nextn_predict_layers >= 1); "
             "'tiny' has none: use --drafter ngram")):
        assert cli.main(["bench-serve", *flags, "--drafter", "mtp"]) == 2
        assert message in capsys.readouterr().err
    # With the prefix cache (offloaded or resident): the MTP rows of cached chunks are kept
    # beside it (tests/engine/test_engine_mtp.py runs such engines).
    for flags in (["--offload", "--hot-slots", "64"], []):
        engine = build_engine(parser.parse_args([
            "--model-dir", parity, "--capacity", "64", "--prefill-chunk", "16", "--num-drafts",
            "1", "--drafter", "mtp", "--prefix-cache", *flags]))[0]
        assert engine.drafter == "mtp" and engine.prefix.mtp is not None


class _Engine:
    """Stands in for an engine in `run_workload`: `seats` seats, a request takes max_tokens
    steps once seated; records the unfinished requests before every step."""

    def __init__(self, seats: int):
        self.seats, self.n_steps = seats, 1
        self.timings = dict.fromkeys(("prefill_s", "decode_s", "step_s"), 1.0)
        self.counters = dict.fromkeys(("prefill_calls", "decode_calls", "prefill_tokens",
                                       "prefix_hit_tokens", "steps", "decode_tokens"), 1)
        self.stats, self.waiting, self.running, self.done, self.before = None, [], {}, {}, []

    def add_request(self, prompt, *, max_tokens):
        rid = str(len(self.waiting) + len(self.running) + len(self.done))
        self.waiting.append((rid, max_tokens))
        return rid

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def num_waiting(self):
        return len(self.waiting)

    def num_running(self):
        return len(self.running)

    def step(self):  # before: (unfinished in the engine, requests not yet finished)
        self.before.append((self.num_running() + self.num_waiting(), 5 - len(self.done)))
        while self.waiting and len(self.running) < self.seats:
            rid, left = self.waiting.pop(0)
            self.running[rid] = [left, []]
        outs = []
        for rid, request in list(self.running.items()):
            request[0] -= 1
            request[1].append(7)
            if request[0] == 0:
                self.done[rid] = self.running.pop(rid)[1]
            outs.append(self._output(rid, request[1], request[0] == 0))
        return outs

    def _output(self, rid, tokens, finished):
        return RequestOutput(rid, tokens[-1:], list(tokens), None, finished, None, 1, 0.1, 0.01)

    def run(self):
        while self.has_unfinished():
            self.step()
        return {rid: self._output(rid, tokens, True) for rid, tokens in self.done.items()}

    def release(self, rid):
        return None

    def pool_occupancy(self):
        return None


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_a_closed_loop_keeps_its_concurrency(concurrency):
    requests = [(1.0 * i, [1, 2], m) for i, m in enumerate([3, 1, 2, 4, 2])]  # 1 s apart
    engine = _Engine(seats=2)
    figures = run_workload(engine, requests, warm=False, concurrency=concurrency)
    # Before every step the engine holds `concurrency` unfinished requests, fewer only when
    # fewer are left; arrival times are ignored (the run never sleeps until the next one).
    assert engine.before and all(n == min(concurrency, left) for n, left in engine.before)
    assert figures["output_tokens"] == 12 and figures["wall_s"] < 0.9
    assert figures["peak_running"] == min(concurrency, 2)


def test_a_closed_loop_needs_a_request_in_flight():
    with pytest.raises(ValueError, match=r"concurrency=0 must be >= 1"):
        run_workload(_Engine(seats=1), [(0.0, [1], 1)], warm=False, concurrency=0)

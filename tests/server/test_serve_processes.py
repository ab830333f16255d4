"""`fo-jax serve --devices 4 --expert-parallel 4 --offload` across 2 processes x 2 simulated
CPU devices (jax.distributed): one HTTP endpoint on process 0, process 1 following it tick by tick
(fo_jax.server.lockstep). A MoE model (tiny_moe cut to 2 layers, random weights, in a model
directory) with 1/4 of its experts on each device; concurrent greedy requests land on the ranks
of both processes and each one's tokens (and one's log-probabilities) equal its solo run on a
single-device Engine with the whole weights (resident: offloaded equals it bit for bit). Served
offloaded (a host pool per rank, least_misses placement from process 0 with each request's
estimate sent by its owner); SIGTERM to process 0 ends both with exit 0, every seat empty
(lengths 0) and every page back in its rank's pool. Both processes are killed (their process
groups) whatever happens. FO_JAX_SERVE_LOCAL_DEVICES=4 (by hand) runs a node's shape:
`--devices 8 --expert-parallel 8` over 2 processes x 4 devices, one expert of 8 per device, 10
requests."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from fo_jax import distributed
from fo_jax.server.app import LOGPROB_FLOOR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROCESSES, SEATS, CAPACITY, CHUNK = 2, 2, 32, 8
LOCAL_DEVICES = int(os.environ.get("FO_JAX_SERVE_LOCAL_DEVICES", "2"))
RANKS = PROCESSES * LOCAL_DEVICES
START_TIMEOUT_S, STOP_TIMEOUT_S = 240, 60
# (prompt length, max_tokens): 6 requests over 4 ranks of 2 seats, prompts of 1 to 3 chunks.
REQUESTS = [(20, 6), (3, 5), (9, 4), (5, 3), (12, 5), (7, 4), (4, 6), (11, 3), (2, 5),
            (16, 4)][:6 if RANKS <= 4 else 10]
LOGPROBS = 2  # the first request asks for its tokens' log-probabilities (and 2 top tokens)


def _config():
    from fo_jax.config import get_config

    # tiny_moe cut to 2 layers (layer 1 MoE: 8 experts, 2 per token), as the engine's cases.
    return get_config("tiny_moe").replace(num_layers=2, indexer_layers=(0,), max_ways=1)


def _prompt(i, length):
    return np.random.default_rng(i).integers(0, 256, length).tolist()


def _reports(text: str, prefix: str) -> list[dict]:
    return [json.loads(line.split(prefix, 1)[1]) for line in text.splitlines()
            if prefix in line]


def _kill(procs):
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _engine_args(*flags):
    import argparse

    from fo_jax.engine.args import EngineArgs
    from fo_jax.server.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return EngineArgs.from_cli_args(parser.parse_args(list(flags)))


@pytest.mark.parametrize("flags, message", [
    ((), "across 2 processes `serve` runs one sharded engine over every process's devices "
         "(2 processes x 4 devices), but --devices is missing: pass --devices 8 "
         "--expert-parallel 8"),
    (("--devices", "4", "--expert-parallel", "4"),
     "--devices 4 across 2 processes must be the global device count 8 (2 processes x 4 "
     "devices: each process serves its own devices): pass --devices 8 --expert-parallel 8"),
    (("--devices", "8"), "--devices 8 across 2 processes needs --expert-parallel 8: one sharded "
                         "engine spans the processes (the data-parallel engines of --devices "
                         "alone run in one process)"),
], ids=["no_devices", "local_count", "no_expert_parallel"])
def test_flags_across_processes_are_checked(flags, message):
    """What serve needs across processes, said before any weight is read."""
    from fo_jax.server.serve import check_processes

    with pytest.raises(ValueError) as err:
        check_processes(_engine_args(*flags), processes=2, device_count=8,
                        local_device_count=4)
    assert str(err.value) == message
    for path in ((), ("--offload",)):  # resident or offloaded
        check_processes(_engine_args("--devices", "8", "--expert-parallel", "8", *path),
                        processes=2, device_count=8, local_device_count=4)


def _model_dir(tmp_path):
    import jax

    from fo_jax.embedded import save_model_dir
    from fo_jax.model.dsa import init_params
    from fo_jax.tokenizer import ByteTokenizer

    config = _config()
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    return save_model_dir(tmp_path / "model", config, params, ByteTokenizer(),
                          dtype=config.dtype)


class _Servers:
    """`fo-jax serve` as 2 processes (jax.distributed, 2 simulated CPU devices each), each in
    its own process group, output to a file each; `kill` ends both groups."""

    def __init__(self, tmp_path, model_dir, *flags):
        self.port = distributed.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "fo_jax.cli", "serve", "--model-dir", str(model_dir),
               "--port", str(self.port), "--devices", str(RANKS), "--expert-parallel",
               str(RANKS), "--seats", str(SEATS), "--capacity", str(CAPACITY),
               "--prefill-chunk", str(CHUNK), "--decode-steps-per-call", "2",
               "--shutdown-timeout", "0", "--log-level", "warning", *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **{distributed.ENV_COORDINATOR: f"127.0.0.1:{distributed.free_port()}",
                      distributed.ENV_NUM_PROCESSES: str(PROCESSES),
                      distributed.ENV_LOCAL_DEVICES: str(LOCAL_DEVICES)})
        self.logs = [tmp_path / f"{i}.log" for i in range(PROCESSES)]
        self.procs = []
        for i, log in enumerate(self.logs):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                    start_new_session=True,
                    env=dict(env, **{distributed.ENV_PROCESS_ID: str(i)})))

    def output(self) -> list[str]:
        return [log.read_text(errors="replace") for log in self.logs]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert all(p.poll() is None for p in self.procs), "\n".join(self.output())[-6000:]
            assert time.monotonic() < deadline, "\n".join(self.output())[-6000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def kill(self) -> None:
        _kill(self.procs)


def test_serve_across_two_processes(tmp_path):
    from fo_jax.embedded import load_model_dir
    from fo_jax.engine import Engine

    config = _config()
    model_dir = _model_dir(tmp_path)
    servers = _Servers(tmp_path, model_dir, "--offload", "--page-size", "4")
    try:
        # Meanwhile, each request alone on one single-device Engine with the whole weights.
        _, whole, _ = load_model_dir(model_dir)
        solo = Engine(whole, config, seats=SEATS, capacity=CAPACITY, prefill_chunk=CHUNK,
                      decode_steps_per_call=2, overlap=False)
        expected = []
        for i, (length, max_tokens) in enumerate(REQUESTS):
            rid = solo.add_request(_prompt(i, length), max_tokens=max_tokens,
                                   logprobs=LOGPROBS if i == 0 else None)
            out = solo.run()[rid]
            expected.append(out.token_ids)
            if i == 0:  # OpenAI's: each token's log-probability, floored
                expected_logprobs = [max(e.logprob, LOGPROB_FLOOR) for e in out.logprobs]
            solo.release(rid)

        servers.wait_ready()
        started = [_reports(text, "fo-jax serve: process: ") for text in servers.output()]
        assert [[(r["process"], r["ranks"], r["experts_per_device"]) for r in mine]
                for mine in started] == [
            [(p, list(range(p * LOCAL_DEVICES, (p + 1) * LOCAL_DEVICES)),
              [config.n_routed_experts // RANKS])] for p in range(PROCESSES)], started

        client = openai.OpenAI(base_url=servers.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)

        def ask(i):
            length, max_tokens = REQUESTS[i]
            resp = client.completions.create(
                model=config.name, prompt=_prompt(i, length), max_tokens=max_tokens,
                temperature=0, logprobs=LOGPROBS if i == 0 else None,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            choice = resp.choices[0]
            if i == 0:
                assert choice.logprobs.token_logprobs == expected_logprobs
                # the top tokens and the sampled one, keyed by their text (bytes that are not
                # UTF-8 alone share one key)
                assert all(1 <= len(top) <= LOGPROBS + 1
                           for top in choice.logprobs.top_logprobs)
            return choice.model_extra["token_ids"], choice.finish_reason

        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            got = list(pool.map(ask, range(len(REQUESTS))))
        assert [tokens for tokens, _ in got] == expected
        assert [reason for _, reason in got] == ["length"] * len(REQUESTS)
        deadline = time.monotonic() + 10  # process 0's books, published once idle
        while True:
            metrics = httpx.get(servers.url + "/metrics", timeout=10).text
            if "fojax_requests_running 0.0" in metrics or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "fojax_requests_running 0.0" in metrics, metrics
        assert "fojax_requests_waiting 0.0" in metrics, metrics

        servers.procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=STOP_TIMEOUT_S) for p in servers.procs]
        texts = servers.output()
        assert codes == [0, 0], "\n".join(texts)[-6000:]
    finally:
        servers.kill()
    stopped = [_reports(text, "fo-jax serve: stopped: process: ") for text in texts]
    assert [[r["process"] for r in mine] for mine in stopped] == [[0], [1]], texts
    for (report,) in stopped:  # every seat and queue empty, every length zero
        assert (report["running"], report["waiting"], report["lengths"],
                report["pages_held"]) == (0, 0, 0, 0), report
        assert sum(report["placed"]) > 0, stopped  # requests on both processes' ranks
    assert sum(sum(r["placed"]) for (r,) in stopped) == len(REQUESTS), stopped
    n = len(REQUESTS)
    assert f"requests received {n}, completed {n}, cancelled 0" in texts[0], texts[0]


def test_a_lost_process_ends_the_server(tmp_path):
    """Process 1 killed once both serve (no warm-up; one request of one token, so that both
    processes have exchanged ticks): process 0's next exchange fails, its server shuts down
    and it exits 1 at once, saying why."""
    servers = _Servers(tmp_path, _model_dir(tmp_path), "--no-warmup")
    try:
        servers.wait_ready()
        client = openai.OpenAI(base_url=servers.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        assert len(client.completions.create(model="tiny_moe", prompt=[1, 2, 3], max_tokens=1,
                                             temperature=0).choices) == 1
        os.killpg(servers.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        code = servers.procs[0].wait(timeout=STOP_TIMEOUT_S)
        assert time.monotonic() - start < 20  # not the runtime's heartbeat timeout
        text = servers.output()[0]
    finally:
        servers.kill()
    assert code == 1, text[-6000:]
    assert ("fo-jax serve: engine failure: RuntimeError: process 0 lost the other processes "
            "(one failed or was stopped)") in text, text[-6000:]
    assert "the engine stopped, exit status 1" in text, text[-6000:]

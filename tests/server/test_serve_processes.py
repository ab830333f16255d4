"""`fo-jax serve --devices 4 --expert-parallel 4` across 2 processes x 2 simulated CPU devices
(jax.distributed): one HTTP endpoint on process 0, process 1 following it tick by tick
(fo_jax.server.lockstep). A MoE model (tiny_moe cut to 2 layers, random weights, in a model
directory) with 1/4 of its experts on each device; concurrent greedy requests land on the ranks
of both processes and each one's tokens equal its solo run on a single-device Engine with the
whole weights; SIGTERM to process 0 ends both with exit 0, every seat empty (lengths 0). Both
processes are killed (their process groups) whatever happens."""

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROCESSES, LOCAL_DEVICES, SEATS, CAPACITY, CHUNK = 2, 2, 2, 32, 8
RANKS = PROCESSES * LOCAL_DEVICES
START_TIMEOUT_S, STOP_TIMEOUT_S = 240, 60
# (prompt length, max_tokens): 6 requests over 4 ranks of 2 seats, prompts of 1 to 3 chunks.
REQUESTS = [(20, 6), (3, 5), (9, 4), (5, 3), (12, 5), (7, 4)]


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
    (("--devices", "8", "--expert-parallel", "8", "--offload"),
     "across 2 processes the sharded engine runs the resident path only: drop --offload"),
], ids=["no_devices", "local_count", "no_expert_parallel", "offload"])
def test_flags_across_processes_are_checked(flags, message):
    """What serve needs across processes, said before any weight is read."""
    from fo_jax.server.serve import check_processes

    with pytest.raises(ValueError) as err:
        check_processes(_engine_args(*flags), processes=2, device_count=8,
                        local_device_count=4)
    assert str(err.value) == message
    check_processes(_engine_args("--devices", "8", "--expert-parallel", "8"), processes=2,
                    device_count=8, local_device_count=4)


def test_serve_across_two_processes(tmp_path):
    import jax

    from fo_jax.embedded import load_model_dir, save_model_dir
    from fo_jax.engine import Engine
    from fo_jax.model.dsa import init_params
    from fo_jax.tokenizer import ByteTokenizer

    config = _config()
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    model_dir = save_model_dir(tmp_path / "model", config, params, ByteTokenizer(),
                               dtype=config.dtype)
    port = distributed.free_port()
    coordinator = f"127.0.0.1:{distributed.free_port()}"
    cmd = [sys.executable, "-m", "fo_jax.cli", "serve", "--model-dir", str(model_dir),
           "--port", str(port), "--devices", str(RANKS), "--expert-parallel", str(RANKS),
           "--seats", str(SEATS), "--capacity", str(CAPACITY), "--prefill-chunk", str(CHUNK),
           "--decode-steps-per-call", "2", "--shutdown-timeout", "0", "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               **{distributed.ENV_COORDINATOR: coordinator,
                  distributed.ENV_NUM_PROCESSES: str(PROCESSES),
                  distributed.ENV_LOCAL_DEVICES: str(LOCAL_DEVICES)})
    logs = [tmp_path / f"{i}.log" for i in range(PROCESSES)]
    procs = []

    def output() -> list[str]:
        return [log.read_text() for log in logs]

    try:
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                    env=dict(env, **{distributed.ENV_PROCESS_ID: str(i)})))
        # Meanwhile, each request alone on one single-device Engine with the whole weights.
        _, whole, _ = load_model_dir(model_dir)
        solo = Engine(whole, config, seats=SEATS, capacity=CAPACITY, prefill_chunk=CHUNK,
                      decode_steps_per_call=2, overlap=False)
        expected = []
        for i, (length, max_tokens) in enumerate(REQUESTS):
            rid = solo.add_request(_prompt(i, length), max_tokens=max_tokens)
            expected.append(solo.run()[rid].token_ids)
            solo.release(rid)

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert all(p.poll() is None for p in procs), "\n".join(output())[-6000:]
            assert time.monotonic() < deadline, "\n".join(output())[-6000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        started = [_reports(text, "fo-jax serve: process: ") for text in output()]
        assert [[(r["process"], r["ranks"], r["experts_per_device"]) for r in mine]
                for mine in started] == [[(0, [0, 1], [2])], [(1, [2, 3], [2])]], started

        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(i):
            length, max_tokens = REQUESTS[i]
            resp = client.completions.create(
                model=config.name, prompt=_prompt(i, length), max_tokens=max_tokens,
                temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
            return resp.choices[0].model_extra["token_ids"], resp.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            got = list(pool.map(ask, range(len(REQUESTS))))
        assert [tokens for tokens, _ in got] == expected
        assert [reason for _, reason in got] == ["length"] * len(REQUESTS)

        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=STOP_TIMEOUT_S) for p in procs]
        texts = output()
        assert codes == [0, 0], "\n".join(texts)[-6000:]
    finally:
        _kill(procs)
    stopped = [_reports(text, "fo-jax serve: stopped: process: ") for text in texts]
    assert [[r["process"] for r in mine] for mine in stopped] == [[0], [1]], texts
    for (report,) in stopped:  # every seat and queue empty, every length zero
        assert (report["running"], report["waiting"], report["lengths"]) == (0, 0, 0), report
        assert sum(report["placed"]) > 0, stopped  # requests on both processes' ranks
    assert sum(sum(r["placed"]) for (r,) in stopped) == len(REQUESTS), stopped
    assert "requests received 6, completed 6, cancelled 0" in texts[0], texts[0]

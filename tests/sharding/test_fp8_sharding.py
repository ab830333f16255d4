"""FP8 over a mesh of 8 simulated CPU devices (fo_jax.sharding, fo_jax.sharded_steps).

A subprocess runs the FP8 cases of data_parallel_cases.py (`FP8_SUITES`, all three; XLA_FLAGS
gives them 8 devices, the rest of the suite keeps one). `--fp8-weights`: FP8 weights (e4m3
values, 128 x 128 block scales) placed over `model` (attention heads) and `expert` (MoE
experts) as the bf16 weights they stand for, each device holding 1/2 of every split weight's
values and scales (from the arrays), a split that would cut a scale block refused before
anything is placed, decode steps and a prefill chunk bit for bit each data rank's one-device
run. `--fp8-kv-steps`: the fp8_ds_mla KV format through the sharded offloaded decode (uint8
host rows, no collective), resident decode and the handoff (NaN fill: 0xFF bytes), bit for
bit. `--fp8-generate`: `fo-jax generate --offload --devices 2 --kv-format fp8_ds_mla`, every
request's tokens those of the one-device FP8 run.
"""

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests", "sharding", "data_parallel_cases.py")


def test_fp8_cases_on_eight_devices():  # one subprocess: jax starts once
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, CASES, "--fp8-weights", "--fp8-kv-steps",
                           "--fp8-generate"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "ALL OK" in proc.stdout, output[-6000:]

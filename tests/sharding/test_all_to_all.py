"""Data-parallel attention with expert-parallel MoE on the same simulated CPU devices (the
all-to-all layout of fo_jax.sharding, fo_jax.model.moe.moe_all_to_all).

Each test runs some cases of all_to_all_cases.py in a subprocess (XLA_FLAGS gives it 8
devices; this process, and the rest of the suite, keep one): the offloaded decode step (4 ranks,
inactive seats), the resident decode step and the offloaded one equal under the same
mesh, an offloaded prefill chunk and the decode loop, each rank bit for bit its one-device run
with the whole weights; exactly three all-to-alls per loop of MoE layers and no other
collective in the compiled step (fo_jax.hlo_checks); 1/D of the experts' bytes per device;
FP8 experts (values and block scales split alike); `fo-jax generate --devices 4
--expert-parallel 4`; the refusals' messages.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests", "sharding", "all_to_all_cases.py")


# Two subprocesses (each pays jax's start once): the decode steps, then the rest.
@pytest.mark.parametrize("cases", [
    pytest.param(["errors", "decode", "decode_fp8"], id="decode"),
    pytest.param(["resident", "prefill", "loop", "cli"], id="resident_prefill_loop_cli"),
])
def test_all_to_all_cases_on_eight_devices(cases):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, CASES, *cases], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "ALL OK" in proc.stdout, output[-6000:]

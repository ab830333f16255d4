"""Data-parallel steps over a mesh of 8 simulated CPU devices (fo_jax.sharding,
fo_jax.sharded_steps).

One subprocess runs every case of data_parallel_cases.py (XLA_FLAGS gives it 8 devices; this
process, and the rest of the suite, keep one): the sharded offloaded decode (policies ring,
clock, lru and random, W 1 to 4, 2 to 8 ranks, shuffled page tables, the FFI host copies), resident decode and
offloaded prefill bit for bit against each rank's single-device run, the compiled program's
shardings and memory kinds, no collective in its HLO, MoE experts split over `expert` (decode
and prefill bit for bit, the experts' all-reduce the only collective), a zero-sized operand of a
data-parallel body (jax 0.11.2 segfaulted compiling one), and the refusals' messages.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests", "sharding", "data_parallel_cases.py")


def test_data_parallel_cases_on_eight_devices():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, CASES], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "ALL OK" in proc.stdout, output[-6000:]

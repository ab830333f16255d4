"""ShardedEngine (fo_jax.engine.sharded): one engine stepping 4 data-parallel ranks in one
program per step, on 4 simulated devices in a subprocess (sharded_engine_cases.py: a request
stream whose tokens are bit for bit each request's solo run on one single-device Engine, in the
all-to-all layout with 1/4 of the experts per device and on the plain data mesh; admission per
rank; seats free at the end; a cancel; the server's driver over it; `serve --devices 4
--expert-parallel 4` builds it; the refusals' messages); offloaded, with a host pool per rank,
in another (the same stream, and one where a rank's pool runs short and its youngest request
is preempted and resumes: tokens bit for bit, every page back in its rank's pool; and
least_misses placement, its estimates and the rows copied per rank)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests", "engine", "sharded_engine_cases.py")


def _run_cases(suite):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # subprocess.run kills the child when the time is up.
    proc = subprocess.run([sys.executable, CASES, suite], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "ALL OK" in proc.stdout, output[-6000:]


def test_sharded_engine_on_four_devices():
    _run_cases("resident")  # ~40 s of CPU on a quiet machine


def test_offloaded_sharded_engine_on_four_devices():
    _run_cases("offloaded")  # ~65 s of CPU on a quiet machine

"""ShardedEngine (fo_jax.engine.sharded): one engine stepping 4 data-parallel ranks in one
program per step, on 4 simulated devices in a subprocess (sharded_engine_cases.py: a request
stream whose tokens are bit for bit each request's solo run on one single-device Engine, in the
all-to-all layout with 1/4 of the experts per device and on the plain data mesh, and the
log-probabilities of those that ask for them; admission per rank; seats free at the end; a
cancel; the server's driver and app over it; `serve --devices 4 --expert-parallel 4` builds it;
the refusals' messages); offloaded, with a host pool per rank, in another (the same stream,
each rank's pool sized in bytes, a device budget per rank and a metrics log with every rank's
figures, the planner's bytes checked against each rank's shards; a budget that binds per rank;
and least_misses placement, its estimates and the rows copied per rank: every page back in
its rank's pool); and across two processes on jax.distributed, resident and offloaded
(multiprocess_sharded_cases.py: a rank's pool runs short and its youngest request is
preempted and resumes, tokens bit for bit; log-probabilities too; a metrics log refused)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests", "engine", "sharded_engine_cases.py")
PROCESS_CASES = os.path.join(ROOT, "tests", "engine", "multiprocess_sharded_cases.py")
# Both processes import jax, compile the engine's programs and a solo Engine's, resident and
# offloaded (~60 s of CPU each, in parallel on an idle 2-core machine; 120 to 170 s of wall on
# a loaded one); generous for a loaded one.
PROCESS_TIMEOUT_S = 400


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
    _run_cases("resident")  # ~47 s of CPU on a quiet machine


def test_offloaded_sharded_engine_on_four_devices():
    _run_cases("offloaded")  # ~65 s of CPU on a quiet machine


def test_sharded_engine_across_two_processes():
    """One ShardedEngine over 2 processes x 2 simulated CPU devices (4 ranks: fewer devices
    than 2 x 4, so that both processes compile and run on a 2-core machine in under a minute;
    the all-to-alls cross the processes all the same), resident and then offloaded (a host
    pool per rank, reserve="prompt": a preemption and resume on process 0 only): each process
    adds requests for its own ranks and the processes step in lockstep until both are done;
    every request's tokens equal its solo single-device Engine run (greedy), seats free,
    lengths zero and every page back in its pool on every process (checked in each,
    multiprocess_sharded_cases.py). `launch` kills both processes on a failure or when the
    time is up."""
    from fo_jax import distributed

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = distributed.launch([PROCESS_CASES], processes=2, devices_per_process=2,
                                 timeout_s=PROCESS_TIMEOUT_S, env=env, cwd=ROOT)
    report = distributed.report(results)
    assert [(r.returncode, r.killed) for r in results] == [(0, False)] * 2, report[-6000:]
    lines = [[json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
             for r in results]
    assert all("ALL OK" in r.stdout for r in results), report[-6000:]
    assert [[(x["mode"], x["process"], x["ranks"]) for x in mine] for mine in lines] == [
        [("resident", 0, [0, 1]), ("offloaded", 0, [0, 1])],
        [("resident", 1, [2, 3]), ("offloaded", 1, [2, 3])]], report[-6000:]
    # Lockstep: the same steps and prefill programs on both, though their streams differ.
    for first, second in zip(*lines):
        assert first["steps"] == second["steps"], (first, second)
        assert first["prefill_calls"] == second["prefill_calls"], (first, second)
        assert first["decode_calls"] > second["decode_calls"] > 0, (first, second)
    # Offloaded: a preemption, its resume's tokens replayed, on process 0 alone.
    (_, paged0), (_, paged1) = lines
    assert paged0["preemptions"] >= 1 and paged0["replayed_tokens"] >= 1, paged0
    assert paged1["preemptions"] == 0 and paged1["replayed_tokens"] == 0, paged1

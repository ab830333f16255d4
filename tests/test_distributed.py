"""fo_jax.distributed: argument errors, the launcher's kill and time limit (children that never
import jax), rows in and out of a one-process mesh, and messages of any length between two
processes (`allgather_bytes`)."""

import json
import os
import time

import jax
import numpy as np
import pytest

from fo_jax import distributed

# A child that reports its settings, then fails (process {fail}) or waits to be killed. Each child
# leaves a mark in {marks} once it has printed; the failing one waits (30 s at most) for every
# process's mark, so a loaded machine cannot kill a peer before it has printed.
CHILD = ("import os, sys, time; e = os.environ; "
         "print(e['FO_JAX_PROCESS_ID'], e['FO_JAX_NUM_PROCESSES'], e['FO_JAX_COORDINATOR'], "
         "e.get('FO_JAX_LOCAL_DEVICE_COUNT'), e.get('JAX_PLATFORMS'), flush=True); "
         "d = r'{marks}'; open(os.path.join(d, e['FO_JAX_PROCESS_ID']), 'w').close(); "
         "t = time.monotonic() + 30\n"
         "while e['FO_JAX_PROCESS_ID'] == '{fail}' and time.monotonic() < t and "
         "len(os.listdir(d)) < int(e['FO_JAX_NUM_PROCESSES']): time.sleep(0.05)\n"
         "sys.exit(3) if e['FO_JAX_PROCESS_ID'] == '{fail}' else time.sleep(60)")


def child(fail, marks):
    return CHILD.replace("{fail}", fail).replace("{marks}", str(marks))


def test_first_failure_kills_the_others(tmp_path):
    start = time.monotonic()
    results = distributed.launch(["-c", child("1", tmp_path)], processes=3,
                                 devices_per_process=2, timeout_s=50)
    assert time.monotonic() - start < 40  # not the children's 60 s
    assert [(r.process_id, r.killed) for r in results] == [(0, True), (1, False), (2, True)]
    assert results[1].returncode == 3
    assert results[0].returncode < 0 and results[2].returncode < 0  # by a signal
    fields = [r.stdout.split() for r in results]
    assert [f[:2] for f in fields] == [["0", "3"], ["1", "3"], ["2", "3"]]
    assert len({f[2] for f in fields}) == 1 and fields[0][2].startswith("127.0.0.1:")
    assert [f[3:] for f in fields] == [["2", "cpu"]] * 3
    report = distributed.report(results)
    assert "[1] 1 3 127.0.0.1:" in report
    assert report.splitlines()[-1] == (
        "process 0: killed (exit -15); process 1: exit 3; process 2: killed (exit -15)")


def test_time_limit_kills_every_process(tmp_path):
    start = time.monotonic()
    results = distributed.launch(["-c", child("none", tmp_path)], processes=2,
                                 timeout_s=1)
    assert time.monotonic() - start < 30
    assert [r.killed for r in results] == [True, True]
    assert all(r.returncode < 0 for r in results)


def test_command_line_reports_each_process(capsys):
    code = distributed.main(["launch", "--processes", "2", "--timeout", "50", "--",
                             "-c", "import os; print('hi', os.environ['FO_JAX_PROCESS_ID'])"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out == ["[0] hi 0", "[1] hi 1", "process 0: exit 0; process 1: exit 0"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(args=[], processes=2), "launch needs the program to run"),
    (dict(args=["x.py"], processes=0), "processes=0 must be >= 1"),
    (dict(args=["x.py"], processes=2, devices_per_process=0), "devices_per_process=0 must be"),
    (dict(args=["x.py"], processes=2, timeout_s=0), "timeout_s=0 must be > 0"),
], ids=["no_program", "no_process", "no_device", "no_time"])
def test_launch_rejects_bad_arguments(kwargs, message):
    args = kwargs.pop("args")
    with pytest.raises(ValueError, match=message):
        distributed.launch(args, **kwargs)


@pytest.mark.parametrize("args, message", [
    (("localhost", 2, 0), "coordinator='localhost' must read 'host:port' (the address of "
                          "process 0"),
    (("127.0.0.1:0", 2, 0), "coordinator='127.0.0.1:0' must read 'host:port'"),
    (("127.0.0.1:1234", 0, 0), "num_processes=0 must be >= 1"),
    (("127.0.0.1:1234", 2, 2), "process_id=2 must be in [0, 2)"),
    (("127.0.0.1:1234", 2, -1), "process_id=-1 must be in [0, 2)"),
    (("127.0.0.1:1234", 2, True), "process_id=True must be an int"),
], ids=["no_port", "port_0", "no_process", "id_too_big", "id_negative", "id_bool"])
def test_initialize_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError) as e:
        distributed.initialize(*args, cpu_collectives=False)
    assert message in str(e.value)


def test_initialize_after_the_backend_started_says_so():
    jax.devices()  # this process's backend is up (as in every test)
    with pytest.raises(RuntimeError, match="the number of CPU devices must be set before JAX "
                                           "starts its backend"):
        distributed.initialize("127.0.0.1:1234", 1, 0, local_device_count=2,
                               cpu_collectives=False)
    with pytest.raises(RuntimeError, match="jax.distributed.initialize must be set before JAX "
                                           "starts its backend"):
        distributed.initialize("127.0.0.1:1234", 1, 0, cpu_collectives=False, timeout_s=5)
    assert jax.process_count() == 1


def test_initialize_from_env():
    assert distributed.initialize_from_env({}) is None  # no launcher: nothing to join
    with pytest.raises(ValueError, match="FO_JAX_COORDINATOR is set, so FO_JAX_PROCESS_ID "
                                         "must hold an int >= 0, got 'one'"):
        distributed.initialize_from_env({"FO_JAX_COORDINATOR": "127.0.0.1:1234",
                                         "FO_JAX_NUM_PROCESSES": "2",
                                         "FO_JAX_PROCESS_ID": "one"})
    with pytest.raises(ValueError, match="FO_JAX_LOCAL_DEVICE_COUNT must hold an int >= 1, "
                                         "got 'x'"):
        distributed.initialize_from_env({"FO_JAX_COORDINATOR": "127.0.0.1:1234",
                                         "FO_JAX_NUM_PROCESSES": "2", "FO_JAX_PROCESS_ID": "0",
                                         "FO_JAX_LOCAL_DEVICE_COUNT": "x"})


def test_rows_in_and_out_of_a_one_process_mesh():
    mesh = distributed.data_mesh()
    local = np.arange(24, dtype=np.float32).reshape(3, 4, 2)
    for dim in (0, 1):
        array = distributed.global_batch(local, mesh, dim=dim)
        assert array.shape == local.shape
        assert array.sharding.spec[dim] == "data"
        np.testing.assert_array_equal(distributed.local_rows(array, dim=dim), local)
    replicated = distributed.replicate({"w": local}, mesh)["w"]
    assert replicated.sharding.is_fully_replicated
    np.testing.assert_array_equal(distributed.local_rows(replicated), local)
    with pytest.raises(ValueError, match=r"dim=3 is not a dimension of the local array of "
                                         r"shape \(3, 4, 2\)"):
        distributed.global_batch(local, mesh, dim=3)
    with pytest.raises(ValueError, match=r"mesh axis 'model' is not one of the mesh's axes "
                                         r"\('data',\)"):
        distributed.global_batch(local, mesh, "model")
    with pytest.raises(ValueError, match="local_rows takes a jax.Array, got ndarray"):
        distributed.local_rows(local)


# Process 0 starts a sleeping child of its own, prints both pids, waits until process 1 is
# ready and fails; process 1 ignores SIGTERM, starts a sleeping child too, prints the pids,
# says it is ready (a file) and would sleep a minute.
STUBBORN = ("import os, signal, subprocess, sys, time; e = os.environ; "
            "ready = os.path.join(e['READY_DIR'], 'ready'); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN) "
            "if e['FO_JAX_PROCESS_ID'] == '1' else None; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(os.getpid(), child.pid, flush=True); "
            "open(ready, 'w').close() if e['FO_JAX_PROCESS_ID'] == '1' else None; "
            "[time.sleep(0.05) for _ in range(400) if not os.path.exists(ready)]; "
            "sys.exit(1) if e['FO_JAX_PROCESS_ID'] == '0' else time.sleep(60)")


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_failure_ends_every_process_and_what_they_started_at_once(tmp_path):
    """`python -m fo_jax.distributed launch`: one process fails at once, its peer ignores
    SIGTERM; the launcher exits non-zero within seconds (SIGTERM, 2 s of grace, SIGKILL), and
    neither process nor anything they started is left running: the failed one's child
    included (it was left running before: a process that had exited was not killed again,
    nor its group)."""
    start = time.monotonic()
    env = dict(os.environ, READY_DIR=str(tmp_path))
    results = distributed.launch(["-c", STUBBORN], processes=2, timeout_s=50, env=env)
    elapsed = time.monotonic() - start
    assert elapsed < 10, elapsed  # not the children's 60 s
    assert [(r.returncode, r.killed) for r in results] == [(1, False), (-9, True)], \
        distributed.report(results)
    pids = [int(p) for r in results for p in r.stdout.split()]
    assert len(pids) == 4
    time.sleep(0.2)  # the orphaned children are reaped by init
    assert [p for p in pids if _alive(p)] == []


def test_process_max_of_one_process_is_the_values():
    """One process: the values themselves, no collective (across processes it is exercised by
    tests/engine/test_sharded_engine.py's two-process engine, whose steps agree through it)."""
    got = distributed.process_max([3, 0, True])
    np.testing.assert_array_equal(got, [3, 0, 1])
    assert got.dtype == np.int32


def test_local_values_and_row_of_a_one_process_mesh():
    """Every block is this process's: local_values is the array, local_row its row."""
    mesh = distributed.data_mesh()
    x = distributed.global_batch(np.arange(2 * len(mesh.devices.flat)).reshape(-1, 1), mesh)
    np.testing.assert_array_equal(distributed.local_values(x, -1), np.asarray(x))
    np.testing.assert_array_equal(distributed.local_row(x, 1), np.asarray(x)[1])


def test_padded_sizes_are_few():
    """The gather compiles one program per padded size: powers of two from 256 bytes."""
    assert [distributed.padded_size(n) for n in (0, 1, 256, 257, 1000, 4096, 4097)] == [
        256, 256, 256, 512, 1024, 4096, 8192]
    with pytest.raises(ValueError, match="nbytes=-1 must be >= 0"):
        distributed.padded_size(-1)


def test_allgather_bytes_of_one_process_is_the_message():
    assert distributed.allgather_bytes(b"abc") == [b"abc"]
    assert distributed.allgather_bytes(bytearray(b"")) == [b""]
    with pytest.raises(TypeError, match="allgather_bytes takes bytes, got str"):
        distributed.allgather_bytes("abc")


# Each process sends its own messages, empty, short and longer than the smallest padding (and
# one longer on process 1 only: the longest sets the padding), and prints what came back.
GATHER = ("import json; from fo_jax import distributed; info = distributed.initialize_from_env(); "
          "me = info.process_id; "
          "sends = [b'', bytes([me]) * (3 + me), ('\\u00e9' * 200 + str(me)).encode(), "
          "bytes(range(256)) * (1 + 3 * me)]; "
          "print(json.dumps([[m.hex() for m in distributed.allgather_bytes(s)] for s in sends]))")


def test_allgather_bytes_across_two_processes():
    """Two processes (one CPU device each): every process gets every message, whole and in
    process order, whatever their lengths."""
    results = distributed.launch(["-c", GATHER], processes=2, devices_per_process=1,
                                 timeout_s=120)
    assert [r.returncode for r in results] == [0, 0], distributed.report(results)
    sent = [[b"", bytes([p]) * (3 + p), ("\u00e9" * 200 + str(p)).encode(),
             bytes(range(256)) * (1 + 3 * p)] for p in range(2)]
    expected = [[m.hex() for m in (sent[0][i], sent[1][i])] for i in range(4)]
    for r in results:
        assert json.loads(r.stdout.splitlines()[-1]) == expected

"""Many processes on JAX's own distributed runtime: start them, join them, move rows in and out.

One process per host (or per GPU) runs the same program; `jax.distributed.initialize` joins them
into one runtime whose `jax.devices()` are every process's devices. Arrays then span processes:
each process supplies and reads back only its own rows (the requests it serves), and the
compiled step runs on all devices at once.

    info = initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # on each process
    mesh = data_mesh()                                  # every device of every process: `data`
    tokens = global_batch(local_tokens, mesh)           # [B/P, T] here -> [B, T] over the mesh
    logits, state = step(params, state, tokens)         # one program on all devices
    mine = local_rows(logits)                           # [B/P, ...] back on this host

On one machine, `python -m fo_jax.distributed launch --processes 2 --devices-per-process 4 --
script.py ARGS` starts the processes (a free coordinator port, simulated CPU devices, a time
limit, every child killed on failure) and the script joins with `initialize_from_env()`.

Processes stepping one program in lockstep agree on how many calls to make with
`process_max` (a small all-gather), and trade messages of any length (a server's commands and
outputs) with `allgather_bytes`.

Sizes: P processes, D devices in all (D / P per process), B requests (B / P per process, B / D
per device). Nothing here moves data between processes except `jax.distributed`'s own start-up
handshake, `process_max`'s few ints and `allgather_bytes`'s messages: rows go from each host
to its own devices and back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# What `launch` tells each child (read by `initialize_from_env`).
ENV_COORDINATOR = "FO_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FO_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FO_JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "FO_JAX_LOCAL_DEVICE_COUNT"

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the joined runtime.

    Attributes:
      process_id: this process's index, in [0, num_processes).
      num_processes: processes joined.
      local_device_count: devices this process drives.
      device_count: devices of all processes.
    """

    process_id: int
    num_processes: int
    local_device_count: int
    device_count: int

    @classmethod
    def current(cls) -> "ProcessInfo":
        return cls(jax.process_index(), jax.process_count(), jax.local_device_count(),
                   jax.device_count())


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an int")
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name}={value!r} must be {bound}")
    return int(value)


def check_coordinator(coordinator) -> str:
    """Raise unless `coordinator` reads "host:port" with a port in [1, 65535]; return it."""
    text = coordinator if isinstance(coordinator, str) else ""
    host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"coordinator={coordinator!r} must read 'host:port' (the address of process 0, "
            "which every process dials), e.g. '127.0.0.1:1234' or '10.0.0.1:1234'")
    return text


def _update_config(name: str, value) -> bool:
    """Set one jax config option; False when this jax does not know the name."""
    try:
        jax.config.update(name, value)
    except AttributeError:  # "Unrecognized config option"
        return False
    return True


def enable_cpu_collectives() -> str:
    """Make the CPU backend able to run programs that span processes (gloo over TCP); returns
    the option set. Must run before the backend starts (before any JAX computation).

    jax 0.11 and 0.12 name it `jax_cpu_collectives_implementation` ("gloo", their default);
    older releases had the boolean `jax_cpu_enable_gloo_collectives`.
    """
    if _update_config("jax_cpu_collectives_implementation", "gloo"):
        return "jax_cpu_collectives_implementation=gloo"
    if _update_config("jax_cpu_enable_gloo_collectives", True):
        return "jax_cpu_enable_gloo_collectives=True"
    raise NotImplementedError(
        f"jax {jax.__version__} has no CPU collectives option (neither "
        "jax_cpu_collectives_implementation nor jax_cpu_enable_gloo_collectives): programs "
        "spanning processes cannot run on its CPU backend; pass cpu_collectives=False on "
        "GPU/TPU")


def set_cpu_device_count(count: int) -> None:
    """Simulate `count` CPU devices in this process (the CPU backend only). Must run before the
    backend starts: through `jax_num_cpu_devices` where this jax has it, else through
    `--xla_force_host_platform_device_count` in XLA_FLAGS (read when the backend starts)."""
    count = _check_int("local_device_count", count, 1)
    try:
        known = _update_config("jax_num_cpu_devices", count)
    except RuntimeError as e:  # the backend has started
        raise RuntimeError(_too_late("the number of CPU devices")) from e
    if not known:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = (
            f"{flags.strip()} --xla_force_host_platform_device_count={count}").strip()


def _too_late(what: str) -> str:
    return (f"{what} must be set before JAX starts its backend, but something already ran a "
            "JAX operation (jax.devices(), a jnp array, a jit call ...) in this process: call "
            "fo_jax.distributed.initialize first thing after `import jax`")


def initialize(coordinator: str, num_processes: int, process_id: int,
               local_device_count: int | None = None, cpu_collectives: bool = True, *,
               local_device_ids: int | Sequence[int] | None = None,
               timeout_s: int = 300) -> ProcessInfo:
    """Join this process to the others through `jax.distributed.initialize`; returns where it
    stands. Call it on every process, first thing after `import jax`.

    Args:
      coordinator: "host:port" of process 0 (it serves the coordination service there; the
        others dial it). On one machine, "127.0.0.1:<a free port>".
      num_processes: processes in the run (P).
      process_id: this one's index in [0, P); process 0 hosts the coordinator.
      local_device_count: simulated CPU devices in this process (`jax_num_cpu_devices` /
        `--xla_force_host_platform_device_count`); None keeps the backend's own count. GPUs and
        TPUs are counted by their runtime: choose them with `local_device_ids` or
        CUDA_VISIBLE_DEVICES.
      cpu_collectives: enable the CPU backend's cross-process collectives (gloo), so that CPU
        programs can span processes. Harmless on GPU/TPU, where NCCL / ICI carry collectives.
      local_device_ids: the accelerators this process drives (passed to jax).
      timeout_s: how long to wait for every process to join.

    Moves nothing but the start-up handshake (device lists) between processes.
    """
    coordinator = check_coordinator(coordinator)
    num_processes = _check_int("num_processes", num_processes, 1)
    process_id = _check_int("process_id", process_id, 0, num_processes)
    if local_device_count is not None:
        set_cpu_device_count(local_device_count)
    if cpu_collectives:
        enable_cpu_collectives()
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   local_device_ids=local_device_ids,
                                   initialization_timeout=_check_int("timeout_s", timeout_s, 1))
    except RuntimeError as e:
        message = str(e)
        if "once" in message:
            raise RuntimeError("fo_jax.distributed.initialize: this process has already "
                               "joined a distributed runtime (initialize runs once per "
                               f"process): {message}") from e
        if "before" in message:
            raise RuntimeError(_too_late("jax.distributed.initialize")) from e
        raise
    info = ProcessInfo.current()
    if info.num_processes != num_processes or info.process_id != process_id:
        raise RuntimeError(f"joined as process {info.process_id} of {info.num_processes}, "
                           f"expected {process_id} of {num_processes}")
    if (local_device_count is not None and jax.default_backend() == "cpu"
            and info.local_device_count != local_device_count):
        raise RuntimeError(f"this process has {info.local_device_count} CPU devices, expected "
                           f"local_device_count={local_device_count}")
    return info


def initialize_from_env(environ: Mapping[str, str] | None = None) -> ProcessInfo | None:
    """`initialize` with the settings `launch` passes in the environment (FO_JAX_COORDINATOR,
    FO_JAX_NUM_PROCESSES, FO_JAX_PROCESS_ID, FO_JAX_LOCAL_DEVICE_COUNT); None, joining
    nothing, when FO_JAX_COORDINATOR is unset (a plain single-process run)."""
    env = os.environ if environ is None else environ
    if not env.get(ENV_COORDINATOR):
        return None
    values = {}
    for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        if not env.get(name, "").isdigit():
            raise ValueError(f"{ENV_COORDINATOR} is set, so {name} must hold an int >= 0, got "
                             f"{env.get(name)!r}")
        values[name] = int(env[name])
    local = env.get(ENV_LOCAL_DEVICES)
    if local is not None and not local.isdigit():
        raise ValueError(f"{ENV_LOCAL_DEVICES} must hold an int >= 1, got {local!r}")
    return initialize(env[ENV_COORDINATOR], values[ENV_NUM_PROCESSES], values[ENV_PROCESS_ID],
                      local_device_count=None if local is None else int(local))


# ------------------------------------------------------------------------ arrays over the mesh


def data_mesh(axis: str = DATA_AXIS, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over `devices` (default: every device of every process), process by process,
    so that each process's devices hold one contiguous block of the `axis` (its rows of the
    batch come in process order)."""
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("data_mesh needs at least one device")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered), (axis,))


def batch_sharding(mesh: Mesh, axis: str = DATA_AXIS, dim: int = 0, ndim: int | None = None
                   ) -> NamedSharding:
    """Rows (dimension `dim`) split over the mesh axis `axis`; the other dimensions whole."""
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh axis {axis!r} is not one of the mesh's axes "
                         f"{tuple(mesh.axis_names)}")
    spec = [None] * max(dim + 1, ndim or 0)
    spec[dim] = axis
    return NamedSharding(mesh, P(*spec))


def global_batch(local_array, mesh: Mesh, axis: str = DATA_AXIS, *, dim: int = 0) -> jax.Array:
    """This process's rows [B/P, ...] (along `dim`) as its part of one array [B, ...] over the
    mesh, rows split over `axis`; every process calls it with its own rows, in process order.

    Touches only the local rows: each of this process's devices gets its [B/D, ...] slice from
    the host (`jax.make_array_from_process_local_data`); nothing crosses processes.
    """
    local = np.asarray(local_array)
    if not 0 <= dim < local.ndim:
        raise ValueError(f"dim={dim} is not a dimension of the local array of shape "
                         f"{local.shape}")
    sharding = batch_sharding(mesh, axis, dim, local.ndim)
    # Positions along `axis` held by this process's devices (a 1-D data mesh: all of them).
    along = mesh.axis_names.index(axis)
    parts = len({at[along] for at in np.ndindex(mesh.devices.shape)
                 if mesh.devices[at].process_index == jax.process_index()})
    if parts == 0:
        raise ValueError(f"the mesh holds none of process {jax.process_index()}'s devices: "
                         "build it from jax.devices() (every process's devices)")
    if local.shape[dim] % parts:
        raise ValueError(f"process {jax.process_index()} has {local.shape[dim]} rows, which "
                         f"its {parts} devices on mesh axis {axis!r} cannot split evenly: "
                         f"give each process a multiple of {parts} rows (pad with dummy "
                         "requests)")
    return jax.make_array_from_process_local_data(sharding, local)


def global_tree(local_tree, shardings):
    """`global_batch` for a pytree (e.g. a decode state): each leaf holds this process's part
    (its rows) and goes to the matching sharding of `shardings` (same tree structure). Touches
    the local rows only, host to device."""
    return jax.tree.map(
        lambda sharding, leaf: jax.make_array_from_process_local_data(sharding, np.asarray(leaf)),
        shardings, local_tree)


def replicate(tree, mesh: Mesh):
    """Every leaf whole on every device of the mesh (weights of a data-parallel run). Each
    process passes the same values (not checked: e.g. weights from one seed or one
    checkpoint); each of its devices gets a full copy from its host; nothing crosses processes.
    """
    sharding = NamedSharding(mesh, P())

    def put(leaf):
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def local_rows(global_array: jax.Array, *, dim: int = 0) -> np.ndarray:
    """This process's rows (along `dim`) of an array split over processes, on the host, in
    order: [B/P, ...] for rows split over all D devices. Reads this process's own devices only
    (device to host); an array replicated on them comes back whole."""
    if not isinstance(global_array, jax.Array):
        raise ValueError(f"local_rows takes a jax.Array, got {type(global_array).__name__}")
    blocks = {}
    for shard in global_array.addressable_shards:
        rows = shard.index[dim] if dim < len(shard.index) else slice(None)
        start, stop, _ = rows.indices(global_array.shape[dim])
        blocks.setdefault((start, stop), shard)
    spans = sorted(blocks)
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        if start != stop:
            raise ValueError(f"process {jax.process_index()}'s rows of the array are not one "
                             f"contiguous block along dim {dim} (spans {spans}): build the "
                             "mesh with data_mesh() so each process holds one block")
    return np.concatenate([np.asarray(blocks[span].data) for span in spans], axis=dim)


def process_max(values) -> np.ndarray:
    """The elementwise max over every process of a few small ints (`values`, the same length on
    every process): how processes stepping one program in lockstep agree on how many calls to
    make. A collective (`process_allgather`, over the CPU backend's gloo, or NCCL / ICI): every
    process calls it at the same point. With one process, the values themselves (no
    collective). O(P len(values)) host traffic."""
    values = np.asarray(values, np.int32).reshape(-1)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values)).reshape(
        jax.process_count(), -1).max(axis=0)


MIN_MESSAGE_BYTES = 256  # `allgather_bytes` pads every message to a power of two >= this


def padded_size(nbytes: int) -> int:
    """The size `allgather_bytes` pads a longest message of `nbytes` bytes to: the next power
    of two, at least `MIN_MESSAGE_BYTES` (so the gather compiles one program per size bucket,
    O(log longest) in all, not one per length)."""
    nbytes = _check_int("nbytes", nbytes, 0)
    return max(MIN_MESSAGE_BYTES, 1 << max(nbytes - 1, 0).bit_length())


def allgather_bytes(message: bytes) -> list[bytes]:
    """Every process's `message` (bytes of any length, each process its own), in process
    order. A collective every process makes at the same point (like `process_max`): one small
    all-gather of the lengths, then one of the messages as uint8 rows padded to
    `padded_size(longest)`. With one process, [message] (no collective). O(P padded) host
    traffic."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise TypeError(f"allgather_bytes takes bytes, got {type(message).__name__}")
    message = bytes(message)
    if jax.process_count() == 1:
        return [message]
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(
        np.array([len(message)], np.int32))).reshape(-1)
    rows = np.zeros(padded_size(int(lengths.max())), np.uint8)
    rows[:len(message)] = np.frombuffer(message, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(rows)).reshape(len(lengths), -1)
    return [gathered[p, :n].tobytes() for p, n in enumerate(lengths.tolist())]


def local_row(x: jax.Array, index: int) -> np.ndarray:
    """Row `index` of `x` (split along axis 0) on the host, read from the shard of this
    process's device that holds it (never another process's)."""
    for shard in x.addressable_shards:
        start, stop, _ = shard.index[0].indices(x.shape[0])
        if start <= index < stop:
            return np.asarray(shard.data[index - start])
    raise ValueError(f"row {index} of the array is on another process's device")


def local_values(x: jax.Array, fill) -> np.ndarray:
    """`x` on the host, whole-shaped: the blocks of this process's devices read from them,
    every other element `fill` (another process's rows, which this one does not read)."""
    out = np.full(x.shape, fill, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


# ---------------------------------------------------------------------------------- launcher


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """How one launched process ended.

    Attributes:
      process_id: its index.
      returncode: its exit status (negative: killed by that signal).
      stdout, stderr: its output, whole.
      killed: the launcher killed it (time limit, or another process failed).
    """

    process_id: int
    returncode: int
    stdout: str
    stderr: str
    killed: bool


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; another program could take it before
    the coordinator binds it, which then fails to start: launch again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """End one child and everything it started (its own process group, which outlives the
    child: a child that has exited may have left processes of its own running)."""
    if proc.poll() is not None:
        try:  # the group's pgid cannot be reused while any member of it lives
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the child is gone; what it started and left behind goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return


def launch(args: Sequence[str], *, processes: int, devices_per_process: int | None = None,
           timeout_s: float = 300.0, env: Mapping[str, str] | None = None,
           cwd: str | None = None, host: str = "127.0.0.1", port: int | None = None
           ) -> list[ProcessResult]:
    """Run `python ARGS` as `processes` processes on this machine, joined through a
    coordinator at host:port (a free port by default); wait for all of them, at most
    `timeout_s` seconds; returns how each ended, in process order.

    Each child gets FO_JAX_COORDINATOR / FO_JAX_NUM_PROCESSES / FO_JAX_PROCESS_ID (and
    FO_JAX_LOCAL_DEVICE_COUNT with JAX_PLATFORMS=cpu when `devices_per_process` simulates CPU
    devices) for `initialize_from_env`. As soon as one child fails, or the time is up, every
    child still running is killed (with what it started): the others would otherwise wait on
    the dead one until the runtime's heartbeat timeout. On return nothing a child started is
    left running (each child's process group is killed, even after the child has exited).
    Outputs go through temporary files (no pipe can fill up and stall a child).
    """
    if not args:
        raise ValueError("launch needs the program to run: python arguments, e.g. "
                         "['-m', 'some.module', '--flag'] or ['script.py']")
    processes = _check_int("processes", processes, 1)
    if devices_per_process is not None:
        devices_per_process = _check_int("devices_per_process", devices_per_process, 1)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    coordinator = check_coordinator(f"{host}:{free_port(host) if port is None else port}")
    base = dict(os.environ if env is None else env)
    base["PYTHONUNBUFFERED"] = "1"
    if devices_per_process is not None:
        base["JAX_PLATFORMS"] = "cpu"
        base[ENV_LOCAL_DEVICES] = str(devices_per_process)
    procs, files = [], []
    with tempfile.TemporaryDirectory(prefix="fo_jax_launch_") as tmp:
        try:
            for i in range(processes):
                child_env = dict(base, **{ENV_COORDINATOR: coordinator,
                                          ENV_NUM_PROCESSES: str(processes),
                                          ENV_PROCESS_ID: str(i)})
                out = open(os.path.join(tmp, f"{i}.out"), "w+")
                err = open(os.path.join(tmp, f"{i}.err"), "w+")
                files.append((out, err))
                procs.append(subprocess.Popen([sys.executable, *args], stdout=out, stderr=err,
                                              env=child_env, cwd=cwd, start_new_session=True))
            killed = _wait_all(procs, time.monotonic() + timeout_s)
        finally:
            for proc in procs:
                _kill(proc)
        results = []
        for i, (proc, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            results.append(ProcessResult(i, proc.returncode, out.read(), err.read(),
                                         killed=i in killed))
            out.close()
            err.close()
    return results


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> set[int]:
    """Wait until every child has exited; on the first failure or at the deadline, kill the
    ones still running. Returns the indices of the killed ones."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return set()
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            running = {i for i, c in enumerate(codes) if c is None}
            for i in running:
                _kill(procs[i])
            return running
        time.sleep(0.05)


def report(results: Sequence[ProcessResult]) -> str:
    """Every process's output, each line prefixed with [process id], then one status line."""
    lines = []
    for r in results:
        for stream in (r.stdout, r.stderr):
            lines += [f"[{r.process_id}] {line}" for line in stream.splitlines()]
    lines.append("; ".join(
        f"process {r.process_id}: " + (f"killed (exit {r.returncode})" if r.killed
                                       else f"exit {r.returncode}") for r in results))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fo_jax.distributed",
        description="Start N processes of one program on this machine, joined by "
                    "jax.distributed (the program calls fo_jax.distributed.initialize_from_env)")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("launch", help="run `python ARGS` as N joined processes")
    run.add_argument("--processes", type=int, required=True)
    run.add_argument("--devices-per-process", type=int, default=None,
                     help="simulated CPU devices per process (sets JAX_PLATFORMS=cpu)")
    run.add_argument("--timeout", type=float, default=300.0,
                     help="seconds before every process is killed (default 300)")
    run.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    run.add_argument("args", nargs=argparse.REMAINDER,
                     help="after `--`: python arguments, e.g. -m some.module --flag")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    try:
        results = launch(args, processes=ns.processes,
                         devices_per_process=ns.devices_per_process, timeout_s=ns.timeout,
                         port=ns.port)
    except ValueError as e:
        parser.error(str(e))
    print(report(results))
    return 0 if all(r.returncode == 0 and not r.killed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`fo-jax serve`: the engine behind an OpenAI-compatible HTTP server (uvicorn).

    fo-jax serve                                  # the embedded model, resident, 127.0.0.1:8000
    fo-jax serve --offload --hot-slots 512 --seats 8 --capacity 2048 --max-queue 32
    fo-jax serve --model-dir runs/bpe --port 8080

Start-up: the flags are checked as they are parsed (`fo_jax.flags`: a port outside
[1, 65535], a non-finite size, an output path whose directory is missing exit 2 naming the
flag), and the address is bound (`bind_socket`: a host of no interface, a port in use) before
the model is built and compiled.

Shutdown (SIGTERM, SIGINT, or `ServerThread.stop`): new requests get 503, in-flight ones get
`--shutdown-timeout` seconds to finish and are then cancelled, the engine thread stops, the
process prints one line of request counts and pool pages (`final_report`) and exits 0. If the
engine thread dies (a fault of the engine's own state), the server shuts down the same way and
the process exits 1, saying so.

Across processes (jax.distributed: launched by `python -m fo_jax.distributed launch`, or the
FO_JAX_* variables set on each host; `run` joins them first): one ShardedEngine over every
process's devices (`--devices` the global count, `--expert-parallel` the same, resident), the
HTTP server on process 0 only, whose `LockstepDriver` (fo_jax.server.lockstep) the other
processes follow tick by tick; each process prints its part of the engine at start and at
stop (`process_report`); stopping process 0 stops them all (exit 0).

`ServerThread` runs the same server in a background thread (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import signal
import socket
import sys
import threading
import time

from fo_jax import flags
from fo_jax.server.driver import EngineDriver

SHUTDOWN_MARGIN = 30.0  # seconds uvicorn waits for connections after the drain


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's flags (fastapi / uvicorn are imported only when it runs)."""
    add_engine_arguments(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="the name of /v1/models (default: the config's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=flags.port, default=8000)
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a seat; more get HTTP 429")
    parser.add_argument("--max-body-mb", type=flags.megabytes, default=16.0,
                        help="request bodies above this many MB (1e6 bytes) get HTTP 413")
    parser.add_argument("--shutdown-timeout", type=flags.seconds, default=10.0,
                        help="seconds in-flight requests get to finish on shutdown")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the start-up request that compiles the programs")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--metrics-jsonl", type=flags.output_path, default=None, metavar="PATH",
                        help="append the engine's counters here as JSON lines (after "
                        "warm-up; with --devices N --expert-parallel N each record also holds "
                        "every rank's figures)")
    parser.add_argument("--metrics-every", type=int, default=16,
                        help="engine steps between two reads of the device counters")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine flags (`serve`, `bench-serve`): `EngineArgs.add_cli_args`."""
    from fo_jax.engine.args import EngineArgs

    EngineArgs.add_cli_args(parser)


@dataclasses.dataclass
class Served:
    """What the server needs: the app and its driver (and the engine's settings)."""
    app: object
    driver: EngineDriver
    model_name: str
    capacity: int


def build_served(engine, tokenizer, *, model_name: str, max_queue: int = 64,
                 shutdown_timeout: float = 10.0, stop_token_ids=None, chat_template=None,
                 stats_every: int = 16, max_body_bytes: int | None = None) -> Served:
    """An app and its driver over `engine` (the driver starts with the app). `max_body_bytes`:
    larger request bodies get 413 (None: `fo_jax.server.app.MAX_BODY_BYTES`)."""
    from fo_jax.server.app import MAX_BODY_BYTES, build_app

    if stop_token_ids is None:  # a checkpoint's EOS ids, or fo_jax's document separator
        eos = tuple(getattr(tokenizer, "eos_ids", ()) or ())
        sep = getattr(tokenizer, "sep", None)
        stop_token_ids = eos or ((sep,) if sep is not None else ())
        stop_token_ids = tuple(t for t in stop_token_ids if t < engine.config.vocab_size)
    if chat_template is None and getattr(tokenizer, "chat_template", None) is not None:
        def chat_template(messages):  # the checkpoint's own template (Hugging Face tokenizers)
            return tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in messages])
    if getattr(engine, "multiprocess", False):  # a ShardedEngine across processes
        from fo_jax.server.lockstep import LockstepDriver

        driver = LockstepDriver(engine, max_queue=max_queue, stats_every=stats_every)
    else:
        driver = EngineDriver(engine, max_queue=max_queue, stats_every=stats_every)
    app = build_app(driver, tokenizer=tokenizer, model_name=model_name,
                    capacity=engine.capacity, stop_token_ids=tuple(stop_token_ids),
                    chat_template=chat_template, shutdown_timeout=shutdown_timeout,
                    max_body_bytes=MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes)
    return Served(app, driver, model_name, engine.capacity)


def _server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn.Server that refuses new requests (503) as soon as shutdown starts, and
        exits 0 on SIGTERM / SIGINT (uvicorn would raise the signal again after shutdown)."""

        driver: EngineDriver | None = None
        drain_timeout: float = 10.0

        def handle_exit(self, sig, frame) -> None:
            if self.driver is not None:
                self.driver.begin_shutdown(self.drain_timeout)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        def engine_failed(self) -> None:
            """The engine thread has died (a fault of its own state): shut down (the
            process then exits non-zero)."""
            self.should_exit = True

    return GracefulServer


def make_server(served: Served, *, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info", shutdown_timeout: float = 10.0):
    """A uvicorn server for `served`. On shutdown, in-flight requests get `shutdown_timeout`
    seconds, then the driver cancels them after the engine's current step (their clients get
    finish_reason "cancelled"); uvicorn closes connections still open `SHUTDOWN_MARGIN` seconds
    after that (a step that compiles a program can take that long). The server shuts down by
    itself if the engine thread dies."""
    import uvicorn

    config = uvicorn.Config(served.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_MARGIN,
                            lifespan="on")
    server = _server_class()(config)
    server.driver, server.drain_timeout = served.driver, shutdown_timeout
    served.driver.on_failure = server.engine_failed
    return server


class ServerThread:
    """The server in a background thread, on a free port of 127.0.0.1 (tests, benchmarks).

        with ServerThread(served) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, served: Served, *, host: str = "127.0.0.1", port: int = 0,
                 shutdown_timeout: float = 5.0):
        self.served = served
        self.server = make_server(served, host=host, port=port, log_level="warning",
                                  shutdown_timeout=shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, name="fo-jax-http", daemon=True)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Graceful shutdown (as on SIGTERM); True if the server and engine threads ended."""
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(timeout)
        return not self.thread.is_alive() and not self.served.driver.alive

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def warm_up(engine) -> None:
    """Requests through the engine before the server starts, so that clients do not wait for
    compilations: a prompt of two prefill chunks (the second reads history), sampled and
    greedy, each with enough tokens for three decode calls (the engine's decode program is
    compiled again on its second call: its arguments become committed device arrays). Prompts
    whose history reaches further compile their prefill program on first use."""
    n = min(engine.chunk + 1, max(1, engine.capacity // 2))
    steps = engine.n_steps
    ranks = getattr(engine, "ranks", None)  # DataParallelEngine, ShardedEngine: every rank
    # A ShardedEngine across processes: each process its own ranks (`run` steps them all).
    ranks = getattr(engine, "local_ranks", None if ranks is None else range(ranks))
    for temperature in (0.0, 1.0):
        rids = [engine.add_request([0] * n, max_tokens=3 * steps + 1, temperature=temperature,
                                   **({} if ranks is None else {"rank": r}))
                for r in (ranks or [None])]
        engine.run()
        for rid in rids:
            engine.release(rid)
    if ranks is not None:
        engine.reset_figures()


def build_engine(args, *, metrics_jsonl: str | None = None):
    """(engine, config, tokenizer, offload config or None) from the flags of
    `add_engine_arguments` (`EngineArgs.from_cli_args`), every flag checked before the weights
    are read. `metrics_jsonl`: the --metrics-jsonl of the command (refused with --devices
    without --expert-parallel).
    --devices N builds a `DataParallelEngine`, and with --expert-parallel N one `ShardedEngine`
    over the N devices (the all-to-all layout: each holds 1/N of the experts)."""
    import jax

    from fo_jax.engine import Engine
    from fo_jax.engine.args import EngineArgs
    from fo_jax.resolve import check_param_memory, random_params, resolve_model
    from fo_jax.tokenizer import ByteTokenizer
    from fo_jax.weights import load_params

    engine_args = EngineArgs.from_cli_args(args)
    model_args = engine_args.model_args
    config, load, tokenizer = resolve_model(model_args)
    if tokenizer is None:
        tokenizer = ByteTokenizer()
        if config.vocab_size < 256:
            raise ValueError(f"the byte tokenizer needs vocab_size >= 256; {config.name!r} has "
                             f"{config.vocab_size}")
    drafter, num_drafts = engine_args.drafting(config)  # checked against the model
    if drafter == "mtp":
        _check_mtp_flags(config, load, num_drafts)
    offload = engine_args.offload_config(config)
    devices = _devices(engine_args, metrics_jsonl)
    if engine_args.expert_parallel is not None and config.n_routed_experts < 1:
        raise ValueError(f"--expert-parallel splits the MoE experts, but {config.name!r} has "
                         "none: drop it (--devices alone serves data-parallel)")
    check_param_memory(config, model_args.max_param_gb)
    mtp = None
    if load is not None and drafter == "mtp":
        _, params, mtp = load(mtp=True)
    elif load is not None:
        params = load()[1]
    else:
        seed = model_args.seed
        params = (load_params(model_args.weights, config) if model_args.weights
                  else random_params(config, seed))
        if drafter == "mtp":  # a preset's random weights: a random MTP layer too
            from fo_jax.model.mtp import init_mtp_params

            mtp = init_mtp_params(config, jax.random.key(seed + 1))
    settings = engine_args.engine_settings(config, offload)
    if devices is None:
        return Engine(params, config, settings, tokenizer=tokenizer, mtp=mtp), config, \
            tokenizer, offload
    if engine_args.expert_parallel is not None:  # one sharded engine over the devices
        from fo_jax import sharding
        from fo_jax.engine.sharded import ShardedEngine

        mesh, rules = sharding.expert_mesh(len(devices), expert=engine_args.expert_parallel,
                                           devices=devices)
        engine = ShardedEngine(params, config, settings, mesh=mesh, rules=rules,
                               placement=engine_args.placement, tokenizer=tokenizer)
        return engine, config, tokenizer, offload
    from fo_jax.engine.data_parallel import DataParallelEngine

    engine = DataParallelEngine(params, config, devices=devices,
                                placement=engine_args.placement, settings=settings,
                                tokenizer=tokenizer, mtp=mtp)
    return engine, config, tokenizer, offload


def _check_mtp_flags(config, load, num_drafts: int) -> None:
    """Raise unless --drafter mtp can run with these flags (before any weight is read)."""
    from fo_jax.checkpoints import load_checkpoint

    if num_drafts < 1:
        raise ValueError("--drafter mtp needs --num-drafts >= 1")
    if config.num_nextn_predict_layers < 1:
        raise ValueError(f"--drafter mtp needs a model with an MTP layer "
                         f"(num_nextn_predict_layers >= 1); {config.name!r} has none: use "
                         "--drafter ngram")
    if load is not None and getattr(load, "func", None) is not load_checkpoint:
        raise ValueError("--drafter mtp needs the MTP layers of a Hugging Face checkpoint "
                         "(--model-dir of one with num_nextn_predict_layers >= 1)")


def check_processes(engine_args, *, processes: int, device_count: int,
                    local_device_count: int) -> None:
    """Raise ValueError unless the flags serve across `processes` processes (of
    `local_device_count` devices each, `device_count` in all): one ShardedEngine over every
    process's devices, so --devices is the global device count, --expert-parallel the same
    (resident or --offload). Each process drives its own devices (jax.distributed)."""
    fix = f"pass --devices {device_count} --expert-parallel {device_count}"
    where = f"{processes} processes x {local_device_count} devices"
    count, expert = engine_args.devices, engine_args.expert_parallel
    if count is None:
        raise ValueError(f"across {processes} processes `serve` runs one sharded engine over "
                         f"every process's devices ({where}), but --devices is missing: {fix}")
    if count != device_count:
        raise ValueError(f"--devices {count} across {processes} processes must be the global "
                         f"device count {device_count} ({where}: each process serves its "
                         f"own devices): {fix}")
    if expert is None:
        raise ValueError(f"--devices {count} across {processes} processes needs "
                         f"--expert-parallel {count}: one sharded engine spans the processes "
                         "(the data-parallel engines of --devices alone run in one process)")


def _devices(engine_args, metrics_jsonl: str | None):
    """The devices of --devices (None without it), checked before the weights are read: this
    process's, or across processes (jax.distributed) every process's (`check_processes`)."""
    import jax

    count = engine_args.devices
    if jax.process_count() > 1:
        check_processes(engine_args, processes=jax.process_count(),
                        device_count=jax.device_count(),
                        local_device_count=jax.local_device_count())
        if metrics_jsonl:
            raise ValueError("--metrics-jsonl is not supported with --devices (one log per "
                             "engine)")
        return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if count is None:
        return None
    local = jax.local_devices()
    if not 1 <= count <= len(local):
        raise ValueError(f"--devices {count} must be in [1, {len(local)}] (this process's "
                         "devices; on a CPU, simulate more with XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={max(count, 1)})")
    if metrics_jsonl and engine_args.expert_parallel is None:
        raise ValueError("--metrics-jsonl is not supported with --devices alone (one log "
                         "per engine; the data-parallel server runs one engine per device): "
                         "add --expert-parallel N for the one sharded engine, which logs "
                         "per-rank figures")
    return local[:count]


def path_name(offload) -> str:
    """How the engine holds the KV, for the banners: "resident", "paged, pool on the device"
    or "offloaded"."""
    if offload is None:
        return "resident"
    return "paged, pool on the device" if offload.host_memory_kind == "device" else "offloaded"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds one, not listening yet (a client
    is refused until the server starts). Raises ValueError naming the flag if it cannot be
    bound (an address of no interface of this machine, a port in use), so that `serve`
    stops before the model is built."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        where = f"{host}:{port}" if family == socket.AF_INET else f"[{host}]:{port}"
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"argument --port: cannot listen on {where}: the port is in use "
                             "(choose another --port)") from None
        raise ValueError(f"argument --host: cannot listen on {where}: {err.strerror or err} "
                         "(give an address of this machine, e.g. 127.0.0.1 or 0.0.0.0)"
                         ) from None
    sock.set_inheritable(True)
    return sock


def run(args) -> int:
    """`fo-jax serve` (flags: `add_arguments`). The address is bound before the model is
    built: a host or port that cannot be had stops the command at once."""
    if args.metrics_every < 1:
        raise ValueError(f"--metrics-every {args.metrics_every} must be >= 1 (engine steps "
                         "between two reads)")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    from fo_jax import distributed

    info = distributed.initialize_from_env()  # joins the others when launched as processes
    if info is None:
        sock = bind_socket(args.host, args.port)
        try:
            return _serve(args, sock)
        finally:
            sock.close()
    if info.process_id > 0:
        code = _follow(args)
    else:
        sock = bind_socket(args.host, args.port)
        try:
            code = _serve(args, sock)
        finally:
            sock.close()
    if code:  # a process failed or is gone: jax.distributed's shutdown barrier would wait for
        # it (the runtime's heartbeat timeout, about a minute) and then abort: leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _build_and_warm(args):
    """(engine, config, tokenizer, offload) built and warmed up (unless --no-warmup); across
    processes, with one line on this process's part."""
    engine, config, tokenizer, offload = build_engine(args, metrics_jsonl=args.metrics_jsonl)
    if not args.no_warmup:
        t0 = time.perf_counter()
        warm_up(engine)
        print(f"fo-jax serve: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    if getattr(engine, "multiprocess", False):
        from fo_jax.server.lockstep import process_report

        print(f"fo-jax serve: process: {json.dumps(process_report(engine))}", flush=True)
    return engine, config, tokenizer, offload


def _follow(args) -> int:
    """A process other than 0 of `serve` across processes: the same engine, no HTTP server;
    its driver follows process 0's ticks until process 0 stops (exit 0) or a fault (exit 1)."""
    from fo_jax.server.lockstep import LockstepDriver, process_report

    engine = _build_and_warm(args)[0]
    driver = LockstepDriver(engine, max_queue=args.max_queue, stats_every=args.metrics_every)
    code = driver.follow()
    print(f"fo-jax serve: stopped: process: {json.dumps(process_report(engine))}", flush=True)
    if code:
        print(f"fo-jax serve: process {driver.process}: {driver.failure}: the engine stopped, "
              "exit status 1", file=sys.stderr, flush=True)
    return code


def _serve(args, sock: socket.socket) -> int:
    engine, config, tokenizer, offload = _build_and_warm(args)
    capacity = engine.capacity
    if args.metrics_jsonl:  # attached after the warm-up: its request is not counted
        from fo_jax.engine.metrics import MetricsLog
        engine.metrics = MetricsLog(engine, path=args.metrics_jsonl, every=args.metrics_every)
    name = args.served_model_name or config.name
    served = build_served(engine, tokenizer, model_name=name, max_queue=args.max_queue,
                          shutdown_timeout=args.shutdown_timeout,
                          max_body_bytes=int(args.max_body_mb * 1e6))
    server = make_server(served, host=args.host, port=args.port, log_level=args.log_level,
                         shutdown_timeout=args.shutdown_timeout)
    ranks = "" if args.devices is None else f" x {args.devices} devices"
    print(f"fo-jax serve: {name} ({path_name(offload)}, {args.seats} "
          f"seats{ranks} "
          f"of {capacity} tokens) on http://{args.host}:{args.port}/v1", flush=True)
    server.run(sockets=[sock])
    if engine.metrics is not None:
        engine.metrics.flush()
    print(final_report(served), flush=True)
    if getattr(engine, "multiprocess", False):
        from fo_jax.server.lockstep import process_report

        print(f"fo-jax serve: stopped: process: {json.dumps(process_report(engine))}",
              flush=True)
    if served.driver.failure is not None:
        print(f"fo-jax serve: {served.driver.failure}: the engine stopped, exit status 1",
              file=sys.stderr, flush=True)
        return 1
    return 0


def final_report(served: Served) -> str:
    """One line for the log once the server has stopped: the request counts of /metrics and
    the pool's pages from the driver's last snapshot (published after the engine thread
    cancelled what was left), e.g. "fo-jax serve: stopped: requests received 40, completed 22,
    cancelled 8, rejected 10, failed 0; pool pages held 0, cached 0, free 16, total 16"."""
    registry = served.app.state.metrics.registry
    counts = {}
    for family in registry.collect():
        name = family.name.removeprefix("fojax_requests_")
        if family.type == "counter" and name in ("received", "completed", "cancelled",
                                                 "rejected", "failed"):
            counts[name] = int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    line = "fo-jax serve: stopped: requests " + ", ".join(
        f"{name} {counts.get(name, 0)}"
        for name in ("received", "completed", "cancelled", "rejected", "failed"))
    pool = served.driver.snapshot.pool
    if pool:
        line += "; pool pages " + ", ".join(f"{k} {pool[k]}" for k in ("held", "cached", "free",
                                                                        "total"))
    else:
        line += "; no page pool (resident)"
    return line


__all__ = ["Served", "ServerThread", "add_arguments", "add_engine_arguments", "bind_socket",
           "build_engine", "build_served", "check_processes", "final_report", "make_server",
           "path_name", "run", "warm_up"]

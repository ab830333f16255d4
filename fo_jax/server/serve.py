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

`ServerThread` runs the same server in a background thread (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
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
                        help="append the engine's counters here as JSON lines (after warm-up)")
    parser.add_argument("--metrics-every", type=int, default=16,
                        help="engine steps between two reads of the device counters")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine flags (`serve`, `bench-serve`)."""
    parser.add_argument("--model", default=None,
                        help="trained-small (default: the model shipped with the package) or a "
                             "preset with random weights (tiny, small) or --weights")
    parser.add_argument("--model-dir", default=None, help="a model directory (fo_jax.embedded)")
    parser.add_argument("--weights", default=None, help="safetensors weights for a --model preset")
    parser.add_argument("--checkpoint-weights", default=None, choices=("fp8", "dequantize"),
                        help="a Hugging Face --model-dir's FP8 weights: fp8 keeps them FP8 "
                             "(multiplied in FP8 with their block scales), dequantize converts "
                             "them on load (default: fp8 for a checkpoint with a "
                             "quantization_config)")
    parser.add_argument("--seed", type=flags.seed, default=0,
                        help="random weights of a --model preset")
    parser.add_argument("--seats", type=int, default=4, help="requests decoded at once")
    parser.add_argument("--capacity", type=int, default=None,
                        help="tokens per seat, prompt + output (default: min(max_seq_len, 2048))")
    parser.add_argument("--offload", action="store_true",
                        help="a paged KV pool shared by the seats, in host memory (offloaded; "
                             "--pool-memory device: in device memory)")
    parser.add_argument("--hot-slots", type=int, default=None,
                        help="with --offload: hot-cache slots per layer (default: top-k x max "
                             "ways)")
    parser.add_argument("--page-size", type=int, default=16, help="with --offload: host page")
    parser.add_argument("--policy", default=None,
                        help="with --offload: eviction policy ring (default), lru, random, clock")
    parser.add_argument("--pool-memory", default=None, metavar="{pinned_host,device}",
                        help="with --offload: where the KV page pool lives: pinned_host "
                             "(default: offloaded to host memory) or device (the paged KV on the "
                             "device: its pages count against --device-gb, with admission and "
                             "preemption by bytes)")
    parser.add_argument("--host-pool-gb", type=flags.gigabytes, default=None,
                        help="with --offload: host KV pool shared by the seats, in GB (default "
                             "every seat full at once)")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="reuse earlier prompts' prefixes: offloaded, their pool pages; "
                             "resident, their KV rows, copied from a prefix store in device "
                             "memory")
    parser.add_argument("--prefix-cache-gb", type=flags.gigabytes, default=None,
                        help="with --prefix-cache, resident: the prefix store's size in GB "
                             "(default: one seat's rows)")
    parser.add_argument("--device-gb", type=flags.gigabytes, default=None,
                        help="with --offload: device budget of request state in GB (hot caches, "
                             "indexer-key pages, prefill buffers, and the KV pages with "
                             "--pool-memory device: the planner's arithmetic); "
                             "requests wait for it, one that never fits is refused")
    parser.add_argument("--reserve", choices=("full", "prompt"), default="full",
                        help="with --offload: pages reserved at admission: prompt + max_tokens "
                             "(full), or the prompt and the next decode call, growing as it "
                             "decodes and preempting the youngest request when short (prompt)")
    parser.add_argument("--queue-order", choices=("fifo", "shortest"), default="fifo",
                        help="waiting requests: by arrival, or shortest prompt + max_tokens first")
    parser.add_argument("--max-wait-steps", type=int, default=256,
                        help="with --queue-order shortest: engine steps after which a waiting "
                             "request goes ahead of shorter ones (-1: no aging)")
    parser.add_argument("--decode-steps-per-call", type=int, default=1)
    parser.add_argument("--num-drafts", type=int, default=0,
                        help="drafts per request and decode step, verified on the device "
                             "(speculative sampling at temperature > 0; 0 = none; at most the "
                             "model's max_ways - 1)")
    parser.add_argument("--drafter", choices=("ngram", "mtp"), default="ngram",
                        help="with --num-drafts: n-gram lookup in each request's history, or "
                             "the model's MTP layer (a --model-dir Hugging Face checkpoint "
                             "with num_nextn_predict_layers >= 1; a preset's random weights "
                             "get a random one; with --devices, one copy per device)")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--devices", type=int, default=None,
                        help="serve data-parallel on this many local devices: one engine per "
                             "device (--seats and the host pool per device), each request "
                             "placed on one (fo_jax.engine.data_parallel). On a CPU, simulated "
                             "devices need XLA_FLAGS=--xla_force_host_platform_device_count=N")
    parser.add_argument("--placement", default=None,
                        choices=("round_robin", "least_requests", "least_context",
                                 "least_misses"),
                        help="with --devices: the rank of a new request (default least_misses "
                             "with --offload, else least_context; fo_jax.placement)")
    parser.add_argument("--max-param-gb", type=float, default=None)
    parser.add_argument("--no-progress", action="store_true")


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
    ranks = getattr(engine, "ranks", None)  # a DataParallelEngine: every rank compiles
    for temperature in (0.0, 1.0):
        rids = [engine.add_request([0] * n, max_tokens=3 * steps + 1, temperature=temperature,
                                   **({} if ranks is None else {"rank": r}))
                for r in range(ranks or 1)]
        engine.run()
        for rid in rids:
            engine.release(rid)
    if ranks is not None:
        engine.reset_figures()


def _check_mtp_flags(args, config, load, num_drafts: int) -> None:
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


def build_engine(args):
    """(engine, config, tokenizer, offload config or None) from the flags of
    `add_engine_arguments`, every flag checked before the weights are read."""
    import jax

    from fo_jax.engine import Engine
    from fo_jax.decode_loop import check_drafting
    from fo_jax.offload.config import (MEMORY_KINDS, OffloadConfig, check_hot_slots,
                                       min_hot_slots)
    from fo_jax.resolve import check_param_memory, random_params, resolve_model
    from fo_jax.tokenizer import ByteTokenizer
    from fo_jax.weights import load_params

    config, load, tokenizer = resolve_model(args)
    if tokenizer is None:
        tokenizer = ByteTokenizer()
        if config.vocab_size < 256:
            raise ValueError(f"the byte tokenizer needs vocab_size >= 256; {config.name!r} has "
                             f"{config.vocab_size}")
    for flag in ("seats", "max_queue", "decode_steps_per_call", "prefill_chunk", "page_size"):
        value = getattr(args, flag, 1)
        if value < (0 if flag == "max_queue" else 1):
            raise ValueError(f"--{flag.replace('_', '-')} must be >= "
                             f"{0 if flag == 'max_queue' else 1}, got {value}")
    pool_memory = getattr(args, "pool_memory", None)
    if pool_memory is not None and pool_memory not in MEMORY_KINDS:
        raise ValueError(f"--pool-memory {pool_memory}: choose pinned_host (the KV pages in host "
                         "memory: offloaded) or device (the paged KV on the device, its pages "
                         "counted against --device-gb)")
    if not args.offload:
        for flag in ("policy", "hot_slots", "pool_memory"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} applies to the offloaded path "
                                 "only: add --offload")
    num_drafts = getattr(args, "num_drafts", 0)
    try:
        check_drafting(num_drafts, config)
    except ValueError as err:
        raise ValueError(f"--num-drafts {num_drafts}: {err}") from None
    drafter = getattr(args, "drafter", "ngram")
    if drafter == "mtp":
        _check_mtp_flags(args, config, load, num_drafts)
    capacity = min(config.max_seq_len, 2048) if args.capacity is None else args.capacity
    offload = None
    if args.offload:
        if capacity % args.page_size:
            raise ValueError(f"--capacity {capacity} must be a multiple of --page-size "
                             f"{args.page_size} with --offload")
        if args.hot_slots is not None:
            check_hot_slots(args.hot_slots, config)
        hot = min_hot_slots(config) if args.hot_slots is None else args.hot_slots
        offload = OffloadConfig(hot_slots=hot, page_size=args.page_size, capacity=capacity,
                                policy=args.policy or "ring",
                                host_memory_kind=pool_memory or "pinned_host")
        offload.validate_for(config)
    devices = _devices(args)
    check_param_memory(config, args.max_param_gb)
    mtp = None
    if load is not None and drafter == "mtp":
        _, params, mtp = load(mtp=True)
    elif load is not None:
        params = load()[1]
    else:
        params = (load_params(args.weights, config) if args.weights
                  else random_params(config, args.seed))
        if drafter == "mtp":  # a preset's random weights: a random MTP layer too
            from fo_jax.model.mtp import init_mtp_params

            mtp = init_mtp_params(config, jax.random.key(args.seed + 1))
    pool = {}
    device_gb, reserve = getattr(args, "device_gb", None), getattr(args, "reserve", "full")
    if args.host_pool_gb is not None or device_gb is not None or reserve != "full":
        if offload is None:
            raise ValueError("--host-pool-gb, --device-gb and --reserve prompt need --offload")
        if args.host_pool_gb is not None:
            pool["host_pool_bytes"] = int(args.host_pool_gb * 1e9)
        if device_gb is not None:
            if device_gb <= 0:
                raise ValueError(f"--device-gb must be > 0, got {device_gb}")
            pool["device_bytes"] = max(1, int(device_gb * 1e9))
        pool["reserve"] = reserve
    pool["prefix_cache"] = args.prefix_cache
    prefix_gb = getattr(args, "prefix_cache_gb", None)
    if prefix_gb is not None:
        if offload is not None or not args.prefix_cache:
            raise ValueError("--prefix-cache-gb sizes the resident prefix store: it needs "
                             "--prefix-cache without --offload (offloaded, cached prefixes "
                             "live in the host pool: --host-pool-gb)")
        if prefix_gb <= 0:
            raise ValueError(f"--prefix-cache-gb must be > 0, got {prefix_gb}")
        pool["prefix_cache_bytes"] = max(1, int(prefix_gb * 1e9))
    kwargs = dict(seats=args.seats, capacity=capacity, offload=offload,
                  decode_steps_per_call=args.decode_steps_per_call,
                  prefill_chunk=args.prefill_chunk, tokenizer=tokenizer,
                  order=getattr(args, "queue_order", "fifo"), num_drafts=num_drafts,
                  max_wait_steps=_max_wait_steps(args),
                  **pool, **({"drafter": "mtp", "mtp": mtp} if drafter == "mtp" else {}))
    if devices is None:
        return Engine(params, config, **kwargs), config, tokenizer, offload
    from fo_jax.engine.data_parallel import DataParallelEngine

    engine = DataParallelEngine(params, config, devices=devices,
                                placement=getattr(args, "placement", None), **kwargs)
    return engine, config, tokenizer, offload


def _max_wait_steps(args) -> int | None:
    """--max-wait-steps: steps, or None for -1 (no aging)."""
    steps = getattr(args, "max_wait_steps", 256)
    if steps is not None and steps < -1:
        raise ValueError(f"--max-wait-steps must be >= 0, or -1 for no aging; got {steps}")
    return None if steps == -1 else steps


def _devices(args):
    """The local devices of --devices (None without it), checked before the weights are
    read."""
    import jax

    count, rule = getattr(args, "devices", None), getattr(args, "placement", None)
    if count is None:
        if rule is not None:
            raise ValueError("--placement chooses among data-parallel ranks: add --devices N")
        return None
    local = jax.local_devices()
    if not 1 <= count <= len(local):
        raise ValueError(f"--devices {count} must be in [1, {len(local)}] (this process's "
                         "devices; on a CPU, simulate more with XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={max(count, 1)})")
    if rule == "least_misses" and not args.offload:
        raise ValueError("--placement least_misses needs --offload (the resident path copies "
                         "no misses)")
    if getattr(args, "metrics_jsonl", None):
        raise ValueError("--metrics-jsonl is not supported with --devices (one log per "
                         "engine)")
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
    sock = bind_socket(args.host, args.port)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args, sock: socket.socket) -> int:
    engine, config, tokenizer, offload = build_engine(args)
    capacity = engine.capacity
    if not args.no_warmup:
        t0 = time.perf_counter()
        warm_up(engine)
        print(f"fo-jax serve: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
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
           "build_engine", "build_served", "final_report", "make_server", "path_name", "run",
           "warm_up"]

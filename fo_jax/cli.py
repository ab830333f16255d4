"""The `fo-jax` command.

    fo-jax generate [--offload --hot-slots C [--policy ring] [--check]
                     [--devices N [--expert-parallel N [--expert-layout all-to-all]]]]
                    [--prompt TEXT] [--kv-format bf16|fp8_ds_mla]
                    [--model-dir DIR [--chat]] [--drafter ngram|mtp [--num-drafts D]] ...
    fo-jax plan (--model glm52 | --model-dir DIR) --context 128000 [--budget-gb 29]
                [--hot-slots 16384] [--kv-format bf16|fp8_ds_mla]
                [--devices 8 --device-gb 141 [--weight-format fp8|bf16]
                 [--expert-layout all-to-all]]
    fo-jax serve [--model-dir DIR] [--port 8000] [--seats N --offload ...]   (fo_jax.server)
                 [--kv-format bf16|fp8_ds_mla]
                 [--offload --pool-memory device --device-gb G --reserve prompt]
    fo-jax bench-serve [--offload --prefix-cache ...] [--requests 16 --rate 4 ...]
                       [--metrics-jsonl PATH --metrics-every 16]

`generate`, `serve` and `bench-serve` share one vocabulary (`fo_jax.flags`): the model flags
(`ModelArgs`: --model, --model-dir, --weights, --checkpoint-weights, --kv-format, --seed,
--max-param-gb, --no-progress) and the drafting flags (--drafter, --num-drafts).

`generate` runs the trained model that ships with the package by default (`trained-small`: a
4.4 M-parameter DSA model trained on the Python standard library's sources, with its BPE
tokenizer; no download). `--model-dir DIR` runs another model directory: a fo_jax one
(fo_jax.embedded: config.json with a "model" section) or a Hugging Face checkpoint of
DeepSeek-V3.2 / GLM-5 (config.json with "architectures", safetensors shards: fo_jax.checkpoints),
with its tokenizer, its EOS ids ending generation, and `--chat` to wrap the prompt in its chat
template as a user message. `--model tiny` (or `small`) runs a preset with random weights from
`--seed` and the byte tokenizer (tests), or with `--weights FILE`.
"""

from __future__ import annotations

import argparse
import sys

from fo_jax import flags
from fo_jax.flags import ModelArgs, add_drafting_args, drafting
from fo_jax.resolve import (check_param_memory, checkpoint_bytes, format_bytes,
                            model_dir_config, random_params, resolve_model, with_kv_format)

DEFAULT_PROMPT = (
    "import os\n\n\ndef read_lines(path):\n"
    "    \"\"\"Return the lines of the file at *path*.\"\"\"\n"
)
# The offload demo (`generate --offload` without --prompt): a real Python source the package
# ships, long enough that the hot cache holds a fraction of it (the embedded model's C = 512
# slots against ~3,000 tokens of context).
DEMO_SOURCE = "offload/manage.py"  # relative to the fo_jax package
DEMO_TOKENS = 3072


def printable(text: str) -> str:
    """Text for a terminal: control characters (but newlines) shown as U+FFFD."""
    return "".join(ch if ch == "\n" or ch.isprintable() else "\ufffd" for ch in text)


def demo_prompt(tokenizer, limit: int) -> tuple[list[int], str]:
    """The offload demo's prompt: (ids, text) of the first min(DEMO_TOKENS, limit) tokens of
    fo_jax's own `DEMO_SOURCE`, a file every install has."""
    import pathlib

    text = (pathlib.Path(__file__).parent / DEMO_SOURCE).read_text()
    ids = tokenizer.encode(text).tolist()[:max(1, min(DEMO_TOKENS, limit))]
    return ids, tokenizer.decode(ids)


def _build_parser() -> argparse.ArgumentParser:
    from fo_jax.config import KV_FORMATS
    from fo_jax.offload.config import HOST_ACCESS

    parser = argparse.ArgumentParser(prog="fo-jax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the embedded trained model "
                                          "(or a model directory, or a random preset)")
    ModelArgs.add_cli_args(gen, seed_help="sampling seed (and the random weights of a --model "
                                          "preset)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap --prompt as a user message in the checkpoint's chat template, "
                          "with the generation prompt")
    gen.add_argument("--prompt", default=None,
                     help="the prompt text (default: with --offload, the first ~3,000 tokens "
                          f"of fo_jax/{DEMO_SOURCE}, a context longer than the hot cache; "
                          "else a short function header)")
    gen.add_argument("--batch", type=int, default=1, help="copies of the prompt to run")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--offload", action="store_true",
                     help="decode with the KV in host memory (FlashOffloading)")
    gen.add_argument("--hot-slots", type=int, default=None,
                     help="with --offload: hot-cache slots per layer (default: top-k x max ways)")
    gen.add_argument("--page-size", type=int, default=16, help="host page / tail block tokens")
    gen.add_argument("--policy", default=None,
                     help="with --offload: eviction policy ring (default), lru, random or clock")
    gen.add_argument("--host-access", default=None, choices=HOST_ACCESS,
                     help="with --offload: how host pages are read and written (default: "
                          "ffi on a GPU with the CUDA host-copy library, else gather; see "
                          "fo_jax.offload.host)")
    gen.add_argument("--prefill-chunk", type=int, default=None,
                     help="prompt tokens per prefill call (default 2048: "
                          "fo_jax.generate.PREFILL_CHUNK)")
    add_drafting_args(gen)
    gen.add_argument("--decode-steps-per-call", type=int, default=1,
                     help="decode steps per compiled call, with sampling on the device (default "
                          "1: one step per call; the tokens are the same for any value)")
    gen.add_argument("--check", action="store_true",
                     help="with --offload: run the resident model side by side, and check "
                          "finiteness and the offload invariants after every step; exit 1 on "
                          "any difference or violation")
    gen.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                     help="decode kernels (default: pallas on TPU, xla elsewhere)")
    gen.add_argument("--interpret", action="store_true",
                     help="run the Pallas kernels in TPU interpret mode (slow; off TPU)")
    gen.add_argument("--devices", type=int, default=None,
                     help="with --offload: run data-parallel over this many devices (requests "
                          "split over them, one host pool per device; fo_jax.sharded_steps). On a "
                          "CPU, simulated devices need XLA_FLAGS=--xla_force_host_platform_"
                          "device_count=N")
    gen.add_argument("--expert-parallel", type=int, default=None, metavar="E",
                     help="with --devices: split the MoE experts over E devices (each holds "
                          "1/E of them); see --expert-layout")
    gen.add_argument("--expert-layout", default="all-to-all",
                     choices=("all-to-all", "replicated"),
                     help="with --expert-parallel: all-to-all (default; E = --devices: every "
                          "device runs attention for its own requests over its own host pool "
                          "and holds 1/E of the experts, rows exchanged by all-to-all) or "
                          "replicated (a data rank's requests and attention replicated over E "
                          "devices, expert rows joined by an all-reduce)")

    from fo_jax.server.serve import add_arguments as add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server over the "
                                                     "continuous-batching engine"))
    from fo_jax.server.serve import add_engine_arguments

    bench = sub.add_parser("bench-serve", help="a Poisson stream of requests through the engine, "
                                               "then its figures")
    add_engine_arguments(bench)
    bench.add_argument("--requests", type=int, default=16)
    bench.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    bench.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128], metavar=("LO", "HI"))
    bench.add_argument("--output-len", type=int, nargs=2, default=[16, 48], metavar=("LO", "HI"))
    bench.add_argument("--shared-prefix", type=float, default=0.0,
                       help="fraction of prompts that start with the same system prompt")
    bench.add_argument("--prefix-len", type=flags.non_negative_int, default=256)
    bench.add_argument("--out", type=flags.output_path, default=None,
                       help="append the figures as a JSON line here")
    bench.add_argument("--metrics-jsonl", type=flags.output_path, default=None, metavar="PATH",
                       help="append the engine's counters (per indexer group, bytes moved, "
                            "pool, queue, per-request TTFT / TPOT) as JSON lines here")
    bench.add_argument("--metrics-every", type=int, default=16,
                       help="engine steps between reads of the device counters")

    plan = sub.add_parser("plan", help="capacity planner for a model preset or directory")
    plan.add_argument("--model", default=None, help="a preset (default glm52)")
    plan.add_argument("--model-dir", default=None,
                      help="the config.json of a fo_jax model directory or a Hugging Face "
                           "checkpoint (weights counted from it)")
    plan.add_argument("--context", type=int, required=True, help="tokens per request")
    plan.add_argument("--budget-gb", type=float, default=29.0, help="device KV budget (GB)")
    plan.add_argument("--hot-slots", type=int, default=16384)
    plan.add_argument("--tail-block", type=int, default=64)
    plan.add_argument("--num-buffers", type=int, default=4, help="prefill layer buffers")
    plan.add_argument("--chunk", type=int, default=None, help="prefill chunk tokens")
    plan.add_argument("--kv-format", default=None, choices=KV_FORMATS,
                      help="how KV rows are stored (default: the config's, bf16 for presets)")
    plan.add_argument("--devices", type=int, default=None,
                      help="devices the weights split over: adds the weights per device (bf16 "
                           "and FP8) and both KV formats' bytes per request, and refuses a "
                           "setting that does not fit (with --device-gb)")
    plan.add_argument("--device-gb", type=float, default=None,
                      help="memory of one device (GB; 141 for an H200), with --devices")
    plan.add_argument("--weight-format", default=None, choices=("bf16", "fp8"),
                      help="the weights' format with --devices (default: fp8, or bf16 for a "
                           "--model-dir without FP8 weights)")
    plan.add_argument("--expert-layout", default=None, choices=("all-to-all",),
                      help="with --devices: also plan the all-to-all layout per device (attention "
                           "data-parallel on every device, the routed experts split over all of "
                           "them, every other weight replicated)")
    return parser


def _cmd_plan(args) -> int:
    from fo_jax.config import get_config
    from fo_jax.model.dsa import param_bytes
    from fo_jax.plan import (format_device_plan, format_expert_plan, format_plan,
                             plan_capacity, plan_devices, plan_expert_parallel)

    if args.model_dir is not None:
        if args.model is not None:
            raise ValueError("--model-dir brings its own config: drop --model")
        config, kind = model_dir_config(args.model_dir)
    else:
        config = get_config("glm52" if args.model is None else args.model)
    config = with_kv_format(config, args.kv_format)
    plan = plan_capacity(config, args.context, budget_gb=args.budget_gb,
                         hot_slots=args.hot_slots, tail_block=args.tail_block,
                         num_buffers=args.num_buffers, prefill_chunk=args.chunk)
    if (args.devices is None) != (args.device_gb is None):
        raise ValueError("--devices and --device-gb go together (the devices and the memory of "
                         "each)")
    if args.weight_format is not None and args.devices is None:
        raise ValueError("--weight-format applies with --devices and --device-gb")
    if args.expert_layout is not None and args.devices is None:
        raise ValueError("--expert-layout applies with --devices and --device-gb")
    block = None  # the FP8 block (rows, cols) of a Hugging Face checkpoint's weights
    if args.model_dir is not None and kind == "hf":
        from fo_jax.checkpoints import hf_quantization

        block = hf_quantization(args.model_dir)
    fp8_dir = block is not None
    device_plan = expert_plan = None
    if args.devices is not None:  # refuses a setting that does not fit, before printing
        default = "bf16" if args.model_dir is not None and not fp8_dir else "fp8"
        sizes = dict(devices=args.devices, device_gb=args.device_gb,
                     weights=args.weight_format or default, hot_slots=args.hot_slots,
                     tail_block=args.tail_block, num_buffers=args.num_buffers)
        device_plan = plan_devices(config, args.context, **sizes)
        if args.expert_layout is not None:
            expert_plan = plan_expert_parallel(config, args.context, **sizes)
    print(format_plan(plan))
    if args.model_dir is not None:  # a preset has no checkpoint of its own to count
        weights = param_bytes(config, fp8_block=block and (block[1], block[0]))
        held = (f"FP8 projections with {block[0]} x {block[1]} block scales" if fp8_dir
                else config.dtype)
        files = checkpoint_bytes(args.model_dir, kind)
        print(f"\nWeights (every parameter as fo_jax holds it; multi-token-prediction layers "
              f"not loaded)\n  weights:  {format_bytes(weights)} {held} (checkpoint files "
              f"{format_bytes(files)}; device memory for weights + KV budget: "
              f"{format_bytes(weights + plan.budget_bytes)})")
    if device_plan is not None:
        print("\n" + format_device_plan(device_plan))
    if expert_plan is not None:
        print("\n" + format_expert_plan(expert_plan))
    return 0


def _kv_bytes(config, batch: int, capacity: int) -> int:
    """Bytes of the KV rows and indexer keys of `batch` requests of `capacity` tokens (the
    resident state; the offloaded path holds as many in host memory), from the shapes alone:
    nothing is allocated."""
    import jax

    from fo_jax.resident import ResidentState

    shapes = jax.eval_shape(lambda: ResidentState.create(config, batch=batch, capacity=capacity))
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))


def _check_devices(args, drafter: str | None) -> None:
    """--devices N: the data-parallel offloaded engine's limits, before anything runs."""
    import jax

    if not args.offload:
        raise ValueError("--devices runs the offloaded path data-parallel: add --offload")
    if args.devices < 1 or args.devices > len(jax.devices()):
        raise ValueError(f"--devices {args.devices}: jax sees {len(jax.devices())} device(s); "
                         "on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         "before the command to simulate N")
    if args.batch % args.devices:
        raise ValueError(f"--batch {args.batch} must be a multiple of --devices {args.devices} "
                         "(each device runs batch / devices requests)")
    if drafter is not None:
        raise ValueError("--drafter does not run with --devices (the data-parallel engine runs "
                         "XLA steps, without drafts or checks)")
    for flag, off in (("check", False), ("implementation", None), ("interpret", False)):
        if getattr(args, flag) != off:
            raise ValueError(f"--{flag.replace('_', '-')} does not run with --devices (the "
                             "data-parallel engine runs XLA steps, without drafts or checks)")
    expert = args.expert_parallel
    if expert is None:
        return
    if expert < 1 or args.devices % expert:
        raise ValueError(f"--expert-parallel {expert} must divide --devices {args.devices}")
    if args.expert_layout == "all-to-all" and expert != args.devices:
        raise ValueError(f"--expert-parallel {expert} with --expert-layout all-to-all must "
                         f"equal --devices {args.devices} (every device holds its own "
                         "requests and 1/devices of the experts); use --expert-layout "
                         "replicated to split the experts over a part of the devices")


def _cmd_generate(args) -> int:
    import jax
    import numpy as np

    from fo_jax import generate as gen
    from fo_jax.kernels import resolve_implementation
    from fo_jax.offload.config import OffloadConfig, check_hot_slots, min_hot_slots
    from fo_jax.resident import ResidentState
    from fo_jax.sampling import check_sampling
    from fo_jax.tokenizer import ByteTokenizer
    from fo_jax.weights import load_params

    model_args = ModelArgs.from_cli_args(args)
    config, load, tokenizer = resolve_model(model_args)
    if args.chat and not hasattr(tokenizer, "apply_chat_template"):
        kind = "bytes" if tokenizer is None else tokenizer.kind
        raise ValueError(f"--chat: the {kind} tokenizer has no chat template; --chat needs a "
                         "Hugging Face checkpoint's tokenizer with one (--model-dir)")
    if tokenizer is None:
        tokenizer = ByteTokenizer()
        if config.vocab_size < 256:
            raise ValueError(f"the byte tokenizer needs vocab_size >= 256; {config.name!r} has "
                             f"{config.vocab_size}")
    for flag in ("batch", "page_size", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    check_sampling(args.temperature, args.top_p)
    drafter, num_drafts = drafting(args.drafter, args.num_drafts, config)
    _, num_drafts = gen.check_drafter(drafter, num_drafts or None, config)
    if drafter == "mtp":
        from fo_jax.checkpoints import load_checkpoint

        if load is not None and getattr(load, "func", None) is not load_checkpoint:
            raise ValueError("--drafter mtp needs the MTP layers of a Hugging Face checkpoint "
                             "(--model-dir of one with num_nextn_predict_layers >= 1)")
    gen.check_decode_steps_per_call(args.decode_steps_per_call)
    if drafter is not None and args.decode_steps_per_call > 1:
        raise ValueError(f"--drafter {drafter} verifies drafts step by step from the host: use "
                         "--decode-steps-per-call 1")
    if args.check and args.decode_steps_per_call > 1:
        raise ValueError("--check compares the logits of every step with the resident model's: "
                         "use --decode-steps-per-call 1")
    if args.devices is not None:
        _check_devices(args, drafter)
    elif args.expert_parallel is not None:
        raise ValueError("--expert-parallel splits the experts over --devices: add --devices")
    if not args.offload:
        for flag in ("policy", "hot_slots", "host_access", "check"):
            if getattr(args, flag) not in (None, False):
                name = "--" + flag.replace("_", "-")
                raise ValueError(
                    f"{name} applies to the offloaded path only: add --offload"
                    + (" (--check compares the offloaded path with the resident one)"
                       if flag == "check" else ""))
    policy = "ring" if args.policy is None else args.policy
    if args.hot_slots is not None:
        if args.hot_slots < 1:
            raise ValueError(f"--hot-slots must be >= 1, got {args.hot_slots}")
        check_hot_slots(args.hot_slots, config)  # before the page size is compared with it
    resolve_implementation(args.implementation, args.interpret)  # before anything runs
    prefill_chunk = gen.PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk
    gen.check_prefill_chunk(prefill_chunk)
    demo = args.prompt is None and args.offload and not args.chat
    prompt_text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if demo:  # leave room for the new tokens within max_seq_len, in whole pages
        room = config.max_seq_len - args.max_new_tokens - args.page_size
        prompt, prompt_text = demo_prompt(tokenizer, room)
    elif args.chat:
        if not prompt_text:
            raise ValueError("--prompt is empty: give at least one character")
        prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}],
                                                    add_generation_prompt=True)
        prompt = tokenizer.encode(prompt_text, add_special_tokens=False).tolist()
    else:
        prompt = tokenizer.encode(prompt_text).tolist()
    stop_tokens = tuple(getattr(tokenizer, "eos_ids", ()))
    if not prompt:
        raise ValueError("--prompt is empty: give at least one character")
    prompts = [prompt] * args.batch
    need = len(prompt) + args.max_new_tokens - 1
    page = args.page_size
    capacity = -(-need // page) * page  # host pages hold whole pages
    if capacity > config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + --max-new-tokens needs {capacity} "
                         f"positions in pages of {page}, beyond max_seq_len="
                         f"{config.max_seq_len} of {config.name!r}: shorten the prompt")
    offload = None
    if args.offload:
        hot = min_hot_slots(config) if args.hot_slots is None else args.hot_slots
        offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity,
                                policy=policy, host_access=args.host_access,
                                host_memory_kind="device" if args.interpret else "pinned_host")
        offload.validate_for(config)
    check_param_memory(config, model_args.max_param_gb,
                       state_bytes=_kv_bytes(config, args.batch, capacity),
                       state=f"the KV of --batch {args.batch} requests of {capacity} tokens")
    mtp = None
    if load is not None and drafter == "mtp":
        _, params, mtp = load(mtp=True)
    elif load is not None:
        params = load()[1]
    else:
        params = (load_params(model_args.weights, config) if model_args.weights
                  else random_params(config, model_args.seed))
        if drafter == "mtp":  # a preset's random weights: a random MTP layer too
            from fo_jax.model.mtp import init_mtp_params

            mtp = init_mtp_params(config, jax.random.key(model_args.seed + 1))
    if args.devices is not None:
        from fo_jax import sharded_steps, sharding

        if args.expert_parallel is None:
            mesh, rules = sharding.make_mesh(args.devices), None
        else:
            mesh, rules = sharding.expert_mesh(args.devices, expert=args.expert_parallel,
                                               layout=args.expert_layout)
        engine = sharded_steps.DataParallelOffloadEngine(
            sharding.shard_params(params, mesh, rules), config, mesh=mesh, offload=offload,
            batch=args.batch, prefill_chunk=prefill_chunk, rules=rules)
    elif args.offload:
        engine = gen.OffloadEngine(params, config, offload=offload, batch=args.batch,
                                   implementation=args.implementation, interpret=args.interpret,
                                   check=args.check, prefill_chunk=prefill_chunk, mtp=mtp)
    else:
        engine = gen.ResidentEngine(params, config, batch=args.batch, capacity=capacity,
                                    implementation=args.implementation, interpret=args.interpret,
                                    prefill_chunk=prefill_chunk, mtp=mtp)

    on_step = on_rollback = None
    if args.check:
        reference = gen.ResidentEngine(params, config, batch=args.batch, capacity=capacity,
                                       implementation=args.implementation,
                                       interpret=args.interpret, check=True,
                                       prefill_chunk=prefill_chunk)
        mismatch = []

        def on_step(step, fed, logits):
            before = reference.lengths.copy()
            ref = reference.step(fed, drop_past_capacity=num_drafts > 0)
            # Ways past capacity (drafts to be rolled back) have unspecified logits.
            stored = (before[:, None] + np.arange(fed.shape[1])[None, :] < capacity)[..., None]
            differ = np.asarray(ref != logits) & stored
            if not mismatch and differ.any():
                b, w, v = np.argwhere(differ)[0]
                mismatch.append(
                    f"step {step}: request {b}, position {before[b] + w}, logit {v}: "
                    f"offload {float(logits[b, w, v])!r} != resident {float(ref[b, w, v])!r}")

        def on_rollback(step, keep):
            reference.rollback(keep)

        tokens, lengths = gen.pad_prompts(prompts)
        reference.prefill(tokens, lengths)

    key = jax.random.key(args.seed)
    try:
        result = gen.generate(engine, prompts, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, key=key,
                              on_step=on_step, progress=not args.no_progress,
                              drafter=drafter, num_drafts=num_drafts or None,
                              on_rollback=on_rollback,
                              decode_steps_per_call=args.decode_steps_per_call,
                              stop_tokens=stop_tokens)
    except gen.StateCheckError as err:
        print(f"CHECK FAILED: {err}")
        return 1
    stopped = []
    for b in range(args.batch):
        tokens = np.asarray(result.tokens[b])
        hits = np.flatnonzero(np.isin(tokens, stop_tokens))
        if hits.size:  # the text ends before the first EOS id
            stopped.append(f"request {b} stopped at EOS id {int(tokens[hits[0]])} after "
                           f"{int(hits[0]) + 1} tokens")
            tokens = tokens[:hits[0]]
        print(f"--- request {b} ---")
        shown = prompt_text
        if demo:  # a few thousand tokens: show where the prompt ends
            shown = (f"[the prompt: the first {len(prompt)} tokens of fo_jax/{DEMO_SOURCE}, "
                     "ending with]\n" + prompt_text[-240:])
        print(printable(shown + tokenizer.decode(tokens)))
    print("--- summary ---")
    kv = "" if config.kv_format == "bf16" else f"   KV rows: {config.kv_format}"
    print(f"model: {config.name}   path: {engine.name}   batch: {args.batch}{kv}")
    print(f"generated: {result.tokens.size} tokens in {result.seconds:.2f} s "
          f"({result.tokens_per_second:.1f} tokens/s; prefill {result.prefill_seconds:.2f} s)")
    print(f"context length: {int(result.context_length.max())} tokens")
    for line in stopped:
        print(line)
    if num_drafts:
        extra = result.extra
        print(f"drafts: {extra['draft']}, {num_drafts} per step: "
              f"{extra['tokens_per_step']:.2f} tokens per step over {extra['verify_steps']} "
              f"steps (accepted {extra['accepted_drafts']} of {extra['proposed_drafts']} "
              "drafts)")
    resident_bytes = ResidentState.create(config, batch=args.batch,
                                          capacity=capacity).device_bytes()
    print(f"KV bytes on device: {format_bytes(result.device_kv_bytes)}"
          + (f"   (resident model: {format_bytes(resident_bytes)}, "
             f"{result.device_kv_bytes / resident_bytes:.2f}x)" if args.offload else ""))
    if args.offload:
        extra = result.extra
        rate = ("no decode step ran (--max-new-tokens 1)" if extra["hit_rate"] is None
                else f"hit rate {extra['hit_rate']:.3f}, misses {extra['misses']}")
        print(f"hot cache: {engine.offload.hot_slots} slots/layer, policy {policy}; {rate}")
        if engine.offload.hot_slots >= capacity:
            # C >= k W (every way's top-k at once) is the decode step's own rule, so a context
            # shorter than that is served from a hot cache larger than itself.
            print(f"(the hot cache holds the whole context of {capacity} positions: offload "
                  "saves device memory only for contexts longer than the hot cache)")
        print(f"bytes moved per token: H2D {format_bytes(extra['h2d_bytes_per_token'])}, "
              f"D2H {format_bytes(extra['d2h_bytes_per_token'])}; "
              f"host KV {format_bytes(extra['host_kv_bytes'])}")
    if args.check:
        if mismatch:
            print(f"CHECK FAILED: {mismatch[0]}")
            return 1
        steps = result.extra.get("verify_steps", result.tokens.shape[1] - 1)
        print(f"check: offloaded logits bitwise equal to the resident model's over "
              f"{steps} decode steps")
    return 0


def _cmd_bench_serve(args) -> int:
    """`fo-jax bench-serve`: the engine under a Poisson workload, then a summary."""
    import json

    from fo_jax.engine.bench import poisson_workload, run_workload, summary_lines
    from fo_jax.server.serve import build_engine, path_name

    if not 0 <= args.shared_prefix <= 1:
        raise ValueError(f"--shared-prefix {args.shared_prefix} must be a fraction in [0, 1]")
    workload = dict(rate=args.rate, prompt_len=tuple(args.prompt_len),
                    output_len=tuple(args.output_len), shared_fraction=args.shared_prefix,
                    prefix_len=args.prefix_len if args.shared_prefix else 0)
    poisson_workload(args.requests, vocab=1, **workload)  # bad flags: refused before loading
    if args.metrics_every < 1:
        raise ValueError(f"--metrics-every {args.metrics_every} must be >= 1 (engine steps "
                         "between reads of the device counters)")
    engine, config, _, offload = build_engine(args, metrics_jsonl=args.metrics_jsonl)
    requests = poisson_workload(args.requests, vocab=config.vocab_size, **workload)
    longest = max(len(p) for _, p, _ in requests)
    if longest > engine.capacity:
        raise ValueError(f"prompts of up to {longest} tokens do not fit seats of "
                         f"{engine.capacity} tokens: raise --capacity or lower --prompt-len / "
                         "--prefix-len")
    figures = run_workload(engine, requests, metrics_path=args.metrics_jsonl,
                           metrics_every=args.metrics_every)
    print(f"bench-serve: {config.name}, {path_name(offload)}, "
          f"{engine.seats} seats of {engine.capacity} tokens, {engine.n_steps} decode steps "
          "per call")
    for line in summary_lines(figures):
        print("  " + line)
    if args.metrics_jsonl:
        print(f"  metrics: {engine.metrics.records} records (JSON lines) in "
              f"{args.metrics_jsonl}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"model": config.name, "offload": offload is not None,
                                "pool_memory": None if offload is None
                                else offload.host_memory_kind,
                                "seats": engine.seats, "capacity": engine.capacity,
                                **figures}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "serve":
            from fo_jax.server.serve import run as serve

            return serve(args)
        if args.command == "bench-serve":
            return _cmd_bench_serve(args)
        return _cmd_generate(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"fo-jax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark tables of the README and the docs pages, generated from the results' JSON lines (not retyped).

A page holds each table between `<!-- results: NAME -->` and `<!-- /results -->`;
`python docs/results.py` rewrites them from the files, `python docs/results.py --check` fails
when a page differs from what its files give (tests/test_docs.py runs the check). Each table
says its machine, jax version, commit, the commit's date, its command and its file.
"""

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
H200 = "experiments/results/accelerator/h200/decode_bench.jsonl"
DP = "experiments/results/serving/dp_serving/dp_serving.jsonl"
DP_SHARDED = "experiments/results/serving/dp_serving/sharded.jsonl"
DP_SHARDED_8 = "experiments/results/serving/dp_serving/sharded_8.jsonl"
EXPERT_LAYOUTS = "experiments/results/parallel/expert_layouts/expert_layouts.jsonl"
RANKS = "experiments/results/traces/rank_imbalance/rank_imbalance.jsonl"
REPLAY = "experiments/results/traces/replay/replay.jsonl"
POISSON = "experiments/results/serving/poisson.jsonl"
LATENCY = "experiments/results/serving/latency.jsonl"
AUTO = "experiments/results/serving/auto_offload/auto_offload.jsonl"
ACCESS = "experiments/results/accelerator/h200/accelerator_check.jsonl"
ACCESS_PAGED = "experiments/results/accelerator/h200/session2/access_gather.run3.jsonl"
LOOP = "experiments/results/accelerator/h200/decode_loop_bench.jsonl"
CPU_LOOP = "experiments/results/decode/decode_loop/cpu_tiny.jsonl"
PREFIX = "experiments/results/serving/shared_prefix.jsonl"
PREFIX_RESIDENT = "experiments/results/serving/shared_prefix_resident.jsonl"
PAGED = {"experiments/results/serving/paged_device_1024.jsonl": "",  # the default lengths
         "experiments/results/serving/paged_device_4096.jsonl":
             " --prompt-len 64 256 --output-len 16 48"}
EMBEDDED = "fo_jax/assets/trained-small/config.json"
KV_FORMAT = "experiments/results/decode/kv_format/accuracy.jsonl"
TRAIN_LOG = "experiments/results/training/trained-small/log.jsonl"


def _rows(path: str, **match):
    rows = [json.loads(line) for line in (ROOT / path).read_text().splitlines() if line.strip()]
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _date(commit: str) -> str:
    try:
        run = subprocess.run(["git", "-C", str(ROOT), "show", "-s", "--format=%cs", commit],
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return "date unknown"
    return run.stdout.strip() or "date unknown"


def _source(rows, path: str, command: str) -> str:
    first = rows[0]
    machine = first["device"] if first["backend"] != "cpu" else "CPU"
    return (f"{machine}, jax {first['jax']}, commit {first['git']} ({_date(first['git'])}); "
            f"`{command}`; `{path}`.")


def h200_management() -> str:
    rows = _rows(H200, question="management")
    sizes = sorted({r["hot_slots"] for r in rows})
    head = " | ".join(f"C = {c // 1024}k" for c in sizes)
    out = [f"| policy | {head} |", "|---" * (len(sizes) + 1) + "|"]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        cells = []
        for c in sizes:
            r = next(r for r in rows if r["policy"] == policy and r["hot_slots"] == c)
            cells.append(f"{r['seconds'] * 1e3:.3f} ms, {r['ratio']:.2f}x "
                         f"[{r['ratio_q25']:.2f}-{r['ratio_q75']:.2f}]")
        out.append(f"| {policy} | " + " | ".join(cells) + " |")
    r = rows[0]
    note = (f"Management per step, median ms and median [IQR] ratio to C = {sizes[0] // 1024}k "
            f"(k = {r['k']}, W = {r['ways']}, batch {r['batch']}, {r['context'] // 1024}k "
            f"context, {r['misses_per_step']:.0f} misses per request per step, {r['rounds']} "
            f"rounds of {r['inner']} steps). ")
    command = ("python -m experiments.decode.decode_bench --what management --multiples 1 4 16 "
               "--rounds 7 "
               "--inner 10 --policies ring clock lru")
    return note + _source(rows, H200, command) + "\n\n" + "\n".join(out)


def h200_step() -> str:
    rows = _rows(H200, question="step")
    out = ["| policy | workload | offloaded / resident [IQR] | hit rate | resident ms | "
           "offloaded ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['policy']} | {r['workload']} | {r['ratio']:.2f} "
                   f"[{r['ratio_q25']:.2f}-{r['ratio_q75']:.2f}] | {r['hit_rate']:.2f} | "
                   f"{r['resident_s'] * 1e3:.2f} | {r['offload_s'] * 1e3:.2f} |")
    r = rows[0]
    note = (f"Whole decode step on `{r['model']}`, median of {r['steps']} paired steps (batch "
            f"{r['batch']}, {r['context'] // 1024}k context, C = {r['hot_slots']}, W = "
            f"{r['ways']}). ")
    command = ("python -m experiments.decode.decode_bench --what step --policy ring clock "
               "--batch 8 "
               "--context 32768 --steps 10 --warmup 10")
    return note + _source(rows, H200, command) + "\n\n" + "\n".join(out)


def dp_serving() -> str:
    rows = _rows(DP, question="dp_serving")
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    base = {r["seed"]: r for r in rows if r["rule"] == rules[0]}
    base_mean = statistics.mean(base[s]["spread"] for s in seeds)
    out = [f"| rule | largest / mean rank, per step ({len(seeds)} seeds) | mean | "
           f"vs {rules[0]} (mean) | tokens / s vs {rules[0]} |", "|---|---|---|---|---|"]
    for rule in rules:
        by_seed = {r["seed"]: r for r in rows if r["rule"] == rule}
        spreads = [by_seed[s]["spread"] for s in seeds]
        speed = [by_seed[s]["tokens_per_s"] / base[s]["tokens_per_s"] for s in seeds]
        out.append(f"| {rule} | " + ", ".join(f"{x:.2f}" for x in spreads)
                   + f" | {statistics.mean(spreads):.2f} | "
                   f"{statistics.mean(spreads) / base_mean:.2f}x | "
                   f"{statistics.mean(speed):.2f}x ({min(speed):.2f}-{max(speed):.2f}x) |")
    command = f"python -m experiments.serving.dp_serving --seeds {' '.join(map(str, seeds))}"
    return _source(rows, DP, command) + "\n\n" + "\n".join(out)


def dp_serving_sharded(path: str = DP_SHARDED) -> str:
    rows = _rows(path, question="dp_serving", engine="sharded")
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    base = {r["seed"]: r for r in rows if r["rule"] == rules[0]}
    base_mean = statistics.mean(base[s]["spread"] for s in seeds)
    out = [f"| rule | largest / mean rank, per step ({len(seeds)} seeds) | mean | "
           f"vs {rules[0]} (mean) | mean of the steps' largest / mean | rows per step, per "
           f"rank (mean of the seeds) |", "|---|---|---|---|---|---|"]
    for rule in rules:
        by_seed = {r["seed"]: r for r in rows if r["rule"] == rule}
        spreads = [by_seed[s]["spread"] for s in seeds]
        per_rank = [statistics.mean(col) for col in zip(*(by_seed[s]["rank_rows_per_step"]
                                                          for s in seeds))]
        out.append(f"| {rule} | " + ", ".join(f"{x:.2f}" for x in spreads)
                   + f" | {statistics.mean(spreads):.2f} | "
                   f"{statistics.mean(spreads) / base_mean:.2f}x | "
                   f"{statistics.mean(by_seed[s]['step_spread_mean'] for s in seeds):.2f} | "
                   + ", ".join(f"{x:.1f}" for x in per_rank) + " |")
    first = rows[0]
    scale = ("" if first["ranks"] == 4 else f" --ranks {first['ranks']} --rate "
             f"{first['rate']:g} --requests {first['requests']}")
    command = (f"python -m experiments.serving.dp_serving --engine sharded --model "
               f"{first['model']}{scale} --seeds {' '.join(map(str, seeds))} --out {path}")
    note = (f"ShardedEngine offloaded, {first['ranks']} ranks of {first['seats']} seats, "
            f"`{first['model']}`, {first['requests']} requests per seed at {first['rate']:g} "
            f"per step. ")
    return note + _source(rows, path, command) + "\n\n" + "\n".join(out)


def expert_layouts() -> str:
    rows = _rows(EXPERT_LAYOUTS, question="expert_layouts", smoke=False)
    out = ["| layout | expert bytes per device | step, median ms | tokens / s | vs replicated "
           "expert 8 | exchange alone, ms | exchange / step (estimate) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['layout_name']} | {r['expert_bytes_per_device'] / 2 ** 20:.0f} MiB "
                   f"of {r['expert_bytes_total'] / 2 ** 20:.0f} | {r['step_s'] * 1e3:.1f} | "
                   f"{r['tokens_per_s']:.0f} | {r['vs_baseline']:.2f}x | "
                   f"{r['exchange_s'] * 1e3:.2f} | {r['exchange_share']:.1%} |")
    r = rows[0]
    same = all(x["same_tokens_as_baseline"] for x in rows)
    note = (f"`{r['model']}` widened (dim {r['dim']}, {r['experts']} experts of hidden "
            f"{r['moe_hidden']}, {r['top']} per token, {r['moe_layers']} MoE layers of "
            f"{r['num_layers']}), offloaded decode step, {r['batch']} requests of "
            f"{r['context']} tokens (C = {r['hot_slots']}), {r['steps']} interleaved steps per "
            f"layout on {r['devices']} simulated CPU devices; greedy tokens "
            f"{'equal' if same else 'NOT equal'} across layouts. ")
    command = "python -m experiments.parallel.expert_layouts"
    return note + _source(rows, EXPERT_LAYOUTS, command) + "\n\n" + "\n".join(out)


def rank_imbalance() -> str:
    rows = _rows(RANKS, question="rank_imbalance")
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    cells = list(dict.fromkeys((r["mix"], r["load"]) for r in rows))
    out = ["| mix | load | misses / rank / step | max / mean: " + " | ".join(rules)
           + " | free moves | p99 (max - mean): round robin, least_misses |",
           "|---" * (len(rules) + 5) + "|"]
    for mix, load in cells:
        by_rule = {r["rule"]: r for r in rows if (r["mix"], r["load"]) == (mix, load)}
        base = by_rule[rules[0]]
        out.append(f"| {mix} | {load:.2f} | {base['misses_per_rank_step']:.1f} | "
                   + " | ".join(f"{by_rule[rule]['spread']:.2f}" for rule in rules)
                   + f" | {base['free_moves_spread']:.2f} | {base['excess_p99']:.0f}, "
                   f"{by_rule['least_misses']['excess_p99']:.0f} |")
    r = rows[0]
    note = (f"{r['ranks']} ranks of {r['seats']} seats, {r['steps']} steps ({r['warmup']} of "
            f"warm-up) x {len(r['seeds'])} seeds. ")
    command = "python -m experiments.traces.rank_imbalance"
    return note + _source(rows, RANKS, command) + "\n\n" + "\n".join(out)


def replay_8192() -> str:
    rows = [r for r in _rows(REPLAY, question="replay", ways=1)
            if r["meta"].get("context") == 8192 and not r.get("synthetic")]
    multiples = sorted({r["multiple"] for r in rows})
    names = {"belady": "belady (MIN)", "ring": "ring (default)"}
    policies = ["belady", "ring", "lru", "clock", "hisparse", "random", "score-mean",
                "score-ema", "score-max"]

    def cell(policy, multiple, text):
        found = [r for r in rows if r["policy"] == policy and r["multiple"] == multiple]
        return text(found[0]) if found else "-"

    def moved(r):
        mb = r["h2d_bytes_per_token"] / 2**20
        return f"{r['misses_per_request_group_step']:.1f}; {mb:.{1 if mb >= 0.1 else 2}f}"

    out = ["| policy | " + " | ".join(f"C = {m} k" for m in multiples) + " |",
           "|---" * (len(multiples) + 1) + "|"]
    for policy in policies:
        text = ((lambda r: f"{r['hit_rate']:.3f}") if policy == "belady" else
                (lambda r: f"{r['hit_rate']:.3f} ({r['ratio_to_belady']:.2f}x)"))
        out.append(f"| {names.get(policy, policy)} | "
                   + " | ".join(cell(policy, m, text) for m in multiples) + " |")
    for policy, label in (("ring", "ring: misses / request / group / step; H2D MB / token"),
                          ("belady", "belady: the same")):
        out.append(f"| {label} | " + " | ".join(cell(policy, m, moved) for m in multiples) + " |")
    r = rows[0]
    note = (f"Traces of {r['meta']['context']}-token windows: {r['steps']} steps each, context "
            f"{r['context']} at the first, k = {r['topk']}, {r['groups']} groups. ")
    command = "python -m experiments.traces.replay --trace ... --prefetch"
    return note + _source(rows, REPLAY, command) + "\n\n" + "\n".join(out)


def serving_budget() -> str:
    rows = _rows(POISSON, workload="poisson")
    out = ["| cell | seats | mean / peak running | tokens/s | TTFT p50 / p99 | TPOT p50 | "
           "programs per token | engine host work |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cell = "resident" if r["path"] == "resident" else "offloaded"
        out.append(f"| {cell}, N = {r['steps_per_call']} | {r['seats']} | "
                   f"{r['mean_running']:.2f} / {r['peak_running']} | {r['tokens_per_s']:.1f} "
                   f"({r['ratio']:.2f}x) | {r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} s | "
                   f"{r['tpot_p50'] * 1e3:.0f} ms | {r['programs_per_token']:.3f} | "
                   f"{r['host_share']:.1%} |")
    r = rows[0]
    command = (f"python -m experiments.serving.serving_bench --model {r['model']} "
               f"--capacity {r['capacity']} "
               f"--requests {r['requests']} --rate {r['rate']:g} --device-budget-mb "
               f"{r['device_budget_bytes'] // 10**6}")
    return _source(rows, POISSON, command) + "\n\n" + "\n".join(out)


def serving_latency() -> str:
    rows = _rows(LATENCY, experiment="serving_latency")
    out = ["| server | TTFT p50 / p99 | inter-token p50 / p99 | tokens/s |", "|---|---|---|---|"]
    for r in rows:
        n = r["decode_steps_per_call"]
        name = ("offloaded" if r["offload"] else "resident") + f", {n} step{'s' * (n > 1)} per call"
        out.append(f"| {name} | {r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f} ms | "
                   f"{r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.0f} ms | "
                   f"{r['tokens_per_second']:.0f} |")
    r = rows[0]
    command = (f"python -m experiments.serving.serving_latency --clients {r['clients']} "
               f"--seats {r['seats']} "
               f"--capacity {r['capacity']} --max-tokens {r['max_tokens']}")
    return _source(rows, LATENCY, command) + "\n\n" + "\n".join(out)


def auto_offload() -> str:
    rows = _rows(AUTO)
    short = next(r["short"] for r in rows if r.get("served"))
    out = ["| workload | cell | seats | peak running | tokens/s | vs auto | moves | H2D kB | "
           "same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("served"):
            out.append(f"| {r['workload']} | {r['cell']} | {r['seats']} | cannot hold these "
                       f"requests (prompt + output > {short} tokens) | | | | | |")
            continue
        out.append(f"| {r['workload']} | {r['cell']} | {r['seats']} | {r['peak_running']} | "
                   f"{r['tokens_per_s']:.1f} | {r['ratio_to_auto']:.2f} | {r['migrations']} | "
                   f"{r['h2d_bytes'] / 1e3:.1f} | {'yes' if r['same_tokens'] else 'no'} |")
    return (_source(rows, AUTO, "python -m experiments.serving.auto_offload_bench") + "\n\n"
            + "\n".join(out))


def h200_host_access() -> str:
    first = [r for r in _rows(ACCESS) if "gb_per_s" in r]
    paged = [r for r in _rows(ACCESS_PAGED) if "gb_per_s" in r]
    out = ["| run | access | setting | direction | MB moved | GB/s | bulk `device_put` GB/s | "
           "host-compute ops | bitwise |", "|---|---|---|---|---|---|---|---|---|"]
    for r in first + paged:
        out.append(f"| {r['git']} | {r['check']} | {r['host_access']} | {r['direction']} | "
                   f"{r['moved_bytes'] / 1e6:.1f} | {r['gb_per_s']:.2f} | "
                   f"{r['bulk_gb_per_s']:.1f} | {r['host_compute_ops']} | "
                   f"{'yes' if r['bitwise'] else 'no'} |")
    note = ("Each host access at real row size (576 bf16 values), against one bulk "
            "`jax.device_put` of the same bytes in the same run; host-compute ops are those XLA "
            "left in the compiled program. The first run: "
            + _source(first, ACCESS, "python -m experiments.accelerator.accelerator_check")
            + " The second (the `access_gather` part of `device_run.sh`), after the page pools (`load_history` reads pages through the page "
            "table), \"gather\" only: "
            + _source(paged, ACCESS_PAGED, "python -m experiments.accelerator.accelerator_check "
                      "--access gather --checks access"))
    return note + "\n\n" + "\n".join(out)


def _decode_loop(path: str) -> str:
    rows = _rows(path, question="decode_loop")
    out = ["| cell | steps per call | tokens/s | ratio to the Python loop [IQR] | programs per "
           "token |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['cell']} | {r['steps_per_call']} | {r['tokens_per_second']:.0f} | "
                   f"{r['ratio']:.2f} [{r['ratio_q25']:.2f}-{r['ratio_q75']:.2f}] | "
                   f"{r['dispatches_per_token']:.4g} |")
    r = rows[0]
    note = (f"Decode loop on `{r['model']}`, {r['path']}, batch {r['batch']}, "
            f"{r['context']} tokens of context, {r['tokens']} new tokens per request per round, "
            f"temperature {r['temperature']:g}, median [IQR] of {r['rounds']} interleaved rounds "
            "(`python`: a Python loop of single decode steps; `loop N`: N steps per compiled "
            "call). ")
    command = (f"python -m experiments.decode.decode_loop_bench --model {r['model']} --batch "
               f"{r['batch']} --context {r['context']}")
    return note + _source(rows, path, command) + "\n\n" + "\n".join(out)


def h200_decode_loop() -> str:
    return _decode_loop(LOOP)


def cpu_decode_loop() -> str:
    return _decode_loop(CPU_LOOP)


def _serving_cells(rows, label):
    out = []
    for r in rows:
        out.append(f"| {label(r)} | {r['seats']} | {r['cached_tokens']:,} | "
                   f"{r['prefill_tokens']:,} | {r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} s | "
                   f"{r['tokens_per_s']:.1f} | {r['output_tokens']} |")
    return out


def prefix_reuse() -> str:
    head = ["| cell | seats | prompt tokens from the cache | tokens prefilled | TTFT p50 / p99 | "
            "tokens/s | output tokens |", "|---|---|---|---|---|---|---|"]
    offload, resident = _rows(PREFIX), _rows(PREFIX_RESIDENT)
    out = head + _serving_cells(
        offload, lambda r: f"{r['path']}, prefix {r['prefix_len']}, "
                           f"{'prefix cache' if r['prefix_cache'] else 'no prefix cache'}")
    out += _serving_cells(
        resident, lambda r: f"{r['path']}, prefix {r['prefix_len']}, "
                            f"{'prefix store' if r['prefix_cache'] else 'no prefix store'}")
    o, s = offload[0], resident[0]
    note = (f"{o['shared_fraction']:.0%} of the prompts start with the same prefix. Offloaded: "
            f"{o['requests']} requests, N = {o['steps_per_call']}; "
            + _source(offload, PREFIX, "python -m experiments.serving.serving_bench --model "
                      "small --workloads shared_prefix")
            + f" Resident (the prefix store copies rows): {s['requests']} requests, N = "
            f"{s['steps_per_call']}; "
            + _source(resident, PREFIX_RESIDENT, "python -m experiments.serving.serving_bench "
                      "--prefix-paths resident --model small --capacity 1024 --requests 12 "
                      "--rate 2 --prompt-len 32 96 --output-len 8 16 --prefix-len 512 "
                      "--prefill-chunk 128 --steps-per-call 4 --max-seats 4"))
    return note + "\n\n" + "\n".join(out)


def paged_device() -> str:
    out = ["| capacity | device budget | cell | seats | peak / mean running | tokens/s | vs "
           "resident | output tokens |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for path in PAGED:
        rows = _rows(path)
        for r in rows:
            out.append(f"| {r['capacity']} | {r['device_budget_bytes'] / 1e6:.0f} MB | "
                       f"{r['path']} | {r['seats']} | {r['peak_running']} / "
                       f"{r['mean_running']:.1f} | {r['tokens_per_s']:.1f} | "
                       f"{r['ratio']:.2f}x | {r['output_tokens']} |")
        r = rows[0]
        command = (f"python -m experiments.serving.serving_bench --model {r['model']} "
                   f"--capacity {r['capacity']} --requests {r['requests']} --rate "
                   f"{r['rate']:g} --device-budget-mb {r['device_budget_bytes'] // 10**6}"
                   f"{PAGED[path]} --workloads poisson --steps-per-call 16")
        notes.append(f"Capacity {r['capacity']}: " + _source(rows, path, command))
    return " ".join(notes) + "\n\n" + "\n".join(out)


def embedded_model() -> str:
    trained = json.loads((ROOT / EMBEDDED).read_text())["trained"]
    bpb = trained["held_out_bits_per_byte"]
    names = [("dense_at_512_float32", "dense model (after stage 1), on 512-token windows"),
             ("dense_float32", "dense model"),
             ("dense_run_sparse_float32", "dense model run with top-k attention"),
             ("sparse_float32", "sparse model (after stage 2), float32"),
             ("sparse", "sparse model, bf16 as shipped"),
             ("sparse_run_dense", "sparse model, bf16, run with dense attention")]
    out = [f"| held-out, {trained['eval_windows']} windows of {trained['eval_seq_len']} tokens "
           "(bits per byte) | |", "|---|---|"]
    out += [f"| {label} | {bpb[name]:.3f} |" for name, label in names if name in bpb]
    run = _rows(TRAIN_LOG)[0]
    note = (f"From the embedded model's own record (`{EMBEDDED}`, \"trained\"), written by "
            "`experiments/training/export_model.py` when the weights were exported: it "
            "holds no jax version or commit. The training run it evaluates: "
            + _source([run], TRAIN_LOG, "python -m experiments.training.train --out-dir runs/bpe "
                      f"--dense-steps {trained['train']['dense_steps']} --sparse-steps "
                      f"{trained['train']['sparse_steps']} --batch {trained['train']['batch']} "
                      "--max-minutes 62"))
    return note + "\n\n" + "\n".join(out)


def kv_format_accuracy() -> str:
    held = _rows(KV_FORMAT, question="held_out")
    cmp = _rows(KV_FORMAT, question="fp8_vs_bf16")[0]
    out = ["| KV format | bytes per row | held-out bits per byte |", "|---|---|---|"]
    out += [f"| {r['kv_format']} | {r['row_bytes']} | {r['bits_per_byte']:.4f} |" for r in held]
    first = cmp["greedy_first_difference"]
    same = sum(d == cmp["gen"] for d in first)
    differ = "; ".join(f"window {i + 1} from its token {d + 1} on" for i, d in enumerate(first)
                       if d != cmp["gen"])
    out.append(f"| fp8_ds_mla against bf16 | | {cmp['bits_per_byte_delta']:+.4f}; the same "
               f"argmax at {cmp['top1_agreement']:.1%} of positions; {cmp['gen']} greedy tokens "
               f"after each window identical in {same} of {len(first)} windows"
               + (f" ({differ})" if differ else "") + " |")
    r = held[0]
    note = (f"The embedded model (`{r['model']}`), {r['docs']} held-out windows of "
            f"{r['context']:,} tokens, resident prefill in chunks of {r['chunk']}. "
            + _source(held, KV_FORMAT, "python -m experiments.decode.kv_format_accuracy"))
    return note + "\n\n" + "\n".join(out)


def _link(path: str) -> str:
    return f"[{path.rsplit('/', 1)[-1]}]({path})"


def key_results() -> str:
    """The README's key results: one row per figure, each from its results file."""
    mgmt = {(r["policy"], r["hot_slots"]): r for r in _rows(H200, question="management")}
    sizes = sorted({c for _, c in mgmt})
    ring = " / ".join(f"{mgmt['ring', c]['seconds'] * 1e3:.3f}" for c in sizes)
    lru = " / ".join(f"{mgmt['lru', c]['seconds'] * 1e3:.3f}" for c in sizes)
    step = next(r for r in _rows(H200, question="step")
                if r["policy"] == "ring" and r["workload"] == "locality")
    budget = {(r["path"], r["steps_per_call"]): r for r in _rows(POISSON, workload="poisson")}
    res, off = budget["resident", 1], budget["offload", 1]
    prefix = {r["prefix_cache"]: r for r in _rows(PREFIX)}
    latency = next(r for r in _rows(LATENCY, experiment="serving_latency") if r["offload"])
    replay = {r["policy"]: r for r in _rows(REPLAY, question="replay", ways=1)
              if r["meta"].get("context") == 8192 and not r.get("synthetic")
              and r["multiple"] == 8}
    dp = [r for r in _rows(DP, question="dp_serving")]
    spread = {rule: statistics.mean(r["spread"] for r in dp if r["rule"] == rule)
              for rule in dict.fromkeys(r["rule"] for r in dp)}
    trained = json.loads((ROOT / EMBEDDED).read_text())["trained"]
    seeds = " ".join(str(s) for s in sorted({r["seed"] for r in dp}))
    h200, cpu = "NVIDIA H200, jax 0.11.2", "2-core CPU"
    rows = [
        ("offloaded decode step equal to resident, bit for bit (every test configuration; 15 "
         "steps after a real prompt on the GPU)", "2-core CPU; NVIDIA H200, jax 0.11.2",
         "fo-jax generate --offload --check",
         _link("experiments/results/accelerator/h200/device_run.log")),
        (f"management per step flat in C: ring {ring} ms at C = "
         + " / ".join(f"{c // 1024}k" for c in sizes) + f" (LRU {lru})", h200,
         "python -m experiments.decode.decode_bench --what management", _link(H200)),
        (f"whole decode step on `{step['model']}`, {step['context'] // 1024}k context: "
         f"offloaded / resident {step['ratio']:.2f}x (hit rate {step['hit_rate']:.2f})", h200,
         f"python -m experiments.decode.decode_bench --what step --batch {step['batch']} "
         f"--context {step['context']}", _link(H200)),
        (f"serving at one {res['device_budget_bytes'] // 10**6} MB device budget: offloaded holds "
         f"{off['mean_running'] / res['mean_running']:.1f}x the concurrent requests of resident, "
         f"{off['tokens_per_s'] / res['tokens_per_s']:.2f}x the tokens/s", cpu,
         f"python -m experiments.serving.serving_bench --model {res['model']} --capacity "
         f"{res['capacity']} --device-budget-mb {res['device_budget_bytes'] // 10**6}",
         _link(POISSON)),
        (f"prefix cache, {prefix[True]['shared_fraction']:.0%} shared "
         f"{prefix[True]['prefix_len']}-token prefix: {prefix[True]['prefill_tokens']:,} tokens "
         f"prefilled instead of {prefix[False]['prefill_tokens']:,}, TTFT p50 "
         f"{prefix[True]['ttft_p50']:.1f} s instead of {prefix[False]['ttft_p50']:.1f} s", cpu,
         "python -m experiments.serving.serving_bench --workloads shared_prefix", _link(PREFIX)),
        (f"`fo-jax serve`, {latency['clients']} streaming clients: TTFT p50 "
         f"{latency['ttft_p50'] * 1e3:.0f} ms, inter-token p50 {latency['itl_p50'] * 1e3:.1f} ms, "
         f"{latency['tokens_per_second']:.0f} tokens/s offloaded", cpu,
         f"python -m experiments.serving.serving_latency --clients {latency['clients']} --seats "
         f"{latency['seats']} --capacity {latency['capacity']} --max-tokens "
         f"{latency['max_tokens']}", _link(LATENCY)),
        (f"hot-cache hit rate on real traces, 8192-token documents, C = 8k: ring "
         f"{replay['ring']['hit_rate']:.3f}, LRU {replay['lru']['hit_rate']:.3f}, Belady's MIN "
         f"{replay['belady']['hit_rate']:.3f}", cpu,
         "python -m experiments.traces.replay --trace ... --prefetch", _link(REPLAY)),
        (f"placement over {dp[0]['ranks']} data-parallel ranks: least_misses takes the busiest "
         f"rank's load over the mean to {spread['least_misses'] / spread['round_robin']:.2f}x "
         "round robin's", f"{cpu}, {dp[0]['ranks']} simulated devices",
         f"python -m experiments.serving.dp_serving --seeds {seeds}", _link(DP)),
        (f"the embedded model: {trained['held_out_bits_per_byte']['sparse']:.3f} bits per byte "
         "held-out (bf16, top-k 128 attention)", f"{cpu}, 62 minutes",
         "python -m experiments.training.train --out-dir runs/bpe --dense-steps "
         f"{trained['train']['dense_steps']} --sparse-steps {trained['train']['sparse_steps']}",
         f"{_link(EMBEDDED)} (\"trained\"), {_link(TRAIN_LOG)}"),
    ]
    out = ["| figure | machine | command | results |", "|---|---|---|---|"]
    out += [f"| {figure} | {machine} | `{command}` | {link} |"
            for figure, machine, command, link in rows]
    note = ("Ratios are to a baseline measured in the same run. Every figure with its command, "
            "date and context: [benchmarks](docs/benchmarks/index.md); this table is generated "
            "from the results files by `python docs/results.py`.")
    return note + "\n\n" + "\n".join(out)


def _planner():
    """(get_config, the module fo_jax.plan), imported from this checkout."""
    sys.path.insert(0, str(ROOT))
    try:
        from fo_jax import plan
        from fo_jax.config import get_config
    finally:
        sys.path.remove(str(ROOT))
    return get_config, plan


def gb(n) -> str:
    return f"{n / 1e9:.1f} GB"


def real_sizes() -> str:
    """The planner's figures for the real models (no results file: computed from the code)."""
    get_config, planner = _planner()
    context, devices, device_gb, hot = 131_072, 8, 141, 16_384

    out = ["| model | weights bf16 / FP8 (per device) | KV format | resident request | "
           "offloaded request: device + host | batch per device, FP8 weights: resident / "
           "offloaded |", "|---|---|---|---|---|---|"]
    for name in ("deepseek_v32", "glm5", "glm52"):
        for fmt in planner.KV_FORMATS:
            plan = planner.plan_devices(get_config(name).replace(kv_format=fmt), context,
                                        devices=devices, device_gb=device_gb, hot_slots=hot)
            w, d, kv = plan.weight_bytes, plan.weights_per_device, plan.kv[fmt]
            out.append(f"| {name} | {gb(w['bf16'])} / {gb(w['fp8'])} ({gb(d['bf16'])} / "
                       f"{gb(d['fp8'])}) | {fmt} | {gb(kv.resident_bytes)} | "
                       f"{gb(kv.offload_device_bytes)} + {gb(kv.host_bytes)} | "
                       f"{plan.max_batch_resident} / {plan.max_batch_offload} |")
    note = (f"From the planner (`fo_jax.plan.plan_devices`; `fo-jax plan --model NAME --context "
            f"{context} --devices {devices} --device-gb {device_gb} --kv-format FORMAT`), every "
            "figure checked to the byte against `jax.eval_shape` of the parameters and states it "
            f"counts (tests/test_plan_real_sizes.py). {devices} devices of {device_gb} GB (an "
            "H200), the weights split evenly over them (FP8: the projections in e4m3 with 128 x "
            f"128 block scales); one request of {context:,} tokens, C = {hot:,} hot slots, tail "
            "blocks 2 x 64. bf16 weights (more than a device) leave no room: the planner refuses "
            "them, naming the devices they need.")
    return note + "\n\n" + "\n".join(out)


def real_sizes_all_to_all() -> str:
    """The planner's per-device figures for the all-to-all layout (computed from the code)."""
    get_config, planner = _planner()
    context, devices, device_gb, hot = 131_072, 8, 141, 16_384

    out = ["| model | KV format | weights per device: replicated + experts / 8 | KV per device "
           "| request: resident / offloaded device + host | batch per device: resident / "
           "offloaded (host per device) | longest context: resident / offloaded |",
           "|---|---|---|---|---|---|---|"]
    for name in ("deepseek_v32", "glm52"):
        for fmt in planner.KV_FORMATS:
            p = planner.plan_expert_parallel(get_config(name).replace(kv_format=fmt), context,
                                             devices=devices, device_gb=device_gb,
                                             hot_slots=hot)
            out.append(f"| {name} | {fmt} | {gb(p.weights_per_device)}: "
                       f"{gb(p.replicated_bytes)} + {gb(p.expert_bytes)} / {devices} | "
                       f"{gb(p.kv_budget_bytes)} | {gb(p.resident_request_bytes)} / "
                       f"{gb(p.offload_request_bytes)} + {gb(p.host_request_bytes)} | "
                       f"{p.max_batch_resident} / {p.max_batch_offload} "
                       f"({gb(p.host_bytes_offload)}) | {p.max_context_resident:,} / "
                       f"{p.max_context_offload:,} |")
    note = (f"From the planner (`fo_jax.plan.plan_expert_parallel`; `fo-jax plan --model NAME "
            f"--context {context} --devices {devices} --device-gb {device_gb} --kv-format "
            "FORMAT --expert-layout all-to-all`), per device, checked against `jax.eval_shape` "
            "of the FP8 parameters and the states placed by the all-to-all rules on one device "
            f"of {devices} (tests/test_plan_real_sizes.py). {devices} devices of {device_gb} GB, "
            "FP8 weights: the routed experts split over the devices, every other weight "
            f"(attention, indexers, router, shared and dense MLPs, embedding, head) on each; "
            f"requests of {context:,} tokens, C = {hot:,} hot slots; a batch counts each "
            "request's decode token's all-to-all buffers too; the longest context is that of "
            "one request, at most the model's max_seq_len. bf16 weights (199.4 GB per device "
            "for deepseek_v32) are refused, naming the 16 devices they need.")
    return note + "\n\n" + "\n".join(out)


TABLES = {"h200_management": h200_management, "h200_step": h200_step,
          "dp_serving": dp_serving, "dp_serving_sharded": dp_serving_sharded,
          "dp_serving_sharded_8": lambda: dp_serving_sharded(DP_SHARDED_8),
          "expert_layouts": expert_layouts,
          "rank_imbalance": rank_imbalance,
          "replay_8192": replay_8192, "serving_budget": serving_budget,
          "serving_latency": serving_latency, "auto_offload": auto_offload,
          "h200_host_access": h200_host_access, "h200_decode_loop": h200_decode_loop,
          "cpu_decode_loop": cpu_decode_loop,
          "prefix_reuse": prefix_reuse, "paged_device": paged_device,
          "embedded_model": embedded_model, "key_results": key_results,
          "kv_format_accuracy": kv_format_accuracy, "real_sizes": real_sizes,
          "real_sizes_all_to_all": real_sizes_all_to_all}
BLOCK = re.compile(r"^( *)(<!-- results: (\w+) -->\n)((?:(?!<!-- results: ).)*?)( *<!-- /results -->)",
                   re.S | re.M)


def render(text: str) -> str:
    """Return `text` with every results block regenerated."""
    def sub(match):
        indent, name = match.group(1), match.group(3)
        if name not in TABLES:
            raise KeyError(f"no results table named {name!r} (known: {sorted(TABLES)})")
        note, table = TABLES[name]().split("\n\n")
        note = textwrap.fill(note, 96 - len(indent), break_long_words=False,
                             break_on_hyphens=False)
        body = "\n".join(indent + line for line in (note + "\n\n" + table).split("\n"))
        body = re.sub(r"^ +$", "", body, flags=re.M)
        return indent + match.group(2) + "\n" + body + "\n\n" + match.group(5)
    return BLOCK.sub(sub, text)


def _undated(text: str) -> str:
    """`text` without the commits' dates (a shallow clone cannot date a commit)."""
    return re.sub(r"\((\d{4}-\d{2}-\d{2}|date unknown)\)", "(date)", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report pages that differ")
    args = parser.parse_args(argv)
    stale = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        new = render(text)
        if _undated(new) != _undated(text) or (new != text and not args.check):
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("results tables out of date (run python docs/results.py):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

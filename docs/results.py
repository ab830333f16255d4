"""Benchmark tables of the docs pages, generated from the results' JSON lines (not retyped).

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
RANKS = "experiments/results/traces/rank_imbalance/rank_imbalance.jsonl"
REPLAY = "experiments/results/traces/replay/replay.jsonl"
POISSON = "experiments/results/serving/poisson.jsonl"
LATENCY = "experiments/results/serving/latency.jsonl"
AUTO = "experiments/results/serving/auto_offload/auto_offload.jsonl"


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


def real_sizes() -> str:
    """The planner's figures for the real models (no results file: computed from the code)."""
    sys.path.insert(0, str(ROOT))
    try:
        from fo_jax.config import get_config
        from fo_jax.plan import KV_FORMATS, plan_devices
    finally:
        sys.path.remove(str(ROOT))
    context, devices, device_gb, hot = 131_072, 8, 141, 16_384

    def gb(n):
        return f"{n / 1e9:.1f} GB"

    out = ["| model | weights bf16 / FP8 (per device) | KV format | resident request | "
           "offloaded request: device + host | batch per device, FP8 weights: resident / "
           "offloaded |", "|---|---|---|---|---|---|"]
    for name in ("deepseek_v32", "glm5", "glm52"):
        for fmt in KV_FORMATS:
            plan = plan_devices(get_config(name).replace(kv_format=fmt), context,
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


TABLES = {"h200_management": h200_management, "h200_step": h200_step,
          "dp_serving": dp_serving, "rank_imbalance": rank_imbalance,
          "replay_8192": replay_8192, "serving_budget": serving_budget,
          "serving_latency": serving_latency, "auto_offload": auto_offload,
          "real_sizes": real_sizes}
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
    for page in sorted((ROOT / "docs").rglob("*.md")):
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

"""The accelerator run's verdict: each target of the FFI host copies, PASS / FAIL / MISSING,
read from the JSON lines `experiments/accelerator/device_run.sh` leaves in its output folder.

Targets (TARGETS below; the figures of an H200 run, against baselines of the same run):

  library       the CUDA host-copy library found and registered, every copy target exact
  bitwise       decode steps, a prefill chunk on a history, every prefill_diagnosis variant
                and the serving engine's tokens: offloaded (host_access="ffi") == resident
  hlo           the ffi decode step and prefill: no op marked as host compute, no copy (or
                other write) of a whole pool, no host-memory fault in the CUDA lowering
  access        every ffi access cell >= 0.6 x `read_bulk` of the same bytes (the copy engine);
                decode misses and write-through >= 20 GB/s at the largest row count measured
  decode        offloaded / resident decode step on `small`, batch 8: <= 1.10 with the locality
                workload, <= 1.25 uniform (other batches printed for the record)
  serving       TPOT p50 offloaded / resident <= 1.2 at saturation (closed loop), each N
  overlap       (the named part serving_overlap, judged only when it ran) host share <= 0.05
                with the engine's overlap at one step per call, each path; without overlap
                printed beside it

A target whose figures are not in the folder (its part did not run, or was cut short) is
MISSING, never PASS. On a CPU (the smoke run) the figures mean nothing: the verdicts only show
that every part wrote what this script reads.

    python -m experiments.accelerator.device_summary --dir results/device
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The part -> file names of experiments/accelerator/device_run.sh.
FILES = {"library": "ffi_library.jsonl", "checks": "ffi_checks.jsonl",
         "prefill": "prefill_exact.jsonl", "engine": "engine_exact.jsonl",
         "access": "access_rates.jsonl", "gather": "access_gather.jsonl",
         "decode": "decode_ratio.jsonl",
         "serving": "serving_saturation.jsonl", "overlap": "serving_overlap.jsonl"}
MIN_RATIO_TO_READ_BULK = 0.6
MIN_GB_PER_S = 20.0  # decode misses and write-through
MAX_DECODE_RATIO = {"locality": 1.10, "uniform": 1.25}
DECODE_BATCH = 8
MAX_TPOT_RATIO = 1.2
MAX_HOST_SHARE = 0.05  # with overlap, one decode step per call


def read_rows(folder: str) -> dict[str, list[dict]]:
    """{part: its JSON lines} of every file in FILES found in `folder` (missing: [])."""
    rows = {}
    for part, name in FILES.items():
        path = os.path.join(folder, name)
        rows[part] = []
        if os.path.exists(path):
            with open(path) as f:
                rows[part] = [json.loads(line) for line in f if line.strip()]
    return rows


def _verdict(ok: bool | None, text: str) -> tuple[str, str]:
    return ("MISSING" if ok is None else "PASS" if ok else "FAIL"), text


def verdicts(rows: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """[(PASS / FAIL / MISSING, what and the figures)] for every target, in order."""
    out = []
    lib = rows["library"][-1:] or [None]
    lib = lib[0]
    if lib is None:
        out.append(_verdict(None, "host-copy library registered, every copy exact"))
    else:
        exact = lib.get("exact") or {}
        out.append(_verdict(lib["registered"] and bool(exact) and all(exact.values()),
                            f"host-copy library registered, every copy exact: "
                            f"{lib.get('library') or lib.get('error')}; {exact}"))
    out += _bitwise(rows)
    out += _hlo(rows["checks"])
    out += _access(rows["access"] + rows["gather"])
    out += _decode(rows["decode"])
    out += _serving(rows["serving"])
    out += _overlap(rows.get("overlap", []))
    return out


def _bitwise(rows) -> list[tuple[str, str]]:
    out = []
    for check, what in (("decode_step", "decode steps"), ("prefill_chunk", "a prefill chunk")):
        got = [r for r in rows["checks"] if r["check"] == check and r["host_access"] == "ffi"]
        ok = None if not got else all(r.get("bitwise") is True for r in got)
        detail = "; ".join(f"{r['status']}" + (f" ({r['error'][:120]})" if "error" in r else "")
                           for r in got)
        out.append(_verdict(ok, f"{what} offloaded (ffi) == resident, bit for bit: {detail}"))
    variants = rows["prefill"]
    differ = [r["variant"] for r in variants if not (r["logits_equal"] and r["kv_equal"])]
    out.append(_verdict(None if not variants else not differ,
                        f"prefill_diagnosis: every variant exact ({len(variants) - len(differ)}"
                        f" of {len(variants)}" + (f"; differ: {', '.join(differ)}" if differ
                                                  else "") + ")"))
    engine = rows["engine"][-1:]
    out.append(_verdict(None if not engine else bool(engine[0]["equal"]),
                        "engine tokens offloaded == resident" + (
                            f" (host_access {engine[0].get('host_access')}, {engine[0]['tokens']}"
                            f" tokens, parted at {engine[0]['parted_at'] or 'none'})"
                            if engine else "")))
    return out


def _hlo(rows) -> list[tuple[str, str]]:
    out = []
    for check, what in (("hlo_decode_step", "decode step"), ("hlo_prefill", "prefill")):
        got = [r for r in rows if r["check"] == check and r["host_access"] == "ffi"]
        if not got or "pool_copies" not in got[-1]:
            why = f": {got[-1]['status']} {got[-1].get('error', '')[:120]}" if got else ""
            out.append(_verdict(None, f"ffi {what}: no host compute, no pool copy, no host "
                                      f"memory fault{why}"))
            continue
        r = got[-1]
        ok = not (r["host_compute_ops"] or r["pool_writes"] or r["host_memory_faults"])
        out.append(_verdict(ok, f"ffi {what}: host-compute ops {r['host_compute_ops']}, pool "
                                f"copies {r['pool_copies']} (whole-pool writes "
                                f"{r['pool_writes']}), host memory faults "
                                f"{r['host_memory_faults']}"))
    return out


def _access(rows) -> list[tuple[str, str]]:
    ffi = [r for r in rows if r["host_access"] == "ffi"]
    measured = [r for r in ffi if "ratio_to_read_bulk" in r]
    out = []
    text = f"every ffi access >= {MIN_RATIO_TO_READ_BULK} x read_bulk"
    if not measured:
        out.append(_verdict(None, text))
    else:
        low = [r for r in measured if r["ratio_to_read_bulk"] < MIN_RATIO_TO_READ_BULK]
        unmeasured = len(ffi) - len(measured)  # skipped, failed, or no read_bulk
        text += f": {len(measured) - len(low)} of {len(measured)} cells" + (
            f" ({unmeasured} not measured)" if unmeasured else "")
        if low:
            text += "; below: " + ", ".join(
                f"{r['check']} {r['row_bytes']}Bx{r['rows']} {r['ratio_to_read_bulk']:.2f}"
                for r in low[:8])
        out.append(_verdict(False if low else None if unmeasured else True, text))
    for check, what in (("gather_rows", "decode misses"), ("write_rows", "write-through")):
        got = [r for r in ffi if r["check"] == check and "gb_per_s" in r]
        if not got:
            out.append(_verdict(None, f"{what} >= {MIN_GB_PER_S:g} GB/s (ffi)"))
            continue
        top = max(r["rows"] for r in got)
        at_top = sorted((r for r in got if r["rows"] == top), key=lambda r: r["row_bytes"])
        out.append(_verdict(all(r["gb_per_s"] >= MIN_GB_PER_S for r in at_top),
                            f"{what} >= {MIN_GB_PER_S:g} GB/s (ffi, {top} rows): " + ", ".join(
                                f"{r['row_bytes']} B rows {r['gb_per_s']:.1f} GB/s"
                                for r in at_top)))
    gather = {(r["check"], r["row_bytes"], r["rows"]): r for r in rows
              if r["host_access"] == "gather" and "gb_per_s" in r}
    pairs = [(r, gather[(r["check"], r["row_bytes"], r["rows"])]) for r in ffi
             if "gb_per_s" in r and (r["check"], r["row_bytes"], r["rows"]) in gather]
    if pairs:  # for the record: what ffi replaced
        top = max(r["rows"] for r, _ in pairs)
        out.append(("INFO", f"ffi vs gather at {top} rows: " + ", ".join(
            f"{f['check']} {f['row_bytes']}B {f['gb_per_s']:.1f} vs {g['gb_per_s']:.1f} GB/s"
            for f, g in pairs if f["rows"] == top)))
    return out


def _decode(rows) -> list[tuple[str, str]]:
    out = []
    for workload, limit in MAX_DECODE_RATIO.items():
        got = [r for r in rows if r["question"] == "step" and r["workload"] == workload
               and r["batch"] == DECODE_BATCH and r["policy"] == "ring"]
        text = (f"decode step offloaded / resident <= {limit:.2f}, {workload}, batch "
                f"{DECODE_BATCH}")
        if not got:
            out.append(_verdict(None, text))
            continue
        r = got[-1]
        out.append(_verdict(r["ratio"] <= limit,
                            f"{text}: x{r['ratio']:.3f} [IQR {r['ratio_q25']:.3f}-"
                            f"{r['ratio_q75']:.3f}] ({r['model']}, context {r['context']}, "
                            f"hit rate {r['hit_rate']:.3f}, host_access {r.get('host_access')})"))
    others = [r for r in rows if r["question"] == "step" and r["batch"] != DECODE_BATCH
              and r["policy"] == "ring"]
    if others:
        out.append(("INFO", "decode step at other batches: " + ", ".join(
            f"batch {r['batch']} {r['workload']} x{r['ratio']:.3f}" for r in others)))
    return out


def _serving(rows) -> list[tuple[str, str]]:
    closed = [r for r in rows if r.get("workload") == "closed_loop"]
    out = []
    for n in sorted({r["steps_per_call"] for r in closed}) or [None]:
        by = {r["path"]: r for r in closed if r["steps_per_call"] == n}
        text = f"serving TPOT p50 offloaded / resident <= {MAX_TPOT_RATIO} at saturation"
        if n is None or not {"resident", "offload"} <= set(by) \
                or not by["resident"]["tpot_p50"] or by["offload"]["tpot_p50"] is None:
            out.append(_verdict(None, text + (f", N={n}" if n else "")))
            continue
        ratio = by["offload"]["tpot_p50"] / by["resident"]["tpot_p50"]
        out.append(_verdict(ratio <= MAX_TPOT_RATIO,
                            f"{text}, N={n}: x{ratio:.3f} ({by['offload']['tpot_p50'] * 1e3:.2f}"
                            f" vs {by['resident']['tpot_p50'] * 1e3:.2f} ms, "
                            f"{by['offload']['seats']} seats)"))
    return out


def _overlap(rows) -> list[tuple[str, str]]:
    """Host share with the engine's overlap at one step per call, per path (nothing when the
    named part did not run)."""
    out = []
    for path in dict.fromkeys(r["path"] for r in rows if r.get("steps_per_call") == 1):
        by = {r["overlap"]: r for r in rows
              if r["path"] == path and r.get("steps_per_call") == 1 and "overlap" in r}
        if True not in by:
            continue
        on, off = by[True], by.get(False)
        text = (f"host share with overlap <= {MAX_HOST_SHARE} at one step per call, {path}: "
                f"{on['host_share']:.3f}")
        if off is not None:
            text += f" (without overlap {off['host_share']:.3f})"
        out.append(_verdict(on["host_share"] <= MAX_HOST_SHARE, text))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="device_run.sh's output folder")
    parser.add_argument("--smoke", action="store_true", help="(the same: it reads files)")
    args = parser.parse_args(argv)
    rows = read_rows(args.dir)
    meta = next((r for part in rows.values() for r in part if "backend" in r), {})
    print(f"targets of the FFI host copies, from {args.dir} ({meta.get('backend', '?')}, "
          f"{meta.get('device', '?')}, jax {meta.get('jax', '?')}, git {meta.get('git', '?')})"
          + ("; a CPU run: its figures mean nothing" if meta.get("backend") == "cpu" else ""))
    got = verdicts(rows)
    for status, text in got:
        print(f"[{status}] {text}")
    counts = {s: sum(v == s for v, _ in got) for s in ("PASS", "FAIL", "MISSING")}
    print(f"{counts['PASS']} pass, {counts['FAIL']} fail, {counts['MISSING']} missing")
    return 0 if counts["FAIL"] == counts["MISSING"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

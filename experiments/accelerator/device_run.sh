#!/usr/bin/env bash
# One accelerator session of fo_jax, bounded in time: fo_jax's own host copies
# (host_access="ffi", fo_jax/offload/ffi) on a GPU. Every part has its own time limit, so one
# that hangs leaves the others; the default parts' limits add up to 470 s (under 8 minutes,
# leaving a device budget of 15 minutes room for the machine's start and one rerun):
#   ffi_library        30 s  the CUDA host-copy library found, registered and exact
#                            (host_copy_check.py); without it the run stops here
#   ffi_checks         90 s  the HLO of the decode step and the prefill: host-compute ops,
#                            copies of a pool, host-memory faults of the CUDA lowering (the
#                            compiled text in $OUT/hlo); then decode steps and a prefill chunk
#                            offloaded vs resident, bit for bit (accelerator_check.py)
#   prefill_exact      55 s  every prefill_diagnosis.py variant through ffi, against resident
#   engine_exact       40 s  the serving engine's tokens offloaded vs resident (engine_check.py)
#   access_rates       70 s  GB/s of the four accesses under ffi, 64-4096 rows of 656 and 1152
#                            bytes, against read_bulk (the copy engine) and device_put of the
#                            same bytes (accelerator_check.py --checks access)
#   access_gather      25 s  the same at 4096 rows under "gather", for comparison
#   real_width        100 s  (named only, not a default part) offloaded / resident decode step
#                            at DeepSeek-V3.2's widths with FP8 weights (real_width.py:
#                            deepseek_v32_width, batch 1 / 16 / 64, 32k / 128k, C = 16k, both KV
#                            formats), cells started within REAL_BUDGET_S (70 s by default); the
#                            whole table in a session of its own: PARTS="ffi_library real_width
#                            summary" REAL_S=540 REAL_BUDGET_S=480
#   decode_ratio       75 s  offloaded / resident decode step, `small`, 32k context, batch 8,
#                            32, 1, locality and uniform workloads (decode_bench.py)
#   serving_saturation 80 s  serving_bench.py --closed-loop: TPOT offloaded / resident, every
#                            seat busy (16 seats, 32 requests, 1 and 16 steps per call)
#   serving_overlap    90 s  (named only, not a default part: the defaults fill their 470 s)
#                            serving_bench.py --closed-loop at one step per call with the
#                            engine's overlap on and off: the host share (device idle,
#                            waiting for the host; target <= 0.05 with overlap) and the
#                            device's idle ms per step, resident and offloaded, 16 seats
#   summary             5 s  PASS / FAIL / MISSING per target (device_summary.py)
# Each part's log goes to $OUT/NAME.log and its JSON lines to $OUT/NAME.jsonl (replaced when
# the part runs again). PARTS picks parts by name, in this order; earlier questions can be
# named too: accelerator_check (every setting at every check) decode_bench_management
# decode_bench_step decode_loop_bench generate_check load_history_variants prefill_diagnosis
# engine_check serving_bench. A part's limit is set by the variable named beside it below.
#
# The CUDA library, built on any machine (no GPU needed) before the session; nvcc from a CUDA
# 13 toolkit or from the wheels (pin all four):
#   pip install "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
#       "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
#   python -m fo_jax.offload.ffi cuda --jaxlib 0.11.2 \
#       --out fo_jax/offload/ffi/lib/libfo_jax_host_copy_cuda.so
# The library is git-ignored: a runner that copies the working tree to the accelerator machine
# must carry it along, e.g. command "OUT=$OUT bash experiments/accelerator/device_run.sh" with
# carry ["fo_jax/offload/ffi/lib/libfo_jax_host_copy_cuda.so"] and a limit of 600 s.
#
#   OUT=results/device bash experiments/accelerator/device_run.sh   # on the accelerator machine
#   SMOKE=1 OUT=/tmp/dev bash experiments/accelerator/device_run.sh  # tiny sizes, any backend
#                                        (limits and budgets x3: a busy CPU compiles slowly)
#   PARTS="ffi_library access_rates summary" OUT=... bash experiments/accelerator/device_run.sh
set -u
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
smoke=${SMOKE:+--smoke}
x=${SMOKE:+3}; x=${x:-1}  # limits and budgets: x3 in smoke mode
full() { [ -z "${SMOKE:-}" ] && echo "$@"; }  # these flags at full size only
PARTS=${PARTS:-ffi_library ffi_checks prefill_exact engine_exact access_rates access_gather \
decode_ratio serving_saturation summary}
part() {  # part NAME SECONDS COMMAND...: run, tee to $OUT/NAME.log; its exit status
  local name=$1 limit=$(( $2 * x )); shift 2
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  rm -f "$OUT/$name.jsonl"
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^WARNING\|^I0000\|^W0000"
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc $(date +%T)"
  return "$rc"
}
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null

# The FFI host copies ----------------------------------------------------------------------
part ffi_library ${LIBRARY_S:-30} $PY -m experiments.accelerator.host_copy_check $smoke \
  $(full --require-gpu) --out "$OUT/ffi_library.jsonl" || {
  echo "=== stopping: every other part needs the host-copy library (see above)"; exit 1; }
part ffi_checks ${CHECKS_S:-90} $PY -m experiments.accelerator.accelerator_check $smoke --access ffi \
  --checks hlo decode prefill --budget-s $((60 * x)) --grace-s $((20 * x)) --hlo "$OUT/hlo" \
  --out "$OUT/ffi_checks.jsonl"
part prefill_exact ${PREFILL_S:-55} $PY -m experiments.accelerator.prefill_diagnosis $smoke \
  --host-access ffi --variants ffi device_pools host_fenced host_no_history \
  --out "$OUT/prefill_exact.jsonl"
part engine_exact ${ENGINE_S:-40} $PY -m experiments.accelerator.engine_check $smoke --host-access ffi \
  --out "$OUT/engine_exact.jsonl"
part access_rates ${RATES_S:-70} $PY -m experiments.accelerator.accelerator_check $smoke --access ffi \
  --checks access $(full --row-counts 64 256 1024 4096) --row-bytes 656 1152 \
  --budget-s $((45 * x)) --grace-s $((12 * x)) --out "$OUT/access_rates.jsonl"
part access_gather ${GATHER_S:-25} $PY -m experiments.accelerator.accelerator_check $smoke --access gather \
  --checks access $(full --row-counts 4096) --budget-s $((8 * x)) --grace-s $((10 * x)) \
  --out "$OUT/access_gather.jsonl"
part real_width ${REAL_S:-100} $PY -m experiments.decode.real_width $smoke --host-access ffi \
  $(full --budget-s ${REAL_BUDGET_S:-70}) --out "$OUT/real_width.jsonl"
part decode_ratio ${DECODE_S:-75} $PY -m experiments.decode.decode_bench $smoke --what step \
  --policy ring --host-access ffi \
  $(full --model small --context 32768 --batch 8 32 1 --steps 10 --warmup 10) \
  --out "$OUT/decode_ratio.jsonl"
part serving_saturation ${SERVING_S:-80} $PY -m experiments.serving.serving_bench $smoke \
  --closed-loop --paths resident offload --workloads poisson --host-access ffi \
  $(full --seats 16 --requests 32 --steps-per-call 1 16) --out "$OUT/serving_saturation.jsonl"
part serving_overlap ${OVERLAP_S:-90} $PY -m experiments.serving.serving_bench $smoke \
  --closed-loop --paths resident offload --workloads poisson --host-access ffi \
  --steps-per-call 1 --overlap on off $(full --seats 16 --requests 32) \
  --out "$OUT/serving_overlap.jsonl"
part summary ${SUMMARY_S:-5} $PY -m experiments.accelerator.device_summary --dir "$OUT"

# Earlier questions (by name in PARTS) ---------------------------------------------------------
part accelerator_check ${CHECK_S:-200} $PY -m experiments.accelerator.accelerator_check $smoke \
  --budget-s ${CHECK_BUDGET_S:-160} --out "$OUT/accelerator_check.jsonl"
part decode_bench_management ${MGMT_S:-75} $PY -m experiments.decode.decode_bench $smoke \
  --what management $(full --multiples 1 4 16 --rounds 7 --inner 10) \
  --policies ring clock lru --out "$OUT/decode_bench_management.jsonl"
part decode_bench_step ${STEP_S:-100} $PY -m experiments.decode.decode_bench $smoke --what step \
  --policy ring clock $(full --batch 8 --context 32768 --steps 10 --warmup 10) \
  --out "$OUT/decode_bench_step.jsonl"
part decode_loop_bench ${LOOP_S:-50} $PY -m experiments.decode.decode_loop_bench $smoke \
  --out "$OUT/decode_loop_bench.jsonl"
part generate_check ${GEN_S:-45} $PY -m fo_jax.cli generate --offload --check \
  --max-new-tokens $([ -n "${SMOKE:-}" ] && echo 8 || echo 64)
part load_history_variants ${VARIANTS_S:-60} $PY -m experiments.accelerator.load_history_variants $smoke \
  --out "$OUT/load_history_variants.jsonl"
part prefill_diagnosis ${DIAG_S:-150} $PY -m experiments.accelerator.prefill_diagnosis $smoke \
  --hlo "$OUT/hlo" --out "$OUT/prefill_diagnosis.jsonl"
part engine_check ${ENGINE_CHECK_S:-150} $PY -m experiments.accelerator.engine_check $smoke \
  --out "$OUT/engine_check.jsonl"
part serving_bench ${SERVE_S:-150} $PY -m experiments.serving.serving_bench $smoke \
  --out "$OUT/serving_bench.jsonl"
echo "=== all done $(date +%T)"

#!/usr/bin/env bash
# One accelerator session of fo_jax, bounded in time: the host-access checks, the decode
# benchmark (management cost vs C for ring / CLOCK / LRU, the whole step for ring and CLOCK
# against resident), the multi-step decode loop, and the offloaded generate --check on the
# embedded model; then where the offloaded prefill parts from the resident one
# (prefill_diagnosis.py), the serving engine offloaded against resident (engine_check.py) and
# the serving benchmark. Every part has its own time limit, so one that hangs leaves the
# others. PARTS picks parts by name (default: all, in this order).
#   OUT=results/device bash experiments/device_run.sh          # on the accelerator machine
#   SMOKE=1 OUT=/tmp/dev bash experiments/device_run.sh         # tiny sizes, any backend
#   PARTS="prefill_diagnosis engine_check" OUT=... bash experiments/device_run.sh
set -u
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
smoke=${SMOKE:+--smoke}
PARTS=${PARTS:-accelerator_check decode_bench_management decode_bench_step decode_loop_bench \
generate_check access_gather load_history_variants prefill_diagnosis engine_check serving_bench}
part() {  # part NAME SECONDS COMMAND...: run, tee to $OUT/NAME.log, report the exit status
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^WARNING\|^I0000\|^W0000"
  echo "=== $name exit ${PIPESTATUS[0]} $(date +%T)"
}
$PY -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
part accelerator_check ${CHECK_S:-200} $PY experiments/accelerator_check.py $smoke \
  --budget-s ${CHECK_BUDGET_S:-160} --out "$OUT/accelerator_check.jsonl"
part decode_bench_management ${MGMT_S:-75} $PY experiments/decode_bench.py $smoke \
  --what management $([ -z "${SMOKE:-}" ] && echo --multiples 1 4 16 --rounds 7 --inner 10) \
  --policies ring clock lru --out "$OUT/decode_bench.jsonl"
part decode_bench_step ${STEP_S:-100} $PY experiments/decode_bench.py $smoke --what step \
  --policy ring clock $([ -z "${SMOKE:-}" ] && echo --batch 8 --context 32768 --steps 10 --warmup 10) \
  --out "$OUT/decode_bench.jsonl"
part decode_loop_bench ${LOOP_S:-50} $PY experiments/decode_loop_bench.py $smoke \
  --out "$OUT/decode_loop_bench.jsonl"
part generate_check ${GEN_S:-45} $PY -m fo_jax.cli generate --offload --check \
  --max-new-tokens $([ -n "${SMOKE:-}" ] && echo 8 || echo 64)
part access_gather ${ACCESS_S:-100} $PY experiments/accelerator_check.py $smoke --checks access \
  --access gather --budget-s ${ACCESS_BUDGET_S:-70} --out "$OUT/access_gather.jsonl"
part load_history_variants ${VARIANTS_S:-60} $PY experiments/load_history_variants.py $smoke \
  --out "$OUT/load_history_variants.jsonl"
part prefill_diagnosis ${DIAG_S:-150} $PY experiments/prefill_diagnosis.py $smoke \
  --hlo "$OUT/hlo" --out "$OUT/prefill_diagnosis.jsonl"
part engine_check ${ENGINE_S:-150} $PY experiments/engine_check.py $smoke \
  --out "$OUT/engine_check.jsonl"
part serving_bench ${SERVE_S:-150} $PY experiments/serving_bench.py $smoke \
  --out "$OUT/serving_bench.jsonl"
echo "=== all done $(date +%T)"

#!/usr/bin/env bash
# The GPU checks, one step after another, each logged under $OUT (default /tmp/out). Run it from
# the repository root on a machine with an H100 or H200:
#
#   tools/gpu-checks.sh info build gpu-tests sanitize
#
# steps:
#   info        nvidia-smi (power limit, clocks) and the devices jax sees
#   build       pip install -e . (the FFI extension) without touching the installed dependencies
#   gpu-tests   pytest -m gpu (GPU_TESTS: test files, default all of tests/; GPU_K: a -k expression;
#               GPU_TIMEOUT: seconds, default 900) in GPU_WORKERS pytest-xdist workers (default 14: the run is bound by
#               kernel compiles, one CPU core each; the workers share the GPU, so none preallocates
#               its memory); the outcomes go to $OUT/gpu-test-results.json
#   multigpu    pytest -m multigpu tests/test_multigpu.py (two or more GPUs)
#   sanitize    compute-sanitizer memcheck and racecheck over tools/sanitize_probe.py
#   examples    the three examples, at their GPU sizes
#   bench-SUITE benchmarks/run.py --suite SUITE (matmul, ragged, launch, ...) into $OUT/SUITE.json
#               (BENCH_CASES: only the cases this regex matches, for run.py --merge)
#   first-call-warm / first-call-cold
#               benchmarks/bench_first_call.py with the cache in .device/cache, or an empty one
#
# If .device/dsl-b/setup.sh exists (a DSL runtime carried to a machine that has none), it is
# sourced first. sanitize passes --report-api-errors no: the DSL probes the driver
# (cuGetProcAddress), and those refused probes would drown the memory and race reports.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -f .device/dsl-b/setup.sh ] && source .device/dsl-b/setup.sh
export JAX_CUTE_COMMIT=${JAX_CUTE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
rc=0
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    info) nvidia-smi --query-gpu=name,driver_version,power.limit,power.max_limit,clocks.sm,clocks.max.sm,temperature.gpu \
            --format=csv
          python3 -c "import jax; print(jax.__version__, jax.devices())" ;;
    build) python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
             || { tail -40 "$OUT/build.log"; rc=1; } ;;
    gpu-tests) XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_CUTE_GPU_RESULTS="$OUT/gpu-test-results.json" \
             timeout -s INT ${GPU_TIMEOUT:-900} python3 -m pytest -m gpu -q -rf -n ${GPU_WORKERS:-14} ${GPU_K:+-k "$GPU_K"} ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
             [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    multigpu) python3 -m pytest -m multigpu -q tests/test_multigpu.py 2>&1 | tee "$OUT/multigpu.log" | tail -15
             [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    sanitize) for tool in memcheck racecheck; do
               XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 600 compute-sanitizer --tool $tool --report-api-errors no \
                 --error-exitcode 9 python3 -X faulthandler tools/sanitize_probe.py > "$OUT/sanitize_$tool.log" 2>&1
               s=$?; echo "$tool rc=$s"; [ $s = 0 ] || rc=1
               grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SANITIZE PROBE DONE" "$OUT/sanitize_$tool.log"
             done ;;
    examples) for ex in "mlp_training.py --steps 8" "moe_training.py --steps 8" "custom_kernel.py"; do
               timeout 120 python3 examples/$ex 2>&1 | grep -v "^\[" | tee -a "$OUT/examples.log" | tail -6
             done ;;
    bench-*) timeout 560 python3 benchmarks/run.py --suite "${step#bench-}" --out "$OUT/${step#bench-}.json" --time-limit 480 \
               ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} ${BENCH_CASES:+--cases "$BENCH_CASES"} 2>&1 | tee "$OUT/${step}.log" | tail -40 ;;
    first-call-warm) python3 benchmarks/bench_first_call.py --cache .device/cache --out "$OUT/first_call.jsonl" ;;
    first-call-cold) python3 benchmarks/bench_first_call.py --cache /tmp/jc_cold --cold --out "$OUT/first_call.jsonl" ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc

#!/usr/bin/env bash
# One call on the GPU machine (device tool): build the extension, then run the named steps,
# each logged under $OUT. The DSL comes from ../shared/tools/device-bundle: a first call runs
# `bash .device/dsl-a/setup.sh` (carry .device/dsl-a), later calls carry .device/dsl-b.
# sanitize: --report-api-errors no, because the DSL compiler probes the driver (cuGetProcAddress)
# and those refused probes would drown the memory and race reports that matter here.
# ncu-probe: one shape per call is safest; if XLA's Triton autotuning segfaults under ncu (it did on
# 16384x1536x1024), set XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (XLA picks cuBLAS there anyway).
# timeline reads TIMELINE_SHAPES (e.g. 2048x2048x2048,8192x8192x8192) and TIMELINE_NAME (output stem).
# devcheck-grouped reads DEVCHECK_BUDGET (seconds), DEVCHECK_WHICH (fwd,drhs) and
# DEVCHECK_SKIP_CHECKS=1 (timings only), DEVCHECK_NO_PALLAS=1 and DEVCHECK_G (e.g. 64,16: the
# benchmark shapes to time, by group count). gpu-tests reads GPU_TESTS (test files; default all) and
# GPU_TIMEOUT (seconds, default 560): the whole GPU suite takes ~7-8 min with its compiles, so a
# call of at most 10 min may split it by file and merge the result files.
# Usage: tools/gpu_session.sh STEP...   (steps: info build ffi devcheck-gemm devcheck-grouped
#        ncu-probe ncu-source timeline energy chain-effect gpu-tests sanitize first-call-warm first-call-cold unpack-compiler multigpu skew-ratio bench-matmul bench-ragged
#        bench-launch)
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
    ffi) python3 -m pytest -m gpu -q -x tests/test_ffi_gpu.py 2>&1 | tee "$OUT/ffi.log" | tail -25 ;;
    devcheck-gemm) timeout 590 python3 benchmarks/devcheck_sm90_gemm.py run --bins .device/bins/gemm 2>&1 \
             | tee "$OUT/devcheck_gemm.log" | tail -60 ;;
    ncu-probe) timeout ${NCU_TIMEOUT:-240} "$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)" --profile-from-start off --clock-control none --csv \
             --metrics "$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import ncu_probe; print(ncu_probe.METRICS)')" \
             python3 benchmarks/ncu_probe.py run --bins ${NCU_BINS:-.device/bins/gemm} ${NCU_SHAPES:+--shapes $NCU_SHAPES} ${NCU_CONFIGS:+--configs $NCU_CONFIGS} \
             > "$OUT/ncu_probe.csv" 2> "$OUT/ncu_probe.err" || { echo "ncu rc=$?"; tail -20 "$OUT/ncu_probe.err"; }
           python3 benchmarks/ncu_probe.py report "$OUT/ncu_probe.csv" | tee "$OUT/ncu_probe.txt" ;;
    ncu-source) ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
           # per-instruction warp-state samples (SASS) of one call per kernel: where warps wait
           timeout ${NCU_TIMEOUT:-420} "$ncu" --profile-from-start off --clock-control none --set none --section WarpStateStats \
             --section SourceCounters --section SpeedOfLight --import-source no -f -o "$OUT/source" \
             python3 benchmarks/ncu_probe.py run --bins ${NCU_BINS:-.device/bins/gemm} --reps 1 \
             ${NCU_SHAPES:+--shapes $NCU_SHAPES} ${NCU_CONFIGS:+--configs $NCU_CONFIGS} > "$OUT/ncu_source.log" 2>&1 \
             || { echo "ncu rc=$?"; tail -20 "$OUT/ncu_source.log"; }
           grep NCU_PROBE "$OUT/ncu_source.log"
           "$ncu" -i "$OUT/source.ncu-rep" --page source --csv --print-source sass > "$OUT/source_sass.csv" 2> "$OUT/source_sass.err"
           "$ncu" -i "$OUT/source.ncu-rep" --page details --csv > "$OUT/source_details.csv" 2>> "$OUT/source_sass.err"
           ls -la "$OUT"; head -c 600 "$OUT/source_sass.err" ;;
    devcheck-grouped) timeout $(( ${DEVCHECK_BUDGET:-228} + 12 )) python3 benchmarks/devcheck_sm90_grouped.py run \
             --bins .device/bins/grouped --budget ${DEVCHECK_BUDGET:-228} --which ${DEVCHECK_WHICH:-fwd,drhs} 2>&1 \
             | tee "$OUT/devcheck_grouped.log" | tail -60 ;;
    graph-tests) python3 -m pytest -m gpu -q -k captured tests/test_gpu_matmul.py tests/test_gpu_cute_call.py \
               tests/test_ragged_dot_gpu.py 2>&1 \
             | tee "$OUT/graph_tests.log" | grep -E "CAPTURED|command buffer|holding|passed|failed" | head -20 ;;
    gpu-tests) JAX_CUTE_GPU_RESULTS="$OUT/gpu-test-results.json" timeout ${GPU_TIMEOUT:-560} python3 -m pytest -m gpu -q ${GPU_TESTS:-tests} 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -40 ;;
    sanitize) for tool in memcheck racecheck; do
               XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 compute-sanitizer --tool $tool --report-api-errors no \
                 --error-exitcode 9 python3 tools/sanitize_probe.py > "$OUT/sanitize_$tool.log" 2>&1
               echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SANITIZE PROBE DONE" "$OUT/sanitize_$tool.log"
             done ;;
    first-call-warm) JAX_CUTE_CACHE_DIR=.device/cache python3 -m jax_cute cache list | tail -2
             python3 -c "import cutlass" 2>/dev/null && echo "DSL compiler importable" || echo "DSL compiler absent"
             python3 benchmarks/bench_first_call.py --cache .device/cache --out "$OUT/first_call.jsonl" ;;
    first-call-cold) python3 benchmarks/bench_first_call.py --cache /tmp/jc_cold --cold --out "$OUT/first_call.jsonl" ;;
    unpack-compiler) bash .device/dsl-a/setup.sh && echo "DSL compiler unpacked" ;;
    examples) for ex in "mlp_training.py --steps 8" "moe_training.py --steps 8" "custom_kernel.py"; do
               timeout 120 python3 examples/$ex 2>&1 | grep -v "^\[" | tee -a "$OUT/examples.log" | tail -6
             done ;;
    multigpu) python3 -m pytest -m multigpu -q tests/test_multigpu.py 2>&1 | tee "$OUT/multigpu.log" | tail -15 ;;
    timeline) JAX_CUTE_CACHE_DIR=${JAX_CUTE_CACHE_DIR:-.device/cache} timeout 300 python3 benchmarks/kernel_timeline.py run \
             --bins .device/bins/gemm --out "$OUT/${TIMELINE_NAME:-timeline}.json" --hlo "$OUT/hlo" \
             ${TIMELINE_SHAPES:+--shapes $TIMELINE_SHAPES} 2>&1 | tee "$OUT/${TIMELINE_NAME:-timeline}.log" | grep -v "^\[" | tail -80 ;;
    energy) JAX_CUTE_CACHE_DIR=${JAX_CUTE_CACHE_DIR:-.device/cache} timeout 240 python3 benchmarks/energy_probe.py run --bins .device/bins/gemm --out "$OUT/energy.json" 2>&1 \
             | tee "$OUT/energy.log" | grep -v "^\[" | tail -30 ;;
    chain-effect) timeout 300 python3 benchmarks/chain_effect.py --records "$OUT/chain_effect.json" 2>&1 \
             | tee "$OUT/chain_effect.log" | tail -14 ;;
    skew-ratio) timeout 300 python3 benchmarks/skew_ratio.py --rounds ${BENCH_ROUNDS:-15} --out "$OUT/skew_ratio.json" 2>&1 \
             | tee "$OUT/skew_ratio.log" | grep "^{" ;;
    bench-*) timeout 500 python3 benchmarks/run.py --suite "${step#bench-}" --out "$OUT/${step#bench-}.json" ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} 2>&1 \
             | tee "$OUT/${step}.log" | tail -40 ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc

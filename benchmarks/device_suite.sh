#!/usr/bin/env bash
# One call on the lent GPU: environment, GPU tests, benchmarks; logs and CSVs under $OUT.
#   bash benchmarks/device_suite.sh smoke|full|final
# smoke: quick GPU tests and both shapes once; full: every GPU test and ncu on the scan (96 and 3
# keys, docs/SCANS.md); final: backend_batch.py at both shapes, each
# shape with and without graph replay (the -mb0-s1-g0/-g1 files backend_batch.py writes).
# Every step runs even when one before it failed; the table printed last says which passed.
set -u
export PYTHONUNBUFFERED=1
stage=${1:-smoke}
OUT=${OUT:-/tmp/device-out}
LOGS="$OUT/logs"  # packed into logs.tgz at the end: only 8 files come back from a call
mkdir -p "$LOGS"
MAINNET=16817159
summary=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-28s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
    tail -n 25 "$LOGS/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,driver_version --format=csv
    python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
    python3 - <<'EOF'
import cupy as cp
n = 1 << 30  # 4 GiB of u32 read + 4 GiB written per copy
a = cp.ones(n, dtype=cp.uint32); b = cp.empty_like(a)
s, e = cp.cuda.Event(), cp.cuda.Event()
for _ in range(2): b[...] = a
s.record()
for _ in range(5): b[...] = a
e.record(); e.synchronize()
ms = cp.cuda.get_elapsed_time(s, e) / 5
print(f"device copy: {2 * 4 * n / ms / 1e6:.0f} GB/s counting read+write ({ms:.2f} ms per 8 GiB)")
EOF
} >"$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

bench() {  # bench NAME LIMIT ARGS...: the CSV benchmark
    step "$1" "$2" python3 benchmarks/backend_batch.py --backend cuda "${@:3}"
}

case "$stage" in
smoke)
    step tests-quick 240 python3 -m pytest tests/gpu_engine/test_cuda_backend.py tests/gpu_engine/test_kernels_compile.py -q -x \
        -p no:cacheprovider -k "not matches_numpy and not dispatch_shapes and not large_shape"
    bench bench-65536 120 --pages 65536 --domain-bits 16 --q 1,2,4,8,16,32 --repeat 5 \
        --dispatch micro_batch=0,streams=1,graph=0 --dispatch micro_batch=0,streams=1,graph=1 \
        --out "$OUT/cuda_65536.csv"
    bench bench-mainnet 240 --pages $MAINNET --domain-bits 25 --gpu-matrix --q 1,8,32 --repeat 3 \
        --out "$OUT/cuda_mainnet.csv"
    ;;
full)
    step tests-all 420 python3 -m pytest tests/gpu_engine/test_cuda_backend.py tests/gpu_engine/test_kernels_compile.py -q \
        -p no:cacheprovider
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for keys in 96 3; do
        step "ncu-k$keys" 150 "$NCU" --clock-control none -k regex:dpf_scan --launch-skip 1 --launch-count 1 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
            --metrics sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active \
            python3 benchmarks/profile_scan.py --pages 1048593 --domain-bits 25 --keys $keys
    done
    ;;
final)
    bench bench-65536 200 --pages 65536 --domain-bits 16 --q 1,2,4,8,16,32 --repeat 9 \
        --dispatch micro_batch=0,streams=1,graph=0 --dispatch micro_batch=0,streams=1,graph=1 \
        --out "$OUT/cuda_65536.csv"
    bench bench-mainnet 330 --pages $MAINNET --domain-bits 25 --gpu-matrix --q 1,2,4,8,16,32 --repeat 3 \
        --dispatch micro_batch=0,streams=1,graph=0 --dispatch micro_batch=0,streams=1,graph=1 \
        --out "$OUT/cuda_mainnet.csv"
    ;;
*)
    echo "unknown stage $stage (smoke|full|final)"; exit 2 ;;
esac

tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$LOGS"
echo
echo "== $stage summary =="
printf '%s\n' "${summary[@]}"
for f in "$OUT"/*.csv; do [ -e "$f" ] && { echo "-- $(basename "$f")"; grep -v '^#' "$f"; }; done

#!/usr/bin/env bash
# The H100 Poisson sweep of the batching policies (engine level, every mode, cuda, 1,048,576 pages), in two
# device calls because one command may run 10 minutes at most:
#   bash benchmarks/device_policy.sh low
#       measures the capacity and t(1); 10%, 30%, 50%, 70% of it, 4 rounds of 5 s per point, and
#       the latency policy measured twice (A/A control)
#   CAPACITY=<capacity_qps> TARGET=<p95_target_ms> bash benchmarks/device_policy.sh high
#       85% and 95% of the same capacity, same slo target, 7 rounds of 6 s per point, and the
#       A/A control: near capacity the p95 of a few seconds moves by more than the modes differ,
#       and the control says by how much
# and, back here, one CSV and plot from both:
#   python3 benchmarks/loadgen.py --from-csv low.csv,high.csv --csv docs/benchmarks/h100_policy.csv \
#       --png docs/benchmarks/h100_policy.png
# numpy + cupy only. Writes under $OUT.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PAGES=${PAGES:-1048576}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# the SM clock, power and temperature once a second: a throttled GPU moves the capacity under a sweep
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 1000 >"$OUT/gpu_clocks.csv" 2>&1 &
trap 'kill $! 2>/dev/null' EXIT
case "${1:-}" in
low)
    python3 benchmarks/loadgen.py --backend cuda --pages "$PAGES" --fractions 0.1,0.3,0.5,0.7 \
        --modes latency,throughput,adaptive,slo,latency-control --duration 20 --rounds 4 --warmup 0.5 --csv "$OUT/policy_cuda_low.csv" 2>&1 | tee "$OUT/low.log" ;;
high)
    python3 benchmarks/loadgen.py --backend cuda --pages "$PAGES" --fractions 0.85,0.95 \
        --modes latency,throughput,adaptive,slo,latency-control --duration 42 --rounds 7 --warmup 0.5 --capacity-qps "$CAPACITY" --target-ms "$TARGET" \
        --csv "$OUT/policy_cuda_high.csv" 2>&1 | tee "$OUT/high.log" ;;
gil)
    # 90% of the same capacity with Python's GIL switch interval at its 5 ms default (0) and at 500 µs:
    # is a thread waiting for the GIL behind the near-capacity stalls?
    for interval in 0 500; do
        python3 benchmarks/loadgen.py --backend cuda --pages "$PAGES" --fractions 0.9 \
            --duration 30 --rounds 5 --warmup 0.5 --capacity-qps "$CAPACITY" --target-ms "$TARGET" \
            --switch-interval-us "$interval" --csv "$OUT/policy_cuda_gil_$interval.csv" 2>&1 \
            | tee "$OUT/gil_$interval.log"
    done ;;
*)
    echo "usage: $0 low | CAPACITY=q/s TARGET=ms $0 high|gil" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# One call on a lent host of two GPUs (nvidia-h200-x2): the CUDA placement tests, then one GPU
# against two, sharded and replicated, at 1,048,576 pages and the mainnet shape; CSVs under $OUT.
#   bash benchmarks/device_placement.sh
# Issue 17's figures: mainnet shard latency (q=1) <= 9 ms and q=32 throughput >= 1.9x one GPU's;
# 1,048,576 pages replicate throughput >= 1.9x one GPU's (placement_*.csv, qps_vs_one).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
nvidia-smi topo -m >"$OUT/topology.txt" 2>&1
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.csv"
timeout 240 python3 -m pytest tests/test_cuda_placement.py -q -x 2>&1 | tail -n 15 | tee "$OUT/tests.log"
timeout 150 python3 benchmarks/placement.py --backend cuda --devices 0,1 --pages 1048576 \
    --q 1,32 --out "$OUT/placement_1048576p.csv" 2>&1 | tee "$OUT/placement_1048576p.log"
timeout 300 python3 benchmarks/placement.py --backend cuda --devices 0,1 --pages 16817159 \
    --q 1,32 --repeat 5 --seconds 3 --out "$OUT/placement_mainnet.csv" 2>&1 | tee "$OUT/placement_mainnet.log"

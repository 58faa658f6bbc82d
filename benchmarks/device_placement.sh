#!/usr/bin/env bash
# The two-GPU figures on a lent host of two GPUs (nvidia-h100-x2 or nvidia-h200-x2), CSVs under $OUT:
#   bash benchmarks/device_placement.sh STAGE...   (default: tests engine switch switch-v2 http)
# tests:  the CUDA placement tests (two GPUs, byte-exact against NumPy)
# engine: one GPU against two, sharded and replicated, at 1,048,576 pages and the mainnet shape
#         (placement_*.csv: latency_vs_one and qps_vs_one are the ratios)
# switch: atomic epoch switches under load at the mainnet shape, both epochs resident, sharded
#         (switch-v2: the same with v2 keys)
# http:   HTTP through the engine server (the Django/Celery wheels in .whl) on one GPU, then two,
#         each against the engine alone on the same devices (http_*gpu.csv)
set -uo pipefail
export PYTHONUNBUFFERED=1
rc=0
OUT=${OUT:-/tmp/device-out}
MAINNET=16817159
mkdir -p "$OUT"
nvidia-smi topo -m >"$OUT/topology.txt" 2>&1
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.csv"
for stage in ${*:-tests engine switch switch-v2 http}; do
    case $stage in
    tests)
        timeout 240 python3 -m pytest tests/gpu_engine/test_cuda_placement.py -q -x -p no:cacheprovider 2>&1 \
            | tail -n 15 | tee "$OUT/tests.log" || rc=1 ;;
    engine)
        timeout 150 python3 benchmarks/placement.py --backend cuda --devices 0,1 --pages 1048576 \
            --q 1,32 --out "$OUT/placement_1048576p.csv" 2>&1 | tee "$OUT/placement_1048576p.log" || rc=1
        timeout 300 python3 benchmarks/placement.py --backend cuda --devices 0,1 --pages $MAINNET \
            --q 1,32 --repeat 5 --seconds 3 --out "$OUT/placement_mainnet.csv" 2>&1 | tee "$OUT/placement_mainnet.log" || rc=1 ;;
    mainnet)
        timeout 300 python3 benchmarks/placement.py --backend cuda --devices 0,1 --pages $MAINNET \
            --q 1,32 --repeat 5 --seconds 3 --out "$OUT/placement_mainnet.csv" 2>&1 | tee "$OUT/placement_mainnet.log" || rc=1 ;;
    switch|switch-v2)  # v1 keys, or v2 keys (on the tensor cores from 8 queries a launch)
        keys=v1; [ "$stage" = switch-v2 ] && keys=v2
        timeout 280 python3 benchmarks/epoch_switch.py --backend cuda --devices 0,1 --pages $MAINNET \
            --placement shard --clients 64 --key-format $keys --out "$OUT/epoch_switch_mainnet_$keys.csv" \
            2>&1 | tee "$OUT/epoch_switch_$keys.log" || rc=1 ;;
    http)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
        for devices in 0 0,1; do
            n=$(tr -cd , <<<"$devices" | wc -c); n=$((n + 1))  # GPUs named
            timeout 280 python3 benchmarks/http_vs_engine.py --backend cuda --pages 1048576 --devices $devices \
                --seconds 5 --out "$OUT/http_${n}gpu.csv" --folder /tmp/hve-$devices 2>&1 | tee -a "$OUT/http.log" || rc=1
        done ;;
    *) echo "unknown stage $stage: tests, engine, mainnet, switch, switch-v2 or http" >&2; exit 2 ;;
    esac
done
exit $rc

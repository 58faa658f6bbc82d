#!/usr/bin/env bash
# One device call for the defaults' figures: the layout the server picks (auto) against pages at
# the mainnet shape, v1 and v2 keys (benchmarks/backend_batch.py), then bulk jobs from POST to done
# against the engine at 65,536 and 1,048,576 pages (benchmarks/bulk.py, JSON and binary uploads).
# Run from the repo root on the device with the Django/Celery wheels in .whl:
#   bash benchmarks/device_defaults.sh   (CSVs and one log under $OUT; benchmarks/fold.py folds
#   each figure's runs into the files docs/benchmarks/ keeps, named after the GPU:
#   bulk_h100.csv, layout_h200_mainnet.csv)
set -uo pipefail
source benchmarks/device_env.sh
LOG="$OUT/device_defaults.log"
cp "$OUT/gpu.txt" "$LOG"
# what the server's default (MORPHO_MATRIX_LAYOUT=auto) picks here, and why
python3 -c "from gpu_engine.backends import create_backend as c; d = c('cuda', layout='auto').describe(); print({k: d[k] for k in ('device', 'layout', 'layout_reason', 'pass_queries')})" 2>&1 | tee -a "$LOG"
for pages in 65536 1048576; do
    echo "== bulk $pages" | tee -a "$LOG"
    timeout "${BULK_S:-100}" python3 benchmarks/bulk.py --backend cuda --pages $pages --queries 10000 \
        --concurrency 2,4 --port 9650 --out "$OUT/bulk_${pages}p.csv" 2>&1 | tee -a "$LOG" | tail -3
done
python3 benchmarks/fold.py --out "$OUT/bulk_${MODEL}.csv" --columns pages \
    65536="$OUT/bulk_65536p.csv" 1048576="$OUT/bulk_1048576p.csv" 2>&1 | tee -a "$LOG"
MAINNET=16817159
for keys in v1 v2; do
    for layout in auto pages; do
        echo "== mainnet $keys $layout" | tee -a "$LOG"
        timeout "${LAYOUT_S:-25}" python3 benchmarks/backend_batch.py --backend cuda --gpu-matrix \
            --pages $MAINNET --domain-bits 25 --key-format $keys --layout $layout --q 1,8,32 \
            --repeat 2 --out "$OUT/layout_mainnet_${keys}_${layout}.csv" 2>&1 | tail -6 | tee -a "$LOG"
    done
done
python3 benchmarks/fold.py --out "$OUT/layout_${MODEL}_mainnet.csv" --columns key_format,layout \
    v1,auto="$OUT/layout_mainnet_v1_auto.csv" v1,pages="$OUT/layout_mainnet_v1_pages.csv" \
    v2,auto="$OUT/layout_mainnet_v2_auto.csv" v2,pages="$OUT/layout_mainnet_v2_pages.csv" 2>&1 | tee -a "$LOG"

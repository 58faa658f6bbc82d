#!/usr/bin/env bash
# One device call: bulk-job throughput against the engine's, on the CUDA backend (benchmarks/bulk.py).
# Run from the repo root on the device with the Django/Celery wheels carried in .whl:
#   bash benchmarks/device_bulk.sh   (writes the CSV and logs under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PAGES=${PAGES:-1048576}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== bulk: 10,000-query job vs engine throughput, cuda, $PAGES pages"
python3 benchmarks/bulk.py --backend cuda --pages "$PAGES" --queries 10000 \
    --out "$OUT/bulk_cuda.csv" 2>&1 | tee "$OUT/bulk.log" | tail -30
cat "$OUT/bulk_cuda.csv"

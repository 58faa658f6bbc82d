#!/usr/bin/env bash
# One device call for the front end's cost at the GPU's rates (benchmarks/frontend_cost.py): a
# party on the GPU, its gunicorn straight and through `make run`'s front end, in turns. Run from
# the repo root on the device with the Django/Celery/uvloop wheels in .whl:
#   bash benchmarks/device_frontend.sh [PAGES] [extra frontend_cost.py options]
set -uo pipefail
PAGES=${1:-65536,1048576}; shift || true
source benchmarks/device_env.sh
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/frontend_cost.py --backend cuda --pages "$PAGES" \
    --out "$OUT/frontend_cost.csv" "$@" 2>&1 | tee "$OUT/bench.log"
cat "$OUT/frontend_cost.csv"

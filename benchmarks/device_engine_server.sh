#!/usr/bin/env bash
# One device call for the HTTP figures (docs/PERFORMANCE.md): GPU tests, then HTTP through the engine server against
# the engine alone (PROFILE=1: with py-spy profiles of both tiers). Run from the repo root on the
# device with the Django/Celery wheels in .whl:
#   bash benchmarks/device_engine_server.sh [PAGES] [extra http_vs_engine.py options]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# a warm machine keeps the last call's files, and the parties of a call that failed (each in its
# own session)
pkill -f "gunicorn morphoweb.wsgi|manage.py serve_engine|bin/gpu-workers" && sleep 2
rm -rf /tmp/hve /tmp/profiles
PAGES=${1:-65536,1048576}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
nproc
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu_engine/test_cuda_backend.py ${EXTRA_TESTS:-} \
        2>&1 | tail -15 | tee "$OUT/tests.log"
fi
# PROFILE=1: py-spy profiles of the engine server and a web worker in each closed loop, summed up
PROFILE_ARGS=(); [ -n "${PROFILE:-}" ] && PROFILE_ARGS=(--profile /tmp/profiles) && mkdir -p /tmp/profiles
export PATH=/tmp/site/bin:$PATH
timeout 500 python3 benchmarks/http_vs_engine.py --backend cuda --pages "$PAGES" --out "$OUT/http_vs_engine.csv" --folder /tmp/hve "${PROFILE_ARGS[@]}" "$@" \
    2>&1 | tee "$OUT/bench.log"
[ -n "${PROFILE:-}" ] && python3 benchmarks/profile_summary.py --seconds 6 --rate 200 --top 45 /tmp/profiles/*.txt > "$OUT/profiles.txt"
for f in /tmp/hve/party-*/*.log; do [ -f "$f" ] && { echo "== $f"; tail -30 "$f"; }; done > "$OUT/party_tail.log" 2>/dev/null
cat "$OUT/http_vs_engine.csv"

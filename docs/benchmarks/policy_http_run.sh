#!/usr/bin/env bash
# HTTP-level Poisson load against one gunicorn party, once per interactive policy (activated live,
# without restarting the server), merged into docs/benchmarks/policy_http_cpu.csv.
# Usage: docs/benchmarks/policy_http_run.sh [PYTHON] [RATES]   (run from the repository root)
set -euo pipefail
PY=${1:-python3}
RATES=${2:-20,60,100}
WORK=$(mktemp -d)
PORT=${PORT:-8765}
export MORPHO_VAR_DIR=$WORK MORPHO_MATRIX_PATH=$WORK/matrix.bin MORPHO_ENGINE_BACKEND=cpu \
       DATABASE_URL=sqlite:///$WORK/db.sqlite3 MORPHO_LOG_LEVEL=WARNING
"$PY" manage.py make_matrix --pages 256 --seed 1 --out "$WORK/matrix.bin" >/dev/null
"$PY" manage.py migrate -v 0
"$PY" -m gunicorn morphoweb.wsgi --bind 127.0.0.1:$PORT --workers 1 --threads 32 --timeout 120 \
    >"$WORK/gunicorn.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER; rm -rf "$WORK"' EXIT
for _ in $(seq 100); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.3; done
OUT=docs/benchmarks/policy_http_cpu.csv
: >"$OUT"
for policy in interactive-latency interactive-throughput interactive-slo; do
    "$PY" manage.py shell -c "from policies.models import BatchingPolicy as P; P.objects.get(name='$policy').activate()"
    sleep 1  # every engine applies it within a second
    "$PY" -m gpu_engine.bench.loadgen_http --url http://127.0.0.1:$PORT --rates "$RATES" \
        --duration 20 --warmup 2 --csv "$WORK/$policy.csv"
    if [ ! -s "$OUT" ]; then cat "$WORK/$policy.csv" >"$OUT"; else grep -v '^#' "$WORK/$policy.csv" | tail -n +2 >>"$OUT"; fi
done
"$PY" manage.py shell -c "from policies.models import BatchingPolicy as P; P.objects.get(name='interactive-latency').activate()"
echo "wrote $OUT"

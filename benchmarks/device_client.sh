#!/usr/bin/env bash
# One device call for the client's figures: client_throughput.py at 65,536 and 1,048,576 pages
# (both parties of `make run` on this host's GPU, the reference and the client in one run each),
# then the client's key generation at d = 16, 20, 25. Run from the repo root on the device with
# the Django/Celery wheels in WHL (default .whl):
#   bash benchmarks/device_client.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
WHL=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
# the protocol core and the client are distributions of this repository, not installed here
export PYTHONPATH=/tmp/site:$PWD:$PWD/pir:$PWD/client PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nproc
python3 benchmarks/keygen.py --domain-bits 16 20 25 --methods vectorised window_v2 window_v1 \
    --keys 3072 --repeats 5 --out "$OUT/keygen_h200host.csv" 2>&1 | tee "$OUT/keygen.log"
timeout 240 python3 benchmarks/client_throughput.py --pages 65536 --rows 20000 \
    --in-flight ${IN_FLIGHT_65K:-2,8,16,32} --key-formats v2 --reference-seconds 8 \
    --reference-procs 4 --reference-threads 8 --folder /tmp/ct65 \
    --out "$OUT/client_h200_65536p.csv" --plot "$OUT/client_h200_65536p.png" 2>&1 | tee "$OUT/bench65.log"
timeout 300 python3 benchmarks/client_throughput.py --pages 1048576 --rows ${ROWS_1M:-20000} \
    --in-flight ${IN_FLIGHT_1M:-8,32} --key-formats v2,v1 --reference-seconds 8 \
    --reference-procs 4 --reference-threads 8 --folder /tmp/ct1m \
    --out "$OUT/client_h200_1048576p.csv" --plot "$OUT/client_h200_1048576p.png" 2>&1 | tee "$OUT/bench1m.log"
tail -n 30 /tmp/ct65/devserver.log /tmp/ct1m/devserver.log > "$OUT/devserver_tail.log" 2>/dev/null
cat "$OUT"/client_h200_*.csv

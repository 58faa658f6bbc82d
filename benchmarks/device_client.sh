#!/usr/bin/env bash
# One device call for the client's figures: client_throughput.py at 65,536 and 1,048,576 pages
# (the parties of `make run` on this host, the reference and the client in one run each), then the
# client's key generation at d = 16, 20, 25. Each party gets a GPU of its own where the host has
# two (GPUS=0,1, as `make run GPU_A=0 GPU_B=1`; GPUS=0 puts both on GPU 0), and the files are
# named after the GPUs used: h200x2_65536_client.csv on two H200s, h100_65536_client.csv on one H100.
# PLANNERS= sets the client's key-making processes (default: the client's own choice). Run from
# the repo root on the device with the Django/Celery wheels in WHL (default .whl); about 5 minutes:
#   bash benchmarks/device_client.sh
set -uo pipefail
source benchmarks/device_env.sh
COUNT=$(wc -l < "$OUT/gpu.txt")
GPUS=${GPUS:-$([ "$COUNT" -ge 2 ] && echo 0,1 || echo 0)}
GPU_A=${GPUS%%,*}; GPU_B=${GPUS#*,}   # one id: both parties on it
TAG=$MODEL; [ "$GPU_A" != "$GPU_B" ] && TAG=${MODEL}x2   # a GPU for each party
PLACE=(--gpus "$GPU_A,$GPU_B")
echo "party A on GPU $GPU_A, party B on GPU $GPU_B; files named ${TAG}_*"
PLAN=(); [ -n "${PLANNERS:-}" ] && PLAN=(--planners "$PLANNERS")
python3 benchmarks/keygen.py --domain-bits 16 20 25 --methods vectorised window_v2 window_v1 \
    --keys 3072 --repeats 5 --out "$OUT/keygen_${MODEL}host.csv" 2>&1 | tee /tmp/keygen.log
# the client alone against stand-in parties on this host's CPU: its own ceiling, and its CPU a row
timeout 60 python3 benchmarks/client_ceiling.py --rows 32768 --in-flight 32 --repeats 1 \
    --planners 0,${PLANNERS:-2} --transports wire --out "$OUT/${MODEL}host_client_ceiling.csv" 2>&1 | tail -n 4
timeout 180 python3 benchmarks/client_throughput.py --pages 65536 --rows ${ROWS_65K:-50000} \
    --in-flight ${IN_FLIGHT_65K:-8,32} --key-formats v2 --reference-seconds 8 \
    --reference-procs 4 --reference-threads 8 --folder /tmp/ct65 "${PLACE[@]}" ${PLAN[@]+"${PLAN[@]}"} \
    --out "$OUT/${TAG}_65536_client.csv" --plot "$OUT/${TAG}_65536_client.png" 2>&1 | tee /tmp/bench65.log
timeout 270 python3 benchmarks/client_throughput.py --pages 1048576 --rows ${ROWS_1M:-20000} \
    --in-flight ${IN_FLIGHT_1M:-8,32} --key-formats v2,v1 --reference-seconds 8 \
    --reference-procs 4 --reference-threads 8 --folder /tmp/ct1m "${PLACE[@]}" ${PLAN[@]+"${PLAN[@]}"} \
    --out "$OUT/${TAG}_1048576_client.csv" --plot "$OUT/${TAG}_1048576_client.png" 2>&1 | tee /tmp/bench1m.log
tail -n 30 /tmp/ct65/devserver.log /tmp/ct1m/devserver.log > "$OUT/devserver_tail.log" 2>/dev/null
cat "$OUT"/*.csv

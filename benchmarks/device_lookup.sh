#!/usr/bin/env bash
# One device call for the lookups' figures: lookup_throughput.py over a records epoch of
# 1,048,576 pages (16,106,127 accounts built on this host's CPUs, both parties of `make run` on its
# GPU): the parties' 32-query batch reference, lookup_many from one client process, and morpho-rpc
# driven with plain JSON-RPC batches (web3.py is not installed here), in one run. Run from the repo
# root on the device with the Django/Celery wheels in WHL (default .whl); about 4 minutes; it
# leaves <gpu>_1048576_lookup.csv (h200_ or h100_) and two logs in $OUT:
#   bash benchmarks/device_lookup.sh   (LOAD=0.06: a sparse table of the same pages, built in seconds)
set -uo pipefail
source benchmarks/device_env.sh
# morpho-rpc is started as `python3 -m morpho_client.rpc`, its console script's own entry point
PAGES=${PAGES:-1048576}
CSV="$OUT/${MODEL}_${PAGES}_lookup.csv"
timeout ${LOOKUP_S:-420} python3 benchmarks/lookup_throughput.py --pages "$PAGES" --load ${LOAD:-0.96} \
    --keys ${KEYS:-30000} --in-flight ${IN_FLIGHT:-auto,32} --reference-seconds 8 \
    --reference-procs 4 --reference-threads 8 --rpc-keys ${RPC_KEYS:-20000} \
    --callers ${CALLERS:-16} --rpc-batch ${RPC_BATCH:-100} --folder /tmp/lt1m \
    --out "$CSV" 2>&1 | tee "$OUT/lookup_throughput.log"
tail -n 40 /tmp/lt1m/devserver.log > "$OUT/devserver_tail.log" 2>/dev/null
tail -n 20 /tmp/lt1m/morpho-rpc.log >> "$OUT/devserver_tail.log" 2>/dev/null
cat "$CSV"

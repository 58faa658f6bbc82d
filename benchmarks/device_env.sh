# Sourced by device scripts (device_client.sh, device_lookup.sh, device_defaults.sh,
# device_frontend.sh): the wheels in WHL
# (default .whl) installed into /tmp/site, this checkout's protocol core and client on PYTHONPATH
# (distributions of this repository, not installed there), $OUT made, the GPUs listed in
# $OUT/gpu.txt (index, name, memory, driver) and MODEL set from the first (h100, h200, ...).
export PYTHONUNBUFFERED=1
WHL=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/pir:$PWD/client PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nproc
MODEL=$(head -n 1 "$OUT/gpu.txt" | grep -o -i -E 'h100|h200|a100|l40s?' | head -n 1 | tr 'A-Z' 'a-z')
MODEL=${MODEL:-gpu}

#!/usr/bin/env bash
# HTTP-level Poisson sweep of the four interactive batching modes and the A/A control (issue 4): `make bench-policy-http`
# runs this. It starts its own gunicorn party in a temporary folder, activates each mode's policy
# live, and removes everything on the way out; see `python -m policies.bench_http --help`.
# Usage (from the repository root): [PY=.venv/bin/python] docs/benchmarks/policy_http_run.sh [OPTIONS]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
exec "$PY" -m policies.bench_http "$@"

# Entry points: `make run` (two local parties) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
SERVER_A ?= http://127.0.0.1:8001
SERVER_B ?= http://127.0.0.1:8002
BENCH_PAGES ?= 65536

.PHONY: venv run epoch test bench-http clean-var gpu-workers bench-bulk bench-policy-http superuser

# The virtualenv is (re)built when pyproject.toml changes; `pip install -e` keeps the tree live.
$(STAMP): pyproject.toml pir/pyproject.toml client/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ./pir -e ./client -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Parties A (127.0.0.1:8001) and B (127.0.0.1:8002) over one generated demo matrix (DEMO_PAGES,
# default 8192), each an engine server, gunicorn and bulk workers with its own SQLite database
# under var/. PORT_A=, PORT_B= and VAR= (the state folder) choose others. DEMO=accounts serves
# an Ethereum-like state (DEMO_ACCOUNTS, default 10000) as a records epoch, for lookups by key
# and morpho-rpc. Ctrl-C stops all. The admin's and the API docs' static files are gathered into
# STATIC_ROOT first; WhiteNoise serves them. GPU_A= and GPU_B= pin each party to its own GPUs
# (CUDA_VISIBLE_DEVICES of its processes, e.g. `make run GPU_A=0 GPU_B=1`); unset, both parties
# see the host's GPUs and each engine takes the first.
# `exec` makes the supervisor make's own child, so that it stops everything when make is killed.
PORT_A ?= 8001
PORT_B ?= 8002
VAR ?=
GPU_A ?=
GPU_B ?=
run: $(STAMP)
	$(PY) manage.py collectstatic --no-input -v0
	exec env $(if $(VAR),MORPHO_VAR_DIR=$(VAR)) $(PY) -m morphoweb.devserver --port-a $(PORT_A) --port-b $(PORT_B) \
		$(if $(DEMO),--demo $(DEMO)) $(if $(GPU_A),--gpu-a $(GPU_A)) $(if $(GPU_B),--gpu-b $(GPU_B))

# One new epoch on both parties of `make run` at once (docs/OPERATIONS.md: Switching epochs):
# MATRIX= its file, in the state folder's matrices/ (var/matrices/); EPOCH_ID= unless the file's sidecar names one; EPOCH_ARGS=
# more load_epoch options (--stop-the-world, --discard-updates, --placement shard, ...); VAR= as
# for `make run`. A party that already serves the epoch is left as it is.
MATRIX ?=
EPOCH_ID ?=
EPOCH_ARGS ?=
epoch: $(STAMP)
	@test -n "$(MATRIX)" || { echo "make epoch MATRIX=FILE [EPOCH_ID=N]: the epoch's matrix file" >&2; exit 2; }
	$(if $(VAR),MORPHO_VAR_DIR=$(VAR)) $(PY) -m morphoweb.devepoch '$(MATRIX)' $(if $(EPOCH_ID),--epoch-id $(EPOCH_ID)) $(EPOCH_ARGS)

# An admin user and its DRF token on both parties of `make run` (their databases
# $(PARTY_DB_DIR)/party-a.sqlite3 and party-b.sqlite3, migrated first): SUPERUSER (default admin)
# with a password asked for each party, or DJANGO_SUPERUSER_PASSWORD for both without asking.
# A user that exists is kept; each party's token is printed (the same one on a second run).
SUPERUSER ?= admin
SUPERUSER_EMAIL ?= $(SUPERUSER)@localhost
PARTY_DB_DIR ?= $(or $(VAR),$(MORPHO_VAR_DIR),var)
superuser: $(STAMP)
	@for party in a b; do \
		export DATABASE_URL="sqlite:///$(abspath $(PARTY_DB_DIR))/party-$$party.sqlite3"; \
		echo "party $$party: $(abspath $(PARTY_DB_DIR))/party-$$party.sqlite3"; \
		$(PY) manage.py migrate --no-input -v0 && \
		$(PY) manage.py createsuperuser --if-missing --username '$(SUPERUSER)' \
			--email '$(SUPERUSER_EMAIL)' $(if $(DJANGO_SUPERUSER_PASSWORD),--no-input) && \
		$(PY) manage.py drf_create_token '$(SUPERUSER)' || exit 1; \
	done

# The suite over every core (pytest-xdist; TEST_WORKERS=0 runs it in this process), a file to a
# worker: the servers a module starts once serve all its tests. PYTEST_ARGS picks tests by
# marker, e.g. -m 'not processes and not kernels' (pyproject.toml lists the markers).
# pytest's exit status 5 means "no tests collected": not a failure of the suite.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; exit 0; fi; exit $$rc

# End-to-end HTTP timings against parties already running (start them with
# `make run DEMO_PAGES=65536` in another terminal). The benchmarks: benchmarks/README.md.
bench-http: $(STAMP)
	$(PY) benchmarks/http_timings.py --server-a $(SERVER_A) --server-b $(SERVER_B) \
		--matrix var/demo-$(BENCH_PAGES)p.bin --out docs/benchmarks/http_cpu_$(BENCH_PAGES)p.csv

# One Celery worker per visible GPU (one on the CPU when none), for bulk jobs.
gpu-workers: $(STAMP)
	$(PY) bin/gpu-workers

# A 10,000-query bulk job against the engine's batch throughput on this machine.
bench-bulk: $(STAMP)
	$(PY) benchmarks/bulk.py --pages 1024 --queries 10000 --out docs/benchmarks/bulk_cpu_1024p.csv

# Poisson sweep over HTTP, 10% to 95% of the measured capacity, of the four interactive batching
# modes and the A/A control, each activated live in one gunicorn party that the command starts and
# stops itself (about 16 minutes with the defaults; matplotlib is installed for the plot).
POLICY_HTTP_ARGS ?= --csv docs/benchmarks/policy_http_cpu.csv --png docs/benchmarks/policy_http_cpu.png
bench-policy-http: $(STAMP)
	$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install --quiet 'matplotlib>=3.8,<4'
	$(PY) benchmarks/policy_http.py $(POLICY_HTTP_ARGS)

clean-var:
	rm -rf var/

# Two commands: `make app` (dashboard on 127.0.0.1) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: app test durations demo install clean chromium slurm slurm-local postgres netns matrix

$(BIN)/python:
	$(PY) -m venv $(VENV) || { apt-get install -y python3-venv && $(PY) -m venv $(VENV); }

# pip compiles each package's bytecode itself, on one core; --no-compile and compileall instead: torch's on the
# other core while pip installs the rest, then everything left on both, with this checkout's own code, which four
# test workers otherwise each compiled at once (stop 81: the install 98.1 -> 78.0 s of wall here, the same .pyc files;
# compileall exits 1 on torch's one file in 3.12 syntax, py312_intrinsics.py)
SITE = $(VENV)/lib/python3*/site-packages
OWN_CODE = app.py engine profilers tuning workbench tools tests bench
PIP = $(BIN)/pip install -q --no-compile

$(STAMP): $(BIN)/python pyproject.toml
	$(PIP) --upgrade pip
	# torch==2.13.0 is a local CPU build on our machines; pyproject states the tested range, torch>=2.13,<2.14.
	$(PIP) "torch==2.13.0"
	{ $(BIN)/python -m compileall -q $(SITE)/torch > /dev/null 2>&1 & }; \
		status=0; $(PIP) -e ".[dev]" || status=$$?; wait; exit $$status
	# DeepSpeed checks the DeepSpeed export: a CPU install without its CUDA ops (~1 min); its tests skip without it
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation "deepspeed>=0.19,<0.20" || echo "DeepSpeed not installed: its export tests will skip"
	# Holistic Trace Analysis reads our traces in a test; --no-deps: its metadata pulls in jupyterlab
	$(PIP) --no-deps "HolisticTraceAnalysis==0.5.0"
	$(BIN)/python -m compileall -q -j 0 $(SITE) $(OWN_CODE) > /dev/null 2>&1 || true
	touch $(STAMP)

install: $(STAMP)

# the dashboard's port: make app PORT=8502 (a second dashboard beside the first)
PORT ?= 8501

app: $(STAMP)
	$(BIN)/workbench app --port $(PORT)

demo: $(STAMP)
	$(BIN)/workbench run examples/tiny.yaml

# the browser test drives Debian's Chromium; without it (no root, no apt) that test skips with a reason
chromium:
	@command -v chromium >/dev/null 2>&1 || { echo "installing Debian's chromium for the browser test (apt-get, ~500 MB)"; (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 && echo "chromium installed" || echo "chromium not installed: the browser test will skip"; }

# the Slurm tests start a one-node cluster (munged, slurmctld, slurmd as root, tests/slurm_cluster.py);
# without root or apt they skip with a reason
slurm:
	@{ command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null 2>&1 || { echo "installing Debian's Slurm and munge for the Slurm tests (apt-get, ~13 MiB)"; (apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge) >/dev/null 2>&1 && echo "slurm installed" || echo "slurm not installed: the Slurm tests will skip"; }

# a one-node Slurm cluster on this machine to try `--launcher slurm` (root): prints the SLURM_CONF to export;
# Ctrl-C (or SIGTERM) cancels every job and stops munged, slurmctld and slurmd
slurm-local: $(STAMP) slurm
	$(BIN)/python -m tests.slurm_cluster

# N "nodes" as network namespaces joined by veth through a bridge (root): prints each node's address and the
# `workbench run --nnodes N --node-rank I --rdzv-endpoint ...` line to start on it; Ctrl-C removes them
netns: $(STAMP)
	$(BIN)/python -m tests.netns $(or $(N),2)

# the PostgreSQL tests need a server on 127.0.0.1:5432 (user postgres without a password, database test):
# tests/postgres_server.sh installs and starts Debian's server when none listens, and says so;
# without root or apt they skip with a reason
postgres:
	@bash tests/postgres_server.sh

# -rs: every skipped test is listed with its reason; the slowest work starts first, by tests/durations.json
# (tests/suite_order.py), which `make durations` rewrites from a whole run (commit it when the times have moved).
# Four workers on two cores, and both cores are busy: on 2026-11-28 /proc/stat read them 99.8-100% busy in every
# minute of a fresh clone's run but the last, so only less CPU makes it shorter (bench/quick_exit.py measures one
# such saving; issue 65's note says where the CPU goes: 333 torchrun ranks and 167 torchrun agents were 40% of it,
# mostly importing torch, until CPU ranks forked from the agent instead: engine/launch/agent.py, bench/launch_fork.py).
# Earlier: pytest took 1,657, 1,694 and 1,573 s with three workers, 1,403 and 1,641 s with four (stops 69-70)
# Stop 78: 99.5% busy over a whole run (user 83%, system 16%), python processes 2,289-2,511 s of CPU: the ranks a
# test forks (682), the agents (544: 154 launches), the workers' own tests (561), CLI calls (~350)
WORKERS ?= 4
# PYTHONDONTWRITEBYTECODE emptied: pytest keeps each test module's rewritten bytecode only where Python may write
# it; without it every worker rewrote all of them again (a collection took 13-19 s of CPU instead of 8)
test: $(STAMP) chromium slurm postgres
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rs -n $(WORKERS) --dist loadgroup --durations=30

durations: $(STAMP) chromium slurm postgres
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rs -n $(WORKERS) --dist loadgroup --durations=30 --record-durations

# the compatibility matrix (docs/compatibility.md): re-runs the accepted cells whose result is stale (another
# plan, or a change to the code that cell runs: tools/matrix/compat_code.py) or missing, or CELLS=a+b,c+d, or
# CELLS=all; it prints how many and about how long first; each result goes to docs/data/matrix.json as it
# ends, with the document re-rendered (a killed run keeps every finished cell)
matrix: $(STAMP)
	@$(BIN)/python -m tools.matrix --estimate "$(or $(CELLS),stale)"
	@status=0; MATRIX_CELLS="$(or $(CELLS),stale)" MATRIX_RECORD=docs/data/matrix.json OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q -p no:cacheprovider -rf tests/test_matrix.py::test_cell || status=$$?; \
	$(BIN)/python -m tools.matrix --write docs/compatibility.md; \
	if [ -z "$(CELLS)" ]; then $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_matrix.py::test_every_accepted_cell_has_a_passing_current_result || status=$$?; fi; exit $$status

clean:
	rm -rf $(VENV)

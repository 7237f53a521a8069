# Two commands: `make app` (dashboard on 127.0.0.1) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: app test demo install clean chromium slurm

$(BIN)/python:
	$(PY) -m venv $(VENV) || { apt-get install -y python3-venv && $(PY) -m venv $(VENV); }

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is a local CPU build on our machines; pyproject keeps torch>=2.6 for GPU users.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	# DeepSpeed checks the DeepSpeed export: a CPU install without its CUDA ops (~1 min); its tests skip without it
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed>=0.19,<0.20" || echo "DeepSpeed not installed: its export tests will skip"
	# Holistic Trace Analysis reads our traces in a test; --no-deps: its metadata pulls in jupyterlab
	$(BIN)/pip install -q --no-deps "HolisticTraceAnalysis==0.5.0"
	touch $(STAMP)

install: $(STAMP)

app: $(STAMP)
	$(BIN)/workbench app

demo: $(STAMP)
	$(BIN)/workbench run examples/tiny.yaml

# the browser test drives Debian's Chromium; without it (no root, no apt) that test skips with a reason
chromium:
	@command -v chromium >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 || echo "chromium not installed: the browser test will skip"; }

# the Slurm tests start a one-node cluster (munged, slurmctld, slurmd as root, tests/slurm_cluster.py);
# without root or apt they skip with a reason
slurm:
	@{ command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge) >/dev/null 2>&1 || echo "slurm not installed: the Slurm tests will skip"; }

test: $(STAMP) chromium slurm
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=30

clean:
	rm -rf $(VENV)

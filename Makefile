# make run           - set up, then the offline demo (4 processes on CPU, real data)
# make test          - set up, then the test suite (what CI runs)
# make test-fast     - set up, then every module's unit tests (no multi-rank jobs; <= 3 min)
# make memory-table  - GPU-free per-rank memory estimates of the paper-scale configs
# make bench         - SDP vs DDP on tiny models (CPU): bytes, comm, step time, serial vs overlapped comm
# make bench-overhead - kernel launches and host time per phase of a step, every variant (CPU, no GPU needed)
# make mixed-gpus    - workers of different capacities vs uniform coverage and DDP (CPU): per-rank bytes, quality
# make plans         - docs/plan.md's three worked examples of sdp.plan for llama_1b (results/plan), and their check
# make tables        - CPU-scale replicas of the paper's tables and plots: measured step budgets, an lr grid per row, 5 or 3 seeds, claims.md (results/cpu_replica)
# make rho           - the spectral gap against convergence (results/cpu_replica/rho_convergence.*)
# make soak          - reliability soak: a sweep of many short runs with one forced failure (CPU)
SHELL := /bin/bash
PYTHON_BIN ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: setup cxx run test test-fast fuzz lint clean memory-table bench bench-overhead mixed-gpus plans plan-check tables rho soak lowcomm

setup: $(STAMP) $(FMNIST) cxx

# torch.compile's inductor writes C++ on CPU (parallelism.compile=true, and the tests): a compiler.
cxx:
	@if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; \
		else \
			echo "No C++ compiler (inductor needs one): run 'sudo apt-get install g++'" >&2; exit 1; \
		fi; \
	fi

# The venv is ~6 GB: built once, rebuilt only when pyproject.toml changes.
$(STAMP): pyproject.toml
	@$(PYTHON_BIN) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 is required, found {sys.version.split()[0]}"'
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# Fashion-MNIST (real, offline) comes from Debian's dataset-fashion-mnist package.
$(FMNIST):
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; \
	else \
		echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist'" >&2; exit 1; \
	fi

run: setup
	$(PY) scripts/demo.py

# The full suite (what CI runs), with its 15 slowest tests and the processes it started.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# Every module's unit tests, without the multi-rank jobs and the slow ones, on both cores (<= 3 min).
test-fast: setup
	$(PY) -m pytest -q -n 2 -m "not slow and not dist" --durations=5

# Every case of the bad-input fuzz over every entrypoint and every key of the typed config (the suite runs a sample; about 5 min).
fuzz: setup
	SDP_FUZZ=all $(PY) -m pytest -q -s tests/test_fuzz_entrypoints.py

# Estimated per-rank memory of the paper-scale configs (GPU-free; about 3 min on 2 cores).
memory-table: setup
	$(PY) scripts/memory_table.py --world-size 8 --out results/tables/memory_estimates

# DDP vs the four SDP variants (serial and overlapped) on tiny models, 4 CPU processes: ratios of bytes,
# live peak, comm, step time, exposed communication, and the step-time model's check (about 8 min).
bench: setup
	$(PY) scripts/bench_sdp.py --out results/bench/sdp_cpu_k4.md

# What a step pays per op: kernel launches (as a GPU would launch them) and host time per phase of one
# rank of K = 8, llama_134m and resnet18, DDP and every SDP variant, with FSDP and the outer loop (about 8 min).
bench-overhead: setup
	$(PY) scripts/bench_overhead.py --out results/bench

# Workers of capacities [1, 1, 0.5, 0.5] against uniform C = 0.75 and DDP, 4 CPU processes on real data:
# each rank's bytes (checked against its held units), bytes sent and quality (about 15 min).
mixed-gpus: setup
	$(PY) scripts/mixed_gpus.py
	$(PY) scripts/mixed_gpus.py --text

PLAN = $(PY) -m sdp.plan experiment=llama_1b_fineweb top=8
LOWCOMM_PLAN = $(PY) -m sdp.plan experiment=llama_134m_fineweb outer=diloco devices=8x80 precision=bf16 checkpointing=none granularity=neuron top=8
plans: setup
	$(PLAN) devices=8x80 cluster=h100_nvlink out=results/plan/nvlink
	$(PLAN) devices=8x24 cluster=h100_ib nodes=2 out=results/plan/ib
	$(PLAN) devices=4x80+4x24 cluster=h100_nvlink out=results/plan/mixed
	$(LOWCOMM_PLAN) cluster=h100_nvlink out=results/plan/lowcomm_h100_nvlink
	$(LOWCOMM_PLAN) cluster=h100_eth1g nodes=2 out=results/plan/lowcomm_h100_eth1g
	$(PY) scripts/plan_check.py results/plan/nvlink/plan.json --sample 3
	$(PY) -m sdp.plan experiment=replica_fmnist devices=4x24 cluster=cpu_2core top=all out=results/plan/replica_fmnist_speed
	$(PY) -m sdp.plan experiment=replica_fmnist devices=4x24 cluster=cpu_2core top=all out=results/plan/replica_fmnist_target \
		objective=time_to_target quality=results/cpu_replica/resnet_tiny_fashion_mnist.csv

plan-check: setup  # every row of the three llama_1b plans against whole traces (~6 + 10 + 30 min here)
	$(PY) scripts/plan_check.py results/plan/nvlink/plan.json --out results/plan/nvlink/check.json
	$(PY) scripts/plan_check.py results/plan/ib/plan.json --out results/plan/ib/check.json
	$(PY) scripts/plan_check.py results/plan/mixed/plan.json --out results/plan/mixed/check.json

clean:
	rm -rf outputs .pytest_cache

lint: setup
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts

# CPU-scale replicas of the paper's tables: 4 CPU processes a run on real offline data; DDP's probe
# measures each table's step budget, every row gets an lr grid on seed 0, then 5 or 3 seeds at its
# best rate; sdp.collect --claims over the chosen runs (outputs/cpu_replica; completed runs are
# not rerun, and results/cpu_replica/runs keeps them, so the work can be spread over several calls,
# sessions or machines).
tables: setup
	$(PY) scripts/cpu_replica.py --runs outputs/cpu_replica --out results/cpu_replica

# An exploratory low-communication sweep: DDP, DiLoCo (H = 10, 50) and SDP with and without DiLoCo, 4 CPU
# processes, seeds 0-2, short and untuned (scripts/lowcomm.py; tables in outputs/lowcomm/tables). The
# converged comparison is make tables' DiLoCo rows (docs/lowcomm.md).
lowcomm: setup
	$(PY) scripts/lowcomm.py --runs outputs/lowcomm --out outputs/lowcomm/tables

# The spectral gap against convergence: K = 4, C = 0.5, cyclic / random / blocked masks (21 runs, about 1.7 hours on 2 cores).
rho: setup
	$(PY) scripts/rho_convergence.py --runs outputs/rho --out results/cpu_replica

# Reliability soak: 25 short 2-process runs in one sweep, one made to diverge; checks that the
# others complete and sweep.json marks only that one failed (scripts/soak.py; about 3 min on 2 cores).
soak: setup
	$(PY) scripts/soak.py

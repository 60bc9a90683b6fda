# SpotRL. `make demo` runs the main job; `make test` runs everything CI runs.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
UV      ?= $(shell command -v uv 2>/dev/null || echo $(VENV)/bin/uv)
# vLLM: its CPU build (extra `cpu`, x86-64) where no NVIDIA driver is installed, the CUDA
# build (extra `gpu`) where one is: `make install EXTRAS=operator,runtime,dev,gpu` chooses.
VLLM_EXTRA ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
EXTRAS  ?= operator,runtime,dev,$(VLLM_EXTRA)
PYTEST_ARGS ?=

.PHONY: help install lock generate lint typecheck test test-changed test-fast test-count toolchain scan bench bench-check demo docs docs-serve cluster-up cluster-down test-cluster test-e2e mutations e2e-kind e2e-kind-ci images clean

help: ## list the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml constraints.txt overrides.txt
	@$(if $(findstring cpu,$(EXTRAS)),e2e/toolchain/system-packages.sh "make install" libnuma.so.1:libnuma1)
	@command -v uv >/dev/null || python3 -m pip install -q uv
	uv venv -q --allow-existing $(VENV) --python python3.11
	uv pip install -q --python $(PY) -c constraints.txt --override overrides.txt -e ".[$(EXTRAS)]"
	@touch $@

install: $(VENV)/.installed ## create .venv with the pinned dependencies

lock: ## re-pin constraints.txt from pyproject.toml (keeping every pin that still fits)
	cp constraints.txt constraints.txt.new  # uv keeps the pins of its output file where it can
	uv pip compile pyproject.toml --all-extras --override overrides.txt --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 --no-header --quiet -o constraints.txt.new
	{ head -2 constraints.txt; cat constraints.txt.new; } > constraints.txt.tmp && rm constraints.txt.new
	mv constraints.txt.tmp constraints.txt

generate: install ## regenerate the CRD and the docs' reference pages (RLJob, CLI, operator, metrics, checks) from the code
	$(PY) -m spotrl_runtime.api.crd
	$(PY) -m spotrl_runtime.api.reference

lint: install ## ruff (lint and format), mypy, and a check that generated files are current
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m spotrl_runtime.api.crd --check
	$(PY) -m spotrl_runtime.api.reference --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .out/site-check

docs: install ## build the docs site into site/ (mkdocs, strict: a broken link or a page outside the nav fails)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install ## serve the docs site on http://127.0.0.1:8000, rebuilt on every edit
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

toolchain: ## build etcd, kube-*, kubectl, helm, the S3 server, kube-score and checkov into ~/.cache/spotrl/tools
	e2e/toolchain/build.sh

scan: install toolchain ## checkov and kube-score on the chart and the operator's objects; fails beyond e2e/scan/allowlist.yaml
	$(PY) e2e/scan/scan.py

CLUSTER_DIR ?= $(or $(TMPDIR),/tmp)/spotrl-cluster

cluster-up: install toolchain ## start the test cluster (etcd, kube-*, node agent) in the background; prints export KUBECONFIG=...
	PYTHONPATH=e2e $(PY) -m spotrl_e2e.cluster up --dir $(CLUSTER_DIR) $(CLUSTER_ARGS)

cluster-down: ## stop everything cluster-up started (nothing is left running)
	PYTHONPATH=e2e $(PY) -m spotrl_e2e.cluster down --dir $(CLUSTER_DIR)

test-cluster: install toolchain ## the cluster and S3 tests only (they start and stop their own cluster)
	$(PY) -m pytest tests/cluster $(PYTEST_ARGS)

test-e2e: install toolchain ## the operator and end-to-end tests on the test control plane
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

APP_VERSION := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' charts/spotrl/Chart.yaml)
IMAGES ?= operator runtime-cpu

images: ## build spotrl-operator and spotrl-runtime-cpu, tagged the chart's appVersion (IMAGES="operator runtime": the CUDA runtime)
	e2e/kind/images.sh $(APP_VERSION) $(IMAGES)

e2e-kind: install toolchain ## every end-to-end test on a kind cluster built here (root, Docker); KEEP_CLUSTER=1 keeps it
	e2e/kind/run.sh $(PYTEST_ARGS)

e2e-kind-ci: install toolchain ## the kind subset CI runs: the README's first hour, then the tests marked kind_ci (a drain after a notice, the leader's pod killed mid-barrier, an abrupt node loss, retention Delete, Kueue quota and preemption)
	SPOTRL_KIND_SUBSET=ci e2e/kind/run.sh $(PYTEST_ARGS)

REPORT ?= .out/test-report
# The kind subset runs as the last lane's next step, beside the first lane's end (e2e/suite.sh,
# SPOTRL_SUITE_THEN): its nodes share one prebuilt containerd store, so it loads no image into
# them, the load that had slowed the tests beside it by more than it saved (docs/benchmarks.md, CI).
# The tests it runs (marked kind_ci) run there only, not also on the test control plane.

test: lint toolchain ## everything CI runs: lint, types, every pytest suite, the kind subset; where the time went: .out/test-report
	@e2e/toolchain/system-packages.sh "make test" pgrep:procps curl:curl debootstrap:debootstrap dockerd:docker.io
	@mkdir -p $(REPORT) && rm -f $(REPORT)/pytest*.xml .e2e-kind/timings
	@rc=0; PY=$(PY) SPOTRL_SUITE_THEN="$(MAKE) --no-print-directory e2e-kind-ci PYTEST_ARGS=" SPOTRL_SUITE_NOT=kind_ci \
	  e2e/suite.sh $(REPORT) $(PYTEST_ARGS) || rc=$$?; \
	  PYTHONPATH=e2e $(PY) -m spotrl_e2e.durations $(REPORT)/pytest-*.xml --kind .e2e-kind/timings > $(REPORT)/durations.txt \
	    && echo "== where the time went ($(REPORT)/durations.txt)" && head -n 60 $(REPORT)/durations.txt; \
	  if [ -s $(REPORT)/failures.txt ]; then echo "== what failed, last ($(REPORT)/failures.txt)"; cat $(REPORT)/failures.txt; fi; \
	  exit $$rc

bench: install ## run every benchmark in bench/ (each prints a small table; S3 ones start their own versitygw)
	@set -e; for f in bench/bench_*.py; do echo "== $$f"; PYTHONPATH=e2e $(PY) $$f; done

# The benchmarks with a target that finish in minutes, at fewer repeats and steps than their
# defaults: their targets hold with wide margins (docs/benchmarks.md). Each runs even
# after another missed a target, so that one run names every miss; then make exits 1.
BENCH_CHECK := "bench_periodic_stall.py --repeat 1" "bench_delta.py --policies 100m --repeat 1 --resume-steps 1" "bench_delta_stall.py --steps 10"
bench-check: install ## the fast benchmarks with --check (bench_periodic_stall, bench_delta at 100m, bench_delta_stall); exit 1 naming each target missed
	@rc=0; for b in $(BENCH_CHECK); do echo "== bench/$$b --check"; PYTHONPATH=e2e $(PY) bench/$$b --check || rc=1; done; exit $$rc

mutations: install toolchain ## each tests/mutations/*.patch applied to a scratch copy: its named tests must fail (PATCHES="..." runs some; not in CI: slow)
	PYTHONPATH=e2e $(PY) -m spotrl_e2e.mutations $(PATCHES)

test-changed: install ## the tests a change touches (against origin/main, else HEAD; BASE=<ref> picks another)
	@paths=$$(PYTHONPATH=e2e $(PY) -m spotrl_e2e.changed $(if $(BASE),--base $(BASE))); \
	  if [ -n "$$paths" ]; then $(PY) -m pytest $$paths $(PYTEST_ARGS); fi

test-count: install ## print how many tests `make test` collects (pytest's collection, never a hand count)
	@$(PY) -m pytest --collect-only -q $(PYTEST_ARGS) | tail -n 1

test-fast: install ## the quick subset for local work: unit tests only
	$(PY) -m pytest tests/unit -m "not slow" $(PYTEST_ARGS)

demo: install ## the main job: train the tiny example, preempt it with SIGTERM, resume, show what survived
	$(PY) examples/demo.py

clean: ## remove the virtualenv and caches in the work tree
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

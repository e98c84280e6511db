# One command each, on a fresh machine: `make demo` runs the main job, `make test` the suite.
# Each creates its virtual environment on first use and reuses it after.

PYTHON ?= python3
UV := uv==0.13.9
VENV := .venv
VENV211 := .venv-211
VENV215 := .venv-215
PYTEST_ARGS ?=
# Two pytest workers, one test file each at a time (pytest-xdist; 0: one process). On the 2-core CI
# machine the multi-rank tests leave cores idle while launchers start and ranks wait on each other.
PYTEST_WORKERS ?= 2
PYTEST := -m pytest tests $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
# Overrides for the demo, e.g. `make demo DEMO_ARGS=loggers.wandb=true` (an offline wandb run).
DEMO_ARGS ?=

# Python writes bytecode caches here even where the machine's environment says not to (PYTHONDONTWRITEBYTECODE=1
# on the development and CI machines): uv installs no .pyc, so without them every interpreter a test starts (each
# rank of a launch) compiles torch, Composer and transformers from source (import torch 4.1-5.2 s against 2.5-3.1 s).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo demo-pp demo-varlen foundry-demo docs test test-every test-repeat test-full test-full-cores test-quick test-211 test-215 venv venv-211 venv-215 wheelhouse clean-venv

# The default environment, Composer 0.32.1's own pin (torch 2.7.0), installed by uv (the same resolution as pip's,
# in about 30 s where pip took 220 s on CI's 2 cores: most of it torch's download).
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q $(UV)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/uv pip install -q -e '.[dev]'
	touch $@

# llm-foundry 0.22.0 in the default environment (it pins torch<2.7.1: this leg only). What its train
# path imports comes pinned from requirements/foundry.txt, then llm-foundry itself without its
# dependency set (see that file for why).
$(VENV)/.foundry: $(VENV)/.installed requirements/foundry.txt
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/uv pip install -q -r requirements/foundry.txt
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/uv pip install -q --no-deps llm-foundry==0.22.0
	touch $@

# torch 2.11 (the GPU machines' torch) and 2.15 (the newest the registry serves), each in one command:
# uv's --override puts the file's torch in place of Composer's pin (docs/supported-versions.md), the
# requirements file adds the leg's test tools. uv reads no pip configuration (a machine-wide pip cap at
# the torch releases kept on disk does not apply) and downloads torch from the index.
$(VENV211)/.installed: setup.py requirements/torch-2.11.txt requirements/override-torch-2.11.txt
	$(PYTHON) -m venv $(VENV211)
	$(VENV211)/bin/python -m pip install -q $(UV)
	VIRTUAL_ENV=$(abspath $(VENV211)) $(VENV211)/bin/uv pip install -q --override requirements/override-torch-2.11.txt -e . -r requirements/torch-2.11.txt
	touch $@

$(VENV215)/.installed: setup.py requirements/torch-2.15.txt requirements/override-torch-2.15.txt
	$(PYTHON) -m venv $(VENV215)
	$(VENV215)/bin/python -m pip install -q $(UV)
	VIRTUAL_ENV=$(abspath $(VENV215)) $(VENV215)/bin/uv pip install -q --override requirements/override-torch-2.15.txt -e . -r requirements/torch-2.15.txt
	touch $@

venv: $(VENV)/.installed
venv-211: $(VENV211)/.installed
venv-215: $(VENV215)/.installed

demo: $(VENV)/.installed
	WANDB_MODE=$${WANDB_MODE:-offline} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/composer -n 2 -m automicro.train tiny-cpu $(DEMO_ARGS)

# Pipeline parallelism: 2 CPU ranks = 2 stages (ZeroBubble), auto microbatching under a memory cap.
demo-pp: $(VENV)/.installed
	WANDB_MODE=$${WANDB_MODE:-offline} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/composer -n 2 -m automicro.train tiny-cpu-pp $(DEMO_ARGS)

# Variable-length data under a token budget: 2 CPU ranks, batches padded to their longest sample.
demo-varlen: $(VENV)/.installed
	WANDB_MODE=$${WANDB_MODE:-offline} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/composer -n 2 -m automicro.train tiny-cpu-varlen $(DEMO_ARGS)

# llm-foundry's own train path with automicro: a tiny MPT on 2 CPU ranks under an emulated memory cap.
foundry-demo: $(VENV)/.foundry
	WANDB_MODE=$${WANDB_MODE:-offline} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/composer -n 2 -m automicro.foundry configs/foundry-tiny-cpu.yaml $(DEMO_ARGS)

# The documentation site (MkDocs, mkdocs.yml) into site/, strict: a broken link, a page left out of
# the nav or a config key without a meaning fails. The configuration reference is generated from the
# code at every build (scripts/docs_hooks.py).
# Its own small environment: the API reference is read from the source, nothing is imported.
VENVDOCS := .venv-docs
$(VENVDOCS)/.installed: requirements/docs.txt
	$(PYTHON) -m venv $(VENVDOCS)
	$(VENVDOCS)/bin/python -m pip install -q $(UV)
	VIRTUAL_ENV=$(abspath $(VENVDOCS)) $(VENVDOCS)/bin/uv pip install -q -r requirements/docs.txt
	touch $@

docs: $(VENVDOCS)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENVDOCS)/bin/mkdocs build --strict --site-dir site

test: $(VENV)/.installed $(VENV)/.foundry
	$(VENV)/bin/python $(PYTEST) $(PYTEST_ARGS)

# Every draw the gate can make, on its three legs (`.ci/run` with AUTOMICRO_EVERY=1: every fault-matrix cell, every 4-rank
# launch, every launch of every file on each torch; the full tier left out): green before a change to the tests or to a
# multi-rank path lands, since each CI run draws a share of them (CONTRIBUTING.md, "Before a change lands").
test-every:
	AUTOMICRO_EVERY=1 bash .ci/run

# The flake hunt: the gate's launches (every draw) N times over beside HOGS busy processes, each test's passes and
# failures (scripts/test_repeat.py; REPEAT_ARGS: more pytest arguments, e.g. one file).
N ?= 3
HOGS ?= 2
REPEAT_ARGS ?=
test-repeat: $(VENV)/.installed $(VENV)/.foundry
	$(PYTHON) scripts/test_repeat.py --python $(VENV)/bin/python --rounds $(N) --hogs $(HOGS) -- $(REPEAT_ARGS)

# The full tier: the gate (`make test`) and the tests tests/gate.py leaves out of it, every cell of the
# fault matrices (`make test` draws a seeded sample that covers every site: tests/matrix.py;
# AUTOMICRO_TEST_SEED=N repeats the draw a run printed) and every 4-rank launch.
test-full: $(VENV)/.installed $(VENV)/.foundry
	$(VENV)/bin/python $(PYTEST) --full $(PYTEST_ARGS)

# The same full tier spread over every core of this machine (about 6 minutes on 16 cores): one pytest
# worker a core, one intra-op thread each, the costliest test files first (scripts/full_suite.sh).
test-full-cores: $(VENV)/.installed $(VENV)/.foundry
	PYTHON=$(abspath $(VENV))/bin/python bash scripts/full_suite.sh

# The development loop (a few minutes, not a gate: CI runs `make test`): the policy, its property
# tests, the layout and capacity logic, config parsing, and one 2-rank end-to-end run of the demo
# config under the composer launcher.
QUICK := tests/test_policy.py tests/test_policy_properties.py tests/test_probe.py tests/test_layout.py \
	tests/test_capacity.py tests/test_config.py tests/test_floor_rule.py
test-quick: $(VENV)/.installed
	$(VENV)/bin/python -m pytest $(QUICK) -m "not multiproc" $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest tests/test_dashboard.py -k launcher_runs_tiny_cpu_config $(PYTEST_ARGS)

test-211: $(VENV211)/.installed
	$(VENV211)/bin/python $(PYTEST) $(PYTEST_ARGS)

test-215: $(VENV215)/.installed
	$(VENV215)/bin/python $(PYTEST) $(PYTEST_ARGS)

wheelhouse:
	bash scripts/gpu_wheelhouse.sh

clean-venv:
	rm -rf $(VENV) $(VENV211) $(VENV215) $(VENVDOCS)

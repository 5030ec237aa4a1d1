# Two commands do all set-up on a fresh machine:
#   make demo   installs what it needs, then runs examples/ddp on 2 local nodes
#   make test   installs what it needs, then runs the whole test suite
# Python packages come from requirements.lock (exact versions and hashes);
# `make lock` refreshes it, `make test-min` / `make test-latest` check the
# ranges in pyproject.toml at their lowest and newest ends.
SHELL := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
LOCK   := requirements.lock
PIP_VERSION := 26.3
# The demo's and the tests' training stack (not a dependency of gpuctl).
TORCH  ?= torch==2.13.0 numpy==2.4.6
# The JAX example's and the Python API's JAX test (CPU; jax's gloo collectives across nodes).
JAX    ?= jax==0.10.2 jaxlib==0.10.2
# podman and runc: the container tests (image_id: docker:IMAGE); runc named so that
# apt does not pick crun, which cannot run containers under hybrid cgroups.
# rclone and fuse3: the cloud-bucket tests (rclone copy/mount against moto's S3).
# chromium: the dashboard's browser tests (Playwright drives it; its own browser is never fetched).
APT_PACKAGES := openssh-server openssh-client rsync iproute2 sudo podman runc rclone fuse3 chromium
# Rootful podman gives containers 1048576 open files and processes; where the hard
# limits are lower (this machine itself in a container), runc cannot start one:
# the hard limits then, and no more processes than pid_max (runc is refused above it).
PODMAN_ULIMITS := /etc/containers/containers.conf.d/50-gpuctl-ulimits.conf
PYTEST_ARGS ?=
# The suite mostly waits on nodes, Terraform and Ansible: several workers keep 2 cores busy
# (tests/conftest.py keeps the tests that share a cluster on one worker, slowest first).
TEST_WORKERS ?= 5
# What test-min and test-latest run: no nodes, no cloud, just gpuctl's code and CLI.
BOUND_TESTS := tests/unit tests/integration/test_cli_errors.py tests/integration/test_cli_usage.py

.PHONY: all deps system-deps venv bytecode test-bytecode demo test test-min test-latest versions lock lint tf-test collection clean

all: test

# Debian packages the local nodes and the sync stage need. Installed only when
# missing; needs root (as on CI); otherwise tells you what to install.
system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "==> apt-get install$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "Please install:$$missing (sudo apt-get install$$missing)"; exit 1; fi; \
	fi
	@command -v terraform >/dev/null || { echo "terraform is not on PATH: install Terraform >= 1.5"; exit 1; }
	@if [ "$$(id -u)" = 0 ] && command -v podman >/dev/null && [ ! -e $(PODMAN_ULIMITS) ]; then \
	  n=$$(ulimit -Hn); p=$$(ulimit -Hu); m=$$(cat /proc/sys/kernel/pid_max); \
	  [ "$$n" = unlimited ] && n=1048576; [ "$$p" = unlimited ] && p=1048576; [ "$$p" -gt "$$m" ] && p=$$m; \
	  if [ "$$n" -lt 1048576 ] || [ "$$p" -lt 1048576 ]; then \
	    echo "==> $(PODMAN_ULIMITS): container limits nofile=$$n nproc=$$p (the hard limits here)"; \
	    mkdir -p $$(dirname $(PODMAN_ULIMITS)) && \
	    printf '# gpuctl (make system-deps): podman'"'"'s defaults exceed this machine'"'"'s hard limits\n[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' \
	      $$n $$n $$p $$p > $(PODMAN_ULIMITS); \
	  fi; \
	fi

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# Exactly the lock: every package pinned and hash-checked, nothing resolved here.
# Each step says what it installs; torch, the large one, shows pip's own progress.
$(VENV)/.deps: $(LOCK) pyproject.toml | $(BIN)/activate
	@echo "==> [1/3] pip $(PIP_VERSION) into $(VENV)"
	$(BIN)/pip install -q pip==$(PIP_VERSION)
	@echo "==> [2/3] gpuctl and its dependencies, exactly as $(LOCK) pins them ($$(grep -c '^[a-z]' $(LOCK)) packages)"
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	@$(BIN)/python -c 'import torch' 2>/dev/null && echo "==> [3/3] torch: already installed" || { \
	  echo "==> [3/3] $(TORCH): the examples' training stack (CPU build, a large download)"; \
	  $(BIN)/pip install --progress-bar on $(TORCH); }
	touch $@

# Only the suite needs JAX (the JAX example's test), not the demo.
$(VENV)/.jax: $(VENV)/.deps
	@$(BIN)/python -c 'import jax' 2>/dev/null || { echo "==> $(JAX): the JAX example's test"; \
	  $(BIN)/pip install -q $(JAX); }
	touch $@

venv: $(VENV)/.deps

deps: system-deps venv

demo: deps bytecode
	cd examples/ddp && $(abspath $(BIN))/gpuctl apply cluster.yaml; rc=$$?; \
	$(abspath $(BIN))/gpuctl down ddp-demo; exit $$rc

# The tools the suite drives, so a drift of a system package shows in the log.
versions:
	@echo "==> versions: $$(terraform version 2>/dev/null | head -1) | ansible-core $$($(BIN)/python -c 'import ansible.release as r; print(r.__version__)') | $$(rsync --version | head -1 | sed 's/  */ /g') | $$(ssh -V 2>&1) | $$(podman --version 2>/dev/null || echo no podman) | $$(rclone version 2>/dev/null | head -1 || echo no rclone)"

# gpuctl's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (CI images set it), every
# `gpuctl` run would compile the modules it imports again (a third of a short command's CPU).
bytecode:
	@$(BIN)/python -m compileall -q -j 0 cli/gpuctl

# The tests' bytecode too: their helpers', and the test modules as pytest rewrites their asserts,
# which it keeps beside them only where bytecode may be written; otherwise every test worker
# rewrites every module again (6 CPU-s each). Collected in two halves side by side.
test-bytecode: bytecode
	@$(BIN)/python -m compileall -q -l -j 0 tests  # the helpers beside the test folders
	@for half in tests/unit tests/integration; do \
	  env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q --collect-only -p no:cacheprovider $$half >/dev/null & \
	done; wait

test: deps $(VENV)/.jax versions test-bytecode
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15 $(PYTEST_ARGS)

# Refresh the lock after changing a range in pyproject.toml (or to take new releases).
lock: $(BIN)/activate
	@test -x $(BIN)/uv || $(BIN)/pip install -q uv
	$(BIN)/uv pip compile -q pyproject.toml --extra test --generate-hashes --universal \
	  --python-version 3.10 -o $(LOCK)

# The ranges' two ends, each in its own venv resolved by uv: the newest
# versions pyproject.toml allows, and the lowest of every direct dependency.
test-latest: venv
	$(MAKE) --no-print-directory bound-venv BOUND=latest RESOLUTION=highest

test-min: venv
	$(MAKE) --no-print-directory bound-venv BOUND=min RESOLUTION=lowest-direct

bound-venv:
	rm -rf $(VENV)-$(BOUND)
	$(BIN)/uv venv -q --python $(PYTHON) $(VENV)-$(BOUND)
	$(BIN)/uv pip compile -q pyproject.toml --extra test --resolution $(RESOLUTION) \
	  --python $(VENV)-$(BOUND)/bin/python -o $(VENV)-$(BOUND)/requirements.txt
	$(BIN)/uv pip install -q --python $(VENV)-$(BOUND)/bin/python -r $(VENV)-$(BOUND)/requirements.txt
	$(BIN)/uv pip install -q --python $(VENV)-$(BOUND)/bin/python --no-deps -e .
	@echo "==> $(BOUND): $$(grep -E '^(typer|click|pydantic|ansible-core|ansible-runner|boto3|rich|pyyaml|jinja2)==' $(VENV)-$(BOUND)/requirements.txt | tr '\n' ' ')"
	$(VENV)-$(BOUND)/bin/python -m pytest -q $(BOUND_TESTS)

# gpuctl's roles and playbooks as the Ansible collection gpuctl.cluster (dist/gpuctl-cluster-VERSION.tar.gz),
# with the node's files (agent, probes) built into role gpuctl_node from cli/gpuctl/node/.
collection: venv
	$(BIN)/python -m gpuctl.configplane.collection dist/

# Python (ruff: the rules pyproject.toml's [tool.ruff] selects), Ansible, YAML and Terraform style;
# .ci/run runs it after the tests.
lint: venv
	$(BIN)/ruff check cli/gpuctl tests benchmarks
	$(BIN)/ansible-lint ansible/
	$(BIN)/yamllint ansible/
	terraform fmt -check -recursive terraform/

clean:
	rm -rf $(VENV) $(VENV)-min $(VENV)-latest .pytest_cache

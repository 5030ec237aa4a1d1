# Two commands do all set-up on a fresh machine:
#   make demo   installs what it needs, then runs examples/ddp on 2 local nodes
#   make test   installs what it needs, then runs the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0 numpy
APT_PACKAGES := openssh-server openssh-client rsync iproute2
PYTEST_ARGS ?=

.PHONY: all deps system-deps venv demo test lint tf-test clean

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

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	touch $@

venv: $(VENV)/.deps

deps: system-deps venv

demo: deps
	$(BIN)/gpuctl apply examples/ddp/cluster.yaml; rc=$$?; \
	$(BIN)/gpuctl down ddp-demo; exit $$rc

test: deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ansible-lint ansible/
	$(BIN)/yamllint ansible/
	terraform fmt -check -recursive terraform/

clean:
	rm -rf $(VENV) .pytest_cache

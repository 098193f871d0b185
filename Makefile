# Argus developer entry points. Everything runs from the repo's .venv (made by scripts/setup.sh
# from /usr/bin/python3 with --system-site-packages, the only interpreter that can import bcc).
#
#   sudo make test       # full suite; fails if any bpf/redis test was skipped
#   make test-fast       # unit tests only: no root, no bpf/redis/slow tiers
#   sudo make demo       # simulated 8-rank job with an injected straggler

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
LINT_PATHS := argus tests benchmarks

# Tiers whose skipped tests make `make test` fail (override: make test ARGUS_REQUIRE_TIERS=).
ARGUS_REQUIRE_TIERS ?= bpf,redis

# $(call need_root,TARGET): fail unless running as root (names the goal the user typed, so
# `make test` says "sudo make test" although its `setup` prerequisite is what checks first).
need_root = @if [ "$$(id -u)" -ne 0 ]; then echo "ERROR: run as root: sudo make $(or $(MAKECMDGOALS),$(1))" >&2; exit 1; fi

# Targets that need only the venv (no root): make it first if it is missing.
define need_venv
	@if [ ! -x $(PY) ]; then \
		if [ "$$(id -u)" -eq 0 ]; then scripts/setup.sh; \
		else echo "ERROR: no $(VENV) yet: sudo make setup" >&2; exit 1; fi; \
	fi
endef

.PHONY: help setup test test-fast demo lint fmt bench clean distclean

help:
	@echo "targets: setup test test-fast demo lint fmt bench clean distclean"

setup:
	$(call need_root,setup)
	@scripts/setup.sh

test: setup
	$(call need_root,test)
	ARGUS_REQUIRE_TIERS=$(ARGUS_REQUIRE_TIERS) $(PY) -m pytest -m "not gpu" tests

test-fast:
	$(need_venv)
	ARGUS_REQUIRE_TIERS= ARGUS_SKIP_SLOW=1 $(PY) -m pytest -m "not bpf and not redis and not slow and not gpu" tests

demo: setup
	$(call need_root,demo)
	@if $(VENV)/bin/argus demo --help >/dev/null 2>&1; then \
		$(VENV)/bin/argus demo; \
	else \
		$(VENV)/bin/argus sim run --ranks 8 --steps 30 --inject straggler:rank=3,factor=1.5,from_step=10; \
	fi

lint:
	$(need_venv)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

fmt:
	$(need_venv)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

bench: setup
	$(call need_root,bench)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks all

clean:
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache .mypy_cache build dist *.egg-info

distclean: clean
	rm -rf $(VENV)

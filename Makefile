# fleetheal — the README's commands. Every target sets itself up on first use (scripts/bootstrap.sh).
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
PYTEST_ARGS ?=

.PHONY: help setup demo test lint unit generate bench clean

help:
	@echo "make demo      show a GPU failure being classified and healed (local lab)"
	@echo "make test      lint + every test (what CI runs)"
	@echo "make lint      ruff, mypy --strict, yamllint, ansible-lint, generated files up to date"
	@echo "make bench     benchmarks -> benchmarks/results/latest.{json,md}"
	@echo "make generate  regenerate alert rules, Ansible vars and docs from policies/faults.yaml"

# Idempotent and about a second when nothing is missing, so every target can run it.
setup:
	@VENV=$(VENV) scripts/bootstrap.sh

demo: setup
	$(PY) -m fleetheal classify --file $(SHARED)/fixtures/xid-log-lines.txt
	@echo
	$(PY) -m fleetheal classify --file $(SHARED)/fixtures/fault-log-lines.txt

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/yamllint -s .
	$(VENV)/bin/ansible-lint --profile production --offline -q
	$(PY) -m fleetheal generate --check

unit: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint unit

generate: setup
	$(PY) -m fleetheal generate

bench: setup
	$(PY) benchmarks/run.py

clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache

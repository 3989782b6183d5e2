# fleetheal — the README's commands. Every target sets itself up on first use (scripts/bootstrap.sh).
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
PYTEST_ARGS ?=

.PHONY: help setup tools slurm demo demo-classify test lint unit integration integration-tools integration-lab compat \
	molecule-prep generate bench clean

help:
	@echo "make demo      the local lab heals a GPU failure live (real Slurm, Prometheus, Alertmanager)"
	@echo "make demo-classify   classify the real log lines in $(SHARED)/fixtures"
	@echo "make test      lint + every test (what CI runs): lint, unit, integration; each runs, failures named at the end"
	@echo "make unit      the tests that need neither the Go-built tools, Molecule's image nor the lab"
	@echo "make integration   the rest: real control plane and Pulumi engine (make tools), Molecule, tests/lab"
	@echo "make compat    the Slurm-facing tests again, on Debian 12's own Slurm 22.05 (part of integration)"
	@echo "make lint      ruff, mypy --strict, yamllint, ansible-lint, generated files up to date"
	@echo "make bench     benchmarks -> benchmarks/results/latest.{json,md}"
	@echo "make slurm     Slurm 26.05 (what Slinky deploys) from Debian sid, relocated beside Debian's 22.05"
	@echo "make tools     build etcd, kube-apiserver, the Pulumi CLI and its Kubernetes provider from Go modules"
	@echo "make generate  regenerate alert rules, Ansible vars and docs from policies/faults.yaml"

# Idempotent and about a second when nothing is missing, so every target can run it.
setup:
	@VENV=$(VENV) scripts/bootstrap.sh

# The Slurm the lab, the demo, the benchmarks and the tests run: 26.05, the release Slinky deploys, from a
# debootstrapped Debian sid root relocated by scripts/slurm-tree.sh (about 30 s once, then instant). Its
# bin/ goes first on PATH, so every Slurm client the agent, the remediator and the playbooks start is
# 26.05's too. `compat` runs the Slurm-facing tests again on Debian 12's 22.05, without that PATH.
CACHE_DIR ?= /var/cache/fleetheal
SLURM_SERIES ?= 26.05
WITH_SLURM := PATH=$(CACHE_DIR)/slurm-$(SLURM_SERIES)/bin:$$PATH
# The compatibility subset: every reader of Slurm's output (nodes, jobs, federation) and the playbooks and
# agent that act through them; the lab's long scenarios (demo, failover, training) run on 26.05 only. Of the
# playbook tests, the four that between them run every Slurm read and write the playbooks make (drain,
# requeue, signal, priority, standby reason and promotion, resume, a job's log); the others differ only in what is decided.
COMPAT_PLAYBOOKS := $(addprefix tests/ansible/test_remediation.py::test_,isolate_and_relocate_drains_requeues_boosts_and_promotes \
	restart_in_place_requeues_on_the_same_node_within_the_limit refuse_and_report_tells_the_job_and_keeps_the_node \
	revalidate_pass_goes_to_standby_then_rejoins)
COMPAT_TESTS := tests/lab/test_slurm.py tests/lab/test_federation.py tests/agent/test_integration.py \
	tests/ansible/test_steps.py $(COMPAT_PLAYBOOKS) tests/ansible/test_responder.py tests/fleet/test_status.py

slurm: setup
	@FLEETHEAL_CACHE_DIR=$(CACHE_DIR) FLEETHEAL_SLURM_SERIES=$(SLURM_SERIES) scripts/slurm-tree.sh >/dev/null

# A real control plane and the real Pulumi engine, from Go modules at the versions tools/*/go.mod pin,
# into .tools/bin. The first build takes tens of minutes on 2 cores; then about a second (Go's caches
# and a stamp per tool).
tools:
	scripts/build-tools.sh

# The local lab: real Slurm, Prometheus, Alertmanager, agents on simulated GPUs, the remediator and
# the real playbooks; heals an Xid 79, refuses to relocate an Xid 31, restarts an NCCL timeout in place.
demo: setup slurm
	$(WITH_SLURM) $(PY) -m fleetheal lab demo

# What `make demo` showed before the lab: the classifier over real log lines.
demo-classify: setup
	$(PY) -m fleetheal classify --file $(SHARED)/fixtures/xid-log-lines.txt
	@echo
	$(PY) -m fleetheal classify --file $(SHARED)/fixtures/fault-log-lines.txt

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/yamllint -s .
	# The repository's own collection (fleetheal.cluster) sits next to the playbooks; ansible-playbook finds it there.
	ANSIBLE_COLLECTIONS_PATH=playbooks/collections $(VENV)/bin/ansible-lint --profile production --offline -q
	$(PY) -m fleetheal generate --check

# Molecule's containers boot a locally built Debian image and install fleetheal from a local wheelhouse
# (no registry, no Galaxy): both scripts are idempotent and take about a second once cached.
molecule-prep: setup
	molecule/image/build.sh
	molecule/image/wheelhouse.sh

# `unit` leaves out the tests marked kube or pulumi (the Go-built tools), federation (a Slurm federation
# with slurmdbd and MariaDB; tests/conftest.py marks every user of the `kube` and `federation` fixtures),
# molecule (Molecule's image) and the lab's own tests; `integration` runs exactly those.
INTEGRATION := kube or pulumi or molecule or federation
INTEGRATION_TOOLS := kube or pulumi or molecule

unit: setup slurm
	$(WITH_SLURM) $(PY) -m pytest -m "not ($(INTEGRATION))" --ignore=tests/lab $(PYTEST_ARGS)

# Every part runs even when an earlier one failed; the target fails at the end, naming each failed part.
define run_parts
	@failed=""; for part in $(1); do $(MAKE) --no-print-directory $$part || failed="$$failed $$part"; done; \
	if [ -n "$$failed" ]; then echo "make $@: failed:$$failed" >&2; exit 1; fi
endef

integration: setup molecule-prep tools slurm
	$(call run_parts,integration-tools integration-lab compat)

integration-tools: setup
	$(WITH_SLURM) $(PY) -m pytest -m "$(INTEGRATION)" $(PYTEST_ARGS)

integration-lab: setup
	$(WITH_SLURM) $(PY) -m pytest -m "not ($(INTEGRATION))" tests/lab $(PYTEST_ARGS)

compat: setup
	$(PY) -m pytest -m "not ($(INTEGRATION_TOOLS))" $(COMPAT_TESTS) $(PYTEST_ARGS)

test:
	$(call run_parts,lint unit integration)

generate: setup
	$(PY) -m fleetheal generate

bench: setup slurm
	$(WITH_SLURM) $(PY) benchmarks/run.py

clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache

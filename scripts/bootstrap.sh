#!/usr/bin/env bash
# Install everything fleetheal needs on a Debian 12 machine, on first use: the Debian packages that the
# lab and the tests run for real (Slurm and its federation's slurmdbd + MariaDB, munge, Prometheus, Alertmanager, PostgreSQL, podman, runc, debootstrap),
# a virtualenv with the exact pins of requirements.txt, fleetheal itself (editable), and the policy pack's
# own virtualenv (policies/.venv, from policies/requirements.txt).
# Idempotent: a second run installs nothing and takes about a second. Says what it installs.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
DEB_PACKAGES=(
  slurmctld slurmd slurm-client munge        # a real Slurm on one machine (lab, agent and playbook tests)
  slurmdbd mariadb-server                    # the Slurm federation: slurmdbd and its database, on loopback
  prometheus prometheus-alertmanager         # real alerting path; promtool tests the generated rules
  postgresql                                 # the remediator's production store, started by the tests on loopback
  podman runc debootstrap uidmap             # Molecule targets: systemd containers built locally
  patchelf                                   # Slurm 26.05 relocated from a sid root (scripts/slurm-tree.sh)
  python3-venv python3-dev build-essential   # the virtualenv
  dpkg-dev fakeroot                          # the dcgm role's local apt repository (a test double)
  iproute2 procps util-linux psmisc curl     # network namespaces, pkill/unshare, health probes
  iptables                                   # a test cuts one replica off PostgreSQL (a real partition)
)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  # Services do not start on install: fleetheal starts its own, on loopback. A policy-rc.d that exits 101
  # forbids invoke-rc.d and deb-systemd-invoke, which the packages' scripts call, to start them
  # (/usr/share/doc/init-system-helpers/README.policy-rc.d.gz); one is written for this install and removed
  # after it, unless the machine has its own (Docker's Debian images do). Nor does PostgreSQL create its
  # `main` cluster: the tests run initdb in a temporary directory.
  policy_rc=/usr/sbin/policy-rc.d
  if [ ! -e "$policy_rc" ]; then
    trap '$SUDO rm -f "$policy_rc"' EXIT
    printf '#!/bin/sh\n# fleetheal scripts/bootstrap.sh, during its apt-get install: start no service.\nexit 101\n' |
      $SUDO tee "$policy_rc" >/dev/null
    $SUDO chmod 755 "$policy_rc"
  fi
  if [[ " ${missing[*]} " == *" postgresql "* ]]; then
    $SUDO mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" | $SUDO tee /etc/postgresql-common/createcluster.d/fleetheal.conf >/dev/null
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

stamp="$VENV/.fleetheal-installed"
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating virtualenv $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
  fi
  echo "bootstrap: installing Python packages from requirements.txt (exact pins)"
  "$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements.txt
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi

# The policy pack runs in its own virtualenv, as Pulumi runs a Python pack (policies/PulumiPolicy.yaml).
pack_venv=policies/.venv
pack_stamp="$pack_venv/.fleetheal-installed"
pack_want=$(sha256sum < policies/requirements.txt | cut -d' ' -f1)
if [ ! -f "$pack_stamp" ] || [ "$(cat "$pack_stamp")" != "$pack_want" ]; then
  echo "bootstrap: installing the policy pack's virtualenv $pack_venv from policies/requirements.txt"
  [ -x "$pack_venv/bin/python" ] || "$PYTHON" -m venv "$pack_venv"
  "$pack_venv/bin/pip" install -q --disable-pip-version-check -r policies/requirements.txt
  echo "$pack_want" > "$pack_stamp"
fi

#!/usr/bin/env bash
# Install everything fleetheal needs on a Debian 12 machine, on first use: the Debian packages that the
# lab and the tests run for real (Slurm, munge, Prometheus, Alertmanager, PostgreSQL, podman, runc, debootstrap),
# a virtualenv with the exact pins of requirements.txt, and fleetheal itself (editable).
# Idempotent: a second run installs nothing and takes about a second. Says what it installs.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
DEB_PACKAGES=(
  slurmctld slurmd slurm-client munge        # a real Slurm on one machine (lab, agent and playbook tests)
  prometheus prometheus-alertmanager         # real alerting path; promtool tests the generated rules
  postgresql                                 # the remediator's production store, started by the tests on loopback
  podman runc debootstrap uidmap             # Molecule targets: systemd containers built locally
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
  # Services do not start on install: fleetheal starts its own, on loopback. (Docker's images forbid it
  # in a policy-rc.d; without an init system, invoke-rc.d blocks them anyway.) Nor does PostgreSQL create
  # its `main` cluster: the tests run initdb in a temporary directory.
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

#!/usr/bin/env bash
# Slurm 26.05 — the release Slinky deploys (slurm chart 1.2.1, `26.05-ubuntu26.04`) — beside Debian 12's
# 22.05, for the lab and the tests. Debian sid carries it; this script debootstraps a minimal sid root,
# installs Slurm's daemons and clients there, and relocates them: patchelf points each program's ELF
# interpreter and library path into the root, so they run on this machine with their own glibc, libslurm
# and plugins, and see this machine's files (state directories, the job scripts' Python) as they are.
# `bin/` holds the Slurm programs only; put it first on PATH (the Makefile does) and every client the
# agent, the remediator and the playbooks start is 26.05's. fleetheal.lab.slurm.Release finds the
# plugins (PluginDir) and slurmd is given the tree's slurmstepd (`slurmd -d`).
#
# Inputs (environment):
#   FLEETHEAL_CACHE_DIR      cache dir               (default /var/cache/fleetheal)
#   FLEETHEAL_DEBIAN_MIRROR  Debian mirror           (default: the first deb.debian.org-style URI in apt's sources)
#   FLEETHEAL_SLURM_SERIES   the release series      (default 26.05; the tree is refused if sid serves another)
# Output: $FLEETHEAL_CACHE_DIR/slurm-$series/{root,bin}; prints the bin directory. About 1 minute the
# first time (debootstrap ~40 s, apt ~20 s), then instant (a stamp records the recipe's version).
set -euo pipefail

cache=${FLEETHEAL_CACHE_DIR:-/var/cache/fleetheal}
series=${FLEETHEAL_SLURM_SERIES:-26.05}
# Bump when the recipe changes, so a stale tree is rebuilt.
recipe=2
tree="$cache/slurm-$series"
stamp="$tree/.fleetheal-tree"
programs_sbin=(slurmctld slurmd slurmstepd slurmdbd slurmrestd)
programs_bin=(sacct sacctmgr salloc sattach sbatch sbcast scancel scontrol sdiag sinfo sprio squeue sreport srun sshare sstat)

if [[ -f "$stamp" && "$(cat "$stamp")" == "$recipe" ]]; then
  echo "$tree/bin"
  exit 0
fi

mkdir -p "$cache"
exec 9>"$cache/slurm-$series.lock"
flock 9 # a second build (two `make` runs at once) waits for the first and then finds its stamp
if [[ -f "$stamp" && "$(cat "$stamp")" == "$recipe" ]]; then
  echo "$tree/bin"
  exit 0
fi

for tool in debootstrap patchelf; do
  command -v "$tool" >/dev/null || { echo "slurm-tree: $tool is missing: run scripts/bootstrap.sh" >&2; exit 1; }
done
mirror=${FLEETHEAL_DEBIAN_MIRROR:-}
if [[ -z "$mirror" ]]; then
  mirror=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
    | head -n1 | tr -d ' ' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi

rm -rf "$tree"
root="$tree/root"
mkdir -p "$root"
echo "slurm-tree: debootstrap sid from $mirror into $root (about 40 s)" >&2
debootstrap --variant=minbase sid "$root" "$mirror" >"$tree/debootstrap.log" 2>&1 \
  || { echo "slurm-tree: debootstrap failed; see $tree/debootstrap.log" >&2; exit 1; }
# No service starts inside the root (its packages' scripts would try).
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
echo "slurm-tree: installing Slurm $series in the root (about 20 s)" >&2
# A snapshot mirror's sid Release file is past its Valid-Until date.
apt_opts=(-o Acquire::Check-Valid-Until=false -q)
chroot "$root" apt-get "${apt_opts[@]}" update >"$tree/apt.log" 2>&1
DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get "${apt_opts[@]}" install -y --no-install-recommends \
  slurmctld slurmd slurmdbd slurm-client slurmrestd slurm-wlm-jwt-plugin munge >>"$tree/apt.log" 2>&1 \
  || { echo "slurm-tree: apt-get install in the root failed; see $tree/apt.log" >&2; exit 1; }
chroot "$root" apt-get clean

lib="$root/usr/lib/x86_64-linux-gnu"
rpath="$lib/slurm-wlm:$lib:$root/lib/x86_64-linux-gnu"
mkdir -p "$tree/bin"
for dir_and_name in "${programs_sbin[@]/#//usr/sbin/}" "${programs_bin[@]/#//usr/bin/}"; do
  # Resolve inside the root: /usr/sbin/slurmd is an alternatives link to an absolute path that, read
  # from outside, names this machine's own 22.05 program.
  real="$root$(chroot "$root" readlink -f "$dir_and_name")"
  patchelf --set-interpreter "$root/lib64/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$rpath" "$real"
  ln -sfn "$real" "$tree/bin/$(basename "$dir_and_name")"
done
# Plugins and libslurmfull carry a RUNPATH of /usr/lib/x86_64-linux-gnu/slurm-wlm: this machine's 22.05.
find "$lib/slurm-wlm" -maxdepth 1 -type f -name '*.so*' -exec patchelf --force-rpath --set-rpath "$rpath" {} \;

version=$("$tree/bin/slurmctld" -V)
if [[ "$version" != "slurm-wlm $series."* ]]; then
  echo "slurm-tree: sid serves '$version', not Slurm $series; set FLEETHEAL_SLURM_SERIES or a snapshot mirror" >&2
  exit 1
fi
echo "$recipe" >"$stamp"
echo "slurm-tree: $version in $tree" >&2
echo "$tree/bin"

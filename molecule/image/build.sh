#!/usr/bin/env bash
# Build the Debian bookworm image Molecule's containers boot (systemd as PID 1), without a registry:
# debootstrap a minimal root file system, cache it as a tarball, and `podman import` it.
#
# Inputs (environment):
#   FLEETHEAL_MOLECULE_IMAGE  image name        (default localhost/fleetheal-molecule:bookworm)
#   FLEETHEAL_CACHE_DIR       tarball cache dir (default /var/cache/fleetheal)
#   FLEETHEAL_DEBIAN_MIRROR   Debian mirror     (default: the first deb.debian.org-style URI in apt's sources)
#   FLEETHEAL_IMAGE_REBUILD=1 rebuild even when the image and tarball exist
# Output: the image in podman's default storage; the tarball under the cache dir (re-import takes ~6 s).
set -euo pipefail

image=${FLEETHEAL_MOLECULE_IMAGE:-localhost/fleetheal-molecule:bookworm}
cache=${FLEETHEAL_CACHE_DIR:-/var/cache/fleetheal}
# Bump when the package list changes, so a stale cached tarball is not reused.
version=4
tarball="$cache/molecule-rootfs-bookworm-v$version.tar"
mirror=${FLEETHEAL_DEBIAN_MIRROR:-}
if [[ -z "$mirror" ]]; then
  mirror=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
    | head -n1 | tr -d ' ' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi

# Packages the roles and their Molecule verify steps need inside the container:
# systemd as init; python3-apt for ansible.builtin.apt; python3-venv and python3-packaging (ansible.builtin.pip) for the fleetheal virtualenvs;
# gpg for apt keyrings; iproute2 (ss) and procps (ps) for verify; sudo for become_user tasks.
packages=python3,python3-apt,python3-venv,python3-packaging,systemd,systemd-sysv,dbus,gpg,iproute2,procps,sudo,ca-certificates

mkdir -p "$cache"
exec 9>"$cache/molecule-image.lock"
flock 9 # a second build (two `make` runs at once) waits for the first and then finds its image

if [[ "${FLEETHEAL_IMAGE_REBUILD:-0}" != 1 ]] && podman image exists "$image" \
  && [[ "$(podman image inspect --format '{{ index .Config.Labels "fleetheal.image.version" }}' "$image")" == "$version" ]]; then
  echo "image $image (version $version) exists (FLEETHEAL_IMAGE_REBUILD=1 to rebuild)"
  exit 0
fi

if [[ "${FLEETHEAL_IMAGE_REBUILD:-0}" == 1 || ! -s "$tarball" ]]; then
  root=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  echo "debootstrap bookworm from $mirror into $root"
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror"
  # No getty or udev work in a container; keep boot to `running` short.
  rm -f "$root"/etc/systemd/system/getty.target.wants/* "$root"/etc/machine-id
  : > "$root/etc/machine-id"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi

podman import \
  --change 'CMD ["/sbin/init"]' \
  --change 'ENV container=podman' \
  --change 'STOPSIGNAL SIGRTMIN+3' \
  --change "LABEL fleetheal.image.version=$version" \
  "$tarball" "$image"
echo "built $image from $tarball"

#!/usr/bin/env bash
# Build, from their Go modules at the versions pinned in tools/*/go.mod (and go.sum), the pieces of a
# real control plane that no package registry carries:
#   tools/kubernetes                  etcd, kube-apiserver, kube-controller-manager, kube-scheduler
#   tools/pulumi                      the Pulumi CLI (engine, local file backend)
#   tools/pulumi-resource-kubernetes  the Pulumi Kubernetes provider
#   tools/kwok                        kwok, the kubelet simulator (+ share/kwok/stages.yaml, its stages)
#   tools/slurm-operator              Slinky's slurm-operator (+ share/slurm-operator/crds, its CRDs)
#   tools/kueue                       Kueue's controller (+ share/kueue: its CRDs and webhook configurations)
# into $FLEETHEAL_TOOLS/bin (default .tools/bin). Go's module and build caches are reused, and a tool
# whose inputs (its go.mod, go.sum and sources, and this script) have not changed is not rebuilt, so a
# second run takes about a second. The first build of all three takes tens of minutes on 2 cores.
#
# Usage: scripts/build-tools.sh [kubernetes|pulumi|pulumi-resource-kubernetes ...]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${FLEETHEAL_TOOLS:-$ROOT/.tools}
mkdir -p "$OUT/bin" "$OUT/stamps"

if ! command -v go >/dev/null; then
  echo "build-tools: 'go' is not on PATH. Install Go 1.21 or newer (GOTOOLCHAIN then fetches the" >&2
  echo "version each tools/*/go.mod names from the Go module proxy)." >&2
  exit 1
fi
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto} GOFLAGS="${GOFLAGS:-} -trimpath -buildvcs=false"
shopt -s nullglob
ALL=(kubernetes pulumi pulumi-resource-kubernetes kwok slurm-operator kueue)

# version TOOLDIR MODULE: the version of MODULE that TOOLDIR's go.mod selects.
version() { (cd "$ROOT/tools/$1" && go list -m -f '{{.Version}}' "$2"); }
# module_dir TOOLDIR MODULE: where Go's module cache holds the sources of that version of MODULE.
module_dir() { (cd "$ROOT/tools/$1" && go mod download -json "$2" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p'); }

build() {
  local name=$1 dir=$ROOT/tools/$1
  local want
  want=$(cd "$dir" && cat go.mod go.sum ./*.go ./*/*.go | cat - "$ROOT/scripts/build-tools.sh" | sha256sum | cut -d' ' -f1)
  if [ -f "$OUT/stamps/$name" ] && [ "$(cat "$OUT/stamps/$name")" = "$want" ]; then
    echo "build-tools: $name is up to date ($OUT/bin)"
    return
  fi
  local start=$SECONDS
  echo "build-tools: building $name from tools/$name (a first build takes minutes; Go's caches make the next fast)"
  case $name in
    kubernetes)
      local kv pkg=k8s.io/component-base/version
      kv=$(version kubernetes k8s.io/kubernetes)
      local minor=${kv#v1.}; minor=${minor%%.*}
      (cd "$dir" && go build -o "$OUT/bin/" \
        -ldflags "-s -w -X $pkg.gitVersion=$kv -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler ./etcd)
      ;;
    kwok)
      local mod=sigs.k8s.io/kwok src
      src=$(module_dir kwok "$mod")
      (cd "$dir" && go build -o "$OUT/bin/kwok" -ldflags "-s -w" "$mod/cmd/kwok")
      # kwok runs no stage unless told: its own defaults (what kwokctl gives it), from the module. Nodes are
      # made Ready, pods bound to a node Running and Ready, and deleted pods removed, with no delay.
      mkdir -p "$OUT/share/kwok"
      local f out=$OUT/share/kwok/stages.yaml
      : > "$out.tmp"
      for f in node/fast/node-initialize pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
        { echo "---"; cat "$src/kustomize/stage/$f.yaml"; } >> "$out.tmp"
      done
      mv "$out.tmp" "$out"
      ;;
    slurm-operator)
      local mod=github.com/SlinkyProject/slurm-operator src
      src=$(module_dir slurm-operator "$mod")
      (cd "$dir" && go build -o "$OUT/bin/slurm-operator" -ldflags "-s -w" "$mod/cmd/manager")
      # The CRDs this operator serves, from the same module (the lab installs these, not fleetheal's).
      rm -rf "$OUT/share/slurm-operator" && mkdir -p "$OUT/share/slurm-operator/crds"
      cp "$src"/config/crd/bases/*.yaml "$OUT/share/slurm-operator/crds/"
      chmod -R u+w "$OUT/share/slurm-operator"
      ;;
    kueue)
      local mod=sigs.k8s.io/kueue src
      src=$(module_dir kueue "$mod")
      (cd "$dir" && go build -o "$OUT/bin/kueue" -ldflags "-s -w" "$mod/cmd/kueue")
      # Its CRDs, and its webhook configurations as its install renders them before kustomize names the Service
      # (the lab points them at the controller it runs: fleetheal/lab/kueue.py).
      rm -rf "$OUT/share/kueue" && mkdir -p "$OUT/share/kueue/crds"
      cp "$src"/config/components/crd/bases/*.yaml "$OUT/share/kueue/crds/"
      cp "$src/config/components/webhook/manifests.yaml" "$OUT/share/kueue/webhooks.yaml"
      chmod -R u+w "$OUT/share/kueue"
      ;;
    pulumi)
      local pv
      pv=$(version pulumi github.com/pulumi/pulumi/pkg/v3)
      (cd "$dir" && go build -o "$OUT/bin/pulumi" \
        -ldflags "-s -w -X github.com/pulumi/pulumi/sdk/v3/go/common/version.Version=$pv" \
        github.com/pulumi/pulumi/pkg/v3/cmd/pulumi)
      ;;
    pulumi-resource-kubernetes)
      local mod=github.com/pulumi/pulumi-kubernetes/provider/v4 src kv
      src=$(module_dir pulumi-resource-kubernetes "$mod")
      kv=$(version pulumi-resource-kubernetes "$mod")
      # The upstream build minifies these two files next to its main.go; the module carries the sources.
      for f in schema terraform-mapping; do
        python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1])), open(sys.argv[2], "w"), separators=(",", ":"))' \
          "$src/cmd/pulumi-resource-kubernetes/$f.json" "$dir/$f-embed.json"
      done
      (cd "$dir" && go build -o "$OUT/bin/pulumi-resource-kubernetes" \
        -ldflags "-s -w -X $mod/pkg/version.Version=${kv#v}" .)
      ;;
    *) echo "build-tools: unknown tool $name (${ALL[*]})" >&2; exit 2 ;;
  esac
  echo "$want" > "$OUT/stamps/$name"
  echo "build-tools: $name built in $((SECONDS - start)) s"
}

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=("${ALL[@]}")
# Side by side: each `go build` is parallel already, but its link step is not.
pids=()
for t in "${tools[@]}"; do build "$t" & pids+=($!); done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "build-tools: ${tools[$i]} FAILED (its go output is above)" >&2; failed=1; }
done
[ $failed -eq 0 ] || exit 1
ls -l "$OUT/bin"

#!/usr/bin/env bash
# Download the wheels that fleetheal's agent and remediator need inside Molecule's containers, so the
# roles install offline (pip --no-index --find-links). Pins come from requirements.txt.
#
# Inputs (environment):
#   FLEETHEAL_WHEELHOUSE  output directory (default /var/cache/fleetheal/wheels)
#   PIP                   pip to run (default .venv/bin/pip)
# The containers run Debian bookworm's CPython 3.11 on x86_64.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${FLEETHEAL_WHEELHOUSE:-/var/cache/fleetheal/wheels}
pip=${PIP:-.venv/bin/pip}
pins=()
for name in PyYAML prometheus-client nvidia-ml-py pyahocorasick regex aiohttp jsonschema psutil ansible-runner ansible-core; do
  pin=$(grep -iE "^${name}==" requirements.txt || true)
  [[ -n "$pin" ]] || { echo "wheelhouse: $name is not pinned in requirements.txt" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p "$out"
exec 9>"$out/.lock"
flock 9 # a second download (two `make` runs at once) waits for the first and then finds its stamp
# Nothing to do (and no network needed) when these exact pins were downloaded before.
stamp="$out/.pins"
if [[ -f "$stamp" && "$(cat "$stamp")" == "${pins[*]}" ]]; then
  echo "wheelhouse: $out is up to date"
  exit 0
fi
"$pip" download --quiet --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any --dest "$out" "${pins[@]}"
printf '%s' "${pins[*]}" > "$stamp"
echo "wheelhouse: $(ls "$out" | wc -l) wheels in $out"

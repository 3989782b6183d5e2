#!/usr/bin/env bash
# Run `make demo` N times in a row (default 10) and count: the README's first command must pass every
# time, not once. Each run's output goes to $DEMO_LOOP_LOGS/run-<i>.log (default /tmp/fleetheal-demo-loop).
# Exit 0 only when every run passed. Usage: scripts/demo-loop.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
logs=${DEMO_LOOP_LOGS:-/tmp/fleetheal-demo-loop}
mkdir -p "$logs"
passed=0
for i in $(seq 1 "$runs"); do
  start=$SECONDS
  if make demo > "$logs/run-$i.log" 2>&1; then
    passed=$((passed + 1)); verdict=passed
  else
    verdict="FAILED (see $logs/run-$i.log)"
  fi
  summary=$(grep -E "^  (xid-79|nccl-timeout) " "$logs/run-$i.log" | awk '{printf "%s %s  ", $1, $5}')
  loop=$(grep -E "^  repair " "$logs/run-$i.log" | grep -oE "[a-z_]+ [0-9.]+s after the fault \(revalidation [0-9.]+s\)")
  echo "demo-loop: run $i of $runs $verdict in $((SECONDS - start)) s; running again after: ${summary:-n/a}" \
    "loop closed: ${loop:-n/a}"
done
echo "demo-loop: $passed of $runs runs passed"
[ "$passed" -eq "$runs" ]

#!/usr/bin/env bash
# Runs `hax table1` with its variants trained side by side, one single-threaded process each
# (small models use many cores better this way), then assembles the table from the finished runs.
# Usage: scripts/table1_parallel.sh [JOBS] [hax table1 options...]
#   JOBS  processes at once (default: the number of cores)
# Every option is passed to each per-variant run and to the final assembly, so the runs match and
# are reused; e.g. scripts/table1_parallel.sh 16 --steps 2000 --seeds 1,2.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then JOBS=$1; shift; fi
HAX=${HAX:-build/hax}
[ -x "$HAX" ] || scripts/setup.sh
variants=$("$HAX" table1 --list-variants)
logs=$(mktemp -d)
echo "table1_parallel: $(echo "$variants" | wc -w) variants, $JOBS at a time, logs in $logs"
for v in $variants; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  "$HAX" table1 "$@" --variants "$v" --threads 1 --out "$logs/$v.md" --json "$logs/$v.json" >"$logs/$v.log" 2>&1 &
done
wait || true
# Every run is finished now (a failed one is retrained here, in-process, and its error shows).
exec "$HAX" table1 "$@" --command "scripts/table1_parallel.sh $JOBS $*"

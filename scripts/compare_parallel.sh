#!/usr/bin/env bash
# Runs `hax compare` with its variants trained side by side, one process of THREADS threads each,
# then assembles the table from the finished runs (evaluating every length there).
# Usage: scripts/compare_parallel.sh [JOBS] [hax compare options...]
#   JOBS  processes at once (default: cores / 2); THREADS (environment) threads each (default 2)
# Every option is passed to each per-variant run and to the final assembly, so the runs match and
# are reused (a run stopped by Ctrl-C or SIGINT resumes at the next call); e.g.
#   scripts/compare_parallel.sh 7 --task niah --seq-len 256 --steps 2000
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then JOBS=$1; shift; fi
THREADS=${THREADS:-2}
HAX=${HAX:-build/hax}
[ -x "$HAX" ] || scripts/setup.sh
variants=$("$HAX" compare --list-variants)
logs=$(mktemp -d)
echo "compare_parallel: $(echo "$variants" | wc -w) variants, $JOBS at a time, $THREADS threads each, logs in $logs"
for v in $variants; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  # Only the training matters here: the final assembly evaluates every length.
  "$HAX" compare "$@" --variants "$v" --threads "$THREADS" --factors 1 --eval-n 1 \
    --out "$logs/$v.md" --json "$logs/$v.json" >"$logs/$v.log" 2>&1 &
done
wait || true
exec "$HAX" compare "$@" --command "scripts/compare_parallel.sh $JOBS $*"

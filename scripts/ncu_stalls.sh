#!/usr/bin/env bash
# Where the warps of one kernel stall, instruction by instruction: ncu's full set (with warp-state
# sampling) on one launch of each kernel whose name matches REGEX, exported as the SASS source
# page and summarized by scripts/ncu_sass_summary.py. Needs a CUDA build and a GPU with ncu.
# Usage: scripts/ncu_stalls.sh OUT_DIR SKIP REGEX... -- CMD...
#   OUT_DIR  where NAME.ncu-rep, NAME-sass.csv and NAME-summary.txt go (NAME: the regex, cleaned)
#   SKIP     launches of the kernel to skip first (warm-up calls), e.g. 2
#   REGEX    one or more kernel-name regexes, profiled one at a time (one ncu run each)
#   CMD      the program to profile, e.g. build/hax bench ssm --device cuda --lengths 64k --repeats 1
# Example (the SSD backward's three big kernels at 64K; forward-only calls come first in the bench,
# and the backward kernels launch once per fwd+bwd call):
#   scripts/ncu_stalls.sh $OUT/stalls 1 'dx_kernel' 'dcb_kernel' 'dbdc_wg' -- \
#     build/hax bench ssm --device cuda --lengths 64k --repeats 1 --json /tmp/x.json
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 4 ] || { echo "usage: scripts/ncu_stalls.sh OUT_DIR SKIP REGEX... -- CMD..." >&2; exit 2; }
OUT_DIR=$1 SKIP=$2
shift 2
case "$SKIP" in '' | *[!0-9]*) echo "ncu_stalls.sh: SKIP '$SKIP' must be a count of launches (0, 1, 2, ...)" >&2; exit 2 ;; esac
REGEXES=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do REGEXES+=("$1"); shift; done
[ ${#REGEXES[@]} -gt 0 ] || { echo "ncu_stalls.sh: give at least one kernel-name REGEX before --" >&2; exit 2; }
[ "${1:-}" = "--" ] && [ $# -ge 2 ] || { echo "ncu_stalls.sh: the command to profile must follow --" >&2; exit 2; }
shift
command -v ncu > /dev/null || { echo "ncu_stalls.sh: ncu is not on the PATH" >&2; exit 2; }
mkdir -p "$OUT_DIR"
status=0
for re in "${REGEXES[@]}"; do
  name=$(printf '%s' "$re" | tr -c 'A-Za-z0-9_' '_')
  rep="$OUT_DIR/$name"
  if ! ncu --set full --import-source no --kernel-name "regex:$re" --launch-skip "$SKIP" --launch-count 1 \
       -f -o "$rep" "$@" > "$rep-ncu.log" 2>&1; then
    echo "ncu_stalls.sh: ncu failed for '$re' (see $rep-ncu.log)" >&2; status=1; continue
  fi
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>> "$rep-ncu.log"
  ncu -i "$rep.ncu-rep" --page details > "$rep-details.txt" 2>> "$rep-ncu.log"
  python3 scripts/ncu_sass_summary.py "$rep-sass.csv" 25 > "$rep-summary.txt" 2>&1 || status=1
  echo "== $re: $(grep -m1 -E 'Duration' "$rep-details.txt" | tr -s ' ')"
  head -20 "$rep-summary.txt"
done
exit $status

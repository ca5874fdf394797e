#!/usr/bin/env bash
# Pass 37: the SSD's states by one sweep (ops/ssd/cuda/segment_scan_wgmma.cuh) against the
# two-kernel form (HAX_SSD_SEGSCAN=1 against 0; the sweep is off by default until this has run) on one card, after pass37-tile-diet-check.sh head has built
# the tree: the SSD GPU tests, `hax bench ssm` at 64K with each form (twice), ncu per kernel.
set -o pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
R=$OUT/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT res; }
timeout 150 build/tests/hax_tests --gtest_filter='SsdCuda*:Mamba2*Cuda*' > $R/ssd-tests.log 2>&1; echo "SSD tests rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/ssd-tests.log | tr '\n' ' ')"
grep -E "Failure|^\[  FAILED|Which is|Expected|error" $R/ssd-tests.log | head -20
pack
for x in a b; do
  for f in 1 0; do
    HAX_SSD_SEGSCAN=$f timeout 60 build/hax bench ssm --device cuda --lengths 16k,64k --json $R/bench-ssm-sweep$f-$x.json > $R/bench-ssm-sweep$f-$x.txt 2>&1
    echo "sweep=$f $x: $(grep -E '^ssd ' $R/bench-ssm-sweep$f-$x.txt | awk '{print "L=" $2, $3, "/", $4}' | tr '\n' ' ')"
  done
done
pack
for f in 1 0; do
  HAX_SSD_SEGSCAN=$f timeout 100 ncu --csv --metrics gpu__time_duration.sum -k regex:'(segment|dx_kernel|dcb_kernel|dbdc|state_pass|chunk_scan|cb_kernel|prep_kernel|ddt_kernel|da_kernel|local_state)' --launch-skip 80 -c 42 build/hax bench ssm --device cuda --lengths 64k --repeats 1 --json /tmp/z.json > $R/ncu-ssd-sweep$f.csv 2>&1
  echo "ncu sweep=$f rc=$?"
  python3 scripts/ncu_summary.py $R/ncu-ssd-sweep$f.csv 1 20 2>&1 | head -24
done
echo "sweep check done $(( $(date +%s) - t0 )) s"; pack

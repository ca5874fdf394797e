#!/usr/bin/env bash
# Pass 38 in one call (device starts were scarce): build the tree; the SSD GPU tests (with the
# new SsdCuda.JointDbdcAgreesWithSplitForm); `hax bench ssm` at 64K with HAX_SSD_DBDC_JOINT=1
# against 0 (twice each); HAX and SW k=128 at 64K (baseline); then, where time is left,
# experiments/tile-integer-diet.patch applied here (patch -p1), an incremental rebuild, the tile,
# causal, scorer and SSD GPU tests, and the same attention benches. Steps past the time guard
# (elapsed seconds) are skipped and say so.
set -o pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
R=$OUT/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT res; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
{ [ -d build ] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAX_CUDA=ON > $R/cfg.log 2>&1; } && cmake --build build > $R/build.log 2>&1 || { grep -E "error" -A3 $R/build.log | head -40; pack; exit 1; }
echo "build done $(el) s"
timeout 120 build/tests/hax_tests --gtest_filter='SsdCuda*' > $R/ssd-tests.log 2>&1; echo "SSD tests rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/ssd-tests.log | tr '\n' ' ') $(el) s"
grep -E "Failure|^\[  FAILED|Which is|Expected|error" $R/ssd-tests.log | head -20
pack
for x in a b; do
  for f in 1 0; do
    HAX_SSD_DBDC_JOINT=$f timeout 40 build/hax bench ssm --device cuda --lengths 64k --json $R/bench-ssm-joint$f-$x.json > $R/bench-ssm-joint$f-$x.txt 2>&1
    echo "joint=$f $x: $(grep -E '^ssd ' $R/bench-ssm-joint$f-$x.txt | awk '{print "L=" $2, $3, "/", $4}' | tr '\n' ' ')"
  done
done
pack
attention() {  # name
  for x in a b; do
    timeout 40 build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --json $R/bench-$1-$x.json > $R/bench-$1-$x.txt 2>&1
    timeout 40 build/hax bench attention --device cuda --patterns sw --keys 128 --lengths 64k --dims 64 --json $R/bench-sw-$1-$x.json > $R/bench-sw-$1-$x.txt 2>&1
    echo "$1 $x: hax $(grep -E '^hax ' $R/bench-$1-$x.txt | awk '{print $3, "/", $4}') | sw $(grep -E '^sw ' $R/bench-sw-$1-$x.txt | awk '{print $3, "/", $4}') $(el) s"
  done
}
attention head; pack
LIMIT=${LIMIT:-560}  # seconds this call may use
if [ ! -f experiments/tile-integer-diet.patch ]; then
  echo "diet: the patch has landed (cb1e507); nothing to apply"
elif [ $(el) -lt $(( LIMIT - 230 )) ]; then
  patch -p1 < experiments/tile-integer-diet.patch > $R/patch.log 2>&1 || { echo "patch failed"; cat $R/patch.log | head; pack; exit 1; }
  timeout $(( LIMIT - $(el) )) cmake --build build > $R/build-diet.log 2>&1; rc=$?
  echo "diet rebuild rc=$rc $(el) s"
  if [ $rc -eq 0 ] && [ $(el) -lt $(( LIMIT - 90 )) ]; then
    timeout $(( LIMIT - 40 - $(el) )) build/tests/hax_tests --gtest_filter='TileBlocksCuda*:SparseAttentionCuda*:CausalAttentionCuda*:ScorerMlpCuda*:SsdCuda.Wgmma*:SsdCuda.Joint*' > $R/diet-tests.log 2>&1; echo "diet tests rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/diet-tests.log | tr '\n' ' ') $(el) s"
    grep -E "Failure|^\[  FAILED|Which is|Expected" $R/diet-tests.log | head -10
    pack
    [ $(el) -lt $(( LIMIT - 20 )) ] && attention diet
  fi
else
  echo "diet skipped at $(el) s"
fi
echo "all done $(el) s"; pack

#!/usr/bin/env bash
# For the next pass (written in pass 38, not yet run): what pass 38 landed without a full check,
# in one 600 s call from a fresh build. The GPU suite first (the joint dB/dC is now the default,
# so every SSD test runs it; the tile diet's last unrun test, TileBlocksCuda.UnionSmallInstance),
# then racecheck and memcheck of the joint dB/dC and of a small tile instance, then the targets:
# HAX and SW k=128 at 64K, the SSD at 64K with the joint form on and off, and the training bench.
# Steps that would pass the call's time are skipped and say so.
set -o pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
R=$OUT/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT res; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
{ [ -d build ] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAX_CUDA=ON > $R/cfg.log 2>&1; } && cmake --build build > $R/build.log 2>&1 || { grep -E "error" -A3 $R/build.log | head -40; pack; exit 1; }
echo "build done $(el) s"
timeout 170 build/tests/hax_tests --gtest_filter='*Cuda*' > $R/gpu-suite.log 2>&1; echo "GPU suite rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/gpu-suite.log | tr '\n' ' ') $(el) s"
grep -E '^\[  FAILED|Failure' $R/gpu-suite.log | head -10
pack
for tool in racecheck memcheck; do
  timeout 30 compute-sanitizer --tool $tool build/tests/hax_tests --gtest_filter='TileBlocksCuda.UnionBandIntervalsSmallInstance' > $R/$tool-tiles.log 2>&1; echo "$tool tiles rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$tool-tiles.log | tr '\n' ' ')"
  timeout 30 compute-sanitizer --tool $tool build/tests/hax_tests --gtest_filter='SsdCuda.BackwardIsDeterministic:SsdCuda.ManyHeadsPerGroupBfloat16' > $R/$tool-ssd.log 2>&1; echo "$tool ssd rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$tool-ssd.log | tr '\n' ' ')"
done
echo "sanitizers done $(el) s"; pack
a() {  # name, args
  timeout 40 build/hax bench attention --device cuda --dims 64 $2 --json $R/bench-att-$1.json > $R/bench-att-$1.txt 2>&1
  echo "$1: $(grep -E '^(hax|sw) ' $R/bench-att-$1.txt | awk '{printf "%s L=%s %s / %s | ", $1, $2, $3, $4}')"
}
for x in a b; do
  [ $(el) -lt 520 ] || { echo "benches skipped at $(el) s"; break; }
  a hax64k-$x "--patterns hax --lengths 64k"; a sw128-$x "--patterns sw --keys 128 --lengths 64k"
  for f in 1 0; do
    HAX_SSD_DBDC_JOINT=$f timeout 30 build/hax bench ssm --device cuda --lengths 64k --json $R/bench-ssm-joint$f-$x.json > $R/bench-ssm-joint$f-$x.txt 2>&1
    echo "ssd joint=$f $x: $(grep -E '^ssd ' $R/bench-ssm-joint$f-$x.txt | awk '{print $3, "/", $4}')"
  done
done
pack
if [ $(el) -lt 450 ]; then
  timeout $(( 580 - $(el) )) build/hax bench train --device cuda --variants mamba2+hax --precision bf16 --graphs on --seeds 2 --steps 40 --json $R/bench-train.json > $R/bench-train.txt 2>&1; echo "train rc=$?"; tail -4 $R/bench-train.txt
else
  echo "train skipped at $(el) s"
fi
echo "all done $(el) s"; pack

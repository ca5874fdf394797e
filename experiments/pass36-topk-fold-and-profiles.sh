#!/usr/bin/env bash
# Pass 36, call 3: Key Selection's three top-k scans with lists loaded 4 steps ahead (fold_lists in
# top_k_prefix.cu; call 2 timed the old loop at 21-22 us each on the H100), checked by the top-k,
# interval and tile tests; HAX at 64K; then profiles for the next pass on this card: the SSD's
# kernels fwd+bwd at 64K, ncu details of HAX's tile forward and backward; the GPU suite last.
set -o pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
R=$OUT/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz --exclude='*.ncu-rep' -C $OUT res; }
left() { echo $(( 530 - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
{ [ -d build ] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAX_CUDA=ON > $R/cfg.log 2>&1; } && cmake --build build > $R/build.log 2>&1 || { grep -E "error" -A3 $R/build.log | head -40; tail -20 $R/build.log; pack; exit 1; }
echo "build done $(( $(date +%s) - t0 )) s"
timeout 90 build/tests/hax_tests --gtest_filter='PatternCuda.TopK*:PatternTopKPrefix*:*Interval*:TileBlocksCuda.*:PatternCuda.Merge*:DmaCuda*:*Dma*Cuda*' > $R/topk-tests.log 2>&1; echo "top-k tests rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/topk-tests.log | tr '\n' ' ')"
grep -E "Failure|^\[  FAILED|Which is|Expected" $R/topk-tests.log | head -20
timeout 60 ncu --csv --metrics gpu__time_duration.sum build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --repeats 1 --calls 1 --json /tmp/x.json > $R/ncu-hax-64k.csv 2>/dev/null; echo "ncu rc=$?"
python3 scripts/ncu_summary.py $R/ncu-hax-64k.csv 1 30 | grep -E "GPU time|_prefix|fold|block_top|tile_|scorer|leave"
for x in a b; do
  timeout 60 build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --json $R/bench-att-hax64k-$x.json > $R/bench-att-hax64k-$x.txt 2>&1
  echo "hax 64k $x: $(grep -E '^hax ' $R/bench-att-hax64k-$x.txt | awk '{print $3, "/", $4}')"
done
echo "hax done $(( $(date +%s) - t0 )) s"; pack
timeout 90 ncu --csv --metrics gpu__time_duration.sum -c 400 build/hax bench ssm --device cuda --lengths 64k --repeats 1 --calls 1 --json /tmp/s.json > $R/ncu-ssm-64k-all.csv 2>/dev/null; echo "ncu ssm rc=$?"
python3 scripts/ncu_summary.py $R/ncu-ssm-64k-all.csv 1 24
echo "ssm ncu done $(( $(date +%s) - t0 )) s"; pack
timeout 100 ncu --set full -k 'regex:tile_(forward|backward)_kernel' --launch-count 2 -o $R/tiles build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --repeats 1 --calls 1 --json /tmp/y.json > $R/ncu-tiles-full.log 2>&1; echo "ncu tiles rc=$?"
timeout 30 ncu --import $R/tiles.ncu-rep --page details > $R/tiles-details.txt 2>&1
grep -E "^  [a-z_ ]*[a-z_]+<|Duration|Memory Throughput|DRAM Throughput|L2 Hit Rate|Executed Ipc Active|Achieved Occupancy|Registers Per|Theoretical Occupancy|Eligible Warps" $R/tiles-details.txt | head -40
rm -f $R/tiles.ncu-rep
echo "tiles ncu done $(( $(date +%s) - t0 )) s"; pack
T=$(left); [ $T -gt 150 ] && T=150
if [ $T -gt 30 ]; then
  echo "suite with ${T} s"
  timeout $T build/tests/hax_tests --gtest_filter='*Cuda*' > $R/gpu-suite.log 2>&1; echo "GPU suite rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/gpu-suite.log | tr '\n' ' ')"
  grep -E '^\[  FAILED' $R/gpu-suite.log | head
  grep -E '^\[       OK' $R/gpu-suite.log | wc -l
fi
echo "all done $(( $(date +%s) - t0 )) s"; pack

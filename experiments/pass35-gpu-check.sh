#!/usr/bin/env bash
# Pass 35, call 1: the balanced interval plan (sorted query ranks, a warp per held candidate's bits,
# band runs by a thread per query); the tile backward's dK/dV rows 4 entries a reduction
# (HAX_TILE_QUAD_ROWS, A/B); Key Selection's prefix direction with grouped heads (HAX_PREFIX_GROUPS,
# A/B); the key-sum row kernel over B*H > 65535. Tests, bench, ncu per kernel, ncu details of the plan and the
# pattern kernels, sanitizers, GPU suite (validates e435475 and the bf16 top-k fallback test).
set -o pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
R=$OUT/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz --exclude='*.ncu-rep' -C $OUT res; }
left() { echo $(( 585 - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
{ [ -d build ] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAX_CUDA=ON > $R/cfg.log 2>&1; } && cmake --build build > $R/build.log 2>&1 || { grep -E "error" -A3 $R/build.log | head -40; tail -20 $R/build.log; pack; exit 1; }
echo "build done $(( $(date +%s) - t0 )) s"
timeout 120 build/tests/hax_tests --gtest_filter='*Interval*:TileBlocksCuda.*:PatternCuda.TopK*:PatternCuda.Merge*:PatternTopKPrefix*:PrefixDirectionCuda.*' > $R/new-tests.log 2>&1; echo "new/tile tests rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/new-tests.log | tr '\n' ' ')"
grep -E "Failure|error [0-9.e-]+ vs|^\[  FAILED|Which is|Expected" $R/new-tests.log | head -30
b() {  # name, env
  env $2 timeout 60 build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --json $R/bench-att-$1.json > $R/bench-att-$1.txt 2>&1
  echo "$1 ($2): $(grep -E '^(hax|ks|lsh) ' $R/bench-att-$1.txt | awk '{printf "%s %s / %s | ", $1, $3, $4}') $(grep -iE 'error|what' $R/bench-att-$1.txt | head -2)"
}
b new-a HAX_TILE_QUAD_ROWS=1; b pairs-a HAX_TILE_QUAD_ROWS=0; b groups0-a HAX_PREFIX_GROUPS=0; b new-b HAX_TILE_QUAD_ROWS=1; b pairs-b HAX_TILE_QUAD_ROWS=0; b groups0-b HAX_PREFIX_GROUPS=0
echo "benches done $(( $(date +%s) - t0 )) s"; pack
timeout 60 ncu --csv --metrics gpu__time_duration.sum build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --repeats 1 --calls 1 --json /tmp/x.json > $R/ncu-hax-64k.csv 2>/dev/null; echo "ncu rc=$?"
python3 scripts/ncu_summary.py $R/ncu-hax-64k.csv 1 26
for qr in 1 0; do
  HAX_TILE_QUAD_ROWS=$qr timeout 40 ncu --metrics gpu__time_duration.sum,lts__t_sectors_op_red.sum,lts__t_requests_op_red.sum,smsp__inst_executed.sum -k regex:tile_backward --launch-count 1 build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --repeats 1 --calls 1 --json /tmp/z.json > $R/ncu-bwd-quad$qr.txt 2>&1
  echo "quad rows $qr: $(grep -E 'gpu__time|lts__t_|smsp__inst' $R/ncu-bwd-quad$qr.txt | awk '{print $1, $NF}' | tr '\n' ' ')"
done
echo "ncu done $(( $(date +%s) - t0 )) s"; pack
timeout 120 ncu --set full -k 'regex:tile_plan_kernel|direction_|chunk_totals_|project_tile_kernel|leave_kernel|scorer_mlp' --launch-count 7 -o $R/pk build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --repeats 1 --calls 1 --json /tmp/y.json > $R/ncu-pk-full.log 2>&1; echo "ncu full rc=$?"
timeout 30 ncu --import $R/pk.ncu-rep --page details > $R/pk-details.txt 2>&1; echo "details rc=$?"
grep -E "^  [a-z_ ]*[a-z_]+<|Duration|Memory Throughput|DRAM Throughput|Executed Ipc Active|Achieved Occupancy|Registers Per|Theoretical Occupancy" $R/pk-details.txt | head -80
rm -f $R/pk.ncu-rep
echo "ncu full done $(( $(date +%s) - t0 )) s"; pack
for tool in racecheck memcheck; do
  timeout 40 compute-sanitizer --tool $tool build/tests/hax_tests --gtest_filter='TileBlocksCuda.UnionBandIntervalsSmallInstance' > $R/$tool.log 2>&1; echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' $R/$tool.log | tr '\n' ' ')"
done
pack
T=$(left); [ $T -gt 175 ] && T=175
echo "suite with ${T} s"
timeout $T build/tests/hax_tests --gtest_filter='*Cuda*' > $R/gpu-suite.log 2>&1; echo "GPU suite rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/gpu-suite.log | tr '\n' ' ')"
grep -E '^\[  FAILED' $R/gpu-suite.log | head
tail -3 $R/gpu-suite.log
echo "suite done $(( $(date +%s) - t0 )) s"; pack

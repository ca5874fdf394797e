#!/usr/bin/env bash
# Pass 37: experiments/tile-integer-diet.patch against HEAD on one card, in two calls on one warm
# machine (stage head, then stage diet with the patch applied to the working tree). HEAD first (HAX, SW k=128 and SSD benches at 64K, ncu of the tile kernels), then
# the patch (incremental rebuild of the four files it touches): the GPU suite, racecheck and
# memcheck of a small tile instance, the same benches and ncu. Land the patch
# if the tests pass and nothing is slower; record either way.
set -o pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
R=$OUT/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT res; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
{ [ -d build ] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAX_CUDA=ON > $R/cfg.log 2>&1; } && cmake --build build > $R/build.log 2>&1 || { grep -E "error" -A3 $R/build.log | head -40; pack; exit 1; }
echo "build done $(( $(date +%s) - t0 )) s"
measure() {  # name
  for x in a b; do
    timeout 60 build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --json $R/bench-$1-$x.json > $R/bench-$1-$x.txt 2>&1
    timeout 60 build/hax bench attention --device cuda --patterns sw --keys 128 --lengths 64k --dims 64 --json $R/bench-sw-$1-$x.json > $R/bench-sw-$1-$x.txt 2>&1
    timeout 60 build/hax bench ssm --device cuda --lengths 64k --json $R/bench-ssm-$1-$x.json > $R/bench-ssm-$1-$x.txt 2>&1
    echo "$1 $x: hax $(grep -E '^hax ' $R/bench-$1-$x.txt | awk '{print $3, "/", $4}') | sw $(grep -E '^sw ' $R/bench-sw-$1-$x.txt | awk '{print $3, "/", $4}') | ssd $(grep -E '^ssd ' $R/bench-ssm-$1-$x.txt | awk '{print $3, "/", $4}')"
  done
  timeout 60 ncu --metrics gpu__time_duration.sum,smsp__inst_executed.sum,lts__t_requests_op_red.sum -k 'regex:tile_(forward|backward)_kernel' --launch-count 2 build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --repeats 1 --calls 1 --json /tmp/z.json > $R/ncu-tiles-$1.txt 2>&1
  echo "$1 ncu: $(grep -E 'tile_(forward|backward)_kernel|gpu__time|smsp__inst|lts__t_req' $R/ncu-tiles-$1.txt | awk '{print $1, $NF}' | tr '\n' ' ')"
}
# Stage "head" (default) measures HEAD; stage "diet" expects the patch already applied to the
# working tree (two calls on one warm machine fit the 600 s limit where one did not).
stage=${1:-head}
[ "$stage" = build ] && { pack; exit 0; }  # (build only)
if [ "$stage" = head ]; then measure head; echo "all done $(( $(date +%s) - t0 )) s"; pack; exit 0; fi
# The whole GPU suite (90-110 s on an H100 in pass 36) covers every kernel the patch touches.
timeout 160 build/tests/hax_tests --gtest_filter='*Cuda*' > $R/gpu-suite.log 2>&1; echo "GPU suite rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/gpu-suite.log | tr '\n' ' ')"
grep -E "Failure|^\[  FAILED|Which is|Expected" $R/gpu-suite.log | head -20
pack
for tool in racecheck memcheck; do
  timeout 40 compute-sanitizer --tool $tool build/tests/hax_tests --gtest_filter='TileBlocksCuda.UnionBandIntervalsSmallInstance' > $R/$tool.log 2>&1; echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$tool.log | tr '\n' ' ')"
done
measure diet; pack
echo "all done $(( $(date +%s) - t0 )) s"; pack

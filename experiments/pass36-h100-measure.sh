#!/usr/bin/env bash
# Pass 36, call 2: every target of issue #5 on the card this call gets (an H100 if lent: the
# targets are for one), the scorer MLP with compile-time widths (HAX_SCORER_WGMMA=1 vs ncu of
# pass 36 call 1) and pack_bf16 as one conversion. Build, scorer tests, benches (HAX 16K/64K/256K,
# SW k=128, SSD, training), ncu per kernel of HAX and of the SSD at 64K, the GPU suite.
set -o pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
R=$OUT/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $OUT res; }
left() { echo $(( 585 - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
{ [ -d build ] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAX_CUDA=ON > $R/cfg.log 2>&1; } && cmake --build build > $R/build.log 2>&1 || { grep -E "error" -A3 $R/build.log | head -40; tail -20 $R/build.log; pack; exit 1; }
echo "build done $(( $(date +%s) - t0 )) s"
timeout 60 build/tests/hax_tests --gtest_filter='ScorerMlp*:KeySelection*Cuda*:*Scorer*Cuda*' > $R/scorer-tests.log 2>&1; echo "scorer tests rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/scorer-tests.log | tr '\n' ' ')"
grep -E "Failure|^\[  FAILED|Which is|Expected" $R/scorer-tests.log | head -20
a() {  # name, args
  timeout 90 build/hax bench attention --device cuda --dims 64 $2 --json $R/bench-att-$1.json > $R/bench-att-$1.txt 2>&1
  echo "$1: $(grep -E '^(hax|sw|ks|lsh) ' $R/bench-att-$1.txt | awk '{printf "%s L=%s %s / %s | ", $1, $2, $3, $4}') $(grep -iE 'error|what' $R/bench-att-$1.txt | head -2)"
}
s() {  # name: SSD fwd / fwd+bwd at 64K
  timeout 60 build/hax bench ssm --device cuda --lengths 64k --json $R/bench-$1.json > $R/bench-$1.txt 2>&1 || tail -5 $R/bench-$1.txt
  echo "$1: $(python3 -c "import json;d=json.load(open('$R/bench-$1.json'));print(' | '.join('%d %.3f / %.3f'%(x['L'],x['fwd_ms'],x['fwdbwd_ms']) for x in d['results']))")"
}
a hax64k-a "--patterns hax --lengths 64k"; a sw128-a "--patterns sw --keys 128 --lengths 64k"
s ssm-a
a hax64k-b "--patterns hax --lengths 64k"; a sw128-b "--patterns sw --keys 128 --lengths 64k"
s ssm-b
a hax-16k-256k "--patterns hax --lengths 16k,256k"
echo "benches done $(( $(date +%s) - t0 )) s"; pack
timeout 60 ncu --csv --metrics gpu__time_duration.sum build/hax bench attention --device cuda --patterns hax --lengths 64k --dims 64 --repeats 1 --calls 1 --json /tmp/x.json > $R/ncu-hax-64k.csv 2>/dev/null; echo "ncu rc=$?"
python3 scripts/ncu_summary.py $R/ncu-hax-64k.csv 1 12
timeout 100 ncu --csv --metrics gpu__time_duration.sum -k regex:'(dx_kernel|dcb_kernel|dbdc|state_pass|chunk_scan|cb_kernel|prep_kernel|ddt_kernel|da_kernel|local_state)' --launch-skip 80 -c 36 build/hax bench ssm --device cuda --lengths 64k --repeats 1 --json /tmp/s.json > $R/ncu-ssm-64k.csv 2>/dev/null; echo "ncu ssm rc=$? (3 fwd+bwd calls)"
python3 scripts/ncu_summary.py $R/ncu-ssm-64k.csv 3 16
echo "ncu done $(( $(date +%s) - t0 )) s"; pack
timeout 150 build/hax bench train --device cuda --variants mamba2+hax --precision bf16 --graphs on --seeds 2 --steps 40 --json $R/bench-train.json > $R/bench-train.txt 2>&1; echo "train rc=$?"; tail -4 $R/bench-train.txt
echo "train done $(( $(date +%s) - t0 )) s"; pack
T=$(left); [ $T -gt 175 ] && T=175
echo "suite with ${T} s"
timeout $T build/tests/hax_tests --gtest_filter='*Cuda*' > $R/gpu-suite.log 2>&1; echo "GPU suite rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/gpu-suite.log | tr '\n' ' ')"
grep -E '^\[  FAILED' $R/gpu-suite.log | head
tail -3 $R/gpu-suite.log
echo "suite done $(( $(date +%s) - t0 )) s"; pack

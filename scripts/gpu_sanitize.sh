#!/usr/bin/env bash
# compute-sanitizer over the GPU tests, as recorded in BENCHMARKS.md (sixth pass). Needs a CUDA
# build (cmake -S . -B build-d -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAX_CUDA=ON) and a GPU.
#   memcheck:  every GPU test except the long ones (L = 65537 and *Long*), in three runs: the op
#              tests (set `ops`, about 2 min on an H100), the model and training tests (`models`,
#              about 10 min, 7 of them for the two deterministic-mode training tests) and the
#              step-graph tests (`graphs`, over 4 min: the first alone took 2.5)
#   racecheck: 28 small tests that together launch every kernel file using shared memory
#              (about 3 min). racecheck runs about 100 times slower than a plain run, so the
#              larger tests do not fit. (Set `race`.)
# Usage: scripts/gpu_sanitize.sh [BUILD_DIR [SET]]   (default build-d, all sets; one set at a time
# keeps each run within a 10-minute device call). Exits non-zero on any error, hazard or failing
# test.
set -euo pipefail
cd "$(dirname "$0")/.."
T="${1:-build-d}/tests/hax_tests"
SET="${2:-all}"
case "$SET" in
  all | ops | models | graphs | race) ;;
  *) echo "gpu_sanitize.sh: SET '$SET' must be all, ops, models, graphs or race" >&2; exit 2 ;;
esac
[ -x "$T" ] || { echo "gpu_sanitize.sh: $T not found; build with -DHAX_CUDA=ON first" >&2; exit 2; }
CS="compute-sanitizer --error-exitcode 1"
OPS='*Cuda*:*CUDA*:-*65537*:*Long*:CudaModels.*:CudaTrain.*:CudaStepGraph.*'
MODELS='CudaModels.*:CudaTrain.*'
GRAPHS='CudaStepGraph.*'
SMALL='SparseAttentionCuda.AnyHeadDimUpTo128:SparseAttentionCuda.LongListsUseTheWorkspace'
SMALL+=':SparseAttentionCuda.TilePathSmallInstance:CausalAttentionCuda.WithoutLseCotangent'
SMALL+=':CausalAttentionCuda.GradientsAreBitIdenticalAcrossRuns:Conv1dCuda.OtherWidthsAndShortRows'
SMALL+=':Conv1dCuda.EmptyRowKeepsTheState:RankingLossCuda.Bfloat16CloseToFloat64:RankingLossCuda.Deterministic'
SMALL+=':RmsNormCuda.MatchesCpuFloat32AndBf16:SelectiveScanCuda.GradientsAreBitIdenticalAcrossRuns'
SMALL+=':SelectiveScanCuda.CheckpointsAreTheCpuCheckpoints:SsdCuda.EmptySequenceAndOddSizes'
SMALL+=':SsdCuda.FinalStateContinuesTheScan:SsdCuda.BackwardIsDeterministic:PatternCuda.LshBucketsEqualCpu'
SMALL+=':SsdCuda.ManyHeadsPerGroupBfloat16'
SMALL+=':PatternCuda.MergeAndKeyCountsEqualCpu:PrefixDirectionCuda.StridedQAndOddSizes'
SMALL+=':PrefixDirectionCuda.ZeroSumGivesZero:PatternCuda.TopKPrefixEqualCpu'
SMALL+=':SsmStepCuda.Conv1dStepMatchesCpuFloat32AndBf16:LshBandCuda.AttentionMatchesCpuFloat32AndBf16'
SMALL+=':JoinByLseCuda.MatchesCpu:PatternCuda.LshBucketsShapesEqualCpu:TileBlocksCuda.SmallInstances'
SMALL+=':AShapedAttentionCuda.SmallInstance'
SMALL+=':HsaAttentionCuda.SmallInstance:Hsa.CudaChunkLayoutTopKChunksAndListsEqualCpu'
want() { [ "$SET" = all ] || [ "$SET" = "$1" ]; }
if want ops; then $CS --tool memcheck --leak-check no "$T" --gtest_filter="$OPS"; fi
if want models; then $CS --tool memcheck --leak-check no "$T" --gtest_filter="$MODELS"; fi
if want graphs; then $CS --tool memcheck --leak-check no "$T" --gtest_filter="$GRAPHS"; fi
if want race; then $CS --tool racecheck "$T" --gtest_filter="$SMALL"; fi
echo "gpu_sanitize.sh: $SET clean"

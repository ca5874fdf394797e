#!/usr/bin/env bash
# The main job: set up, build, then train the default model (Mamba-2) on the default task
# (multi-query joint recall) with the embedded default config, and print its test accuracy.
# Extra arguments go to `hax train` (e.g. --steps 300, --config configs/paper/mamba2.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# --device auto: on the GPU when this build has the CUDA backend and a GPU is present, else the CPU.
exec build/hax train --device auto --run-dir "runs/main-$(date +%Y%m%d-%H%M%S)" "$@"

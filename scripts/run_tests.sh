#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (GoogleTest). Exits non-zero if any test fails.
# GPU tests skip cleanly (and are listed as SKIPPED) on machines without a CUDA device.
# Extra arguments go to the test binary (e.g. --gtest_filter='Ssd*').
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/tests/hax_tests "$@"

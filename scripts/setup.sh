#!/usr/bin/env bash
# Installs what hax needs on a Debian 12 machine (if missing) and builds it into build/.
# Usage: scripts/setup.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(build-essential cmake ninja-build libtorch-dev libopenblas0-pthread libcli11-dev libfmt-dev
      nlohmann-json3-dev libgtest-dev)
missing=()
if command -v dpkg >/dev/null 2>&1; then
  for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
fi
# A machine whose Python has torch (the GPU machine) uses that LibTorch and needs no libtorch-dev.
if [ ${#missing[@]} -gt 0 ] && python3 -c 'import torch' >/dev/null 2>&1; then
  missing=("${missing[@]/libtorch-dev/}"); missing=("${missing[@]/libopenblas0-pthread/}")
  missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
fi
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq || echo "setup: apt-get update failed; trying the install anyway"
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing packages ${missing[*]} and no apt-get; the configure step will say what it cannot find"
  fi
fi

GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build build --parallel "$(nproc)"

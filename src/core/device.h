// Where a run computes: "cpu", "cuda" (the first CUDA device; "cuda:N" for another) or "auto"
// (CUDA when this build has the CUDA backend and a GPU is present, else the CPU).
#pragma once
#include <ATen/ATen.h>

#include <string>

namespace hax {

// Resolves a --device value; `option` names the flag in errors ("--device"). A CUDA device
// without the CUDA backend, or without a GPU, is a clear error.
at::Device resolve_device(const std::string& name, const char* option = "--device");

}  // namespace hax

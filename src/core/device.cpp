#include "core/device.h"

#include "core/error.h"
#include "ops/backend.h"

namespace hax {

at::Device resolve_device(const std::string& name, const char* option) {
  if (name == "cpu") return at::kCPU;
  if (name == "auto") return ops::cuda_available() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  HAX_CHECK(name == "cuda" || name.rfind("cuda:", 0) == 0, "{} {} is unknown; choose cpu, cuda, cuda:N or auto",
            option, name);
  HAX_CHECK(ops::cuda_backend_built(),
            "{} {}: this build of hax has no CUDA backend (it needs nvcc and a CUDA-enabled LibTorch at configure "
            "time; see the README)",
            option, name);
  HAX_CHECK(at::hasCUDA(), "{} {}: no CUDA device is visible on this machine", option, name);
  int index = 0;
  if (name.size() > 5) {
    const std::string n = name.substr(5);
    HAX_CHECK(!n.empty() && n.find_first_not_of("0123456789") == std::string::npos, "{} {}: N in cuda:N must be a number",
              option, name);
    index = std::stoi(n);
  }
  return at::Device(at::kCUDA, (c10::DeviceIndex)index);
}

}  // namespace hax

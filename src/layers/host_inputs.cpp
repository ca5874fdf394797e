#include "layers/host_inputs.h"

namespace hax {

namespace {

// Host tensor -> device without waiting (pinned staging, ordered on the current stream).
at::Tensor upload(const at::Tensor& host, const at::Device& device) {
  if (device.is_cpu()) return host;
  return host.contiguous().pin_memory().to(device, /*non_blocking=*/true);
}

}  // namespace

bool HostInputs::refill(const ForwardContext& ctx) const {
  std::vector<at::Tensor> made;
  made.reserve(entries.size());
  for (const Entry& e : entries) {
    made.push_back(e.make(ctx));
    if (made.back().sizes() != e.buffer.sizes() || made.back().scalar_type() != e.buffer.scalar_type()) return false;
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    at::Tensor b = entries[i].buffer;  // a handle to the graph's buffer (copy_ writes into it)
    b.copy_(upload(made[i], b.device()), /*non_blocking=*/true);
  }
  return true;
}

at::Tensor host_input(const ForwardContext* ctx, const HostInputMaker& make, const at::Device& device) {
  const ForwardContext none;
  const at::Tensor host = make(ctx ? *ctx : none);
  if (!ctx || !ctx->host_inputs) return upload(host, device);
  HostInputs& in = *ctx->host_inputs;
  at::Tensor buffer = in.allocate ? in.allocate(host, device) : at::empty(host.sizes(), host.options().device(device));
  in.entries.push_back({make, buffer});
  return buffer;
}

}  // namespace hax

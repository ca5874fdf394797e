// Per-step inputs that layers make on the host: the LSH projections (drawn from the step's seed)
// and the ranking loss's candidate positions (drawn from the seed and the batch's valid mask).
//
// Eagerly, host_input() makes the tensor and uploads it. While a CUDA graph of the training step
// is captured (ctx.host_inputs set), it returns a device buffer instead and keeps the maker: the
// graph reads the buffer, and before every replay refill() runs each maker again for the new
// step's context and copies the result in. A maker must depend only on the context it is given
// and on values fixed for the run (sizes, seeds' salts, the layer's index).
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "layers/forward_context.h"

namespace hax {

// Makes a host (CPU) tensor for the step described by the context.
using HostInputMaker = std::function<at::Tensor(const ForwardContext&)>;

struct HostInputs {
  struct Entry {
    HostInputMaker make;  // the maker, run again before every replay
    at::Tensor buffer;    // the device tensor the graph reads
  };
  std::vector<Entry> entries;
  // Allocates a buffer like the host tensor on the device, outside the graph's memory pool: the
  // buffers are written between replays, so they must not share memory with the graph's own
  // temporaries (a temporary freed before the buffer was allocated in the capture would be
  // written over it in every replay). Set by the capturer (StepGraph carves them from a buffer
  // allocated before the capture); unset: at::empty.
  std::function<at::Tensor(const at::Tensor& host, const at::Device& device)> allocate;

  // Makes every entry for `ctx` and copies it into its buffer (stream-ordered, not waiting).
  // Returns false, copying nothing, when some maker's result no longer has its buffer's shape
  // and dtype (the step must then run eagerly).
  bool refill(const ForwardContext& ctx) const;
};

// The maker's tensor for this step on `device`: uploaded at once (eager), or, while a step is
// captured, a buffer of its shape that refill() fills before each replay.
at::Tensor host_input(const ForwardContext* ctx, const HostInputMaker& make, const at::Device& device);

}  // namespace hax

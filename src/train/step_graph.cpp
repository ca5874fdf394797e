#include "train/step_graph.h"

#include <chrono>
#include <climits>

#include <fmt/format.h>

#include "core/error.h"
#include "layers/host_inputs.h"

#if defined(HAX_TORCH_CUDA)
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace hax {

bool step_graphs_possible(const AdamW& opt, const at::Device& device, bool deterministic, std::string* why) {
  auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
#if !defined(HAX_TORCH_CUDA)
  (void)opt, (void)device, (void)deterministic;
  return no("this build of hax has no CUDA backend");
#else
  if (!device.is_cuda()) return no("the device is " + device.str() + ", not CUDA");
  if (!opt.fused())
    return no("the optimizer is not on its fused CUDA path (float32 CUDA parameters, LibTorch >= 2.4)");
  if (deterministic) return no("--deterministic backward passes size their scratch on the host every step");
  return true;
#endif
}

#if defined(HAX_TORCH_CUDA)

namespace {

// n plus an eighth, rounded up to a multiple of `multiple`.
int64_t with_room(int64_t n, int64_t multiple) {
  n += n / 8;
  return (n + multiple - 1) / multiple * multiple;
}

// The tensors of a batch that a step reads, in a fixed order.
std::vector<at::Tensor*> batch_tensors(Batch& b) {
  return {&b.inputs,    &b.targets,    &b.loss_mask,         &b.seq_idx,
          &b.sample_id, &b.supervised, &b.supervised_weight, &b.supervised_mask};
}

constexpr int64_t kTimedSteps = 4;  // adaptive: eager steps and replays timed before choosing
const char* const kArenaFull = "the host inputs outgrew their buffer";

// The first line of an exception's message (LibTorch appends long backtraces).
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

struct StepGraph::Impl {
  LanguageModel& model;
  AdamW& opt;
  std::map<std::string, at::Tensor> params;
  StepSettings settings;
  int32_t pad_id;
  at::cuda::CUDAStream stream;  // captures must run on a stream other than the default one
  int64_t rows = 0, length = 0, supervised = 0;  // the capacities
  int64_t variant = INT64_MIN;
  bool packed = false;
  int64_t warmup = 2;      // untimed eager steps before the first capture
  int64_t time_eager = 0;  // choosing (adaptive): eager steps still to time, then
  int64_t time_graph = 0;  // replays still to time
  double eager_seconds = 0, graph_seconds = 0;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  Batch dev;                      // the graph's batch (padded shape, on the device)
  HostInputs inputs;              // the graph's host-made inputs
  std::vector<at::Tensor> grads;  // the gradients the graph writes (kept alive with it)
  at::Tensor lr;                  // () float32: the learning rate the graph's AdamW reads
  at::Tensor out;                 // (4) float64: the graph's metrics
  // The host inputs' buffers are carved from `arena`, allocated before the capture: they are
  // written between replays, so they must not share memory with the graph's pool, where a
  // temporary freed before a buffer was allocated in the capture would write over it in every
  // replay. (Allocating them for another stream during the capture is not permitted.)
  at::Tensor arena;               // (bytes) uint8
  int64_t arena_used = 0, arena_needed = 0;

  Impl(LanguageModel& m, AdamW& o, std::map<std::string, at::Tensor> p, StepSettings s, int32_t pad, bool adaptive)
      : model(m), opt(o), params(std::move(p)), settings(std::move(s)), pad_id(pad),
        stream(at::cuda::getStreamFromPool(/*isHighPriority=*/false, m.device().index())),
        time_eager(adaptive ? kTimedSteps : 0),
        time_graph(adaptive ? kTimedSteps : 0) {}
  ~Impl() {
    if (graph) c10::cuda::device_synchronize();  // no replay still reads the buffers freed here
  }

  void release() {
    graph.reset();
    inputs.entries.clear();
    grads.clear();
    out = at::Tensor();
    dev = Batch{};
  }

  // Captures the step on `padded` (ctx: its context); returns the error, empty on success. A
  // capture whose host inputs outgrew the arena is repeated once with a larger one.
  std::string capture(const Batch& padded, ForwardContext& ctx) {
    std::string error = capture_once(padded, ctx);
    if (error == kArenaFull) error = capture_once(padded, ctx);
    return error;
  }

  std::string capture_once(const Batch& padded, ForwardContext& ctx) {
    c10::cuda::device_synchronize();  // the old graph's replays are done before its buffers go
    release();
    // The buffers written between replays (the batch, the rate, the host-made inputs) are
    // allocated outside the graph's pool, so that none shares memory with a temporary of the graph.
    dev = padded.to(model.device());
    lr = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(model.device()));
    if (!arena.defined() || arena.numel() < arena_needed)
      arena = at::empty({std::max<int64_t>(int64_t(4) << 20, 2 * arena_needed)},
                        at::TensorOptions().dtype(at::kByte).device(model.device()));
    arena_used = 0;
    bool overflow = false;
    inputs.allocate = [this, &overflow](const at::Tensor& host, const at::Device& device) {
      const int64_t bytes = host.numel() * (int64_t)host.element_size(), at = (arena_used + 255) / 256 * 256;
      arena_used = at + bytes;
      arena_needed = std::max(arena_needed, arena_used);
      if (arena_used <= arena.numel()) return arena.narrow(0, at, bytes).view(host.scalar_type()).view(host.sizes());
      overflow = true;  // this capture is measured, then repeated with a larger arena
      return at::empty(host.sizes(), host.options().device(device));
    };
    opt.zero_grad();  // the backward allocates the gradients inside the graph's pool
    ctx.host_inputs = &inputs;
    c10::cuda::device_synchronize();
    const bool cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);  // cached casts would outlive the capture
    auto g = std::make_unique<at::cuda::CUDAGraph>();
    std::string error;
    try {
      g->capture_begin();
      try {
        out = device_train_step(model, params, dev, ctx, settings,
                                [&](const at::Tensor& skip) { opt.step_on_device(lr, skip); });
      } catch (const std::exception& e) {
        error = first_line(e.what());
      }
      try {
        g->capture_end();
      } catch (const std::exception& e) {
        if (error.empty()) error = first_line(e.what());
      }
    } catch (const std::exception& e) {
      if (error.empty()) error = first_line(e.what());
    }
    at::autocast::set_autocast_cache_enabled(cache);
    ctx.host_inputs = nullptr;
    inputs.allocate = nullptr;  // (it refers to this call's `overflow`)
    ctx.valid = at::Tensor();
    ctx.ranking_losses.clear();
    if (error.empty() && overflow) error = kArenaFull;
    if (!error.empty()) {
      (void)cudaGetLastError();  // the failed capture's error must not surface at a later launch
      release();
      opt.zero_grad();
      return error;
    }
    for (auto& [name, p] : params) grads.push_back(p.grad());
    graph = std::move(g);
    return "";
  }
};

StepGraph::StepGraph(LanguageModel& model, AdamW& opt, std::map<std::string, at::Tensor> params,
                     StepSettings settings, bool adaptive, int32_t pad_id)
    : impl_(std::make_unique<Impl>(model, opt, std::move(params), std::move(settings), pad_id, adaptive)) {
  std::string why;
  if (!step_graphs_possible(opt, model.device(), false, &why)) disabled_reason_ = why;
}

StepGraph::~StepGraph() = default;

std::array<int64_t, 3> StepGraph::capacity() const { return {impl_->rows, impl_->length, impl_->supervised}; }

at::Tensor StepGraph::run(const Batch& batch, uint64_t seed, double lr, int64_t variant) {
  if (disabled()) return {};
  Impl& m = *impl_;
  if (!batch.supervised.defined() || !batch.supervised_weight.defined() || !batch.inputs.is_cpu()) {
    disabled_reason_ = "the batch does not come from make_batch on the CPU (its supervised positions unknown)";
    return {};
  }
  const int64_t rows = batch.inputs.size(0), length = batch.inputs.size(1), sup = batch.supervised.numel();
  const bool packed = batch.seq_idx.defined();
  const bool fits = rows <= m.rows && length <= m.length && sup <= m.supervised;
  if (!fits) {
    // Rows exactly (an eighth more measured 9-10% slower at the paper's batch, the packed row
    // counts settling within the first steps), positions rounded up to 8, supervised positions
    // (which vary more) with an eighth of room.
    m.rows = std::max(m.rows, rows);
    m.length = std::max(m.length, (length + 7) / 8 * 8);
    m.supervised = std::max(m.supervised, with_room(sup, 64));
  }
  const bool recapture = !m.graph || !fits || variant != m.variant || packed != m.packed;
  const Batch padded = pad_batch(batch, m.rows, m.length, m.supervised, m.pad_id);

  // The side stream starts after the work queued so far, and the caller's stream continues after it.
  const at::cuda::CUDAStream caller = at::cuda::getCurrentCUDAStream(m.model.device().index());
  at::cuda::CUDAEvent ready;
  ready.record(caller);
  ready.block(m.stream);
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) {
    c10::cuda::device_synchronize();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  at::Tensor result;
  {
    c10::cuda::CUDAStreamGuard guard(m.stream);
    if (m.warmup > 0 || m.time_eager > 0) {
      // An eager step on the batch itself: a warm-up step, or one timed against the replays.
      const bool timed = m.warmup == 0;
      if (timed) c10::cuda::device_synchronize();
      const auto t0 = Clock::now();
      ForwardContext ctx;
      ctx.seed = seed;
      m.opt.zero_grad();
      result = device_train_step(m.model, m.params, batch, ctx, m.settings,
                                 [&](const at::Tensor& skip) { m.opt.step(lr, skip); });
      if (timed) m.eager_seconds += seconds_since(t0), --m.time_eager;
      else --m.warmup;
      ++eager_;
    } else {
      ForwardContext ctx;
      ctx.training = true;
      ctx.seed = seed;
      ctx.valid_host = padded.sample_id >= 0;
      const bool timed = m.time_graph > 0 && !recapture;  // replays that capture nothing
      if (timed) c10::cuda::device_synchronize();
      const auto t0 = Clock::now();
      bool ok = true;
      if (recapture) {
        const std::string error = m.capture(padded, ctx);
        if (!error.empty()) {
          disabled_reason_ = "the step could not be captured as a CUDA graph: " + error;
          ok = false;
        } else {
          m.variant = variant, m.packed = packed;
          ++captures_;
        }
      } else {
        Batch src = padded;
        auto from = batch_tensors(src), to = batch_tensors(m.dev);
        for (size_t i = 0; i < from.size(); ++i)
          if (from[i]->defined()) to[i]->copy_(from[i]->pin_memory(), /*non_blocking=*/true);
      }
      if (ok && m.inputs.refill(ctx)) {
        m.lr.fill_(lr);
        m.graph->replay();
        // The parameters' .grad show this step's gradients, as after an eager step (an eager step
        // in between may have replaced them).
        size_t i = 0;
        for (auto& [name, p] : m.params) p.mutable_grad() = m.grads[i++];
        m.opt.note_step();
        ++replays_;
        result = m.out;
        if (timed) {
          m.graph_seconds += seconds_since(t0);
          if (--m.time_graph == 0) {
            // Decided once: the replays (padded batches) against the eager steps (as they are).
            const double eager_ms = 1e3 * m.eager_seconds / kTimedSteps, graph_ms = 1e3 * m.graph_seconds / kTimedSteps;
            if (graph_ms > 0.95 * eager_ms)
              disabled_reason_ = fmt::format(
                  "the replays were not faster than eager steps ({:.2f} against {:.2f} ms per step, timed over {} "
                  "steps each): this step is bound by the GPU, not by launches",
                  graph_ms, eager_ms, kTimedSteps);
          }
        }
      }
    }
  }
  at::cuda::CUDAEvent done;
  done.record(m.stream);
  done.block(caller);
  return result.defined() ? result.clone() : result;
}

#else  // no CUDA in this build: every step runs eagerly

struct StepGraph::Impl {};

StepGraph::StepGraph(LanguageModel&, AdamW&, std::map<std::string, at::Tensor>, StepSettings, bool, int32_t)
    : disabled_reason_("this build of hax has no CUDA backend") {}

StepGraph::~StepGraph() = default;

std::array<int64_t, 3> StepGraph::capacity() const { return {0, 0, 0}; }

at::Tensor StepGraph::run(const Batch&, uint64_t, double, int64_t) { return {}; }

#endif

}  // namespace hax

#include "tasks/batch.h"

#include <fmt/ranges.h>

#include <algorithm>

#include "core/error.h"

namespace hax {

namespace {

// Input positions a sample contributes.
int64_t positions(const Sample& s) { return std::max<int64_t>((int64_t)s.tokens.size() - 1, 0); }

// Fills a batch whose row r holds samples rows[r] in order.
Batch fill(const std::vector<Sample>& samples, const std::vector<std::vector<int32_t>>& rows,
           int32_t pad_id, bool packed) {
  const int64_t B = (int64_t)rows.size();
  int64_t T = 0;
  for (const auto& row : rows) {
    int64_t len = 0;
    for (int32_t i : row) len += positions(samples[i]);
    T = std::max(T, len);
  }
  Batch b;
  b.num_samples = (int64_t)samples.size();
  b.inputs = at::full({B, T}, pad_id, at::kLong);
  b.targets = at::full({B, T}, pad_id, at::kLong);
  b.loss_mask = at::zeros({B, T}, at::kFloat);
  b.sample_id = at::full({B, T}, -1, at::kInt);
  if (packed) b.seq_idx = at::empty({B, T}, at::kInt);
  int64_t* in = b.inputs.data_ptr<int64_t>();
  int64_t* tg = b.targets.data_ptr<int64_t>();
  float* lm = b.loss_mask.data_ptr<float>();
  int32_t* sid = b.sample_id.data_ptr<int32_t>();
  int32_t* seg = packed ? b.seq_idx.data_ptr<int32_t>() : nullptr;
  std::vector<int64_t> supervised;          // flat indices of loss_mask 1, ascending
  std::vector<int32_t> sup_sample;           // the sample of each supervised position
  std::vector<int64_t> count(samples.size(), 0);  // supervised positions per sample
  for (int64_t r = 0; r < B; ++r) {
    int64_t t = r * T;
    int32_t segment = 0;
    for (int32_t i : rows[r]) {
      const Sample& s = samples[i];
      HAX_CHECK(s.mask.size() == s.tokens.size(), "sample {} has {} tokens but {} mask entries", i,
                s.tokens.size(), s.mask.size());
      const int64_t n = positions(s);
      if (n == 0) continue;  // a one-token sample contributes nothing, not even a segment
      for (int64_t p = 0; p < n; ++p, ++t) {
        in[t] = s.tokens[p];
        tg[t] = s.tokens[p + 1];
        lm[t] = s.mask[p + 1] ? 1.f : 0.f;
        if (s.mask[p + 1]) supervised.push_back(t), sup_sample.push_back(i), ++count[i];
        sid[t] = i;
        if (seg) seg[t] = segment;
      }
      ++segment;
    }
    if (seg) std::fill(seg + t, seg + (r + 1) * T, segment);
    b.num_tokens += t - r * T;
  }
  // Rows are filled in order and positions within a row ascend, so `supervised` ascends.
  b.supervised = at::tensor(supervised, at::kLong);
  b.supervised_samples = (int64_t)samples.size() - std::count(count.begin(), count.end(), int64_t(0));
  std::vector<double> weight(supervised.size());
  for (size_t k = 0; k < supervised.size(); ++k) weight[k] = 1.0 / (double)count[sup_sample[k]];
  b.supervised_weight = at::tensor(weight, at::kDouble);
  return b;
}

}  // namespace

Batch Batch::to(const at::Device& device) const {
  if (inputs.device() == device) return *this;
  Batch b = *this;
  const bool pin = device.is_cuda() && inputs.device().is_cpu();
  for (at::Tensor* t : {&b.inputs, &b.targets, &b.loss_mask, &b.seq_idx, &b.sample_id, &b.supervised,
                     &b.supervised_weight, &b.supervised_mask})
    if (t->defined()) *t = (pin ? t->pin_memory() : *t).to(device, /*non_blocking=*/true);
  return b;
}

Batch make_batch(const std::vector<Sample>& samples, int32_t pad_id) {
  std::vector<std::vector<int32_t>> rows(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) rows[i] = {(int32_t)i};
  return fill(samples, rows, pad_id, false);
}

Batch make_packed_batch(const std::vector<Sample>& samples, int64_t pack_len, int32_t pad_id) {
  HAX_CHECK(pack_len >= 1, "--pack-len {} must be >= 1", pack_len);
  std::vector<std::vector<int32_t>> rows;
  std::vector<int64_t> room;  // free positions per row
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t n = positions(samples[i]);
    if (n == 0) continue;  // nothing to place
    size_t r = 0;
    while (r < rows.size() && room[r] < n) ++r;
    if (r == rows.size()) {
      rows.emplace_back();
      room.push_back(pack_len);
    }
    rows[r].push_back((int32_t)i);
    room[r] -= n;  // negative for an oversized sample: its row takes nothing more
  }
  return fill(samples, rows, pad_id, true);
}

Batch make_batch(const std::vector<Sample>& samples, bool pack, int64_t pack_len, int32_t pad_id) {
  return pack ? make_packed_batch(samples, pack_len, pad_id) : make_batch(samples, pad_id);
}

Batch pad_batch(const Batch& batch, int64_t rows, int64_t length, int64_t supervised, int32_t pad_id) {
  HAX_CHECK(batch.inputs.defined() && batch.inputs.dim() == 2 && batch.inputs.is_cpu(),
            "pad_batch: the batch's inputs must be a (B, T) tensor on the CPU");
  HAX_CHECK(batch.supervised.defined() && batch.supervised_weight.defined() && !batch.supervised_mask.defined(),
            "pad_batch: the batch must come from make_batch (its supervised positions known) and not be padded "
            "already");
  const int64_t B = batch.inputs.size(0), T = batch.inputs.size(1), M = batch.supervised.numel();
  HAX_CHECK(rows >= B, "pad_batch: rows = {} is fewer than the batch's {} rows", rows, B);
  HAX_CHECK(length >= T, "pad_batch: length = {} is shorter than the batch's {} positions", length, T);
  HAX_CHECK(supervised >= M, "pad_batch: supervised = {} is fewer than the batch's {} supervised positions",
            supervised, M);
  Batch p = batch;
  auto grow = [&](const at::Tensor& t, double fill) {  // (B, T) -> (rows, length), t in the top-left corner
    at::Tensor out = at::full({rows, length}, fill, t.options());
    out.narrow(0, 0, B).narrow(1, 0, T).copy_(t);
    return out;
  };
  p.inputs = grow(batch.inputs, pad_id);
  p.targets = grow(batch.targets, pad_id);
  p.loss_mask = grow(batch.loss_mask, 0);
  p.sample_id = grow(batch.sample_id, -1);
  if (batch.seq_idx.defined()) {
    p.seq_idx = grow(batch.seq_idx, 0);
    if (length > T && T > 0) {
      // A row's appended positions belong to its padding segment: the one after its last sample,
      // or the padding segment the row already ends in.
      const at::Tensor last_seg = batch.seq_idx.select(1, T - 1);
      const at::Tensor last_real = batch.sample_id.select(1, T - 1) >= 0;
      const at::Tensor pad_seg = last_seg + last_real.to(at::kInt);
      p.seq_idx.narrow(0, 0, B).narrow(1, T, length - T).copy_(pad_seg.unsqueeze(1).expand({B, length - T}));
    }
  }
  // Flat indices move from rows of T to rows of `length` positions.
  const at::Tensor sup = batch.supervised;
  const at::Tensor moved = at::div(sup, std::max<int64_t>(T, 1), "floor") * length + sup.remainder(std::max<int64_t>(T, 1));
  p.supervised = at::zeros({supervised}, at::kLong);
  p.supervised.narrow(0, 0, M).copy_(moved);
  p.supervised_weight = at::zeros({supervised}, at::kDouble);
  p.supervised_weight.narrow(0, 0, M).copy_(batch.supervised_weight);
  p.supervised_mask = at::zeros({supervised}, at::kFloat);
  p.supervised_mask.narrow(0, 0, M).fill_(1);
  return p;
}

at::Tensor per_sample_accuracy(const Batch& batch, const at::Tensor& correct) {
  HAX_CHECK(correct.sizes() == batch.targets.sizes(),
            "correct has shape {} but the batch's targets have shape {}",
            fmt::join(correct.sizes(), "x"), fmt::join(batch.targets.sizes(), "x"));
  const at::Tensor sel = batch.loss_mask.flatten() > 0;
  const at::Tensor ids = batch.sample_id.flatten().masked_select(sel).to(at::kLong);
  const at::Tensor hits = correct.to(at::kCPU).to(at::kDouble).flatten().masked_select(sel);
  const at::Tensor sums = at::zeros({batch.num_samples}, at::kDouble).index_add_(0, ids, hits);
  const at::Tensor counts =
      at::zeros({batch.num_samples}, at::kDouble).index_add_(0, ids, at::ones_like(hits));
  return sums / counts;
}

}  // namespace hax

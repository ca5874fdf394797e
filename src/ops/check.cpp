#include "ops/check.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "ops/backend.h"

namespace hax::ops {

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank, const char* dims) {
  HAX_CHECK(t.defined(), "{}: tensor {} is missing; it must be {}", op, name, dims);
  HAX_CHECK(t.dim() == rank, "{}: {} has shape {} but must have {} dimensions {}", op, name,
            shape_str(t.sizes()), rank, dims);
}

void check_shape(const char* op, const char* name, const at::Tensor& t, const std::vector<int64_t>& shape,
                 const char* dims) {
  check_rank(op, name, t, (int64_t)shape.size(), dims);
  HAX_CHECK(t.sizes().vec() == shape, "{}: {} has shape {} but must be {} = {}", op, name, shape_str(t.sizes()),
            dims, shape_str(shape));
}

void check_floating(const char* op, const char* name, const at::Tensor& t) {
  check_backend(op, name, t);
  if (t.device().is_cuda())
    HAX_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "{}: {} has dtype {} on {}, but the CUDA kernels take float32 or bfloat16", op, name,
              c10::toString(t.scalar_type()), t.device().str());
  else
    HAX_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              "{}: {} has dtype {} but must be float32 or float64 on the CPU", op, name,
              c10::toString(t.scalar_type()));
}

void check_same(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  HAX_CHECK(t.scalar_type() == like.scalar_type(), "{}: {} has dtype {} but must match the input's {}", op,
            name, c10::toString(t.scalar_type()), c10::toString(like.scalar_type()));
  HAX_CHECK(t.device() == like.device(), "{}: {} is on {} but the input is on {}", op, name, t.device().str(),
            like.device().str());
}

QkvDims check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_rank(op, "q", q, 4, "(B, L, H, D)");
  check_floating(op, "q", q);
  QkvDims d{q.size(0), q.size(1), q.size(2), q.size(3), 0};
  check_shape(op, "k", k, {d.B, d.L, d.H, d.D}, "(B, L, H, D)");
  check_rank(op, "v", v, 4, "(B, L, H, Dv)");
  d.Dv = v.size(3);
  check_shape(op, "v", v, {d.B, d.L, d.H, d.Dv}, "(B, L, H, Dv)");
  check_same(op, "k", k, q);
  check_same(op, "v", v, q);
  return d;
}

at::Tensor check_seq_idx(const char* op, const at::Tensor& seq_idx, int64_t B, int64_t L) {
  if (!seq_idx.defined()) return seq_idx;
  check_shape(op, "seq_idx", seq_idx, {B, L}, "(B, L)");
  HAX_CHECK(!at::isFloatingType(seq_idx.scalar_type()), "{}: seq_idx has dtype {} but must be an integer type",
            op, c10::toString(seq_idx.scalar_type()));
  at::Tensor s = seq_idx.to(at::kInt).contiguous();
  if (L > 1 && (!s.is_cuda() || check_device_values())) {
    bool ok = (s.narrow(1, 1, L - 1) >= s.narrow(1, 0, L - 1)).all().item<bool>();
    HAX_CHECK(ok, "{}: seq_idx must be non-decreasing along each row (it numbers packed sequences)", op);
  }
  return s;
}

namespace {

std::atomic<bool>& device_value_checks() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("HAX_CHECK_DEVICE_VALUES");
    return e != nullptr && std::strcmp(e, "0") != 0 && e[0] != 0;
  }()};
  return on;
}

}  // namespace

void set_check_device_values(bool on) { device_value_checks() = on; }
bool check_device_values() { return device_value_checks(); }

}  // namespace hax::ops

// Tensor argument checks shared by the ops' binding layers. Every failure is a hax::UsageError
// naming the op, the tensor, what it is and what it must be.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace hax::ops {

// `t` must be defined, have exactly `shape` (`dims` spells it, e.g. "(B, L, H)").
void check_shape(const char* op, const char* name, const at::Tensor& t, const std::vector<int64_t>& shape,
                 const char* dims);
// `t` must have `rank` dimensions (`dims` spells them).
void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank, const char* dims);
// `t` must have dtype `dtype` and live on the same device as `like`.
void check_same(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like);
// `t` must be on a device this build supports, and float32 or float64 on the CPU, float32 or
// bfloat16 on a CUDA device.
void check_floating(const char* op, const char* name, const at::Tensor& t);
// Self-attention inputs: q, k (B, L, H, D) and v (B, L, H, Dv) of one floating dtype on one
// device (check_floating). Returns {B, L, H, D, Dv}.
struct QkvDims {
  int64_t B, L, H, D, Dv;
};
QkvDims check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
// Converts an optional seq_idx (B, L) to contiguous int32 (on its own device) and checks that each
// row is non-decreasing. The row check reads tensor values: always on the CPU, on a CUDA device
// only while check_device_values() is on (it would stall the host on every call).
at::Tensor check_seq_idx(const char* op, const at::Tensor& seq_idx, int64_t B, int64_t L);

// Checks of argument *values* that live on a CUDA device (non-decreasing seq_idx, index ranges)
// copy them to the host and so synchronize with the GPU. They run only while this is on: off by
// default (training steps never wait on the host), on with set_check_device_values(true) or the
// environment variable HAX_CHECK_DEVICE_VALUES=1 (a debugging run). Checks of CPU tensors always run.
void set_check_device_values(bool on);
bool check_device_values();

std::string shape_str(at::IntArrayRef s);

}  // namespace hax::ops

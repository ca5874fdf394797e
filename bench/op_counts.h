// Counts the LibTorch operators a piece of code calls, for finding where a GPU step's launches go.
//
// While an OpCounter is alive, every operator call on any thread (the autograd engine's included)
// is seen through LibTorch's RecordFunction callbacks. A call that calls no other operator is a
// leaf: on a GPU, nearly every leaf other than a view or an allocation is one kernel launch (or a
// copy). Leaves are counted by (caller, name), the caller being the enclosing operator or autograd
// node, so that a count names its call site. hax's own scopes (RECORD_USER_SCOPE("hax::...") in
// the layers and the training step) get their host time summed.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace hax::bench {

class OpCounter {
 public:
  OpCounter();   // starts counting
  ~OpCounter();  // stops
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;

  // (caller, leaf name) -> calls since construction.
  std::map<std::pair<std::string, std::string>, int64_t> leaves() const;
  // A table of the `top` most frequent leaves, views and allocations listed apart, each count
  // divided by `per` (e.g. the number of steps counted).
  std::string table(int top, int64_t per = 1) const;

 private:
  uint64_t handle_ = 0;
};

}  // namespace hax::bench

// A small, fast, portable random number generator for everything hax draws itself (task samples,
// hashing seeds). Independent of LibTorch's generators so that a seed gives the same data on
// every machine and LibTorch version.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace hax {

// SplitMix64 step: used to derive independent seeds from (seed, stream, index).
inline uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A seed for stream `stream` (e.g. a split or a purpose) and item `index` of base seed `seed`.
inline uint64_t derive_seed(uint64_t seed, uint64_t stream, uint64_t index = 0) {
  uint64_t x = seed;
  uint64_t a = splitmix64(x);
  x = a ^ (stream * 0xD1B54A32D192ED03ull);
  uint64_t b = splitmix64(x);
  x = b ^ (index * 0x8CB92BA72F3D8DD7ull);
  return splitmix64(x);
}

// xoshiro256** generator.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    uint64_t x = seed;
    for (auto& w : s_) w = splitmix64(x);
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform integer in [0, n), n > 0 (unbiased: Lemire's method with rejection).
  uint64_t below(uint64_t n) {
    uint64_t x = next();
    __uint128_t m = (__uint128_t)x * n;
    uint64_t l = (uint64_t)m;
    if (l < n) {
      uint64_t t = -n % n;
      while (l < t) {
        x = next();
        m = (__uint128_t)x * n;
        l = (uint64_t)m;
      }
    }
    return (uint64_t)(m >> 64);
  }
  // Uniform integer in [lo, hi] (inclusive).
  int64_t range(int64_t lo, int64_t hi) { return lo + (int64_t)below((uint64_t)(hi - lo + 1)); }
  // Uniform double in [0, 1).
  double uniform() { return (next() >> 11) * 0x1.0p-53; }
  // Fisher-Yates shuffle.
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }
  // A uniformly random permutation of 0..n-1.
  std::vector<int> permutation(int n) {
    std::vector<int> p(n);
    for (int i = 0; i < n; ++i) p[i] = i;
    shuffle(p);
    return p;
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace hax

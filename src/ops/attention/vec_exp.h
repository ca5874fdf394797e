// exp() for the softmax loops of the attention kernels, written in plain arithmetic so that GCC and
// Clang vectorize a loop of it (`#pragma omp simd`): std::exp is a library call that stops
// vectorization, and the causal attention kernel evaluates L²/2 of them.
//
// Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, a polynomial for e^r and 2^n put into
// the exponent bits. Accuracy: about 1 ulp in float, 2 ulp in double. Results below the smallest
// normal number are flushed to 0, and exp(-inf) = 0 (what a masked softmax entry needs); x > ~88
// (float) / ~709 (double) gives +inf; NaN is not propagated (callers never pass it).
#pragma once
#include <cstdint>
#include <cstring>

namespace hax::ops::detail {

inline float vexp(float x) {
  const float lo = -87.3365447f, hi = 88.7228394f;  // e^lo = smallest normal float, e^hi ~ FLT_MAX
  const float xc = x < lo ? lo : (x > hi ? hi : x);
  const float magic = 12582912.0f;                  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  int32_t ti;
  std::memcpy(&ti, &t, sizeof(ti));
  const int32_t ni = ti - 0x4B400000;               // the integer n (bits of magic subtracted)
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t ei = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &ei, sizeof(scale));
  const float y = p * scale;
  return x < lo ? 0.0f : (x > hi ? __builtin_inff() : y);
}

inline double vexp(double x) {
  const double lo = -708.396418532264, hi = 709.782712893384;
  const double xc = x < lo ? lo : (x > hi ? hi : x);
  const double magic = 6755399441055744.0;          // 1.5 * 2^52
  const double t = xc * 1.4426950408889634074 + magic;
  const double n = t - magic;
  int64_t ti;
  std::memcpy(&ti, &t, sizeof(ti));
  const int64_t ni = ti - 0x4338000000000000LL;
  const double r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  // Taylor series of e^r to degree 13: the truncation error is below 5e-18 for |r| <= ln2/2.
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r * r + r + 1.0;
  const int64_t ei = (ni + 1023) << 52;
  double scale;
  std::memcpy(&scale, &ei, sizeof(scale));
  const double y = p * scale;
  return x < lo ? 0.0 : (x > hi ? __builtin_inf() : y);
}

}  // namespace hax::ops::detail

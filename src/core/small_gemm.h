// Small dense matrix products for CPU kernels (chunks of 16..256 rows that live in cache), with
// register tiles of GCC/Clang vector types so that the compiler emits vector FMAs whatever the
// instruction set (AVX-512, AVX2 or SSE). Row-major throughout.
#pragma once
#include <cstdint>
#include <cstring>

namespace hax {
namespace detail {

#if defined(__AVX512F__)
constexpr int kGemmRows = 8, kVecBytes = 64;  // 32 vector registers: 8 rows x 2 vectors of accumulators
#elif defined(__AVX__)
constexpr int kGemmRows = 4, kVecBytes = 32;  // 16 vector registers
#else
constexpr int kGemmRows = 4, kVecBytes = 16;
#endif

// Element (i, k) of A: row-major (M x K, lda), or, with TA, A^T stored row-major (K x M, lda).
template <bool TA, class T>
inline T a_at(const T* A, int64_t lda, int64_t i, int64_t k) {
  return TA ? A[k * lda + i] : A[i * lda + k];
}

// An RM x (NV * lanes) tile of C = (accumulate ? C : 0) + A B kept in registers over the K loop;
// V is a vector type of `lanes` elements of T.
template <class T, class V, int RM, int NV, bool TA = false>
inline void gemm_tile(int64_t i, int64_t j, int64_t K, const T* __restrict A, int64_t lda, const T* __restrict B,
                      int64_t ldb, T* __restrict C, int64_t ldc, bool accumulate) {
  constexpr int lanes = sizeof(V) / sizeof(T);
  V acc[RM][NV];
  for (int r = 0; r < RM; ++r)
    for (int v = 0; v < NV; ++v) {
      if (accumulate) std::memcpy(&acc[r][v], C + (i + r) * ldc + j + v * lanes, sizeof(V));
      else acc[r][v] = V{};
    }
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&b[v], B + k * ldb + j + v * lanes, sizeof(V));
    for (int r = 0; r < RM; ++r) {
      const T a = a_at<TA>(A, lda, i + r, k);
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(C + (i + r) * ldc + j + v * lanes, &acc[r][v], sizeof(V));
}

// Columns j.. of one scalar-width tail.
template <class T, int RM, bool TA>
inline void gemm_tail(int64_t i, int64_t j, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                      T* C, int64_t ldc, bool accumulate) {
  for (int r = 0; r < RM; ++r) {
    T* crow = C + (i + r) * ldc;
    for (int64_t c = j; c < N; ++c) {
      T s = accumulate ? crow[c] : T(0);
      for (int64_t k = 0; k < K; ++k) s += a_at<TA>(A, lda, i + r, k) * B[k * ldb + c];
      crow[c] = s;
    }
  }
}

// Rows i .. i+RM-1 of C: tiles of two widest vectors, then one vector of each narrower width
// down to 16 bytes, then scalars.
template <class T, int RM, bool TA>
inline void gemm_rows(int64_t i, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                      int64_t ldc, bool accumulate) {
  typedef T VW __attribute__((vector_size(kVecBytes)));
  typedef T V32 __attribute__((vector_size(kVecBytes >= 32 ? 32 : 16)));
  typedef T V16 __attribute__((vector_size(16)));
  constexpr int64_t w = kVecBytes / sizeof(T), w32 = 32 / sizeof(T), w16 = 16 / sizeof(T);
  int64_t j = 0;
  for (; j + 2 * w <= N; j += 2 * w) gemm_tile<T, VW, RM, 2, TA>(i, j, K, A, lda, B, ldb, C, ldc, accumulate);
  if (j + w <= N) gemm_tile<T, VW, RM, 1, TA>(i, j, K, A, lda, B, ldb, C, ldc, accumulate), j += w;
  if (kVecBytes > 32 && j + w32 <= N) gemm_tile<T, V32, RM, 1, TA>(i, j, K, A, lda, B, ldb, C, ldc, accumulate), j += w32;
  if (kVecBytes > 16 && j + w16 <= N) gemm_tile<T, V16, RM, 1, TA>(i, j, K, A, lda, B, ldb, C, ldc, accumulate), j += w16;
  if (j < N) gemm_tail<T, RM, TA>(i, j, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

template <bool TA, class T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
          bool accumulate) {
  constexpr int RM = kGemmRows;
  int64_t i = 0;
  for (; i + RM <= M; i += RM) gemm_rows<T, RM, TA>(i, N, K, A, lda, B, ldb, C, ldc, accumulate);
  for (; i < M; ++i) gemm_rows<T, 1, TA>(i, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

}  // namespace detail

// C (M x N, leading dim ldc) = (accumulate ? C : 0) + A (M x K, lda) * B (K x N, ldb).
template <class T>
void small_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                bool accumulate) {
  detail::gemm<false>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

// C (M x N, ldc) = (accumulate ? C : 0) + A^T B, where A is stored row-major as (K x M, lda) and
// B is (K x N, ldb): a product with the transpose of a stored matrix, without transposing it.
template <class T>
void small_gemm_tn(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                   int64_t ldc, bool accumulate) {
  detail::gemm<true>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

// Transposes A (M x N, lda) into B (N x M, ldb).
template <class T>
void transpose(int64_t M, int64_t N, const T* A, int64_t lda, T* B, int64_t ldb) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) B[j * ldb + i] = A[i * lda + j];
}

}  // namespace hax

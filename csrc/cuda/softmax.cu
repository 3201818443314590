// Scaled softmax with a causal or explicit mask, and its backward: each row read once into registers
// (16-byte accesses when aligned), float math.
#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

// Softmax of x[0, len) * scale into y[0, len) over the entries with keep set; the others are 0, and a
// row with nothing kept is all 0.  Packs at or past `limit` are not read (all their entries are dropped).
template <int N, int P, typename T>
__device__ void softmax_row(const T* x, T* y, const bool (&keep)[P][N], int64_t packs, int64_t limit, float scale,
                            float* scratch) {
  float v[P][N];
  load_row<N, P>(x, limit, v);
  // Scores in base 2 (x * scale * log2 e), so each exponential is one exp2.
  const float scale2 = scale * kLog2e;
  float mx = -INFINITY;
#pragma unroll
  for (int q = 0; q < P; ++q)
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v[q][i] *= scale2;
      if (keep[q][i]) mx = fmaxf(mx, v[q][i]);
    }
  mx = row_max(mx, scratch);
  float sum = 0.0f;
#pragma unroll
  for (int q = 0; q < P; ++q)
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v[q][i] = keep[q][i] ? exp2f(v[q][i] - mx) : 0.0f;
      sum += v[q][i];
    }
  sum = row_sum(sum, scratch);
  const float inv = mx == -INFINITY ? 0.0f : 1.0f / sum;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = pack_index(q);
    if (k >= packs) continue;
#pragma unroll
    for (int i = 0; i < N; ++i) v[q][i] *= inv;
    store<N>(y + k * N, v[q]);
  }
}

// Row r of [.., s, s] is at position r % s: entries j <= r % s are kept.
template <typename T, int N, int P>
__global__ void ROW_BOUNDS(N, P) causal_softmax_kernel(const T* x, T* y, int64_t rows, int64_t s, float scale) {
  __shared__ float scratch[32];
  const int64_t r = row_index(rows);
  if (r < 0) return;
  const int64_t n = fast_mod(r, s) + 1, packs = s / N;
  bool keep[P][N];
#pragma unroll
  for (int q = 0; q < P; ++q)
#pragma unroll
    for (int i = 0; i < N; ++i) keep[q][i] = pack_index(q) * N + i < n;
  softmax_row<N, P>(x + r * s, y + r * s, keep, packs, (n + N - 1) / N, scale, scratch);
}

template <typename T, int N, int P>
__global__ void ROW_BOUNDS(N, P) masked_softmax_kernel(const T* x, const bool* mask, T* y, int64_t rows, int64_t d1, int64_t d2,
                                      int64_t n, int64_t s0, int64_t s1, int64_t s2, float scale) {
  __shared__ float scratch[32];
  const int64_t r = row_index(rows);
  if (r < 0) return;
  const int64_t i2 = fast_mod(r, d2), i1 = fast_mod(fast_div(r, d2), d1), i0 = fast_div(r, d2 * d1), packs = n / N;
  const bool* m = mask + i0 * s0 + i1 * s1 + i2 * s2;
  bool keep[P][N];
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = pack_index(q);
    if (k < packs) {
      load_mask<N>(m + k * N, keep[q]);
#pragma unroll
      for (int i = 0; i < N; ++i) keep[q][i] = !keep[q][i];
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) keep[q][i] = false;
    }
  }
  softmax_row<N, P>(x + r * n, y + r * n, keep, packs, packs, scale, scratch);
}

template <typename T, int N, int P>
__global__ void ROW_BOUNDS(N, P) softmax_bwd_kernel(const T* grad, const T* y, T* grad_x, int64_t rows, int64_t n, float scale) {
  __shared__ float scratch[32];
  const int64_t r = row_index(rows);
  if (r < 0) return;
  const int64_t packs = n / N;
  float g[P][N], yv[P][N];
  load_row<N, P>(grad + r * n, packs, g);
  load_row<N, P>(y + r * n, packs, yv);
  float dot = 0.0f;
#pragma unroll
  for (int q = 0; q < P; ++q)
#pragma unroll
    for (int i = 0; i < N; ++i) dot += g[q][i] * yv[q][i];
  dot = row_sum(dot, scratch);
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = pack_index(q);
    if (k >= packs) continue;
#pragma unroll
    for (int i = 0; i < N; ++i) g[q][i] = scale * yv[q][i] * (g[q][i] - dot);
    store<N>(grad_x + r * n + k * N, g[q]);
  }
}

}  // namespace

cudaError_t causal_softmax_fwd(int dtype, const void* x, void* y, int64_t rows, int64_t s, float scale,
                               cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, return row_dispatch<T>(vectorizable<T>(s, {x, y}), rows, s, [&](auto n, auto p, RowLaunch at) {
    causal_softmax_kernel<T, decltype(n)::value, decltype(p)::value>
        <<<at.grid, at.block, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), rows, s, scale);
    return cudaGetLastError();
  }));
  return cudaSuccess;
}

cudaError_t masked_softmax_fwd(int dtype, const void* x, const bool* mask, void* y, int64_t d0, int64_t d1,
                               int64_t d2, int64_t n, int64_t s0, int64_t s1, int64_t s2, float scale,
                               cudaStream_t stream) {
  const int64_t rows = d0 * d1 * d2;
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, {
    // The mask's rows start at multiples of its strides: packs of N bools stay aligned when they are too.
    const bool vec = vectorizable<T>(n, {x, y, mask}) && s0 % kVec<T> == 0 && s1 % kVec<T> == 0 &&
                     s2 % kVec<T> == 0;
    return row_dispatch<T>(vec, rows, n, [&](auto v, auto p, RowLaunch at) {
      masked_softmax_kernel<T, decltype(v)::value, decltype(p)::value><<<at.grid, at.block, 0, stream>>>(
          static_cast<const T*>(x), mask, static_cast<T*>(y), rows, d1, d2, n, s0, s1, s2, scale);
      return cudaGetLastError();
    });
  });
  return cudaSuccess;
}

cudaError_t softmax_bwd(int dtype, const void* grad, const void* y, void* grad_x, int64_t rows, int64_t n,
                        float scale, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, return row_dispatch<T>(vectorizable<T>(n, {grad, y, grad_x}), rows, n,
                                                  [&](auto v, auto p, RowLaunch at) {
    softmax_bwd_kernel<T, decltype(v)::value, decltype(p)::value><<<at.grid, at.block, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(y), static_cast<T*>(grad_x), rows, n, scale);
    return cudaGetLastError();
  }));
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace megalite

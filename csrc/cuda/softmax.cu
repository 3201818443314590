// Scaled softmax with a causal or explicit mask, and its backward: one block per row, float math.
#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

// Softmax of x[0, n) * scale into y[0, len): entries at j >= n or with mask[j] set are 0; a row with
// nothing left is all 0.
template <typename T>
__device__ void softmax_row(const T* x, const bool* mask, T* y, int64_t n, int64_t len, float scale, float* scratch) {
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    if (mask == nullptr || !mask[j]) mx = fmaxf(mx, to_float(x[j]) * scale);
  }
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    if (mask == nullptr || !mask[j]) sum += expf(to_float(x[j]) * scale - mx);
  }
  sum = block_sum(sum, scratch);
  const float inv = mx == -INFINITY ? 0.0f : 1.0f / sum;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
    const bool keep = j < n && (mask == nullptr || !mask[j]);
    y[j] = from_float<T>(keep ? expf(to_float(x[j]) * scale - mx) * inv : 0.0f);
  }
}

template <typename T>
__global__ void causal_softmax_kernel(const T* x, T* y, int64_t s, float scale) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  softmax_row<T>(x + r * s, nullptr, y + r * s, r % s + 1, s, scale, scratch);
}

template <typename T>
__global__ void masked_softmax_kernel(const T* x, const bool* mask, T* y, int64_t d1, int64_t d2, int64_t n,
                                      int64_t s0, int64_t s1, int64_t s2, float scale) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int64_t i2 = r % d2, i1 = (r / d2) % d1, i0 = r / (d2 * d1);
  softmax_row<T>(x + r * n, mask + i0 * s0 + i1 * s1 + i2 * s2, y + r * n, n, n, scale, scratch);
}

template <typename T>
__global__ void softmax_bwd_kernel(const T* grad, const T* y, T* grad_x, int64_t n, float scale) {
  __shared__ float scratch[32];
  const int64_t base = blockIdx.x * n;
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += to_float(grad[base + j]) * to_float(y[base + j]);
  dot = block_sum(dot, scratch);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float yv = to_float(y[base + j]);
    grad_x[base + j] = from_float<T>(scale * yv * (to_float(grad[base + j]) - dot));
  }
}

}  // namespace

cudaError_t causal_softmax_fwd(int dtype, const void* x, void* y, int64_t rows, int64_t s, float scale,
                               cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, causal_softmax_kernel<T><<<rows, row_threads(s), 0, stream>>>(
                               static_cast<const T*>(x), static_cast<T*>(y), s, scale));
  return cudaGetLastError();
}

cudaError_t masked_softmax_fwd(int dtype, const void* x, const bool* mask, void* y, int64_t d0, int64_t d1,
                               int64_t d2, int64_t n, int64_t s0, int64_t s1, int64_t s2, float scale,
                               cudaStream_t stream) {
  const int64_t rows = d0 * d1 * d2;
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, masked_softmax_kernel<T><<<rows, row_threads(n), 0, stream>>>(
                               static_cast<const T*>(x), mask, static_cast<T*>(y), d1, d2, n, s0, s1, s2, scale));
  return cudaGetLastError();
}

cudaError_t softmax_bwd(int dtype, const void* grad, const void* y, void* grad_x, int64_t rows, int64_t n,
                        float scale, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, softmax_bwd_kernel<T><<<rows, row_threads(n), 0, stream>>>(
                               static_cast<const T*>(grad), static_cast<const T*>(y), static_cast<T*>(grad_x), n,
                               scale));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megalite

// MoE token permute / unpermute over a row map (row j <- assignment row_map[j] = t * k + slot).
// The inverse map lets every token gather its own rows, so no atomics are needed.
#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

__global__ void inverse_kernel(const int64_t* row_map, int64_t* inverse, int64_t n, int64_t assignments) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j < n && row_map[j] >= 0 && row_map[j] < assignments) inverse[row_map[j]] = j;
}

// Row j of out is token row_map[j] / k (zeros for an ignored entry); each thread moves packs of N columns.
template <typename T, int N>
__global__ void gather_kernel(const T* tokens, const int64_t* row_map, T* out, int64_t h, int64_t k,
                              int64_t assignments) {
  const int64_t j = blockIdx.x, a = row_map[j];
  const bool valid = a >= 0 && a < assignments;
  for (int64_t c = threadIdx.x * N; c < h; c += blockDim.x * N) {
    float v[N] = {};
    if (valid) load<N>(tokens + fast_div(a, k) * h + c, v);
    store<N>(out + j * h + c, v);
  }
}

// out[t] = sum over kept slots of (probs ? probs[t, slot] : 1) * rows[inverse[t * k + slot]].
template <typename T, int N>
__global__ void combine_kernel(const T* rows, const int64_t* inverse, const float* probs, T* out, int64_t h,
                               int64_t k) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x * N; c < h; c += blockDim.x * N) {
    float acc[N] = {};
    for (int64_t slot = 0; slot < k; ++slot) {
      const int64_t j = inverse[t * k + slot];
      if (j < 0) continue;
      const float w = probs == nullptr ? 1.0f : probs[t * k + slot];
      float v[N];
      load<N>(rows + j * h + c, v);
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] += w * v[i];
    }
    store<N>(out + t * h + c, acc);
  }
}

template <typename T, int N>
__global__ void unpermute_bwd_kernel(const T* grad, const T* permuted, const int64_t* row_map, const float* probs,
                                     T* grad_permuted, float* grad_probs, int64_t h, int64_t assignments, int64_t k) {
  __shared__ float scratch[32];
  const int64_t j = blockIdx.x, a = row_map[j];
  const bool valid = a >= 0 && a < assignments;
  const float w = valid ? probs[a] : 0.0f;
  const T* g = grad + (valid ? fast_div(a, k) : 0) * h;
  float dot = 0.0f;
  for (int64_t c = threadIdx.x * N; c < h; c += blockDim.x * N) {
    float gc[N] = {}, pv[N], out[N];
    if (valid) load<N>(g + c, gc);
    load<N>(permuted + j * h + c, pv);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      out[i] = w * gc[i];
      dot += gc[i] * pv[i];
    }
    store<N>(grad_permuted + j * h + c, out);
  }
  dot = row_sum(dot, scratch);
  if (threadIdx.x == 0 && valid) grad_probs[a] = dot;
}

// Launches kernel<T, N> with one block per row of h columns, N = kVec<T> when `vec`, else 1.
#define LAUNCH_ROWS(vec, blocks, h, kernel, ...)                                                       \
  do {                                                                                                 \
    if (vec) {                                                                                         \
      kernel<T, kVec<T>><<<blocks, row_threads((h) / kVec<T>), 0, stream>>>(__VA_ARGS__);              \
    } else {                                                                                           \
      kernel<T, 1><<<blocks, row_threads(h), 0, stream>>>(__VA_ARGS__);                                \
    }                                                                                                  \
  } while (0)

cudaError_t build_inverse(const int64_t* row_map, int64_t* inverse, int64_t n, int64_t assignments,
                          cudaStream_t stream) {
  if (n > 0) inverse_kernel<<<(n + 255) / 256, 256, 0, stream>>>(row_map, inverse, n, assignments);
  return cudaGetLastError();
}

}  // namespace

cudaError_t permute_fwd(int dtype, const void* tokens, const int64_t* row_map, void* out, int64_t n, int64_t h,
                        int64_t k, int64_t num_tokens, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_ROWS(vectorizable<T>(h, {tokens, out}), n, h, gather_kernel,
                                       static_cast<const T*>(tokens), row_map, static_cast<T*>(out), h, k,
                                       num_tokens * k));
  return cudaGetLastError();
}

cudaError_t permute_bwd(int dtype, const void* grad, const int64_t* row_map, int64_t* inverse, void* grad_tokens,
                        int64_t n, int64_t h, int64_t k, int64_t num_tokens, cudaStream_t stream) {
  const cudaError_t status = build_inverse(row_map, inverse, n, num_tokens * k, stream);
  if (status != cudaSuccess || num_tokens == 0) return status;
  MEGALITE_DISPATCH(dtype, LAUNCH_ROWS(vectorizable<T>(h, {grad, grad_tokens}), num_tokens, h, combine_kernel,
                                       static_cast<const T*>(grad), inverse, nullptr, static_cast<T*>(grad_tokens), h,
                                       k));
  return cudaGetLastError();
}

cudaError_t unpermute_fwd(int dtype, const void* permuted, const int64_t* row_map, const float* probs,
                          int64_t* inverse, void* out, int64_t n, int64_t h, int64_t k, int64_t num_tokens,
                          cudaStream_t stream) {
  const cudaError_t status = build_inverse(row_map, inverse, n, num_tokens * k, stream);
  if (status != cudaSuccess || num_tokens == 0) return status;
  MEGALITE_DISPATCH(dtype, LAUNCH_ROWS(vectorizable<T>(h, {permuted, out}), num_tokens, h, combine_kernel,
                                       static_cast<const T*>(permuted), inverse, probs, static_cast<T*>(out), h, k));
  return cudaGetLastError();
}

cudaError_t unpermute_bwd(int dtype, const void* grad, const void* permuted, const int64_t* row_map,
                          const float* probs, void* grad_permuted, float* grad_probs, int64_t n, int64_t h, int64_t k,
                          int64_t num_tokens, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_ROWS(vectorizable<T>(h, {grad, permuted, grad_permuted}), n, h,
                                       unpermute_bwd_kernel, static_cast<const T*>(grad),
                                       static_cast<const T*>(permuted), row_map, probs,
                                       static_cast<T*>(grad_permuted), grad_probs, h, num_tokens * k, k));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megalite

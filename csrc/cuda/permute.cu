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

template <typename T>
__global__ void gather_kernel(const T* tokens, const int64_t* row_map, T* out, int64_t h, int64_t k,
                              int64_t assignments) {
  const int64_t j = blockIdx.x, a = row_map[j];
  const bool valid = a >= 0 && a < assignments;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) out[j * h + c] = valid ? tokens[(a / k) * h + c] : from_float<T>(0.0f);
}

// out[t] = sum over kept slots of (probs ? probs[t, slot] : 1) * rows[inverse[t * k + slot]].
template <typename T>
__global__ void combine_kernel(const T* rows, const int64_t* inverse, const float* probs, T* out, int64_t h,
                               int64_t k) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    float acc = 0.0f;
    for (int64_t slot = 0; slot < k; ++slot) {
      const int64_t j = inverse[t * k + slot];
      if (j >= 0) acc += (probs == nullptr ? 1.0f : probs[t * k + slot]) * to_float(rows[j * h + c]);
    }
    out[t * h + c] = from_float<T>(acc);
  }
}

template <typename T>
__global__ void unpermute_bwd_kernel(const T* grad, const T* permuted, const int64_t* row_map, const float* probs,
                                     T* grad_permuted, float* grad_probs, int64_t h, int64_t assignments, int64_t k) {
  __shared__ float scratch[32];
  const int64_t j = blockIdx.x, a = row_map[j];
  const bool valid = a >= 0 && a < assignments;
  const float w = valid ? probs[a] : 0.0f;
  const T* g = grad + (valid ? a / k : 0) * h;
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const float gc = valid ? to_float(g[c]) : 0.0f;
    grad_permuted[j * h + c] = from_float<T>(w * gc);
    dot += gc * to_float(permuted[j * h + c]);
  }
  dot = block_sum(dot, scratch);
  if (threadIdx.x == 0 && valid) grad_probs[a] = dot;
}

cudaError_t build_inverse(const int64_t* row_map, int64_t* inverse, int64_t n, int64_t assignments,
                          cudaStream_t stream) {
  if (n > 0) inverse_kernel<<<(n + 255) / 256, 256, 0, stream>>>(row_map, inverse, n, assignments);
  return cudaGetLastError();
}

}  // namespace

cudaError_t permute_fwd(int dtype, const void* tokens, const int64_t* row_map, void* out, int64_t n, int64_t h,
                        int64_t k, int64_t num_tokens, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, gather_kernel<T><<<n, row_threads(h), 0, stream>>>(
                               static_cast<const T*>(tokens), row_map, static_cast<T*>(out), h, k, num_tokens * k));
  return cudaGetLastError();
}

cudaError_t permute_bwd(int dtype, const void* grad, const int64_t* row_map, int64_t* inverse, void* grad_tokens,
                        int64_t n, int64_t h, int64_t k, int64_t num_tokens, cudaStream_t stream) {
  const cudaError_t status = build_inverse(row_map, inverse, n, num_tokens * k, stream);
  if (status != cudaSuccess || num_tokens == 0) return status;
  MEGALITE_DISPATCH(dtype, combine_kernel<T><<<num_tokens, row_threads(h), 0, stream>>>(
                               static_cast<const T*>(grad), inverse, nullptr, static_cast<T*>(grad_tokens), h, k));
  return cudaGetLastError();
}

cudaError_t unpermute_fwd(int dtype, const void* permuted, const int64_t* row_map, const float* probs,
                          int64_t* inverse, void* out, int64_t n, int64_t h, int64_t k, int64_t num_tokens,
                          cudaStream_t stream) {
  const cudaError_t status = build_inverse(row_map, inverse, n, num_tokens * k, stream);
  if (status != cudaSuccess || num_tokens == 0) return status;
  MEGALITE_DISPATCH(dtype, combine_kernel<T><<<num_tokens, row_threads(h), 0, stream>>>(
                               static_cast<const T*>(permuted), inverse, probs, static_cast<T*>(out), h, k));
  return cudaGetLastError();
}

cudaError_t unpermute_bwd(int dtype, const void* grad, const void* permuted, const int64_t* row_map,
                          const float* probs, void* grad_permuted, float* grad_probs, int64_t n, int64_t h, int64_t k,
                          int64_t num_tokens, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, unpermute_bwd_kernel<T><<<n, row_threads(h), 0, stream>>>(
                               static_cast<const T*>(grad), static_cast<const T*>(permuted), row_map, probs,
                               static_cast<T*>(grad_permuted), grad_probs, h, num_tokens * k, k));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megalite

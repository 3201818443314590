// LayerNorm and RMSNorm over the last dim: one block per row, float math,
// weight gradients reduced deterministically in two stages (row chunks, then chunks).
#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

constexpr int64_t kRowsPerChunk = 64;

template <typename T>
__global__ void layer_norm_fwd_kernel(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd,
                                      int64_t h, float eps) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * h;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) sum += to_float(xr[j]);
  const float mu = block_sum(sum, scratch) / h;
  float var = 0.0f;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float c = to_float(xr[j]) - mu;
    var += c * c;
  }
  const float rs = rsqrtf(block_sum(var, scratch) / h + eps);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) y[r * h + j] = from_float<T>((to_float(xr[j]) - mu) * rs * w[j] + b[j]);
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// mean == nullptr selects RMSNorm (no centering, no bias gradient).
template <typename T>
__global__ void norm_bwd_rows_kernel(const T* grad, const T* x, const float* w, const float* mean, const float* rstd,
                                     T* grad_x, int64_t h) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const float mu = mean == nullptr ? 0.0f : mean[r], rs = rstd[r];
  float s1 = 0.0f, s2 = 0.0f;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float g = to_float(grad[r * h + j]) * w[j];
    s1 += g;
    s2 += g * (to_float(x[r * h + j]) - mu) * rs;
  }
  s1 = mean == nullptr ? 0.0f : block_sum(s1, scratch) / h;
  s2 = block_sum(s2, scratch) / h;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float g = to_float(grad[r * h + j]) * w[j];
    const float xh = (to_float(x[r * h + j]) - mu) * rs;
    grad_x[r * h + j] = from_float<T>(rs * (g - s1 - xh * s2));
  }
}

// partial_w[c, j] = sum over chunk c of grad * xhat; partial_b[c, j] = sum of grad (when non-null).
template <typename T>
__global__ void norm_bwd_partial_kernel(const T* grad, const T* x, const float* mean, const float* rstd,
                                        float* partial_w, float* partial_b, int64_t rows, int64_t h) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= h) return;
  const int64_t c = blockIdx.y, r1 = min(rows, (c + 1) * kRowsPerChunk);
  float gw = 0.0f, gb = 0.0f;
  for (int64_t r = c * kRowsPerChunk; r < r1; ++r) {
    const float g = to_float(grad[r * h + j]);
    const float mu = mean == nullptr ? 0.0f : mean[r];
    gw += g * (to_float(x[r * h + j]) - mu) * rstd[r];
    gb += g;
  }
  partial_w[c * h + j] = gw;
  if (partial_b != nullptr) partial_b[c * h + j] = gb;
}

__global__ void sum_chunks_kernel(const float* partial, float* out, int64_t chunks, int64_t h) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= h) return;
  float total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c * h + j];
  out[j] = total;
}

template <typename T>
__global__ void rms_norm_fwd_kernel(const T* x, const float* w, T* y, float* rstd, int64_t h, float eps) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * h;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float v = to_float(xr[j]);
    ss += v * v;
  }
  const float rs = rsqrtf(block_sum(ss, scratch) / h + eps);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) y[r * h + j] = from_float<T>(to_float(xr[j]) * rs * w[j]);
  if (threadIdx.x == 0) rstd[r] = rs;
}

template <typename T>
cudaError_t norm_bwd(const T* grad, const T* x, const float* w, const float* mean, const float* rstd, T* grad_x,
                     float* grad_w, float* grad_b, float* workspace, int64_t rows, int64_t h, cudaStream_t stream) {
  if (rows == 0) return cudaMemsetAsync(grad_w, 0, h * sizeof(float), stream);
  norm_bwd_rows_kernel<T><<<rows, row_threads(h), 0, stream>>>(grad, x, w, mean, rstd, grad_x, h);
  const int64_t chunks = norm_bwd_chunks(rows);
  float* partial_b = grad_b == nullptr ? nullptr : workspace + chunks * h;
  const dim3 grid((h + 255) / 256, chunks);
  norm_bwd_partial_kernel<T><<<grid, 256, 0, stream>>>(grad, x, mean, rstd, workspace, partial_b, rows, h);
  sum_chunks_kernel<<<(h + 255) / 256, 256, 0, stream>>>(workspace, grad_w, chunks, h);
  if (grad_b != nullptr) sum_chunks_kernel<<<(h + 255) / 256, 256, 0, stream>>>(partial_b, grad_b, chunks, h);
  return cudaGetLastError();
}

}  // namespace

int64_t norm_bwd_chunks(int64_t rows) { return rows == 0 ? 1 : (rows + kRowsPerChunk - 1) / kRowsPerChunk; }

cudaError_t layer_norm_fwd(int dtype, const void* x, const float* weight, const float* bias, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, layer_norm_fwd_kernel<T><<<rows, row_threads(h), 0, stream>>>(
                               static_cast<const T*>(x), weight, bias, static_cast<T*>(y), mean, rstd, h, eps));
  return cudaGetLastError();
}

cudaError_t layer_norm_bwd(int dtype, const void* grad, const void* x, const float* weight, const float* mean,
                           const float* rstd, void* grad_x, float* grad_weight, float* grad_bias, float* workspace,
                           int64_t rows, int64_t h, cudaStream_t stream) {
  if (rows == 0) {
    cudaMemsetAsync(grad_bias, 0, h * sizeof(float), stream);
    return cudaMemsetAsync(grad_weight, 0, h * sizeof(float), stream);
  }
  MEGALITE_DISPATCH(dtype, return norm_bwd<T>(static_cast<const T*>(grad), static_cast<const T*>(x), weight, mean,
                                              rstd, static_cast<T*>(grad_x), grad_weight, grad_bias, workspace, rows,
                                              h, stream));
  return cudaSuccess;
}

cudaError_t rms_norm_fwd(int dtype, const void* x, const float* weight, void* y, float* rstd, int64_t rows, int64_t h,
                         float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, rms_norm_fwd_kernel<T><<<rows, row_threads(h), 0, stream>>>(
                               static_cast<const T*>(x), weight, static_cast<T*>(y), rstd, h, eps));
  return cudaGetLastError();
}

cudaError_t rms_norm_bwd(int dtype, const void* grad, const void* x, const float* weight, const float* rstd,
                         void* grad_x, float* grad_weight, float* workspace, int64_t rows, int64_t h,
                         cudaStream_t stream) {
  MEGALITE_DISPATCH(dtype, return norm_bwd<T>(static_cast<const T*>(grad), static_cast<const T*>(x), weight, nullptr,
                                              rstd, static_cast<T*>(grad_x), grad_weight, nullptr, workspace, rows, h,
                                              stream));
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace megalite

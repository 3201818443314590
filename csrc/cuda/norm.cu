// LayerNorm and RMSNorm over the last dim: each row read once into registers (16-byte accesses when
// aligned), float math, weight gradients reduced deterministically in two stages (row chunks, then chunks).
#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

constexpr int64_t kRowsPerChunk = 64;

// mean == nullptr selects RMSNorm (no centering; bias ignored).
template <typename T, int N, int P>
__global__ void __launch_bounds__(1024) norm_fwd_kernel(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd,
                                int64_t rows, int64_t h, float eps) {
  __shared__ float scratch[32];
  const int64_t r = row_index(rows);
  if (r < 0) return;
  const int64_t packs = h / N;
  float v[P][N];
  load_row<N, P>(x + r * h, packs, v);
  float mu = 0.0f;
  if (mean != nullptr) {
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < P; ++q)
#pragma unroll
      for (int i = 0; i < N; ++i) sum += v[q][i];
    mu = row_sum(sum, scratch) / h;
  }
  float ss = 0.0f;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    if (pack_index(q) < packs) {
#pragma unroll
      for (int i = 0; i < N; ++i) ss += (v[q][i] - mu) * (v[q][i] - mu);
    }
  }
  const float rs = rsqrtf(row_sum(ss, scratch) / h + eps);
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = pack_index(q);
    if (k >= packs) continue;
    float out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int64_t j = k * N + i;
      out[i] = (v[q][i] - mu) * rs * w[j] + (mean == nullptr ? 0.0f : b[j]);
    }
    store<N>(y + r * h + k * N, out);
  }
  if (threadIdx.x == 0) {
    if (mean != nullptr) mean[r] = mu;
    rstd[r] = rs;
  }
}

// grad_x of one row: rs * (g - mean(g) - xhat * mean(g * xhat)) with g = grad * w (no mean(g) for RMSNorm).
template <typename T, int N, int P>
__global__ void __launch_bounds__(1024) norm_bwd_rows_kernel(const T* grad, const T* x, const float* w, const float* mean, const float* rstd,
                                     T* grad_x, int64_t rows, int64_t h) {
  __shared__ float scratch[32];
  const int64_t r = row_index(rows);
  if (r < 0) return;
  const int64_t packs = h / N;
  const float mu = mean == nullptr ? 0.0f : mean[r], rs = rstd[r];
  float g[P][N], xh[P][N];
  load_row<N, P>(grad + r * h, packs, g);
  load_row<N, P>(x + r * h, packs, xh);
  float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = pack_index(q);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      g[q][i] *= k < packs ? w[k * N + i] : 0.0f;
      xh[q][i] = (xh[q][i] - mu) * rs;
      s1 += g[q][i];
      s2 += g[q][i] * xh[q][i];
    }
  }
  s1 = mean == nullptr ? 0.0f : row_sum(s1, scratch) / h;
  s2 = row_sum(s2, scratch) / h;
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = pack_index(q);
    if (k >= packs) continue;
    float out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = rs * (g[q][i] - s1 - xh[q][i] * s2);
    store<N>(grad_x + r * h + k * N, out);
  }
}

// partial_w[c, j] = sum over chunk c of grad * xhat; partial_b[c, j] = sum of grad (when non-null).
// Each thread owns N adjacent columns.
template <typename T, int N>
__global__ void norm_bwd_partial_kernel(const T* grad, const T* x, const float* mean, const float* rstd,
                                        float* partial_w, float* partial_b, int64_t rows, int64_t h) {
  const int64_t j = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * N;
  if (j >= h) return;
  const int64_t c = blockIdx.y, r1 = min(rows, (c + 1) * kRowsPerChunk);
  float gw[N] = {}, gb[N] = {};
  for (int64_t r = c * kRowsPerChunk; r < r1; ++r) {
    float g[N], xv[N];
    load<N>(grad + r * h + j, g);
    load<N>(x + r * h + j, xv);
    const float mu = mean == nullptr ? 0.0f : mean[r], rs = rstd[r];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      gw[i] += g[i] * (xv[i] - mu) * rs;
      gb[i] += g[i];
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    partial_w[c * h + j + i] = gw[i];
    if (partial_b != nullptr) partial_b[c * h + j + i] = gb[i];
  }
}

__global__ void sum_chunks_kernel(const float* partial, float* out, int64_t chunks, int64_t h) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= h) return;
  float total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c * h + j];
  out[j] = total;
}

template <typename T>
cudaError_t norm_fwd(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd, int64_t rows,
                     int64_t h, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return row_dispatch<T>(vectorizable<T>(h, {x, y}), rows, h, [&](auto n, auto p, RowLaunch at) {
    norm_fwd_kernel<T, decltype(n)::value, decltype(p)::value>
        <<<at.grid, at.block, 0, stream>>>(x, w, b, y, mean, rstd, rows, h, eps);
    return cudaGetLastError();
  });
}

template <typename T>
cudaError_t norm_bwd(const T* grad, const T* x, const float* w, const float* mean, const float* rstd, T* grad_x,
                     float* grad_w, float* grad_b, float* workspace, int64_t rows, int64_t h, cudaStream_t stream) {
  if (rows == 0) {
    if (grad_b != nullptr) cudaMemsetAsync(grad_b, 0, h * sizeof(float), stream);
    return cudaMemsetAsync(grad_w, 0, h * sizeof(float), stream);
  }
  const bool vec = vectorizable<T>(h, {grad, x, grad_x});
  const cudaError_t status = row_dispatch<T>(vec, rows, h, [&](auto n, auto p, RowLaunch at) {
    norm_bwd_rows_kernel<T, decltype(n)::value, decltype(p)::value>
        <<<at.grid, at.block, 0, stream>>>(grad, x, w, mean, rstd, grad_x, rows, h);
    return cudaGetLastError();
  });
  if (status != cudaSuccess) return status;
  const int64_t chunks = norm_bwd_chunks(rows);
  float* partial_b = grad_b == nullptr ? nullptr : workspace + chunks * h;
  const int n = vec ? kVec<T> : 1;
  const dim3 grid((h / n + 255) / 256, chunks);
  if (vec) {
    norm_bwd_partial_kernel<T, kVec<T>><<<grid, 256, 0, stream>>>(grad, x, mean, rstd, workspace, partial_b, rows, h);
  } else {
    norm_bwd_partial_kernel<T, 1><<<grid, 256, 0, stream>>>(grad, x, mean, rstd, workspace, partial_b, rows, h);
  }
  sum_chunks_kernel<<<(h + 255) / 256, 256, 0, stream>>>(workspace, grad_w, chunks, h);
  if (grad_b != nullptr) sum_chunks_kernel<<<(h + 255) / 256, 256, 0, stream>>>(partial_b, grad_b, chunks, h);
  return cudaGetLastError();
}

}  // namespace

int64_t norm_bwd_chunks(int64_t rows) { return rows == 0 ? 1 : (rows + kRowsPerChunk - 1) / kRowsPerChunk; }

cudaError_t layer_norm_fwd(int dtype, const void* x, const float* weight, const float* bias, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, cudaStream_t stream) {
  MEGALITE_DISPATCH(dtype, return norm_fwd<T>(static_cast<const T*>(x), weight, bias, static_cast<T*>(y), mean, rstd,
                                              rows, h, eps, stream));
  return cudaSuccess;
}

cudaError_t layer_norm_bwd(int dtype, const void* grad, const void* x, const float* weight, const float* mean,
                           const float* rstd, void* grad_x, float* grad_weight, float* grad_bias, float* workspace,
                           int64_t rows, int64_t h, cudaStream_t stream) {
  MEGALITE_DISPATCH(dtype, return norm_bwd<T>(static_cast<const T*>(grad), static_cast<const T*>(x), weight, mean,
                                              rstd, static_cast<T*>(grad_x), grad_weight, grad_bias, workspace, rows,
                                              h, stream));
  return cudaSuccess;
}

cudaError_t rms_norm_fwd(int dtype, const void* x, const float* weight, void* y, float* rstd, int64_t rows, int64_t h,
                         float eps, cudaStream_t stream) {
  MEGALITE_DISPATCH(dtype, return norm_fwd<T>(static_cast<const T*>(x), weight, nullptr, static_cast<T*>(y), nullptr,
                                              rstd, rows, h, eps, stream));
  return cudaSuccess;
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

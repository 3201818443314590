// LayerNorm and RMSNorm over the last dim: each row read once into registers (16-byte accesses when
// aligned), float math.  The backward reads each row once too: a fixed set of row slots walks the rows,
// each thread summing its columns' weight gradients in registers, and the slots' partial sums are then
// added in slot order (deterministic, no atomics).
#include <algorithm>

#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

// Row slots of the backward: enough blocks to fill the GPU, each walking rows/slots rows.
constexpr int64_t kMaxSlots = 1024;

// mean == nullptr selects RMSNorm (no centering; bias ignored).
template <typename T, int N, int P>
__global__ void ROW_BOUNDS(N, P) norm_fwd_kernel(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd,
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
    float out[N], wv[N], bv[N] = {};
    load_floats<N>(w + k * N, wv);
    if (mean != nullptr) load_floats<N>(b + k * N, bv);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = (v[q][i] - mu) * rs * wv[i] + bv[i];
    store<N>(y + r * h + k * N, out);
  }
  if (threadIdx.x == 0) {
    if (mean != nullptr) mean[r] = mu;
    rstd[r] = rs;
  }
}

// grad_x of each row: rs * (g - mean(g) - xhat * mean(g * xhat)) with g = grad * w (no mean(g) for RMSNorm).
// Row slot `slot` (its row group) takes rows slot, slot + slots, ...; each thread adds grad * xhat (and grad)
// of its packs into registers and writes them to partial_w[slot] (partial_b[slot] when non-null) at the end.
template <typename T, int N, int P>
__global__ void ROW_BOUNDS(N, P) norm_bwd_kernel(const T* grad, const T* x, const float* w, const float* mean,
                                                 const float* rstd, T* grad_x, float* partial_w, float* partial_b,
                                                 int64_t rows, int64_t h) {
  __shared__ float scratch[32];
  const int64_t packs = h / N, slots = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const int64_t slot = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y;
  float dw[P][N] = {}, db[P][N] = {};
  for (int64_t r = slot; r < rows; r += slots) {
    const float mu = mean == nullptr ? 0.0f : mean[r], rs = rstd[r];
    float g[P][N], xh[P][N];
    load_row<N, P>(grad + r * h, packs, g);
    load_row<N, P>(x + r * h, packs, xh);
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int q = 0; q < P; ++q) {
      float wv[N] = {};  // the weights stay in L1 across rows; registers hold the row and the sums
      if (pack_index(q) < packs) load_floats<N>(w + pack_index(q) * N, wv);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        xh[q][i] = (xh[q][i] - mu) * rs;
        dw[q][i] += g[q][i] * xh[q][i];
        db[q][i] += g[q][i];
        g[q][i] *= wv[i];
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
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = pack_index(q);
    if (k >= packs) continue;
    store_floats<N>(partial_w + slot * h + k * N, dw[q]);
    if (partial_b != nullptr) store_floats<N>(partial_b + slot * h + k * N, db[q]);
  }
}

// out[j] = the sum over chunks of partial[c, j] in a fixed order: for 32 columns (threadIdx.x), 32 lanes
// (threadIdx.y) each add every 32nd chunk, then the lanes' sums are added in lane order.
__global__ void sum_chunks_kernel(const float* partial, float* out, int64_t chunks, int64_t h) {
  __shared__ float sums[32][33];
  const int64_t j = blockIdx.x * 32 + threadIdx.x;
  float total = 0.0f;
  if (j < h) {
    for (int64_t c = threadIdx.y; c < chunks; c += 32) total += partial[c * h + j];
  }
  sums[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y != 0 || j >= h) return;
  total = 0.0f;
  for (int y = 0; y < 32; ++y) total += sums[y][threadIdx.x];
  out[j] = total;
}

template <typename T>
cudaError_t norm_fwd(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd, int64_t rows,
                     int64_t h, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return row_dispatch<T>(vectorizable<T>(h, {x, y, w, b}), rows, h, [&](auto n, auto p, RowLaunch at) {
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
  const int64_t chunks = norm_bwd_chunks(rows);
  float* partial_b = grad_b == nullptr ? nullptr : workspace + chunks * h;
  int64_t slots = 0;
  const bool vec = vectorizable<T>(h, {grad, x, grad_x, w, workspace, partial_b});
  const cudaError_t status = row_dispatch<T>(vec, rows, h, [&](auto n, auto p, RowLaunch at) {
    // As many row slots as rows, up to the workspace's chunks (a multiple of every block's row count).
    at.grid.x = static_cast<unsigned int>((std::min(rows, chunks) + at.block.y - 1) / at.block.y);
    slots = static_cast<int64_t>(at.grid.x) * at.block.y;
    norm_bwd_kernel<T, decltype(n)::value, decltype(p)::value><<<at.grid, at.block, 0, stream>>>(
        grad, x, w, mean, rstd, grad_x, workspace, partial_b, rows, h);
    return cudaGetLastError();
  });
  if (status != cudaSuccess) return status;
  const unsigned int columns = static_cast<unsigned int>((h + 31) / 32);
  sum_chunks_kernel<<<columns, dim3(32, 32), 0, stream>>>(workspace, grad_w, slots, h);
  if (grad_b != nullptr) sum_chunks_kernel<<<columns, dim3(32, 32), 0, stream>>>(partial_b, grad_b, slots, h);
  return cudaGetLastError();
}

}  // namespace

int64_t norm_bwd_chunks(int64_t rows) { return (std::min(std::max(rows, int64_t{1}), kMaxSlots) + 7) / 8 * 8; }

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

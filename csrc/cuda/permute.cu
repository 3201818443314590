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

// ---- The row map: kept assignments (expert id >= 0) stably sorted by expert id, as a counting sort over tiles
// of kSortTile assignments.  row_map_stats_kernel finds the largest id and the kept count (the host sizes the
// row map from them); tile_counts_kernel counts each tile's assignments per expert into hist[expert][tile];
// tile_offsets_kernel turns hist into where each (expert, tile) run starts in the row map (an exclusive scan
// in expert-major order); tile_rank_kernel places each assignment at its run's start plus the number of
// same-expert assignments before it in its tile (warps matched on the id, then the warps before it).
constexpr int kStatsThreads = 1024;

__global__ void row_map_stats_kernel(const int64_t* ids, int64_t n, int64_t* stats) {
  __shared__ int64_t top[kStatsThreads / 32], kept[kStatsThreads / 32];
  int64_t m = -1, k = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    m = ids[i] > m ? ids[i] : m;
    k += ids[i] >= 0;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const int64_t other = __shfl_xor_sync(0xffffffffu, m, offset);
    m = other > m ? other : m;
    k += __shfl_xor_sync(0xffffffffu, k, offset);
  }
  if ((threadIdx.x & 31) == 0) top[threadIdx.x >> 5] = m, kept[threadIdx.x >> 5] = k;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
      m = top[w] > m ? top[w] : m;
      k += kept[w];
    }
    stats[0] = m + 1;
    stats[1] = k;
  }
}

__global__ void tile_counts_kernel(const int64_t* ids, int64_t n, int experts, int64_t* hist) {
  __shared__ int counts[kMaxSortExperts];
  const int64_t tiles = gridDim.x, i = static_cast<int64_t>(blockIdx.x) * kSortTile + threadIdx.x;
  if (threadIdx.x < experts) counts[threadIdx.x] = 0;
  __syncthreads();
  if (i < n && ids[i] >= 0) atomicAdd(&counts[ids[i]], 1);
  __syncthreads();
  if (threadIdx.x < experts) hist[threadIdx.x * tiles + blockIdx.x] = counts[threadIdx.x];
}

__global__ void tile_offsets_kernel(int64_t* hist, int experts, int64_t tiles) {
  __shared__ int64_t base[kMaxSortExperts];
  const int e = threadIdx.x;
  int64_t running = 0;
  if (e < experts) {
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t count = hist[e * tiles + t];
      hist[e * tiles + t] = running;
      running += count;
    }
    base[e] = running;
  }
  __syncthreads();
  if (e == 0) {
    int64_t sum = 0;
    for (int x = 0; x < experts; ++x) {
      const int64_t total = base[x];
      base[x] = sum;
      sum += total;
    }
  }
  __syncthreads();
  if (e < experts) {
    for (int64_t t = 0; t < tiles; ++t) hist[e * tiles + t] += base[e];
  }
}

__global__ void tile_rank_kernel(const int64_t* ids, int64_t n, int experts, const int64_t* hist, int64_t* row_map) {
  __shared__ int warp_counts[kSortTile / 32][kMaxSortExperts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int j = threadIdx.x; j < (kSortTile / 32) * experts; j += blockDim.x) warp_counts[j / experts][j % experts] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kSortTile + threadIdx.x;
  const int e = i < n && ids[i] >= 0 ? static_cast<int>(ids[i]) : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && lane == __ffs(peers) - 1) warp_counts[warp][e] = __popc(peers);
  __syncthreads();
  if (e < 0) return;
  int before = rank;
  for (int w = 0; w < warp; ++w) before += warp_counts[w][e];
  row_map[hist[e * static_cast<int64_t>(gridDim.x) + blockIdx.x] + before] = i;
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

cudaError_t row_map_stats(const int64_t* ids, int64_t n, int64_t* stats, cudaStream_t stream) {
  row_map_stats_kernel<<<1, kStatsThreads, 0, stream>>>(ids, n, stats);
  return cudaGetLastError();
}

cudaError_t row_map_counting_sort(const int64_t* ids, int64_t n, int experts, int64_t* hist, int64_t* row_map,
                                  cudaStream_t stream) {
  if (experts < 1 || experts > kMaxSortExperts) return cudaErrorInvalidValue;
  const int64_t tiles = (n + kSortTile - 1) / kSortTile;
  if (tiles == 0) return cudaSuccess;
  // Each launch is checked before the next: the last one writes where the others' results say.
  tile_counts_kernel<<<static_cast<unsigned int>(tiles), kSortTile, 0, stream>>>(ids, n, experts, hist);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  tile_offsets_kernel<<<1, kMaxSortExperts, 0, stream>>>(hist, experts, tiles);
  if ((status = cudaGetLastError()) != cudaSuccess) return status;
  tile_rank_kernel<<<static_cast<unsigned int>(tiles), kSortTile, 0, stream>>>(ids, n, experts, hist, row_map);
  return cudaGetLastError();
}

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

// Device helpers shared by the megalite CUDA kernels: dtype conversion, block reductions, dispatch.
#pragma once

#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels.h"

namespace megalite {
namespace cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// ---- 16-byte accesses.  A kernel templated on N moves N elements of T per load and store: N = 16 /
// sizeof(T) (8 bf16 / fp16, 4 fp32) when the launcher found every pointer 16-byte aligned and rows a
// whole number of packs, else 1.  Half types move 8 values per instruction instead of 1.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pack.v[i]);
}

template <int N, typename T>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// N floats (weights, statistics, cos/sin tables, fp32 partial sums) as 16-byte loads and stores when N is a
// multiple of 4 (the launcher checked 16-byte alignment), else one at a time.
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      out[i] = f.x, out[i + 1] = f.y, out[i + 2] = f.z, out[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = p[i];
  }
}

template <int N>
__device__ __forceinline__ void store_floats(float* p, const float (&in)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(in[i], in[i + 1], in[i + 2], in[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = in[i];
  }
}

// a / b and a % b for a >= 0, b > 0.  A 64-bit division is a long software routine on the GPU (dozens of
// instructions, enough to make an elementwise kernel compute-bound); 32-bit is a few, so take it when both fit.
__device__ __forceinline__ int64_t fast_div(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

__device__ __forceinline__ int64_t fast_mod(int64_t a, int64_t b) { return a - fast_div(a, b) * b; }

// exp(v) as exp2(v * log2 e): the hardware's exp2 unit (2 ulp), without expf's longer range reduction.
constexpr float kLog2e = 1.4426950408889634f;

// ---- Counter-based random numbers for dropout: Philox4x32-10 (Salmon et al., SC'11), the generator behind
// Triton's tl.randint4x, which megalite/kernels/philox.py uses to compute the same draws for the reference.
// Draw g under a 64-bit seed is philox(counter (g, 0, 0, 0), key (seed low word, seed high word)); element e
// of a tensor takes word e % 4 of draw e / 4 (the counter keeps the low 32 bits of e / 4).
__device__ __forceinline__ uint4 philox(uint32_t counter, uint64_t seed) {
  uint32_t c0 = counter, c1 = 0, c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi_a = __umulhi(0xD2511F53u, c0), lo_a = 0xD2511F53u * c0;
    const uint32_t hi_b = __umulhi(0xCD9E8D57u, c2), lo_b = 0xCD9E8D57u * c2;
    c0 = hi_b ^ c1 ^ k0;
    c2 = hi_a ^ c3 ^ k1;
    c1 = lo_b;
    c3 = lo_a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

// keep[i] for elements e .. e + N of a dropout under `seed`: kept when the element's word is below
// `threshold` (kept with probability threshold / 2^32).  A pack of N = 4 or 8 starts at a multiple of N,
// so it is one or two whole draws; N = 1 draws for its one element.
template <int N>
__device__ __forceinline__ void keep_mask(uint64_t seed, int64_t e, uint32_t threshold, bool (&keep)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int g = 0; g < N / 4; ++g) {
      const uint4 r = philox(static_cast<uint32_t>((e >> 2) + g), seed);
      keep[4 * g] = r.x < threshold;
      keep[4 * g + 1] = r.y < threshold;
      keep[4 * g + 2] = r.z < threshold;
      keep[4 * g + 3] = r.w < threshold;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint4 r = philox(static_cast<uint32_t>((e + i) >> 2), seed);
      const int word = static_cast<int>((e + i) & 3);
      keep[i] = (word == 0 ? r.x : word == 1 ? r.y : word == 2 ? r.z : r.w) < threshold;
    }
  }
}

template <int N>
__device__ __forceinline__ void load_mask(const bool* p, bool (&out)[N]) {
  const Pack<bool, N> pack = *reinterpret_cast<const Pack<bool, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = pack.v[i];
}

inline bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// True when the 16-byte path applies: every non-null pointer 16-byte aligned and `inner` (the length
// that packs must not straddle) a multiple of the pack size.
template <typename T>
inline bool vectorizable(int64_t inner, std::initializer_list<const void*> pointers) {
  if (inner % kVec<T> != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && !aligned(p, 16)) return false;
  }
  return true;
}

// ---- Row kernels.  A row of h elements is held in registers by the G threads of its row group
// (G = blockDim.x, a multiple of 32): thread t keeps packs t, t + G, ..., up to P packs of N elements,
// so the row is read from global memory once.  Each thread keeps the fewest floats (8, 16 or 32) that
// let at most 128 threads hold the row, as Transformer Engine's tuned norms do for h = 4096: several
// 16-byte loads in flight per thread, and many rows resident per SM to hide the memory's latency.
// Short rows (G = 32) are one warp each, several rows per block (blockDim.y); longer rows take one
// block each.  Rows past 32 x 128 floats keep 64 floats per thread in up to 1024 threads.
#define ROW_BOUNDS(N, P) __launch_bounds__((N) * (P) <= 32 ? 256 : 1024)

// Sum / max over the threads of a row group; every thread gets the result.  `scratch` holds 32 floats.
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (blockDim.x == 32) return v;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float row_max(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (blockDim.x == 32) return v;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float best = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) best = fmaxf(best, scratch[w]);
  return best;
}

// This thread's packs of a row of `packs` packs: v[q] is pack threadIdx.x + q * G, zeros past the end
// (or past `limit` packs, which need not be read).
template <int N, int P, typename T>
__device__ __forceinline__ void load_row(const T* row, int64_t limit, float (&v)[P][N]) {
#pragma unroll
  for (int q = 0; q < P; ++q) {
    const int64_t k = threadIdx.x + static_cast<int64_t>(q) * blockDim.x;
    if (k < limit) {
      load<N>(row + k * N, v[q]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[q][i] = 0.0f;
    }
  }
}

__device__ __forceinline__ int64_t pack_index(int q) { return threadIdx.x + static_cast<int64_t>(q) * blockDim.x; }

// The row this thread works on, or -1 past the last row.
__device__ __forceinline__ int64_t row_index(int64_t rows) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y;
  return r < rows ? r : -1;
}

template <int V>
struct Int {
  static constexpr int value = V;
};

// Launch shape of a row kernel for rows of `packs` packs, P packs per thread.
struct RowLaunch {
  dim3 grid, block;
};

inline RowLaunch row_launch(int64_t rows, int64_t packs, int per_thread) {
  int64_t threads = ((packs + per_thread - 1) / per_thread + 31) / 32 * 32;
  if (threads < 32) threads = 32;
  const unsigned int per_block = threads == 32 ? 8 : 1;
  return {dim3(static_cast<unsigned int>((rows + per_block - 1) / per_block)),
          dim3(static_cast<unsigned int>(threads), per_block)};
}

// Calls launch(Int<N>, Int<P>, RowLaunch) with N = kVec<T> when `vec`, else 1, and the fewest floats per
// thread (8, 16, 32) that fit a row of h elements in at most 128 threads, else 64 floats (up to 1024 threads).
template <typename T, typename Launch>
cudaError_t row_dispatch(bool vec, int64_t rows, int64_t h, Launch&& launch) {
  if (h > kMaxRow) return cudaErrorInvalidValue;
  auto with = [&](auto n) {
    constexpr int N = decltype(n)::value;
    const int64_t packs = h / N;
    auto fits = [&](int floats) { return (packs + floats / N - 1) / (floats / N) <= 128; };
    if (fits(8)) return launch(n, Int<8 / N>{}, row_launch(rows, packs, 8 / N));
    if (fits(16)) return launch(n, Int<16 / N>{}, row_launch(rows, packs, 16 / N));
    if (fits(32)) return launch(n, Int<32 / N>{}, row_launch(rows, packs, 32 / N));
    return launch(n, Int<64 / N>{}, row_launch(rows, packs, 64 / N));
  };
  return vec ? with(Int<kVec<T>>{}) : with(Int<1>{});
}

// Threads per block for one block per row of length n: a multiple of 32 in [32, 512].
inline int row_threads(int64_t n) {
  int64_t t = ((n + 31) / 32) * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 512 ? 512 : t));
}

// Blocks for a grid-stride loop over n elements with 256 threads.
inline unsigned int flat_blocks(int64_t n) {
  int64_t b = (n + 255) / 256;
  return static_cast<unsigned int>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

}  // namespace cuda
}  // namespace megalite

// Runs the statement with T bound to the storage type of `dtype`; unknown dtypes return an error.
#define MEGALITE_DISPATCH(dtype, ...)                     \
  switch (dtype) {                                        \
    case ::megalite::cuda::kFloat32: {                    \
      using T = float;                                    \
      __VA_ARGS__;                                        \
    } break;                                              \
    case ::megalite::cuda::kFloat16: {                    \
      using T = __half;                                   \
      __VA_ARGS__;                                        \
    } break;                                              \
    case ::megalite::cuda::kBFloat16: {                   \
      using T = __nv_bfloat16;                            \
      __VA_ARGS__;                                        \
    } break;                                              \
    default:                                              \
      return cudaErrorInvalidValue;                       \
  }

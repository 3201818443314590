// Device helpers shared by the megalite CUDA kernels: dtype conversion, block reductions, dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// Sum / max of v over the block; every thread gets the result.  `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>((blockDim.x + 31) >> 5); ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float best = -INFINITY;
  for (int w = 0; w < static_cast<int>((blockDim.x + 31) >> 5); ++w) best = fmaxf(best, scratch[w]);
  return best;
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

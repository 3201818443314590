// Launchers of the megalite CUDA kernels: plain CUDA C++, no torch, so nvcc can
// compile the .cu files without torch's headers.  Every launcher takes raw
// device pointers, sizes and a stream, enqueues its kernels and returns the
// launch status.  Activations have the storage type given by `dtype`; norm
// weights, statistics, rotary cos/sin and MoE probabilities are float.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace megalite {
namespace cuda {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Longest row the norm and softmax kernels take (1024 threads x 64 floats in registers); callers send
// longer rows elsewhere (megalite.kernels uses the torch reference).
constexpr int64_t kMaxRow = 1024 * 64;

// Row slots of the deterministic two-stage weight-gradient reduction (each slot sums its rows, then the
// slots are summed in order); norm backward launchers need a float workspace of chunks * h (* 2 for LayerNorm).
int64_t norm_bwd_chunks(int64_t rows);

cudaError_t layer_norm_fwd(int dtype, const void* x, const float* weight, const float* bias, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, cudaStream_t stream);
cudaError_t layer_norm_bwd(int dtype, const void* grad, const void* x, const float* weight, const float* mean,
                           const float* rstd, void* grad_x, float* grad_weight, float* grad_bias, float* workspace,
                           int64_t rows, int64_t h, cudaStream_t stream);
cudaError_t rms_norm_fwd(int dtype, const void* x, const float* weight, void* y, float* rstd, int64_t rows, int64_t h,
                         float eps, cudaStream_t stream);
cudaError_t rms_norm_bwd(int dtype, const void* grad, const void* x, const float* weight, const float* rstd,
                         void* grad_x, float* grad_weight, float* workspace, int64_t rows, int64_t h,
                         cudaStream_t stream);

// Softmax over rows of length n; causal rows are [.., s, s] with row r at position r % s.
// Masked: x is [d0, d1, d2, n], mask[i0, i1, i2, j] at i0*s0 + i1*s1 + i2*s2 + j, nonzero = masked.
cudaError_t causal_softmax_fwd(int dtype, const void* x, void* y, int64_t rows, int64_t s, float scale,
                               cudaStream_t stream);
cudaError_t masked_softmax_fwd(int dtype, const void* x, const bool* mask, void* y, int64_t d0, int64_t d1,
                               int64_t d2, int64_t n, int64_t s0, int64_t s1, int64_t s2, float scale,
                               cudaStream_t stream);
cudaError_t softmax_bwd(int dtype, const void* grad, const void* y, void* grad_x, int64_t rows, int64_t n,
                        float scale, cudaStream_t stream);

// Pointwise ops over rows of length h (bias may be null).
cudaError_t bias_gelu_fwd(int dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t h,
                          cudaStream_t stream);
cudaError_t bias_gelu_bwd(int dtype, const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows,
                          int64_t h, cudaStream_t stream);
cudaError_t bias_swiglu_fwd(int dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t h,
                            cudaStream_t stream);
cudaError_t bias_swiglu_bwd(int dtype, const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows,
                            int64_t h, cudaStream_t stream);
// x is [s, per_pos, d]; cos/sin are [s, d].
cudaError_t rotary(int dtype, const void* x, const float* cos, const float* sin, void* out, int64_t s,
                   int64_t per_pos, int64_t d, bool backward, cudaStream_t stream);
// Dropout draws its keep-mask from *seed (a device int64): element e is kept, and scaled by `scale`, when
// word e % 4 of Philox draw e / 4 is below `threshold` (common.cuh); the backward draws the same mask.
cudaError_t bias_dropout_add_fwd(int dtype, const void* x, const void* bias, const void* residual, const int64_t* seed,
                                 uint32_t threshold, void* out, int64_t rows, int64_t h, float scale,
                                 cudaStream_t stream);
cudaError_t dropout_bwd(int dtype, const void* grad, const int64_t* seed, uint32_t threshold, void* grad_x, int64_t n,
                        float scale, cudaStream_t stream);

// MoE row map (megalite::permute_row_map): the kept assignments (id >= 0) of ids [n], stably sorted by id.
// row_map_stats writes stats[0] = largest id + 1 and stats[1] = the kept count; with at most kMaxSortExperts
// experts, row_map_counting_sort fills row_map [kept] using hist [experts * ceil(n / kSortTile)] as scratch.
constexpr int kMaxSortExperts = 256;
constexpr int kSortTile = 1024;
cudaError_t row_map_stats(const int64_t* ids, int64_t n, int64_t* stats, cudaStream_t stream);
cudaError_t row_map_counting_sort(const int64_t* ids, int64_t n, int experts, int64_t* hist, int64_t* row_map,
                                  cudaStream_t stream);

// MoE: row_map[j] = t * k + slot; inverse (num_tokens * k, filled with -1 by the caller) is built here.
// Entries outside [0, num_tokens * k) are ignored; such rows come out as zeros.
cudaError_t permute_fwd(int dtype, const void* tokens, const int64_t* row_map, void* out, int64_t n, int64_t h,
                        int64_t k, int64_t num_tokens, cudaStream_t stream);
cudaError_t permute_bwd(int dtype, const void* grad, const int64_t* row_map, int64_t* inverse, void* grad_tokens,
                        int64_t n, int64_t h, int64_t k, int64_t num_tokens, cudaStream_t stream);
cudaError_t unpermute_fwd(int dtype, const void* permuted, const int64_t* row_map, const float* probs,
                          int64_t* inverse, void* out, int64_t n, int64_t h, int64_t k, int64_t num_tokens,
                          cudaStream_t stream);
// grad_probs must be zero-filled by the caller.
cudaError_t unpermute_bwd(int dtype, const void* grad, const void* permuted, const int64_t* row_map,
                          const float* probs, void* grad_permuted, float* grad_probs, int64_t n, int64_t h, int64_t k,
                          int64_t num_tokens, cudaStream_t stream);

}  // namespace cuda
}  // namespace megalite

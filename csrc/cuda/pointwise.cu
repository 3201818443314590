// Elementwise fused ops: bias + GeLU(tanh), bias + SwiGLU, rotary embedding, bias + dropout + residual.
// Grid-stride loops over packs of N elements (16-byte accesses when aligned, else N = 1), float math.
#include <algorithm>

#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

constexpr float kGeluC0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC1 = 0.044715f;

// x[i, i + N) plus bias at column i % h (packs never straddle a row).
template <int N, typename T>
__device__ __forceinline__ void load_biased(const T* x, const T* bias, int64_t i, int64_t h, float (&v)[N]) {
  load<N>(x + i, v);
  if (bias == nullptr) return;
  float b[N];
  load<N>(bias + fast_mod(i, h), b);
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] += b[k];
}

// 1 / (1 + e^-v) with the fast division (2 ulp; 0 once e^-v passes 2^126, the limit anyway).
__device__ __forceinline__ float sigmoid(float v) { return __fdividef(1.0f, 1.0f + exp2f(-v * kLog2e)); }

// tanh(u) = 1 - 2 / (e^2u + 1): one exp2 and a fast division instead of tanhf's longer sequence; near 0
// its absolute error is about float epsilon, which GeLU's 0.5 v (1 + tanh) carries as a relative one.
__device__ __forceinline__ float fast_tanh(float u) { return 1.0f - __fdividef(2.0f, exp2f(2.0f * kLog2e * u) + 1.0f); }

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <typename T, int N>
__global__ void gelu_fwd_kernel(const T* x, const T* bias, T* y, int64_t n, int64_t h) {
  GRID_STRIDE(p, n / N) {
    float v[N];
    load_biased<N>(x, bias, p * N, h, v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = 0.5f * v[k] * (1.0f + fast_tanh(kGeluC0 * (v[k] + kGeluC1 * v[k] * v[k] * v[k])));
    store<N>(y + p * N, v);
  }
}

template <typename T, int N>
__global__ void gelu_bwd_kernel(const T* grad, const T* x, const T* bias, T* grad_x, int64_t n, int64_t h) {
  GRID_STRIDE(p, n / N) {
    float v[N], g[N];
    load_biased<N>(x, bias, p * N, h, v);
    load<N>(grad + p * N, g);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float t = fast_tanh(kGeluC0 * (v[k] + kGeluC1 * v[k] * v[k] * v[k]));
      g[k] *= 0.5f * (1.0f + t) + 0.5f * v[k] * (1.0f - t * t) * kGeluC0 * (1.0f + 3.0f * kGeluC1 * v[k] * v[k]);
    }
    store<N>(grad_x + p * N, g);
  }
}

// SwiGLU over x [rows, h] = [gate | up]: a thread owns one pack of N output columns c (gate at x[r, c], up at
// x[r, h / 2 + c]) and walks the rows blockIdx.y, + gridDim.y, ...: no index division, and the bias packs stay in
// registers across the rows.  (The flat grid-stride form split every output index into row and column with two
// divisions and loaded the bias per pack: 87-90% of copy bandwidth on an H100, this form 100-103%.)
template <int N, typename T>
__device__ __forceinline__ void load_bias_halves(const T* bias, int64_t c, int64_t half, float (&gate)[N],
                                                 float (&up)[N]) {
  if (bias == nullptr) return;
  load<N>(bias + c, gate);
  load<N>(bias + half + c, up);
}

// The gate and up packs of row r at column c, plus the bias packs the caller holds when there is a bias.
template <int N, typename T>
__device__ __forceinline__ void load_gate_up(const T* x, int64_t r, int64_t h, int64_t c, bool has_bias,
                                             const float (&bias_gate)[N], const float (&bias_up)[N],
                                             float (&gate)[N], float (&up)[N]) {
  load<N>(x + r * h + c, gate);
  load<N>(x + r * h + h / 2 + c, up);
  if (!has_bias) return;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    gate[k] += bias_gate[k];
    up[k] += bias_up[k];
  }
}

__device__ __forceinline__ int64_t swiglu_column(int n) {
  return (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * n;
}

template <typename T, int N>
__global__ void swiglu_fwd_kernel(const T* x, const T* bias, T* y, int64_t rows, int64_t h) {
  const int64_t half = h / 2, c = swiglu_column(N);
  if (c >= half) return;
  float bias_gate[N], bias_up[N];
  load_bias_halves<N>(bias, c, half, bias_gate, bias_up);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float gate[N], up[N];
    load_gate_up<N>(x, r, h, c, bias != nullptr, bias_gate, bias_up, gate, up);
#pragma unroll
    for (int k = 0; k < N; ++k) up[k] *= gate[k] * sigmoid(gate[k]);
    store<N>(y + r * half + c, up);
  }
}

template <typename T, int N>
__global__ void swiglu_bwd_kernel(const T* grad, const T* x, const T* bias, T* grad_x, int64_t rows, int64_t h) {
  const int64_t half = h / 2, c = swiglu_column(N);
  if (c >= half) return;
  float bias_gate[N], bias_up[N];
  load_bias_halves<N>(bias, c, half, bias_gate, bias_up);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float gate[N], up[N], g[N], d_gate[N], d_up[N];
    load_gate_up<N>(x, r, h, c, bias != nullptr, bias_gate, bias_up, gate, up);
    load<N>(grad + r * half + c, g);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float s = sigmoid(gate[k]);
      d_gate[k] = g[k] * up[k] * s * (1.0f + gate[k] * (1.0f - s));
      d_up[k] = g[k] * gate[k] * s;
    }
    store<N>(grad_x + r * h + c, d_gate);
    store<N>(grad_x + r * h + half + c, d_up);
  }
}

// Pack p covers pairs (row r, j..j+N), j < d / 2, of x [s * per_pos, d]; row r is at position r / per_pos.
template <typename T, int N>
__global__ void rotary_kernel(const T* x, const float* cos, const float* sin, T* out, int64_t n, int64_t per_pos,
                              int64_t d, bool backward) {
  const int64_t half = d / 2;
  GRID_STRIDE(p, n / N) {
    const int64_t r = fast_div(p * N, half), j = p * N - r * half, at = fast_div(r, per_pos) * d + j;
    float a[N], b[N], lo[N], hi[N], c_lo[N], c_hi[N], s_lo[N], s_hi[N];
    load<N>(x + r * d + j, a);
    load<N>(x + r * d + j + half, b);
    load_floats<N>(cos + at, c_lo);
    load_floats<N>(cos + at + half, c_hi);
    load_floats<N>(sin + at, s_lo);
    load_floats<N>(sin + at + half, s_hi);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (backward) {
        lo[k] = a[k] * c_lo[k] + b[k] * s_hi[k];
        hi[k] = b[k] * c_hi[k] - a[k] * s_lo[k];
      } else {
        lo[k] = a[k] * c_lo[k] - b[k] * s_lo[k];
        hi[k] = b[k] * c_hi[k] + a[k] * s_hi[k];
      }
    }
    store<N>(out + r * d + j, lo);
    store<N>(out + r * d + j + half, hi);
  }
}

// The keep-mask is drawn here, from the seed (common.cuh's keep_mask), not read from memory: a byte per
// element written by a mask kernel and read back was a third more traffic than the op's own.
template <typename T, int N>
__global__ void bias_dropout_add_kernel(const T* x, const T* bias, const T* residual, const int64_t* seed,
                                        uint32_t threshold, T* out, int64_t n, int64_t h, float scale) {
  const uint64_t key = static_cast<uint64_t>(*seed);
  GRID_STRIDE(p, n / N) {
    float v[N], res[N];
    bool keep[N];
    load_biased<N>(x, bias, p * N, h, v);
    load<N>(residual + p * N, res);
    keep_mask<N>(key, p * N, threshold, keep);
#pragma unroll
    for (int k = 0; k < N; ++k) res[k] += keep[k] ? v[k] * scale : 0.0f;
    store<N>(out + p * N, res);
  }
}

// The backward draws the forward's mask again from the same seed, so no mask is kept between them.
template <typename T, int N>
__global__ void dropout_bwd_kernel(const T* grad, const int64_t* seed, uint32_t threshold, T* grad_x, int64_t n,
                                   float scale) {
  const uint64_t key = static_cast<uint64_t>(*seed);
  GRID_STRIDE(p, n / N) {
    float g[N];
    bool keep[N];
    load<N>(grad + p * N, g);
    keep_mask<N>(key, p * N, threshold, keep);
#pragma unroll
    for (int k = 0; k < N; ++k) g[k] = keep[k] ? g[k] * scale : 0.0f;
    store<N>(grad_x + p * N, g);
  }
}

// Launches kernel<T, N> over n elements with N = kVec<T> when `vec`, else 1.
#define LAUNCH_PACKED(vec, n, kernel, ...)                                                           \
  do {                                                                                               \
    if (vec) {                                                                                       \
      kernel<T, kVec<T>><<<flat_blocks((n) / kVec<T>), 256, 0, stream>>>(__VA_ARGS__);               \
    } else {                                                                                         \
      kernel<T, 1><<<flat_blocks(n), 256, 0, stream>>>(__VA_ARGS__);                                 \
    }                                                                                                \
  } while (0)

// Launches a SwiGLU kernel<T, N> over [rows, h] (N = kVec<T> when `vec`, else 1): blocks of up to 256 threads
// across the h / 2 / N column packs, one row per grid row, up to 65,535 grid rows.
#define LAUNCH_SWIGLU(vec, rows, h, kernel, ...)                                                     \
  do {                                                                                               \
    const int n_ = (vec) ? kVec<T> : 1;                                                              \
    const int64_t packs_ = (h) / 2 / n_;                                                             \
    const int threads_ = std::min(row_threads(packs_), 256);                                         \
    const dim3 grid_(static_cast<unsigned int>((packs_ + threads_ - 1) / threads_),                  \
                     static_cast<unsigned int>((rows) < 65535 ? (rows) : 65535));                    \
    if (vec) {                                                                                       \
      kernel<T, kVec<T>><<<grid_, threads_, 0, stream>>>(__VA_ARGS__);                               \
    } else {                                                                                         \
      kernel<T, 1><<<grid_, threads_, 0, stream>>>(__VA_ARGS__);                                     \
    }                                                                                                \
  } while (0)

}  // namespace

cudaError_t bias_gelu_fwd(int dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t h,
                          cudaStream_t stream) {
  const int64_t n = rows * h;
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_PACKED(vectorizable<T>(h, {x, bias, y}), n, gelu_fwd_kernel,
                                         static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), n, h));
  return cudaGetLastError();
}

cudaError_t bias_gelu_bwd(int dtype, const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows,
                          int64_t h, cudaStream_t stream) {
  const int64_t n = rows * h;
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_PACKED(vectorizable<T>(h, {grad, x, bias, grad_x}), n, gelu_bwd_kernel,
                                         static_cast<const T*>(grad), static_cast<const T*>(x),
                                         static_cast<const T*>(bias), static_cast<T*>(grad_x), n, h));
  return cudaGetLastError();
}

cudaError_t bias_swiglu_fwd(int dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t h,
                            cudaStream_t stream) {
  if (rows * (h / 2) == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_SWIGLU(vectorizable<T>(h / 2, {x, bias, y}), rows, h, swiglu_fwd_kernel,
                                         static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y),
                                         rows, h));
  return cudaGetLastError();
}

cudaError_t bias_swiglu_bwd(int dtype, const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows,
                            int64_t h, cudaStream_t stream) {
  if (rows * (h / 2) == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_SWIGLU(vectorizable<T>(h / 2, {grad, x, bias, grad_x}), rows, h, swiglu_bwd_kernel,
                                         static_cast<const T*>(grad), static_cast<const T*>(x),
                                         static_cast<const T*>(bias), static_cast<T*>(grad_x), rows, h));
  return cudaGetLastError();
}

cudaError_t rotary(int dtype, const void* x, const float* cos, const float* sin, void* out, int64_t s,
                   int64_t per_pos, int64_t d, bool backward, cudaStream_t stream) {
  const int64_t n = s * per_pos * (d / 2);
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_PACKED(vectorizable<T>(d / 2, {x, out, cos, sin}), n, rotary_kernel, static_cast<const T*>(x),
                                         cos, sin, static_cast<T*>(out), n, per_pos, d, backward));
  return cudaGetLastError();
}

cudaError_t bias_dropout_add_fwd(int dtype, const void* x, const void* bias, const void* residual, const int64_t* seed,
                                 uint32_t threshold, void* out, int64_t rows, int64_t h, float scale,
                                 cudaStream_t stream) {
  const int64_t n = rows * h;
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_PACKED(vectorizable<T>(h, {x, bias, residual, out}), n, bias_dropout_add_kernel,
                                         static_cast<const T*>(x), static_cast<const T*>(bias),
                                         static_cast<const T*>(residual), seed, threshold, static_cast<T*>(out), n, h,
                                         scale));
  return cudaGetLastError();
}

cudaError_t dropout_bwd(int dtype, const void* grad, const int64_t* seed, uint32_t threshold, void* grad_x, int64_t n,
                        float scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, LAUNCH_PACKED(vectorizable<T>(n, {grad, grad_x}), n, dropout_bwd_kernel,
                                         static_cast<const T*>(grad), seed, threshold, static_cast<T*>(grad_x), n,
                                         scale));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megalite

// Elementwise fused ops: bias + GeLU(tanh), bias + SwiGLU, rotary embedding, bias + dropout + residual.
// Grid-stride loops with float math.
#include "common.cuh"

namespace megalite {
namespace cuda {
namespace {

constexpr float kGeluC0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC1 = 0.044715f;

template <typename T>
__device__ __forceinline__ float biased(const T* x, const T* bias, int64_t i, int64_t h) {
  return to_float(x[i]) + (bias == nullptr ? 0.0f : to_float(bias[i % h]));
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <typename T>
__global__ void gelu_fwd_kernel(const T* x, const T* bias, T* y, int64_t n, int64_t h) {
  GRID_STRIDE(i, n) {
    const float v = biased(x, bias, i, h);
    y[i] = from_float<T>(0.5f * v * (1.0f + tanhf(kGeluC0 * (v + kGeluC1 * v * v * v))));
  }
}

template <typename T>
__global__ void gelu_bwd_kernel(const T* grad, const T* x, const T* bias, T* grad_x, int64_t n, int64_t h) {
  GRID_STRIDE(i, n) {
    const float v = biased(x, bias, i, h);
    const float t = tanhf(kGeluC0 * (v + kGeluC1 * v * v * v));
    const float d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kGeluC0 * (1.0f + 3.0f * kGeluC1 * v * v);
    grad_x[i] = from_float<T>(to_float(grad[i]) * d);
  }
}

// Output element i is (row r, column j) of [rows, h / 2]; gate at x[r, j], up at x[r, j + h / 2].
template <typename T>
__global__ void swiglu_fwd_kernel(const T* x, const T* bias, T* y, int64_t n, int64_t h) {
  const int64_t half = h / 2;
  GRID_STRIDE(i, n) {
    const int64_t gate_at = (i / half) * h + i % half;
    const float gate = biased(x, bias, gate_at, h), up = biased(x, bias, gate_at + half, h);
    y[i] = from_float<T>(gate * sigmoid(gate) * up);
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(const T* grad, const T* x, const T* bias, T* grad_x, int64_t n, int64_t h) {
  const int64_t half = h / 2;
  GRID_STRIDE(i, n) {
    const int64_t gate_at = (i / half) * h + i % half;
    const float gate = biased(x, bias, gate_at, h), up = biased(x, bias, gate_at + half, h);
    const float s = sigmoid(gate), g = to_float(grad[i]);
    grad_x[gate_at] = from_float<T>(g * up * s * (1.0f + gate * (1.0f - s)));
    grad_x[gate_at + half] = from_float<T>(g * gate * s);
  }
}

// Element i is pair (row r, j < d / 2) of x [s * per_pos, d]; row r is at position r / per_pos.
template <typename T>
__global__ void rotary_kernel(const T* x, const float* cos, const float* sin, T* out, int64_t n, int64_t per_pos,
                              int64_t d, bool backward) {
  const int64_t half = d / 2;
  GRID_STRIDE(i, n) {
    const int64_t r = i / half, j = i % half;
    const float* c = cos + (r / per_pos) * d;
    const float* sn = sin + (r / per_pos) * d;
    const float a = to_float(x[r * d + j]), b = to_float(x[r * d + j + half]);
    if (backward) {
      out[r * d + j] = from_float<T>(a * c[j] + b * sn[j + half]);
      out[r * d + j + half] = from_float<T>(b * c[j + half] - a * sn[j]);
    } else {
      out[r * d + j] = from_float<T>(a * c[j] - b * sn[j]);
      out[r * d + j + half] = from_float<T>(b * c[j + half] + a * sn[j + half]);
    }
  }
}

template <typename T>
__global__ void bias_dropout_add_kernel(const T* x, const T* bias, const T* residual, const bool* mask, T* out,
                                        int64_t n, int64_t h, float scale) {
  GRID_STRIDE(i, n) {
    const float v = biased(x, bias, i, h);
    const float dropped = mask == nullptr ? v : (mask[i] ? v * scale : 0.0f);
    out[i] = from_float<T>(to_float(residual[i]) + dropped);
  }
}

template <typename T>
__global__ void dropout_bwd_kernel(const T* grad, const bool* mask, T* grad_x, int64_t n, float scale) {
  GRID_STRIDE(i, n) { grad_x[i] = from_float<T>(mask[i] ? to_float(grad[i]) * scale : 0.0f); }
}

}  // namespace

cudaError_t bias_gelu_fwd(int dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t h,
                          cudaStream_t stream) {
  const int64_t n = rows * h;
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, gelu_fwd_kernel<T><<<flat_blocks(n), 256, 0, stream>>>(
                               static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), n, h));
  return cudaGetLastError();
}

cudaError_t bias_gelu_bwd(int dtype, const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows,
                          int64_t h, cudaStream_t stream) {
  const int64_t n = rows * h;
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, gelu_bwd_kernel<T><<<flat_blocks(n), 256, 0, stream>>>(
                               static_cast<const T*>(grad), static_cast<const T*>(x), static_cast<const T*>(bias),
                               static_cast<T*>(grad_x), n, h));
  return cudaGetLastError();
}

cudaError_t bias_swiglu_fwd(int dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t h,
                            cudaStream_t stream) {
  const int64_t n = rows * (h / 2);
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, swiglu_fwd_kernel<T><<<flat_blocks(n), 256, 0, stream>>>(
                               static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), n, h));
  return cudaGetLastError();
}

cudaError_t bias_swiglu_bwd(int dtype, const void* grad, const void* x, const void* bias, void* grad_x, int64_t rows,
                            int64_t h, cudaStream_t stream) {
  const int64_t n = rows * (h / 2);
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, swiglu_bwd_kernel<T><<<flat_blocks(n), 256, 0, stream>>>(
                               static_cast<const T*>(grad), static_cast<const T*>(x), static_cast<const T*>(bias),
                               static_cast<T*>(grad_x), n, h));
  return cudaGetLastError();
}

cudaError_t rotary(int dtype, const void* x, const float* cos, const float* sin, void* out, int64_t s,
                   int64_t per_pos, int64_t d, bool backward, cudaStream_t stream) {
  const int64_t n = s * per_pos * (d / 2);
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, rotary_kernel<T><<<flat_blocks(n), 256, 0, stream>>>(
                               static_cast<const T*>(x), cos, sin, static_cast<T*>(out), n, per_pos, d, backward));
  return cudaGetLastError();
}

cudaError_t bias_dropout_add_fwd(int dtype, const void* x, const void* bias, const void* residual, const bool* mask,
                                 void* out, int64_t rows, int64_t h, float scale, cudaStream_t stream) {
  const int64_t n = rows * h;
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, bias_dropout_add_kernel<T><<<flat_blocks(n), 256, 0, stream>>>(
                               static_cast<const T*>(x), static_cast<const T*>(bias),
                               static_cast<const T*>(residual), mask, static_cast<T*>(out), n, h, scale));
  return cudaGetLastError();
}

cudaError_t dropout_bwd(int dtype, const void* grad, const bool* mask, void* grad_x, int64_t n, float scale,
                        cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MEGALITE_DISPATCH(dtype, dropout_bwd_kernel<T><<<flat_blocks(n), 256, 0, stream>>>(
                               static_cast<const T*>(grad), mask, static_cast<T*>(grad_x), n, scale));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megalite

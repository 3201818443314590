// CPU kernels of every megalite op.
//
// Each kernel makes one pass over its rows (two for a norm backward, which
// also reduces weight gradients), works in float whatever the storage dtype,
// and splits rows over threads with at::parallel_for.  exp is a branch-free
// polynomial and reductions carry `omp simd` (built with -fopenmp-simd, no
// OpenMP runtime) so that the inner loops vectorize.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace megalite {
namespace {

constexpr int64_t kGrain = 2048;  // elements of work below which a kernel stays on one thread

// The elementwise math below must inline into its callers' `omp simd` loops: an out-of-line call keeps
// a loop scalar, and GCC's inliner gives up inside the large AT_DISPATCH lambdas unless told.
#define MEGALITE_INLINE inline __attribute__((always_inline))

// std::bit_cast for C++17 (torch 2.11 builds extensions as C++17); the memcpy folds to a register move.
template <class To, class From>
MEGALITE_INLINE To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// min(max(x, -87), 88), NaN stays NaN.  Done on the bits with integer min/max, which vectorize to single
// instructions; the float form becomes compares and blends that made the activation loops 2x slower.
// As unsigned, negative floats sort by magnitude above all positive ones (so the unsigned min clamps
// x < -87); as signed, positive floats sort by value above all negative ones (so the signed min clamps
// x > 88).
MEGALITE_INLINE float clamp_exp_arg(float x) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  const uint32_t low = std::min(bits, 0xC2AE0000u);                                          // -87.0f
  const uint32_t both = static_cast<uint32_t>(std::min(static_cast<int32_t>(low), 0x42B00000));  // 88.0f
  return bit_cast<float>((bits & 0x7FFFFFFFu) > 0x7F800000u ? bits : both);
}

// exp(x) for x in roughly [-87, 88] (inputs outside are clamped), ~1 ulp.  Branch-free and call-free so
// that it vectorizes inside `omp simd` loops: n = round(x / ln 2) comes from adding and subtracting
// 1.5 * 2^23 (which leaves the nearest integer in a float's mantissa), not from a libm call.
MEGALITE_INLINE float fast_exp(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  x = clamp_exp_arg(x);
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  return p * bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

MEGALITE_INLINE float fast_tanh(float x) { return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f); }

MEGALITE_INLINE float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

constexpr float kGeluC0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC1 = 0.044715f;

// Rows [begin, end) of a [rows, cols] problem, split over threads by rows.
template <typename F>
void for_rows(int64_t rows, int64_t cols, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, f);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

template <typename T>
inline void load_row_bias(const T* src, const T* bias, float* dst, int64_t n) {
  if (bias == nullptr) return load_row(src, dst, n);
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]) + static_cast<float>(bias[j]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(src[j]);
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "megalite: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "megalite: ", name, " must be contiguous");
}

void check_float(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "megalite: ", name, " must be float32, got ", t.scalar_type());
}

// Column sums of per-thread partial rows: partial is [chunks, cols].
at::Tensor sum_partials(const std::vector<float>& partial, int64_t chunks, int64_t cols) {
  at::Tensor out = at::zeros({cols}, at::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = partial.data() + c * cols;
    for (int64_t j = 0; j < cols; ++j) o[j] += p[j];
  }
  return out;
}

// Runs f(chunk, row_begin, row_end) over at most num_threads contiguous row chunks.
template <typename F>
int64_t for_row_chunks(int64_t rows, const F& f) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  const int64_t per = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) f(c, c * per, std::min(rows, (c + 1) * per));
  });
  return chunks;
}

// ---------------------------------------------------------------- norms

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                              const at::Tensor& bias, double eps) {
  check_cpu(x, "x");
  check_float(weight, "weight");
  check_float(bias, "bias");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(weight.numel() == h && bias.numel() == h, "megalite::layer_norm_fwd: weight/bias size != ", h);
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  float* mp = mean.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "layer_norm_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(h);
      for (int64_t r = r0; r < r1; ++r) {
        load_row(xp + r * h, buf.data(), h);
        float sum = 0.0f;
_Pragma("omp simd reduction(+ : sum)")
        for (int64_t j = 0; j < h; ++j) sum += buf[j];
        const float mu = sum / h;
        float var = 0.0f;
_Pragma("omp simd reduction(+ : var)")
        for (int64_t j = 0; j < h; ++j) {
          const float c = buf[j] - mu;
          var += c * c;
        }
        const float rs = 1.0f / std::sqrt(var / h + static_cast<float>(eps));
        for (int64_t j = 0; j < h; ++j) buf[j] = (buf[j] - mu) * rs * w[j] + b[j];
        store_row(buf.data(), yp + r * h, h);
        mp[r] = mu;
        rp[r] = rs;
      }
    });
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& grad, const at::Tensor& x,
                                                              const at::Tensor& weight, const at::Tensor& mean,
                                                              const at::Tensor& rstd) {
  check_cpu(grad, "grad");
  check_cpu(x, "x");
  check_float(weight, "weight");
  check_float(mean, "mean");
  check_float(rstd, "rstd");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "megalite::layer_norm_bwd: grad/x mismatch");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  at::Tensor gx = at::empty_like(x);
  const float* w = weight.data_ptr<float>();
  const float* mp = mean.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  const int64_t max_chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  std::vector<float> pw(max_chunks * h, 0.0f), pb(max_chunks * h, 0.0f);
  int64_t chunks = 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "layer_norm_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = gx.data_ptr<scalar_t>();
    chunks = for_row_chunks(rows, [&](int64_t c, int64_t r0, int64_t r1) {
      std::vector<float> xh(h), g(h);
      float* gw = pw.data() + c * h;
      float* gb = pb.data() + c * h;
      for (int64_t r = r0; r < r1; ++r) {
        load_row(xp + r * h, xh.data(), h);
        load_row(gp + r * h, g.data(), h);
        const float mu = mp[r], rs = rp[r];
        float s1 = 0.0f, s2 = 0.0f;
_Pragma("omp simd reduction(+ : s1, s2)")
        for (int64_t j = 0; j < h; ++j) {
          xh[j] = (xh[j] - mu) * rs;
          gw[j] += g[j] * xh[j];
          gb[j] += g[j];
          g[j] *= w[j];
          s1 += g[j];
          s2 += g[j] * xh[j];
        }
        s1 /= h;
        s2 /= h;
        for (int64_t j = 0; j < h; ++j) g[j] = rs * (g[j] - s1 - xh[j] * s2);
        store_row(g.data(), op + r * h, h);
      }
    });
  });
  return {gx, sum_partials(pw, chunks, h), sum_partials(pb, chunks, h)};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_float(weight, "weight");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(weight.numel() == h, "megalite::rms_norm_fwd: weight size ", weight.numel(), " != ", h);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const float* w = weight.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(h);
      for (int64_t r = r0; r < r1; ++r) {
        load_row(xp + r * h, buf.data(), h);
        float ss = 0.0f;
_Pragma("omp simd reduction(+ : ss)")
        for (int64_t j = 0; j < h; ++j) ss += buf[j] * buf[j];
        const float rs = 1.0f / std::sqrt(ss / h + static_cast<float>(eps));
        for (int64_t j = 0; j < h; ++j) buf[j] = buf[j] * rs * w[j];
        store_row(buf.data(), yp + r * h, h);
        rp[r] = rs;
      }
    });
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& rstd) {
  check_cpu(grad, "grad");
  check_cpu(x, "x");
  check_float(weight, "weight");
  check_float(rstd, "rstd");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "megalite::rms_norm_bwd: grad/x mismatch");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  at::Tensor gx = at::empty_like(x);
  const float* w = weight.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  const int64_t max_chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  std::vector<float> pw(max_chunks * h, 0.0f);
  int64_t chunks = 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = gx.data_ptr<scalar_t>();
    chunks = for_row_chunks(rows, [&](int64_t c, int64_t r0, int64_t r1) {
      std::vector<float> xh(h), g(h);
      float* gw = pw.data() + c * h;
      for (int64_t r = r0; r < r1; ++r) {
        load_row(xp + r * h, xh.data(), h);
        load_row(gp + r * h, g.data(), h);
        const float rs = rp[r];
        float s = 0.0f;
_Pragma("omp simd reduction(+ : s)")
        for (int64_t j = 0; j < h; ++j) {
          xh[j] *= rs;
          gw[j] += g[j] * xh[j];
          g[j] *= w[j];
          s += g[j] * xh[j];
        }
        s /= h;
        for (int64_t j = 0; j < h; ++j) g[j] = rs * (g[j] - xh[j] * s);
        store_row(g.data(), op + r * h, h);
      }
    });
  });
  return {gx, sum_partials(pw, chunks, h)};
}

// ---------------------------------------------------------------- activations

const at::Tensor* optional_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_cpu(*bias, "bias");
  TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "megalite: bias dtype ", bias->scalar_type(), " != x dtype ", x.scalar_type());
  TORCH_CHECK(bias->numel() == x.size(-1), "megalite: bias size ", bias->numel(), " != last dim ", x.size(-1));
  return &*bias;
}

template <typename scalar_t>
const scalar_t* bias_ptr(const at::Tensor* bias) {
  return bias == nullptr ? nullptr : bias->data_ptr<scalar_t>();
}

// Calls f(std::true_type{}) when bias is set and f(std::false_type{}) otherwise, so that the elementwise
// loops below are compiled once with and once without the bias add and carry no branch.
template <typename T, typename F>
inline void with_bias(const T* bias, const F& f) {
  if (bias != nullptr) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// x[j] (+ bias[j] when kBias) in float.
template <bool kBias, typename T>
MEGALITE_INLINE float biased(const T* x, const T* bias, int64_t j) {
  if constexpr (kBias) {
    return static_cast<float>(x[j]) + static_cast<float>(bias[j]);
  } else {
    return static_cast<float>(x[j]);
  }
}

// The per-row loops of the activations are plain functions, outside the AT_DISPATCH macros: GCC drops an
// `omp simd` _Pragma that sits inside a macro argument, and then the exp below does not vectorize.

template <bool kBias, typename T>
void gelu_fwd_rows(const T* x, const T* bias, T* y, int64_t r0, int64_t r1, int64_t h) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      const float v = biased<kBias>(xr, bias, j);
      yr[j] = static_cast<T>(0.5f * v * (1.0f + fast_tanh(kGeluC0 * (v + kGeluC1 * v * v * v))));
    }
  }
}

template <bool kBias, typename T>
void gelu_bwd_rows(const T* grad, const T* x, const T* bias, T* out, int64_t r0, int64_t r1, int64_t h) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * h;
    const T* gr = grad + r * h;
    T* orow = out + r * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      const float u = biased<kBias>(xr, bias, j);
      const float t = fast_tanh(kGeluC0 * (u + kGeluC1 * u * u * u));
      const float d = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * kGeluC0 * (1.0f + 3.0f * kGeluC1 * u * u);
      orow[j] = static_cast<T>(static_cast<float>(gr[j]) * d);
    }
  }
}

// Rows of x are [gate | up], each of width half; bias (when kBias) is laid out the same way.
template <bool kBias, typename T>
void swiglu_fwd_rows(const T* x, const T* bias, T* y, int64_t r0, int64_t r1, int64_t half) {
  const T* bias_up = kBias ? bias + half : nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate_row = x + r * 2 * half;
    const T* up_row = gate_row + half;
    T* yr = y + r * half;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float gate = biased<kBias>(gate_row, bias, j);
      yr[j] = static_cast<T>(gate * sigmoid(gate) * biased<kBias>(up_row, bias_up, j));
    }
  }
}

template <bool kBias, typename T>
void swiglu_bwd_rows(const T* grad, const T* x, const T* bias, T* out, int64_t r0, int64_t r1, int64_t half) {
  const T* bias_up = kBias ? bias + half : nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate_row = x + r * 2 * half;
    const T* up_row = gate_row + half;
    const T* gr = grad + r * half;
    T* ggate = out + r * 2 * half;
    T* gup = ggate + half;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float gate = biased<kBias>(gate_row, bias, j), up = biased<kBias>(up_row, bias_up, j);
      const float g = static_cast<float>(gr[j]);
      const float s = sigmoid(gate);
      ggate[j] = static_cast<T>(g * up * s * (1.0f + gate * (1.0f - s)));
      gup[j] = static_cast<T>(g * gate * s);
    }
  }
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  const at::Tensor* b = optional_bias(bias, x);
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(b);
    scalar_t* yp = y.data_ptr<scalar_t>();
    with_bias(bp, [&](auto has_bias) {
      for_rows(rows, h, [&](int64_t r0, int64_t r1) { gelu_fwd_rows<decltype(has_bias)::value>(xp, bp, yp, r0, r1, h); });
    });
  });
  return y;
}

at::Tensor bias_gelu_bwd(const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cpu(grad, "grad");
  check_cpu(x, "x");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "megalite::bias_gelu_bwd: grad/x mismatch");
  const at::Tensor* b = optional_bias(bias, x);
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  at::Tensor gx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(b);
    scalar_t* op = gx.data_ptr<scalar_t>();
    with_bias(bp, [&](auto has_bias) {
      for_rows(rows, h, [&](int64_t r0, int64_t r1) { gelu_bwd_rows<decltype(has_bias)::value>(gp, xp, bp, op, r0, r1, h); });
    });
  });
  return gx;
}

at::Tensor bias_swiglu_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  const at::Tensor* b = optional_bias(bias, x);
  const int64_t h = x.size(-1), half = h / 2, rows = x.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(h % 2 == 0, "megalite::bias_swiglu_fwd: last dim ", h, " is odd");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = half;
  at::Tensor y = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_swiglu_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(b);
    scalar_t* yp = y.data_ptr<scalar_t>();
    with_bias(bp, [&](auto has_bias) {
      for_rows(rows, h, [&](int64_t r0, int64_t r1) { swiglu_fwd_rows<decltype(has_bias)::value>(xp, bp, yp, r0, r1, half); });
    });
  });
  return y;
}

at::Tensor bias_swiglu_bwd(const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cpu(grad, "grad");
  check_cpu(x, "x");
  const at::Tensor* b = optional_bias(bias, x);
  const int64_t h = x.size(-1), half = h / 2, rows = x.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(grad.numel() * 2 == x.numel() && grad.scalar_type() == x.scalar_type(), "megalite::bias_swiglu_bwd: grad/x mismatch");
  at::Tensor gx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_swiglu_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(b);
    scalar_t* op = gx.data_ptr<scalar_t>();
    with_bias(bp, [&](auto has_bias) {
      for_rows(rows, h, [&](int64_t r0, int64_t r1) { swiglu_bwd_rows<decltype(has_bias)::value>(gp, xp, bp, op, r0, r1, half); });
    });
  });
  return gx;
}

// ---------------------------------------------------------------- rotary

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  check_cpu(x, "x");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(x.dim() == 4, "megalite::rotary: x must be [s, b, n, d]");
  const int64_t s = x.size(0), d = x.size(3), half = d / 2, per_pos = x.size(1) * x.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.numel() == s * d && sin.numel() == s * d, "megalite::rotary: bad cos/sin or odd d");
  at::Tensor out = at::empty_like(x);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  // Forward: o1 = x1 c1 - x2 s1, o2 = x2 c2 + x1 s2.  Backward: g1 c1 + g2 s2, g2 c2 - g1 s1.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(s * per_pos, d, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(d);
      for (int64_t r = r0; r < r1; ++r) {
        const float* c = cp + (r / per_pos) * d;
        const float* sn = sp + (r / per_pos) * d;
        const scalar_t* xr = xp + r * d;
        if (backward) {
          for (int64_t j = 0; j < half; ++j) {
            const float a = xr[j], b = xr[j + half];
            buf[j] = a * c[j] + b * sn[j + half];
            buf[j + half] = b * c[j + half] - a * sn[j];
          }
        } else {
          for (int64_t j = 0; j < half; ++j) {
            const float a = xr[j], b = xr[j + half];
            buf[j] = a * c[j] - b * sn[j];
            buf[j + half] = b * c[j + half] + a * sn[j + half];
          }
        }
        store_row(buf.data(), op + r * d, d);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------- bias + dropout + residual

at::Tensor bias_dropout_add_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& residual,
                                const c10::optional<at::Tensor>& mask, double scale) {
  check_cpu(x, "x");
  check_cpu(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "megalite::bias_dropout_add_fwd: residual/x mismatch");
  const at::Tensor* b = optional_bias(bias, x);
  // The bool mask is read as bytes (0 or 1) and multiplied in, a branch-free loop that vectorizes.
  const uint8_t* mp = nullptr;
  if (mask.has_value() && mask->defined()) {
    check_cpu(*mask, "mask");
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->sizes() == x.sizes(), "megalite::bias_dropout_add_fwd: mask must be bool shaped like x");
    mp = reinterpret_cast<const uint8_t*>(mask->data_ptr<bool>());
  }
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  const float sc = static_cast<float>(scale);
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_dropout_add_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(b);
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(h);
      for (int64_t r = r0; r < r1; ++r) {
        load_row_bias(xp + r * h, bp, buf.data(), h);
        const scalar_t* res = rp + r * h;
        if (mp != nullptr) {
          const uint8_t* m = mp + r * h;
          for (int64_t j = 0; j < h; ++j) buf[j] = static_cast<float>(res[j]) + buf[j] * (static_cast<float>(m[j]) * sc);
        } else {
          for (int64_t j = 0; j < h; ++j) buf[j] += static_cast<float>(res[j]);
        }
        store_row(buf.data(), op + r * h, h);
      }
    });
  });
  return out;
}

at::Tensor dropout_bwd(const at::Tensor& grad, const at::Tensor& mask, double scale) {
  check_cpu(grad, "grad");
  check_cpu(mask, "mask");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.sizes() == grad.sizes(), "megalite::dropout_bwd: mask must be bool shaped like grad");
  const int64_t n = grad.numel();
  const float sc = static_cast<float>(scale);
  at::Tensor out = at::empty_like(grad);
  const uint8_t* mp = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "dropout_bwd", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain * 8, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) op[i] = static_cast<scalar_t>(static_cast<float>(gp[i]) * (static_cast<float>(mp[i]) * sc));
    });
  });
  return out;
}

// ---------------------------------------------------------------- softmax

// y = softmax(v) over v[0, n) where masked entries (keep == false) get 0; a row with nothing kept is all 0.
inline void softmax_row(float* v, const bool* masked, int64_t n) {
  float mx = -INFINITY;
_Pragma("omp simd reduction(max : mx)")
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, masked != nullptr && masked[j] ? -INFINITY : v[j]);
  if (mx == -INFINITY) {
    std::fill(v, v + n, 0.0f);
    return;
  }
  float sum = 0.0f;
  if (masked != nullptr) {
_Pragma("omp simd reduction(+ : sum)")
    for (int64_t j = 0; j < n; ++j) {
      v[j] = masked[j] ? 0.0f : fast_exp(v[j] - mx);
      sum += v[j];
    }
  } else {
_Pragma("omp simd reduction(+ : sum)")
    for (int64_t j = 0; j < n; ++j) {
      v[j] = fast_exp(v[j] - mx);
      sum += v[j];
    }
  }
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) v[j] *= inv;
}

at::Tensor causal_softmax_fwd(const at::Tensor& x, double scale) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) == x.size(-2), "megalite::causal_softmax_fwd: x must be [..., s, s]");
  const int64_t s = x.size(-1), rows = x.numel() / std::max<int64_t>(s, 1);
  const float sc = static_cast<float>(scale);
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "causal_softmax_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, s, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(s);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t n = r % s + 1;
        const scalar_t* xr = xp + r * s;
        for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(xr[j]) * sc;
        softmax_row(buf.data(), nullptr, n);
        std::fill(buf.begin() + n, buf.end(), 0.0f);
        store_row(buf.data(), yp + r * s, s);
      }
    });
  });
  return y;
}

at::Tensor masked_softmax_fwd(const at::Tensor& x, const at::Tensor& mask, double scale) {
  check_cpu(x, "x");
  TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == at::kBool, "megalite::masked_softmax_fwd: mask must be a CPU bool tensor");
  TORCH_CHECK(x.dim() == 4 && mask.sizes() == x.sizes() && mask.stride(3) == 1,
              "megalite::masked_softmax_fwd: x must be 4-d and mask expanded to x with unit last stride");
  const int64_t d1 = x.size(1), d2 = x.size(2), sk = x.size(3), rows = x.numel() / std::max<int64_t>(sk, 1);
  const int64_t st0 = mask.stride(0), st1 = mask.stride(1), st2 = mask.stride(2);
  const float sc = static_cast<float>(scale);
  const bool* mp = mask.data_ptr<bool>();
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "masked_softmax_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, sk, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(sk);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i2 = r % d2, i1 = (r / d2) % d1, i0 = r / (d2 * d1);
        load_row(xp + r * sk, buf.data(), sk);
        for (int64_t j = 0; j < sk; ++j) buf[j] *= sc;
        softmax_row(buf.data(), mp + i0 * st0 + i1 * st1 + i2 * st2, sk);
        store_row(buf.data(), yp + r * sk, sk);
      }
    });
  });
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& grad, const at::Tensor& y, double scale) {
  check_cpu(grad, "grad");
  check_cpu(y, "y");
  TORCH_CHECK(grad.sizes() == y.sizes() && grad.scalar_type() == y.scalar_type(), "megalite::softmax_bwd: grad/y mismatch");
  const int64_t n = y.size(-1), rows = y.numel() / std::max<int64_t>(n, 1);
  const float sc = static_cast<float>(scale);
  at::Tensor gx = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "softmax_bwd", [&] {
    const scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = gx.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t r0, int64_t r1) {
      std::vector<float> yv(n), g(n);
      for (int64_t r = r0; r < r1; ++r) {
        load_row(yp + r * n, yv.data(), n);
        load_row(gp + r * n, g.data(), n);
        float dot = 0.0f;
_Pragma("omp simd reduction(+ : dot)")
        for (int64_t j = 0; j < n; ++j) dot += g[j] * yv[j];
        for (int64_t j = 0; j < n; ++j) g[j] = sc * yv[j] * (g[j] - dot);
        store_row(g.data(), op + r * n, n);
      }
    });
  });
  return gx;
}

// ---------------------------------------------------------------- paged attention (inference decode)

// Attention of a few new queries per sequence over that sequence's paged KV cache, read in place through its
// block table (no gather).  q [T, heads, d] holds the packed new tokens; sequence s owns rows
// first[s] .. first[s] + lengths[s], whose query i sits at position starts[s] + i and sees keys 0 .. that
// position (its own key is already written to the cache).  keys/values are [groups, num_blocks, block, d];
// heads g * per_group .. (g + 1) * per_group - 1 read group g.  One pass over the blocks per (sequence,
// group) with an online softmax, fp32 throughout.  Rows of q outside every sequence come back as 0.
// Decode attention reads more bytes than it computes on, so the loop is built around the reads: every key
// and value row of a block is used for all of the group's query vectors while it is in L1, and the next
// block (a scattered page) is prefetched while this one is worked on.
// Eight and four floats in a vector register (GCC/Clang vector extensions; AVX with -march=native).
typedef float Float8 __attribute__((vector_size(32)));
typedef float Float4 __attribute__((vector_size(16)));

MEGALITE_INLINE Float8 load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Dot product of two length-d rows: eight running sums in one register, folded with shuffles at the end.  A
// plain `omp simd` reduction folds through the stack with a serial chain of scalar adds, which dominated the
// paged-attention kernel.
MEGALITE_INLINE float dot8(const float* a, const float* b, int64_t d) {
  Float8 sum8 = {};
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) sum8 += load8(a + c) * load8(b + c);
  Float4 low, high;
  std::memcpy(&low, &sum8, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&sum8) + sizeof(low), sizeof(high));
  const Float4 sum4 = low + high;
  float dot = (sum4[0] + sum4[2]) + (sum4[1] + sum4[3]);
  for (; c < d; ++c) dot += a[c] * b[c];
  return dot;
}

// a += sum_r p[r] * rows[r] over n rows of length d.  For the common head sizes the accumulator stays in
// registers across the rows (D / 8 vectors); otherwise it is updated in memory row by row.
template <int64_t D>
MEGALITE_INLINE void add_weighted_rows_fixed(float* a, const float* p, const float* rows, int64_t n) {
  Float8 t[D / 8];
  for (int64_t k = 0; k < D / 8; ++k) t[k] = load8(a + 8 * k);
  for (int64_t r = 0; r < n; ++r) {
    const float w = p[r];
    for (int64_t k = 0; k < D / 8; ++k) t[k] += w * load8(rows + r * D + 8 * k);
  }
  std::memcpy(a, t, sizeof(t));
}

MEGALITE_INLINE void add_weighted_rows(float* a, const float* p, const float* rows, int64_t n, int64_t d) {
  if (d == 64) return add_weighted_rows_fixed<64>(a, p, rows, n);
  if (d == 128) return add_weighted_rows_fixed<128>(a, p, rows, n);
  for (int64_t r = 0; r < n; ++r) {
    const float w = p[r];
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) a[c] += w * rows[r * d + c];
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& block_tables, const at::Tensor& starts, const at::Tensor& lengths,
                           const at::Tensor& first, double scale) {
  check_float(q, "q");
  check_float(keys, "keys");
  check_float(values, "values");
  for (const at::Tensor* t : {&block_tables, &starts, &lengths, &first}) {
    check_cpu(*t, "block table / starts / lengths / first");
    TORCH_CHECK(t->scalar_type() == at::kLong, "megalite::paged_attention: index tensors must be int64");
  }
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && q.size(2) == keys.size(3),
              "megalite::paged_attention: q must be [T, heads, d] and keys/values [groups, blocks, block, d]");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t groups = keys.size(0), num_blocks = keys.size(1), bs = keys.size(2);
  TORCH_CHECK(heads % groups == 0, "megalite::paged_attention: ", heads, " heads not a multiple of ", groups, " groups");
  const int64_t n = starts.numel(), max_blocks = block_tables.size(-1), per_group = heads / groups;
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n && lengths.numel() == n && first.numel() == n,
              "megalite::paged_attention: one block-table row, length and first row per sequence");
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s) {
    const int64_t context = sp[s] + lp[s];
    TORCH_CHECK(sp[s] >= 0 && lp[s] >= 0 && fp[s] >= 0 && fp[s] + lp[s] <= rows && (context + bs - 1) / bs <= max_blocks,
                "megalite::paged_attention: sequence ", s, " (start ", sp[s], ", length ", lp[s], ", first row ", fp[s],
                ") does not fit ", rows, " query rows and ", max_blocks, " table blocks");
    for (int64_t b = 0; b < (context + bs - 1) / bs; ++b) {
      TORCH_CHECK(tp[s * max_blocks + b] >= 0 && tp[s * max_blocks + b] < num_blocks, "megalite::paged_attention: block id ",
                  tp[s * max_blocks + b], " outside [0, ", num_blocks, ")");
    }
  }
  at::Tensor out = at::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * groups, 1, [&](int64_t task0, int64_t task1) {
    std::vector<float> state, prob;
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t s = task / groups, g = task % groups, len = lp[s];
      const int64_t nq = len * per_group;  // query vectors of this (sequence, group): row i, head j -> i * per_group + j
      // Per query vector: running max, running sum, the query scaled by `scale`, the accumulator [d].
      state.assign(nq * (2 + 2 * d), 0.0f);
      float* run_max = state.data();
      float* run_sum = run_max + nq;
      float* query = run_sum + nq;
      float* acc = query + nq * d;
      prob.assign(nq * bs, 0.0f);  // this block's scores, then probabilities, [nq, bs]
      std::fill(run_max, run_max + nq, -INFINITY);
      for (int64_t i = 0; i < len; ++i) {
        for (int64_t j = 0; j < per_group; ++j) {
          const float* qv = qp + ((fp[s] + i) * heads + g * per_group + j) * d;
          float* dst = query + (i * per_group + j) * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) dst[c] = qv[c] * sc;
        }
      }
      const int64_t context = sp[s] + len;
      for (int64_t b = 0; b * bs < context; ++b) {
        const int64_t block = tp[s * max_blocks + b];
        const float* kb = kp + (g * num_blocks + block) * bs * d;
        const float* vb = vp + (g * num_blocks + block) * bs * d;
        const int64_t rows_here = std::min<int64_t>(bs, context - b * bs);
        // Blocks are scattered pages, which the hardware prefetcher does not follow: while this block is read,
        // load the next one, a row of keys and of values per row here.
        const bool has_next = (b + 1) * bs < context;
        const int64_t next = has_next ? tp[s * max_blocks + b + 1] : block;
        const char* kn = reinterpret_cast<const char*>(kp + (g * num_blocks + next) * bs * d);
        const char* vn = reinterpret_cast<const char*>(vp + (g * num_blocks + next) * bs * d);
        const int64_t row_bytes = d * static_cast<int64_t>(sizeof(float));
        // Scores: each key row is read once for all query vectors of the group.
        for (int64_t r = 0; r < rows_here; ++r) {
          const float* kr = kb + r * d;
          if (has_next) {
            for (int64_t byte = r * row_bytes; byte < (r + 1) * row_bytes; byte += 64) {
              __builtin_prefetch(kn + byte);
              __builtin_prefetch(vn + byte);
            }
          }
          for (int64_t v = 0; v < nq; ++v) prob[v * bs + r] = dot8(query + v * d, kr, d);
        }
        // Online softmax per query vector; keys past a query's position (speculative rows) get probability 0.
        for (int64_t v = 0; v < nq; ++v) {
          const int64_t visible = std::min<int64_t>(rows_here, sp[s] + v / per_group + 1 - b * bs);
          float* pv = prob.data() + v * bs;
          if (visible <= 0) {
            std::fill(pv, pv + rows_here, 0.0f);
            continue;
          }
          float block_max = -INFINITY;
          for (int64_t r = 0; r < visible; ++r) block_max = std::max(block_max, pv[r]);
          const float new_max = std::max(run_max[v], block_max);
          const float correction = fast_exp(run_max[v] - new_max);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t r = 0; r < visible; ++r) {
            pv[r] = fast_exp(pv[r] - new_max);
            sum += pv[r];
          }
          std::fill(pv + visible, pv + rows_here, 0.0f);
          run_max[v] = new_max;
          run_sum[v] = run_sum[v] * correction + sum;
          float* a = acc + v * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) a[c] *= correction;
        }
        for (int64_t v = 0; v < nq; ++v) add_weighted_rows(acc + v * d, prob.data() + v * bs, vb, rows_here, d);
      }
      for (int64_t i = 0; i < len; ++i) {
        for (int64_t j = 0; j < per_group; ++j) {
          const int64_t v = i * per_group + j;
          const float inv = 1.0f / run_sum[v];
          const float* a = acc + v * d;
          float* o = op + ((fp[s] + i) * heads + g * per_group + j) * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) o[c] = a[c] * inv;
        }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------- MoE permute / unpermute

// inverse[t * k + slot] = row j of that assignment in the permuted layout, or -1 when it was dropped.
std::vector<int64_t> inverse_map(const at::Tensor& row_map, int64_t assignments) {
  check_cpu(row_map, "row_map");
  TORCH_CHECK(row_map.scalar_type() == at::kLong, "megalite: row_map must be int64");
  std::vector<int64_t> inverse(assignments, -1);
  const int64_t* rm = row_map.data_ptr<int64_t>();
  for (int64_t j = 0; j < row_map.numel(); ++j) {
    TORCH_CHECK(rm[j] >= 0 && rm[j] < assignments, "megalite: row_map entry ", rm[j], " outside [0, ", assignments, ")");
    inverse[rm[j]] = j;
  }
  return inverse;
}

// Flat indices of the kept (>= 0) assignments grouped by expert id, in the order a stable argsort
// gives.  A counting sort (one pass to count, one to place) when the ids are small next to the
// number of assignments, as router outputs are; a stable comparison sort otherwise.
at::Tensor permute_row_map(const at::Tensor& expert_indices) {
  check_cpu(expert_indices, "expert_indices");
  TORCH_CHECK(expert_indices.scalar_type() == at::kLong, "megalite::permute_row_map: expert_indices must be int64");
  const int64_t n = expert_indices.numel();
  const int64_t* e = expert_indices.data_ptr<int64_t>();
  int64_t experts = 0, kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    experts = std::max(experts, e[i] + 1);
    kept += e[i] >= 0;
  }
  at::Tensor out = at::empty({kept}, expert_indices.options());
  int64_t* o = out.data_ptr<int64_t>();
  if (experts > 2 * n + 1024) {
    int64_t j = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (e[i] >= 0) o[j++] = i;
    }
    std::stable_sort(o, o + kept, [e](int64_t a, int64_t b) { return e[a] < e[b]; });
    return out;
  }
  std::vector<int64_t> next(experts + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] >= 0) ++next[e[i] + 1];
  }
  for (int64_t x = 0; x < experts; ++x) next[x + 1] += next[x];
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] >= 0) o[next[e[i]]++] = i;
  }
  return out;
}

at::Tensor permute_fwd(const at::Tensor& tokens, const at::Tensor& row_map, int64_t k) {
  check_cpu(tokens, "tokens");
  check_cpu(row_map, "row_map");
  TORCH_CHECK(tokens.dim() == 2 && row_map.scalar_type() == at::kLong && k > 0, "megalite::permute_fwd: bad arguments");
  const int64_t n = row_map.numel(), h = tokens.size(1), assignments = tokens.size(0) * k;
  at::Tensor out = at::empty({n, h}, tokens.options());
  const int64_t* rm = row_map.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(rm[j] >= 0 && rm[j] < assignments, "megalite::permute_fwd: row_map entry ", rm[j], " outside [0, ", assignments, ")");
  }
  const int64_t bytes = h * tokens.element_size();
  const char* src = static_cast<const char*>(tokens.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for_rows(n, h, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) std::memcpy(dst + j * bytes, src + (rm[j] / k) * bytes, bytes);
  });
  return out;
}

at::Tensor permute_bwd(const at::Tensor& grad, const at::Tensor& row_map, int64_t num_tokens, int64_t k) {
  check_cpu(grad, "grad");
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == row_map.numel() && k > 0, "megalite::permute_bwd: bad arguments");
  const std::vector<int64_t> inverse = inverse_map(row_map, num_tokens * k);
  const int64_t h = grad.size(1);
  at::Tensor out = at::empty({num_tokens, h}, grad.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "permute_bwd", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(num_tokens, h * k, [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(h);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t slot = 0; slot < k; ++slot) {
          const int64_t j = inverse[t * k + slot];
          if (j < 0) continue;
          const scalar_t* g = gp + j * h;
          for (int64_t c = 0; c < h; ++c) acc[c] += static_cast<float>(g[c]);
        }
        store_row(acc.data(), op + t * h, h);
      }
    });
  });
  return out;
}

at::Tensor unpermute_fwd(const at::Tensor& permuted, const at::Tensor& row_map, const at::Tensor& probs, int64_t num_tokens) {
  check_cpu(permuted, "permuted");
  check_float(probs, "probs");
  TORCH_CHECK(permuted.dim() == 2 && permuted.size(0) == row_map.numel() && probs.dim() == 2 && probs.size(0) == num_tokens,
              "megalite::unpermute_fwd: bad arguments");
  const int64_t k = probs.size(1), h = permuted.size(1);
  const std::vector<int64_t> inverse = inverse_map(row_map, num_tokens * k);
  const float* pp = probs.data_ptr<float>();
  at::Tensor out = at::empty({num_tokens, h}, permuted.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, permuted.scalar_type(), "unpermute_fwd", [&] {
    const scalar_t* xp = permuted.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(num_tokens, h * k, [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(h);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t slot = 0; slot < k; ++slot) {
          const int64_t j = inverse[t * k + slot];
          if (j < 0) continue;
          const float w = pp[t * k + slot];
          const scalar_t* row = xp + j * h;
          for (int64_t c = 0; c < h; ++c) acc[c] += w * static_cast<float>(row[c]);
        }
        store_row(acc.data(), op + t * h, h);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> unpermute_bwd(const at::Tensor& grad, const at::Tensor& permuted, const at::Tensor& row_map,
                                                 const at::Tensor& probs) {
  check_cpu(grad, "grad");
  check_cpu(permuted, "permuted");
  check_float(probs, "probs");
  const int64_t num_tokens = probs.size(0), k = probs.size(1), n = permuted.size(0), h = permuted.size(1);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == num_tokens && grad.size(1) == h && grad.scalar_type() == permuted.scalar_type(),
              "megalite::unpermute_bwd: bad arguments");
  inverse_map(row_map, num_tokens * k);
  const int64_t* rm = row_map.data_ptr<int64_t>();
  const float* pp = probs.data_ptr<float>();
  at::Tensor gperm = at::empty_like(permuted);
  at::Tensor gprobs = at::zeros_like(probs);
  float* gpp = gprobs.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, permuted.scalar_type(), "unpermute_bwd", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    const scalar_t* xp = permuted.data_ptr<scalar_t>();
    scalar_t* op = gperm.data_ptr<scalar_t>();
    for_rows(n, h, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t a = rm[j];
        const float w = pp[a];
        const scalar_t* g = gp + (a / k) * h;
        const scalar_t* x = xp + j * h;
        scalar_t* o = op + j * h;
        float dot = 0.0f;
_Pragma("omp simd reduction(+ : dot)")
        for (int64_t c = 0; c < h; ++c) {
          const float gc = static_cast<float>(g[c]);
          o[c] = static_cast<scalar_t>(w * gc);
          dot += gc * static_cast<float>(x[c]);
        }
        gpp[a] = dot;
      }
    });
  });
  return {gperm, gprobs};
}

}  // namespace

TORCH_LIBRARY_IMPL(megalite, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("bias_gelu_fwd", &bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd);
  m.impl("bias_swiglu_fwd", &bias_swiglu_fwd);
  m.impl("bias_swiglu_bwd", &bias_swiglu_bwd);
  m.impl("rotary", &rotary);
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd);
  m.impl("dropout_bwd", &dropout_bwd);
  m.impl("causal_softmax_fwd", &causal_softmax_fwd);
  m.impl("masked_softmax_fwd", &masked_softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
  m.impl("permute_row_map", &permute_row_map);
  m.impl("permute_fwd", &permute_fwd);
  m.impl("permute_bwd", &permute_bwd);
  m.impl("unpermute_fwd", &unpermute_fwd);
  m.impl("unpermute_bwd", &unpermute_bwd);
  m.impl("paged_attention", &paged_attention);
}

}  // namespace megalite

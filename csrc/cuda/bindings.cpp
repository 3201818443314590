// CUDA implementations of the megalite ops: checks and allocation in ATen, work in the
// plain-CUDA launchers of kernels.h.  Built only when torch has CUDA and nvcc is found.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"

namespace megalite {
namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::kFloat32;
    case at::kHalf: return cuda::kFloat16;
    case at::kBFloat16: return cuda::kBFloat16;
    default: TORCH_CHECK(false, "megalite: unsupported dtype ", t.scalar_type());
  }
  return -1;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "megalite: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "megalite: ", name, " must be contiguous");
}

void check_float(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "megalite: ", name, " must be float32");
}

void check_status(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, "megalite::", op, ": ", cudaGetErrorString(status));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

int64_t last_dim(const at::Tensor& x) { return x.dim() == 0 ? 1 : x.size(-1); }
int64_t rows_of(const at::Tensor& x) { return last_dim(x) == 0 ? 0 : x.numel() / last_dim(x); }

const void* optional_ptr(const c10::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check_cuda(*t, name);
  TORCH_CHECK(t->scalar_type() == x.scalar_type(), "megalite: ", name, " dtype differs from x");
  TORCH_CHECK(t->numel() == last_dim(x), "megalite: ", name, " size ", t->numel(), " != last dim ", last_dim(x));
  return t->data_ptr();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                              const at::Tensor& bias, double eps) {
  check_cuda(x, "x");
  check_float(weight, "weight");
  check_float(bias, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = last_dim(x), rows = rows_of(x);
  TORCH_CHECK(weight.numel() == h && bias.numel() == h, "megalite::layer_norm_fwd: weight/bias size != ", h);
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_status(cuda::layer_norm_fwd(dtype_code(x), x.data_ptr(), weight.data_ptr<float>(), bias.data_ptr<float>(),
                                    y.data_ptr(), mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, h,
                                    static_cast<float>(eps), stream()),
               "layer_norm_fwd");
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& grad, const at::Tensor& x,
                                                              const at::Tensor& weight, const at::Tensor& mean,
                                                              const at::Tensor& rstd) {
  check_cuda(grad, "grad");
  check_cuda(x, "x");
  check_float(weight, "weight");
  check_float(mean, "mean");
  check_float(rstd, "rstd");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "megalite::layer_norm_bwd: grad/x mismatch");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = last_dim(x), rows = rows_of(x);
  at::Tensor gx = at::empty_like(x);
  at::Tensor gw = at::empty({h}, weight.options());
  at::Tensor gb = at::empty({h}, weight.options());
  at::Tensor workspace = at::empty({2 * cuda::norm_bwd_chunks(rows) * h}, weight.options());
  check_status(cuda::layer_norm_bwd(dtype_code(x), grad.data_ptr(), x.data_ptr(), weight.data_ptr<float>(),
                                    mean.data_ptr<float>(), rstd.data_ptr<float>(), gx.data_ptr(), gw.data_ptr<float>(),
                                    gb.data_ptr<float>(), workspace.data_ptr<float>(), rows, h, stream()),
               "layer_norm_bwd");
  return {gx, gw, gb};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cuda(x, "x");
  check_float(weight, "weight");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = last_dim(x), rows = rows_of(x);
  TORCH_CHECK(weight.numel() == h, "megalite::rms_norm_fwd: weight size ", weight.numel(), " != ", h);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_status(cuda::rms_norm_fwd(dtype_code(x), x.data_ptr(), weight.data_ptr<float>(), y.data_ptr(),
                                  rstd.data_ptr<float>(), rows, h, static_cast<float>(eps), stream()),
               "rms_norm_fwd");
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& rstd) {
  check_cuda(grad, "grad");
  check_cuda(x, "x");
  check_float(weight, "weight");
  check_float(rstd, "rstd");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "megalite::rms_norm_bwd: grad/x mismatch");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = last_dim(x), rows = rows_of(x);
  at::Tensor gx = at::empty_like(x);
  at::Tensor gw = at::empty({h}, weight.options());
  at::Tensor workspace = at::empty({cuda::norm_bwd_chunks(rows) * h}, weight.options());
  check_status(cuda::rms_norm_bwd(dtype_code(x), grad.data_ptr(), x.data_ptr(), weight.data_ptr<float>(),
                                  rstd.data_ptr<float>(), gx.data_ptr(), gw.data_ptr<float>(),
                                  workspace.data_ptr<float>(), rows, h, stream()),
               "rms_norm_bwd");
  return {gx, gw};
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  check_status(cuda::bias_gelu_fwd(dtype_code(x), x.data_ptr(), optional_ptr(bias, x, "bias"), y.data_ptr(),
                                   rows_of(x), last_dim(x), stream()),
               "bias_gelu_fwd");
  return y;
}

at::Tensor bias_gelu_bwd(const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cuda(grad, "grad");
  check_cuda(x, "x");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "megalite::bias_gelu_bwd: grad/x mismatch");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor gx = at::empty_like(x);
  check_status(cuda::bias_gelu_bwd(dtype_code(x), grad.data_ptr(), x.data_ptr(), optional_ptr(bias, x, "bias"),
                                   gx.data_ptr(), rows_of(x), last_dim(x), stream()),
               "bias_gelu_bwd");
  return gx;
}

at::Tensor bias_swiglu_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cuda(x, "x");
  TORCH_CHECK(last_dim(x) % 2 == 0, "megalite::bias_swiglu_fwd: last dim ", last_dim(x), " is odd");
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor y = at::empty(shape, x.options());
  check_status(cuda::bias_swiglu_fwd(dtype_code(x), x.data_ptr(), optional_ptr(bias, x, "bias"), y.data_ptr(),
                                     rows_of(x), last_dim(x), stream()),
               "bias_swiglu_fwd");
  return y;
}

at::Tensor bias_swiglu_bwd(const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_cuda(grad, "grad");
  check_cuda(x, "x");
  TORCH_CHECK(grad.numel() * 2 == x.numel() && grad.scalar_type() == x.scalar_type(), "megalite::bias_swiglu_bwd: grad/x mismatch");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor gx = at::empty_like(x);
  check_status(cuda::bias_swiglu_bwd(dtype_code(x), grad.data_ptr(), x.data_ptr(), optional_ptr(bias, x, "bias"),
                                     gx.data_ptr(), rows_of(x), last_dim(x), stream()),
               "bias_swiglu_bwd");
  return gx;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  check_cuda(x, "x");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "megalite::rotary: x must be [s, b, n, d] with even d");
  const int64_t s = x.size(0), d = x.size(3);
  TORCH_CHECK(cos.numel() == s * d && sin.numel() == s * d, "megalite::rotary: cos/sin must be [", s, ", ", d, "]");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  check_status(cuda::rotary(dtype_code(x), x.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr(),
                            s, x.size(1) * x.size(2), d, backward, stream()),
               "rotary");
  return out;
}

const int64_t* seed_ptr(const at::Tensor& seed, const at::Tensor& x) {
  check_cuda(seed, "seed");
  TORCH_CHECK(seed.scalar_type() == at::kLong && seed.numel() == 1 && seed.device() == x.device(),
              "megalite: the dropout seed must be one int64 on the device of x");
  return seed.data_ptr<int64_t>();
}

uint32_t keep_threshold(int64_t threshold) {
  TORCH_CHECK(threshold >= 0 && threshold < (int64_t{1} << 32), "megalite: dropout threshold ", threshold,
              " outside [0, 2^32)");
  return static_cast<uint32_t>(threshold);
}

at::Tensor bias_dropout_add_philox_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                       const at::Tensor& residual, const at::Tensor& seed, int64_t threshold,
                                       double scale) {
  check_cuda(x, "x");
  check_cuda(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "megalite::bias_dropout_add_philox_fwd: residual/x mismatch");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  check_status(cuda::bias_dropout_add_fwd(dtype_code(x), x.data_ptr(), optional_ptr(bias, x, "bias"),
                                          residual.data_ptr(), seed_ptr(seed, x), keep_threshold(threshold),
                                          out.data_ptr(), rows_of(x), last_dim(x), static_cast<float>(scale),
                                          stream()),
               "bias_dropout_add_philox_fwd");
  return out;
}

at::Tensor dropout_philox_bwd(const at::Tensor& grad, const at::Tensor& seed, int64_t threshold, double scale) {
  check_cuda(grad, "grad");
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor out = at::empty_like(grad);
  check_status(cuda::dropout_bwd(dtype_code(grad), grad.data_ptr(), seed_ptr(seed, grad), keep_threshold(threshold),
                                 out.data_ptr(), grad.numel(), static_cast<float>(scale), stream()),
               "dropout_philox_bwd");
  return out;
}

at::Tensor causal_softmax_fwd(const at::Tensor& x, double scale) {
  check_cuda(x, "x");
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) == x.size(-2), "megalite::causal_softmax_fwd: x must be [..., s, s]");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  check_status(cuda::causal_softmax_fwd(dtype_code(x), x.data_ptr(), y.data_ptr(), rows_of(x), last_dim(x),
                                        static_cast<float>(scale), stream()),
               "causal_softmax_fwd");
  return y;
}

at::Tensor masked_softmax_fwd(const at::Tensor& x, const at::Tensor& mask, double scale) {
  check_cuda(x, "x");
  TORCH_CHECK(mask.is_cuda() && mask.scalar_type() == at::kBool, "megalite::masked_softmax_fwd: mask must be a CUDA bool tensor");
  TORCH_CHECK(x.dim() == 4 && mask.sizes() == x.sizes() && mask.stride(3) == 1,
              "megalite::masked_softmax_fwd: x must be 4-d and mask expanded to x with unit last stride");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  check_status(cuda::masked_softmax_fwd(dtype_code(x), x.data_ptr(), mask.data_ptr<bool>(), y.data_ptr(), x.size(0),
                                        x.size(1), x.size(2), x.size(3), mask.stride(0), mask.stride(1),
                                        mask.stride(2), static_cast<float>(scale), stream()),
               "masked_softmax_fwd");
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& grad, const at::Tensor& y, double scale) {
  check_cuda(grad, "grad");
  check_cuda(y, "y");
  TORCH_CHECK(grad.sizes() == y.sizes() && grad.scalar_type() == y.scalar_type(), "megalite::softmax_bwd: grad/y mismatch");
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor gx = at::empty_like(y);
  check_status(cuda::softmax_bwd(dtype_code(y), grad.data_ptr(), y.data_ptr(), gx.data_ptr(), rows_of(y), last_dim(y),
                                 static_cast<float>(scale), stream()),
               "softmax_bwd");
  return gx;
}

void check_row_map(const at::Tensor& row_map) {
  check_cuda(row_map, "row_map");
  TORCH_CHECK(row_map.scalar_type() == at::kLong && row_map.dim() == 1, "megalite: row_map must be 1-d int64");
}

// The CPU op's counting sort on the GPU.  The row map's length comes from the data, so the host reads the kept
// count (one sync, as torch's nonzero makes); past kMaxSortExperts experts a stable argsort, as the CPU op's
// fallback for very many experts.
at::Tensor permute_row_map(const at::Tensor& expert_indices) {
  check_cuda(expert_indices, "expert_indices");
  TORCH_CHECK(expert_indices.scalar_type() == at::kLong, "megalite::permute_row_map: expert_indices must be int64");
  const c10::cuda::CUDAGuard guard(expert_indices.device());
  const int64_t n = expert_indices.numel();
  const int64_t* ids = expert_indices.data_ptr<int64_t>();
  at::Tensor stats = at::empty({2}, expert_indices.options());
  check_status(cuda::row_map_stats(ids, n, stats.data_ptr<int64_t>(), stream()), "permute_row_map");
  const at::Tensor host = stats.cpu();
  const int64_t experts = host.data_ptr<int64_t>()[0], kept = host.data_ptr<int64_t>()[1];
  if (experts > cuda::kMaxSortExperts) {
    return at::argsort(expert_indices.reshape({-1}), /*stable=*/true).slice(0, n - kept);
  }
  at::Tensor row_map = at::empty({kept}, expert_indices.options());
  if (kept == 0) return row_map;
  at::Tensor hist = at::empty({experts * ((n + cuda::kSortTile - 1) / cuda::kSortTile)}, expert_indices.options());
  check_status(cuda::row_map_counting_sort(ids, n, static_cast<int>(experts), hist.data_ptr<int64_t>(),
                                           row_map.data_ptr<int64_t>(), stream()),
               "permute_row_map");
  return row_map;
}

at::Tensor permute_fwd(const at::Tensor& tokens, const at::Tensor& row_map, int64_t k) {
  check_cuda(tokens, "tokens");
  check_row_map(row_map);
  TORCH_CHECK(tokens.dim() == 2 && k > 0, "megalite::permute_fwd: tokens must be [T, h] and k > 0");
  const c10::cuda::CUDAGuard guard(tokens.device());
  const int64_t n = row_map.numel(), h = tokens.size(1);
  at::Tensor out = at::empty({n, h}, tokens.options());
  check_status(cuda::permute_fwd(dtype_code(tokens), tokens.data_ptr(), row_map.data_ptr<int64_t>(), out.data_ptr(),
                                 n, h, k, tokens.size(0), stream()),
               "permute_fwd");
  return out;
}

at::Tensor permute_bwd(const at::Tensor& grad, const at::Tensor& row_map, int64_t num_tokens, int64_t k) {
  check_cuda(grad, "grad");
  check_row_map(row_map);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == row_map.numel() && k > 0, "megalite::permute_bwd: bad arguments");
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t h = grad.size(1);
  at::Tensor inverse = at::full({num_tokens * k}, -1, row_map.options());
  at::Tensor out = at::empty({num_tokens, h}, grad.options());
  check_status(cuda::permute_bwd(dtype_code(grad), grad.data_ptr(), row_map.data_ptr<int64_t>(),
                                 inverse.data_ptr<int64_t>(), out.data_ptr(), row_map.numel(), h, k, num_tokens,
                                 stream()),
               "permute_bwd");
  return out;
}

at::Tensor unpermute_fwd(const at::Tensor& permuted, const at::Tensor& row_map, const at::Tensor& probs, int64_t num_tokens) {
  check_cuda(permuted, "permuted");
  check_row_map(row_map);
  check_float(probs, "probs");
  TORCH_CHECK(permuted.dim() == 2 && permuted.size(0) == row_map.numel() && probs.dim() == 2 && probs.size(0) == num_tokens,
              "megalite::unpermute_fwd: bad arguments");
  const c10::cuda::CUDAGuard guard(permuted.device());
  const int64_t k = probs.size(1), h = permuted.size(1);
  at::Tensor inverse = at::full({num_tokens * k}, -1, row_map.options());
  at::Tensor out = at::empty({num_tokens, h}, permuted.options());
  check_status(cuda::unpermute_fwd(dtype_code(permuted), permuted.data_ptr(), row_map.data_ptr<int64_t>(),
                                   probs.data_ptr<float>(), inverse.data_ptr<int64_t>(), out.data_ptr(),
                                   row_map.numel(), h, k, num_tokens, stream()),
               "unpermute_fwd");
  return out;
}

std::tuple<at::Tensor, at::Tensor> unpermute_bwd(const at::Tensor& grad, const at::Tensor& permuted, const at::Tensor& row_map,
                                                 const at::Tensor& probs) {
  check_cuda(grad, "grad");
  check_cuda(permuted, "permuted");
  check_row_map(row_map);
  check_float(probs, "probs");
  const int64_t num_tokens = probs.size(0), k = probs.size(1), h = permuted.size(1);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == num_tokens && grad.size(1) == h && grad.scalar_type() == permuted.scalar_type(),
              "megalite::unpermute_bwd: bad arguments");
  const c10::cuda::CUDAGuard guard(permuted.device());
  at::Tensor gperm = at::empty_like(permuted);
  at::Tensor gprobs = at::zeros_like(probs);
  check_status(cuda::unpermute_bwd(dtype_code(permuted), grad.data_ptr(), permuted.data_ptr(),
                                   row_map.data_ptr<int64_t>(), probs.data_ptr<float>(), gperm.data_ptr(),
                                   gprobs.data_ptr<float>(), row_map.numel(), h, k, num_tokens, stream()),
               "unpermute_bwd");
  return {gperm, gprobs};
}

}  // namespace

TORCH_LIBRARY_IMPL(megalite, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("bias_gelu_fwd", &bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd);
  m.impl("bias_swiglu_fwd", &bias_swiglu_fwd);
  m.impl("bias_swiglu_bwd", &bias_swiglu_bwd);
  m.impl("rotary", &rotary);
  m.impl("bias_dropout_add_philox_fwd", &bias_dropout_add_philox_fwd);
  m.impl("dropout_philox_bwd", &dropout_philox_bwd);
  m.impl("causal_softmax_fwd", &causal_softmax_fwd);
  m.impl("masked_softmax_fwd", &masked_softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
  m.impl("permute_row_map", &permute_row_map);
  m.impl("permute_fwd", &permute_fwd);
  m.impl("permute_bwd", &permute_bwd);
  m.impl("unpermute_fwd", &unpermute_fwd);
  m.impl("unpermute_bwd", &unpermute_bwd);
}

}  // namespace megalite

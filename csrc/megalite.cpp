// Operator schemas of the megalite extension and its Python module (megalite._C).
//
// Kernels live per device: csrc/cpu/ops.cpp (always built) and the CUDA
// binding csrc/cuda/bindings.cpp over the plain-CUDA kernels in csrc/cuda/*.cu.
// Autograd formulas and fake (meta) kernels are registered in Python, in
// megalite/kernels/fused.py.  Norm weights/biases, rotary cos/sin and MoE
// probabilities are float32; activations are float32, float16 or bfloat16.
#include <Python.h>
#include <torch/library.h>

#ifdef MEGALITE_WITH_CUDA
#include "cuda/kernels.h"
#endif

TORCH_LIBRARY(megalite, m) {
  m.def("layer_norm_fwd(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor grad, Tensor x, Tensor weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  m.def("bias_gelu_fwd(Tensor x, Tensor? bias) -> Tensor");
  m.def("bias_gelu_bwd(Tensor grad, Tensor x, Tensor? bias) -> Tensor");
  m.def("bias_swiglu_fwd(Tensor x, Tensor? bias) -> Tensor");
  m.def("bias_swiglu_bwd(Tensor grad, Tensor x, Tensor? bias) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool backward) -> Tensor");
  m.def("bias_dropout_add_fwd(Tensor x, Tensor? bias, Tensor residual, Tensor? mask, float scale) -> Tensor");
  m.def("dropout_bwd(Tensor grad, Tensor mask, float scale) -> Tensor");
  // CUDA draws the keep-mask inside the kernel from a seed (megalite/kernels/philox.py says how); CPU reads it.
  m.def("bias_dropout_add_philox_fwd(Tensor x, Tensor? bias, Tensor residual, Tensor seed, int threshold, "
        "float scale) -> Tensor");
  m.def("dropout_philox_bwd(Tensor grad, Tensor seed, int threshold, float scale) -> Tensor");
  m.def("causal_softmax_fwd(Tensor x, float scale) -> Tensor");
  m.def("masked_softmax_fwd(Tensor x, Tensor mask, float scale) -> Tensor");
  m.def("softmax_bwd(Tensor grad, Tensor y, float scale) -> Tensor");
  m.def("permute_row_map(Tensor expert_indices) -> Tensor");
  m.def("permute_fwd(Tensor tokens, Tensor row_map, int k) -> Tensor");
  m.def("permute_bwd(Tensor grad, Tensor row_map, int num_tokens, int k) -> Tensor");
  m.def("unpermute_fwd(Tensor permuted, Tensor row_map, Tensor probs, int num_tokens) -> Tensor");
  m.def("unpermute_bwd(Tensor grad, Tensor permuted, Tensor row_map, Tensor probs) -> (Tensor, Tensor)");
  m.def("paged_attention(Tensor q, Tensor keys, Tensor values, Tensor block_tables, Tensor starts, Tensor lengths, "
        "Tensor first, float scale) -> Tensor");
}

static PyModuleDef megalite_module = {PyModuleDef_HEAD_INIT, "_C", "megalite fused kernels (ops under torch.ops.megalite)", -1,
                                      nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&megalite_module);
  if (module == nullptr) return nullptr;
#ifdef MEGALITE_WITH_CUDA
  PyModule_AddIntConstant(module, "WITH_CUDA", 1);
  PyModule_AddIntConstant(module, "CUDA_MAX_ROW", megalite::cuda::kMaxRow);
#else
  PyModule_AddIntConstant(module, "WITH_CUDA", 0);
#endif
  return module;
}

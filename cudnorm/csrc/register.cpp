// Every registration of the native path with PyTorch's dispatcher, in one place.
//
// * cudnorm::*_entry: the public entry points (CompositeImplicitAutograd: under tracing they
//   decompose into whatever cudnorm's Python implementation records).
// * The CUDA and AutogradCUDA kernels of cudnorm's custom ops, which cudnorm's Python code
//   defines (cudnorm._norm, cudnorm._fused_add, cudnorm.ada_layer_norm) with its Python
//   implementation for every other device: compiled graphs that call the ops run these.
// * cudnorm_native::*: what cudnorm._native uses to feed and inspect the plan and recipe tables.
#include <torch/library.h>

#include "native.h"

TORCH_LIBRARY_FRAGMENT(cudnorm, m) {
  m.def("layer_norm_entry(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05) -> Tensor");
  m.def("rms_norm_entry(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None, "
        "float weight_offset=0.) -> Tensor");
  m.def("add_layer_norm_entry(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, "
        "Tensor? bias=None, float eps=1e-05) -> (Tensor, Tensor)");
  m.def("add_rms_norm_entry(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, "
        "float? eps=None, float weight_offset=0.) -> (Tensor, Tensor)");
  m.def("ada_layer_norm_entry(Tensor input, Tensor scale, Tensor shift, float eps=1e-06, "
        "bool one_plus_scale=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(cudnorm, CompositeImplicitAutograd, m) {
  m.impl("layer_norm_entry", TORCH_FN(cudnorm::layer_norm_entry));
  m.impl("rms_norm_entry", TORCH_FN(cudnorm::rms_norm_entry));
  m.impl("add_layer_norm_entry", TORCH_FN(cudnorm::add_layer_norm_entry));
  m.impl("add_rms_norm_entry", TORCH_FN(cudnorm::add_rms_norm_entry));
  m.impl("ada_layer_norm_entry", TORCH_FN(cudnorm::ada_layer_norm_entry));
}

TORCH_LIBRARY_IMPL(cudnorm, CUDA, m) {
  m.impl("layer_norm_fwd", TORCH_FN(cudnorm::layer_norm_fwd));
  m.impl("layer_norm_bwd", TORCH_FN(cudnorm::layer_norm_bwd));
  m.impl("rms_norm_fwd", TORCH_FN(cudnorm::rms_norm_fwd));
  m.impl("rms_norm_bwd", TORCH_FN(cudnorm::rms_norm_bwd));
  m.impl("add_norm_fwd", TORCH_FN(cudnorm::add_norm_fwd));
  m.impl("add_norm_bwd", TORCH_FN(cudnorm::add_norm_bwd));
  m.impl("ada_layer_norm_fwd", TORCH_FN(cudnorm::ada_layer_norm_fwd));
  m.impl("ada_layer_norm_bwd", TORCH_FN(cudnorm::ada_layer_norm_bwd));
}

TORCH_LIBRARY_IMPL(cudnorm, AutogradCUDA, m) {
  m.impl("layer_norm_fwd", TORCH_FN(cudnorm::layer_norm_fwd_autograd));
  m.impl("rms_norm_fwd", TORCH_FN(cudnorm::rms_norm_fwd_autograd));
  m.impl("add_norm_fwd", TORCH_FN(cudnorm::add_norm_fwd_autograd));
  m.impl("ada_layer_norm_fwd", TORCH_FN(cudnorm::ada_layer_norm_fwd_autograd));
}

TORCH_LIBRARY(cudnorm_native, m) {
  m.def("add_plan(Tensor blob, int device, int slots) -> int",
        [](const at::Tensor& blob, int64_t device, int64_t slots) { return cudnorm::add_plan(blob, device, slots); });
  m.def("drop_plan(int id) -> ()", [](int64_t id) { cudnorm::drop_plan(id); });
  m.def("clear() -> ()", [] {
    cudnorm::clear_recipes();
    cudnorm::clear_decisions();
  });
  m.def("configure(bool enabled, bool policy_auto, int cudnn_min_elements, bool measured, int config) -> ()",
        [](bool enabled, bool policy_auto, int64_t min_elements, bool measured, int64_t config) {
          cudnorm::configure(enabled, policy_auto, min_elements, measured, config);
        });
  m.def("counters() -> int[]", [] { return cudnorm::counters(); });
  // cudnorm's own kernels as the native path launches them, for the dispatcher to time
  // (cudnorm._candidates); absent outputs are empty tensors
  m.def("kernel_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps, bool training, bool rms) -> (Tensor, Tensor)",
        [](const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
           double eps, bool training, bool rms) {
          auto [y, stats] = cudnorm::kernel_forward(x, weight, bias, eps, training, rms);
          return std::make_tuple(y, stats.defined() ? stats : x.new_empty({0}));
        });
  m.def("kernel_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor stats, bool rms, ScalarType? bias_dtype) -> "
        "(Tensor, Tensor, Tensor)",
        [](const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
           const at::Tensor& stats, bool rms, std::optional<at::ScalarType> bias_dtype) {
          auto [dx, dw, db] = cudnorm::kernel_backward(dy, x, weight, stats, rms, bias_dtype);
          return std::make_tuple(dx, dw.defined() ? dw : x.new_empty({0}), db.defined() ? db : x.new_empty({0}));
        });
  m.def("execute_floor_us(int id, int[] ptrs, int reps) -> float",
        [](int64_t id, c10::IntArrayRef ptrs, int64_t reps) {
          return cudnorm::execute_floor_us(id, ptrs.vec(), reps);
        });
}

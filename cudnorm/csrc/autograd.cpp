// Autograd of the forward ops in C++: a node per call saving what its backward reads, whose
// backward calls the backward op through the dispatcher (so a traced call, with fake tensors,
// traces it too). Registered for AutogradCUDA; the entry points call the same code with the
// CUDA kernel run directly. Only `y` (and `h`) are differentiable outputs: the statistics are
// saved in the node. With create_graph=True the gradients come from cudnorm's differentiable
// Python formulas (cudnorm._native), as on the Python path.
#include "native.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

namespace cudnorm {

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

bool requires_grad(const OptTensor& t) { return t.has_value() && t->defined() && t->requires_grad(); }
bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

[[noreturn]] void inference_phase(const char* name) {
  TORCH_CHECK(false, "cudnorm.", name, ": backward through an inference-phase forward ",
              "(the forward ran without grad mode, so no statistics were saved)");
}

// What an inference-phase forward saved: no statistics (an empty tensor). A traced backward's
// statistics may have symbolic sizes: they come from a training forward.
bool no_statistics(const Tensor& stats) {
  if (!stats.defined()) return true;
  return !stats.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && stats.numel() == 0;
}

// dbias in the bias' dtype (the graph writes it in the weight's)
Tensor as_dtype(const Tensor& t, std::optional<at::ScalarType> dtype) {
  if (!dtype.has_value()) return Tensor();
  return t.scalar_type() == *dtype ? t : t.to(*dtype);
}

// Whether a backward may call its CUDA kernel directly: plain tensors (a traced backward, on
// fake tensors, goes through the dispatcher to their kernels) and no dispatch mode active.
template <typename... T>
bool direct(const T&... tensors) {
  return settings().enabled && no_dispatch_modes() && (is_plain(tensors) && ...);
}

// A node whose gradients for inputs that need none are dropped (the differentiable formulas
// return placeholders for them).
struct CudnormNode : Node {
  variable_list computed(variable_list grads) {
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!should_compute_output(i)) grads[i] = Tensor();
    }
    return grads;
  }
};

struct NormBackward : CudnormNode {
  SavedVariable x, weight, stats;
  bool rms = false;
  bool kernel = false;  // the forward ran cudnorm's own kernel: its backward serves too (kernel.cpp)
  std::optional<at::ScalarType> bias_dtype;
  double eps = 0.0, offset = 0.0;

  std::string name() const override { return rms ? "CudnormRMSNormBackward" : "CudnormLayerNormBackward"; }
  void release_variables() override {
    x.reset_data();
    weight.reset_data();
    stats.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const Tensor& dy = grads[0];
    variable_list out(rms ? 2 : 3);
    if (!dy.defined()) return out;
    Tensor xs = x.unpack(), w = weight.unpack(), st = stats.unpack();
    if (no_statistics(st)) inference_phase(rms ? "rms_norm" : "layer_norm");
    OptTensor wo = w.defined() ? OptTensor(w) : std::nullopt;
    Tensor dx, dw, db;
    if (at::GradMode::is_enabled()) {  // create_graph=True: the gradients must be differentiable
      auto g = composite_py(rms ? "rms_norm_grad" : "layer_norm_grad", {dy, xs, wo}, {eps, offset});
      dx = g[0];
      dw = g[1];
      if (!rms) db = g[2];
    } else if (kernel && direct(dy, xs, wo, st)) {
      std::tie(dx, dw, db) = kernel_backward(dy, xs, wo, st, rms, bias_dtype);
    } else if (direct(dy, xs, wo, st)) {  // the CUDA kernel itself: no dispatcher hop
      std::tie(dx, dw, db) = rms ? std::tuple_cat(cudnorm::rms_norm_bwd(dy, xs, wo, st, offset), std::make_tuple(Tensor()))
                                 : cudnorm::layer_norm_bwd(dy, xs, wo, st);
    } else if (rms) {
      static auto bwd = op("cudnorm::rms_norm_bwd")
                            .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                              const Tensor&, double)>();
      std::tie(dx, dw) = bwd.call(dy, xs, wo, st, offset);
    } else {
      static auto bwd = op("cudnorm::layer_norm_bwd")
                            .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                                      const Tensor&)>();
      std::tie(dx, dw, db) = bwd.call(dy, xs, wo, st);
    }
    out[0] = dx;
    if (w.defined()) out[1] = dw;
    if (!rms) out[2] = as_dtype(db, bias_dtype);
    return computed(std::move(out));
  }
};

struct AddNormBackward : CudnormNode {
  SavedVariable h, weight, stats;
  bool rms = false;
  std::optional<at::ScalarType> bias_dtype;
  double eps = 0.0, offset = 0.0;

  std::string name() const override { return rms ? "CudnormAddRMSNormBackward" : "CudnormAddLayerNormBackward"; }
  void release_variables() override {
    h.reset_data();
    weight.reset_data();
    stats.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const Tensor &dy = grads[0], &dh = grads[1];
    variable_list out(4);
    if (!dy.defined() && !dh.defined()) return out;
    Tensor hs = h.unpack(shared_from_this()), w = weight.unpack(), st = stats.unpack();
    if (no_statistics(st)) inference_phase(rms ? "rms_norm" : "layer_norm");
    OptTensor wo = w.defined() ? OptTensor(w) : std::nullopt;
    OptTensor dyo = dy.defined() ? OptTensor(dy) : std::nullopt, dho = dh.defined() ? OptTensor(dh) : std::nullopt;
    Tensor dx, dw, db;
    if (at::GradMode::is_enabled()) {
      auto g = composite_py("add_norm_grad", {dyo, dho, hs, wo}, {eps, double(rms), offset});
      dx = g[0];
      dw = g[1];
      db = g[2];
    } else if (direct(dyo, dho, hs, wo, st)) {
      std::tie(dx, dw, db) = cudnorm::add_norm_bwd(dyo, dho, hs, wo, st, rms, offset);
    } else {
      static auto bwd = op("cudnorm::add_norm_bwd")
                            .typed<std::tuple<Tensor, Tensor, Tensor>(const OptTensor&, const OptTensor&,
                                                                      const Tensor&, const OptTensor&,
                                                                      const Tensor&, bool, double)>();
      std::tie(dx, dw, db) = bwd.call(dyo, dho, hs, wo, st, rms, offset);
    }
    out[0] = dx;
    out[1] = dx;  // input and residual get the same gradient
    if (w.defined()) out[2] = dw;
    out[3] = as_dtype(db, bias_dtype);
    return computed(std::move(out));
  }
};

// A modulated norm's node: what its backward reads (x, the scale, the forward's statistics).
struct ModulatedBackward : CudnormNode {
  SavedVariable x, scale, stats;

  void release_variables() override {
    x.reset_data();
    scale.reset_data();
    stats.reset_data();
  }
};

struct AdaBackward : ModulatedBackward {
  bool dit = false;
  at::ScalarType shift_dtype = at::kFloat;
  double eps = 0.0;

  std::string name() const override { return "CudnormAdaLayerNormBackward"; }

  variable_list apply(variable_list&& grads) override {
    const Tensor& dy = grads[0];
    variable_list out(3);
    if (!dy.defined()) return out;
    Tensor xs = x.unpack(), sc = scale.unpack(), st = stats.unpack();
    if (no_statistics(st)) inference_phase("ada_layer_norm");
    if (at::GradMode::is_enabled()) {
      auto g = composite_py("ada_layer_norm_grad", {dy, xs, sc},
                            {eps, double(dit), double(static_cast<int64_t>(shift_dtype))});
      return computed({g[0], g[1], g[2]});
    }
    if (direct(dy, xs, sc, st)) {
      auto [dx, dscale, dshift] = cudnorm::ada_layer_norm_bwd(dy, xs, sc, st, dit, shift_dtype);
      return computed({dx, dscale, dshift});
    }
    static auto bwd = op("cudnorm::ada_layer_norm_bwd")
                          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                    const Tensor&, bool, at::ScalarType)>();
    auto [dx, dscale, dshift] = bwd.call(dy, xs, sc, st, dit, shift_dtype);
    return computed({dx, dscale, dshift});
  }
};

// A norm modulated by cudnorm's kernels (kernel.cpp): per token (batch 0: every gradient per
// row, nothing summed, dshift is dy itself in the shift's dtype) or per sample (the adaptive
// RMSNorm, batch B: dscale and dshift summed over each sample's tokens).
struct ModulatedNormBackward : ModulatedBackward {
  bool rms = false, one_plus_scale = false;
  int64_t batch = 0;
  std::optional<at::ScalarType> shift_dtype;
  double eps = 0.0;

  std::string name() const override {
    if (batch > 0) return "CudnormAdaRMSNormBackward";
    return rms ? "CudnormTokenAdaRMSNormBackward" : "CudnormTokenAdaLayerNormBackward";
  }

  variable_list apply(variable_list&& grads) override {
    const Tensor& dy = grads[0];
    variable_list out(3);
    if (!dy.defined()) return out;
    Tensor xs = x.unpack(), sc = scale.unpack(), st = stats.unpack();
    if (at::GradMode::is_enabled()) {  // create_graph=True: the gradients must be differentiable
      const double shift_code = shift_dtype ? double(static_cast<int64_t>(*shift_dtype)) : -1.0;
      auto g = composite_py(batch > 0 ? "ada_rms_grad" : "token_ada_grad", {dy, xs, sc},
                            {eps, double(rms), double(one_plus_scale), shift_code});
      out[0] = g[0];
      out[1] = g[1];
      if (shift_dtype) out[2] = g[2];
    } else if (batch > 0) {
      std::tie(out[0], out[1], out[2]) = ada_rms_backward(dy, xs, sc, st, one_plus_scale, shift_dtype);
    } else {
      std::tie(out[0], out[1]) = token_backward(dy, xs, sc, st, one_plus_scale, rms);
      if (shift_dtype) out[2] = dy.scalar_type() == *shift_dtype ? dy : dy.to(*shift_dtype);
    }
    return computed(std::move(out));
  }
};

// A gated residual into an adaptive LayerNorm (gated.cpp): gradients to residual, branch, gate,
// scale and shift from dy and the stream's own gradient dh (either may be absent).
struct GatedAdaBackward : ModulatedBackward {  // x: the normalised stream h, an output of this node
  SavedVariable branch, gate;
  bool one_plus_scale = false;
  double eps = 0.0;

  std::string name() const override { return "CudnormGatedAdaLayerNormBackward"; }
  void release_variables() override {
    ModulatedBackward::release_variables();
    branch.reset_data();
    gate.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const Tensor &dy = grads[0], &dh = grads[1];
    variable_list out(5);
    if (!dy.defined() && !dh.defined()) return out;
    Tensor hs = x.unpack(shared_from_this()), br = branch.unpack(), gt = gate.unpack(), sc = scale.unpack();
    OptTensor dyo = dy.defined() ? OptTensor(dy) : std::nullopt, dho = dh.defined() ? OptTensor(dh) : std::nullopt;
    if (at::GradMode::is_enabled()) {  // create_graph=True: the gradients must be differentiable
      auto g = composite_py("gated_grad", {dyo, dho, hs, br, gt, sc}, {eps, double(one_plus_scale)});
      return computed({g[0], g[1], g[2], g[3], g[4]});
    }
    auto [dres, dbranch, sums] =
        gated_backward(dy.defined() ? dy : at::zeros_like(hs), dho, hs, br, gt, sc, stats.unpack(), one_plus_scale);
    // sums: dscale, dshift, dgate in fp32, each rounded once to its parameter's dtype (one dtype: the call's)
    Tensor rounded = sums.scalar_type() == gt.scalar_type() ? sums : sums.to(gt.scalar_type());
    return computed({dres.view(hs.sizes()), dbranch.view(hs.sizes()), rounded[2], rounded[0], rounded[1]});
  }
};

template <typename T>
std::shared_ptr<T> make_node() {
  return std::shared_ptr<T>(new T(), torch::autograd::deleteNode);
}

// ---- the forward with its node: `forward()` runs below autograd, the node is made when a
// gradient is needed

template <typename Forward>
std::tuple<Tensor, Tensor> norm_with_node(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                          double eps, bool rms, double offset, Forward forward, bool kernel = false) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || requires_grad(weight) || requires_grad(bias));
  std::tuple<Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = forward();
  }
  if (grad) {
    auto node = make_node<NormBackward>();
    node->set_next_edges(rms ? torch::autograd::collect_next_edges(x, weight)
                             : torch::autograd::collect_next_edges(x, weight, bias));
    node->x = SavedVariable(x, false);
    node->weight = SavedVariable(weight.value_or(Tensor()), false);
    node->stats = SavedVariable(std::get<1>(out), false);
    node->rms = rms;
    node->kernel = kernel;
    if (!rms && defined(bias)) node->bias_dtype = bias->scalar_type();
    node->eps = eps;
    node->offset = offset;
    torch::autograd::set_history(std::get<0>(out), node);
  }
  return out;
}

template <typename Forward>
std::tuple<Tensor, Tensor, Tensor> add_norm_with_node(const Tensor& x, const Tensor& residual,
                                                      const OptTensor& weight, const OptTensor& bias, double eps,
                                                      bool rms, double offset, Forward forward) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || residual.requires_grad() ||
                                                   requires_grad(weight) || requires_grad(bias));
  std::tuple<Tensor, Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = forward();
  }
  if (grad) {
    auto node = make_node<AddNormBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight, bias));
    torch::autograd::set_history(std::get<0>(out), node);
    torch::autograd::set_history(std::get<1>(out), node);
    node->h = SavedVariable(std::get<1>(out), true);  // an output of this node: saved without a cycle
    node->weight = SavedVariable(weight.value_or(Tensor()), false);
    node->stats = SavedVariable(std::get<2>(out), false);
    node->rms = rms;
    if (!rms && defined(bias)) node->bias_dtype = bias->scalar_type();
    node->eps = eps;
    node->offset = offset;
  }
  return out;
}

template <typename Forward>
std::tuple<Tensor, Tensor> ada_with_node(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                         bool dit, Forward forward) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || scale.requires_grad() || shift.requires_grad());
  std::tuple<Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = forward();
  }
  if (grad) {
    auto node = make_node<AdaBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, scale, shift));
    node->x = SavedVariable(x, false);
    node->scale = SavedVariable(scale, false);
    node->stats = SavedVariable(std::get<1>(out), false);
    node->dit = dit;
    node->shift_dtype = shift.scalar_type();
    node->eps = eps;
    torch::autograd::set_history(std::get<0>(out), node);
  }
  return out;
}

// statistics of a forward that saved none (inference phase): an empty tensor, as the op returns
Tensor saved_stats(const Tensor& stats, const Tensor& x, int64_t rows) {
  return stats.defined() ? stats : at::empty({rows, 0}, x.options().dtype(at::kFloat));
}

}  // namespace

// ---------------------------------------------------------------- AutogradCUDA kernels

std::tuple<Tensor, Tensor> layer_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const OptTensor& weight,
                                                   const OptTensor& bias, double eps, bool training) {
  static auto fwd = op("cudnorm::layer_norm_fwd")
                        .typed<std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const OptTensor&, double,
                                                          bool)>();
  return norm_with_node(x, weight, bias, eps, false, 0.0, [&] {
    return fwd.redispatch(ks & c10::after_autograd_keyset, x, weight, bias, eps, training);
  });
}

std::tuple<Tensor, Tensor> rms_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const OptTensor& weight,
                                                 double eps, bool training, double offset) {
  static auto fwd = op("cudnorm::rms_norm_fwd")
                        .typed<std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, double, bool, double)>();
  return norm_with_node(x, weight, std::nullopt, eps, true, offset, [&] {
    return fwd.redispatch(ks & c10::after_autograd_keyset, x, weight, eps, training, offset);
  });
}

std::tuple<Tensor, Tensor, Tensor> add_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x,
                                                         const Tensor& residual, const OptTensor& weight,
                                                         const OptTensor& bias, double eps, bool training, bool rms,
                                                         double offset) {
  static auto fwd = op("cudnorm::add_norm_fwd")
                        .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                                  const OptTensor&, double, bool, bool, double)>();
  return add_norm_with_node(x, residual, weight, rms ? OptTensor() : bias, eps, rms, offset, [&] {
    return fwd.redispatch(ks & c10::after_autograd_keyset, x, residual, weight, bias, eps, training, rms, offset);
  });
}

std::tuple<Tensor, Tensor> ada_layer_norm_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const Tensor& scale,
                                                       const Tensor& shift, double eps, bool one_plus_scale,
                                                       bool training) {
  static auto fwd = op("cudnorm::ada_layer_norm_fwd")
                        .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double, bool,
                                                          bool)>();
  return ada_with_node(x, scale, shift, eps, one_plus_scale, [&] {
    return fwd.redispatch(ks & c10::after_autograd_keyset, x, scale, shift, eps, one_plus_scale, training);
  });
}

// ---------------------------------------------------------------- the entry points' hot path

Tensor layer_norm_train(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps, bool training,
                        bool kernel) {
  auto out = norm_with_node(
      x, weight, bias, eps, false, 0.0,
      [&] {
        if (kernel) return kernel_forward(x, weight, bias, eps, training, false);
        auto [y, h, stats] = norm_forward(x, std::nullopt, weight, bias, eps, training, false, 0.0);
        return std::make_tuple(y, training ? stats : Tensor());
      },
      kernel);
  return std::get<0>(out);
}

Tensor rms_norm_train(const Tensor& x, const OptTensor& weight, double eps, bool training, double offset,
                      bool kernel) {
  // the kernel takes no weight offset: the dispatcher never gives such a call to it (entry.cpp)
  auto out = norm_with_node(
      x, weight, std::nullopt, eps, true, offset,
      [&] {
        if (kernel) return kernel_forward(x, weight, std::nullopt, eps, training, true);
        auto [y, h, stats] = norm_forward(x, std::nullopt, weight, std::nullopt, eps, training, true, offset);
        return std::make_tuple(y, training ? stats : Tensor());
      },
      kernel);
  return std::get<0>(out);
}

std::tuple<Tensor, Tensor> add_norm_train(const Tensor& x, const Tensor& residual, const OptTensor& weight,
                                          const OptTensor& bias, double eps, bool training, bool rms, double offset) {
  const OptTensor b = rms ? OptTensor() : bias;
  auto out = add_norm_with_node(x, residual, weight, b, eps, rms, offset, [&] {
    auto [y, h, stats] = norm_forward(x, residual, weight, b, eps, training, rms, offset);
    return std::make_tuple(y, h, saved_stats(stats, x, rms ? 1 : 2));
  });
  return {std::get<0>(out), std::get<1>(out)};
}

Tensor ada_layer_norm_train(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                            bool one_plus_scale, bool training) {
  auto out = ada_with_node(x, scale, shift, eps, one_plus_scale, [&] {
    auto [y, stats] = ada_forward(x, scale, shift, eps, one_plus_scale, training);
    return std::make_tuple(y, stats);
  });
  return std::get<0>(out);
}

std::tuple<Tensor, Tensor> gated_train(const Tensor& residual, const Tensor& branch, const Tensor& gate,
                                       const Tensor& scale, const Tensor& shift, double eps, bool one_plus_scale) {
  const bool grad = at::GradMode::is_enabled() && (residual.requires_grad() || branch.requires_grad() ||
                                                   gate.requires_grad() || scale.requires_grad() ||
                                                   shift.requires_grad());
  Tensor h, y, stats;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    h = at::addcmul(residual, gate.unsqueeze(1), branch);
    std::tie(y, stats) = ada_forward(h, scale, shift, eps, one_plus_scale, grad);
  }
  if (grad) {
    auto node = make_node<GatedAdaBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(residual, branch, gate, scale, shift));
    torch::autograd::set_history(y, node);
    torch::autograd::set_history(h, node);
    node->x = SavedVariable(h, true);  // an output of this node: saved without a cycle
    node->branch = SavedVariable(branch, false);
    node->gate = SavedVariable(gate, false);
    node->scale = SavedVariable(scale, false);
    node->stats = SavedVariable(stats, false);
    node->one_plus_scale = one_plus_scale;
    node->eps = eps;
  }
  return {y, h};
}

Tensor modulated_norm_train(const Tensor& x, const Tensor& scale, const OptTensor& shift, double eps,
                            bool one_plus_scale, bool rms, int64_t batch, const Recipe& recipe) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || scale.requires_grad() || requires_grad(shift));
  std::tuple<Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = modulated_forward(x, scale, shift, eps, one_plus_scale, rms, grad, batch > 0 ? x.size(0) / batch : 1, recipe);
  }
  if (grad) {
    auto node = make_node<ModulatedNormBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, scale, shift.value_or(Tensor())));
    node->x = SavedVariable(x, false);
    node->scale = SavedVariable(scale, false);
    node->stats = SavedVariable(std::get<1>(out), false);
    node->rms = rms;
    node->one_plus_scale = one_plus_scale;
    node->batch = batch;
    if (defined(shift)) node->shift_dtype = shift->scalar_type();
    node->eps = eps;
    torch::autograd::set_history(std::get<0>(out), node);
  }
  return std::get<0>(out);
}

}  // namespace cudnorm

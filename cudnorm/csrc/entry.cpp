// The public entry points on the native path: cudnorm.layer_norm, rms_norm (with or without
// a fused residual add) and ada_layer_norm hand their arguments here first. The common call
// (plain CUDA tensors, well-formed arguments) is served in C++: the kernel policy, the
// flattening to [M, N] rows, the autograd node and the launch. Anything else (CPU, DTensor,
// fake or functional tensors under torch.compile, float64, empty inputs, a malformed argument
// whose error message cudnorm's checks word) goes to the Python implementation
// (cudnorm._native), which handles every case the same way as without the native path.
#include "native.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <limits>

namespace cudnorm {

namespace {

bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }
bool requires_grad(const OptTensor& t) { return defined(t) && t->requires_grad(); }

bool supported_dtype(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat;
}

// A tensor the native path serves: plain, on a CUDA device cuDNN's norm engines support,
// non-empty, of a dtype cuDNN normalizes, with the native path enabled and no Python dispatch
// mode or functorch transform active (those see cudnorm's ops through the Python path).
bool served(const Tensor& input) {
  return settings().enabled && input.defined() && is_plain(input) && supported_dtype(input.scalar_type()) &&
         input.numel() > 0 && device_supported(input.get_device()) && no_dispatch_modes();
}

bool concrete(c10::SymIntArrayRef shape, std::vector<int64_t>& out) {
  for (const auto& size : shape) {
    auto value = size.maybe_as_int();
    if (!value.has_value()) return false;
    out.push_back(*value);
  }
  return !out.empty();
}

bool good_eps(double eps) { return std::isfinite(eps) && eps >= 0.0; }

// cudnorm._checks.norm_call's fast branch: normalized_shape the trailing dims of input, each
// weight-like tensor plain, of that shape, of input's dtype or fp32, on input's device.
bool norm_args(const Tensor& input, const std::vector<int64_t>& shape, std::initializer_list<const OptTensor*> params,
               double eps, int64_t* n) {
  const int64_t dims = static_cast<int64_t>(shape.size());
  if (dims > input.dim() || !good_eps(eps)) return false;
  int64_t count = 1;
  for (int64_t i = 0; i < dims; ++i) {
    if (input.size(input.dim() - dims + i) != shape[i]) return false;
    count *= shape[i];
  }
  for (const OptTensor* p : params) {
    if (!defined(*p)) continue;
    const Tensor& t = **p;
    if (!is_plain(t) || t.sizes() != at::IntArrayRef(shape) || t.get_device() != input.get_device() ||
        (t.scalar_type() != input.scalar_type() && t.scalar_type() != at::kFloat)) {
      return false;
    }
  }
  *n = count;
  return true;
}

bool same_as_input(const Tensor& input, const Tensor& other) {
  return is_plain(other) && other.sizes() == input.sizes() && other.scalar_type() == input.scalar_type() &&
         other.get_device() == input.get_device();
}

// cudnorm._policy.torch_serves, then cudnorm._decisions.serves, for a served call: under policy
// "auto" (or "torch") calls whose weights have the input's dtype and fewer than Config's
// threshold of elements run PyTorch's own op; under "auto" every larger call takes the
// measured decision of its signature (an RMSNorm with a weight offset is not measured: cuDNN
// adds the offset inside its graph, the other candidates do not take one); under "cudnn" cuDNN serves.
// A server a measurement forces (ServeAs) comes first.
Server serve(bool rms, bool training, const Tensor& input, int64_t n, const OptTensor& weight, const OptTensor& bias,
             bool measurable = true) {
  if (const auto server = forced_server()) return *server;
  const Settings& s = settings();
  if (!s.policy_auto) return Server::Cudnn;
  const bool same = (!defined(weight) || weight->scalar_type() == input.scalar_type()) &&
                    (!defined(bias) || bias->scalar_type() == input.scalar_type());
  if (same && input.numel() < s.cudnn_min_elements) return Server::Torch;
  return s.measured && measurable
             ? server_for(rms ? MeasuredOp::RmsNorm : MeasuredOp::LayerNorm, training, input, n, weight, bias)
             : Server::Cudnn;
}

double default_rms_eps(at::ScalarType dtype) {  // torch.finfo(dtype).eps, as torch.nn.RMSNorm
  switch (dtype) {
    case at::kHalf: return 0.0009765625;
    case at::kBFloat16: return 0.0078125;
    default: return static_cast<double>(std::numeric_limits<float>::epsilon());
  }
}

// Gemma's RMSNorm as its model code writes it (cudnorm._norm.gemma_rms_norm)
Tensor gemma_rms_norm(const Tensor& x, at::IntArrayRef shape, const OptTensor& weight, double eps, double offset) {
  Tensor y = at::rms_norm(x.to(at::kFloat), shape, std::nullopt, eps);
  Tensor scaled = defined(weight) ? y * (weight->to(at::kFloat) + offset) : y * (1.0 + offset);
  return scaled.to(x.scalar_type());
}

OptTensor flat_param(const OptTensor& p, bool flat, int64_t n) {
  return flat || !defined(p) ? p : OptTensor(p->reshape({n}));
}

std::vector<double> rms_scalars(const std::optional<double>& eps, double offset) {
  return {eps.has_value() ? 1.0 : 0.0, eps.value_or(0.0), offset};
}

// PyTorch's ops for an adaptive LayerNorm (cudnorm.ada_layer_norm._torch_ops): the LayerNorm, the
// gain, the modulation; scale/shift [B, 1.., D] or [B, D] of input's dtype
Tensor ada_torch_ops(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps, bool one_plus_scale) {
  const int64_t b = input.size(0), d = input.size(-1);
  Tensor sc = scale, sh = shift;
  if (sc.dim() == 2 && input.dim() == 3) {
    sc = sc.unsqueeze(1);
    sh = sh.unsqueeze(1);
  } else if (sc.dim() != input.dim()) {
    std::vector<int64_t> view(input.dim(), 1);
    view.front() = b;
    view.back() = d;
    sc = sc.reshape(view);
    sh = sh.reshape(view);
  }
  Tensor xhat = at::layer_norm(input, {d}, std::nullopt, std::nullopt, eps);
  Tensor gain = one_plus_scale ? sc + 1 : sc;
  if (at::GradMode::is_enabled() && (input.requires_grad() || scale.requires_grad() || shift.requires_grad())) {
    return xhat * gain + sh;
  }
  return at::addcmul(sh, xhat, gain);
}

// cudnorm._token_entry._check_call's fast branch: a modulation per token of input's shape,
// plain, on its device, of its dtype or fp32 (shift may be absent)
bool token_args(const Tensor& input, const Tensor& scale, const OptTensor& shift, double eps) {
  bool ok = served(input) && input.dim() >= 2 && good_eps(eps);
  for (const Tensor* p : {&scale, defined(shift) ? &*shift : &scale}) {
    ok = ok && p->defined() && is_plain(*p) && p->sizes() == input.sizes() && p->get_device() == input.get_device() &&
         (p->scalar_type() == input.scalar_type() || p->scalar_type() == at::kFloat);
  }
  return ok;
}

// cudnorm._token_ada.formula: the norm in input's dtype, the modulation in PyTorch's type
// promotion, the result rounded to input's dtype
Tensor token_formula(const Tensor& input, const Tensor& scale, const OptTensor& shift, double eps, bool one_plus_scale,
                     bool rms) {
  const int64_t d = input.size(-1);
  Tensor xhat = rms ? at::rms_norm(input, {d}, std::nullopt, eps)
                    : at::layer_norm(input, {d}, std::nullopt, std::nullopt, eps);
  Tensor y = xhat * (one_plus_scale ? scale + 1 : scale);
  if (defined(shift)) y = y + *shift;
  return y.scalar_type() == input.scalar_type() ? y : y.to(input.scalar_type());
}

// [M, N] rows of a per-token modulation with unit column stride: a view where its rows are
// evenly spaced (a chunk of a Linear's output), else a copy
Tensor modulation_rows(const Tensor& t, int64_t n) {
  Tensor rows = t.reshape({-1, n});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

// the kernels on the call's rows, with their autograd node; the formula where they do not
// compute it (a width or dtype they do not take)
Tensor token_kernel(const Tensor& input, const Tensor& scale, const OptTensor& shift, double eps, bool one_plus_scale,
                    bool rms, bool training) {
  const int64_t d = input.size(-1);
  const Tensor x = packed(input.reshape({-1, d}));
  const Tensor sc = modulation_rows(scale, d);
  const OptTensor sh = defined(shift) ? OptTensor(modulation_rows(*shift, d)) : std::nullopt;
  const RecipeRef recipe = modulated_recipe(x, sc, sh, one_plus_scale, rms, training);
  if (recipe->mode == Mode::Aten) return token_formula(input, scale, shift, eps, one_plus_scale, rms);
  return modulated_norm_train(x, sc, sh, eps, one_plus_scale, rms, 0, *recipe).view(input.sizes());
}

bool token_training(const Tensor& input, const Tensor& scale, const OptTensor& shift) {
  return at::GradMode::is_enabled() && (input.requires_grad() || scale.requires_grad() || requires_grad(shift));
}

// cudnorm.gated_ada_layer_norm._check_call's fast branch: [B, S, D] residual (contiguous: its
// rows are the backward recipe's), branch of its shape, gate, scale and shift [B, D] or
// [B, 1, D], all plain, of one dtype, on one device
bool gated_args(const Tensor& residual, const Tensor& branch, const Tensor& gate, const Tensor& scale,
                const Tensor& shift, double eps) {
  bool ok = served(residual) && residual.dim() == 3 && residual.is_contiguous() && good_eps(eps) &&
            same_as_input(residual, branch);
  const int64_t b = ok ? residual.size(0) : 0, d = ok ? residual.size(2) : 0;
  for (const Tensor* p : {&gate, &scale, &shift}) {
    ok = ok && p->defined() && is_plain(*p) && p->scalar_type() == residual.scalar_type() &&
         p->get_device() == residual.get_device() && p->size(0) == b && p->size(-1) == d &&
         (p->dim() == 2 || (p->dim() == 3 && p->size(1) == 1));
  }
  return ok;
}

// cudnorm._gated.formula: PyTorch's ops as the blocks write them, autograd by PyTorch
std::tuple<Tensor, Tensor> gated_formula(const Tensor& residual, const Tensor& branch, const Tensor& gate,
                                         const Tensor& scale, const Tensor& shift, double eps, bool one_plus_scale) {
  const int64_t b = residual.size(0), d = residual.size(2);
  const Tensor sc = scale.reshape({b, 1, d});
  Tensor h = residual + gate.reshape({b, 1, d}) * branch;
  Tensor xhat = at::layer_norm(h, {d}, std::nullopt, std::nullopt, eps);
  return {xhat * (one_plus_scale ? sc + 1 : sc) + shift.reshape({b, 1, d}), h};
}

}  // namespace

Tensor layer_norm_entry(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                        const OptTensor& bias, double eps) {
  std::vector<int64_t> shape;
  int64_t n = 0;
  if (!served(input) || !concrete(normalized_shape, shape) || !norm_args(input, shape, {&weight, &bias}, eps, &n)) {
    return composite_py("layer_norm", {input, weight, bias}, {eps}, normalized_shape)[0];
  }
  const bool training =
      at::GradMode::is_enabled() && (input.requires_grad() || requires_grad(weight) || requires_grad(bias));
  const Server server = serve(false, training, input, n, weight, bias);
  if (server == Server::Torch) return at::layer_norm(input, shape, weight, bias, eps);
  const bool flat = input.dim() == 2 && input.size(1) == n;
  const Tensor x = flat ? input : input.reshape({-1, n});
  const OptTensor w = flat_param(weight, flat, n), b = flat_param(bias, flat, n);
  Tensor y = layer_norm_train(x, w, b, eps, training, server == Server::Kernel);
  return flat ? y : y.view(input.sizes());
}

Tensor rms_norm_entry(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                      std::optional<double> eps, double weight_offset) {
  std::vector<int64_t> shape;
  int64_t n = 0;
  const double e = input.defined() && eps.has_value() ? *eps : (input.defined() ? default_rms_eps(input.scalar_type()) : 0.0);
  if (!served(input) || !std::isfinite(weight_offset) || !concrete(normalized_shape, shape) ||
      !norm_args(input, shape, {&weight}, e, &n)) {
    return composite_py("rms_norm", {input, weight}, rms_scalars(eps, weight_offset), normalized_shape)[0];
  }
  const bool training = at::GradMode::is_enabled() && (input.requires_grad() || requires_grad(weight));
  const Server server = serve(true, training, input, n, weight, std::nullopt, weight_offset == 0.0);
  if (server == Server::Torch) {
    return weight_offset != 0.0 ? gemma_rms_norm(input, shape, weight, e, weight_offset)
                                : at::rms_norm(input, shape, weight, e);
  }
  const bool flat = input.dim() == 2 && input.size(1) == n;
  const Tensor x = flat ? input : input.reshape({-1, n});
  const OptTensor w = flat_param(weight, flat, n);
  Tensor y = rms_norm_train(x, w, e, training, weight_offset, server == Server::Kernel);
  return flat ? y : y.view(input.sizes());
}

std::tuple<Tensor, Tensor> add_layer_norm_entry(const Tensor& input, const Tensor& residual,
                                                c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                                const OptTensor& bias, double eps) {
  std::vector<int64_t> shape;
  int64_t n = 0;
  if (!served(input) || !residual.defined() || !same_as_input(input, residual) || !concrete(normalized_shape, shape) ||
      !norm_args(input, shape, {&weight, &bias}, eps, &n)) {
    auto out = composite_py("add_layer_norm", {input, residual, weight, bias}, {eps}, normalized_shape);
    return {out[0], out[1]};
  }
  const bool training = at::GradMode::is_enabled() && (input.requires_grad() || residual.requires_grad() ||
                                                      requires_grad(weight) || requires_grad(bias));
  // the plain norm's decision: the same engines serve the fused graph (cudnorm._fused_add.call)
  switch (serve(false, training, input, n, weight, bias)) {
    case Server::Torch: {  // cudnorm._fused_add.reference: Inductor-style unfused math
      Tensor h = input + residual;
      return {at::layer_norm(h, shape, weight, bias, eps), h};
    }
    case Server::Kernel: {  // PyTorch's add, then cudnorm's kernel on h (cudnorm._fused_add.call)
      const bool flat = input.dim() == 2 && input.size(1) == n;
      Tensor h = input + residual;
      const Tensor h2 = flat ? h : h.reshape({-1, n});
      Tensor y = layer_norm_train(h2, flat_param(weight, flat, n), flat_param(bias, flat, n), eps, training, true);
      return {flat ? y : y.view(input.sizes()), h};
    }
    case Server::Cudnn: break;
  }
  const bool flat = input.dim() == 2 && input.size(1) == n;
  const Tensor x = flat ? input : input.reshape({-1, n}), r = flat ? residual : residual.reshape({-1, n});
  const OptTensor w = flat_param(weight, flat, n), b = flat_param(bias, flat, n);
  auto [y, h] = add_norm_train(x, r, w, b, eps, training, false, 0.0);
  return flat ? std::make_tuple(y, h) : std::make_tuple(y.view(input.sizes()), h.view(input.sizes()));
}

std::tuple<Tensor, Tensor> add_rms_norm_entry(const Tensor& input, const Tensor& residual,
                                              c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                              std::optional<double> eps, double weight_offset) {
  std::vector<int64_t> shape;
  int64_t n = 0;
  const double e = input.defined() && eps.has_value() ? *eps : (input.defined() ? default_rms_eps(input.scalar_type()) : 0.0);
  if (!served(input) || !residual.defined() || !same_as_input(input, residual) || !std::isfinite(weight_offset) ||
      !concrete(normalized_shape, shape) || !norm_args(input, shape, {&weight}, e, &n)) {
    auto out = composite_py("add_rms_norm", {input, residual, weight}, rms_scalars(eps, weight_offset),
                            normalized_shape);
    return {out[0], out[1]};
  }
  const bool training =
      at::GradMode::is_enabled() && (input.requires_grad() || residual.requires_grad() || requires_grad(weight));
  const Server server = serve(true, training, input, n, weight, std::nullopt, weight_offset == 0.0);
  switch (server) {
    case Server::Torch: {
      Tensor h = input + residual;
      return {weight_offset != 0.0 ? gemma_rms_norm(h, shape, weight, e, weight_offset)
                                   : at::rms_norm(h, shape, weight, e),
              h};
    }
    case Server::Kernel: {  // PyTorch's add, then cudnorm's kernel on h (never with an offset: serve())
      const bool flat = input.dim() == 2 && input.size(1) == n;
      Tensor h = input + residual;
      const Tensor h2 = flat ? h : h.reshape({-1, n});
      Tensor y = rms_norm_train(h2, flat_param(weight, flat, n), e, training, 0.0, true);
      return {flat ? y : y.view(input.sizes()), h};
    }
    case Server::Cudnn: break;
  }
  const bool flat = input.dim() == 2 && input.size(1) == n;
  const Tensor x = flat ? input : input.reshape({-1, n}), r = flat ? residual : residual.reshape({-1, n});
  const OptTensor w = flat_param(weight, flat, n);
  auto [y, h] = add_norm_train(x, r, w, std::nullopt, e, training, true, weight_offset);
  return flat ? std::make_tuple(y, h) : std::make_tuple(y.view(input.sizes()), h.view(input.sizes()));
}

Tensor ada_layer_norm_entry(const Tensor& input, const Tensor& scale, const Tensor& shift, double eps,
                            bool one_plus_scale) {
  // cudnorm.ada_layer_norm._check_call's fast branch: [B, *, D] input, scale/shift [B, 1.., D]
  // of input's dtype or fp32 on its device
  bool ok = served(input) && input.dim() >= 2 && good_eps(eps);
  const int64_t b = ok ? input.size(0) : 0, d = ok ? input.size(-1) : 0;
  for (const Tensor* p : {&scale, &shift}) {
    ok = ok && p->defined() && is_plain(*p) && p->dim() >= 2 && p->size(0) == b && p->size(-1) == d &&
         p->numel() == b * d && p->get_device() == input.get_device() &&
         (p->scalar_type() == input.scalar_type() || p->scalar_type() == at::kFloat);
  }
  if (!ok) {
    return composite_py("ada_layer_norm", {input, scale, shift}, {eps, double(one_plus_scale)})[0];
  }
  const bool same = scale.scalar_type() == input.scalar_type() && shift.scalar_type() == input.scalar_type();
  if (settings().policy_auto && same && input.numel() < settings().cudnn_min_elements) {
    return ada_torch_ops(input, scale, shift, eps, one_plus_scale);
  }
  const bool training = at::GradMode::is_enabled() &&
                        (input.requires_grad() || scale.requires_grad() || shift.requires_grad());
  // under policy "auto" a larger call takes its signature's measured decision, cuDNN's AdaLN or
  // diffusers' formula: the AdaLN runs cuDNN's norm engines, which fall off cliffs at some widths
  if (settings().measured && same && input.numel() > 0 &&
      server_for(MeasuredOp::AdaLayerNorm, training, input, d, scale, shift) == Server::Torch) {
    return ada_torch_ops(input, scale, shift, eps, one_plus_scale);
  }
  const bool flat = input.dim() == 3;
  const Tensor x = flat ? input : input.reshape({b, -1, d});
  const Tensor sc = scale.dim() == 2 ? scale : scale.reshape({b, d});
  const Tensor sh = shift.dim() == 2 ? shift : shift.reshape({b, d});
  Tensor y = ada_layer_norm_train(x, sc, sh, eps, one_plus_scale, training);
  return flat ? y : y.view(input.sizes());
}

Tensor token_ada_norm_entry(const Tensor& input, const Tensor& scale, const OptTensor& shift, double eps,
                            bool one_plus_scale, bool rms) {
  if (!token_args(input, scale, shift, eps)) {
    return composite_py("token_ada_norm", {input, scale, shift}, {eps, double(one_plus_scale), double(rms)})[0];
  }
  const bool training = token_training(input, scale, shift);
  const bool same = scale.scalar_type() == input.scalar_type() &&
                    (!defined(shift) || shift->scalar_type() == input.scalar_type());
  // cudnorm._token_entry.python_call's rules: under policy "cudnn" the kernels serve; under
  // "auto" (or "torch") small same-dtype calls run the formula, larger ones the measured decision
  const Settings& s = settings();
  Server server = Server::Kernel;
  if (s.policy_auto && same && input.numel() < s.cudnn_min_elements) {
    server = Server::Torch;
  } else if (s.policy_auto && s.measured) {
    server = server_for(rms ? MeasuredOp::TokenRmsNorm : MeasuredOp::TokenLayerNorm, training, input,
                        input.size(-1), scale, shift);
  }
  if (server == Server::Torch) return token_formula(input, scale, shift, eps, one_plus_scale, rms);
  return token_kernel(input, scale, shift, eps, one_plus_scale, rms, training);
}

std::optional<Tensor> token_ada_kernel_entry(const Tensor& input, const Tensor& scale, const OptTensor& shift,
                                             double eps, bool one_plus_scale, bool rms) {
  if (!token_args(input, scale, shift, eps)) return std::nullopt;
  return token_kernel(input, scale, shift, eps, one_plus_scale, rms, token_training(input, scale, shift));
}

std::optional<Tensor> ada_rms_kernel_entry(const Tensor& input, const Tensor& scale, const OptTensor& shift,
                                           double eps, bool one_plus_scale) {
  // cudnorm.ada_rms_norm._check_call's fast branch: [B, *, D] input, scale/shift [B, 1.., D] of
  // its dtype or fp32 on its device (shift may be absent)
  bool ok = served(input) && input.dim() >= 2 && good_eps(eps);
  const int64_t b = ok ? input.size(0) : 0, d = ok ? input.size(-1) : 0;
  for (const Tensor* p : {&scale, defined(shift) ? &*shift : &scale}) {
    ok = ok && p->defined() && is_plain(*p) && p->dim() >= 2 && p->size(0) == b && p->size(-1) == d &&
         p->numel() == b * d && p->get_device() == input.get_device() &&
         (p->scalar_type() == input.scalar_type() || p->scalar_type() == at::kFloat);
  }
  if (!ok) return std::nullopt;
  const Tensor x = packed(input.reshape({-1, d}));
  const Tensor sc = modulation_rows(scale, d);
  const OptTensor sh = defined(shift) ? OptTensor(modulation_rows(*shift, d)) : std::nullopt;
  const RecipeRef recipe = modulated_recipe(x, sc, sh, one_plus_scale, true, token_training(input, scale, shift));
  if (recipe->mode == Mode::Aten) return std::nullopt;
  return modulated_norm_train(x, sc, sh, eps, one_plus_scale, true, b, *recipe).view(input.sizes());
}

std::optional<std::tuple<Tensor, Tensor>> gated_kernel_entry(const Tensor& residual, const Tensor& branch,
                                                             const Tensor& gate, const Tensor& scale,
                                                             const Tensor& shift, double eps, bool one_plus_scale) {
  // cudnorm._gated.supports and gated_ada_layer_norm's checks: [B, S, D] residual and branch,
  // gate, scale and shift [B, 1.., D], all plain, of one dtype, on one device
  bool ok = served(residual) && residual.dim() == 3 && good_eps(eps) && same_as_input(residual, branch);
  const int64_t b = ok ? residual.size(0) : 0, d = ok ? residual.size(2) : 0;
  for (const Tensor* p : {&gate, &scale, &shift}) {
    ok = ok && p->defined() && is_plain(*p) && p->dim() >= 2 && p->size(0) == b && p->size(-1) == d &&
         p->numel() == b * d && p->get_device() == residual.get_device() &&
         p->scalar_type() == residual.scalar_type();
  }
  if (!ok) return std::nullopt;
  // [B, D] views: their gradients reach the caller's shapes through autograd's view nodes
  return gated_train(residual, branch, gate.reshape({b, d}), scale.reshape({b, d}), shift.reshape({b, d}), eps,
                     one_plus_scale);
}

std::optional<Tensor> modulated_layer_norm_entry(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                                 const OptTensor& weight, const OptTensor& bias) {
  // cudnorm._diffusers_forwards._modulated_layer_norm's per-sample affine call: x [B, S, D],
  // scale and shift [B, 1, D], an affine LayerNorm's weight and bias [D] (one may be absent),
  // all plain, of one dtype, on one device
  bool ok = served(x) && x.dim() == 3 && good_eps(eps) && (defined(weight) || defined(bias));
  const int64_t b = ok ? x.size(0) : 0, d = ok ? x.size(2) : 0;
  for (const Tensor* p : {&scale, &shift}) {
    ok = ok && p->defined() && is_plain(*p) && p->scalar_type() == x.scalar_type() &&
         p->get_device() == x.get_device() && p->dim() == 3 && p->size(0) == b && p->size(1) == 1 && p->size(2) == d;
  }
  for (const OptTensor* p : {&weight, &bias}) {
    ok = ok && (!defined(*p) || (is_plain(**p) && (*p)->scalar_type() == x.scalar_type() &&
                                 (*p)->get_device() == x.get_device() && (*p)->dim() == 1 && (*p)->size(0) == d));
  }
  if (!ok) return std::nullopt;
  // its signature's measured decision (op "modulated_layer_norm", _formula_serves): diffusers'
  // formula in PyTorch's ops, or the affine fold (fold.cpp) and one adaptive LayerNorm
  const bool training = at::GradMode::is_enabled() && (x.requires_grad() || scale.requires_grad() ||
                                                       shift.requires_grad() || requires_grad(weight) ||
                                                       requires_grad(bias));
  if (settings().measured &&
      server_for(MeasuredOp::ModulatedLayerNorm, training, x, d, scale, shift) == Server::Torch) {
    return at::layer_norm(x, {d}, weight, bias, eps) * (scale + 1) + shift;
  }
  auto [gain, folded] = affine_fold(scale, shift, weight, bias, true, x.scalar_type());
  return ada_layer_norm_entry(x, gain, folded, eps, false);
}

std::optional<std::tuple<Tensor, Tensor>> gated_entry(const Tensor& residual, const Tensor& branch,
                                                      const Tensor& gate, const Tensor& scale, const Tensor& shift,
                                                      double eps, bool one_plus_scale) {
  if (!gated_args(residual, branch, gate, scale, shift, eps)) return std::nullopt;
  // cudnorm.gated_ada_layer_norm's rules in its order: small calls under policy "auto" (every
  // call under "torch") run the formula; without grad, one multiply-add and the adaptive
  // LayerNorm's own entry; a training call the fused op if its backward kernel launches from
  // here (else Python decides, as before) and its signature's measured decision allows
  const Settings& s = settings();
  if (s.policy_auto && residual.numel() < s.cudnn_min_elements) {
    return gated_formula(residual, branch, gate, scale, shift, eps, one_plus_scale);
  }
  const bool training = at::GradMode::is_enabled() &&
                        (residual.requires_grad() || branch.requires_grad() || gate.requires_grad() ||
                         scale.requires_grad() || shift.requires_grad());
  const int64_t b = residual.size(0), d = residual.size(2);
  if (!training) {
    Tensor h = at::addcmul(residual, gate.reshape({b, 1, d}), branch);
    return std::make_tuple(ada_layer_norm_entry(h, scale, shift, eps, one_plus_scale), h);
  }
  // the recipe the backward looks up when h gets a gradient too (a residual stream does)
  const RecipeRef backward =
      recipe_for(Kind::GatedBackward, residual.view({-1, d}), {b, 1, one_plus_scale, dtype_code(scale)}, {});
  if (backward->mode != Mode::Kernel) return std::nullopt;
  if (s.measured && server_for(MeasuredOp::GatedAdaLayerNorm, true, residual, d, scale, shift) == Server::Torch) {
    return gated_formula(residual, branch, gate, scale, shift, eps, one_plus_scale);
  }
  return gated_train(residual, branch, gate.reshape({b, d}), scale.reshape({b, d}), shift.reshape({b, d}), eps,
                     one_plus_scale);
}

}  // namespace cudnorm

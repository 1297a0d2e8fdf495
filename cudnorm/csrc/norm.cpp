// LayerNorm and RMSNorm on cuDNN plans: the CUDA kernels of cudnorm::layer_norm_fwd/_bwd,
// rms_norm_fwd/_bwd and add_norm_fwd/_bwd (the fused residual add). Same buffers and
// layouts as the Python path (cudnorm._norm, cudnorm._fused_add): x is [M, N] rows,
// LayerNorm's statistics fp32 [2, ceil4(M)] (mean in row 0, rstd in row 1), RMSNorm's rstd [M]
// ([1, ceil4(M)] with the fused add), weights [N] fp32 or x's dtype.
#include "native.h"

#include <c10/cuda/CUDAGuard.h>

namespace cudnorm {

namespace {

const auto kF32 = at::kFloat;

// (scale, shift) as a forward graph reads them (cudnorm._dispatch.forward_params): in
// `dtype`, absent ones replaced by cached ones / zeros, others rounded by one kernel into a
// fresh pair of 16-byte aligned rows.
std::pair<Tensor, Tensor> forward_params(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                         bool has_bias, at::ScalarType dtype) {
  const int64_t n = x.size(1);
  const bool has_weight = weight.has_value() && weight->defined();
  has_bias = has_bias && bias.has_value() && bias->defined();
  const bool round_weight = has_weight && weight->scalar_type() != dtype;
  const bool round_bias = has_bias && bias->scalar_type() != dtype;
  Tensor scale = has_weight ? *weight : Tensor();
  Tensor shift = has_bias ? *bias : Tensor();
  if (round_weight || round_bias) {
    const int64_t per16 = 16 / static_cast<int64_t>(c10::elementSize(dtype));
    Tensor pair = at::empty({2, (n + per16 - 1) / per16 * per16}, x.options().dtype(dtype));
    Tensor scale_row = pair[0].narrow(0, 0, n), shift_row = pair[1].narrow(0, 0, n);
    if (round_weight && round_bias) {
      at::_foreach_copy_({scale_row, shift_row}, {scale, shift});
      scale = scale_row;
      shift = shift_row;
    } else if (round_weight) {
      scale = scale_row.copy_(scale);
    } else {
      shift = shift_row.copy_(shift);
    }
  }
  if (!scale.defined()) scale = constant(1.0, n, dtype, x.device());
  if (!shift.defined()) shift = constant(0.0, n, dtype, x.device());
  return {scale, shift};
}

Slot fixed(const void* address) { return Slot{reinterpret_cast<uintptr_t>(address), 0, Slot::Fixed, {}}; }
Slot rows(const Tensor& t, int64_t row_bytes) { return Slot{reinterpret_cast<uintptr_t>(t.data_ptr()), row_bytes, Slot::Rows, {}}; }
// Row k of fp32 statistics (LayerNorm's [2, ceil4(M)], RMSNorm's [M] or [1, ceil4(M)]): its
// address, and the [M] view only for chunk launches (they copy into it): one launch needs the
// address alone, and a select and a narrow per row are host time spent on every call.
Slot stat(const Tensor& stats, int64_t k, int64_t m, const Recipe& recipe) {
  const int64_t row_stride = stats.dim() == 1 ? 0 : stats.stride(0);
  const uintptr_t base = reinterpret_cast<uintptr_t>(stats.data_ptr()) + k * row_stride * 4;
  Tensor view;
  if (recipe.mode == Mode::Chunked) view = stats.dim() == 1 ? stats : stats[k].narrow(0, 0, m);
  return Slot{base, 4, Slot::Stats, view};
}

void run(const Recipe& recipe, const std::vector<Slot>& slots, int64_t cols) {
  if (recipe.mode == Mode::Chunked) {
    launch_chunked(recipe, slots, cols);
  } else {
    launch_single(recipe, slots);
  }
}

// PyTorch's fused kernels (cudnorm._norm._native_layer_norm / _native_rms_norm): wide rows,
// row counts no graph serves, declined graphs.
std::pair<Tensor, Tensor> aten_forward(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                       bool training, bool rms) {
  const int64_t m = x.size(0);
  if (rms) {
    auto [y, rstd] = at::_fused_rms_norm(x, {x.size(1)}, scale, eps);
    return {y, training ? rstd.view({-1}).to(kF32) : Tensor()};
  }
  auto [y, mean, rstd] = at::native_layer_norm(x, {x.size(1)}, scale, shift, eps);
  if (!training) return {y, Tensor()};
  Tensor stats = stats_buffer(m, 2, x.device());
  stats[0].narrow(0, 0, m).copy_(mean.view({-1}));
  stats[1].narrow(0, 0, m).copy_(rstd.view({-1}));
  return {y, stats};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& x_in, const OptTensor& residual, const OptTensor& weight,
                                           const OptTensor& bias, double eps, bool training, bool rms,
                                           double offset) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const bool add = residual.has_value() && residual->defined();
  auto python = [&] {
    auto out = kernel_py("norm_fwd", {x_in, residual, weight, bias},
                         {eps, double(training), double(rms), offset});
    return std::make_tuple(out[0], add ? out[1] : Tensor(), training ? out[2] : Tensor());
  };
  if (!settings().enabled || x_in.numel() == 0) return python();  // empty inputs: PyTorch's path
  Tensor x = cudnn_rows(x_in);
  RecipeRef recipe = recipe_for(Kind::NormForward, x, {rms, training, add, dtype_code(weight), dtype_code(bias)},
                                {offset});
  if (recipe->mode == Mode::Python) return python();
  auto [scale, shift] = forward_params(x, weight, bias, !rms, recipe->param_dtype);
  if (recipe->mode == Mode::Aten) {
    Tensor h = add ? at::add(x, *residual) : Tensor();
    auto [y, stats] = aten_forward(add ? h : x, scale, shift, eps, training, rms);
    return {y, h, stats};
  }
  const int64_t m = x.size(0), n = x.size(1), row_bytes = n * x.element_size();
  Tensor input = x, h, residual_rows;
  if (add && recipe->fused_add) {
    residual_rows = packed(residual->view({m, n}));
    h = at::empty({m, n}, x.options());
  } else if (add) {
    h = at::add(x, *residual);  // wide rows: PyTorch's add, then the plain graph on h
    input = h;
  }
  Tensor y = at::empty({m, n}, x.options());
  Tensor stats;
  if (training) stats = rms && !add ? at::empty({m}, x.options().dtype(kF32)) : stats_buffer(m, rms ? 1 : 2, x.device());
  // host scalars read by the execute below (pass-by-value inputs of the graph)
  const float eps_value = static_cast<float>(eps), offset_value = static_cast<float>(offset);
  std::vector<Slot> slots{rows(input, input.stride(0) * input.element_size()), fixed(scale.data_ptr())};
  if (!rms) slots.push_back(fixed(shift.data_ptr()));
  slots.push_back(fixed(&eps_value));
  slots.push_back(rows(y, row_bytes));
  if (training) {
    slots.push_back(stat(stats, 0, m, *recipe));
    if (!rms) slots.push_back(stat(stats, 1, m, *recipe));
  }
  if (offset != 0.0) slots.push_back(fixed(&offset_value));
  if (add && recipe->fused_add) {
    slots.push_back(rows(residual_rows, row_bytes));
    slots.push_back(rows(h, row_bytes));
  }
  run(*recipe, slots, n);
  return {y, h, stats};
}

namespace {

// (dx, dweight, dbias) of a backward on [M, N]; dbias undefined for RMSNorm. `stats`: LayerNorm's
// [2, ceil4(M)], RMSNorm's rstd [M].
std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& dy, const Tensor& x_in, const OptTensor& weight,
                                            const Tensor& stats, bool rms, double offset) {
  c10::cuda::CUDAGuard guard(x_in.device());
  auto python = [&] {
    auto out = kernel_py("norm_bwd", {dy, x_in, weight, stats}, {double(rms), offset});
    return std::make_tuple(out[0], out[1], rms ? Tensor() : out[2]);
  };
  if (!settings().enabled || x_in.numel() == 0) return python();
  Tensor x = cudnn_rows(x_in);
  RecipeRef recipe = recipe_for(Kind::NormBackward, x, {rms, dtype_code(weight)}, {offset});
  if (recipe->mode == Mode::Python) return python();
  const int64_t m = x.size(0), n = x.size(1), row_bytes = n * x.element_size();
  const bool has_weight = weight.has_value() && weight->defined();
  const auto wdtype = has_weight ? weight->scalar_type() : kF32;
  Tensor scale = has_weight ? *weight : constant(1.0, n, kF32, x.device());
  if (recipe->mode == Mode::Chunked && scale.scalar_type() != kF32) {
    scale = scale.to(kF32);  // chunk graphs read an fp32 scale and write fp32 partial dW/dB
  }
  Tensor dy_rows = packed(dy);
  Tensor dx = at::empty({m, n}, x.options());
  Tensor dw = at::empty({n}, x.options().dtype(wdtype));
  Tensor db = rms ? Tensor() : at::empty({n}, x.options().dtype(wdtype));
  const float offset_value = static_cast<float>(offset);
  std::vector<Slot> slots{rows(x, x.stride(0) * x.element_size()), fixed(scale.data_ptr())};
  slots.push_back(stat(stats, 0, m, *recipe));
  if (!rms) slots.push_back(stat(stats, 1, m, *recipe));
  slots.push_back(Slot{reinterpret_cast<uintptr_t>(dy_rows.data_ptr()), row_bytes, Slot::Dy, dy_rows});
  slots.push_back(rows(dx, row_bytes));
  slots.push_back(Slot{reinterpret_cast<uintptr_t>(dw.data_ptr()), 0, Slot::Sum, dw});
  if (!rms) slots.push_back(Slot{reinterpret_cast<uintptr_t>(db.data_ptr()), 0, Slot::Sum, db});
  if (offset != 0.0) slots.push_back(fixed(&offset_value));
  run(*recipe, slots, n);
  return {dx, dw, db};
}

Tensor no_stats(const Tensor& x, std::initializer_list<int64_t> shape) {
  return at::empty(shape, x.options().dtype(kF32));
}

}  // namespace

std::tuple<Tensor, Tensor> layer_norm_fwd(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                          double eps, bool training) {
  auto [y, h, stats] = norm_forward(x, std::nullopt, weight, bias, eps, training, false, 0.0);
  return {y, training ? stats : no_stats(x, {2, 0})};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                                  const Tensor& stats) {
  return backward(dy, x, weight, stats, false, 0.0);
}

std::tuple<Tensor, Tensor> rms_norm_fwd(const Tensor& x, const OptTensor& weight, double eps, bool training,
                                        double offset) {
  auto [y, h, stats] = norm_forward(x, std::nullopt, weight, std::nullopt, eps, training, true, offset);
  return {y, training ? stats : no_stats(x, {0})};
}

std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                        const Tensor& rstd, double offset) {
  auto [dx, dw, db] = backward(dy, x, weight, rstd, true, offset);
  return {dx, dw};
}

std::tuple<Tensor, Tensor, Tensor> add_norm_fwd(const Tensor& x, const Tensor& residual, const OptTensor& weight,
                                                const OptTensor& bias, double eps, bool training, bool rms,
                                                double offset) {
  auto [y, h, stats] = norm_forward(x, residual, weight, rms ? OptTensor() : bias, eps, training, rms, offset);
  return {y, h, training ? stats : no_stats(x, {rms ? 1 : 2, 0})};
}

std::tuple<Tensor, Tensor, Tensor> add_norm_bwd(const OptTensor& dy, const OptTensor& dh, const Tensor& h,
                                                const OptTensor& weight, const Tensor& stats, bool rms,
                                                double offset) {
  // cudnorm._fused_add.backward: the plain backward on h, then dh added (cuDNN declines an add
  // after its norm backward)
  const int64_t n = h.size(1);
  const auto wdtype = weight.has_value() && weight->defined() ? weight->scalar_type() : kF32;
  if (!dy.has_value() || !dy->defined()) {
    Tensor zeros = at::zeros({n}, h.options().dtype(wdtype));
    return {dh->clone(), zeros, zeros.clone()};
  }
  auto [dx, dw, db] = backward(*dy, h, weight, rms ? stats[0].narrow(0, 0, h.size(0)) : stats, rms, offset);
  if (!db.defined()) db = at::zeros_like(dw);
  if (dh.has_value() && dh->defined()) dx.add_(*dh);
  return {dx, dw, db};
}

}  // namespace cudnorm

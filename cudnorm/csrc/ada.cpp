// Adaptive LayerNorm on cuDNN plans: the CUDA kernels of cudnorm::ada_layer_norm_fwd/_bwd.
// x is [B, S, D], scale/shift [B, D]; statistics fp32 [2, ceil4(B*S)] as in
// cudnorm.ada_layer_norm. The strategy (cuDNN's AdaLN graph, or the plain LayerNorm graph
// once per sample) is Python's choice (cudnorm._ada_strategies), carried by the recipe.
#include "native.h"

#include <c10/cuda/CUDAGuard.h>

namespace cudnorm {

namespace {

const auto kF32 = at::kFloat;

// The per-sample multiplier [B, D] of `dtype`, packed: 1 + scale (DiT) added in fp32 and
// rounded once, or scale itself (cudnorm._ada_strategies.make_gain).
Tensor make_gain(const Tensor& scale, bool dit, at::ScalarType dtype) {
  if (!dit) return packed(scale.scalar_type() == dtype ? scale : scale.to(dtype));
  if (scale.scalar_type() == dtype) return packed(at::add(scale, 1.0));
  Tensor out = at::empty(scale.sizes(), scale.options().dtype(dtype));
  return at::add_out(out, scale, constant(1.0, scale.size(-1), kF32, scale.device()));
}

// (gain, shift) as the forward graph reads them (cudnorm._ada_strategies.modulation): DiT's
// scale and shift are chunks of one Linear output, so both need a kernel; one _foreach_add
// makes both (adding 0 copies shift exactly).
std::pair<Tensor, Tensor> modulation(const Tensor& scale, const Tensor& shift, bool dit, at::ScalarType dtype) {
  if (dit && scale.scalar_type() == dtype && shift.scalar_type() == dtype && !is_packed(shift)) {
    auto out = at::_foreach_add({scale, shift}, at::ArrayRef<at::Scalar>({1.0, 0.0}));
    return {packed(out[0]), packed(out[1])};
  }
  return {make_gain(scale, dit, dtype), packed(shift.scalar_type() == dtype ? shift : shift.to(dtype))};
}

Slot at_step(const void* address, int64_t step) {
  return Slot{reinterpret_cast<uintptr_t>(address), step, Slot::Rows, {}};
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The fused backward (cudnorm._ada_kernel): one kernel writes dx and each program's partial
// sums [2, B, chunks, D] (fp32), one sum gives dscale/dshift. Undefined tensors when the call
// is not what the kernel was compiled for (cudnorm._ada_kernel.native_launch): a pointer not
// 16-byte aligned, a scale row stride not a multiple of 16, statistics rows not ceil4(B*S)
// apart; the caller then takes Python's launch, which compiles for the call as it is.
std::tuple<Tensor, Tensor, Tensor> fused_backward(const Recipe& recipe, const Tensor& dy2, const Tensor& x2, int64_t b,
                                                  const Tensor& scale_in, const Tensor& stats,
                                                  at::ScalarType shift_dtype) {
  const int64_t rows = x2.size(0), d = x2.size(1), s = rows / b, chunks = recipe.kernel.chunks;
  Tensor scale = scale_in.stride(-1) == 1 ? scale_in : scale_in.contiguous();
  const int64_t scale_stride = scale.size(0) > 1 ? scale.stride(0) : 16;  // one row: its stride is never read
  if (!(aligned16(x2) && aligned16(dy2) && aligned16(scale) && aligned16(stats)) || scale_stride % 16 != 0 ||
      stats.stride(0) != (rows + 3) / 4 * 4) {
    return {};
  }
  Tensor dx = at::empty({rows, d}, x2.options());
  Tensor partial = at::empty({2, b, chunks, d}, x2.options().dtype(kF32));
  // the kernel's parameters: x, dy, scale, stats, dx, partial; seq, cols, x / scale / stats
  // row strides, chunks, batch
  launch_kernel(recipe.kernel, b * chunks,
                {x2.data_ptr(), dy2.data_ptr(), scale.data_ptr(), stats.data_ptr(), dx.data_ptr(), partial.data_ptr()},
                {static_cast<int32_t>(s), static_cast<int32_t>(d), static_cast<int32_t>(x2.stride(0)),
                 static_cast<int32_t>(scale_stride), static_cast<int32_t>(stats.stride(0)),
                 static_cast<int32_t>(chunks), static_cast<int32_t>(b)});
  Tensor sums = chunks == 1 ? partial.select(2, 0) : partial.sum(2);
  const auto scale_dtype = scale_in.scalar_type();
  if (scale_dtype == shift_dtype) {
    if (shift_dtype != kF32) sums = sums.to(shift_dtype);  // one cast for both
    return {dx.view({b, s, d}), sums[0], sums[1]};
  }
  return {dx.view({b, s, d}), sums[0].to(scale_dtype), sums[1].to(shift_dtype)};
}

}  // namespace

std::tuple<Tensor, Tensor> ada_forward(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                       bool one_plus_scale, bool training) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t b = x.size(0), s = x.size(1), d = x.size(2);
  auto python = [&] {
    auto out = kernel_py("ada_fwd", {x, scale, shift}, {eps, double(one_plus_scale), double(training)});
    return std::make_tuple(out[0], training ? out[1] : Tensor());
  };
  if (!settings().enabled || x.numel() == 0) return python();  // empty inputs: PyTorch's path
  Tensor x2 = cudnn_rows(x.reshape({b * s, d}));
  RecipeRef recipe = recipe_for(Kind::AdaForward, x2,
                                {training, b, dtype_code(scale), dtype_code(shift), one_plus_scale}, {});
  if (recipe->mode == Mode::Python) return python();
  auto [gain, shift_rows] = modulation(scale, shift, one_plus_scale, recipe->param_dtype);
  Tensor y = at::empty({b, s, d}, x.options());
  Tensor stats = training ? stats_buffer(b * s, 2, x.device()) : Tensor();
  const float eps_value = static_cast<float>(eps);
  const int64_t xsize = x2.element_size(), psize = c10::elementSize(recipe->param_dtype);
  const bool per_sample = recipe->mode == Mode::PerSample;
  // per sample: x, weight gain[b], bias shift[b], eps, y, and when training mean, rstd
  std::vector<Slot> slots{at_step(x2.data_ptr(), per_sample ? s * x2.stride(0) * xsize : 0),
                          at_step(gain.data_ptr(), per_sample ? d * psize : 0),
                          at_step(shift_rows.data_ptr(), per_sample ? d * psize : 0), at_step(&eps_value, 0),
                          at_step(y.data_ptr(), per_sample ? s * d * xsize : 0)};
  if (training) {
    auto* mean = static_cast<char*>(stats.data_ptr());
    slots.push_back(at_step(mean, per_sample ? 4 * s : 0));
    slots.push_back(at_step(mean + 4 * stats.size(1), per_sample ? 4 * s : 0));
  }
  if (per_sample) {
    launch_per_sample(*recipe, slots, b);
  } else {
    launch_single(*recipe, slots);
  }
  return {y, stats};
}

std::tuple<Tensor, Tensor> ada_layer_norm_fwd(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps,
                                              bool one_plus_scale, bool training) {
  auto [y, stats] = ada_forward(x, scale, shift, eps, one_plus_scale, training);
  return {y, training ? stats : at::empty({2, 0}, x.options().dtype(kF32))};
}

std::tuple<Tensor, Tensor, Tensor> ada_layer_norm_bwd(const Tensor& dy, const Tensor& x, const Tensor& scale,
                                                      const Tensor& stats_in, bool one_plus_scale,
                                                      at::ScalarType shift_dtype) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t b = x.size(0), s = x.size(1), d = x.size(2), rows = b * s;
  auto python = [&] {
    auto out = kernel_py("ada_bwd", {dy, x, scale, stats_in},
                         {double(one_plus_scale), double(static_cast<int64_t>(shift_dtype))});
    return std::make_tuple(out[0], out[1], out[2]);
  };
  if (!settings().enabled || x.numel() == 0) return python();  // empty inputs: PyTorch's path
  Tensor x2 = cudnn_rows(x.reshape({rows, d}));
  RecipeRef recipe = recipe_for(Kind::AdaBackward, x2, {b, dtype_code(scale), one_plus_scale}, {});
  if (recipe->mode == Mode::Python) return python();
  Tensor dy2 = packed(dy.reshape({rows, d}));
  if (recipe->mode == Mode::Kernel) {
    auto out = fused_backward(*recipe, dy2, x2, b, scale, stats_in, shift_dtype);
    if (std::get<0>(out).defined()) return out;
    return python();  // an unaligned argument: the compiled kernel assumes 16-byte aligned pointers
  }
  Tensor gain = make_gain(scale, one_plus_scale, scale.scalar_type());
  Tensor dx = at::empty({rows, d}, x.options());
  Tensor dscale = at::empty({b, d}, scale.options());
  Tensor dshift = at::empty({b, d}, scale.options());
  const bool per_sample = recipe->mode == Mode::PerSample;
  Tensor stats = stats_in;
  if (per_sample && s % 4 != 0) {  // a sample's statistics must start 16-byte aligned: padded rows
    Tensor padded = at::empty({2, b, (s + 3) / 4 * 4}, stats.options());
    padded.narrow(2, 0, s).copy_(stats.narrow(1, 0, rows).view({2, b, s}));
    stats = padded.view({2, -1});
  }
  const int64_t xsize = x2.element_size(), psize = scale.element_size();
  const int64_t stat_step = per_sample ? 4 * (stats.size(1) / b) : 0;
  auto* mean = static_cast<char*>(stats.data_ptr());
  // x, gain, mean, rstd, dy, dx, dscale, dshift (variant-pack order)
  std::vector<Slot> slots{at_step(x2.data_ptr(), per_sample ? s * x2.stride(0) * xsize : 0),
                          at_step(gain.data_ptr(), per_sample ? d * psize : 0), at_step(mean, stat_step),
                          at_step(mean + 4 * stats.size(1), stat_step),
                          at_step(dy2.data_ptr(), per_sample ? s * d * xsize : 0),
                          at_step(dx.data_ptr(), per_sample ? s * d * xsize : 0),
                          at_step(dscale.data_ptr(), per_sample ? d * psize : 0),
                          at_step(dshift.data_ptr(), per_sample ? d * psize : 0)};
  if (per_sample) {
    launch_per_sample(*recipe, slots, b);
  } else {
    launch_single(*recipe, slots);
  }
  if (dshift.scalar_type() != shift_dtype) dshift = dshift.to(shift_dtype);
  return {dx.view({b, s, d}), dscale, dshift};
}

}  // namespace cudnorm

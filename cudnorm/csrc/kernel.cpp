// cudnorm's own LayerNorm / RMSNorm kernels (cudnorm._norm_kernel), launched from C++: what
// serves a call signature the measuring dispatcher gave to "kernel" (decisions.cpp); and the
// same forward modulated per token (cudnorm._token_ada) or per sample (the adaptive RMSNorm,
// cudnorm._ada_rms) with their backward kernels.
//
// Python compiles the Triton kernel for a call signature (cudnorm._norm_kernel.native_launch,
// through the recipe of Kind::KernelForward / KernelBackward) and C++ launches it through the
// CUDA driver: launched from Python, a training call paid 0.3-0.5 ms more host time, which
// decided host-bound steps against the kernel. Same buffers as the cuDNN path (norm.cpp):
// LayerNorm's statistics fp32 [2, ceil4(M)] (mean, rstd), RMSNorm's rstd [M], so either
// backward reads either forward's statistics. Where the compiled kernel cannot take a call
// (Mode::Python: Python's launch compiles for it) Python launches the same kernel.
#include "native.h"

#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <limits>

namespace cudnorm {

namespace {

const auto kF32 = at::kFloat;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }

int32_t float_bits(double value) {
  const float f = static_cast<float>(value);
  int32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

bool fits_int32(int64_t v) { return v < std::numeric_limits<int32_t>::max(); }

// A forward's statistics (training: LayerNorm fp32 [2, ceil4(M)] mean and rstd, RMSNorm [M]
// rstd; not training: none, y's pointer standing in, unread) and where the kernel writes them
std::tuple<Tensor, const void*, const void*> forward_stats(const Tensor& x, const Tensor& y, bool rms, bool training) {
  if (!training) return {Tensor(), y.data_ptr(), y.data_ptr()};
  const int64_t m = x.size(0);
  Tensor stats = rms ? at::empty({m}, x.options().dtype(kF32)) : stats_buffer(m, 2, x.device());
  const char* mean = static_cast<const char*>(stats.data_ptr());
  return {stats, mean, rms ? mean : mean + 4 * stats.stride(0)};
}

}  // namespace

std::tuple<Tensor, Tensor> kernel_forward(const Tensor& x_in, const OptTensor& weight, const OptTensor& bias,
                                          double eps, bool training, bool rms) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const OptTensor b = rms ? OptTensor() : bias;
  auto python = [&] {
    auto out = kernel_py("kernel_fwd", {x_in, weight, b}, {eps, double(training), double(rms)});
    return std::make_tuple(out[0], training ? out[1] : Tensor());
  };
  if (!settings().enabled || x_in.numel() == 0) return python();
  const Tensor x = packed(x_in);  // the kernel reads contiguous rows from a 16-byte aligned start
  RecipeRef recipe = recipe_for(Kind::KernelForward, x, {rms, training, dtype_code(weight), dtype_code(b)}, {});
  const int64_t m = x.size(0);
  if (recipe->mode != Mode::Kernel || !fits_int32(m)) return python();
  const Tensor w = defined(weight) ? packed(*weight) : x;  // an absent parameter: x stands in, unread
  const Tensor bb = defined(b) ? packed(*b) : x;
  Tensor y = at::empty_like(x);
  auto [stats, mean, rstd] = forward_stats(x, y, rms, training);
  const KernelLaunch& k = recipe->kernel;
  // x, weight, bias, y, mean, rstd; rows, tiles, eps, seq (1: not modulated)
  launch_kernel(k, k.programs, {x.data_ptr(), w.data_ptr(), bb.data_ptr(), y.data_ptr(), mean, rstd},
                {static_cast<int32_t>(m), static_cast<int32_t>(k.tiles), float_bits(eps), 1});
  return {y, stats};
}

std::tuple<Tensor, Tensor, Tensor> kernel_backward(const Tensor& dy_in, const Tensor& x_in, const OptTensor& weight,
                                                   const Tensor& stats, bool rms,
                                                   std::optional<at::ScalarType> bias_dtype) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const bool has_w = defined(weight), has_bias = bias_dtype.has_value();
  auto python = [&] {
    auto out = kernel_py("kernel_bwd", {dy_in, x_in, weight, stats},
                         {double(rms), has_bias ? double(static_cast<int64_t>(*bias_dtype)) : -1.0});
    return std::make_tuple(out[0], has_w ? out[1] : Tensor(), has_bias ? out[2] : Tensor());
  };
  if (!settings().enabled || x_in.numel() == 0) return python();
  const Tensor x = packed(x_in.reshape({-1, x_in.size(-1)}));
  const int64_t m = x.size(0), n = x.size(1);
  const char* mean = static_cast<const char*>(stats.data_ptr());
  const char* rstd = rms ? mean : mean + 4 * stats.stride(0);
  // statistics made by Python's launch ([2, M] rows) may start a row unaligned
  if (!aligned16(mean) || !aligned16(rstd) || !fits_int32(m)) return python();
  // the recipe's weight and bias codes: absent (-1), or the parameter's dtype (the finishing
  // sum writes each gradient in it)
  const int64_t bias_code = has_bias ? static_cast<int64_t>(*bias_dtype) : -1;
  RecipeRef recipe = recipe_for(Kind::KernelBackward, x, {rms, dtype_code(weight), bias_code}, {});
  if (recipe->mode != Mode::Kernel) return python();
  const KernelLaunch& k = recipe->kernel;
  const Tensor dy = packed(dy_in.reshape({m, n}));
  const Tensor w = has_w ? packed(*weight) : x;
  Tensor dx = at::empty_like(x);
  // one partial column per program for each of dweight and dbias ([N, programs], the layout
  // the finishing kernel reads), the second starting aligned
  const int64_t sums = int64_t(has_w) + int64_t(has_bias), span = (k.programs * n + 3) / 4 * 4;
  Tensor partial = at::empty({std::max<int64_t>(sums, 1), span}, x.options().dtype(kF32));
  const char* dw_partial = static_cast<const char*>(partial.data_ptr());
  const char* db_partial = dw_partial + (sums == 2 ? 4 * span : 0);
  // x, dy, weight, mean, rstd, dx, dweight partial, dbias partial; rows, tiles
  launch_kernel(k, k.programs, {x.data_ptr(), dy.data_ptr(), w.data_ptr(), mean, rstd, dx.data_ptr(), dw_partial,
                                db_partial},
                {static_cast<int32_t>(m), static_cast<int32_t>(k.tiles)});
  Tensor dw, db;
  if (sums > 0) {
    // the finishing kernel sums the [N, programs] partials over programs in a fixed order
    // (deterministic) and writes each gradient once, in its parameter's dtype
    const KernelLaunch& f = recipe->finish;
    TORCH_CHECK(f.function != 0, "cudnorm: a kernel backward recipe without its finishing sum");
    if (has_w) dw = at::empty({n}, x.options().dtype(weight->scalar_type()));
    if (has_bias) db = at::empty({n}, x.options().dtype(*bias_dtype));
    const void* absent = partial.data_ptr();  // the pointer of a gradient not computed: never written
    // dweight partial, dbias partial, dweight, dbias; programs
    launch_kernel(f, f.programs, {dw_partial, db_partial, has_w ? dw.data_ptr() : absent,
                                  has_bias ? db.data_ptr() : absent},
                  {static_cast<int32_t>(k.programs)});
  }
  return {dx.view(x_in.sizes()), dw, db};
}

// ---------------------------------------------------------------- modulated per token or per sample

int64_t modulation_stride(const Tensor& rows) { return rows.size(0) == 1 ? rows.size(1) : rows.stride(0); }

RecipeRef modulated_recipe(const Tensor& x, const Tensor& scale, const OptTensor& shift, bool one_plus_scale, bool rms,
                           bool training) {
  // the row strides are compiled in (a model has one or two: its Linear's output width); the
  // rows a modulation row serves (seq) are not
  return recipe_for(Kind::ModulatedForward, x,
                    {rms, training, one_plus_scale, dtype_code(scale), dtype_code(shift), modulation_stride(scale),
                     defined(shift) ? modulation_stride(*shift) : x.size(1)},
                    {});
}

std::tuple<Tensor, Tensor> modulated_forward(const Tensor& x, const Tensor& scale, const OptTensor& shift, double eps,
                                             bool one_plus_scale, bool rms, bool training, int64_t seq,
                                             const Recipe& recipe) {
  c10::cuda::CUDAGuard guard(x.device());
  auto python = [&] {
    auto out = kernel_py("mod_fwd", {x, scale, shift},
                         {eps, double(one_plus_scale), double(rms), double(training), double(seq)});
    return std::make_tuple(out[0], training ? out[1] : Tensor());
  };
  const int64_t m = x.size(0);
  // the kernel is compiled for 16-byte aligned pointers: a modulation starting elsewhere (a
  // chunk of an odd width) takes Python's launch, which compiles for it
  if (!settings().enabled || !is_packed(x) || !aligned16(scale.data_ptr()) ||
      (defined(shift) && !aligned16(shift->data_ptr())) || !fits_int32(m)) {
    return python();
  }
  if (recipe.mode != Mode::Kernel) return python();
  Tensor y = at::empty_like(x);
  auto [stats, mean, rstd] = forward_stats(x, y, rms, training);
  const KernelLaunch& k = recipe.kernel;
  // x, scale, shift, y, mean, rstd; rows, tiles, eps, seq (row r reads modulation row r / seq)
  launch_kernel(k, k.programs,
                {x.data_ptr(), scale.data_ptr(), defined(shift) ? shift->data_ptr() : x.data_ptr(), y.data_ptr(),
                 mean, rstd},
                {static_cast<int32_t>(m), static_cast<int32_t>(k.tiles), float_bits(eps), static_cast<int32_t>(seq)});
  return {y, stats};
}

std::tuple<Tensor, Tensor> token_backward(const Tensor& dy_in, const Tensor& x, const Tensor& scale,
                                          const Tensor& stats, bool one_plus_scale, bool rms) {
  c10::cuda::CUDAGuard guard(x.device());
  auto python = [&] {
    auto out = kernel_py("token_bwd", {dy_in, x, scale, stats}, {double(one_plus_scale), double(rms)});
    return std::make_tuple(out[0], out[1]);
  };
  const int64_t m = x.size(0), n = x.size(1);
  const char* mean = static_cast<const char*>(stats.data_ptr());
  const char* rstd = rms ? mean : mean + 4 * stats.stride(0);
  if (!settings().enabled || !is_packed(x) || !aligned16(scale.data_ptr()) || !aligned16(mean) || !aligned16(rstd) ||
      !fits_int32(m)) {
    return python();
  }
  RecipeRef recipe =
      recipe_for(Kind::TokenBackward, x, {rms, one_plus_scale, dtype_code(scale), modulation_stride(scale)}, {});
  if (recipe->mode != Mode::Kernel) return python();
  const KernelLaunch& k = recipe->kernel;
  const Tensor dy = packed(dy_in.reshape({m, n}));
  Tensor dx = at::empty_like(x);
  Tensor dscale = at::empty({m, n}, x.options().dtype(scale.scalar_type()));
  // x, dy, scale, mean, rstd, dx, dscale; rows (every gradient is per row: nothing to sum)
  launch_kernel(k, k.programs,
                {x.data_ptr(), dy.data_ptr(), scale.data_ptr(), mean, rstd, dx.data_ptr(), dscale.data_ptr()},
                {static_cast<int32_t>(m)});
  return {dx, dscale};
}

std::tuple<Tensor, Tensor, Tensor> ada_rms_backward(const Tensor& dy_in, const Tensor& x, const Tensor& scale,
                                                    const Tensor& rstd, bool one_plus_scale,
                                                    std::optional<at::ScalarType> shift_dtype) {
  c10::cuda::CUDAGuard guard(x.device());
  auto python = [&] {
    const double shift_code = shift_dtype ? double(static_cast<int64_t>(*shift_dtype)) : -1.0;
    auto out = kernel_py("ada_rms_bwd", {dy_in, x, scale, rstd}, {double(one_plus_scale), shift_code});
    return std::make_tuple(out[0], out[1], shift_dtype ? out[2] : Tensor());
  };
  const int64_t b = scale.size(0), m = x.size(0), n = x.size(1);
  const int64_t scale_stride = b > 1 ? scale.stride(0) : 16;  // one row: its stride is never read
  // compiled for 16-byte aligned pointers and a scale row stride divisible by 16 (_ada_kernel.native_launch)
  if (!settings().enabled || !is_packed(x) || !aligned16(scale.data_ptr()) || !aligned16(rstd.data_ptr()) ||
      scale_stride % 16 != 0 || !fits_int32(m)) {
    return python();
  }
  RecipeRef recipe = recipe_for(Kind::AdaRmsBackward, x, {b, dtype_code(scale), one_plus_scale}, {});
  if (recipe->mode != Mode::Kernel) return python();
  const KernelLaunch& k = recipe->kernel;
  const Tensor dy = packed(dy_in.reshape({m, n}));
  Tensor dx = at::empty_like(x);
  Tensor partial = at::empty({2, b, k.chunks, n}, x.options().dtype(kF32));
  // x, dy, scale, stats (the rstd), dx, partial; seq, cols, x / scale / statistics row strides
  // (0: an RMSNorm has no mean row), chunks, batch
  launch_kernel(k, b * k.chunks, {x.data_ptr(), dy.data_ptr(), scale.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                                  partial.data_ptr()},
                {static_cast<int32_t>(m / b), static_cast<int32_t>(n), static_cast<int32_t>(x.stride(0)),
                 static_cast<int32_t>(scale_stride), 0, static_cast<int32_t>(k.chunks), static_cast<int32_t>(b)});
  // the per-sample sums over chunks in a fixed order (deterministic), rounded once
  Tensor sums = k.chunks == 1 ? partial.select(2, 0) : partial.sum(2);
  return {dx, sums[0].to(scale.scalar_type()), shift_dtype ? sums[1].to(*shift_dtype) : Tensor()};
}

}  // namespace cudnorm

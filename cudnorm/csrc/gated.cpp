// A gated residual into an adaptive LayerNorm (cudnorm._gated): its backward, cudnorm's fused
// kernel launched by handle. Per row of h = residual + gate * branch it writes the residual's
// and the branch's gradients; per sample, partial sums of dscale, dshift and dgate that one
// fixed-order sum finishes (deterministic). The forward is an addcmul and ada_forward (ada.cpp),
// the autograd node autograd.cpp's.
#include "native.h"

#include <c10/cuda/CUDAGuard.h>

#include <limits>

namespace cudnorm {

namespace {

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// a [B, D] modulation's row stride as the compiled kernel reads it (compiled for any multiple
// of 16: cudnorm._ada_kernel.gated_native_launch); one row: never read
int64_t sample_stride(const Tensor& t) { return t.size(0) > 1 ? t.stride(0) : 16; }

}  // namespace

std::tuple<Tensor, Tensor, Tensor> gated_backward(const Tensor& dy_in, const OptTensor& dh_in, const Tensor& h,
                                                  const Tensor& branch_in, const Tensor& gate, const Tensor& scale,
                                                  const Tensor& stats, bool one_plus_scale) {
  c10::cuda::CUDAGuard guard(h.device());
  auto python = [&] {
    auto out = kernel_py("gated_bwd", {dy_in, dh_in, h, branch_in, gate, scale, stats}, {double(one_plus_scale)});
    return std::make_tuple(out[0], out[1], out[2]);
  };
  const int64_t b = gate.size(0), rows = h.numel() / h.size(-1), d = h.size(-1);
  const bool has_dh = dh_in.has_value() && dh_in->defined();
  if (!settings().enabled || !is_packed(h) || !aligned16(gate) || !aligned16(scale) || !aligned16(stats) ||
      gate.stride(1) != 1 || scale.stride(1) != 1 || sample_stride(gate) % 16 != 0 ||
      sample_stride(scale) % 16 != 0 || stats.stride(0) != (rows + 3) / 4 * 4 ||
      rows * d >= std::numeric_limits<int32_t>::max()) {
    return python();
  }
  const Tensor h2 = h.view({rows, d});
  RecipeRef recipe = recipe_for(Kind::GatedBackward, h2, {b, has_dh, one_plus_scale, dtype_code(scale)}, {});
  if (recipe->mode != Mode::Kernel) return python();
  const KernelLaunch& k = recipe->kernel;
  const Tensor dy = packed(dy_in.reshape({rows, d})), branch = packed(branch_in.reshape({rows, d}));
  const Tensor dh = has_dh ? packed(dh_in->reshape({rows, d})) : h2;  // absent: h stands in, unread
  Tensor dres = at::empty({rows, d}, h.options()), dbranch = at::empty({rows, d}, h.options());
  Tensor partial = at::empty({3, b, k.chunks, d}, h.options().dtype(at::kFloat));
  // h, dy, dh, branch, gate, scale, stats, dres, dbranch, partial; seq, cols, the gate's, the
  // scale's and the statistics' row strides, chunks, batch
  launch_kernel(k, b * k.chunks,
                {h2.data_ptr(), dy.data_ptr(), dh.data_ptr(), branch.data_ptr(), gate.data_ptr(), scale.data_ptr(),
                 stats.data_ptr(), dres.data_ptr(), dbranch.data_ptr(), partial.data_ptr()},
                {static_cast<int32_t>(rows / b), static_cast<int32_t>(d), static_cast<int32_t>(sample_stride(gate)),
                 static_cast<int32_t>(sample_stride(scale)), static_cast<int32_t>(stats.stride(0)),
                 static_cast<int32_t>(k.chunks), static_cast<int32_t>(b)});
  return {dres, dbranch, k.chunks == 1 ? partial.select(2, 0) : partial.sum(2)};
}

}  // namespace cudnorm

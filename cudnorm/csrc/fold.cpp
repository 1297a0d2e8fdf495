// The affine fold of a modulated LayerNorm (diffusers' CogVideoXLayerNormZero and its kin: an
// affine LayerNorm, then a per-sample modulation):
//   (x_hat * w + b) * g + t == x_hat * (w * g) + (b * g + t),   g = 1 + scale (or scale)
// so the pair is one ada_layer_norm call with the folded gain and shift. PyTorch's formula for
// the fold records about ten ops and as many backward nodes per call (0.2-0.3 ms of host time,
// which a host-bound step pays: CogVideoX trained at 0.81x); here it is one autograd node
// whose forward and backward run a few ATen kernels on [B, D] elements.
#include "native.h"

#include <ATen/ExpandUtils.h>
#include <torch/csrc/autograd/custom_function.h>

namespace cudnorm {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const auto kF32 = at::kFloat;

// `t` in `dtype`, always a new tensor: a custom function must not return its input as is
Tensor fresh(const Tensor& t, at::ScalarType dtype) { return t.to(dtype, false, /*copy=*/true); }

struct AffineFold : torch::autograd::Function<AffineFold> {
  // scale, shift: [B, 1.., D] (per sample) or [D] (shared), one shape; weight, bias: [D] or
  // undefined. Computed in fp32, each result rounded once to `dtype`.
  // (an absent weight or bias is an empty optional: Function::apply takes no undefined tensor)
  static variable_list forward(AutogradContext* ctx, const Tensor& scale, const Tensor& shift, const OptTensor& w,
                               const OptTensor& b, bool one_plus_scale, int64_t dtype_code) {
    const auto dtype = static_cast<at::ScalarType>(dtype_code);
    const Tensor weight = w.value_or(Tensor()), bias = b.value_or(Tensor());
    // 1 + scale in one kernel: fp32 ones promote the sum to fp32
    const Tensor g = one_plus_scale ? at::add(scale, constant(1.0, scale.size(-1), kF32, scale.device()))
                                    : scale.to(kF32);
    Tensor gain = weight.defined() ? at::mul(g, weight).to(dtype) : fresh(g, dtype);
    Tensor folded = bias.defined() ? at::addcmul(shift, bias, g).to(dtype) : fresh(shift, dtype);
    ctx->save_for_backward({g, weight, bias});
    ctx->saved_data["scale"] = static_cast<int64_t>(scale.scalar_type());
    ctx->saved_data["shift"] = static_cast<int64_t>(shift.scalar_type());
    return {gain, folded};
  }

  // d gain / d scale = w, d shift' / d scale = b, d shift' / d shift = 1; the parameters'
  // gradients sum over the samples
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &g = saved[0], &weight = saved[1], &bias = saved[2];
    const Tensor dgain = grads[0].defined() ? grads[0].to(kF32) : Tensor();
    const Tensor dfolded = grads[1].defined() ? grads[1].to(kF32) : Tensor();
    Tensor dscale, dshift, dweight, dbias;
    if (dgain.defined()) {
      dscale = weight.defined() ? at::mul(dgain, weight) : dgain;
      if (weight.defined()) dweight = at::sum_to(at::mul(dgain, g), weight.sizes()).to(weight.scalar_type());
    }
    if (dfolded.defined()) {
      if (bias.defined()) {
        dscale = dscale.defined() ? at::addcmul(dscale, dfolded, bias) : at::mul(dfolded, bias);
        dbias = at::sum_to(at::mul(dfolded, g), bias.sizes()).to(bias.scalar_type());
      }
      dshift = dfolded.to(static_cast<at::ScalarType>(ctx->saved_data["shift"].toInt()));
    }
    if (dscale.defined()) {
      dscale = at::sum_to(dscale, g.sizes()).to(static_cast<at::ScalarType>(ctx->saved_data["scale"].toInt()));
    }
    return {dscale, dshift, dweight, dbias, Tensor(), Tensor()};
  }
};

}  // namespace

std::tuple<Tensor, Tensor> affine_fold(const Tensor& scale, const Tensor& shift, const OptTensor& weight,
                                       const OptTensor& bias, bool one_plus_scale, at::ScalarType dtype) {
  auto out = AffineFold::apply(scale, shift, weight, bias, one_plus_scale, static_cast<int64_t>(dtype));
  return {out[0], out[1]};
}

}  // namespace cudnorm

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

// `t` in `dtype`; `copy`: a new tensor even where it has that dtype (a custom function must not
// return an input as it is)
Tensor as(const Tensor& t, at::ScalarType dtype, bool copy = false) { return t.to(dtype, false, copy); }

// `t` summed over the dims it broadcasts over, down to `shape`: a reshape where nothing is summed
// (one sample: the [1, 1, D] gradient of a [D] parameter)
Tensor summed_to(const Tensor& t, c10::IntArrayRef shape) {
  if (t.numel() == c10::multiply_integers(shape)) return t.reshape(shape);
  return at::sum_to(t, shape);
}

// Each product is one multiply-add kernel (addcmul: computed in fp32, rounded once): w * (1 + s)
// is w + w * s, and b * (1 + s) + t is (t + b) + b * s. Kernel launches are the cost that
// matters here ([B, D] elements; a host-bound step pays each launch), so the forward takes 2-3
// and the backward 3-4, where the fp32 formula takes 6 and 12.
struct AffineFold : torch::autograd::Function<AffineFold> {
  // scale, shift: [B, 1.., D] (per sample) or [D] (shared), one shape; w, b: [D] or absent (an
  // absent one is an empty optional: Function::apply takes no undefined tensor)
  static variable_list forward(AutogradContext* ctx, const Tensor& scale, const Tensor& shift, const OptTensor& w,
                               const OptTensor& b, bool one_plus_scale, int64_t dtype_code) {
    const auto dtype = static_cast<at::ScalarType>(dtype_code);
    const Tensor weight = w.value_or(Tensor()), bias = b.value_or(Tensor());
    Tensor gain;
    if (!weight.defined()) {
      gain = one_plus_scale ? as(at::add(scale, 1.0), dtype) : as(scale, dtype, true);
    } else {
      gain = as(one_plus_scale ? at::addcmul(weight, weight, scale) : at::mul(weight, scale), dtype);
    }
    Tensor folded;
    if (!bias.defined()) {
      folded = as(shift, dtype, true);
    } else {
      folded = as(one_plus_scale ? at::addcmul(at::add(shift, bias), bias, scale) : at::addcmul(shift, bias, scale),
                  dtype);
    }
    ctx->save_for_backward({scale, weight, bias});
    ctx->saved_data["dit"] = one_plus_scale;
    ctx->saved_data["shift"] = static_cast<int64_t>(shift.scalar_type());
    return {gain, folded};
  }

  // d gain / d scale = w, d folded / d scale = b, d folded / d shift = 1; d gain / d w =
  // 1 + s and d folded / d b = 1 + s, summed over the samples
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &scale = saved[0], &weight = saved[1], &bias = saved[2];
    const bool dit = ctx->saved_data["dit"].toBool();
    const Tensor &dgain = grads[0], &dfolded = grads[1];
    // g * (1 + s) (or g * s) as one kernel, summed to the parameter's shape, in its dtype (an
    // fp32 parameter's gradient computed in fp32)
    auto param_grad = [&](const Tensor& g_in, const Tensor& param) {
      const Tensor g = as(g_in, at::promote_types(g_in.scalar_type(), param.scalar_type()));
      return as(summed_to(dit ? at::addcmul(g, g, scale) : at::mul(g, scale), param.sizes()), param.scalar_type());
    };
    Tensor dscale, dshift, dweight, dbias;
    if (dgain.defined()) {
      dscale = weight.defined() ? at::mul(dgain, weight) : dgain;
      if (weight.defined()) dweight = param_grad(dgain, weight);
    }
    if (dfolded.defined()) {
      if (bias.defined()) {
        dscale = dscale.defined() ? at::addcmul(dscale, dfolded, bias) : at::mul(dfolded, bias);
        dbias = param_grad(dfolded, bias);
      }
      dshift = as(dfolded, static_cast<at::ScalarType>(ctx->saved_data["shift"].toInt()));
    }
    if (dscale.defined()) dscale = as(summed_to(dscale, scale.sizes()), scale.scalar_type());
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

// The step's scalars from the global sum of squares, in one launch: dsfunc_cuda::step_scalars.
//
// One thread computes what the reference (dsfunc/kernels/step_scalars.py) computes with nine torch CUDA ops, in
// the same order and with the same IEEE rounding (no fused multiply-add, true division; a division by the
// Python float max_norm is torch's multiplication by its float reciprocal): whether the step is
// finite, the skip flag, the unscaled global norm, the factor that unscales and clips the gradients, and the
// skip flag as int32 for the metrics. On a small model each launch is a visible share of the step.
#include "common.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <tuple>

namespace dsfunc {
namespace {

__global__ void step_scalars_kernel(const float* __restrict__ sumsq, const float* __restrict__ loss_scale,
                                    float max_norm, bool unscaled, bool* __restrict__ finite,
                                    bool* __restrict__ skip, float* __restrict__ grad_norm,
                                    float* __restrict__ grad_scale, int* __restrict__ skipped) {
  const float s = *sumsq, scale = *loss_scale;
  const bool ok = s < INFINITY;  // a sum of squares is >= 0, inf or nan
  const float root = __fsqrt_rn(s);
  const float norm = unscaled ? root : __fdiv_rn(root, scale);
  float divisor = scale;
  if (max_norm > 0.f) {
    const float ratio = __fmul_rn(__fadd_rn(norm, 1e-6f), __fdiv_rn(1.f, max_norm));
    const float clip = isnan(ratio) ? ratio : fmaxf(ratio, 1.f);  // clamp(min=1) keeps a NaN
    divisor = unscaled ? clip : __fmul_rn(scale, clip);
  }
  *finite = ok;
  *skip = !ok;
  *grad_norm = norm;
  *grad_scale = __fdiv_rn(1.f, divisor);
  *skipped = ok ? 0 : 1;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> step_scalars_cuda(
    const at::Tensor& sumsq, const at::Tensor& loss_scale, double max_norm, bool unscaled) {
  const c10::cuda::CUDAGuard guard(sumsq.device());
  const auto flag = sumsq.options().dtype(at::kBool);
  const auto value = sumsq.options().dtype(at::kFloat);
  at::Tensor finite = at::empty({}, flag), skip = at::empty({}, flag);
  at::Tensor grad_norm = at::empty({}, value), grad_scale = at::empty({}, value);
  at::Tensor skipped = at::empty({}, sumsq.options().dtype(at::kInt));
  step_scalars_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      sumsq.data_ptr<float>(), loss_scale.data_ptr<float>(), static_cast<float>(max_norm), unscaled,
      finite.data_ptr<bool>(), skip.data_ptr<bool>(), grad_norm.data_ptr<float>(), grad_scale.data_ptr<float>(),
      skipped.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {finite, skip, grad_norm, grad_scale, skipped};
}

}  // namespace dsfunc

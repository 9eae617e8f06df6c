// Registers the CUDA kernels of ops/ as torch ops in the private namespace dsfunc_cuda.
// dsfunc/kernels.py defines the public ops (dsfunc::*) and forwards to these on CUDA tensors.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace dsfunc {
void adam_steps_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList lowps, const at::Tensor& grad_scale,
                     const at::Tensor& lr, const at::Tensor& step, const at::Tensor& skip, double beta1,
                     double beta2, double eps, double weight_decay, bool adam_w_mode, bool bias_correction);
at::Tensor sum_of_squares_cuda(at::TensorList tensors);
at::Tensor cross_entropy_rows_cuda(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& scale,
                                   int64_t ignore_index, bool write_grad);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> step_scalars_cuda(
    const at::Tensor& sumsq, const at::Tensor& loss_scale, double max_norm, bool unscaled);
}  // namespace dsfunc

TORCH_LIBRARY(dsfunc_cuda, m) {
  m.def(
      "adam_steps_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] lowps, Tensor grad_scale, Tensor lr, Tensor step, Tensor skip, float beta1, "
      "float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction) -> ()");
  m.def("sum_of_squares(Tensor[] tensors) -> Tensor");
  m.def("cross_entropy_rows_(Tensor(a!) logits, Tensor target, Tensor scale, int ignore_index, bool write_grad) -> Tensor");
  m.def("step_scalars(Tensor sumsq, Tensor loss_scale, float max_norm, bool unscaled) -> "
        "(Tensor finite, Tensor skip, Tensor grad_norm, Tensor grad_scale, Tensor skipped)");
}

TORCH_LIBRARY_IMPL(dsfunc_cuda, CUDA, m) {
  m.impl("adam_steps_", &dsfunc::adam_steps_cuda);
  m.impl("sum_of_squares", &dsfunc::sum_of_squares_cuda);
  m.impl("cross_entropy_rows_", &dsfunc::cross_entropy_rows_cuda);
  m.impl("step_scalars", &dsfunc::step_scalars_cuda);
}
